// PageAllocator: which logical pages of one PageMapper are free, reserved or in use.
//
// The PageMapper is this process's FTensorAllocator, or a broadcast to the worker processes
// that own the tensors (kvcached_core.ipc). It is never called under mutex_: a Python mapper
// takes the GIL, and a Python thread holding the GIL may be waiting for mutex_.
//
// States of a logical page id (each id is in exactly one place, under mutex_):
//   free_          unmapped, available
//   reserved_      mapped and idle (the reserve pool; alloc takes these first: a "reserve hit")
//   in_use_        handed out by alloc_pages
//   quarantined_   a map rollback was uncertain; never handed out again
//   in flight      being mapped (by alloc or the refill thread) or unmapped, outside mutex_
// Limits: in_use + reserved + refilling <= capacity, except that a shrink never revokes pages in
// use (set_capacity returns false and the limit holds for new allocations). The reserve never
// holds more than max_reserved pages.
// Map and unmap batches run outside mutex_ (callers release the GIL), so a slow driver call never
// blocks counters, other frees, or Python.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ftensor_allocator.hpp"
#include "page_mapper.hpp"

namespace kvcached {

class PageAllocator {
 public:
  // The mapper must have no transaction pending. Pages it already maps are refused (ConfigError)
  // unless adopt_mapped is set: then they join the reserve pool (lowest ids, up to
  // max_reserved) and the rest are unmapped here. Its quarantined pages are never handed out.
  PageAllocator(std::shared_ptr<PageMapper> mapper, size_t min_reserved, size_t max_reserved,
                bool prealloc, bool adopt_mapped = false);
  ~PageAllocator();
  PageAllocator(const PageAllocator&) = delete;
  PageAllocator& operator=(const PageAllocator&) = delete;

  // All or nothing; lowest ids first. OutOfMemoryError (-> PoolExhausted) leaves nothing changed.
  std::vector<int64_t> alloc_pages(size_t count);
  // Every id must be in use (StateError naming the first one that is not; nothing changed).
  void free_pages(const std::vector<int64_t>& page_ids);
  // Returns false when pages in use still exceed the new capacity.
  bool set_capacity(size_t pages);
  // Unmaps the whole reserve.
  void trim();
  size_t physical_free_pages() const;
  // Stops and joins the refill thread (idempotent; also done on destruction).
  void stop();

  std::string state() const;  // "healthy" | "degraded" | "failed"
  std::string failure_reason() const;
  // Pages the next alloc_pages can hand out, with at most `limit` in use: free and reserved
  // ids plus those a refill or an unmap holds for a moment (alloc_pages waits for them).
  size_t allocatable_pages(size_t limit) const;
  size_t num_free() const;
  size_t num_reserved() const;
  size_t num_in_use() const;
  size_t num_quarantined() const;
  size_t capacity() const;
  size_t num_total() const { return num_total_; }
  size_t min_reserved() const { return min_reserved_; }
  size_t max_reserved() const { return max_reserved_; }
  std::vector<int64_t> reserved_page_ids() const;
  const std::shared_ptr<PageMapper>& mapper() const { return mapper_; }
  // The local FTensorAllocator, or nullptr when the pages are mapped elsewhere.
  std::shared_ptr<FTensorAllocator> ftensor_allocator() const {
    return std::dynamic_pointer_cast<FTensorAllocator>(mapper_);
  }

  uint64_t reserve_hits() const { return reserve_hits_.load(std::memory_order_relaxed); }
  uint64_t reserve_misses() const { return reserve_misses_.load(std::memory_order_relaxed); }
  uint64_t map_calls() const { return map_calls_.load(std::memory_order_relaxed); }
  uint64_t map_ns_total() const { return map_ns_total_.load(std::memory_order_relaxed); }
  uint64_t unmap_calls() const { return unmap_calls_.load(std::memory_order_relaxed); }
  uint64_t unmap_ns_total() const { return unmap_ns_total_.load(std::memory_order_relaxed); }

 private:
  void refill_loop();
  void request_refill_locked();
  void check_usable_locked() const;
  void fail_locked(const std::string& reason);
  // Maps `ids` (outside mutex_). Returns normally or rethrows after updating the counters.
  void timed_map(const std::vector<int64_t>& ids);
  // Unmaps `ids` (counted in unmapping_, outside mutex_), then returns them to free_; a failure
  // fails the pool and throws StateError.
  void unmap_to_free(const std::vector<int64_t>& ids);
  // Ids of `candidates` that the mapper quarantined (all of them when it cannot tell).
  // Called WITHOUT mutex_ (the mapper may be remote).
  std::vector<int64_t> quarantined_among(const std::vector<int64_t>& candidates) const;
  std::vector<int64_t> take_lowest_locked(std::set<int64_t>* from, size_t count);

  const std::shared_ptr<PageMapper> mapper_;
  const size_t num_total_;
  const size_t min_reserved_;
  const size_t max_reserved_;

  mutable std::mutex mutex_;              // guards everything below up to the counters
  std::condition_variable work_settled_;  // in-flight refill/unmap finished
  std::condition_variable refill_wanted_;
  std::set<int64_t> free_;
  std::set<int64_t> reserved_;
  std::vector<bool> in_use_;
  size_t num_in_use_ = 0;  // includes pages an alloc_pages call is still mapping
  std::set<int64_t> quarantined_;
  size_t refilling_ = 0;
  size_t unmapping_ = 0;
  size_t capacity_;
  bool refill_requested_ = false;
  uint64_t trim_generation_ = 0;  // bumped by trim(): a refill decided before it is dropped
  bool stopping_ = false;
  bool failed_ = false;
  std::string failure_reason_;

  std::atomic<uint64_t> reserve_hits_{0};
  std::atomic<uint64_t> reserve_misses_{0};
  std::atomic<uint64_t> map_calls_{0};
  std::atomic<uint64_t> map_ns_total_{0};
  std::atomic<uint64_t> unmap_calls_{0};
  std::atomic<uint64_t> unmap_ns_total_{0};

  std::thread refill_thread_;  // last member: started once everything else exists
};

}  // namespace kvcached
