"""Python face of the native data plane (`kvcached_core._C`).

The extension does not link libtorch (docs/architecture.md, principle 6): a virtual KV tensor
reaches torch through the DLPack protocol, with no copy. `as_tensor` is the one function engines
need; torch is imported lazily, so importing this module never requires it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcached_core import _C

if TYPE_CHECKING:
    import torch

Backend = _C.Backend
HostBackend = _C.HostBackend
FTensor = _C.FTensor
FTensorAllocator = _C.FTensorAllocator
PageAllocator = _C.PageAllocator
PageMapper = _C.PageMapper

# DLPack type codes (dlpack.h): int, uint, float, bfloat, bool.
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_BOOL = 0, 1, 2, 4, 6

# torch dtype name -> (DLPack code, bits). float8 travels as uint8 bits and is viewed back.
_DLPACK_DTYPES: dict[str, tuple[int, int]] = {
    "bool": (_DL_BOOL, 8),
    "int8": (_DL_INT, 8),
    "int16": (_DL_INT, 16),
    "int32": (_DL_INT, 32),
    "int64": (_DL_INT, 64),
    "uint8": (_DL_UINT, 8),
    "float16": (_DL_FLOAT, 16),
    "float32": (_DL_FLOAT, 32),
    "float64": (_DL_FLOAT, 64),
    "bfloat16": (_DL_BFLOAT, 16),
}
_AS_UINT8 = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})


def cuda_driver_status() -> tuple[bool, str]:
    """(available, reason): whether the CUDA driver can be used here, and why not."""
    available, reason = _C.cuda_driver_status()
    return bool(available), str(reason)


def cuda_backend(device_id: int = 0) -> Backend:
    """The CUDA driver backend of one device. RuntimeError with the plain reason if unusable."""
    return _C.cuda_backend(device_id)


def host_backend(memory_limit_bytes: int = 0) -> HostBackend:
    """A host-memory backend; `memory_limit_bytes` caps what it may commit (0: the OS decides)."""
    return _C.HostBackend(memory_limit_bytes)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class FTensorView:
    """A typed, strided window on an FTensor that speaks the DLPack protocol."""

    def __init__(
        self,
        ftensor: FTensor,
        dtype_code: int,
        bits: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...] | None,
        byte_offset: int,
    ) -> None:
        self.ftensor = ftensor
        self.dtype_code = dtype_code
        self.bits = bits
        self.shape = tuple(shape)
        self.strides = tuple(strides) if strides is not None else None
        self.byte_offset = byte_offset

    def __dlpack_device__(self) -> tuple[int, int]:
        device_type, device_id = self.ftensor.dlpack_device()
        return int(device_type), int(device_id)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        # No work of ours is pending on any stream, so `stream` needs no synchronisation.
        # The capsule is the unversioned kind, which consumers asking for max_version accept.
        if copy:
            raise BufferError("an FTensor view is exported without copying")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"an FTensor view lives on {self.__dlpack_device__()}")
        return self.ftensor.to_dlpack(
            self.dtype_code, self.bits, list(self.shape), list(self.strides or ()), self.byte_offset
        )


def as_tensor(
    ftensor: FTensor,
    dtype: torch.dtype,
    shape: tuple[int, ...] | list[int],
    strides: tuple[int, ...] | list[int] | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """A torch tensor over `ftensor`'s memory: no copy, `strides` in elements, `offset` in bytes.

    The tensor keeps the FTensor's virtual range alive for as long as it (or a view of it) lives.
    """
    import torch

    name = _dtype_name(dtype)
    as_bits = name in _AS_UINT8
    if as_bits:
        code, bits = _DL_UINT, 8
    elif name in _DLPACK_DTYPES:
        code, bits = _DLPACK_DTYPES[name]
    else:
        raise TypeError(f"dtype {dtype} cannot be exported from an FTensor")
    view = FTensorView(
        ftensor,
        code,
        bits,
        tuple(shape),
        tuple(strides) if strides is not None else None,
        offset,
    )
    tensor = torch.from_dlpack(view)
    return tensor.view(dtype) if as_bits else tensor
