// Host memory backend: the same reserve/map/unmap model as the CUDA driver, on plain Linux memory.
//
// - Virtual ranges are reserved with mmap(PROT_NONE) and stay reserved until free_range.
// - Physical pages live in ONE memfd per backend (the page store). A handle is the byte offset of
//   its slot in that file. create = fallocate (memory is really committed; ENOSPC/ENOMEM is out of
//   memory), release = fallocate(PUNCH_HOLE) (memory goes back to the OS).
// - map = mmap(MAP_SHARED | MAP_FIXED) of the slot; unmap = an anonymous PROT_NONE mapping over the
//   range, so the address range is never handed back to the OS by accident.
// - The zero page is an anonymous private read-only mapping: reads see the kernel's shared zero
//   page (no resident memory), writes fault, and neighbouring zero mappings merge into one VMA.
//   Made writable on request (set_zero_page_writable), a stray write gets a private copy.
// - Tests can make the Nth future call of an operation fail the way a driver would.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "backend.hpp"

namespace kvcached {

enum class HostOp { kCreate, kMap, kUnmap, kMapZero, kRelease };

HostOp parse_host_op(const std::string& name);  // throws ConfigError

class HostBackend : public Backend {
 public:
  // memory_limit_bytes caps what this backend may commit (0: only the OS limits it).
  explicit HostBackend(size_t memory_limit_bytes = 0);
  ~HostBackend() override;
  HostBackend(const HostBackend&) = delete;
  HostBackend& operator=(const HostBackend&) = delete;

  DeviceKind device_kind() const override { return DeviceKind::kHost; }
  int device_id() const override { return 0; }
  size_t granularity() const override { return granularity_; }

  uintptr_t reserve_range(size_t size) override;
  OpResult free_range(uintptr_t va, size_t size) override;
  OpResult create_handle(size_t size, uint64_t* handle) override;
  OpResult release_handle(uint64_t handle, size_t size) override;
  OpResult map_handle(uintptr_t va, size_t size, uint64_t handle) override;
  OpResult set_access(uintptr_t va, size_t size) override;
  OpResult unmap_range(uintptr_t va, size_t size) override;
  OpResult map_zero(uintptr_t va, size_t size) override;
  bool zero_page_read_only() const override { return !zero_writable_; }
  void set_zero_page_writable(bool writable) override { zero_writable_ = writable; }
  size_t physical_free_bytes() override;

  // The `nth` future call (1 = the next one) of `op` fails; out_of_memory picks the error kind.
  void inject_failure(HostOp op, int nth, bool out_of_memory);
  void clear_injected_failures();
  // Bytes the page store holds right now, as the kernel accounts them (allocated blocks).
  size_t store_allocated_bytes() const;
  // Bytes committed through create_handle and not yet released (bookkeeping view of the same).
  size_t committed_bytes() const;

 private:
  struct Injection {
    int countdown;
    bool out_of_memory;
  };

  std::optional<OpResult> take_injected(HostOp op);

  const size_t granularity_;
  std::atomic<bool> zero_writable_{false};
  const size_t memory_limit_bytes_;
  int store_fd_ = -1;

  mutable std::mutex mutex_;  // guards everything below
  size_t store_end_ = 0;      // slots are carved from [0, store_end_)
  std::map<size_t, std::vector<size_t>> free_slots_;  // slot size -> released slot offsets
  std::map<uint64_t, size_t> live_slots_;             // handle (offset) -> size
  size_t committed_ = 0;
  std::map<HostOp, std::vector<Injection>> injections_;
};

}  // namespace kvcached
