"""The few CUDA driver calls a GPU-side hand-over needs, through ctypes: no nvcc, no extension to build.

* `stamp(addr)`: a one-thread kernel that stores the GPU's global nanosecond
  timer (`%globaltimer`, one clock for every context on the GPU) at `addr`;
* `spin(stream, ns)`: a one-thread kernel that runs for `ns` nanoseconds;
* `wait_value` / `write_value`: `cuStreamWaitValue32` (GEQ) and
  `cuStreamWriteValue32` on host memory registered for the device: the two
  halves of a hand-over that the GPU performs itself;
* `register_host` maps a page of host memory (a shared-memory file's) into the
  device's address space.

The kernels are PTX text JIT-compiled by the driver at load (ISA 6.0, sm_60
and newer). Everything runs on the context torch made current, on the stream
handle given (`torch.cuda.Stream().cuda_stream`).
"""
from __future__ import annotations

import ctypes
from ctypes import byref, c_char_p, c_int, c_size_t, c_uint, c_uint32, c_uint64, c_void_p

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

_WAIT_GEQ = 0x0
_HOST_REGISTER_PORTABLE = 0x01
_HOST_REGISTER_DEVICEMAP = 0x02


class CudaError(RuntimeError):
    """A driver call failed; the message names the call and the driver's error."""


class CudaDriver:
    """libcuda's stream memory operations and two timer kernels, on the current context."""

    def __init__(self) -> None:
        try:
            self._cu = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaError(f"no CUDA driver here: {exc}") from exc
        cu = self._cu
        self._wait = self._fn("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self._write = self._fn("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        for f in (self._wait, self._write):
            f.argtypes = [c_void_p, c_uint64, c_uint32, c_uint]
        self._launch = cu.cuLaunchKernel
        self._launch.argtypes = [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
                                 c_void_p, c_void_p]
        self._register = self._fn("cuMemHostRegister_v2", "cuMemHostRegister")
        self._register.argtypes = [c_void_p, c_size_t, c_uint]
        self._device_ptr = self._fn("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        self._device_ptr.argtypes = [ctypes.POINTER(c_uint64), c_void_p, c_uint]
        module = c_void_p()
        self._check(cu.cuModuleLoadData(byref(module), c_char_p(_PTX)), "cuModuleLoadData (timer kernels)")
        self._stamp_fn, self._spin_fn = c_void_p(), c_void_p()
        self._check(cu.cuModuleGetFunction(byref(self._stamp_fn), module, b"xo_stamp"), "cuModuleGetFunction")
        self._check(cu.cuModuleGetFunction(byref(self._spin_fn), module, b"xo_spin"), "cuModuleGetFunction")

    def _fn(self, *names: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        for name in names:
            f = getattr(self._cu, name, None)
            if f is not None:
                f.restype = c_int
                return f
        raise CudaError(f"the CUDA driver has none of {', '.join(names)}")

    def _check(self, rc: int, what: str) -> None:
        if rc:
            name = c_char_p()
            self._cu.cuGetErrorName(rc, byref(name))
            raise CudaError(f"{what}: {(name.value or b'?').decode()} ({rc})")

    def _run(self, fn: c_void_p, stream: int, arg: int) -> None:
        value = c_uint64(arg)
        params = (c_void_p * 1)(ctypes.cast(byref(value), c_void_p))
        self._check(self._launch(fn, 1, 1, 1, 1, 1, 1, 0, c_void_p(stream), params, None), "cuLaunchKernel")

    def stamp(self, stream: int, device_addr: int) -> None:
        """Store the GPU's global timer (ns) at `device_addr` when the stream reaches this point."""
        self._run(self._stamp_fn, stream, device_addr)

    def spin(self, stream: int, ns: int) -> None:
        """Keep the GPU busy on `stream` for `ns` nanoseconds (one thread: the context holds the GPU)."""
        self._run(self._spin_fn, stream, ns)

    def register_host(self, host_addr: int, size: int) -> int:
        """Pin and map `size` bytes of host memory at `host_addr`; its address on the device."""
        self._check(self._register(c_void_p(host_addr), size, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_DEVICEMAP),
                    "cuMemHostRegister")
        dev = c_uint64()
        self._check(self._device_ptr(byref(dev), c_void_p(host_addr), 0), "cuMemHostGetDevicePointer")
        return dev.value

    def wait_value(self, stream: int, device_addr: int, value: int) -> None:
        """The stream waits, on the GPU, until the 32-bit word at `device_addr` is ≥ `value`."""
        self._check(self._wait(c_void_p(stream), device_addr, value, _WAIT_GEQ), "cuStreamWaitValue32")

    def write_value(self, stream: int, device_addr: int, value: int) -> None:
        """The stream stores `value` at `device_addr` once its earlier work is done."""
        self._check(self._write(c_void_p(stream), device_addr, value, 0), "cuStreamWriteValue32")
