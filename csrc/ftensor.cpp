#include "ftensor.hpp"

#include <utility>

#include "errors.hpp"

namespace kvcached {
namespace {

[[noreturn]] void throw_clean_failure(const OpResult& result, const std::string& context) {
  if (result.is_out_of_memory()) throw OutOfMemoryError(context + ": " + result.message);
  throw BackendError(context + ": " + result.message + " (rolled back)");
}

}  // namespace

FTensor::FTensor(std::shared_ptr<Backend> backend, std::string name, size_t size,
                 size_t unit_size)
    : backend_(std::move(backend)), name_(std::move(name)), size_(size), unit_size_(unit_size) {
  const size_t granularity = backend_->granularity();
  if (unit_size_ == 0 || unit_size_ % granularity != 0) {
    throw ConfigError("page size " + std::to_string(unit_size_) +
                      " must be a positive multiple of the backend granularity " +
                      std::to_string(granularity));
  }
  if (size_ == 0 || size_ % unit_size_ != 0) {
    throw ConfigError("tensor size " + std::to_string(size_) +
                      " must be a positive multiple of the page size " + std::to_string(unit_size_));
  }
  vaddr_ = backend_->reserve_range(size_);
  for (size_t offset = 0; offset < size_; offset += unit_size_) {
    OpResult result = backend_->map_zero(vaddr_ + offset, unit_size_);
    if (!result.is_ok()) {
      for (size_t undo = 0; undo < offset; undo += unit_size_) {
        backend_->unmap_range(vaddr_ + undo, unit_size_);
      }
      backend_->free_range(vaddr_, size_);
      if (result.is_out_of_memory()) throw OutOfMemoryError("zero page: " + result.message);
      throw BackendError("mapping the zero page over " + name_ + ": " + result.message);
    }
  }
}

FTensor::~FTensor() {
  // Best effort: a destructor cannot report; every unit holds some mapping (or an unknown one).
  for (size_t offset = 0; offset < size_; offset += unit_size_) {
    backend_->unmap_range(vaddr_ + offset, unit_size_);
  }
  mapping_.clear();     // releases the pages, now unmapped
  quarantine_.clear();  // the range is unmapped as a whole, so these are safe to release too
  backend_->free_range(vaddr_, size_);
}

void FTensor::check_unit(size_t offset) const {
  if (offset % unit_size_ != 0 || offset >= size_) {
    throw ConfigError("offset " + std::to_string(offset) + " is not a page of " + name_ +
                      " (size " + std::to_string(size_) + ", page " + std::to_string(unit_size_) +
                      ")");
  }
}

void FTensor::quarantine_locked(size_t offset, std::unique_ptr<PhysicalPage> page) {
  uncertain_units_.insert(offset);
  if (page) quarantine_.push_back(std::move(page));
}

OpResult FTensor::install(size_t offset, const PhysicalPage& page, bool* rollback_ok) {
  const uintptr_t va = vaddr_ + offset;
  *rollback_ok = true;
  OpResult result = backend_->unmap_range(va, unit_size_);
  if (!result.is_ok()) {
    *rollback_ok = false;  // the zero mapping may or may not still be there
    return result;
  }
  result = backend_->map_handle(va, unit_size_, page.handle());
  if (result.is_ok()) {
    result = backend_->set_access(va, unit_size_);
    if (result.is_ok()) return result;
    if (!backend_->unmap_range(va, unit_size_).is_ok()) {
      *rollback_ok = false;
      return result;
    }
  }
  *rollback_ok = backend_->map_zero(va, unit_size_).is_ok();
  return result;
}

void FTensor::map(size_t offset) {
  check_unit(offset);
  std::lock_guard<std::mutex> lock(mutex_);
  if (mapping_.count(offset) != 0) {
    throw StateError(name_ + " offset " + std::to_string(offset) + " is already mapped");
  }
  if (uncertain_units_.count(offset) != 0) {
    throw QuarantineError(name_ + " offset " + std::to_string(offset) + " is quarantined");
  }
  // Create first: running out of memory then leaves the virtual range untouched.
  std::unique_ptr<PhysicalPage> page;
  OpResult created = PhysicalPage::create(backend_, unit_size_, &page);
  if (!created.is_ok()) throw_clean_failure(created, "creating a page for " + name_);

  bool rollback_ok = true;
  OpResult installed = install(offset, *page, &rollback_ok);
  if (installed.is_ok()) {
    mapping_.emplace(offset, std::move(page));
    return;
  }
  const std::string context = "mapping " + name_ + " offset " + std::to_string(offset);
  if (!rollback_ok) {
    quarantine_locked(offset, std::move(page));
    throw QuarantineError(context + " failed (" + installed.message +
                          ") and the zero page could not be restored; the page is quarantined");
  }
  OpResult released = page->release();
  if (!released.is_ok()) {
    quarantine_.push_back(std::move(page));  // the unit itself is fine again
    throw QuarantineError(context + " failed (" + installed.message + ") and releasing the page " +
                          "failed (" + released.message + "); the page is quarantined");
  }
  throw_clean_failure(installed, context);
}

std::unique_ptr<PhysicalPage> FTensor::unmap_retain(size_t offset) {
  check_unit(offset);
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = mapping_.find(offset);
  if (found == mapping_.end()) {
    throw StateError(name_ + " offset " + std::to_string(offset) + " is not mapped");
  }
  const uintptr_t va = vaddr_ + offset;
  const std::string context = "unmapping " + name_ + " offset " + std::to_string(offset);
  OpResult result = backend_->unmap_range(va, unit_size_);
  if (!result.is_ok()) {
    // The page may still be mapped: keep it where it is, its unit is no longer trusted.
    uncertain_units_.insert(offset);
    throw StateError(context + " failed: " + result.message);
  }
  std::unique_ptr<PhysicalPage> page = std::move(found->second);
  mapping_.erase(found);
  result = backend_->map_zero(va, unit_size_);
  if (!result.is_ok()) {
    // The page is unmapped, so it can be released; the unit now reads nothing at all.
    uncertain_units_.insert(offset);
    page->release();
    throw StateError(context + ": restoring the zero page failed: " + result.message);
  }
  return page;
}

void FTensor::unmap(size_t offset) {
  std::unique_ptr<PhysicalPage> page = unmap_retain(offset);
  OpResult released = page->release();
  if (!released.is_ok()) {
    std::lock_guard<std::mutex> lock(mutex_);
    quarantine_.push_back(std::move(page));
    throw StateError("releasing the page of " + name_ + " offset " + std::to_string(offset) +
                     " failed: " + released.message);
  }
}

void FTensor::restore(size_t offset, std::unique_ptr<PhysicalPage> page) {
  check_unit(offset);
  std::lock_guard<std::mutex> lock(mutex_);
  if (mapping_.count(offset) != 0 || uncertain_units_.count(offset) != 0) {
    quarantine_.push_back(std::move(page));
    throw QuarantineError(name_ + " offset " + std::to_string(offset) +
                          " cannot take its page back; the page is quarantined");
  }
  bool rollback_ok = true;
  OpResult installed = install(offset, *page, &rollback_ok);
  if (installed.is_ok()) {
    mapping_.emplace(offset, std::move(page));
    return;
  }
  // The retained page holds the only copy of its contents: never release it here.
  if (rollback_ok) {
    quarantine_.push_back(std::move(page));
  } else {
    quarantine_locked(offset, std::move(page));
  }
  throw QuarantineError("restoring " + name_ + " offset " + std::to_string(offset) +
                        " failed (" + installed.message + "); the page is quarantined");
}

bool FTensor::is_mapped(size_t offset) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mapping_.count(offset) != 0;
}

std::vector<size_t> FTensor::mapped_offsets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<size_t> offsets;
  offsets.reserve(mapping_.size());
  for (const auto& entry : mapping_) offsets.push_back(entry.first);
  return offsets;
}

size_t FTensor::num_mapped() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mapping_.size();
}

size_t FTensor::num_quarantined() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return quarantine_.size();
}

size_t FTensor::num_uncertain_units() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return uncertain_units_.size();
}

}  // namespace kvcached
