#include "dlpack_export.hpp"

#include <string>

#include "errors.hpp"

namespace kvcached {
namespace {

// The DLPack ABI (dlpack.h v0.8), declared here so the extension needs no extra header.
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

constexpr int32_t kDLCPU = 1;
constexpr int32_t kDLCUDA = 2;

// Owns everything a DLManagedTensor points at.
struct ExportContext {
  std::shared_ptr<FTensor> tensor;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  DLManagedTensor managed{};
};

void delete_export(DLManagedTensor* self) {
  delete static_cast<ExportContext*>(self->manager_ctx);
}

void capsule_destructor(PyObject* capsule) {
  // A consumer renames the capsule to "used_dltensor" and then owns the tensor.
  if (PyCapsule_IsValid(capsule, "dltensor") == 0) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed != nullptr) managed->deleter(managed);
}

}  // namespace

std::pair<int, int> dlpack_device(const FTensor& tensor) {
  const Backend& backend = *tensor.backend();
  if (backend.device_kind() == DeviceKind::kCuda) return {kDLCUDA, backend.device_id()};
  return {kDLCPU, 0};
}

PyObject* export_dlpack(const std::shared_ptr<FTensor>& tensor, const DLPackView& view) {
  if (view.bits == 0 || view.bits % 8 != 0) throw ConfigError("dtype bits must be a multiple of 8");
  const int64_t item_bytes = view.bits / 8;
  const size_t ndim = view.shape.size();
  std::vector<int64_t> strides = view.strides;
  if (strides.empty()) {
    strides.assign(ndim, 1);
    for (size_t i = ndim; i-- > 1;) strides[i - 1] = strides[i] * view.shape[i];
  }
  if (strides.size() != ndim) throw ConfigError("strides must have one entry per dimension");
  if (view.byte_offset % static_cast<uint64_t>(item_bytes) != 0) {
    throw ConfigError("offset must be a multiple of the element size");
  }
  // The highest byte the view can touch must lie inside the reserved range.
  int64_t last_element = 0;
  bool empty = false;
  for (size_t i = 0; i < ndim; ++i) {
    if (view.shape[i] < 0) throw ConfigError("shape entries must be >= 0");
    if (strides[i] < 0) throw ConfigError("strides must be >= 0");
    if (view.shape[i] == 0) empty = true;
    last_element += (view.shape[i] - 1) * strides[i];
  }
  const uint64_t end = empty ? view.byte_offset
                             : view.byte_offset + static_cast<uint64_t>(last_element + 1) *
                                                      static_cast<uint64_t>(item_bytes);
  if (end > tensor->size()) {
    throw ConfigError("view ends at byte " + std::to_string(end) + " but " + tensor->name() +
                      " holds " + std::to_string(tensor->size()) + " bytes");
  }

  auto* context = new ExportContext{tensor, view.shape, std::move(strides), {}};
  DLTensor& dl = context->managed.dl_tensor;
  // The offset is folded into data (byte_offset stays 0), which every consumer handles alike.
  dl.data = reinterpret_cast<void*>(tensor->vaddr() + view.byte_offset);
  auto [device_type, device_id] = dlpack_device(*tensor);
  dl.device = {device_type, device_id};
  dl.ndim = static_cast<int32_t>(ndim);
  dl.dtype = {view.type_code, view.bits, 1};
  dl.shape = context->shape.data();
  dl.strides = context->strides.data();
  dl.byte_offset = 0;
  context->managed.manager_ctx = context;
  context->managed.deleter = delete_export;
  PyObject* capsule = PyCapsule_New(&context->managed, "dltensor", capsule_destructor);
  if (capsule == nullptr) delete context;
  return capsule;
}

}  // namespace kvcached
