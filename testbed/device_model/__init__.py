"""A GPU-like device for the emulated cluster: compute that costs no CPU, shared the way a GPU without MPS is.

A node's ranks submit each compute phase to the node's device server
(`server`, one process per node) as seconds of device work and block until
the server says it is done (`client`). The server runs `model.DeviceModel`:

* one context computing alone runs at full speed;
* k contexts computing at once are time-sliced: each gets 1/k of the device,
  less the cost of switching between them (`switch_us` per `slice_us`);
* while an allreduce of a rank on that device is in flight, compute runs
  `interference` slower (a collective's kernels and copies contend for the
  device's SMs and memory bandwidth).

The defaults come from published measurements (docs/emulated-cluster.md,
"The device model"); `bench.emulated --device model` sweeps them. The
simulator (`testbed.simulator`) shares `DeviceParams.compute_rate`, so both
models of a device are one.
"""
from __future__ import annotations

from .model import DeviceModel, DeviceParams

__all__ = ["DeviceModel", "DeviceParams", "SOCKET_ENV"]

SOCKET_ENV = "EMULATED_DEVICE_SOCKET"
"""Set in a rank's environment by the emulated cluster: the path of its node's device server."""
