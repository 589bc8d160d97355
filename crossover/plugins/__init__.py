"""What `import crossover.auto` installs on Horovod, in two rooms: `hook/`, the optimizer hook chain
and phase tracking; `aggregation/`, the rules that combine gradients (Adasum, LB-BSP weighting,
group_async). The settings both follow are `crossover.settings`."""
