"""``--device auto`` and ``--dtype auto``: CUDA when torch sees it, bf16 on CUDA.

`ragkv serve` and `ragkv index` default to ``auto`` so that a GPU host (the Docker
image, the Terraform g5 units and Batch jobs pass no device) computes on its GPU
without being told. torch is imported only when ``auto`` has to be resolved.
"""

from __future__ import annotations

from ragkv.types import DType

AUTO = "auto"


def resolve_device(device: str) -> str:
    """``device``, or ``cuda`` / ``cpu`` for ``auto`` by what torch sees."""
    if device != AUTO:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: DType | str, device: str) -> DType:
    """``dtype``, or for ``auto``: bfloat16 on CUDA, float32 elsewhere (CPUs are slow at 16-bit).

    Raises:
        ValueError: ``dtype`` is not a DType.
    """
    try:
        dtype = DType(dtype)
    except ValueError:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(d.value for d in DType)}") from None
    if dtype is DType.AUTO:
        return DType.BFLOAT16 if resolve_device(device).startswith("cuda") else DType.FLOAT32
    return dtype
