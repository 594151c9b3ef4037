"""What every fit shares: the problem it takes in, the start, the compile cache, the
result, its uncertainty and report. Imports the core only: never a backend."""
