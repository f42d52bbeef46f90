// Zero-copy export of an FTensor view through DLPack (legacy, unversioned "dltensor" capsules,
// which every torch since 1.10 consumes). The exported DLManagedTensor owns a shared reference to
// the FTensor, so the virtual range outlives every tensor made from it.
#pragma once

#include <Python.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "ftensor.hpp"

namespace kvcached {

// DLPack type codes used here (the ABI's values).
enum DLPackTypeCode : uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6 };

struct DLPackView {
  uint8_t type_code = kDLUInt;
  uint8_t bits = 8;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements; empty means C-contiguous
  uint64_t byte_offset = 0;
};

// Returns a new reference to a "dltensor" capsule. Throws ConfigError when the view does not lie
// inside the tensor's range.
PyObject* export_dlpack(const std::shared_ptr<FTensor>& tensor, const DLPackView& view);

// (device_type, device_id) as DLPack numbers them: (1, 0) for host, (2, id) for CUDA.
std::pair<int, int> dlpack_device(const FTensor& tensor);

}  // namespace kvcached
