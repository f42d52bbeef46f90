#include "cuda_driver.hpp"

// No iostreams in this extension: a newer compiler's stream templates running on the host
// process's older libstdc++ crashed formatting a number (seen on the GPU build host).

#include <dlfcn.h>


namespace kvcached {
namespace {

template <typename Fn>
bool resolve(void* library, const char* symbol, Fn* out, std::string* missing) {
  void* address = dlsym(library, symbol);
  if (address == nullptr) {
    *missing = symbol;
    return false;
  }
  *out = reinterpret_cast<Fn>(address);
  return true;
}

CudaDriver load_driver() {
  CudaDriver driver;
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    driver.unavailable_reason = std::string("no CUDA driver: libcuda.so.1 could not be loaded (") +
                                (why != nullptr ? why : "unknown reason") + ")";
    return driver;
  }
  std::string missing;
  // The versioned names are the ones cuda.h maps the plain API names to.
  bool resolved =
      resolve(library, "cuInit", &driver.init, &missing) &&
      resolve(library, "cuDriverGetVersion", &driver.driver_get_version, &missing) &&
      resolve(library, "cuDeviceGet", &driver.device_get, &missing) &&
      resolve(library, "cuDeviceGetCount", &driver.device_get_count, &missing) &&
      resolve(library, "cuDeviceGetAttribute", &driver.device_get_attribute, &missing) &&
      resolve(library, "cuDevicePrimaryCtxRetain", &driver.primary_ctx_retain, &missing) &&
      resolve(library, "cuDevicePrimaryCtxRelease_v2", &driver.primary_ctx_release, &missing) &&
      resolve(library, "cuCtxGetCurrent", &driver.ctx_get_current, &missing) &&
      resolve(library, "cuCtxSetCurrent", &driver.ctx_set_current, &missing) &&
      resolve(library, "cuCtxSynchronize", &driver.ctx_synchronize, &missing) &&
      resolve(library, "cuMemAddressReserve", &driver.mem_address_reserve, &missing) &&
      resolve(library, "cuMemAddressFree", &driver.mem_address_free, &missing) &&
      resolve(library, "cuMemCreate", &driver.mem_create, &missing) &&
      resolve(library, "cuMemRelease", &driver.mem_release, &missing) &&
      resolve(library, "cuMemMap", &driver.mem_map, &missing) &&
      resolve(library, "cuMemUnmap", &driver.mem_unmap, &missing) &&
      resolve(library, "cuMemSetAccess", &driver.mem_set_access, &missing) &&
      resolve(library, "cuMemGetAllocationGranularity", &driver.mem_get_allocation_granularity,
              &missing) &&
      resolve(library, "cuMemGetInfo_v2", &driver.mem_get_info, &missing) &&
      resolve(library, "cuMemsetD8_v2", &driver.memset_d8, &missing) &&
      resolve(library, "cuGetErrorName", &driver.get_error_name, &missing);
  if (!resolved) {
    driver.unavailable_reason =
        "CUDA driver too old: libcuda.so.1 does not export " + missing + " (needs CUDA 11.2+)";
    return driver;  // the library stays loaded; it is harmless
  }
  CUresult status = driver.init(0);
  if (status != CUDA_SUCCESS) {
    driver.unavailable_reason = "CUDA driver loaded but cuInit failed: " + driver.error_name(status);
    return driver;
  }
  driver.driver_get_version(&driver.driver_version);
  driver.device_get_count(&driver.device_count);
  if (driver.device_count == 0) {
    driver.unavailable_reason = "CUDA driver loaded but it reports no device";
    return driver;
  }
  driver.available = true;
  return driver;
}

}  // namespace

const CudaDriver& CudaDriver::get() {
  static const CudaDriver driver = load_driver();  // thread-safe one-time initialisation
  return driver;
}

std::string CudaDriver::error_name(CUresult code) const {
  const char* name = nullptr;
  if (get_error_name != nullptr && get_error_name(code, &name) == CUDA_SUCCESS && name) {
    return name;
  }
  return "CUresult " + std::to_string(static_cast<int>(code));
}

}  // namespace kvcached
