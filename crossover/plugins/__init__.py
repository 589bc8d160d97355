"""What `import crossover.auto` installs on Horovod, in two rooms: `hook/`, the optimizer hook chain,
phase tracking and the plugin's settings; `aggregation/`, the rules that combine gradients (Adasum,
LB-BSP weighting, group_async)."""
