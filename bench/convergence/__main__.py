"""`python -m bench.convergence`: see `cli`."""
from bench.convergence.cli import main

main()
