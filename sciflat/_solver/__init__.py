"""The compiled loops on a flat `p`: MINPACK's Levenberg–Marquardt, self-scaled
quasi-Newton and its strong-Wolfe line search. Imports the core and `_fitting`."""
