"""C++ CPU kernels (kvserve/csrc: paged attention straight from the KV blocks, fused bf16 layer ops), built
with g++ at first use and cached.

The library is plain C++ with OpenMP and no torch headers, so it builds in seconds; it is called through
ctypes with raw data pointers. It goes to ~/.cache/kvserve/kernels/<hash>.so, the hash covering the source,
the flags, the compiler and the CPU (the code is built for -march=native). When no compiler is found or the
build fails, `load()` returns None and callers fall back to the pure-torch backend.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvserve.attention import kv_layout

logger = logging.getLogger("kvserve")

CSRC = Path(__file__).resolve().parent / "csrc"
_FILES = ("common.h", "attention.cpp", "ops.cpp", "gemv.cpp", "layers.cpp")


def _read_source() -> str:
    """The kernel files as one translation unit (common.h first, its includes dropped from the others)."""
    parts = []
    for name in _FILES:
        text = (CSRC / name).read_text()
        parts.append("\n".join(line for line in text.splitlines()
                                 if line.strip() not in ('#include "common.h"', "#pragma once")))
    return "\n".join(parts)


_SOURCE = _read_source()

MAX_HEAD_DIM = 256
MAX_ROWS = 64   # query rows of one work item: q heads per kv head must fit
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-shared", "-fPIC",
          "-std=c++17"]
_lib: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvserve" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next((line for line in info.splitlines() if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _build(cxx: str, source: str | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    source = _SOURCE if source is None else source
    flags = _FLAGS + list(extra_flags)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    key = hashlib.sha256("|".join([source, " ".join(flags), version, _cpu_id()]).encode()).hexdigest()[:20]
    path = cache_dir() / f"kvserve_kernels_{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        src = Path(tmp) / "kernels.cpp"
        src.write_text(source)
        out = Path(tmp) / "kernels.so"
        proc = subprocess.run([cxx, *flags, str(src), "-o", str(out)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{proc.stderr[-4000:]}")
        os.replace(out, path)   # atomic: a concurrent builder's copy is just as good
    return path


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {
        "kvserve_paged_attention_f32": [p, i64, p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, f],
        "kvserve_paged_attention_bf16": [p, i64, p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, f, i64],
        "kvserve_write_kv": [p, i64, p, i64, p, i64, i64, i64, i64, i64, i64, p, p],
        "kvserve_rmsnorm_bf16": [p, p, p, p, i64, i64, f],
        "kvserve_rope_bf16": [p, i64, p, p, i64, i64, i64],
        "kvserve_silu_mul_bf16": [p, i64, p, i64, i64],
        "kvserve_gemv_pack": [p, i64, i64, p],
        "kvserve_argmax_f32": [p, i64, i64, i64, p],
        "kvserve_packed_matmul_bf16": [p, i64, p, p, i64, i64, i64, i64],
        "kvserve_llama_layers_bf16": [p, p, p, i64, p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, i64, i64, i64, i64,
                                 f, f, p, i64],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = None
    lib.kvserve_simd.restype = ctypes.c_int
    lib.kvserve_bf16_tiles.restype = ctypes.c_int
    lib.kvserve_has_packed_matmul.restype = ctypes.c_int
    lib.kvserve_silu_mul_fast.restype = ctypes.c_int
    lib.silu_mul_fast = bool(lib.kvserve_silu_mul_fast())
    return lib


def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel library, built on first use; None when it cannot be built (no compiler, build error)."""
    global _lib, _tried
    if extra_flags:
        return _bind(ctypes.CDLL(str(_build(_require_compiler(), extra_flags=extra_flags))))
    if _tried:
        return _lib
    _tried = True
    cxx = _compiler()
    if cxx is None:
        logger.warning("kvserve: no C++ compiler found; using the pure-torch attention backend")
        return None
    # torch is imported first, so the library's libgomp.so.1 resolves to torch's: one OpenMP thread pool
    try:
        _lib = _bind(ctypes.CDLL(str(_build(cxx))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("kvserve: building the C++ attention kernels failed; using the pure-torch backend: %s", e)
        _lib = None
    return _lib


def _require_compiler() -> str:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler")
    return cxx


def paged_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, kernel_args: tuple, num_heads: int, scale: float) -> None:
    """out[T, H*D] = causal attention of q[T, H*D] (rows may be strided) over each sequence's paged K/V (either
    layout for bf16, standard for float32); kernel_args: AttentionMetadata.kernel_args."""
    bs, hkv, d = kv_layout.geometry(k_cache)
    _, tables, table_stride, seq_lens, query_start, num_seqs = kernel_args
    args = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables, table_stride,
            seq_lens, query_start, num_seqs, num_heads, hkv, d, bs, scale)
    if q.dtype == torch.bfloat16:
        lib.kvserve_paged_attention_bf16(*args, kv_layout.is_tiled(k_cache))
    else:
        lib.kvserve_paged_attention_f32(*args)


def write_kv(lib: ctypes.CDLL, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             kernel_args: tuple) -> None:
    """k_cache/v_cache rows [slot_mapping[t]] = k/v [t] (k, v: [T, Hkv*D], rows may be strided; either layout)."""
    bs, hkv, d = kv_layout.geometry(k_cache)
    lib.kvserve_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kernel_args[0], k.shape[0], hkv, d,
                    k.element_size(), bs, kv_layout.is_tiled(k_cache), k_cache.data_ptr(), v_cache.data_ptr())


def pack_weight(lib: ctypes.CDLL, weight: torch.Tensor, out: torch.Tensor) -> None:
    """Repack a bf16 weight [N, K] (K even) into `out` (packed_numel(N, K) bf16) for kvserve_packed_matmul_bf16."""
    n, k = weight.shape
    w = weight.contiguous()
    lib.kvserve_gemv_pack(w.data_ptr(), n, k, out.data_ptr())


def packed_numel(n: int, k: int) -> int:
    return -(-n // 16) * 16 * k


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes, 2 MiB aligned, advised to the kernel as transparent huge pages before it is
    touched (Linux; elsewhere, or when refused, plain pages). Weights streamed every step read ~1.4x faster
    from huge pages here (32.6 against 23.2 GB/s, the read test in docs/benchmarks.md)."""
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    buf = raw[start:start + nbytes]
    if platform.system() == "Linux" and nbytes >= _HUGE_PAGE:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise(buf.data_ptr(), nbytes - nbytes % _HUGE_PAGE, _MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass
    return buf
