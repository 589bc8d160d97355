"""A group leader's link to the parameter service (rank 0 keeps the service process: `service_process`).

Fail-open: when the service cannot be reached, :meth:`ServiceLink.exchange`
returns ``None`` (warned once per outage), the group keeps training
synchronously inside, and the next exchange tries to re-attach. What the
group learned meanwhile is not lost: the leader's base stays where the last
acknowledged exchange left it, so its next update carries every step since.

A leader on the service's node (same kernel, same network namespace) moves
models through shared memory: three buffers in ``/dev/shm`` that both map
(`shared_buffers`), used in turn as the base, the update and the answer, so an
exchange is one pass to write the update, the service's add, and one copy of
the global model, with nothing on the TCP stream but the headers. The files
are unlinked once the service has mapped them: nothing is left behind if
either process dies.
"""
from __future__ import annotations

import logging
import socket
import time
from typing import Any, Optional

import numpy as np
import torch

from crossover.errors import CrossoverError
from crossover.plugins.aggregation.group_async.codec import Codec, as_bytes, decode
from crossover.plugins.aggregation.group_async.flat_params import Model, flatten, parts
from crossover.plugins.aggregation.group_async.shared_buffers import SharedBuffers, shared_memory_usable
from crossover.plugins.aggregation.group_async.wire import Payload, WireError, node_identity, recv_frame, send_frame

__all__ = ["ServiceError", "ServiceLink"]

_log = logging.getLogger(__name__)

_SLOTS = 3  # in turn the base (the global model last received), the update pushed, and the service's answer


class ServiceError(CrossoverError, RuntimeError):
    """The service refused a call (its message says why): a misuse, not an outage, so it is raised."""


class ServiceLink:
    """One leader's connection: ``hello`` once, then ``exchange`` its updates for the global model."""

    def __init__(self, address: tuple[str, int], token: str, group: int, codec: Codec,
                 timeout_s: float = 150.0, shared_memory: bool = False) -> None:
        self.address = address
        self.token = token
        self.group = group
        self.codec = codec
        self.timeout_s = timeout_s
        self.shared_memory = shared_memory  # use shared memory when the service turns out to be on this node
        self.seq = 0
        self.base: Optional[torch.Tensor] = None
        # (seq, what the service adds for it); over shared memory (seq, None): the update is in its slot
        self.in_flight: Optional[tuple[int, Optional[torch.Tensor]]] = None
        self._slots: Optional[list[torch.Tensor]] = None  # the shared buffers, once the service mapped them
        self._base_slot = 0
        self.consumed: Optional[int] = None  # the last answer's count of samples all groups took from the epoch
        self.version = -1  # the global model's version, as the service's last answer gave it
        self.stage: Optional[str] = None  # the schedule's stage, as the service's last answer named it
        self.lost_since: Optional[float] = None
        self.outages = 0
        self.gaps: list[int] = []
        self.exchange_s: list[float] = []
        self.cost_s = 0.0  # what the last exchange cost, the service's wait for the bound left out (0: none yet)
        self._fresh = True  # no exchange yet on this connection
        self.answer_bytes: list[int] = []  # what each answer carried over TCP
        self._held: Optional[torch.Tensor] = None  # the model as this connection's answers built it
        self._sock: Optional[socket.socket] = None
        # Over TCP, the buffers an update is written to and answers land in, kept from one exchange to the
        # next (a model's worth of fresh memory costs more in page faults than the bytes it receives).
        self._outbox: Optional[torch.Tensor] = None
        self._wide: Optional[torch.Tensor] = None  # an fp16 answer, widened before it is added
        self._inboxes: list[np.ndarray] = []

    # ---- connection ----------------------------------------------------

    def _receive_into(self, n: int) -> memoryview:
        """A kept buffer for an answer of `n` bytes: one that neither the base nor the held model is a view
        of, since an answer lands before either moves on."""
        busy = {t.data_ptr() for t in (self.base, self._held) if t is not None}
        for i, buf in enumerate(self._inboxes):
            if buf.ctypes.data not in busy:
                if buf.size < n:
                    buf = self._inboxes[i] = np.empty(n, dtype=np.uint8)
                return buf.data[:n]
        buf = np.empty(n, dtype=np.uint8)
        self._inboxes.append(buf)
        return buf.data

    def _call(self, header: dict[str, Any], payload: bytes | memoryview = b"") -> tuple[dict[str, Any], Payload]:
        if self._sock is None:
            sock = socket.create_connection(self.address, timeout=5.0)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout_s)
            send_frame(sock, {"op": "auth", "token": self.token})
            reply, _ = recv_frame(sock)
            if "error" in reply:
                sock.close()
                raise ServiceError(reply["error"])
            self._sock = sock
        send_frame(self._sock, header, payload)
        reply, body = recv_frame(self._sock, self._receive_into)
        if "error" in reply:
            raise ServiceError(reply["error"])
        return reply, body

    @property
    def _update_slot(self) -> int:
        return (self._base_slot + 1) % _SLOTS

    @property
    def _answer_slot(self) -> int:
        return (self._base_slot + 2) % _SLOTS

    @property
    def local(self) -> bool:
        """Whether models move through shared memory (the service is on this node and mapped them)."""
        return self._slots is not None

    def _drop(self, exc: BaseException) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        if self.lost_since is None:
            self.lost_since = time.monotonic()
            self.outages += 1
            _log.warning("group %d: the parameter service at %s:%d is unreachable (%s); training on inside the "
                         "group and re-attaching at each exchange", self.group, *self.address, exc)

    def _attach(self, flat: torch.Tensor) -> None:
        """``hello``; the first leader ever seeds the service's model with its own parameters."""
        reply, _ = self._call({"op": "hello", "group": self.group, "numel": flat.numel()},
                              as_bytes(flat.detach().to("cpu", torch.float32).reshape(-1)))
        self.version = int(reply["version"])
        base = self.base
        if self.in_flight is not None and reply["last_seq"] >= self.in_flight[0] and base is not None:
            # the service applied it before the answer was lost
            applied = self.in_flight[1]
            if applied is None and self._slots is not None:
                applied = self._slots[self._update_slot]
            if applied is not None:
                base = base + applied
            self.seq = self.in_flight[0] + 1
        else:
            self.seq = max(self.seq, reply["last_seq"] + 1)
        self.in_flight = None
        self._fresh = True
        if base is not None:
            self.base = base.clone() if self._slots is not None else base  # the old slots go with the connection
        self._slots = None
        self._held = None  # a new connection's first answer is the whole model
        if self.shared_memory and self.base is not None and reply.get("node") and reply["node"] == node_identity() \
                and shared_memory_usable():
            self._map_slots(self.base)
        if self.lost_since is not None:
            _log.warning("group %d: re-attached to the parameter service after %.1fs (version %d)", self.group,
                         time.monotonic() - self.lost_since, reply["version"])
            self.lost_since = None

    def _map_slots(self, base: torch.Tensor) -> None:
        """Offer the service three shared buffers; keep them if it maps them (else stay on TCP)."""
        try:
            made = SharedBuffers(base.numel(), _SLOTS, prefix="crossover-slot-")
        except OSError as exc:
            _log.info("group %d: no shared memory for exchanges (%s); using TCP", self.group, exc)
            return
        try:
            self._call({"op": "slots", "group": self.group, "numel": base.numel(), "slots": made.describe()})
        except ServiceError as exc:
            _log.info("group %d: the service could not map shared memory (%s); using TCP", self.group, exc)
            return
        finally:
            made.unlink()
        slots = [torch.from_numpy(a) for a in made.arrays]
        slots[0].copy_(base)
        self._slots, self._base_slot = slots, 0
        self.base = slots[0]
        _log.info("group %d: exchanging with the parameter service through shared memory", self.group)

    def start(self, flat: torch.Tensor) -> None:
        """Attach at the start of training; the base is the model every rank starts from."""
        self.base = flat.detach().to("cpu", torch.float32).reshape(-1).clone()
        try:
            self._attach(flat)
        except (OSError, WireError) as exc:
            self._drop(exc)

    def rebase(self, model: torch.Tensor) -> None:
        """The group now holds ``model`` (a full mix): later updates count from it."""
        if self._slots is not None:
            self._slots[self._base_slot].copy_(model)
            self.base = self._slots[self._base_slot]
        else:
            self.base = model.clone()

    def _update(self, model: Model, scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``scale * (model - base)`` as one flat float32 tensor (into ``out`` when given), one pass
        over each parameter, no flat copy of the model first."""
        assert self.base is not None
        if out is None:
            out = torch.empty(self.base.numel(), dtype=torch.float32)
        offset = 0
        with torch.no_grad():
            for p in parts(model):
                src = p.detach().reshape(-1)
                if src.dtype != torch.float32 or src.device.type != "cpu":
                    src = src.to("cpu", torch.float32)
                n = src.numel()
                piece = out[offset:offset + n]
                torch.sub(src, self.base[offset:offset + n], out=piece)
                if scale != 1.0:
                    piece.mul_(scale)
                offset += n
        if offset != self.base.numel():
            raise ValueError(f"the model has {offset} parameters, the base {self.base.numel()}")
        return out

    # ---- operations ----------------------------------------------------

    def exchange(self, model: Model, wait: bool = True, scale: float = 1.0, epoch: int = -1,
                 taken: int = 0, ticks: int = 1) -> Optional[torch.Tensor]:
        """Push ``scale * (model - base)``, return the global model (and make it the base); ``None`` if
        unreachable. ``taken``: the samples the group has taken from ``epoch`` so far (see :meth:`progress`);
        ``ticks``: the exchange periods it worked since its last exchange (the service's clock counts them).
        The tensor returned is read-only to the caller and valid until the next call."""
        assert self.base is not None, "start() first"
        started = time.perf_counter()
        self.consumed = None
        header = {"op": "exchange", "group": self.group, "seq": self.seq, "codec": self.codec.kind,
                  "numel": self.base.numel(), "wait": wait, "epoch": epoch, "taken": taken, "ticks": ticks,
                  "cost_s": self.cost_s}
        try:
            if self._sock is None:
                self._attach(flatten(model))
                header["seq"] = self.seq
            if self._slots is not None:
                update_slot, answer_slot = self._update_slot, self._answer_slot
                self._update(model, scale, out=self._slots[update_slot])
                self.in_flight = (self.seq, None)
                reply, body = self._call({**header, "codec": "fp32", "slot": update_slot, "answer": answer_slot})
            else:
                if self._outbox is None or self._outbox.numel() != self.base.numel():
                    self._outbox = torch.empty(self.base.numel(), dtype=torch.float32)
                update = self._update(model, scale, out=self._outbox)
                payload = self.codec.encode(update)
                self.in_flight = (self.seq, self.codec.sent(update, payload))
                reply, body = self._call({**header, "fraction": self.codec.fraction}, payload)
        except (OSError, WireError) as exc:
            self.codec.settle(answered=False)
            self._drop(exc)
            return None
        self.codec.settle(answered=True)
        self.in_flight = None
        if reply.get("duplicate"):  # hello() settles a lost answer, so this is a bug, not an outage
            _log.error("group %d: the service had already applied exchange %d; skipping it", self.group, self.seq)
            self.seq += 1
            return None
        self.seq += 1
        self.consumed = reply.get("consumed")
        self.version = int(reply.get("version", self.version))
        self.stage = reply.get("stage", self.stage)
        if wait:
            self.gaps.append(int(reply["gap"]))
        if self._slots is not None:
            self._base_slot = answer_slot
            self.base = self._slots[answer_slot]
        elif reply.get("answer", "full") == "full":
            self.base = torch.from_numpy(np.frombuffer(body, dtype=np.float32))  # our inbox until an answer after it
        else:  # how the global model differs from the model this group last received, added where it is held
            held = self._held if self._held is not None else self.base
            kind = str(reply["answer"])
            if kind == "fp16" and (self._wide is None or self._wide.numel() != held.numel()):
                self._wide = torch.empty(held.numel(), dtype=torch.float32)
            wide = self._wide.numpy() if kind == "fp16" and self._wide is not None else None
            difference = decode(kind, body, held.numel(), out=wide)
            self.base = held.add_(torch.from_numpy(difference))
        self._held = self.base
        self.answer_bytes.append(len(body))
        self.exchange_s.append(time.perf_counter() - started)
        # a connection's first exchange also attached and touched fresh pages: it does not price the others
        self.cost_s = 0.0 if self._fresh else max(0.0, self.exchange_s[-1] - float(reply.get("waited_s", 0.0)))
        self._fresh = False
        return self.base

    def progress(self, epoch: int, taken: int) -> Optional[int]:
        """Tell the service the group has taken ``taken`` samples of ``epoch`` so far (a running total,
        so a repeated call counts once); the answer is what all groups have taken (``None`` if unreachable).
        No model travels and no clock moves: a group may ask at every step."""
        try:
            if self._sock is None and self.base is not None:
                self._attach(self.base)
            reply, _ = self._call({"op": "progress", "group": self.group, "epoch": epoch, "taken": taken})
        except (OSError, WireError) as exc:
            self._drop(exc)
            return None
        return int(reply["consumed"])

    def park(self) -> None:
        """This group is between epochs or done: the others must not wait for it."""
        try:
            if self._sock is not None:
                self._call({"op": "park", "group": self.group})
        except (OSError, WireError) as exc:
            self._drop(exc)

    def pull(self, level: bool = False) -> Optional[torch.Tensor]:
        """The global model (``level``: every group has now seen every update; clocks are evened), now
        the base; read-only to the caller and valid until the next call."""
        try:
            if self._sock is None and self.base is not None:
                self._attach(self.base)
            if self._slots is not None:
                answer_slot = self._answer_slot
                reply, _ = self._call({"op": "pull", "level": level, "answer": answer_slot})
                self._base_slot = answer_slot
                self.base = self._slots[answer_slot]
            else:
                reply, body = self._call({"op": "pull", "level": level})
                self.base = torch.from_numpy(np.frombuffer(body, dtype=np.float32))
        except (OSError, WireError) as exc:
            self._drop(exc)
            return None
        self.version = int(reply.get("version", self.version))
        return self.base

    def regroup(self, leaders: list[int]) -> None:
        """The groups changed (every model is mixed): only these leaders' clocks count, all level."""
        try:
            if self._sock is not None:
                self._call({"op": "regroup", "leaders": leaders})
        except (OSError, WireError) as exc:
            self._drop(exc)

    def stats(self) -> Optional[dict[str, Any]]:
        try:
            return self._call({"op": "stats"})[0]
        except (OSError, WireError) as exc:
            self._drop(exc)
            return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._slots is not None and self.base is not None:
            self.base = self.base.clone()  # the slots go with the connection
        self._slots = None
