// FTensorAllocator: the KV tensors of one group and the mapping of logical page ids onto them.
//
// Layouts (bpb = bytes_per_layer_per_buffer, L = num_layers, B = num_kv_buffers, P = page_size):
// - per-layer: one FTensor per layer of B * bpb bytes ([K region | V region]); logical page p is
//   the unit at offset b * bpb + p * P of every layer, for every buffer b (L * B mappings).
// - contiguous: one FTensor of L * B * bpb bytes; logical page p is ONE compound unit of
//   P * L * B bytes at offset p * P * L * B.
//
// Invariants (under mutex_, which serialises every map, unmap and transaction of the group):
// - page_state_[p] == kMapped  <=> every target unit of p holds its own physical page;
// - page_state_[p] == kUnmapped <=> every target unit of p holds the zero page;
// - kQuarantined pages are in an unknown or untrusted state and are never mapped again;
// - at most one two-phase unmap is pending; while it is, map and unmap are refused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "ftensor.hpp"
#include "page_mapper.hpp"

namespace kvcached {

class FTensorAllocator : public PageMapper {
 public:
  FTensorAllocator(std::shared_ptr<Backend> backend, size_t page_size, bool contiguous);

  std::vector<std::shared_ptr<FTensor>> create_kv_tensors(size_t bytes_per_layer_per_buffer,
                                                          size_t num_layers, size_t num_kv_buffers);

  // All or nothing. Returns the ids that were not mapped before (already mapped ids are skipped).
  // Throws OutOfMemoryError / BackendError after a clean rollback, QuarantineError when the
  // rollback was uncertain (those ids are quarantined), StateError on a protocol violation.
  std::vector<int64_t> map_pages(const std::vector<int64_t>& page_ids) override;
  // Every id must be mapped. A failure is a StateError (the id is quarantined).
  void unmap_pages(const std::vector<int64_t>& page_ids) override;

  // Two-phase unmap: prepare unmaps to the zero page and retains the physical pages; commit
  // releases them, abort maps them back. Finished ids are remembered (last 64) so that repeated
  // commits/aborts are no-ops and a prepare that arrives after its abort is rejected.
  void prepare_unmap(int64_t txn_id, const std::vector<int64_t>& page_ids) override;
  void commit_unmap(int64_t txn_id) override;
  void abort_unmap(int64_t txn_id) override;
  std::optional<int64_t> pending_txn() const override;

  std::vector<int64_t> mapped_page_ids() const override;
  std::vector<int64_t> quarantined_page_ids() const override;
  size_t num_quarantined() const;
  // (tensor index, byte offset) of every unit logical page `page_id` maps.
  std::vector<std::pair<size_t, size_t>> page_targets(int64_t page_id) const;

  size_t num_logical_pages() const override;
  size_t logical_page_bytes() const override;
  size_t page_size() const { return page_size_; }
  bool contiguous() const { return contiguous_; }
  bool tensors_created() const override;
  std::vector<std::shared_ptr<FTensor>> tensors() const;
  const std::shared_ptr<Backend>& backend() const { return backend_; }
  size_t physical_free_pages() const override {
    const size_t bytes = logical_page_bytes();
    return bytes == 0 ? 0 : backend_->physical_free_bytes() / bytes;
  }

  static constexpr size_t kTxnHistory = 64;

 private:
  enum class PageState : uint8_t { kUnmapped, kMapped, kPendingUnmap, kQuarantined };
  enum class TxnOutcome : uint8_t { kCommitted, kAborted };
  struct Target {
    FTensor* tensor;
    size_t offset;
  };
  struct RetainedPage {
    int64_t page_id;
    Target target;
    std::unique_ptr<PhysicalPage> page;
  };
  struct PendingUnmap {
    int64_t txn_id;
    std::vector<int64_t> page_ids;
    std::vector<RetainedPage> retained;
  };

  std::vector<Target> targets_locked(int64_t page_id) const;
  void require_tensors_locked() const;
  void require_no_pending_locked(const char* operation) const;
  std::vector<int64_t> checked_ids_locked(const std::vector<int64_t>& page_ids) const;
  std::optional<TxnOutcome> finished_outcome_locked(int64_t txn_id) const;
  void remember_locked(int64_t txn_id, TxnOutcome outcome);
  // Puts retained pages back; ids that cannot be restored are quarantined (returned).
  std::vector<int64_t> restore_locked(std::vector<RetainedPage>* retained);

  const std::shared_ptr<Backend> backend_;
  const size_t page_size_;
  const bool contiguous_;

  mutable std::mutex mutex_;  // guards everything below
  std::vector<std::shared_ptr<FTensor>> tensors_;
  size_t bytes_per_layer_per_buffer_ = 0;
  size_t num_layers_ = 0;
  size_t num_kv_buffers_ = 0;
  std::vector<PageState> page_state_;
  std::optional<PendingUnmap> pending_;
  std::deque<std::pair<int64_t, TxnOutcome>> finished_;
};

}  // namespace kvcached
