// DLPack export of a space's reservation, written from the DLPack ABI spec
// (1.0: versioned "dltensor_versioned" capsules, which carry a writable flag;
// and the legacy unversioned "dltensor" ones for older consumers), so vtm
// has no build dependency on torch or on the dlpack headers.
//
// The managed tensor owns a reference on the Reservation: the virtual range
// stays reserved while any consumer (a torch or numpy array) holds the view.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "reservation.h"

namespace vtm {

struct DLDevice {
  std::int32_t device_type;
  std::int32_t device_id;
};

struct DLDataType {
  std::uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 6 bool
  std::uint8_t bits;
  std::uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // in elements
  std::uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

struct DLPackVersion {
  std::uint32_t major;
  std::uint32_t minor;
};

struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  std::uint64_t flags;  // bit 0: read only; bit 1: is a copy. Ours: 0
  DLTensor dl_tensor;
};

// A new managed tensor of `shape` (C-contiguous, in elements of `dtype`) over
// the start of `reservation`: a DLManagedTensorVersioned when `versioned`,
// else a DLManagedTensor. Throws kInvalidArgument when the shape does not
// fit in the reservation. The consumer calls its deleter.
void* MakeDLPackView(std::shared_ptr<Reservation> reservation, DLDataType dtype,
                     const std::vector<std::int64_t>& shape, bool versioned);

// Frees a view nobody consumed.
void DeleteDLPackView(void* view, bool versioned);

}  // namespace vtm
