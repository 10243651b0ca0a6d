"""The Triton attention backend's kernels (kernels.py) and their typed ops (ops.py); triton is imported only when
the backend is chosen."""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter on CPU tensors (TRITON_INTERPRET=1, read at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why the Triton backend cannot run on `device`, or None when it can."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e})"
    kind = torch.device(device).type
    if kind == "cuda":
        return None
    if kind == "cpu" and interpreting():
        return None
    return (f"the Triton kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests); the device "
            f"is {kind}")
