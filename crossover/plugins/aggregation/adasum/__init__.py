"""Adasum (Maleki et al., MLSys 2021) of the optimizer *deltas*, as Horovod does it.

Each rank applies the wrapped optimizer locally (learning rate, momentum,
weight decay), the deltas ``p_after - p_before`` are combined per tensor with
the Adasum tree, and every rank sets ``p = p_before + combined delta``. Two
implementations, chosen by :func:`~.decision.adasum_path`:

* **native** — ``op=hvd.Adasum``: Horovod's C++ kernel (vector halving,
  distance doubling; about 2× the model bytes sent per rank, overlapped
  with the backward pass because each tensor is reduced as soon as its
  gradient is ready). Only under the MPI controller, on the global
  process set and with a power-of-two number of ranks (on GPUs with
  NCCL: a power-of-two number of nodes).
* **plugin** — :class:`~.optimizer.AdasumOptimizer`: :mod:`.algorithms`
  over Horovod collectives (:class:`~.collectives.HorovodCollectives`), so
  it runs under Gloo, inside a process set and with any number of ranks.
  The reduction starts in ``step()`` (no overlap with backward) and is one
  fused call per dtype. Data moved per rank and step, for a model of ``M``
  bytes over ``n`` ranks: ``allgather`` receives ``(n-1)·M`` and holds ``n``
  copies, in one collective call; ``recursive_doubling`` sends and receives
  about ``⌈log2 n⌉·M`` (plus ``M`` twice for ranks folded into a power of
  two) in ``log2(p)+2`` ``alltoall`` rounds. ``auto`` picks ``allgather`` up
  to 8 ranks.

Modules: :mod:`.algorithms` (the math and both distributed algorithms, over
any :class:`~.algorithms.Collectives`), :mod:`.collectives`,
:mod:`.optimizer`, :mod:`.decision` (native or plugin, which algorithm).
"""
