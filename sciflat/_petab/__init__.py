"""`petab_problem`: a PEtab problem (SBML model and tables) as an objective on `p`."""
