// CUDA driver backend: cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess /
// cuMemUnmap / cuMemRelease / cuMemAddressFree on one device, in its primary context.
//
// The zero page is one physical allocation per mapping-unit size, zeroed once with cuMemsetD8 and
// mapped at every unbacked unit: read-only (CU_MEM_ACCESS_FLAGS_PROT_READ) by default, so a stray
// write faults; read-write after set_zero_page_writable(true), which patched vLLM asks for because
// its dummy runs write padding KV into blocks no request owns. A writable zero page is scratch:
// its contents are garbage after such writes, and no request ever reads a block it does not own.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <map>
#include <string>
#include <memory>
#include <mutex>
#include <vector>

#include "backend.hpp"
#include "cuda_driver.hpp"

namespace kvcached {

class CudaBackend : public Backend {
 public:
  // Throws BackendError with the driver's plain reason when the device cannot be used.
  explicit CudaBackend(int device_id);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  DeviceKind device_kind() const override { return DeviceKind::kCuda; }
  int device_id() const override { return device_id_; }
  size_t granularity() const override { return granularity_; }

  uintptr_t reserve_range(size_t size) override;
  OpResult free_range(uintptr_t va, size_t size) override;
  OpResult create_handle(size_t size, uint64_t* handle) override;
  OpResult release_handle(uint64_t handle, size_t size) override;
  OpResult map_handle(uintptr_t va, size_t size, uint64_t handle) override;
  OpResult set_access(uintptr_t va, size_t size) override;
  OpResult unmap_range(uintptr_t va, size_t size) override;
  OpResult map_zero(uintptr_t va, size_t size) override;
  bool zero_page_read_only() const override;
  void set_zero_page_writable(bool writable) override;
  size_t physical_free_bytes() override;
  std::map<std::string, OpStat> op_stats() const override;

 private:
  enum Op { kCreate, kRelease, kMap, kSetAccess, kUnmap, kMapZero, kOpCount };
  class OpTimer;
  // Adds the time since `start` to the counters of `op` (relaxed atomics: a cheap profile).
  void record(Op op, std::chrono::steady_clock::time_point start) const;

  // Makes the primary context current in the calling thread if no context is.
  void ensure_context() const;
  OpResult result_of(CUresult status, const char* what) const;
  // The zero allocation of `size` bytes, created and zeroed on first use. Caller holds zero_mutex_.
  OpResult zero_handle_locked(size_t size, CUmemGenericAllocationHandle* handle);

  const CudaDriver& driver_;
  const int device_id_;
  CUdevice device_ = 0;
  CUcontext primary_context_ = nullptr;
  CUmemAllocationProp prop_{};
  size_t granularity_ = 0;

  mutable std::mutex zero_mutex_;  // guards the two members below
  std::map<size_t, CUmemGenericAllocationHandle> zero_handles_;
  bool zero_read_only_ = true;  // false only if the driver refuses read-only mappings

  mutable std::array<std::atomic<uint64_t>, kOpCount> op_calls_{};
  mutable std::array<std::atomic<uint64_t>, kOpCount> op_ns_{};
};

}  // namespace kvcached
