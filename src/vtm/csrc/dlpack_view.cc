#include "dlpack_view.h"

#include "error.h"

namespace vtm {
namespace {

// Everything the view owns, freed by the deleter.
struct ViewContext {
  std::shared_ptr<Reservation> reservation;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  DLManagedTensor legacy;
  DLManagedTensorVersioned versioned;
};

void DeleteLegacy(DLManagedTensor* self) { delete static_cast<ViewContext*>(self->manager_ctx); }
void DeleteVersioned(DLManagedTensorVersioned* self) { delete static_cast<ViewContext*>(self->manager_ctx); }

}  // namespace

void* MakeDLPackView(std::shared_ptr<Reservation> reservation, DLDataType dtype,
                     const std::vector<std::int64_t>& shape, bool versioned) {
  if (dtype.bits == 0 || dtype.bits % 8 != 0 || dtype.lanes != 1)
    Throw(ErrorCode::kInvalidArgument, "unsupported dtype for a view: bits " + std::to_string(dtype.bits));
  // The byte size is computed with overflow checks: a product that wrapped
  // would pass the size check below, and torch aborts the process on the
  // resulting shape.
  std::size_t bytes = dtype.bits / 8;
  for (std::int64_t d : shape) {
    if (d < 0) Throw(ErrorCode::kInvalidArgument, "negative dimension in a view shape");
    if (__builtin_mul_overflow(bytes, static_cast<std::size_t>(d), &bytes))
      Throw(ErrorCode::kInvalidArgument, "the view shape's byte size overflows");
  }
  if (bytes > reservation->bytes())
    Throw(ErrorCode::kInvalidArgument, "a view of " + std::to_string(bytes) + " bytes exceeds the reservation of " +
                                           std::to_string(reservation->bytes()));
  // C-contiguous strides, also checked: with a zero dimension in front the
  // byte size is 0 whatever the dimensions after it multiply to.
  std::vector<std::int64_t> strides(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i)
    if (__builtin_mul_overflow(strides[i + 1], shape[i + 1], &strides[i]))
      Throw(ErrorCode::kInvalidArgument, "the view shape's strides overflow");
  auto ctx = std::make_unique<ViewContext>();
  ctx->reservation = std::move(reservation);
  ctx->shape = shape;
  ctx->strides = std::move(strides);
  const auto& backend = ctx->reservation->backend();
  DLTensor& t = versioned ? ctx->versioned.dl_tensor : ctx->legacy.dl_tensor;
  t.data = reinterpret_cast<void*>(ctx->reservation->va());
  t.device = DLDevice{static_cast<std::int32_t>(backend->device_type()), backend->device_id()};
  t.ndim = static_cast<std::int32_t>(shape.size());
  t.dtype = dtype;
  t.shape = ctx->shape.data();
  t.strides = ctx->strides.data();
  t.byte_offset = 0;
  ViewContext* raw = ctx.release();
  if (versioned) {
    raw->versioned.version = DLPackVersion{1, 0};
    raw->versioned.flags = 0;
    raw->versioned.manager_ctx = raw;
    raw->versioned.deleter = DeleteVersioned;
    return &raw->versioned;
  }
  raw->legacy.manager_ctx = raw;
  raw->legacy.deleter = DeleteLegacy;
  return &raw->legacy;
}

void DeleteDLPackView(void* view, bool versioned) {
  if (versioned) {
    auto* t = static_cast<DLManagedTensorVersioned*>(view);
    t->deleter(t);
  } else {
    auto* t = static_cast<DLManagedTensor*>(view);
    t->deleter(t);
  }
}

}  // namespace vtm
