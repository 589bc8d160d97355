"""What the fuzz tier sends: its budgets and the Hypothesis strategies of hostile input."""
from __future__ import annotations

import math
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from crossover.protos import PROTOCOL_VERSION
from crossover.protos import crossover_v1_pb2 as pb

EXAMPLES = int(os.environ.get("CROSSOVER_FUZZ_EXAMPLES", "250"))


BATCH = 50  # examples between health checks


MAX_ERROR_CHARS = 1000


HUGE = 100_000


POLICIES = ("exclusive", "crossover", "passthrough")


# Deliberate answers. UNKNOWN / INTERNAL: an exception nobody mapped; CANCELLED / DEADLINE_EXCEEDED: a hang.
ALLOWED = frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION", "OUT_OF_RANGE",
                     "UNAUTHENTICATED", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED"})


FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


INT32 = st.one_of(st.sampled_from([0, 1, -1, -2, 2, 7, 1 << 20, (1 << 20) + 1, 2**31 - 1, -(2**31)]),
                  st.integers(-(2**31), 2**31 - 1))


INT64 = st.one_of(st.integers(-2, 20), st.sampled_from([2**31, 2**53, 2**53 + 1, 2**63 - 1, -(2**63)]),
                  st.integers(-(2**63), 2**63 - 1))


UINT64 = st.one_of(st.integers(0, 20), st.sampled_from([2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))


VERSION = st.one_of(st.just(PROTOCOL_VERSION), st.just(PROTOCOL_VERSION), st.sampled_from([0, 1, 3, 2**32 - 1]),
                  st.integers(0, 2**32 - 1))


SECONDS = st.one_of(st.just(0.0), st.floats(0.0, 0.01),
                    st.sampled_from([-0.0, -1.0, 86_400.0, 86_400.001, math.nan, math.inf, -math.inf, 5e-324, 1e308]),
                    st.floats())


# A long string is a character repeated: drawing 100,000 characters one by one would take seconds.
LONG = st.builds(lambda c, n: c * n, st.sampled_from(["x", "\u00e9", "\u4e2d", "\U0001f600", "\x00", "'"]),
                 st.sampled_from([129, 257, 2_000, 20_000, HUGE]))


STRINGS = st.one_of(st.just(""), st.text(max_size=40), LONG)


KINDS = st.one_of(st.sampled_from(sorted(pb.EventKind.values())), st.integers(-(2**31), 2**31 - 1))


VALID_KINDS = st.sampled_from([pb.COMPUTE_REQUEST, pb.COMPUTE_DONE, pb.COMM_BEGIN, pb.COMM_END, pb.HEARTBEAT,
                               pb.LEASE_RELEASED])


def _events(kinds: st.SearchStrategy[int], batch: st.SearchStrategy[list] = st.just([])) -> st.SearchStrategy:
    """RankEvents whose every field may be absurd (`kinds` decides how often the kind itself is)."""
    return st.builds(pb.RankEvent, kind=kinds, session_id=st.one_of(st.just(""), st.text(max_size=20)),
                     iteration=INT64, seq=UINT64, duration_s=SECONDS, comm_begins=st.booleans(),
                     no_wait=st.booleans(), requested=st.booleans(), comm_s=SECONDS, ago_s=SECONDS,
                     yields=st.booleans(), batch=batch)


PLAUSIBLE = _events(VALID_KINDS)


HOSTILE = _events(KINDS)


NESTED = _events(st.sampled_from([pb.BATCH, pb.OPEN, pb.HEARTBEAT]), st.lists(HOSTILE, max_size=3))


BATCH_EVENT = st.builds(lambda evs: pb.RankEvent(kind=pb.BATCH, batch=evs),
                        st.lists(st.one_of(PLAUSIBLE, HOSTILE, NESTED), max_size=6))


BIG_BATCH = st.builds(lambda ev, n: pb.RankEvent(kind=pb.BATCH, batch=[ev] * n), st.one_of(PLAUSIBLE, HOSTILE),
                      st.sampled_from([1_000, 3_000]))


EVENTS = st.one_of(PLAUSIBLE, PLAUSIBLE, HOSTILE, NESTED, BATCH_EVENT, BIG_BATCH)


# How a stream starts: OPEN with a fresh session (most often), someone else's open session, a forged,
# empty or huge id, or no OPEN at all.
OPENINGS = st.sampled_from(["valid", "valid", "valid", "duplicate", "unknown", "empty", "huge", "none"])


# Identities that are absurd throughout, and identities that are nearly right (so some register, and
# collide) with what the daemon does not check (node, pid, job_name up to its limit) left wild.
IDENTITIES = st.one_of(
    st.builds(pb.RankIdentity, job_id=STRINGS, job_name=STRINGS, rank=INT32, local_rank=INT32,
              world_size=INT32, local_size=INT32, node=STRINGS, device=INT32,
              pid=st.one_of(st.just(os.getpid()), INT32)),
    st.builds(lambda job, name, rank, world, node, device, pid: pb.RankIdentity(
        job_id=job, job_name=name, rank=rank, local_rank=rank, world_size=world, local_size=world, node=node,
        device=device, pid=pid),
        st.sampled_from(["j0", "j1", "j2"]), st.one_of(st.text(max_size=20), st.just("n" * 256)), st.integers(0, 3),
        st.integers(1, 4), STRINGS, st.integers(-1, 1), st.one_of(st.just(os.getpid()), st.integers(1, 2**31 - 1))),
)


REGISTERS = st.builds(lambda version, ident, leases: pb.RegisterRequest(
    protocol_version=version, identity=ident, accepts_leases=leases),
    VERSION, st.one_of(st.none(), IDENTITIES), st.booleans())


NAMES = st.one_of(st.sampled_from(POLICIES), STRINGS)


ADMIN_CALLS = st.one_of(
    st.tuples(st.sampled_from(["GetQueue", "Drain", "Resume"]), VERSION, INT32),
    st.tuples(st.sampled_from(["SetPolicy", "GetPolicy"]), VERSION, NAMES),
    st.tuples(st.just("ListJobs"), VERSION, st.none()),
)


FRAME_KINDS = st.sampled_from(["random_bytes", "oversized_header", "lying_header", "events", "events",
                               "truncated", "garbage_after", "empty"])
