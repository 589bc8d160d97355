"""GPU memory by class: what each job on a device may hold, so that no neighbour runs a higher job out of it.

The operator reserves part of each device's memory for a class
(`crossoverd --reserve high=50%`). A reservation is *active* on a device while
a job of that class is registered there; a job leaving frees it. The rules:

* **Only below.** A reservation guards its class against the classes below it,
  never against its own or those above. Jobs of the highest class with an active
  reservation, and every class above it, are not capped.
* **Held from the top.** Active reservations are held from the highest class
  down, each at most what the ones above it left, so byte sizes never promise
  more than the device has.
* **The rest is shared, layer by layer.** Every job of a lower class is capped.
  The capped jobs share what the uncapped classes' reservations leave: at each
  capped class, from the top, what is not that class's own reservation is split
  equally among its jobs and every capped job below it, and the class's jobs add
  their reservation as far as the layer has room. So the caps of the jobs below
  any reservation never add up to more than the device less that reservation
  and every one above it, and a lower class's reservation takes nothing from a
  higher class.
* **Nothing changes** for a job alone on its device, or where no reservation is
  active: it gets no cap.

A cap is the job's whole footprint on the device as NVML counts it (its CUDA
context, NCCL's buffers and its allocator's pool); the rank measures what lies
outside its allocator and applies the rest to it. A reservation covers the whole
footprint of its class's jobs likewise. The device's total is what the driver
does not keep for itself.

Pure: no I/O; the scheduler feeds it each device's jobs and total.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from crossover.daemon.policies.classes import Priority
from crossover.figures import format_bytes, parse_size

__all__ = ["MemoryCap", "MemoryRules", "Reservation", "caps", "parse_reservation"]

@dataclass(frozen=True)
class Reservation:
    """Memory held on each device for the jobs of `priority`: a `fraction` of the device, or `amount` bytes."""

    priority: Priority
    fraction: float = 0.0
    amount: int = 0

    def on(self, total: int) -> int:
        """The bytes it holds on a device of `total` bytes."""
        return min(total, int(self.fraction * total) if self.fraction else self.amount)

    def __str__(self) -> str:
        size = f"{100 * self.fraction:g}%" if self.fraction else format_bytes(self.amount)
        return f"{self.priority}={size}"


def parse_reservation(text: str) -> Reservation:
    """`high=50%`, `normal=20GiB`; ValueError says what is wrong."""
    klass, sep, size = text.partition("=")
    if not sep:
        raise ValueError(f"reservation {text!r}: write CLASS=SIZE, e.g. high=50% or high=40GiB")
    try:
        priority = Priority.parse(klass)
        fraction, amount = parse_size(size)
    except ValueError as exc:
        raise ValueError(f"reservation {text!r}: {exc}") from None
    return Reservation(priority, fraction, amount)


@dataclass(frozen=True)
class MemoryRules:
    """The node's reservations, at most one per class."""

    reservations: tuple[Reservation, ...] = ()

    def __post_init__(self) -> None:
        classes = [r.priority for r in self.reservations]
        if len(set(classes)) != len(classes):
            raise ValueError("a class is reserved twice; give each class one --reserve")
        if sum(r.fraction for r in self.reservations) > 1.0:
            raise ValueError("the reservations add up to more than 100% of a device")

    @classmethod
    def parse(cls, texts: tuple[str, ...] | list[str]) -> MemoryRules:
        return cls(tuple(parse_reservation(t) for t in texts))

    def of(self, priority: Priority) -> Reservation | None:
        return next((r for r in self.reservations if r.priority == priority), None)

    def __str__(self) -> str:
        return ", ".join(map(str, self.reservations)) or "none"


@dataclass(frozen=True)
class MemoryCap:
    """What a job may hold on one device: `limit` bytes of footprint (None: no cap; 0: nothing), and why, in
    words that finish the rank's out-of-memory line: the cap, the reservations behind it, the setting."""

    limit: int | None = None
    why: str = ""


def caps(total: int, jobs: Mapping[str, Priority], rules: MemoryRules) -> dict[str, MemoryCap]:
    """Each job's cap on a device of `total` bytes whose jobs are `jobs` (job → class); a job without a cap
    gets `MemoryCap()`.

    The active reservations are held from the highest class down, each at most what the ones above it left.
    The capped jobs share what the uncapped classes' reservations leave, layer by layer from the top: at each
    capped class, what is not that class's own reservation is split equally among its jobs and every capped
    job below (the lower ones take their part at the next layer), and the class's jobs add their reservation
    as far as the layer has room. So a reservation takes only from the classes below its own."""
    uncapped = {job: MemoryCap() for job in jobs}
    if total <= 0 or not rules.reservations:
        return uncapped
    present = set(jobs.values())
    held: dict[Priority, int] = {}
    left = total
    for r in sorted((r for r in rules.reservations if r.priority in present), key=lambda r: -r.priority):
        held[r.priority] = min(r.on(total), left)
        left -= held[r.priority]
    if not held:
        return uncapped
    top = max(held)
    capped_classes = sorted({p for p in present if p < top}, reverse=True)
    if not capped_classes:
        return uncapped
    pool = total - sum(b for p, b in held.items() if p >= top)
    members = {p: [job for job, q in jobs.items() if q == p] for p in capped_classes}
    reasons = ", ".join(f"{p} reserves {format_bytes(b)}" for p, b in sorted(held.items(), reverse=True))
    n_capped = sum(len(m) for m in members.values())
    shared = f"split among {n_capped} capped jobs" if n_capped > 1 else "left to it"
    out = dict(uncapped)
    below = n_capped
    for p in capped_classes:
        own = held.get(p, 0)
        equal = max(0, pool - own) // below
        limit = min(pool, equal * len(members[p]) + own) // len(members[p])
        for job in members[p]:
            out[job] = MemoryCap(limit, f"{format_bytes(limit)} of {format_bytes(total)}, as {reasons} and the "
                                        f"rest is {shared} (the operator's crossoverd --reserve; a higher class "
                                        "or a smaller batch fits it)")
        pool -= limit * len(members[p])
        below -= len(members[p])
    return out
