"""Zero-copy tensor views of a space's reservation, through DLPack.

The C++ side builds a DLManagedTensor that holds a reference on the
reservation; here we pick the dtype and hand the capsule to torch or numpy.
Neither is a build dependency: torch is imported only when a torch dtype is
asked for.
"""

from __future__ import annotations

import operator
import sys

from vtm.errors import InvalidArgument

# DLPack type codes (DLDataTypeCode).
_INT, _UINT, _FLOAT, _BFLOAT, _BOOL = 0, 1, 2, 4, 6
_NUMPY_KINDS = {"i": _INT, "u": _UINT, "f": _FLOAT, "b": _BOOL}


class _Exporter:
    """A one-shot object speaking the __dlpack__ protocol for one view."""

    def __init__(self, space, code, bits, shape):
        self._args = (code, bits, shape)
        self._space = space
        self._device = space._device

    def __dlpack__(self, stream=None, max_version=None, **_ignored):
        # Mapping completes on the worker before an operation's future
        # resolves, so there is no pending work to order against `stream`.
        # DLPack 1.0 capsules say "writable"; legacy ones are for consumers
        # that do not ask for a version (numpy imports those read-only).
        # Consumed only once a capsule exists: numpy retries without
        # max_version when the first call raises, and must see that error again.
        if self._space is None:
            raise RuntimeError("this DLPack export was already consumed")
        versioned = max_version is not None and max_version[0] >= 1
        capsule = self._space._dlpack(*self._args, versioned)
        self._space = None
        return capsule

    def __dlpack_device__(self):
        return self._device


def _torch_dtype_code(dtype):
    import torch

    table = {
        torch.uint8: (_UINT, 8),
        torch.int8: (_INT, 8),
        torch.int16: (_INT, 16),
        torch.int32: (_INT, 32),
        torch.int64: (_INT, 64),
        torch.float16: (_FLOAT, 16),
        torch.bfloat16: (_BFLOAT, 16),
        torch.float32: (_FLOAT, 32),
        torch.float64: (_FLOAT, 64),
        torch.bool: (_BOOL, 8),
    }
    if dtype not in table:
        raise InvalidArgument(f"space.tensor: unsupported torch dtype {dtype}")
    return table[dtype]


def _is_torch_dtype(dtype) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(dtype, torch.dtype)


def tensor(space, dtype, shape=None):
    """A zero-copy view of the whole reservation of `space`.

    Default shape: [max_slots, slot_bytes // itemsize]. A torch dtype gives a
    torch.Tensor on the backend's device; a numpy dtype (or its name) gives a
    numpy.ndarray (host backend only). The view keeps the reservation alive;
    touching a page that is not mapped faults.
    """
    if _is_torch_dtype(dtype):
        code, bits = _torch_dtype_code(dtype)
        use_torch = True
    else:
        import numpy as np

        np_dtype = np.dtype(dtype)
        if np_dtype.kind not in _NUMPY_KINDS or np_dtype.itemsize not in (1, 2, 4, 8):
            raise InvalidArgument(f"space.tensor: unsupported numpy dtype {np_dtype}")
        code, bits = _NUMPY_KINDS[np_dtype.kind], np_dtype.itemsize * 8
        use_torch = False
    itemsize = bits // 8
    if shape is None:
        shape = (space.max_slots, space.slot_bytes // itemsize)
    # operator.index, not int: a float dimension is a mistake, not a size to truncate.
    dims = [operator.index(d) for d in shape]
    if any(d >= 1 << 63 for d in dims):
        raise InvalidArgument(f"space.tensor: shape {dims} has a dimension past the 64-bit range")
    exporter = _Exporter(space, code, bits, dims)
    if use_torch:
        import torch

        return torch.from_dlpack(exporter)
    import numpy as np

    if space._device[0] != 1:
        raise InvalidArgument("space.tensor: numpy views exist only for the host backend; pass a torch dtype")
    return np.from_dlpack(exporter)
