"""Process memory helpers."""
from __future__ import annotations

import ctypes
import functools
import mmap
import platform

import torch


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS where the C library is glibc (a no-op elsewhere): glibc keeps what
    loading freed (dense weights replaced by their packs or quantized blocks, a large tokenizer.json's parse,
    conversion temporaries) as resident memory otherwise."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass


PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def discard_pages(tensor: torch.Tensor, start: int, end: int) -> int:
    """Hand back to the OS the whole pages inside bytes [start, end) of `tensor` (Linux), where no other tensor
    views its storage: their contents are lost, they read as zeros, and they stop counting in the resident set
    until written again. For a tensor the caller is about to drop, consumed piece by piece (a weight packed panel by
    panel), so that it and what replaces it never both take memory. The caller vouches that nothing else holds the
    tensor object itself (a view, which this check sees, is how to keep its values). Returns the bytes handed
    back (0 where not possible)."""
    storage = tensor.untyped_storage()
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    madvise = _madvise()
    if (madvise is None or use_count is None or not tensor.is_contiguous() or tensor.device.type != "cpu"
            or storage.data_ptr() != tensor.data_ptr() or storage.nbytes() != tensor.nbytes
            or use_count(storage._cdata) != 2):   # the tensor's and `storage`'s: no view
        return 0
    lo = -(-(tensor.data_ptr() + start) // PAGE) * PAGE
    hi = (tensor.data_ptr() + min(end, tensor.nbytes)) // PAGE * PAGE
    if hi <= lo:
        return 0
    return hi - lo if madvise(lo, hi - lo, _MADV_DONTNEED) == 0 else 0


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes, 2 MiB aligned, advised to the kernel as transparent huge pages before it is
    touched (Linux; elsewhere, or when refused, plain pages): weights streamed every step read faster from huge
    pages (benchmarks/LOG.md)."""
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    buf = raw[start:start + nbytes]
    madvise = _madvise()
    if madvise is not None and nbytes >= _HUGE_PAGE:
        madvise(buf.data_ptr(), nbytes - nbytes % _HUGE_PAGE, _MADV_HUGEPAGE)
    return buf


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's madvise (Linux), or None."""
    if platform.system() != "Linux":
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise
