// The CUDA driver, loaded at run time. The extension links neither libcuda nor libtorch
// (docs/architecture.md, principle 6): libcuda.so.1 is dlopen'ed on first use and every entry
// point is resolved by its exported (versioned where the header renames it) symbol name. cuda.h
// is only used for types and constants.
#pragma once

#include <cuda.h>

#include <string>

namespace kvcached {

struct CudaDriver {
  CUresult (*init)(unsigned int) = nullptr;
  CUresult (*driver_get_version)(int*) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*device_get_count)(int*) = nullptr;
  CUresult (*device_get_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*primary_ctx_release)(CUdevice) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*ctx_synchronize)() = nullptr;
  CUresult (*mem_address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                  unsigned long long) = nullptr;  // NOLINT(runtime/int)
  CUresult (*mem_address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                         unsigned long long) = nullptr;  // NOLINT(runtime/int)
  CUresult (*mem_release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                      unsigned long long) = nullptr;  // NOLINT(runtime/int)
  CUresult (*mem_unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*mem_get_allocation_granularity)(size_t*, const CUmemAllocationProp*,
                                             CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*mem_get_info)(size_t*, size_t*) = nullptr;
  CUresult (*memset_d8)(CUdeviceptr, unsigned char, size_t) = nullptr;
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;

  bool available = false;
  // Why the driver cannot be used (empty when available).
  std::string unavailable_reason;
  int driver_version = 0;
  int device_count = 0;

  // Loads the driver once per process; never throws.
  static const CudaDriver& get();
  // "CUDA_ERROR_OUT_OF_MEMORY" etc.
  std::string error_name(CUresult code) const;
};

}  // namespace kvcached
