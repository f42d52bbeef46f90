#include "page_allocator.hpp"

#include <algorithm>
#include <chrono>

#include "errors.hpp"

namespace kvcached {
namespace {

uint64_t elapsed_ns(std::chrono::steady_clock::time_point since) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now() - since)
                                   .count());
}

std::shared_ptr<PageMapper> require_mapper(std::shared_ptr<PageMapper> mapper) {
  if (!mapper) throw ConfigError("a PageAllocator needs a page mapper (an FTensorAllocator)");
  return mapper;
}

}  // namespace

PageAllocator::PageAllocator(std::shared_ptr<PageMapper> mapper, size_t min_reserved,
                             size_t max_reserved, bool prealloc, bool adopt_mapped)
    : mapper_(require_mapper(std::move(mapper))),
      num_total_(mapper_->num_logical_pages()),
      min_reserved_(std::min(min_reserved, num_total_)),
      max_reserved_(std::min(max_reserved, num_total_)),
      capacity_(num_total_) {
  if (!mapper_->tensors_created()) {
    throw ConfigError("create_kv_tensors must be called before building a PageAllocator");
  }
  if (min_reserved > max_reserved) {
    throw ConfigError("min_reserved (" + std::to_string(min_reserved) +
                      ") must not exceed max_reserved (" + std::to_string(max_reserved) + ")");
  }
  if (auto txn = mapper_->pending_txn()) {
    throw ConfigError("a PageAllocator needs a page mapper with no unmap transaction pending "
                      "(transaction " + std::to_string(*txn) + " is)");
  }
  std::vector<int64_t> mapped = mapper_->mapped_page_ids();
  if (!mapped.empty() && !adopt_mapped) {
    throw ConfigError("a PageAllocator needs an FTensorAllocator with no page mapped yet (" +
                      std::to_string(mapped.size()) +
                      " mapped; pass adopt_mapped=True to take them over)");
  }
  in_use_.assign(num_total_, false);
  auto check_id = [this](int64_t id, const char* what) {
    if (id < 0 || static_cast<size_t>(id) >= num_total_) {
      throw StateError(std::string("the page mapper reports ") + what + " page id " +
                       std::to_string(id) + " outside [0, " + std::to_string(num_total_) + ")");
    }
  };
  for (int64_t id : mapper_->quarantined_page_ids()) {
    check_id(id, "quarantined");
    quarantined_.insert(id);
  }
  std::sort(mapped.begin(), mapped.end());
  mapped.erase(std::unique(mapped.begin(), mapped.end()), mapped.end());
  std::vector<int64_t> excess;
  for (int64_t id : mapped) {
    check_id(id, "mapped");
    if (reserved_.size() < max_reserved_) {
      reserved_.insert(id);
    } else {
      excess.push_back(id);
    }
  }
  // Adopted pages beyond what the reserve may hold go back now, before any thread starts.
  if (!excess.empty()) mapper_->unmap_pages(excess);
  for (size_t id = 0; id < num_total_; ++id) {
    const auto page = static_cast<int64_t>(id);
    if (reserved_.count(page) == 0 && quarantined_.count(page) == 0) free_.insert(page);
  }
  refill_requested_ = prealloc && min_reserved_ > 0;
  refill_thread_ = std::thread([this] { refill_loop(); });
}

PageAllocator::~PageAllocator() { stop(); }

void PageAllocator::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  refill_wanted_.notify_all();
  if (refill_thread_.joinable() && refill_thread_.get_id() != std::this_thread::get_id()) {
    refill_thread_.join();
  }
}

void PageAllocator::check_usable_locked() const {
  if (failed_) throw StateError("page pool failed: " + failure_reason_);
}

void PageAllocator::fail_locked(const std::string& reason) {
  if (!failed_) {
    failed_ = true;
    failure_reason_ = reason;
  }
}

void PageAllocator::request_refill_locked() {
  if (min_reserved_ == 0 || stopping_) return;
  if (reserved_.size() + refilling_ >= min_reserved_) return;
  refill_requested_ = true;
  refill_wanted_.notify_one();
}

std::vector<int64_t> PageAllocator::take_lowest_locked(std::set<int64_t>* from, size_t count) {
  std::vector<int64_t> taken;
  taken.reserve(count);
  auto it = from->begin();
  for (size_t i = 0; i < count; ++i) taken.push_back(*it++);
  from->erase(from->begin(), it);
  return taken;
}

std::vector<int64_t> PageAllocator::quarantined_among(
    const std::vector<int64_t>& candidates) const {
  std::vector<int64_t> all;
  try {
    all = mapper_->quarantined_page_ids();
  } catch (const std::exception&) {
    return candidates;  // the mapper cannot say which ones: none of them is trusted again
  }
  std::sort(all.begin(), all.end());
  std::vector<int64_t> hit;
  for (int64_t id : candidates) {
    if (std::binary_search(all.begin(), all.end(), id)) hit.push_back(id);
  }
  return hit;
}

void PageAllocator::timed_map(const std::vector<int64_t>& ids) {
  auto start = std::chrono::steady_clock::now();
  try {
    mapper_->map_pages(ids);
  } catch (...) {
    map_calls_.fetch_add(1, std::memory_order_relaxed);
    map_ns_total_.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
    throw;
  }
  map_calls_.fetch_add(1, std::memory_order_relaxed);
  map_ns_total_.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
}

void PageAllocator::unmap_to_free(const std::vector<int64_t>& ids) {
  if (ids.empty()) return;
  auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    mapper_->unmap_pages(ids);
  } catch (const std::exception& e) {
    error = e.what();
  }
  unmap_calls_.fetch_add(1, std::memory_order_relaxed);
  unmap_ns_total_.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    unmapping_ -= ids.size();
    if (error.empty()) {
      free_.insert(ids.begin(), ids.end());
    } else {
      // Which pages made it back is unknown to the pool: it stops here.
      fail_locked("unmap failed: " + error);
    }
  }
  work_settled_.notify_all();
  if (!error.empty()) throw StateError("unmap failed, the page pool is now failed: " + error);
}

std::vector<int64_t> PageAllocator::alloc_pages(size_t count) {
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  if (count == 0) return {};
  size_t hits = 0;
  size_t misses = 0;
  for (;;) {
    if (num_in_use_ + count > capacity_) {
      throw OutOfMemoryError("cannot allocate " + std::to_string(count) + " page(s): " +
                             std::to_string(num_in_use_) + " in use, capacity " +
                             std::to_string(capacity_));
    }
    hits = std::min(count, reserved_.size());
    misses = count - hits;
    // Fresh pages empty the reserve; first let in-flight refills and unmaps settle so the
    // capacity and free-id counts below are exact.
    if (misses > 0 && (refilling_ > 0 || unmapping_ > 0)) {
      work_settled_.wait(lock);
      check_usable_locked();
      continue;
    }
    if (free_.size() < misses) {
      throw OutOfMemoryError("cannot allocate " + std::to_string(count) + " page(s): only " +
                             std::to_string(free_.size() + reserved_.size()) +
                             " page id(s) left (" + std::to_string(quarantined_.size()) +
                             " quarantined)");
    }
    break;
  }
  std::vector<int64_t> from_reserve = take_lowest_locked(&reserved_, hits);
  std::vector<int64_t> fresh = take_lowest_locked(&free_, misses);
  num_in_use_ += count;
  for (int64_t id : from_reserve) in_use_[static_cast<size_t>(id)] = true;

  if (!fresh.empty()) {
    lock.unlock();
    std::exception_ptr failure;
    std::vector<int64_t> lost;
    try {
      timed_map(fresh);
    } catch (const QuarantineError&) {
      failure = std::current_exception();
      lost = quarantined_among(fresh);  // before taking mutex_: the mapper may be remote
    } catch (...) {
      failure = std::current_exception();
    }
    lock.lock();
    if (failure) {
      // Undo the bookkeeping; map_pages has already rolled the memory back.
      num_in_use_ -= count;
      for (int64_t id : from_reserve) in_use_[static_cast<size_t>(id)] = false;
      reserved_.insert(from_reserve.begin(), from_reserve.end());
      for (int64_t id : fresh) {
        if (std::find(lost.begin(), lost.end(), id) == lost.end()) free_.insert(id);
      }
      quarantined_.insert(lost.begin(), lost.end());
      try {
        std::rethrow_exception(failure);
      } catch (const QuarantineError&) {
        throw;  // the pool carries on, degraded
      } catch (const StateError& error) {
        fail_locked(error.what());
        throw;
      } catch (const OutOfMemoryError& error) {
        throw OutOfMemoryError(std::string("out of physical memory: ") + error.what());
      }
    }
    for (int64_t id : fresh) in_use_[static_cast<size_t>(id)] = true;
  }
  reserve_hits_.fetch_add(hits, std::memory_order_relaxed);
  reserve_misses_.fetch_add(misses, std::memory_order_relaxed);
  request_refill_locked();

  std::vector<int64_t> result = std::move(from_reserve);
  result.insert(result.end(), fresh.begin(), fresh.end());
  return result;
}

void PageAllocator::free_pages(const std::vector<int64_t>& page_ids) {
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  std::vector<int64_t> ids = page_ids;
  std::sort(ids.begin(), ids.end());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t id = ids[i];
    const bool known = id >= 0 && static_cast<size_t>(id) < num_total_;
    if (!known || !in_use_[static_cast<size_t>(id)] || (i > 0 && ids[i - 1] == id)) {
      throw StateError("free of page id " + std::to_string(id) + " which is not in use");
    }
  }
  for (int64_t id : ids) in_use_[static_cast<size_t>(id)] = false;
  num_in_use_ -= ids.size();
  const size_t held = num_in_use_ + reserved_.size() + refilling_;
  const size_t room_by_capacity = capacity_ > held ? capacity_ - held : 0;
  const size_t room_by_max = max_reserved_ > reserved_.size() ? max_reserved_ - reserved_.size() : 0;
  const size_t keep = std::min({room_by_capacity, room_by_max, ids.size()});
  reserved_.insert(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(keep));
  std::vector<int64_t> to_unmap(ids.begin() + static_cast<std::ptrdiff_t>(keep), ids.end());
  unmapping_ += to_unmap.size();
  lock.unlock();
  unmap_to_free(to_unmap);
}

bool PageAllocator::set_capacity(size_t pages) {
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  pages = std::min(pages, num_total_);
  const bool grew = pages > capacity_;
  capacity_ = pages;
  work_settled_.wait(lock, [this] { return refilling_ == 0; });
  std::vector<int64_t> to_unmap;
  const size_t held = num_in_use_ + reserved_.size();
  if (held > capacity_) {
    const size_t excess = std::min(reserved_.size(), held - capacity_);
    // Give back the highest ids so that allocation keeps favouring low ids.
    for (size_t i = 0; i < excess; ++i) {
      auto last = std::prev(reserved_.end());
      to_unmap.push_back(*last);
      reserved_.erase(last);
    }
  }
  const bool within = num_in_use_ <= capacity_;
  unmapping_ += to_unmap.size();
  if (grew) request_refill_locked();
  lock.unlock();
  unmap_to_free(to_unmap);
  return within;
}

void PageAllocator::trim() {
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  // A refill requested before the trim, or one deciding its batch outside the lock right now,
  // must not map the reserve back: the reserve stays empty until the next allocation asks.
  refill_requested_ = false;
  ++trim_generation_;
  work_settled_.wait(lock, [this] { return refilling_ == 0; });
  std::vector<int64_t> to_unmap(reserved_.begin(), reserved_.end());
  reserved_.clear();
  unmapping_ += to_unmap.size();
  lock.unlock();
  unmap_to_free(to_unmap);
}

void PageAllocator::refill_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    refill_wanted_.wait(lock, [this] { return stopping_ || refill_requested_; });
    if (stopping_) return;
    refill_requested_ = false;
    if (failed_ || reserved_.size() >= min_reserved_) continue;
    const uint64_t generation = trim_generation_;

    lock.unlock();
    size_t physical = 0;
    try {
      physical = physical_free_pages();  // a driver (or worker) query: not under mutex_
    } catch (const std::exception&) {
      physical = 0;  // unknown: no refill this round; the next trigger asks again
    }
    lock.lock();
    if (stopping_) return;
    if (generation != trim_generation_) continue;  // trimmed meanwhile: stay trimmed
    const size_t held = num_in_use_ + reserved_.size();
    const size_t room = capacity_ > held ? capacity_ - held : 0;
    const size_t missing = min_reserved_ > reserved_.size() ? min_reserved_ - reserved_.size() : 0;
    const size_t want = std::min({missing, room, free_.size(), physical});
    if (want == 0 || failed_) continue;
    std::vector<int64_t> batch = take_lowest_locked(&free_, want);
    refilling_ = batch.size();
    lock.unlock();

    std::string fatal;
    bool mapped = false;
    std::vector<int64_t> lost;
    try {
      timed_map(batch);
      mapped = true;
    } catch (const QuarantineError&) {
      lost = quarantined_among(batch);  // the rest go back to free_ below
    } catch (const StateError& error) {
      fatal = error.what();
    } catch (const std::exception&) {
      // out of memory or a clean driver failure: give the ids back, retry on the next trigger
    }
    lock.lock();
    if (mapped) {
      reserved_.insert(batch.begin(), batch.end());
    } else {
      for (int64_t id : batch) {
        if (std::find(lost.begin(), lost.end(), id) == lost.end()) free_.insert(id);
      }
      quarantined_.insert(lost.begin(), lost.end());
      if (!fatal.empty()) fail_locked("reserve refill failed: " + fatal);
    }
    refilling_ = 0;
    work_settled_.notify_all();
  }
}

size_t PageAllocator::physical_free_pages() const { return mapper_->physical_free_pages(); }

std::string PageAllocator::state() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failed_) return "failed";
  return quarantined_.empty() ? "healthy" : "degraded";
}

std::string PageAllocator::failure_reason() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_reason_;
}

size_t PageAllocator::allocatable_pages(size_t limit) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const size_t cap = std::min(limit, capacity_);
  if (failed_ || cap <= num_in_use_) return 0;
  return std::min(cap - num_in_use_, free_.size() + reserved_.size() + refilling_ + unmapping_);
}

size_t PageAllocator::num_free() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return free_.size();
}

size_t PageAllocator::num_reserved() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_.size();
}

size_t PageAllocator::num_in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return num_in_use_;
}

size_t PageAllocator::num_quarantined() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return quarantined_.size();
}

size_t PageAllocator::capacity() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return capacity_;
}

std::vector<int64_t> PageAllocator::reserved_page_ids() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {reserved_.begin(), reserved_.end()};
}

}  // namespace kvcached
