// Python bindings of kvcached_core._C. Every call that maps or unmaps memory (or waits for a
// thread that does) releases the GIL. C++ errors become the classes of kvcached_core.errors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda_backend.hpp"
#include "cuda_driver.hpp"
#include "dlpack_export.hpp"
#include "errors.hpp"
#include "ftensor.hpp"
#include "ftensor_allocator.hpp"
#include "host_backend.hpp"
#include "page_allocator.hpp"
#include "page_mapper.hpp"
#include "shared_budget.hpp"

namespace py = pybind11;
using namespace kvcached;  // NOLINT(build/namespaces)

namespace {

using Release = py::call_guard<py::gil_scoped_release>;

// Borrowed for the life of the process (the module holds the errors module alive).
PyObject* g_pool_exhausted = nullptr;
PyObject* g_state_consistency = nullptr;
PyObject* g_map_quarantined = nullptr;
PyObject* g_config_error = nullptr;

void register_error_translation() {
  py::module_ errors = py::module_::import("kvcached_core.errors");
  g_pool_exhausted = py::object(errors.attr("PoolExhausted")).release().ptr();
  g_state_consistency = py::object(errors.attr("StateConsistencyError")).release().ptr();
  g_map_quarantined = py::object(errors.attr("MapQuarantinedError")).release().ptr();
  g_config_error = py::object(errors.attr("KVCachedConfigError")).release().ptr();
  py::register_exception_translator([](std::exception_ptr error) {
    if (!error) return;
    try {
      std::rethrow_exception(error);
    } catch (const OutOfMemoryError& e) {
      PyErr_SetString(g_pool_exhausted, e.what());
    } catch (const QuarantineError& e) {
      PyErr_SetString(g_map_quarantined, e.what());
    } catch (const StateError& e) {
      PyErr_SetString(g_state_consistency, e.what());
    } catch (const ConfigError& e) {
      PyErr_SetString(g_config_error, e.what());
    } catch (const BackendError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
}

// A Python exception raised by a PageMapper override, as the C++ error of the same meaning, so
// that the PageAllocator (and its refill thread) react to it exactly as to a local failure.
[[noreturn]] void throw_as_native(py::error_already_set& error, const char* method) {
  const std::string message =
      std::string("page mapper ") + method + ": " + py::str(error.value()).cast<std::string>();
  if (error.matches(g_pool_exhausted)) throw OutOfMemoryError(message);
  if (error.matches(g_map_quarantined)) throw QuarantineError(message);
  if (error.matches(g_state_consistency)) throw StateError(message);
  if (error.matches(g_config_error)) throw ConfigError(message);
  throw BackendError(message);  // any other failure: the mapper rolled back cleanly
}

// Trampoline for PageMapper subclasses written in Python. The GIL is taken only for the call
// itself; callers (the PageAllocator) hold none of their own locks while calling.
class PyPageMapper : public PageMapper {
 public:
  std::vector<int64_t> map_pages(const std::vector<int64_t>& page_ids) override {
    return call<std::vector<int64_t>>("map_pages", page_ids);
  }
  void unmap_pages(const std::vector<int64_t>& page_ids) override {
    call<void>("unmap_pages", page_ids);
  }
  void prepare_unmap(int64_t txn_id, const std::vector<int64_t>& page_ids) override {
    call<void>("prepare_unmap", txn_id, page_ids);
  }
  void commit_unmap(int64_t txn_id) override { call<void>("commit_unmap", txn_id); }
  void abort_unmap(int64_t txn_id) override { call<void>("abort_unmap", txn_id); }
  std::optional<int64_t> pending_txn() const override {
    return call<std::optional<int64_t>>("pending_txn");
  }
  std::vector<int64_t> mapped_page_ids() const override {
    return call<std::vector<int64_t>>("mapped_page_ids");
  }
  std::vector<int64_t> quarantined_page_ids() const override {
    return call<std::vector<int64_t>>("quarantined_page_ids");
  }
  size_t num_logical_pages() const override { return call<size_t>("num_logical_pages"); }
  size_t logical_page_bytes() const override { return call<size_t>("logical_page_bytes"); }
  bool tensors_created() const override { return call<bool>("tensors_created"); }
  size_t physical_free_pages() const override { return call<size_t>("physical_free_pages"); }

 private:
  template <typename Result, typename... Args>
  Result call(const char* method, Args&&... args) const {
    py::gil_scoped_acquire gil;
    py::function override = py::get_override(static_cast<const PageMapper*>(this), method);
    if (!override) {
      throw ConfigError(std::string("PageMapper subclass does not implement ") + method);
    }
    try {
      py::object result = override(std::forward<Args>(args)...);
      if constexpr (std::is_void_v<Result>) {
        return;
      } else {
        return result.template cast<Result>();
      }
    } catch (py::error_already_set& error) {
      throw_as_native(error, method);
    } catch (const py::cast_error& error) {
      throw StateError(std::string("page mapper ") + method + " returned a value of the wrong " +
                       "type: " + error.what());
    }
  }
};

// A PageMapper for the PageAllocator to hold. A Python subclass lives in its Python object: the
// returned pointer keeps that object alive and lets it go under the GIL.
std::shared_ptr<PageMapper> hold_mapper(const py::object& mapper) {
  auto native = mapper.cast<std::shared_ptr<PageMapper>>();
  if (dynamic_cast<PyPageMapper*>(native.get()) == nullptr) return native;
  struct Owner {
    py::object python;
    std::shared_ptr<PageMapper> native;
  };
  auto* owner = new Owner{mapper, native};
  return std::shared_ptr<PageMapper>(native.get(), [owner](PageMapper*) {
    if (!Py_IsInitialized()) return;  // interpreter gone: nothing left to release safely
    py::gil_scoped_acquire gil;
    delete owner;
  });
}

// Destroys a PageAllocator without the GIL: its refill thread may be waiting for the GIL inside
// a Python mapper, and the destructor joins that thread.
void delete_page_allocator(PageAllocator* allocator) {
  if (PyGILState_Check()) {
    py::gil_scoped_release released;
    delete allocator;
  } else {
    delete allocator;
  }
}

std::shared_ptr<Backend> make_cuda_backend(int device_id) {
  return std::make_shared<CudaBackend>(device_id);
}

std::string device_kind_name(const Backend& backend) {
  return backend.device_kind() == DeviceKind::kCuda ? "cuda" : "cpu";
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native data plane of kvcached_core: virtual KV tensors with physical pages on demand";
  register_error_translation();

  m.def(
      "cuda_driver_status",
      []() {
        const CudaDriver& driver = CudaDriver::get();
        if (!driver.available) return std::make_tuple(false, driver.unavailable_reason);
        return std::make_tuple(true, "CUDA driver " + std::to_string(driver.driver_version) +
                                         ", " + std::to_string(driver.device_count) +
                                         " device(s)");
      },
      "(available, reason): whether libcuda.so.1 loads and initialises, and why not.");

  py::class_<Backend, std::shared_ptr<Backend>>(m, "Backend")
      .def_property_readonly("device_type", &device_kind_name)
      .def_property_readonly("device_id", &Backend::device_id)
      .def_property_readonly("granularity", &Backend::granularity)
      .def_property_readonly("zero_page_read_only", &Backend::zero_page_read_only)
      .def("set_zero_page_writable", &Backend::set_zero_page_writable, py::arg("writable"))
      .def("physical_free_bytes", &Backend::physical_free_bytes, Release())
      .def(
          "op_stats",
          [](const Backend& self) {
            py::dict stats;
            for (const auto& [name, stat] : self.op_stats()) {
              stats[py::str(name)] = py::make_tuple(stat.calls, stat.ns);
            }
            return stats;
          },
          "{operation: (calls, total ns)} of the driver calls made (CUDA backend only).");

  py::class_<HostBackend, Backend, std::shared_ptr<HostBackend>>(m, "HostBackend")
      .def(py::init<size_t>(), py::arg("memory_limit_bytes") = 0)
      .def(
          "inject_failure",
          [](HostBackend& self, const std::string& op, int nth, bool out_of_memory) {
            self.inject_failure(parse_host_op(op), nth, out_of_memory);
          },
          py::arg("op"), py::arg("nth") = 1, py::arg("out_of_memory") = false,
          "Make the nth future call (1 = next) of op fail: create, map, unmap, map_zero, release.")
      .def("clear_injected_failures", &HostBackend::clear_injected_failures)
      .def("store_allocated_bytes", &HostBackend::store_allocated_bytes)
      .def("committed_bytes", &HostBackend::committed_bytes);

  py::class_<BudgetedBackend, Backend, std::shared_ptr<BudgetedBackend>>(
      m, "BudgetedBackend",
      "A backend whose physical allocations are charged to a budget shared on this host.")
      .def(py::init([](std::shared_ptr<Backend> inner, std::string name, std::string path) {
             auto budget = std::make_shared<SharedBudget>(std::move(name), path);
             return std::make_shared<BudgetedBackend>(std::move(inner), std::move(budget));
           }),
           py::arg("inner"), py::arg("budget_name"), py::arg("budget_path"))
      .def_property_readonly("inner", &BudgetedBackend::inner)
      .def_property_readonly("budget_name",
                             [](const BudgetedBackend& self) { return self.budget()->name(); })
      .def_property_readonly("budget_path",
                             [](const BudgetedBackend& self) { return self.budget()->path(); })
      .def("budget_free_bytes",
           [](const BudgetedBackend& self) { return self.budget()->free_bytes(); }, Release())
      .def("charged_bytes", &BudgetedBackend::charged_bytes)
      .def("committed_bytes", &BudgetedBackend::charged_bytes,
           "Bytes committed through this backend and not yet released (= charged_bytes).");

  m.def("process_start_time", &process_start_time, py::arg("pid"),
        "Start time of a live process in clock ticks after boot (0: gone or a zombie).");

  m.def("cuda_backend", &make_cuda_backend, py::arg("device_id") = 0,
        "The CUDA driver backend of one device; RuntimeError with the plain reason if unusable.");

  py::class_<FTensor, std::shared_ptr<FTensor>>(m, "FTensor")
      .def_property_readonly("name", &FTensor::name)
      .def_property_readonly("vaddr", &FTensor::vaddr)
      .def_property_readonly("size", &FTensor::size)
      .def_property_readonly("page_size", &FTensor::unit_size)
      .def_property_readonly("backend", &FTensor::backend)
      .def_property_readonly("num_mapped", &FTensor::num_mapped)
      .def_property_readonly("num_quarantined", &FTensor::num_quarantined)
      .def("is_mapped", &FTensor::is_mapped, py::arg("offset"))
      .def("mapped_offsets", &FTensor::mapped_offsets)
      .def("map", &FTensor::map, py::arg("offset"), Release())
      .def("unmap", &FTensor::unmap, py::arg("offset"), Release())
      .def("dlpack_device", [](const FTensor& self) { return dlpack_device(self); })
      .def(
          "to_dlpack",
          [](const std::shared_ptr<FTensor>& self, int type_code, int bits,
             std::vector<int64_t> shape, std::vector<int64_t> strides, uint64_t byte_offset) {
            DLPackView view;
            view.type_code = static_cast<uint8_t>(type_code);
            view.bits = static_cast<uint8_t>(bits);
            view.shape = std::move(shape);
            view.strides = std::move(strides);
            view.byte_offset = byte_offset;
            PyObject* capsule = export_dlpack(self, view);
            if (capsule == nullptr) throw py::error_already_set();
            return py::reinterpret_steal<py::object>(capsule);
          },
          py::arg("type_code"), py::arg("bits"), py::arg("shape"), py::arg("strides"),
          py::arg("byte_offset"),
          "A 'dltensor' capsule viewing this range (strides in elements; [] = C-contiguous).");

  py::class_<PageMapper, PyPageMapper, std::shared_ptr<PageMapper>>(
      m, "PageMapper",
      "How a PageAllocator maps logical pages: an FTensorAllocator, or a Python subclass that "
      "implements every method (map_pages, unmap_pages, prepare_unmap, commit_unmap, "
      "abort_unmap, pending_txn, mapped_page_ids, quarantined_page_ids, num_logical_pages, "
      "logical_page_bytes, tensors_created, physical_free_pages).")
      .def(py::init<>());

  py::class_<FTensorAllocator, PageMapper, std::shared_ptr<FTensorAllocator>>(m, "FTensorAllocator")
      .def(py::init<std::shared_ptr<Backend>, size_t, bool>(), py::arg("backend"),
           py::arg("page_size"), py::arg("contiguous"))
      .def("create_kv_tensors", &FTensorAllocator::create_kv_tensors,
           py::arg("bytes_per_layer_per_buffer"), py::arg("num_layers"), py::arg("num_kv_buffers"),
           Release())
      .def("map_pages", &FTensorAllocator::map_pages, py::arg("page_ids"), Release())
      .def("unmap_pages", &FTensorAllocator::unmap_pages, py::arg("page_ids"), Release())
      .def("prepare_unmap", &FTensorAllocator::prepare_unmap, py::arg("txn_id"),
           py::arg("page_ids"), Release())
      .def("commit_unmap", &FTensorAllocator::commit_unmap, py::arg("txn_id"), Release())
      .def("abort_unmap", &FTensorAllocator::abort_unmap, py::arg("txn_id"), Release())
      .def_property_readonly("pending_txn", &FTensorAllocator::pending_txn)
      .def("mapped_page_ids", &FTensorAllocator::mapped_page_ids)
      .def("quarantined_page_ids", &FTensorAllocator::quarantined_page_ids)
      .def_property_readonly("num_quarantined", &FTensorAllocator::num_quarantined)
      .def("page_targets", &FTensorAllocator::page_targets, py::arg("page_id"))
      .def_property_readonly("num_logical_pages", &FTensorAllocator::num_logical_pages)
      .def_property_readonly("logical_page_bytes", &FTensorAllocator::logical_page_bytes)
      .def_property_readonly("page_size", &FTensorAllocator::page_size)
      .def_property_readonly("contiguous", &FTensorAllocator::contiguous)
      .def_property_readonly("tensors_created", &FTensorAllocator::tensors_created)
      .def_property_readonly("tensors", &FTensorAllocator::tensors)
      .def("physical_free_pages", &FTensorAllocator::physical_free_pages, Release())
      .def_property_readonly("backend", &FTensorAllocator::backend);

  py::class_<PageAllocator, std::shared_ptr<PageAllocator>>(m, "PageAllocator")
      .def(py::init([](const py::object& mapper, size_t min_reserved, size_t max_reserved,
                       bool prealloc, bool adopt_mapped) {
             std::shared_ptr<PageMapper> held = hold_mapper(mapper);
             PageAllocator* allocator = nullptr;
             {
               py::gil_scoped_release released;  // the mapper may call back into Python
               allocator =
                   new PageAllocator(held, min_reserved, max_reserved, prealloc, adopt_mapped);
             }
             return std::shared_ptr<PageAllocator>(allocator, &delete_page_allocator);
           }),
           py::arg("mapper"), py::arg("min_reserved"), py::arg("max_reserved"),
           py::arg("prealloc"), py::arg("adopt_mapped") = false)
      .def("alloc_pages", &PageAllocator::alloc_pages, py::arg("count"), Release())
      .def("free_pages", &PageAllocator::free_pages, py::arg("page_ids"), Release())
      .def("set_capacity", &PageAllocator::set_capacity, py::arg("pages"), Release())
      .def("trim", &PageAllocator::trim, Release())
      .def("stop", &PageAllocator::stop, Release())
      .def("physical_free_pages", &PageAllocator::physical_free_pages, Release())
      .def("reserved_page_ids", &PageAllocator::reserved_page_ids)
      .def_property_readonly("ftensor_allocator", &PageAllocator::ftensor_allocator,
                             "The local FTensorAllocator (None when a broadcast maps the pages).")
      .def_property_readonly("mapper", &PageAllocator::mapper)
      .def_property_readonly("state", &PageAllocator::state)
      .def_property_readonly("failure_reason", &PageAllocator::failure_reason)
      .def("allocatable_pages", &PageAllocator::allocatable_pages, py::arg("limit"))
      .def_property_readonly("num_free", &PageAllocator::num_free)
      .def_property_readonly("num_reserved", &PageAllocator::num_reserved)
      .def_property_readonly("num_in_use", &PageAllocator::num_in_use)
      .def_property_readonly("num_quarantined", &PageAllocator::num_quarantined)
      .def_property_readonly("capacity", &PageAllocator::capacity)
      .def_property_readonly("num_total", &PageAllocator::num_total)
      .def_property_readonly("min_reserved", &PageAllocator::min_reserved)
      .def_property_readonly("max_reserved", &PageAllocator::max_reserved)
      .def_property_readonly("reserve_hits", &PageAllocator::reserve_hits)
      .def_property_readonly("reserve_misses", &PageAllocator::reserve_misses)
      .def_property_readonly("map_calls", &PageAllocator::map_calls)
      .def_property_readonly("map_ns_total", &PageAllocator::map_ns_total)
      .def_property_readonly("unmap_calls", &PageAllocator::unmap_calls)
      .def_property_readonly("unmap_ns_total", &PageAllocator::unmap_ns_total);
}
