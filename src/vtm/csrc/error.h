// Typed errors of the vTensor Manager.
//
// Every failure that a caller can cause or must handle (bad arguments, memory
// exhaustion, a driver error) is an Error with a code. The Python binding maps
// each code to one exception class under vtm.Error; the broker maps them to
// gRPC status codes. Nothing in vtm aborts the process on a runtime error.
#pragma once

#include <stdexcept>
#include <string>

namespace vtm {

enum class ErrorCode {
  kOutOfMemory,         // no chunk within capacity / device memory, or no free slot
  kInvalidArgument,     // the request itself is malformed; nothing was changed
  kNotFound,            // a name or id that does not exist
  kFailedPrecondition,  // the object is in the wrong state (released, closed, other space)
  kBackend,             // the memory API (driver, kernel) failed
  kUnavailable,         // the backend cannot be used on this machine (no driver)
  kInternal,            // a broken invariant: a bug in vtm
};

const char* ErrorCodeName(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

[[noreturn]] inline void Throw(ErrorCode code, const std::string& message) {
  throw Error(code, message);
}

}  // namespace vtm
