"""Crossover: time-share GPUs among co-located Horovod jobs.

Add `import crossover.auto` as the first line of a Horovod PyTorch script to
schedule it through the node's `crossoverd`; run `crossover queue` to watch.
"""
__version__ = "0.1.0"
__all__ = ["__version__"]
