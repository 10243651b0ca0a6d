"""`python -m kvserve.attention.triton.compile` (`make gpu-compile`): compile every Triton kernel variant the engine
launches for sm_80 (A100) and sm_90 (H100/H200) ahead of time, with the ptxas inside Triton's wheel, on a machine
without a GPU, and print the registers, spills and shared memory of each. Exits 1 if a variant fails to compile.
Run it without TRITON_INTERPRET (the interpreter replaces the kernels)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

ARCHS = (80, 90)
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
FP8 = {"fp8_e4m3": "fp8e4nv", "fp8_e5m2": "fp8e5"}
KV_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                   "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class Variant:
    """One attention geometry in one dtype (the KV pools' dtype may be FP8)."""

    dtype: str
    kv_dtype: str
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    window: int = 0
    softcap: float = 0.0
    splits: int = 1   # split KV (a decode step of few sequences)

    def label(self) -> str:
        kv = "" if self.kv_dtype == self.dtype else f" kv={self.kv_dtype}"
        window = f" window={self.window}" if self.window else ""
        cap = f" softcap={self.softcap:g}" if self.softcap else ""
        splits = f" splits={self.splits}" if self.splits > 1 else ""
        return (f"{self.dtype}{kv} h={self.heads}/{self.kv_heads} d={self.head_dim} bs={self.block_size}"
                f"{window}{cap}{splits}")


def variants() -> list[Variant]:
    """The geometries of the models we serve (GQA 3 at D=64, GQA 6 at D=128, MHA), both block sizes, every dtype,
    a sliding window with logit soft-capping (Gemma 2's shape), FP8 pools, split KV (a single stream's decode)."""
    out = []
    for dtype in DTYPES:
        out += [Variant(dtype, dtype, 9, 3, 64, 16), Variant(dtype, dtype, 12, 2, 128, 16),
                Variant(dtype, dtype, 8, 8, 64, 32)]
    out += [Variant("bfloat16", "bfloat16", 8, 4, 128, 16, window=512),
            Variant("bfloat16", "bfloat16", 8, 4, 256, 16, window=4096, softcap=50.0),
            Variant("bfloat16", "fp8_e4m3", 9, 3, 64, 16), Variant("bfloat16", "fp8_e5m2", 12, 2, 128, 16),
            Variant("bfloat16", "bfloat16", 9, 3, 64, 16, splits=16),
            Variant("bfloat16", "bfloat16", 12, 2, 128, 16, splits=16),
            Variant("float16", "float16", 8, 4, 128, 16, window=512, splits=8),
            Variant("bfloat16", "fp8_e4m3", 12, 2, 128, 16, splits=16)]
    return out


def _kernels():
    from kvserve.attention.triton import interpreting
    if interpreting():
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the kernels with Python functions")
    from kvserve.attention.triton import kernels
    return kernels


def attention_source(v: Variant):
    """The unified attention kernel's ASTSource for a variant."""
    from triton.compiler import ASTSource
    kernels = _kernels()
    from kvserve.attention.triton.ops import attention_meta
    t, kv = DTYPES[v.dtype], FP8.get(v.kv_dtype, DTYPES.get(v.kv_dtype))
    constexprs = attention_meta(v.heads, v.kv_heads, v.head_dim, v.block_size, v.window, v.kv_dtype in FP8,
                                v.dtype == "float32", v.softcap, v.splits)
    signature = dict(out_ptr=f"*{t}", q_ptr=f"*{t}", k_cache_ptr=f"*{kv}", v_cache_ptr=f"*{kv}",
                     block_table_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", k_scale_ptr="*fp32",
                     v_scale_ptr="*fp32", scale="fp32", num_seqs="i32", q_stride_t="i32", q_stride_h="i32",
                     out_stride_t="i32", out_stride_h="i32", block_table_stride="i32", part_ptr="*fp32",
                     ml_ptr="*fp32", **{name: "constexpr" for name in constexprs})
    return ASTSource(kernels.unified_attention_kernel, signature, constexprs)


def combine_source(v: Variant):
    """The split-KV combine kernel's ASTSource for a variant with splits."""
    from triton.compiler import ASTSource
    kernels = _kernels()
    from kvserve.attention.triton.ops import combine_meta
    constexprs = combine_meta(v.heads, v.head_dim, v.splits)
    signature = dict(out_ptr=f"*{DTYPES[v.dtype]}", part_ptr="*fp32", ml_ptr="*fp32", out_stride_t="i32",
                     out_stride_h="i32", **{name: "constexpr" for name in constexprs})
    return ASTSource(kernels.combine_splits_kernel, signature, constexprs)


def write_source(v: Variant):
    """The KV write kernel's ASTSource for a variant."""
    from triton.compiler import ASTSource
    kernels = _kernels()
    from kvserve.attention.triton.ops import write_kv_meta
    t, kv = DTYPES[v.dtype], FP8.get(v.kv_dtype, DTYPES.get(v.kv_dtype))
    constexprs = write_kv_meta(v.kv_heads * v.head_dim, KV_TORCH_DTYPES[v.kv_dtype])
    signature = dict(k_ptr=f"*{t}", v_ptr=f"*{t}", k_cache_ptr=f"*{kv}", v_cache_ptr=f"*{kv}", slot_mapping_ptr="*i64",
                     k_scale_ptr="*fp32", v_scale_ptr="*fp32", k_stride="i32", v_stride="i32",
                     **{name: "constexpr" for name in constexprs})
    return ASTSource(kernels.write_kv_kernel, signature, constexprs)


def _ptxas(arch: int) -> str:
    """The path of the ptxas inside Triton's wheel (its helper's signature differs between Triton versions)."""
    from triton.backends.nvidia import compiler
    try:
        tool = compiler.get_ptxas(arch)
    except TypeError:
        tool = compiler.get_ptxas()
    return tool.path if hasattr(tool, "path") else tool[0]


def ptxas_report(ptx: str, arch: int, shared: int) -> str:
    """'N regs, S spill bytes, M smem bytes' from ptxas -v on the kernel's PTX (shared: Triton's dynamic shared
    memory, which ptxas does not see)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        name = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        log = subprocess.run([_ptxas(arch), "-v", f"--gpu-name={name}", path, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", log)
    return f"{regs.group(1) if regs else '?'} regs, {max(map(int, spills), default=0)} spill bytes, {shared} smem bytes"


def layer_op_sources(dtype: str):
    """(name, compile options as launched, ASTSource) of the layer ops (kvserve/model/triton_ops.py) in a dtype, at
    SmolLM2's and Qwen2.5-1.5B's widths."""
    from triton.compiler import ASTSource
    _kernels()   # refuses under the interpreter
    from kvserve.model import triton_ops as k
    t = DTYPES[dtype]

    def source(kernel, meta, **signature):
        constexprs, options = meta
        return options, ASTSource(kernel, {**signature, **{name: "constexpr" for name in constexprs}}, constexprs)

    out = []
    for hidden, head_dim, inter in ((576, 64, 1536), (1536, 128, 8960)):
        for has_res in (False, True):
            out.append((f"rmsnorm h={hidden}{' +res' if has_res else ''}", *source(
                k.rmsnorm_kernel, k.rmsnorm_meta(hidden, has_res), x_ptr=f"*{t}", residual_ptr=f"*{t}",
                weight_ptr=f"*{t}", out_ptr=f"*{t}", residual_out_ptr=f"*{t}", x_stride="i32",
                residual_stride="i32", n="i32", eps="fp32")))
        out.append((f"rope d={head_dim}", *source(k.rope_kernel, k.rope_meta(head_dim), x_ptr=f"*{t}",
                                                  cos_ptr=f"*{t}", sin_ptr=f"*{t}", x_stride="i32")))
        out.append((f"silu_mul i={inter}", *source(k.silu_mul_kernel, k.silu_mul_meta(inter), x_ptr=f"*{t}",
                                                   out_ptr=f"*{t}", x_stride="i32", n="i32")))
        out.append((f"gelu_tanh_mul i={inter}", *source(k.gelu_tanh_mul_kernel, k.gelu_tanh_mul_meta(inter),
                                                        x_ptr=f"*{t}", out_ptr=f"*{t}", x_stride="i32", n="i32")))
    return out


def compile_all(archs=ARCHS) -> list[tuple[str, str, int, str]]:
    """(kernel, variant, arch, report or 'FAILED: why') for every variant. FP8 pools are for sm_89 and newer (e4m3
    has no sm_80 instructions; the backend refuses FP8 KV there), so they compile for sm_90 only."""
    rows = []
    for v in variants():
        for arch in archs:
            if v.kv_dtype in FP8 and arch < 89:
                continue
            makers = (("unified_attention", attention_source),
                      ("combine_splits", combine_source) if v.splits > 1 else ("write_kv", write_source))
            for name, make in makers:
                rows.append((name, v.label(), arch, _compile(make(v), arch)))
    for dtype in ("bfloat16", "float16"):
        for arch in archs:
            for label, options, source in layer_op_sources(dtype):
                rows.append(("layer op", f"{dtype} {label}", arch, _compile(source, arch, options)))
    return rows


def _compile(source, arch: int, options: dict | None = None) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options or None)
        return ptxas_report(compiled.asm["ptx"], arch, compiled.metadata.shared)
    except Exception as e:   # every variant is tried; the exit code says whether any failed
        return f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def main() -> int:
    import triton
    rows = compile_all()
    print(f"Triton {triton.__version__}: {len(rows)} kernel variants for sm_{'/sm_'.join(map(str, ARCHS))}")
    for name, label, arch, report in rows:
        print(f"  sm_{arch}  {name:17s}  {label:44s}  {report}")
    failed = [r for r in rows if r[3].startswith("FAILED")]
    if failed:
        print(f"{len(failed)} variant(s) failed to compile")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
