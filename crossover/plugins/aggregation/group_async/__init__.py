"""Group-level asynchronous training: synchronous inside groups, asynchronous between them, bounded staleness.

Pure decision logic (:mod:`.clock`, :mod:`.grouping`, :mod:`.schedule`,
:mod:`.codec`) is separate from the I/O that uses it: the parameter service
(:mod:`.service`, with its wire format in :mod:`.wire`), a group leader's link
to it (:mod:`.link`), the optimizer that averages inside a group and
exchanges between groups (:mod:`.optimizer`) and the sampler whose epoch
boundaries regroup and rebalance (:mod:`.sampler`). docs/aggregation.md
explains the scheme, its settings, guarantees and costs.
"""
