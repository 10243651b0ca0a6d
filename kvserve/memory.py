"""Process memory helpers."""
from __future__ import annotations

import ctypes


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS where the C library is glibc (a no-op elsewhere): glibc keeps what
    loading freed (dense weights replaced by their packs or quantized blocks, a large tokenizer.json's parse,
    conversion temporaries) as resident memory otherwise."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass
