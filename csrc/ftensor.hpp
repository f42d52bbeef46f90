// FTensor: a stable virtual address range whose physical memory is mapped unit by unit.
//
// Invariants (kept under mutex_, the callers serialise mutations through FTensorAllocator):
// - every unit of the range is mapped either to its own PhysicalPage (listed in mapping_) or to
//   the backend's zero page (read-only unless the backend was made writable), except units
//   listed in uncertain_units_, whose state is unknown after a failed rollback and which are
//   never mapped again;
// - a PhysicalPage whose rollback was uncertain is kept in quarantine_ until destruction and is
//   never reused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "backend.hpp"

namespace kvcached {

class FTensor {
 public:
  // Reserves `size` bytes and maps the zero page at every unit of `unit_size` bytes.
  FTensor(std::shared_ptr<Backend> backend, std::string name, size_t size, size_t unit_size);
  ~FTensor();
  FTensor(const FTensor&) = delete;
  FTensor& operator=(const FTensor&) = delete;

  // Backs the unit at `offset` with a fresh physical page. On failure the zero page is restored
  // and the page released; throws OutOfMemoryError / BackendError (clean rollback) or
  // QuarantineError (rollback uncertain: the page is quarantined).
  void map(size_t offset);
  // Unmaps the unit (the zero page comes back) and releases its page. Throws StateError.
  void unmap(size_t offset);
  // Unmaps the unit (the zero page comes back) and hands its page to the caller.
  std::unique_ptr<PhysicalPage> unmap_retain(size_t offset);
  // Maps a retained page back at `offset`; on failure the page is quarantined (QuarantineError).
  void restore(size_t offset, std::unique_ptr<PhysicalPage> page);

  bool is_mapped(size_t offset) const;
  std::vector<size_t> mapped_offsets() const;
  size_t num_mapped() const;
  // Pages kept out of use after an uncertain rollback, and units whose mapping is unknown.
  size_t num_quarantined() const;
  size_t num_uncertain_units() const;

  const std::string& name() const { return name_; }
  uintptr_t vaddr() const { return vaddr_; }
  size_t size() const { return size_; }
  size_t unit_size() const { return unit_size_; }
  const std::shared_ptr<Backend>& backend() const { return backend_; }

 private:
  void check_unit(size_t offset) const;  // throws ConfigError
  // Maps `page` at the (zero-mapped) unit. Returns the first failure; `rollback_ok` tells whether
  // the unit is back on the zero page with `page` unmapped.
  OpResult install(size_t offset, const PhysicalPage& page, bool* rollback_ok);
  void quarantine_locked(size_t offset, std::unique_ptr<PhysicalPage> page);

  const std::shared_ptr<Backend> backend_;
  const std::string name_;
  const size_t size_;
  const size_t unit_size_;
  uintptr_t vaddr_ = 0;

  mutable std::mutex mutex_;  // guards the three members below
  std::map<size_t, std::unique_ptr<PhysicalPage>> mapping_;  // unit offset -> its page
  std::vector<std::unique_ptr<PhysicalPage>> quarantine_;
  std::set<size_t> uncertain_units_;
};

}  // namespace kvcached
