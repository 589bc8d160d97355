"""The emulated-cluster benchmark: `python -m bench.emulated` (`cli`); its scenarios, the judge of a run
and its report."""
