"""The few CUDA driver calls a GPU-side hand-over needs, through ctypes: no nvcc, no extension to build.

* `stamp(addr)`: a one-thread kernel that stores the GPU's global nanosecond
  timer (`%globaltimer`, one clock for every context on the GPU) at `addr`;
* `spin(stream, ns)`: a one-thread kernel that runs for `ns` nanoseconds;
* `wait_value` / `write_value` and `register_host`: the product's own stream
  memory operations (`crossover.plugins.hook.cuda_turns.StreamMemory`), which the
  plugin's hand-over on the GPU uses, so the check measures the same calls.

The kernels are PTX text JIT-compiled by the driver at load (ISA 6.0, sm_60
and newer). Everything runs on the context torch made current, on the stream
handle given (`torch.cuda.Stream().cuda_stream`).
"""
from __future__ import annotations

import ctypes
from ctypes import byref, c_char_p, c_uint, c_uint64, c_void_p

from crossover.plugins.hook.cuda_turns import CudaUnavailable as CudaError
from crossover.plugins.hook.cuda_turns import StreamMemory

__all__ = ["CudaDriver", "CudaError"]

_PTX = rb"""
.version 6.0
.target sm_60
.address_size 64

.visible .entry xo_stamp(.param .u64 xo_stamp_out)
{
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [xo_stamp_out];
    cvta.to.global.u64 %rd2, %rd1;
    mov.u64 %rd3, %globaltimer;
    st.global.u64 [%rd2], %rd3;
    membar.sys;
    ret;
}

.visible .entry xo_spin(.param .u64 xo_spin_ns)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [xo_spin_ns];
    mov.u64 %rd2, %globaltimer;
    add.s64 %rd3, %rd2, %rd1;
$Lspin:
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p1, %rd4, %rd3;
    @%p1 bra $Lspin;
    ret;
}
"""

class CudaDriver(StreamMemory):
    """The product's stream memory operations (`crossover.plugins.hook.cuda_turns.StreamMemory`) and two timer
    kernels, on the current context."""

    def __init__(self) -> None:
        super().__init__()
        cu = self._cu
        self._launch = cu.cuLaunchKernel
        self._launch.argtypes = [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
                                 c_void_p, c_void_p]
        module = c_void_p()
        self.check(cu.cuModuleLoadData(byref(module), c_char_p(_PTX)), "cuModuleLoadData (timer kernels)")
        self._stamp_fn, self._spin_fn = c_void_p(), c_void_p()
        self.check(cu.cuModuleGetFunction(byref(self._stamp_fn), module, b"xo_stamp"), "cuModuleGetFunction")
        self.check(cu.cuModuleGetFunction(byref(self._spin_fn), module, b"xo_spin"), "cuModuleGetFunction")

    def _run(self, fn: c_void_p, stream: int, arg: int) -> None:
        value = c_uint64(arg)
        params = (c_void_p * 1)(ctypes.cast(byref(value), c_void_p))
        self.check(self._launch(fn, 1, 1, 1, 1, 1, 1, 0, c_void_p(stream), params, None), "cuLaunchKernel")

    def stamp(self, stream: int, device_addr: int) -> None:
        """Store the GPU's global timer (ns) at `device_addr` when the stream reaches this point."""
        self._run(self._stamp_fn, stream, device_addr)

    def spin(self, stream: int, ns: int) -> None:
        """Keep the GPU busy on `stream` for `ns` nanoseconds (one thread: the context holds the GPU)."""
        self._run(self._spin_fn, stream, ns)
