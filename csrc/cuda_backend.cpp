#include "cuda_backend.hpp"

#include <chrono>

#include "errors.hpp"

namespace kvcached {

// Adds the duration of one driver operation to the backend's profile when it goes out of scope.
class CudaBackend::OpTimer {
 public:
  OpTimer(const CudaBackend* backend, Op op)
      : backend_(backend), op_(op), start_(std::chrono::steady_clock::now()) {}
  ~OpTimer() { backend_->record(op_, start_); }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  const CudaBackend* backend_;
  Op op_;
  std::chrono::steady_clock::time_point start_;
};

CudaBackend::CudaBackend(int device_id) : driver_(CudaDriver::get()), device_id_(device_id) {
  if (!driver_.available) throw BackendError(driver_.unavailable_reason);
  if (device_id < 0 || device_id >= driver_.device_count) {
    throw ConfigError("CUDA device " + std::to_string(device_id) + " does not exist (" +
                      std::to_string(driver_.device_count) + " device(s))");
  }
  CUresult status = driver_.device_get(&device_, device_id);
  if (status != CUDA_SUCCESS) throw BackendError("cuDeviceGet: " + driver_.error_name(status));
  int vmm_supported = 0;
  driver_.device_get_attribute(
      &vmm_supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device_);
  if (vmm_supported == 0) {
    throw BackendError("CUDA device " + std::to_string(device_id) +
                       " does not support virtual memory management (cuMemMap)");
  }
  status = driver_.primary_ctx_retain(&primary_context_, device_);
  if (status != CUDA_SUCCESS) {
    throw BackendError("cuDevicePrimaryCtxRetain: " + driver_.error_name(status));
  }
  ensure_context();
  prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop_.location.id = device_;
  status = driver_.mem_get_allocation_granularity(&granularity_, &prop_,
                                                  CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (status != CUDA_SUCCESS) {
    driver_.primary_ctx_release(device_);
    throw BackendError("cuMemGetAllocationGranularity: " + driver_.error_name(status));
  }
}

CudaBackend::~CudaBackend() {
  ensure_context();
  for (auto& [size, handle] : zero_handles_) driver_.mem_release(handle);
  driver_.primary_ctx_release(device_);
}

void CudaBackend::ensure_context() const {
  CUcontext current = nullptr;
  if (driver_.ctx_get_current(&current) == CUDA_SUCCESS && current == nullptr) {
    driver_.ctx_set_current(primary_context_);
  }
}

OpResult CudaBackend::result_of(CUresult status, const char* what) const {
  if (status == CUDA_SUCCESS) return OpResult::ok();
  std::string why = std::string(what) + ": " + driver_.error_name(status);
  if (status == CUDA_ERROR_OUT_OF_MEMORY) return OpResult::out_of_memory(why);
  return OpResult::failed(why);
}

uintptr_t CudaBackend::reserve_range(size_t size) {
  ensure_context();
  CUdeviceptr va = 0;
  CUresult status = driver_.mem_address_reserve(&va, size, granularity_, 0, 0);
  if (status != CUDA_SUCCESS) {
    throw BackendError("cuMemAddressReserve of " + std::to_string(size) +
                       " bytes: " + driver_.error_name(status));
  }
  return static_cast<uintptr_t>(va);
}

OpResult CudaBackend::free_range(uintptr_t va, size_t size) {
  ensure_context();
  return result_of(driver_.mem_address_free(static_cast<CUdeviceptr>(va), size),
                   "cuMemAddressFree");
}

OpResult CudaBackend::create_handle(size_t size, uint64_t* handle) {
  OpTimer timer(this, kCreate);
  ensure_context();
  CUmemGenericAllocationHandle created = 0;
  OpResult result = result_of(driver_.mem_create(&created, size, &prop_, 0), "cuMemCreate");
  if (result.is_ok()) *handle = static_cast<uint64_t>(created);
  return result;
}

OpResult CudaBackend::release_handle(uint64_t handle, size_t /*size*/) {
  OpTimer timer(this, kRelease);
  ensure_context();
  return result_of(driver_.mem_release(static_cast<CUmemGenericAllocationHandle>(handle)),
                   "cuMemRelease");
}

OpResult CudaBackend::map_handle(uintptr_t va, size_t size, uint64_t handle) {
  OpTimer timer(this, kMap);
  ensure_context();
  return result_of(driver_.mem_map(static_cast<CUdeviceptr>(va), size, 0,
                                   static_cast<CUmemGenericAllocationHandle>(handle), 0),
                   "cuMemMap");
}

OpResult CudaBackend::set_access(uintptr_t va, size_t size) {
  OpTimer timer(this, kSetAccess);
  ensure_context();
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return result_of(driver_.mem_set_access(static_cast<CUdeviceptr>(va), size, &access, 1),
                   "cuMemSetAccess");
}

OpResult CudaBackend::unmap_range(uintptr_t va, size_t size) {
  OpTimer timer(this, kUnmap);
  ensure_context();
  return result_of(driver_.mem_unmap(static_cast<CUdeviceptr>(va), size), "cuMemUnmap");
}

OpResult CudaBackend::zero_handle_locked(size_t size, CUmemGenericAllocationHandle* handle) {
  auto found = zero_handles_.find(size);
  if (found != zero_handles_.end()) {
    *handle = found->second;
    return OpResult::ok();
  }
  CUmemGenericAllocationHandle created = 0;
  OpResult result = result_of(driver_.mem_create(&created, size, &prop_, 0), "cuMemCreate (zero)");
  if (!result.is_ok()) return result;
  // Zero it once through a temporary read-write mapping, then never write it again.
  CUdeviceptr scratch = 0;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  result = result_of(driver_.mem_address_reserve(&scratch, size, granularity_, 0, 0),
                     "cuMemAddressReserve (zero)");
  if (result.is_ok()) {
    result = result_of(driver_.mem_map(scratch, size, 0, created, 0), "cuMemMap (zero)");
    if (result.is_ok()) {
      result = result_of(driver_.mem_set_access(scratch, size, &access, 1), "cuMemSetAccess (zero)");
      if (result.is_ok()) result = result_of(driver_.memset_d8(scratch, 0, size), "cuMemsetD8");
      if (result.is_ok()) result = result_of(driver_.ctx_synchronize(), "cuCtxSynchronize");
      driver_.mem_unmap(scratch, size);
    }
    driver_.mem_address_free(scratch, size);
  }
  if (!result.is_ok()) {
    driver_.mem_release(created);
    return result;
  }
  zero_handles_[size] = created;
  *handle = created;
  return OpResult::ok();
}

OpResult CudaBackend::map_zero(uintptr_t va, size_t size) {
  OpTimer timer(this, kMapZero);
  ensure_context();
  std::lock_guard<std::mutex> lock(zero_mutex_);
  CUmemGenericAllocationHandle zero = 0;
  OpResult result = zero_handle_locked(size, &zero);
  if (!result.is_ok()) return result;
  auto ptr = static_cast<CUdeviceptr>(va);
  result = result_of(driver_.mem_map(ptr, size, 0, zero, 0), "cuMemMap (zero page)");
  if (!result.is_ok()) return result;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = zero_read_only_ ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult status = driver_.mem_set_access(ptr, size, &access, 1);
  if (status != CUDA_SUCCESS && zero_read_only_ &&
      (status == CUDA_ERROR_INVALID_VALUE || status == CUDA_ERROR_NOT_SUPPORTED)) {
    // Some drivers refuse read-only device mappings; zero_page_read_only() then reports it.
    zero_read_only_ = false;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    status = driver_.mem_set_access(ptr, size, &access, 1);
  }
  if (status != CUDA_SUCCESS) {
    OpResult failed = result_of(status, "cuMemSetAccess (zero page)");
    if (driver_.mem_unmap(ptr, size) != CUDA_SUCCESS) {
      failed.message += "; the zero mapping could not be undone either";
    }
    return failed;
  }
  return OpResult::ok();
}

void CudaBackend::record(Op op, std::chrono::steady_clock::time_point start) const {
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - start)
                .count();
  op_calls_[op].fetch_add(1, std::memory_order_relaxed);
  op_ns_[op].fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
}

std::map<std::string, Backend::OpStat> CudaBackend::op_stats() const {
  static const char* const kNames[kOpCount] = {"create", "release", "map",
                                               "set_access", "unmap", "map_zero"};
  std::map<std::string, OpStat> stats;
  for (int op = 0; op < kOpCount; ++op) {
    stats[kNames[op]] = {op_calls_[op].load(std::memory_order_relaxed),
                         op_ns_[op].load(std::memory_order_relaxed)};
  }
  return stats;
}

void CudaBackend::set_zero_page_writable(bool writable) {
  std::lock_guard<std::mutex> lock(zero_mutex_);
  zero_read_only_ = !writable;
}

bool CudaBackend::zero_page_read_only() const {
  std::lock_guard<std::mutex> lock(zero_mutex_);
  return zero_read_only_;
}

size_t CudaBackend::physical_free_bytes() {
  ensure_context();
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  if (driver_.mem_get_info(&free_bytes, &total_bytes) != CUDA_SUCCESS) return 0;
  return free_bytes;
}

}  // namespace kvcached
