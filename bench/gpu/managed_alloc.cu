// Managed (unified) memory for torch's CUDAPluggableAllocator: what a low job would spill through instead of
// failing at its cap (TGS's mechanism, in-process). Built by `bench.gpu --only memory` with nvcc on the GPU
// machine and loaded in the low job of its `spill` run, to measure whether spilling pays (issue 54).
#include <cuda_runtime.h>
#include <sys/types.h>

extern "C" {

void* xo_managed_malloc(ssize_t size, int device, cudaStream_t stream) {
  void* ptr = nullptr;
  if (cudaMallocManaged(&ptr, size, cudaMemAttachGlobal) != cudaSuccess) {
    return nullptr;
  }
  return ptr;
}

void xo_managed_free(void* ptr, ssize_t size, int device, cudaStream_t stream) {
  cudaFree(ptr);
}

}
