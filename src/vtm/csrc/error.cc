#include "error.h"

namespace vtm {

const char* ErrorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOutOfMemory: return "OutOfMemory";
    case ErrorCode::kInvalidArgument: return "InvalidArgument";
    case ErrorCode::kNotFound: return "NotFound";
    case ErrorCode::kFailedPrecondition: return "FailedPrecondition";
    case ErrorCode::kBackend: return "BackendError";
    case ErrorCode::kUnavailable: return "Unavailable";
    case ErrorCode::kInternal: return "InternalError";
  }
  return "InternalError";
}

}  // namespace vtm
