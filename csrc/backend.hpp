// The one interface every memory backend implements (docs/architecture.md, principle 7).
// Everything above it (FTensor, FTensorAllocator, PageAllocator) is shared between the CUDA
// driver and the host.
//
// Operations that take part in a map/unmap transaction return an OpResult instead of throwing, so
// that the caller can decide how to roll back. Handles are opaque 64-bit values owned through
// PhysicalPage (RAII).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

namespace kvcached {

struct OpResult {
  enum class Kind { kOk, kOutOfMemory, kFailed };

  Kind kind = Kind::kOk;
  std::string message;

  static OpResult ok() { return {}; }
  static OpResult out_of_memory(std::string why) { return {Kind::kOutOfMemory, std::move(why)}; }
  static OpResult failed(std::string why) { return {Kind::kFailed, std::move(why)}; }

  bool is_ok() const { return kind == Kind::kOk; }
  bool is_out_of_memory() const { return kind == Kind::kOutOfMemory; }
};

enum class DeviceKind { kHost, kCuda };

class Backend {
 public:
  virtual ~Backend() = default;

  virtual DeviceKind device_kind() const = 0;
  virtual int device_id() const = 0;
  // Every size and address below is a multiple of this.
  virtual size_t granularity() const = 0;

  // Reserves `size` bytes of virtual address space with no memory behind it. Throws BackendError.
  virtual uintptr_t reserve_range(size_t size) = 0;
  virtual OpResult free_range(uintptr_t va, size_t size) = 0;

  // A physical allocation of `size` bytes. Out of memory is reported as such.
  virtual OpResult create_handle(size_t size, uint64_t* handle) = 0;
  virtual OpResult release_handle(uint64_t handle, size_t size) = 0;

  // Maps `handle` at `va` (the range must hold no mapping); set_access then makes it read-write.
  virtual OpResult map_handle(uintptr_t va, size_t size, uint64_t handle) = 0;
  virtual OpResult set_access(uintptr_t va, size_t size) = 0;
  // Removes whatever mapping covers [va, va + size); the range stays reserved.
  virtual OpResult unmap_range(uintptr_t va, size_t size) = 0;
  // Maps the shared zero page at [va, va + size) (the range must hold no mapping): read-only
  // unless set_zero_page_writable(true) was called.
  virtual OpResult map_zero(uintptr_t va, size_t size) = 0;
  // Whether writes to a zero-page mapping fault (true for both backends where the driver allows it).
  virtual bool zero_page_read_only() const = 0;
  // Makes later zero-page mappings writable: stray writes into unbacked pages (an engine's
  // dummy runs writing KV for padding tokens) land in a scratch page instead of faulting, and
  // unbacked pages then read whatever was last written there, not zeros. Call before creating
  // tensors.
  virtual void set_zero_page_writable(bool writable) = 0;

  // Bytes of physical memory that could still be committed.
  virtual size_t physical_free_bytes() = 0;

  // Calls and total nanoseconds per driver operation since creation (empty where not measured).
  struct OpStat {
    uint64_t calls = 0;
    uint64_t ns = 0;
  };
  virtual std::map<std::string, OpStat> op_stats() const { return {}; }
};

// Owns one physical allocation. release() is the checked path; the destructor is the safety net
// for error paths and logs nothing (a handle can only leak here if the driver refused a release,
// which the checked path has already reported).
class PhysicalPage {
 public:
  PhysicalPage(std::shared_ptr<Backend> backend, uint64_t handle, size_t size)
      : backend_(std::move(backend)), handle_(handle), size_(size) {}
  PhysicalPage(const PhysicalPage&) = delete;
  PhysicalPage& operator=(const PhysicalPage&) = delete;
  ~PhysicalPage() {
    if (owned_) backend_->release_handle(handle_, size_);
  }

  static OpResult create(const std::shared_ptr<Backend>& backend, size_t size,
                         std::unique_ptr<PhysicalPage>* out) {
    uint64_t handle = 0;
    OpResult result = backend->create_handle(size, &handle);
    if (result.is_ok()) *out = std::make_unique<PhysicalPage>(backend, handle, size);
    return result;
  }

  OpResult release() {
    OpResult result = backend_->release_handle(handle_, size_);
    if (result.is_ok()) owned_ = false;
    return result;
  }

  uint64_t handle() const { return handle_; }
  size_t size() const { return size_; }

 private:
  std::shared_ptr<Backend> backend_;
  uint64_t handle_;
  size_t size_;
  bool owned_ = true;
};

}  // namespace kvcached
