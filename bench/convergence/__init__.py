"""The convergence benchmark: `python -m bench.convergence` (`cli`); the plan of its runs, the runs,
their judging and their plots."""
