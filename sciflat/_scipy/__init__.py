"""`scipy.optimize` on `p`: `minimize`, `least_squares`, the host loop and bounds."""
