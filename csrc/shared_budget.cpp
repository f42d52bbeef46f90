#include "shared_budget.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "errors.hpp"

namespace kvcached {
namespace {

std::string errno_text(const std::string& what, int err) {
  return what + " failed: " + std::strerror(err) + " (errno " + std::to_string(err) + ")";
}

}  // namespace

uint64_t process_start_time(int64_t pid) {
  if (pid <= 0) return 0;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));  // NOLINT
  FILE* file = std::fopen(path, "r");
  if (file == nullptr) return 0;
  char text[1024];
  size_t length = std::fread(text, 1, sizeof(text) - 1, file);
  std::fclose(file);
  text[length] = '\0';
  // The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
  const char* rest = std::strrchr(text, ')');
  if (rest == nullptr) return 0;
  char state = 0;
  unsigned long long start = 0;  // NOLINT(runtime/int)
  // Field 3 is the state; field 22 the start time, 19 fields later.
  if (std::sscanf(rest + 1, " %c %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s "
                            "%*s %*s %llu",
                  &state, &start) != 2) {
    return 0;
  }
  if (state == 'Z' || state == 'X') return 0;  // exited: its memory is gone already
  return static_cast<uint64_t>(start);
}

// flock(LOCK_EX) for the life of the object; the caller also holds mutex_.
class SharedBudget::FileLock {
 public:
  explicit FileLock(int fd) : fd_(fd) {
    while (flock(fd_, LOCK_EX) != 0) {
      if (errno != EINTR) throw BackendError(errno_text("flock of the budget file", errno));
    }
  }
  ~FileLock() { flock(fd_, LOCK_UN); }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_;
};

SharedBudget::SharedBudget(std::string name, const std::string& path)
    : name_(std::move(name)),
      path_(path),
      pid_(static_cast<int64_t>(getpid())),
      start_time_(process_start_time(static_cast<int64_t>(getpid()))) {
  fd_ = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd_ < 0) {
    int err = errno;
    if (err == ENOENT) {
      throw ConfigError("kvcached budget '" + name_ + "' does not exist (" + path +
                        "); create it with `kvctl budget set " + name_ + " SIZE`");
    }
    throw ConfigError(errno_text("opening kvcached budget '" + name_ + "' (" + path + ")", err));
  }
  try {
    struct stat st {};
    if (fstat(fd_, &st) != 0) throw BackendError(errno_text("fstat of " + path, errno));
    if (static_cast<size_t>(st.st_size) < kBudgetFileBytes) {
      throw ConfigError("kvcached budget '" + name_ + "': " + path + " is " +
                        std::to_string(st.st_size) + " bytes, not a budget file");
    }
    mapping_ = mmap(nullptr, kBudgetFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (mapping_ == MAP_FAILED) {
      mapping_ = nullptr;
      throw BackendError(errno_text("mmap of " + path, errno));
    }
    header_ = static_cast<BudgetHeader*>(mapping_);
    slots_ = reinterpret_cast<BudgetSlot*>(static_cast<char*>(mapping_) + sizeof(BudgetHeader));
    std::lock_guard<std::mutex> guard(mutex_);
    FileLock lock(fd_);
    if (std::memcmp(header_->magic, kBudgetMagic, sizeof(kBudgetMagic)) != 0 ||
        header_->version != kBudgetVersion || header_->num_slots != kBudgetSlots) {
      throw ConfigError("kvcached budget '" + name_ + "': " + path +
                        " is not a budget file of format " + std::to_string(kBudgetVersion));
    }
    slot_ = find_own_slot_locked();
    if (slot_ == kBudgetSlots) {
      reclaim_dead_locked();
      for (size_t i = 0; i < kBudgetSlots; ++i) {
        if (slots_[i].pid == 0) {
          slots_[i] = BudgetSlot{pid_, start_time_, 0, 0};
          slot_ = i;
          break;
        }
      }
      if (slot_ == kBudgetSlots) {
        throw OutOfMemoryError("kvcached budget '" + name_ + "' has " +
                               std::to_string(kBudgetSlots) + " live members already");
      }
    }
    slots_[slot_].attached += 1;
  } catch (...) {
    if (mapping_ != nullptr) munmap(mapping_, kBudgetFileBytes);
    close(fd_);
    throw;
  }
}

SharedBudget::~SharedBudget() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    try {
      FileLock lock(fd_);
      BudgetSlot& own = slots_[slot_];
      if (own.pid == pid_ && own.start_time == start_time_) {
        if (own.attached > 0) own.attached -= 1;
        if (own.attached == 0 && own.charged == 0) own = BudgetSlot{0, 0, 0, 0};
      }
    } catch (const std::exception&) {
      // Without the lock the slot stays; it is reclaimed once this process is gone.
    }
  }
  munmap(mapping_, kBudgetFileBytes);
  close(fd_);
}

size_t SharedBudget::find_own_slot_locked() const {
  for (size_t i = 0; i < kBudgetSlots; ++i) {
    if (slots_[i].pid == pid_ && slots_[i].start_time == start_time_) return i;
  }
  return kBudgetSlots;
}

uint64_t SharedBudget::sum_charged_locked() const {
  uint64_t sum = 0;
  for (size_t i = 0; i < kBudgetSlots; ++i) {
    if (slots_[i].pid != 0) sum += slots_[i].charged;
  }
  return sum;
}

void SharedBudget::reclaim_dead_locked() {
  for (size_t i = 0; i < kBudgetSlots; ++i) {
    BudgetSlot& slot = slots_[i];
    if (slot.pid == 0 || i == slot_) continue;
    if (process_start_time(slot.pid) != slot.start_time) slot = BudgetSlot{0, 0, 0, 0};
  }
}

OpResult SharedBudget::charge(size_t bytes) {
  if (static_cast<int64_t>(getpid()) != pid_) {
    return OpResult::failed("kvcached budget '" + name_ + "' was joined by process " +
                            std::to_string(pid_) + ", not this one (a forked child)");
  }
  std::lock_guard<std::mutex> guard(mutex_);
  FileLock lock(fd_);
  const uint64_t capacity = header_->capacity;
  uint64_t charged = sum_charged_locked();
  if (charged + bytes > capacity) {
    reclaim_dead_locked();  // only now: a dead member's bytes matter only when they block
    charged = sum_charged_locked();
    if (charged + bytes > capacity) {
      return OpResult::out_of_memory("kvcached budget " + name_ + " of " +
                                     std::to_string(capacity) + " bytes is spent: " +
                                     std::to_string(charged) + " charged, " +
                                     std::to_string(bytes) + " more requested");
    }
  }
  slots_[slot_].charged += bytes;
  return OpResult::ok();
}

void SharedBudget::refund(size_t bytes) {
  std::lock_guard<std::mutex> guard(mutex_);
  FileLock lock(fd_);
  BudgetSlot& own = slots_[slot_];
  own.charged = own.charged > bytes ? own.charged - bytes : 0;
}

size_t SharedBudget::free_bytes() {
  std::lock_guard<std::mutex> guard(mutex_);
  FileLock lock(fd_);
  reclaim_dead_locked();  // not a hot path: asked before a reserve refill
  const uint64_t capacity = header_->capacity;
  const uint64_t charged = sum_charged_locked();
  return charged >= capacity ? 0 : static_cast<size_t>(capacity - charged);
}

size_t SharedBudget::capacity() {
  std::lock_guard<std::mutex> guard(mutex_);
  FileLock lock(fd_);
  return static_cast<size_t>(header_->capacity);
}

BudgetedBackend::BudgetedBackend(std::shared_ptr<Backend> inner,
                                 std::shared_ptr<SharedBudget> budget)
    : inner_(std::move(inner)), budget_(std::move(budget)) {
  if (!inner_ || !budget_) throw ConfigError("BudgetedBackend needs a backend and a budget");
}

OpResult BudgetedBackend::create_handle(size_t size, uint64_t* handle) {
  OpResult charged = budget_->charge(size);
  if (!charged.is_ok()) return charged;
  OpResult created = inner_->create_handle(size, handle);
  if (!created.is_ok()) {
    budget_->refund(size);
    return created;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  charged_ += size;
  return created;
}

OpResult BudgetedBackend::release_handle(uint64_t handle, size_t size) {
  OpResult released = inner_->release_handle(handle, size);
  if (!released.is_ok()) return released;  // the memory is still held: so is its charge
  budget_->refund(size);
  std::lock_guard<std::mutex> lock(mutex_);
  charged_ = charged_ > size ? charged_ - size : 0;
  return released;
}

size_t BudgetedBackend::physical_free_bytes() {
  return std::min(inner_->physical_free_bytes(), budget_->free_bytes());
}

size_t BudgetedBackend::charged_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return charged_;
}

}  // namespace kvcached
