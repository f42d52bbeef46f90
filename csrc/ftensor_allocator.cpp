#include "ftensor_allocator.hpp"

#include <algorithm>
#include <set>
#include <string>

#include "errors.hpp"

namespace kvcached {
namespace {

std::string id_list(const std::vector<int64_t>& ids) {
  std::string text = "[";
  for (size_t i = 0; i < ids.size(); ++i) text += (i ? ", " : "") + std::to_string(ids[i]);
  return text + "]";
}

}  // namespace

FTensorAllocator::FTensorAllocator(std::shared_ptr<Backend> backend, size_t page_size,
                                   bool contiguous)
    : backend_(std::move(backend)), page_size_(page_size), contiguous_(contiguous) {
  const size_t granularity = backend_->granularity();
  if (page_size_ == 0 || page_size_ % granularity != 0) {
    throw ConfigError("page_size " + std::to_string(page_size_) +
                      " must be a positive multiple of the backend granularity " +
                      std::to_string(granularity));
  }
}

std::vector<std::shared_ptr<FTensor>> FTensorAllocator::create_kv_tensors(
    size_t bytes_per_layer_per_buffer, size_t num_layers, size_t num_kv_buffers) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!tensors_.empty()) {
    throw ConfigError("create_kv_tensors was already called for this allocator; create a new "
                      "FTensorAllocator for another KV group");
  }
  if (num_layers == 0 || num_kv_buffers == 0) {
    throw ConfigError("num_layers and num_kv_buffers must be >= 1");
  }
  if (bytes_per_layer_per_buffer == 0 || bytes_per_layer_per_buffer % page_size_ != 0) {
    throw ConfigError("bytes_per_layer_per_buffer " + std::to_string(bytes_per_layer_per_buffer) +
                      " must be a positive multiple of page_size " + std::to_string(page_size_) +
                      " (round it down to whole pages)");
  }
  std::vector<std::shared_ptr<FTensor>> created;
  if (contiguous_) {
    const size_t unit = page_size_ * num_layers * num_kv_buffers;
    created.push_back(std::make_shared<FTensor>(
        backend_, "kv_contiguous", bytes_per_layer_per_buffer * num_layers * num_kv_buffers, unit));
  } else {
    for (size_t layer = 0; layer < num_layers; ++layer) {
      created.push_back(std::make_shared<FTensor>(backend_, "kv_" + std::to_string(layer),
                                                  bytes_per_layer_per_buffer * num_kv_buffers,
                                                  page_size_));
    }
  }
  tensors_ = created;
  bytes_per_layer_per_buffer_ = bytes_per_layer_per_buffer;
  num_layers_ = num_layers;
  num_kv_buffers_ = num_kv_buffers;
  page_state_.assign(bytes_per_layer_per_buffer / page_size_, PageState::kUnmapped);
  return created;
}

std::vector<FTensorAllocator::Target> FTensorAllocator::targets_locked(int64_t page_id) const {
  const auto page = static_cast<size_t>(page_id);
  std::vector<Target> targets;
  if (contiguous_) {
    const size_t unit = page_size_ * num_layers_ * num_kv_buffers_;
    targets.push_back({tensors_[0].get(), page * unit});
    return targets;
  }
  targets.reserve(num_layers_ * num_kv_buffers_);
  for (const auto& tensor : tensors_) {
    for (size_t buffer = 0; buffer < num_kv_buffers_; ++buffer) {
      targets.push_back({tensor.get(), buffer * bytes_per_layer_per_buffer_ + page * page_size_});
    }
  }
  return targets;
}

std::vector<std::pair<size_t, size_t>> FTensorAllocator::page_targets(int64_t page_id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  require_tensors_locked();
  checked_ids_locked({page_id});
  std::vector<std::pair<size_t, size_t>> result;
  for (const Target& target : targets_locked(page_id)) {
    size_t index = 0;
    while (tensors_[index].get() != target.tensor) ++index;
    result.emplace_back(index, target.offset);
  }
  return result;
}

void FTensorAllocator::require_tensors_locked() const {
  if (tensors_.empty()) throw ConfigError("create_kv_tensors has not been called yet");
}

void FTensorAllocator::require_no_pending_locked(const char* operation) const {
  if (pending_) {
    throw StateError(std::string(operation) + " refused: unmap transaction " +
                     std::to_string(pending_->txn_id) + " is pending");
  }
}

std::vector<int64_t> FTensorAllocator::checked_ids_locked(const std::vector<int64_t>& ids) const {
  std::vector<int64_t> unique;
  std::set<int64_t> seen;
  for (int64_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= page_state_.size()) {
      throw ConfigError("page id " + std::to_string(id) + " is out of range [0, " +
                        std::to_string(page_state_.size()) + ")");
    }
    if (seen.insert(id).second) unique.push_back(id);
  }
  return unique;
}

std::vector<int64_t> FTensorAllocator::map_pages(const std::vector<int64_t>& page_ids) {
  std::lock_guard<std::mutex> lock(mutex_);
  require_tensors_locked();
  require_no_pending_locked("map");
  const std::vector<int64_t> ids = checked_ids_locked(page_ids);
  for (int64_t id : ids) {
    if (page_state_[static_cast<size_t>(id)] == PageState::kQuarantined) {
      throw QuarantineError("page id " + std::to_string(id) + " is quarantined");
    }
    if (page_state_[static_cast<size_t>(id)] == PageState::kUnmapped) {
      for (const Target& target : targets_locked(id)) {
        if (target.tensor->is_mapped(target.offset)) {
          throw StateError("page id " + std::to_string(id) + " is partially mapped");
        }
      }
    }
  }

  std::vector<int64_t> newly_mapped;
  std::vector<std::pair<int64_t, Target>> done;  // units mapped by this call, for rollback
  std::vector<int64_t> quarantined;
  std::string failure;
  bool out_of_memory = false;
  try {
    for (int64_t id : ids) {
      if (page_state_[static_cast<size_t>(id)] == PageState::kMapped) continue;
      for (const Target& target : targets_locked(id)) {
        target.tensor->map(target.offset);
        done.emplace_back(id, target);
      }
      page_state_[static_cast<size_t>(id)] = PageState::kMapped;
      newly_mapped.push_back(id);
    }
    return newly_mapped;
  } catch (const QuarantineError& error) {
    failure = error.what();
    // The failing id is the first one of `ids` not yet in newly_mapped.
    for (int64_t id : ids) {
      if (page_state_[static_cast<size_t>(id)] != PageState::kMapped) {
        quarantined.push_back(id);
        break;
      }
    }
  } catch (const OutOfMemoryError& error) {
    failure = error.what();
    out_of_memory = true;
  } catch (const std::exception& error) {
    failure = error.what();
  }

  // Roll back every unit this call mapped, newest first.
  for (auto it = done.rbegin(); it != done.rend(); ++it) {
    try {
      it->second.tensor->unmap(it->second.offset);
    } catch (const std::exception&) {
      if (std::find(quarantined.begin(), quarantined.end(), it->first) == quarantined.end()) {
        quarantined.push_back(it->first);
      }
    }
  }
  for (int64_t id : newly_mapped) page_state_[static_cast<size_t>(id)] = PageState::kUnmapped;
  for (int64_t id : quarantined) page_state_[static_cast<size_t>(id)] = PageState::kQuarantined;
  if (!quarantined.empty()) {
    std::sort(quarantined.begin(), quarantined.end());
    throw QuarantineError("map of pages " + id_list(ids) + " failed (" + failure +
                          "); rollback was uncertain, quarantined page ids " +
                          id_list(quarantined));
  }
  if (out_of_memory) throw OutOfMemoryError(failure);
  throw BackendError(failure);
}

void FTensorAllocator::unmap_pages(const std::vector<int64_t>& page_ids) {
  std::lock_guard<std::mutex> lock(mutex_);
  require_tensors_locked();
  require_no_pending_locked("unmap");
  const std::vector<int64_t> ids = checked_ids_locked(page_ids);
  for (int64_t id : ids) {
    if (page_state_[static_cast<size_t>(id)] != PageState::kMapped) {
      throw StateError("page id " + std::to_string(id) + " is not mapped");
    }
  }
  for (int64_t id : ids) {
    for (const Target& target : targets_locked(id)) {
      try {
        target.tensor->unmap(target.offset);
      } catch (const std::exception& error) {
        page_state_[static_cast<size_t>(id)] = PageState::kQuarantined;
        throw StateError("unmap of page id " + std::to_string(id) + " failed: " + error.what());
      }
    }
    page_state_[static_cast<size_t>(id)] = PageState::kUnmapped;
  }
}

std::optional<FTensorAllocator::TxnOutcome> FTensorAllocator::finished_outcome_locked(
    int64_t txn_id) const {
  for (const auto& [id, outcome] : finished_) {
    if (id == txn_id) return outcome;
  }
  return std::nullopt;
}

void FTensorAllocator::remember_locked(int64_t txn_id, TxnOutcome outcome) {
  finished_.emplace_back(txn_id, outcome);
  while (finished_.size() > kTxnHistory) finished_.pop_front();
}

std::vector<int64_t> FTensorAllocator::restore_locked(std::vector<RetainedPage>* retained) {
  std::vector<int64_t> quarantined;
  for (auto it = retained->rbegin(); it != retained->rend(); ++it) {
    try {
      it->target.tensor->restore(it->target.offset, std::move(it->page));
    } catch (const std::exception&) {
      page_state_[static_cast<size_t>(it->page_id)] = PageState::kQuarantined;
      quarantined.push_back(it->page_id);
    }
  }
  for (const RetainedPage& entry : *retained) {
    auto& state = page_state_[static_cast<size_t>(entry.page_id)];
    if (state != PageState::kQuarantined) state = PageState::kMapped;
  }
  retained->clear();
  return quarantined;
}

void FTensorAllocator::prepare_unmap(int64_t txn_id, const std::vector<int64_t>& page_ids) {
  std::lock_guard<std::mutex> lock(mutex_);
  require_tensors_locked();
  const std::vector<int64_t> ids = checked_ids_locked(page_ids);
  if (pending_) {
    if (pending_->txn_id == txn_id && pending_->page_ids == ids) return;  // a repeated prepare
    throw StateError("prepare of unmap transaction " + std::to_string(txn_id) +
                     " refused: transaction " + std::to_string(pending_->txn_id) + " is pending");
  }
  if (auto outcome = finished_outcome_locked(txn_id)) {
    if (*outcome == TxnOutcome::kCommitted) return;  // a late duplicate of a finished prepare
    throw StateError("prepare of unmap transaction " + std::to_string(txn_id) +
                     " rejected: it was already aborted");
  }
  for (int64_t id : ids) {
    if (page_state_[static_cast<size_t>(id)] != PageState::kMapped) {
      throw StateError("page id " + std::to_string(id) + " is not mapped");
    }
  }
  PendingUnmap pending{txn_id, ids, {}};
  for (int64_t id : ids) {
    for (const Target& target : targets_locked(id)) {
      try {
        pending.retained.push_back({id, target, target.tensor->unmap_retain(target.offset)});
      } catch (const std::exception& error) {
        page_state_[static_cast<size_t>(id)] = PageState::kQuarantined;
        std::vector<int64_t> lost = restore_locked(&pending.retained);
        throw StateError("prepare of unmap transaction " + std::to_string(txn_id) +
                         " failed on page id " + std::to_string(id) + ": " + error.what() +
                         (lost.empty() ? "" : "; quarantined page ids " + id_list(lost)));
      }
    }
    page_state_[static_cast<size_t>(id)] = PageState::kPendingUnmap;
  }
  pending_ = std::move(pending);
}

void FTensorAllocator::commit_unmap(int64_t txn_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!pending_ || pending_->txn_id != txn_id) {
    auto outcome = finished_outcome_locked(txn_id);
    if (outcome == TxnOutcome::kCommitted) return;  // idempotent
    if (outcome == TxnOutcome::kAborted) {
      throw StateError("commit of unmap transaction " + std::to_string(txn_id) +
                       " refused: it was aborted");
    }
    throw StateError("commit of unknown unmap transaction " + std::to_string(txn_id));
  }
  std::vector<int64_t> failed;
  std::string reason;
  for (RetainedPage& entry : pending_->retained) {
    OpResult released = entry.page->release();
    if (!released.is_ok()) {
      failed.push_back(entry.page_id);
      reason = released.message;
      page_state_[static_cast<size_t>(entry.page_id)] = PageState::kQuarantined;
    }
  }
  for (int64_t id : pending_->page_ids) {
    auto& state = page_state_[static_cast<size_t>(id)];
    if (state != PageState::kQuarantined) state = PageState::kUnmapped;
  }
  pending_.reset();  // pages whose release failed are dropped by their RAII owner (best effort)
  remember_locked(txn_id, TxnOutcome::kCommitted);
  if (!failed.empty()) {
    throw StateError("commit of unmap transaction " + std::to_string(txn_id) +
                     ": releasing pages " + id_list(failed) + " failed: " + reason);
  }
}

void FTensorAllocator::abort_unmap(int64_t txn_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!pending_ || pending_->txn_id != txn_id) {
    auto outcome = finished_outcome_locked(txn_id);
    if (outcome == TxnOutcome::kAborted) return;  // idempotent
    if (outcome == TxnOutcome::kCommitted) {
      throw StateError("abort of unmap transaction " + std::to_string(txn_id) +
                       " refused: it was committed");
    }
    // Never prepared here: remember the abort so that a late prepare is rejected.
    remember_locked(txn_id, TxnOutcome::kAborted);
    return;
  }
  std::vector<int64_t> lost = restore_locked(&pending_->retained);
  pending_.reset();
  remember_locked(txn_id, TxnOutcome::kAborted);
  if (!lost.empty()) {
    std::sort(lost.begin(), lost.end());
    throw QuarantineError("abort of unmap transaction " + std::to_string(txn_id) +
                          " could not map back page ids " + id_list(lost) + "; they are quarantined");
  }
}

std::optional<int64_t> FTensorAllocator::pending_txn() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!pending_) return std::nullopt;
  return pending_->txn_id;
}

std::vector<int64_t> FTensorAllocator::mapped_page_ids() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> ids;
  for (size_t id = 0; id < page_state_.size(); ++id) {
    if (page_state_[id] == PageState::kMapped) ids.push_back(static_cast<int64_t>(id));
  }
  return ids;
}

std::vector<int64_t> FTensorAllocator::quarantined_page_ids() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> ids;
  for (size_t id = 0; id < page_state_.size(); ++id) {
    if (page_state_[id] == PageState::kQuarantined) ids.push_back(static_cast<int64_t>(id));
  }
  return ids;
}

size_t FTensorAllocator::num_quarantined() const { return quarantined_page_ids().size(); }

size_t FTensorAllocator::num_logical_pages() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return page_state_.size();
}

size_t FTensorAllocator::logical_page_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return page_size_ * num_layers_ * num_kv_buffers_;
}

bool FTensorAllocator::tensors_created() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !tensors_.empty();
}

std::vector<std::shared_ptr<FTensor>> FTensorAllocator::tensors() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return tensors_;
}

}  // namespace kvcached
