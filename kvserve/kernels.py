"""The C++ CPU kernels (kvserve/csrc): paged attention straight from the KV blocks, bf16 matmuls on packed
weights, fused norms, RoPE and SiLU, LoRA adapters, the whole decoder layer stack in one call, argmax and the
grammar bitmask.

The library is plain C++ with OpenMP and no torch headers, called through ctypes with raw data pointers. `make`
builds it at set-up (`python -m kvserve.kernels`); otherwise the first engine builds it (a one-time message, at
most BUILD_TIMEOUT_S) into ~/.cache/kvserve/kernels/<hash>.so, the hash covering the source, the flags, the
compiler and the CPU (the code is built for -march=native).

What runs depends on the CPU, and the engine logs it at start (`summary()`): AVX-512 gives the vectorized
attention; AVX-512 BF16 adds the tiled bf16 KV layout and vdpbf16ps matmuls. AVX2 has an attention kernel of its
own. Without AVX-512 BF16 (AVX2, and AVX-512 CPUs without it) the packed bf16 matmuls widen the bf16 weights to
float32 in registers (the GEMM's tiles on 16 lanes where there is AVX-512). On all of them, bf16 runs the packed
matmuls and the fused layer stack (the fast path). Elsewhere the portable C++ build runs the attention, and with no
compiler (or a failed build) everything is plain torch. Every path computes the same model: the tests run the
engine on each (`variant()`).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve import memory
from kvserve.attention import fp8, kv_layout

logger = logging.getLogger("kvserve")

CSRC = Path(__file__).resolve().parent / "csrc"
_FILES = ("common.h", "attention.cpp", "attention_avx2.cpp", "attention_avx512.cpp", "attention_dispatch.cpp",
          "ops.cpp", "gemv.cpp", "quant.cpp", "quant_avx2.cpp", "quant_dispatch.cpp",
          "quant_k.cpp", "quant_int8.cpp", "quant_matmul.cpp", "lora.cpp",
          "layers.cpp", "moe.cpp", "shm.cpp")


def _read_source(csrc: Path = CSRC) -> str:
    """The kernel files in `csrc` as one translation unit (common.h first, its includes dropped from the others)."""
    parts = []
    for name in _FILES:
        if not (csrc / name).exists() and csrc != CSRC and (csrc / "common.h").exists():
            continue   # an older tree's kernels (benchmarks/quant_ab.py), from before a file was split off
        text = (csrc / name).read_text()
        parts.append("\n".join(line for line in text.splitlines()
                                 if line.strip() not in ('#include "common.h"', "#pragma once")))
    return "\n".join(parts)


_SOURCE = _read_source()

MAX_HEAD_DIM = 256
MAX_ROWS = 64   # query rows of one work item: q heads per kv head must fit
BUILD_TIMEOUT_S = 300
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-fPIC", "-std=c++17"]
# linked apart from the compile and without -ffast-math: gcc would link crtfastmath.o, whose constructor sets
# flush-to-zero for the whole process (torch included) the moment the library loads
_LINK_FLAGS = ["-shared", "-fopenmp"]
# native: everything this CPU supports; no-avx512: the same without AVX-512 (what an AVX2 CPU runs; tests compare
# the two bit for bit where they differ); no-avx512bf16: the same without AVX-512 BF16 (what Skylake to Ice Lake
# Xeons run); portable: the plain C++ paths every x86/ARM CPU runs; none: no C++ at all (no compiler), every op in
# torch
VARIANTS = {"native": (), "no-avx512": ("-mno-avx512f",), "no-avx512bf16": ("-mno-avx512bf16",),
            "portable": ("-DKVSERVE_PORTABLE",), "none": None}
# KVSERVE_KERNELS picks the variant for the whole process: KVSERVE_KERNELS=no-avx512 (with oneDNN and ATen held to
# AVX2: ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2) runs on an AVX-512 machine what an AVX2 machine runs;
# KVSERVE_KERNELS=no-avx512bf16 ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI what an AVX-512 CPU without BF16 runs
_ENV = "KVSERVE_KERNELS"


def _initial_variant() -> str:
    name = os.environ.get(_ENV, "native") or "native"
    if name not in VARIANTS:
        raise ValueError(f"{_ENV}={name!r} is not a kernel variant; choose from {sorted(VARIANTS)}")
    return name


_variant = _initial_variant()
_libs: dict[str, ctypes.CDLL | None] = {}
_failures: dict[str, str] = {}   # variant -> why it could not be built


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


# the feature each variant below native drops: built where the CPU has it (elsewhere it is the native build)
_DROPS = {"no-avx512": "avx512f", "no-avx512bf16": "avx512_bf16"}


def differs_here(name: str) -> bool:
    """False for a variant that drops a feature this CPU lacks: it would build what native builds. True where the
    CPU's flags are unknown (no flags line in /proc/cpuinfo)."""
    flags = _cpu_id()
    return name not in _DROPS or not flags.startswith("flags") or _DROPS[name] in flags.split()


def build_of(name: str) -> str:
    """The variant whose build `name` is here: itself, or native for one that drops only what this CPU lacks."""
    return name if differs_here(name) else "native"


def distinct_builds(names) -> list[str]:
    """`names` as the builds they are here (build_of), each once, in order: what tests and benchmarks compare."""
    return list(dict.fromkeys(map(build_of, names)))


def _build(cxx: str, source: str | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """The cached library for these sources and flags, compiling it first if needed (at most BUILD_TIMEOUT_S)."""
    source = _SOURCE if source is None else source
    flags = _FLAGS + list(extra_flags)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    ident = "|".join([source, " ".join(flags + _LINK_FLAGS), version, _cpu_id()])
    key = hashlib.sha256(ident.encode()).hexdigest()[:20]
    name = f"kvserve_kernels_{key}.so"
    path = cache_dir() / name
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        build_dir = tempfile.mkdtemp(dir=path.parent, prefix=".build-")
    except OSError as e:   # a read-only cache (home, or only its kernels folder): build anyway, not for next time
        path = Path(tempfile.mkdtemp(prefix="kvserve-kernels-")) / name
        build_dir = tempfile.mkdtemp(dir=path.parent, prefix=".build-")
        logger.warning("kvserve: the kernel cache %s is not writable (%s); building into %s, not cached",
                       cache_dir(), e, path.parent)
    try:
        return _compile(cxx, source, flags, path, Path(build_dir))
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def _compile(cxx: str, source: str, flags: list[str], path: Path, tmp: Path) -> Path:
    """Compile and link in `tmp` (beside `path`), then move the library into place."""
    logger.warning("kvserve: compiling the C++ CPU kernels for this CPU (once; cached in %s)...", path.parent)
    start = time.monotonic()
    src, obj, out = tmp / "kernels.cpp", tmp / "kernels.o", tmp / "kernels.so"
    src.write_text(source)
    deadline = start + BUILD_TIMEOUT_S
    _run_compiler([cxx, *flags, "-c", str(src), "-o", str(obj)], deadline)
    _run_compiler([cxx, *_LINK_FLAGS, str(obj), "-o", str(out)], deadline)
    os.replace(out, path)   # atomic: a concurrent builder's copy is just as good
    logger.warning("kvserve: compiled the C++ CPU kernels in %.1f s", time.monotonic() - start)
    return path


def _run_compiler(cmd: list[str], deadline: float) -> None:
    """Run one compiler command; past the deadline its whole process group goes (the driver's cc1plus too)."""
    # its own process group, so that a timeout ends it whole; the same for Ctrl-C, which no longer reaches it
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    except BaseException as e:
        os.killpg(proc.pid, signal.SIGKILL)   # the group outlives a driver that already exited: safe
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if isinstance(e, subprocess.TimeoutExpired):
            raise RuntimeError(f"{cmd[0]} did not finish within {BUILD_TIMEOUT_S} s") from None
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed:\n{stderr[-4000:]}")


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {
        "kvserve_paged_attention_f32": [p, i64, p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, f, i64, f],
        "kvserve_paged_attention_bf16": [p, i64, p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, f, i64, i64, f],
        "kvserve_write_kv": [p, i64, p, i64, p, i64, i64, i64, i64, i64, i64, p, p],
        "kvserve_paged_attention_fp8": [p, i64, p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, f, i64, i64, p, i64,
                                        f],
        "kvserve_write_kv_fp8": [p, i64, p, i64, p, i64, i64, i64, i64, i64, p, p, p],
        "kvserve_rmsnorm_bf16": [p, p, p, p, i64, i64, f],
        "kvserve_rope_bf16": [p, i64, p, p, i64, i64, i64],
        "kvserve_silu_mul_bf16": [p, i64, p, i64, i64],
        "kvserve_gelu_tanh_mul_bf16": [p, i64, p, i64, i64],
        "kvserve_qk_norm_bf16": [p, i64, p, p, i64, i64, i64, i64, f],
        "kvserve_gemv_pack": [p, i64, i64, p],
        "kvserve_gemv_pack_f16": [p, i64, i64, p],
        "kvserve_argmax_f32": [p, i64, i64, i64, p],
        "kvserve_apply_bitmask_f32": [p, i64, p, i64, p, i64, i64],
        "kvserve_packed_matmul_bf16": [p, i64, p, p, i64, i64, i64, i64],
        "kvserve_packed_matmul_f16": [p, i64, p, p, i64, i64, i64, i64],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = None
    lib.kvserve_decoder_stack_bf16.argtypes = [p]   # a StackArgs (kvserve/model/fused.py)
    lib.kvserve_decoder_stack_bf16.restype = ctypes.c_int   # 0, or -1 - the layer whose linear refused its weights
    lib.kvserve_stack_layout.argtypes = [p]
    lib.kvserve_stack_layout.restype = i64
    lib.kvserve_moe_layout.argtypes = [p]
    lib.kvserve_moe_layout.restype = i64
    lib.kvserve_moe_bf16.argtypes = [p, p, i64, i64, p]   # a MoEDesc (kvserve/model/moe.py)
    lib.kvserve_moe_bf16.restype = ctypes.c_int   # 0, or -1 where a quantized weight's descriptor is refused
    lib.kvserve_moe_route.argtypes = [p, i64, i64, i64, i64, p, p]
    lib.kvserve_moe_route.restype = None
    lib.kvserve_stack_scratch_per_token.argtypes = [i64] * 5
    lib.kvserve_stack_scratch_per_token.restype = i64
    lib.kvserve_shm_all_reduce.argtypes = [p, i64, i64, i64, p, p, i64, i64, ctypes.c_double]
    lib.kvserve_shm_all_reduce.restype = ctypes.c_int
    lib.kvserve_shm_abort.argtypes = [p]
    lib.kvserve_shm_abort.restype = None
    lib.kvserve_quant_matmul.argtypes = [p, p, i64, i64, p, i64, i64, i64]
    lib.kvserve_quant_matmul.restype = ctypes.c_int
    lib.kvserve_lora_add.argtypes = [p, p, i64, i64, p, i64, i64, p]
    lib.kvserve_lora_add.restype = ctypes.c_int
    lib.kvserve_quant_rows.argtypes = [i64, p, i64, p, i64, i64, p, i64]
    lib.kvserve_quant_rows.restype = ctypes.c_int
    lib.kvserve_omp_release.restype = ctypes.c_int
    lib.kvserve_quant_repack.argtypes = [i64, p, i64, i64, i64]
    lib.kvserve_quant_repack.restype = ctypes.c_int
    lib.kvserve_quant_simd.restype = ctypes.c_int
    lib.kvserve_simd.restype = ctypes.c_int
    lib.kvserve_avx2.restype = ctypes.c_int
    lib.kvserve_fp8_avx2.restype = ctypes.c_int
    lib.kvserve_fp8_attention_path.argtypes = [i64, i64, i64, i64]
    lib.kvserve_fp8_attention_path.restype = ctypes.c_int
    lib.kvserve_bf16_tiles.restype = ctypes.c_int
    if hasattr(lib, "kvserve_attention_split_steps"):   # (an older tree's build, for an A/B, has none)
        lib.kvserve_attention_split_steps.restype = ctypes.c_int64
    lib.kvserve_has_packed_matmul.restype = ctypes.c_int
    lib.kvserve_packed_matmul_kind.restype = ctypes.c_int
    lib.kvserve_has_packed_matmul_f16.restype = ctypes.c_int
    lib.kvserve_silu_mul_fast.restype = ctypes.c_int
    lib.silu_mul_fast = bool(lib.kvserve_silu_mul_fast())
    return lib


def release_openmp_workers() -> None:
    """End the calling thread's OpenMP worker threads where the kernels are loaded (csrc/ops.cpp's
    kvserve_omp_release): while libgomp keeps more workers than there are CPUs, every thread's parallel regions put
    their workers to sleep and wake them through the kernel. Call it from a thread done with parallel work (the one
    that loaded the model, one that read a LoRA adapter) while another thread computes."""
    lib = _libs.get(_variant)
    if lib is not None and lib.kvserve_omp_release() != 0:
        logger.debug("kvserve: OpenMP workers not released (called inside a parallel region)")


def load() -> ctypes.CDLL | None:
    """The kernel library of the current variant, built on first use; None when it cannot be built."""
    if _variant not in _libs:
        _libs[_variant] = _load(_variant)
    return _libs[_variant]


def _load(name: str) -> ctypes.CDLL | None:
    if build_of(name) != name:   # it drops what this CPU lacks: the same build
        lib = load_variant("native")
        if lib is None:
            _failures[name] = _failures.get("native")
        return lib
    flags = VARIANTS[name]
    if flags is None:
        _failures[name] = "switched off"
        return None
    cxx = _compiler()
    if cxx is None:
        _failures[name] = "no C++ compiler (install g++)"
        logger.warning("kvserve: no C++ compiler found: attention and matmuls run in plain torch (slower); "
                       "install g++ and restart")
        return None
    # torch is imported first, so the library's libgomp.so.1 resolves to torch's: one OpenMP thread pool
    try:
        return _bind(ctypes.CDLL(str(_build(cxx, extra_flags=flags))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _failures[name] = f"the build failed: {str(e).splitlines()[0]}"
        logger.warning("kvserve: building the C++ CPU kernels failed; attention and matmuls run in plain torch "
                       "(slower): %s", e)
        return None


def load_variant(name: str) -> ctypes.CDLL | None:
    """The library of a named variant (tests compare them), without making it the current one."""
    if name not in _libs:
        _libs[name] = _load(name)
    return _libs[name]


@contextlib.contextmanager
def variant(name: str):
    """Run the code inside on another kernel variant (tests and benchmarks: build engines inside it)."""
    global _variant
    if name not in VARIANTS:
        raise ValueError(f"unknown kernel variant {name!r}; choose from {sorted(VARIANTS)}")
    previous, _variant = _variant, name
    try:
        yield load()
    finally:
        _variant = previous


@dataclass(frozen=True)
class KernelStatus:
    """What the current variant provides on this CPU."""

    built: bool           # the C++ library loaded
    avx512: bool          # vectorized attention, norms and argmax
    bf16: bool            # AVX-512 BF16: tiled bf16 KV, vdpbf16ps matmuls
    reason: str | None    # why the library is missing
    avx2: bool = False    # AVX2 attention and bf16 layer ops
    bf16_matmul: bool = False   # packed bf16 matmuls: vdpbf16ps, or bf16 weights widened to float32 (AVX2, AVX-512)
    fp8_avx2: bool = False      # the AVX2 attention kernel reads FP8 KV (F16C); on AVX-512 CPUs the AVX-512 one does
                                # where head dims are a multiple of 32 (kvserve_fp8_attention_path)

    @property
    def fast_bf16(self) -> bool:
        """bf16 runs the packed matmuls and the fused layer stack."""
        return self.built and self.bf16_matmul


def status() -> KernelStatus:
    lib = load()
    if lib is None:
        return KernelStatus(False, False, False, _failures.get(_variant))
    kind = lib.kvserve_packed_matmul_kind()
    return KernelStatus(True, bool(lib.kvserve_simd()), kind == 1, None, bool(lib.kvserve_avx2()),
                        kind >= 1 and lib.silu_mul_fast, bool(lib.kvserve_fp8_avx2()))


def summary(dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype | None = None) -> str:
    """One line: which kernel paths an engine of this dtype (and KV cache dtype) on this device runs, and what it
    falls back to."""
    if device.type != "cpu":
        return f"{device.type}: torch ops"
    st = status()
    dt = str(dtype).removeprefix("torch.")
    from kvserve.model.linear_method import onednn_available
    matmuls = (f"{dt} matmuls by oneDNN on prepacked weights" if dtype == torch.float32 and
               onednn_available(torch.float32) else f"{dt} matmuls in torch")
    if not st.built:
        return f"no C++ kernels ({st.reason}): attention in plain torch, {matmuls}{_SEE}"
    fp8_kv = kv_dtype is not None and kv_dtype in fp8.FORMATS   # FP8 pools: the AVX-512 or AVX2 kernel, else portable
    fp8_kernel = ("AVX-512 kernel; AVX2 for head dims not a multiple of 32, portable for those not of 16" if st.avx512
                  else "AVX2 kernel, F16C; portable for head dims not a multiple of 16" if st.fp8_avx2
                  else "portable kernel")
    if dtype == torch.bfloat16 and st.bf16:
        kv = f"FP8 KV ({fp8_kernel})" if fp8_kv else "tiled KV"
        return f"C++ AVX-512 BF16: paged attention on {kv}, packed bf16 matmuls, fused layer stack"
    if fp8_kv:
        attention = f"C++ paged attention on FP8 KV ({fp8_kernel})"
    else:
        attention = ("C++ paged attention (AVX-512)" if st.avx512 else "C++ paged attention (AVX2)" if st.avx2
                     else "C++ paged attention (portable: no AVX2)")
    if dtype == torch.bfloat16 and st.bf16_matmul:
        return (f"{attention}; packed bf16 matmuls (the bf16 weights widened to float32 in registers, "
                f"{'AVX-512' if st.avx512 else 'AVX2'} FMAs), quantized ones by int8 dot products; the fused layer "
                "stack where the layers allow")
    if st.bf16_matmul:
        return f"{attention}; {matmuls} (--dtype bfloat16 runs the bf16 kernels)"
    return f"{attention}; {matmuls} (no bf16 matmul kernels here: --dtype float32 is the fast path){_SEE}"


_SEE = "; see docs/architecture.md, Kernel paths"


def is_degraded(device: torch.device) -> bool:
    """True on a CPU that cannot run the fast path: no C++ kernels, or no packed bf16 matmuls (the fused stack needs
    them too: its bf16 ops are vectorized exactly where they are built)."""
    return device.type == "cpu" and not status().fast_bf16


def main(argv: list[str] | None = None) -> int:
    """`python -m kvserve.kernels [--with-portable]`: build the kernels now (make setup does) and say what this CPU
    runs; --with-portable also builds the variants the tests compare against, at the same time: the portable one,
    on a CPU with AVX-512 the no-avx512 one, and with AVX-512 BF16 the no-avx512bf16 one (one compiler process
    each, all at once)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--with-portable"]):
        print("usage: python -m kvserve.kernels [--with-portable]", file=sys.stderr)
        return 2
    threads = {}
    # the test variants compile beside the native one (daemons: Ctrl-C does not wait for them); each one that drops
    # a feature only where the native build has it, which the CPU's flags tell before it is built
    wanted = ["portable"] + [name for name in _DROPS if differs_here(name)] if args else []
    for name in wanted:
        threads[name] = threading.Thread(target=load_variant, args=(name,), daemon=True)
        threads[name].start()
    st = status()
    for name, thread in threads.items():
        thread.join()
        if not _libs.get(name):
            print(f"kvserve kernels, {name} variant: not built: {_failures.get(name, 'the build raised')}")
            return 1 if st.built else 0   # without a compiler nothing builds: the engine runs plain torch
        print(f"kvserve kernels, {name} variant: built")
    if st.built:
        print(f"kvserve kernels: built ({'AVX-512' if st.avx512 else 'AVX2' if st.avx2 else 'portable, no AVX2'}"
              f"{', AVX-512 BF16' if st.bf16 else ', no AVX-512 BF16'})")
    else:
        print(f"kvserve kernels: not built: {st.reason}; the engine will run plain torch ops")
    print(f"  float32: {summary(torch.float32, torch.device('cpu'))}")
    print(f"  bfloat16: {summary(torch.bfloat16, torch.device('cpu'))}")
    return 0


def paged_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, kernel_args: tuple, num_heads: int, scale: float,
                    kv_scales: torch.Tensor | None = None, sliding_window: int | None = None,
                    softcap: float | None = None) -> None:
    """out[T, H*D] = causal attention of q[T, H*D] (rows may be strided) over each sequence's paged K/V (either
    layout for bf16, standard for float32 and FP8 pools, whose values kv_scales [K's, V's] multiply);
    kernel_args: AttentionMetadata.kernel_args. sliding_window W: a token sees only the last W keys up to its own;
    softcap c: each scaled score s becomes c * tanh(s / c) before the softmax."""
    window, cap = int(sliding_window or 0), float(softcap or 0.0)
    bs, hkv, d = kv_layout.geometry(k_cache)
    _, tables, table_stride, seq_lens, query_start, num_seqs = kernel_args
    args = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables, table_stride,
            seq_lens, query_start, num_seqs, num_heads, hkv, d, bs, scale)
    if k_cache.dtype in fp8.FORMATS:
        lib.kvserve_paged_attention_fp8(*args, q.dtype == torch.bfloat16, fp8.FORMATS[k_cache.dtype],
                                        kv_scales.data_ptr(), window, cap)
    elif q.dtype == torch.bfloat16:
        lib.kvserve_paged_attention_bf16(*args, kv_layout.is_tiled(k_cache), window, cap)
    else:
        lib.kvserve_paged_attention_f32(*args, window, cap)


def write_kv(lib: ctypes.CDLL, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             kernel_args: tuple, kv_scales: torch.Tensor | None = None) -> None:
    """k_cache/v_cache rows [slot_mapping[t]] = k/v [t] (k, v: [T, Hkv*D], rows may be strided; either layout);
    FP8 pools take fp8(k / K's scale), fp8(v / V's scale) (kv_scales, kvserve/attention/fp8.py)."""
    bs, hkv, d = kv_layout.geometry(k_cache)
    if k_cache.dtype in fp8.FORMATS:
        lib.kvserve_write_kv_fp8(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kernel_args[0], k.shape[0],
                                 hkv, d, k.dtype == torch.bfloat16, fp8.FORMATS[k_cache.dtype],
                                 kv_scales.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())
        return
    lib.kvserve_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kernel_args[0], k.shape[0], hkv, d,
                    k.element_size(), bs, kv_layout.is_tiled(k_cache), k_cache.data_ptr(), v_cache.data_ptr())


def pack_weight(lib: ctypes.CDLL, weight: torch.Tensor, out: torch.Tensor, consume: bool = False) -> None:
    """Repack a bf16 (or fp16) weight [N, K] (K even) into `out` (packed_numel(N, K) values) for
    kvserve_packed_matmul_bf16 (or _f16): a permutation of the 16-bit values, in panels of 16 rows. consume: the
    weight is dropped next, so it is packed a few panels at a time and each part's pages go back to the OS as soon
    as it is packed (memory.discard_pages: the weight reads as zeros there after): a large weight (a tied embedding
    table) and its pack then never both take memory."""
    n, k = weight.shape
    w = weight.contiguous()
    pack = lib.kvserve_gemv_pack_f16 if w.dtype == torch.float16 else lib.kvserve_gemv_pack
    row_bytes, done = k * w.element_size(), 0
    step = max(16, _CONSUME_BYTES // row_bytes // 16 * 16) if consume else n
    for r in range(0, n, step):
        rows = min(step, n - r)
        pack(w[r:].data_ptr(), rows, k, out[r * k:].data_ptr())
        if consume:
            end = (r + rows) * row_bytes
            memory.discard_pages(w, done, end)
            done = end - (w.data_ptr() + end) % memory.PAGE   # the page across this part's end: with the next


_CONSUME_BYTES = 4 << 20   # a consumed weight's bytes packed between two hand-backs of its pages


def packed_numel(n: int, k: int) -> int:
    return -(-n // 16) * 16 * k


if __name__ == "__main__":
    sys.exit(main())
