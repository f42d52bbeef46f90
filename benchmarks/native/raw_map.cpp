// Raw driver floor for benchmarks/bench_map_page.py: a benchmark-only extension, built on
// demand by benchmarks/native/raw_map.py from this file and the product's CUDA backend sources;
// it is not part of kvcached_core.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <string>
#include <vector>

#include "cuda_backend.hpp"
#include "cuda_driver.hpp"
#include "errors.hpp"

namespace py = pybind11;

namespace kvcached {

// Times the raw driver floor for growing by `handles_per_step` allocations of `bytes` each:
// cuMemCreate + cuMemMap + cuMemSetAccess(read-write), per step, in nanoseconds. Teardown
// (unmap + release) happens between steps and is not timed. With zero_swap, every slot starts
// mapped read-only to a zero allocation and the timed step also includes its cuMemUnmap: the
// floor for a range that keeps unbacked pages readable.
struct RawMapTiming {
  std::vector<double> total_ns;
  std::vector<double> unmap_zero_ns;
  std::vector<double> create_ns;
  std::vector<double> map_ns;
  std::vector<double> access_ns;
};

RawMapTiming bench_raw_map(int device_id, size_t bytes, int handles_per_step, int steps,
                           bool zero_swap) {
  CudaBackend backend(device_id);  // retains the context and checks VMM support
  const CudaDriver& driver = CudaDriver::get();
  if (bytes % backend.granularity() != 0) {
    throw ConfigError("bytes must be a multiple of the granularity " +
                      std::to_string(backend.granularity()));
  }
  const size_t span = bytes * static_cast<size_t>(handles_per_step);
  uintptr_t base = backend.reserve_range(span);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device_id;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_id;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  using Clock = std::chrono::steady_clock;
  auto ns_between = [](Clock::time_point a, Clock::time_point b) {
    return static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count());
  };
  RawMapTiming timing;
  std::vector<CUmemGenericAllocationHandle> handles(static_cast<size_t>(handles_per_step));
  for (int step = 0; step < steps; ++step) {
    if (zero_swap) {
      for (int i = 0; i < handles_per_step; ++i) {
        OpResult zeroed = backend.map_zero(base + static_cast<size_t>(i) * bytes, bytes);
        if (!zeroed.is_ok()) throw BackendError("raw map setup: " + zeroed.message);
      }
    }
    double create_ns = 0, map_ns = 0, access_ns = 0, unmap_zero_ns = 0;
    Clock::time_point start = Clock::now();
    for (int i = 0; i < handles_per_step; ++i) {
      CUdeviceptr va = static_cast<CUdeviceptr>(base + static_cast<size_t>(i) * bytes);
      if (zero_swap) {
        Clock::time_point z0 = Clock::now();
        CUresult unmapped = driver.mem_unmap(va, bytes);
        unmap_zero_ns += ns_between(z0, Clock::now());
        if (unmapped != CUDA_SUCCESS) {
          throw BackendError("raw zero unmap failed: " + driver.error_name(unmapped));
        }
      }
      Clock::time_point t0 = Clock::now();
      CUresult s1 = driver.mem_create(&handles[static_cast<size_t>(i)], bytes, &prop, 0);
      Clock::time_point t1 = Clock::now();
      CUresult s2 = driver.mem_map(va, bytes, 0, handles[static_cast<size_t>(i)], 0);
      Clock::time_point t2 = Clock::now();
      CUresult s3 = driver.mem_set_access(va, bytes, &access, 1);
      Clock::time_point t3 = Clock::now();
      if (s1 != CUDA_SUCCESS || s2 != CUDA_SUCCESS || s3 != CUDA_SUCCESS) {
        throw BackendError("raw map step failed: " + driver.error_name(s1) + "/" +
                           driver.error_name(s2) + "/" + driver.error_name(s3));
      }
      create_ns += ns_between(t0, t1);
      map_ns += ns_between(t1, t2);
      access_ns += ns_between(t2, t3);
    }
    timing.total_ns.push_back(ns_between(start, Clock::now()));
    timing.create_ns.push_back(create_ns);
    timing.map_ns.push_back(map_ns);
    timing.access_ns.push_back(access_ns);
    timing.unmap_zero_ns.push_back(unmap_zero_ns);
    for (int i = 0; i < handles_per_step; ++i) {
      driver.mem_unmap(static_cast<CUdeviceptr>(base + static_cast<size_t>(i) * bytes), bytes);
      driver.mem_release(handles[static_cast<size_t>(i)]);
    }
  }
  backend.free_range(base, span);
  return timing;
}

}  // namespace kvcached

using namespace kvcached;

PYBIND11_MODULE(kvcached_raw_map, m) {
  m.def(
      "bench_raw_map",
      [](int device_id, size_t bytes, int handles_per_step, int steps, bool zero_swap) {
        RawMapTiming timing;
        {
          py::gil_scoped_release released;
          timing = bench_raw_map(device_id, bytes, handles_per_step, steps, zero_swap);
        }
        py::dict result;
        result["total_ns"] = timing.total_ns;
        result["create_ns"] = timing.create_ns;
        result["map_ns"] = timing.map_ns;
        result["access_ns"] = timing.access_ns;
        result["unmap_zero_ns"] = timing.unmap_zero_ns;
        return result;
      },
      py::arg("device_id"), py::arg("bytes"), py::arg("handles_per_step"), py::arg("steps"),
      py::arg("zero_swap") = false,
      "Raw driver floor per step: handles_per_step x (cuMemCreate + cuMemMap + cuMemSetAccess),\n"
      "plus the cuMemUnmap of a zero-page mapping first when zero_swap is set.");
}
