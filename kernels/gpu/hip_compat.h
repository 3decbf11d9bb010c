/* The one place where HIP names meet CUDA's (docs/design.md "GPU builds").
 *
 * GPU code in kernels/gpu/ (and the GPU test and bench) is written against
 * the HIP runtime API and HIP's device intrinsics. On AMD, hipcc compiles it
 * against the real HIP headers. On NVIDIA, nvcc compiles it (-x cu) and this
 * header maps each HIP name we use onto CUDA's; Debian's HIP 5.2 nvidia
 * headers do not build against CUDA 13, so we never include them.
 *
 * Usable from C (runtime API only: the backend, tests, bench) and from
 * HIP/CUDA C++ (kernels). Add a name here when a new one is needed; nothing
 * else may include a vendor header. */
#ifndef MOE_GPU_HIP_COMPAT_H
#define MOE_GPU_HIP_COMPAT_H

#if defined(MOE_GPU_CUDA) + defined(MOE_GPU_HIP) != 1
#error "define exactly one of MOE_GPU_CUDA or MOE_GPU_HIP (kernels/gpu/CMakeLists.txt does)"
#endif

#if defined(MOE_GPU_HIP)
/* ---- AMD: the real thing -------------------------------------------------- */
#ifndef __HIP_PLATFORM_AMD__
#define __HIP_PLATFORM_AMD__ 1
#endif
#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#else
#include <hip/hip_runtime_api.h>
#endif
/* Warp-level shuffle without a mask (every lane of the wavefront takes part). */
#define MOE_SHFL_XOR(v, m) __shfl_xor((v), (m))
#define MOE_VENDOR "hip"

#else
/* ---- NVIDIA: HIP names over the CUDA runtime ------------------------------ */
#if defined(__CUDACC__)
#include <cuda_runtime.h>
#else
#include <cuda_runtime_api.h>
#endif
#include <stdint.h>

typedef cudaError_t hipError_t;
typedef cudaStream_t hipStream_t;
typedef cudaEvent_t hipEvent_t;
typedef struct cudaDeviceProp hipDeviceProp_t;

#define hipSuccess cudaSuccess
#define hipErrorNoDevice cudaErrorNoDevice
#define hipGetErrorString cudaGetErrorString
#define hipGetLastError cudaGetLastError
#define hipGetDeviceCount cudaGetDeviceCount
#define hipGetDevice cudaGetDevice
#define hipSetDevice cudaSetDevice
#define hipGetDeviceProperties cudaGetDeviceProperties
#define hipDeviceGetAttribute cudaDeviceGetAttribute
#define hipDeviceAttributeMultiprocessorCount cudaDevAttrMultiProcessorCount
#define hipDriverGetVersion cudaDriverGetVersion
#define hipRuntimeGetVersion cudaRuntimeGetVersion
#define hipDeviceSynchronize cudaDeviceSynchronize
#define hipMemGetInfo cudaMemGetInfo

#define hipMalloc cudaMalloc
#define hipFree cudaFree
#define hipHostMalloc(p, n, f) cudaHostAlloc((p), (n), (f))
#define hipHostMallocDefault cudaHostAllocDefault
#define hipHostFree cudaFreeHost
#define hipMemcpy cudaMemcpy
#define hipMemcpyAsync cudaMemcpyAsync
#define hipMemsetAsync cudaMemsetAsync
#define hipMemcpyHostToDevice cudaMemcpyHostToDevice
#define hipMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define hipMemcpyDeviceToDevice cudaMemcpyDeviceToDevice

#define hipStreamCreateWithFlags cudaStreamCreateWithFlags
#define hipStreamNonBlocking cudaStreamNonBlocking
#define hipStreamDestroy cudaStreamDestroy
#define hipStreamSynchronize cudaStreamSynchronize
#define hipStreamWaitEvent cudaStreamWaitEvent

#define hipEventCreate cudaEventCreate
#define hipEventCreateWithFlags cudaEventCreateWithFlags
#define hipEventDisableTiming cudaEventDisableTiming
#define hipEventDestroy cudaEventDestroy
#define hipEventRecord cudaEventRecord
#define hipEventSynchronize cudaEventSynchronize
#define hipEventElapsedTime cudaEventElapsedTime

/* Another process's device memory (kernels/gpu/ipc.c). */
typedef cudaIpcMemHandle_t hipIpcMemHandle_t;
typedef void *hipDeviceptr_t;
#define hipIpcOpenMemHandle cudaIpcOpenMemHandle
#define hipIpcCloseMemHandle cudaIpcCloseMemHandle
#define hipIpcMemLazyEnablePeerAccess cudaIpcMemLazyEnablePeerAccess
#define hipErrorNotSupported cudaErrorNotSupported
#define hipErrorInvalidValue cudaErrorInvalidValue
/* The runtime API has no counterpart of HIP's hipMemGetAddressRange: the
 * driver's cuMemGetAddressRange, looked up through the runtime (moe links
 * cudart alone, not libcuda). */
static inline hipError_t hipMemGetAddressRange(hipDeviceptr_t *base, size_t *size, hipDeviceptr_t p) {
  typedef int (*range_fn)(unsigned long long *, size_t *, unsigned long long); /* CUresult (CUDA_SUCCESS 0) */
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult q;
#if CUDART_VERSION >= 12050
  cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q);
#else
  cudaError_t e = cudaGetDriverEntryPoint("cuMemGetAddressRange", &fn, cudaEnableDefault, &q);
#endif
  if (e != cudaSuccess) return e;
  if (!fn || q != cudaDriverEntryPointSuccess) return cudaErrorNotSupported;
  unsigned long long b = 0;
  if (((range_fn)fn)(&b, size, (unsigned long long)(uintptr_t)p) != 0) return cudaErrorInvalidValue;
  *base = (hipDeviceptr_t)(uintptr_t)b;
  return cudaSuccess;
}

#define MOE_SHFL_XOR(v, m) __shfl_xor_sync(0xFFFFFFFFu, (v), (m))
#define MOE_VENDOR "cuda"
#endif

/* Launch bookkeeping shared by every kernel file. */
#define MOE_GPU_BLOCK 256 /* threads per block: a multiple of both warp sizes */

#endif
