// C++ error types of the data plane. bindings.cpp translates each one into the Python class of
// kvcached_core.errors with the same meaning (docs/architecture.md, principle 8):
//   OutOfMemoryError     -> PoolExhausted          (recoverable: nothing changed, retry or preempt)
//   StateError           -> StateConsistencyError  (fatal: the state of memory is unknown)
//   QuarantineError      -> MapQuarantinedError    (a rollback was uncertain; pages were quarantined)
//   ConfigError          -> KVCachedConfigError    (a geometry or setting that cannot work)
//   BackendError         -> RuntimeError           (a driver call failed and was cleanly rolled back)
#pragma once

#include <stdexcept>
#include <string>

namespace kvcached {

class OutOfMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class StateError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class QuarantineError : public StateError {
 public:
  using StateError::StateError;
};

class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class BackendError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace kvcached
