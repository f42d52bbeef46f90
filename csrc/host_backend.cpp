#include "host_backend.hpp"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "errors.hpp"

namespace kvcached {
namespace {

std::string errno_text(const char* what, int err) {
  return std::string(what) + " failed: " + std::strerror(err) + " (errno " + std::to_string(err) +
         ")";
}

const char* op_name(HostOp op) {
  switch (op) {
    case HostOp::kCreate: return "create";
    case HostOp::kMap: return "map";
    case HostOp::kUnmap: return "unmap";
    case HostOp::kMapZero: return "map_zero";
    case HostOp::kRelease: return "release";
  }
  return "?";
}

size_t mem_available_bytes() {
  // Plain stdio parsing: no iostreams in this extension (see cuda_driver.cpp).
  FILE* meminfo = std::fopen("/proc/meminfo", "r");
  if (meminfo == nullptr) return 0;
  char line[256];
  unsigned long long available_kib = 0, free_kib = 0;  // NOLINT(runtime/int)
  bool have_available = false;
  while (std::fgets(line, sizeof(line), meminfo) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %llu kB", &available_kib) == 1) have_available = true;
    std::sscanf(line, "MemFree: %llu kB", &free_kib);
  }
  std::fclose(meminfo);
  // Kernels (and sandboxes) without MemAvailable: fall back to MemFree.
  return static_cast<size_t>(have_available ? available_kib : free_kib) * 1024;
}

}  // namespace

HostOp parse_host_op(const std::string& name) {
  for (HostOp op : {HostOp::kCreate, HostOp::kMap, HostOp::kUnmap, HostOp::kMapZero,
                    HostOp::kRelease}) {
    if (name == op_name(op)) return op;
  }
  throw ConfigError("unknown backend operation '" + name +
                    "': use create, map, unmap, map_zero or release");
}

HostBackend::HostBackend(size_t memory_limit_bytes)
    : granularity_(static_cast<size_t>(sysconf(_SC_PAGESIZE))),
      memory_limit_bytes_(memory_limit_bytes) {
  store_fd_ = memfd_create("kvcached-page-store", MFD_CLOEXEC);
  if (store_fd_ < 0) throw BackendError(errno_text("memfd_create", errno));
}

HostBackend::~HostBackend() {
  if (store_fd_ >= 0) close(store_fd_);
}

std::optional<OpResult> HostBackend::take_injected(HostOp op) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = injections_.find(op);
  if (it == injections_.end()) return std::nullopt;
  std::optional<OpResult> result;
  for (auto& injection : it->second) {
    if (--injection.countdown == 0 && !result) {
      std::string why = std::string("injected failure of ") + op_name(op);
      result = injection.out_of_memory ? OpResult::out_of_memory(why + " (out of memory)")
                                       : OpResult::failed(why + " (I/O error)");
    }
  }
  auto& pending = it->second;
  pending.erase(std::remove_if(pending.begin(), pending.end(),
                               [](const Injection& inj) { return inj.countdown <= 0; }),
                pending.end());
  return result;
}

void HostBackend::inject_failure(HostOp op, int nth, bool out_of_memory) {
  if (nth < 1) throw ConfigError("nth must be >= 1 (1 = the next call)");
  std::lock_guard<std::mutex> lock(mutex_);
  injections_[op].push_back({nth, out_of_memory});
}

void HostBackend::clear_injected_failures() {
  std::lock_guard<std::mutex> lock(mutex_);
  injections_.clear();
}

uintptr_t HostBackend::reserve_range(size_t size) {
  void* va = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (va == MAP_FAILED) throw BackendError(errno_text("mmap(PROT_NONE) reserve", errno));
  return reinterpret_cast<uintptr_t>(va);
}

OpResult HostBackend::free_range(uintptr_t va, size_t size) {
  if (munmap(reinterpret_cast<void*>(va), size) != 0) {
    return OpResult::failed(errno_text("munmap", errno));
  }
  return OpResult::ok();
}

OpResult HostBackend::create_handle(size_t size, uint64_t* handle) {
  if (auto injected = take_injected(HostOp::kCreate)) return *injected;
  std::lock_guard<std::mutex> lock(mutex_);
  if (memory_limit_bytes_ != 0 && committed_ + size > memory_limit_bytes_) {
    return OpResult::out_of_memory("host memory limit of " + std::to_string(memory_limit_bytes_) +
                                   " bytes reached");
  }
  size_t offset;
  auto& reusable = free_slots_[size];
  bool reused = !reusable.empty();
  if (reused) {
    offset = reusable.back();
    reusable.pop_back();
  } else {
    offset = store_end_;
    store_end_ += size;
  }
  if (fallocate(store_fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(size)) != 0) {
    int err = errno;
    if (reused) {
      reusable.push_back(offset);
    } else {
      store_end_ -= size;
    }
    std::string why = errno_text("fallocate", err);
    if (err == ENOSPC || err == ENOMEM) return OpResult::out_of_memory(why);
    return OpResult::failed(why);
  }
  committed_ += size;
  live_slots_[offset] = size;
  *handle = offset;
  return OpResult::ok();
}

OpResult HostBackend::release_handle(uint64_t handle, size_t size) {
  if (auto injected = take_injected(HostOp::kRelease)) return *injected;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_slots_.find(handle);
  if (it == live_slots_.end() || it->second != size) {
    return OpResult::failed("release of unknown page store slot " + std::to_string(handle));
  }
  if (fallocate(store_fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(handle),
                static_cast<off_t>(size)) != 0) {
    return OpResult::failed(errno_text("fallocate(PUNCH_HOLE)", errno));
  }
  live_slots_.erase(it);
  free_slots_[size].push_back(handle);
  committed_ -= size;
  return OpResult::ok();
}

OpResult HostBackend::map_handle(uintptr_t va, size_t size, uint64_t handle) {
  if (auto injected = take_injected(HostOp::kMap)) return *injected;
  // MAP_POPULATE: a mapped page is resident, as device memory behind a CUDA mapping is.
  void* got = mmap(reinterpret_cast<void*>(va), size, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_FIXED | MAP_POPULATE, store_fd_, static_cast<off_t>(handle));
  if (got == MAP_FAILED) {
    int err = errno;
    std::string why = errno_text("mmap(MAP_FIXED) of a page", err);
    return err == ENOMEM ? OpResult::out_of_memory(why) : OpResult::failed(why);
  }
  return OpResult::ok();
}

OpResult HostBackend::set_access(uintptr_t va, size_t size) {
  if (mprotect(reinterpret_cast<void*>(va), size, PROT_READ | PROT_WRITE) != 0) {
    return OpResult::failed(errno_text("mprotect", errno));
  }
  return OpResult::ok();
}

OpResult HostBackend::unmap_range(uintptr_t va, size_t size) {
  if (auto injected = take_injected(HostOp::kUnmap)) return *injected;
  void* got = mmap(reinterpret_cast<void*>(va), size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (got == MAP_FAILED) return OpResult::failed(errno_text("mmap(PROT_NONE) unmap", errno));
  return OpResult::ok();
}

OpResult HostBackend::map_zero(uintptr_t va, size_t size) {
  if (auto injected = take_injected(HostOp::kMapZero)) return *injected;
  const int protection = zero_writable_ ? PROT_READ | PROT_WRITE : PROT_READ;
  void* got = mmap(reinterpret_cast<void*>(va), size, protection,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (got == MAP_FAILED) return OpResult::failed(errno_text("mmap zero page", errno));
  return OpResult::ok();
}

size_t HostBackend::physical_free_bytes() {
  size_t available = mem_available_bytes();
  if (memory_limit_bytes_ == 0) return available;
  std::lock_guard<std::mutex> lock(mutex_);
  size_t under_limit = memory_limit_bytes_ > committed_ ? memory_limit_bytes_ - committed_ : 0;
  return std::min(available, under_limit);
}

size_t HostBackend::store_allocated_bytes() const {
  struct stat st {};
  if (fstat(store_fd_, &st) != 0) return 0;
  return static_cast<size_t>(st.st_blocks) * 512;
}

size_t HostBackend::committed_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return committed_;
}

}  // namespace kvcached
