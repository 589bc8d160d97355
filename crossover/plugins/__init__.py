"""What `import crossover.auto` installs on Horovod: the optimizer hook chain, phase tracking, and the
aggregation rules (Adasum, LB-BSP weighting, group_async)."""
