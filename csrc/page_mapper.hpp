// PageMapper: how a PageAllocator puts physical memory behind logical page ids.
//
// Two implementations: FTensorAllocator maps the tensors of this process; a Python subclass
// (kvcached_core.ipc.coordinator.BroadcastMapper) forwards every call to the worker processes
// that own the tensors. The PageAllocator never holds its own lock while calling a PageMapper,
// because a Python implementation takes the GIL and may wait on sockets.
//
// Contract (every implementation):
// - map_pages is all or nothing and returns the ids it newly mapped. On failure it throws
//   OutOfMemoryError / BackendError after a clean rollback, QuarantineError when the rollback
//   was uncertain (the ids concerned then appear in quarantined_page_ids()), StateError when the
//   state of memory is unknown.
// - unmap_pages unmaps ids that are all mapped; any failure is a StateError.
// - prepare/commit/abort_unmap is the two-phase unmap with an idempotent transaction history.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace kvcached {

class PageMapper {
 public:
  virtual ~PageMapper() = default;

  virtual std::vector<int64_t> map_pages(const std::vector<int64_t>& page_ids) = 0;
  virtual void unmap_pages(const std::vector<int64_t>& page_ids) = 0;

  virtual void prepare_unmap(int64_t txn_id, const std::vector<int64_t>& page_ids) = 0;
  virtual void commit_unmap(int64_t txn_id) = 0;
  virtual void abort_unmap(int64_t txn_id) = 0;
  virtual std::optional<int64_t> pending_txn() const = 0;

  virtual std::vector<int64_t> mapped_page_ids() const = 0;
  virtual std::vector<int64_t> quarantined_page_ids() const = 0;

  virtual size_t num_logical_pages() const = 0;
  // Bytes of physical memory one logical page holds (summed over every rank for a broadcast).
  virtual size_t logical_page_bytes() const = 0;
  virtual bool tensors_created() const = 0;
  // Logical pages that could still be mapped with the physical memory free now.
  virtual size_t physical_free_pages() const = 0;
};

}  // namespace kvcached
