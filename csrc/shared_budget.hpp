// A memory budget shared by every process on the host that joins it, and a Backend decorator
// that charges physical allocations to it.
//
// On a GPU, engines on one device share its memory whether they like it or not; a budget makes
// that sharing explicit and enforceable on any backend (the host backend included). The budget
// is one small file in the limits directory (`kvcached-budget-<name>`), mapped by every member:
//
//   header (64 bytes): magic "KVCBUDGT", u32 version, u32 slot count, u64 capacity,
//                      u64 revision (bumped when the capacity changes), 32 reserved bytes
//   slots (32 bytes each): i64 pid, u64 process start time (clock ticks after boot, field 22 of
//                      /proc/<pid>/stat: guards against pid reuse), u64 charged bytes,
//                      u64 attached backends
//
// Every read-modify-write holds flock(LOCK_EX) on the file (kvctl, in Python, does the same).
// A charge sums the slots and refuses what would exceed the capacity; only then are slots of
// dead processes reclaimed, so a crashed member's bytes come back without a liveness check on
// the hot path. All integers are little-endian (x86-64 and aarch64 hosts).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "backend.hpp"

namespace kvcached {

constexpr char kBudgetMagic[8] = {'K', 'V', 'C', 'B', 'U', 'D', 'G', 'T'};
constexpr uint32_t kBudgetVersion = 1;
constexpr uint32_t kBudgetSlots = 64;

struct BudgetHeader {
  char magic[8];
  uint32_t version;
  uint32_t num_slots;
  uint64_t capacity;
  uint64_t revision;
  uint64_t reserved[4];
};
static_assert(sizeof(BudgetHeader) == 64, "budget header layout is shared with Python");

struct BudgetSlot {
  int64_t pid;
  uint64_t start_time;
  uint64_t charged;
  uint64_t attached;
};
static_assert(sizeof(BudgetSlot) == 32, "budget slot layout is shared with Python");

constexpr size_t kBudgetFileBytes = sizeof(BudgetHeader) + kBudgetSlots * sizeof(BudgetSlot);

// Start time of a process (clock ticks after boot), 0 if it does not exist.
uint64_t process_start_time(int64_t pid);

// One process's membership of a budget file: the open fd, the mapping and its own slot.
// Thread-safe; every operation takes the file lock.
class SharedBudget {
 public:
  // Opens an existing budget file and takes (or shares, within this process) a slot.
  // Throws ConfigError if the file is missing or not a budget, OutOfMemoryError if every slot
  // belongs to a live process.
  SharedBudget(std::string name, const std::string& path);
  ~SharedBudget();
  SharedBudget(const SharedBudget&) = delete;
  SharedBudget& operator=(const SharedBudget&) = delete;

  // Charges `bytes` to this process's slot, or refuses (nothing changed) with the reason.
  OpResult charge(size_t bytes);
  void refund(size_t bytes);

  // Capacity minus what live members hold (0 when over).
  size_t free_bytes();
  size_t capacity();
  const std::string& name() const { return name_; }
  const std::string& path() const { return path_; }

 private:
  class FileLock;
  uint64_t sum_charged_locked() const;
  void reclaim_dead_locked();
  size_t find_own_slot_locked() const;

  const std::string name_;
  const std::string path_;
  int fd_ = -1;
  void* mapping_ = nullptr;
  BudgetHeader* header_ = nullptr;
  BudgetSlot* slots_ = nullptr;
  const int64_t pid_;
  const uint64_t start_time_;
  size_t slot_ = 0;
  std::mutex mutex_;  // flock does not exclude threads sharing this fd
};

// Decorates any Backend: create_handle is charged to a SharedBudget first (refused as out of
// memory when the budget is spent), release_handle refunds it once the inner release succeeded.
class BudgetedBackend : public Backend {
 public:
  BudgetedBackend(std::shared_ptr<Backend> inner, std::shared_ptr<SharedBudget> budget);

  DeviceKind device_kind() const override { return inner_->device_kind(); }
  int device_id() const override { return inner_->device_id(); }
  size_t granularity() const override { return inner_->granularity(); }

  uintptr_t reserve_range(size_t size) override { return inner_->reserve_range(size); }
  OpResult free_range(uintptr_t va, size_t size) override { return inner_->free_range(va, size); }
  OpResult create_handle(size_t size, uint64_t* handle) override;
  OpResult release_handle(uint64_t handle, size_t size) override;
  OpResult map_handle(uintptr_t va, size_t size, uint64_t handle) override {
    return inner_->map_handle(va, size, handle);
  }
  OpResult set_access(uintptr_t va, size_t size) override { return inner_->set_access(va, size); }
  OpResult unmap_range(uintptr_t va, size_t size) override {
    return inner_->unmap_range(va, size);
  }
  OpResult map_zero(uintptr_t va, size_t size) override { return inner_->map_zero(va, size); }
  bool zero_page_read_only() const override { return inner_->zero_page_read_only(); }
  void set_zero_page_writable(bool writable) override {
    inner_->set_zero_page_writable(writable);
  }
  size_t physical_free_bytes() override;
  std::map<std::string, OpStat> op_stats() const override { return inner_->op_stats(); }

  const std::shared_ptr<Backend>& inner() const { return inner_; }
  const std::shared_ptr<SharedBudget>& budget() const { return budget_; }
  // Bytes this backend has charged and not yet refunded.
  size_t charged_bytes() const;

 private:
  std::shared_ptr<Backend> inner_;
  std::shared_ptr<SharedBudget> budget_;
  mutable std::mutex mutex_;
  size_t charged_ = 0;
};

}  // namespace kvcached
