"""Quantized weights, and the linear method that multiplies them.

gguf: a GGUF file's weights kept in their block formats. int8 (W8A8): any checkpoint's linears, token embedding and
output head quantized at load to int8 per output channel (INT8: one float scale per row, rows packed in groups of
16 for kvserve/csrc/quant_int8.cpp's dot products; a matrix whose rows do not come in 16s takes ggml's Q8_0
blocks of 32 values instead). Either way a quantized linear holds a QuantizedWeight (rows of ggml blocks, those of
the OCTET_FORMATS reordered for the kernels, or INT8 groups; one segment per format: a fused q|k|v may mix Q4_K
and Q6_K) inside its QuantizedMethod (kvserve/model/linear_method.py); the matmul is
kvserve/csrc/quant_matmul.cpp's (activations quantized to int8 as they arrive: per token and 128 values for INT8,
per 32 values for the 32-value formats, Q4_K and Q6_K, per 128 for Q2_K, Q3_K, Q5_K and IQ4_XS; int32 dot
products), for the modules path and the fused layer stack alike. GGUF formats
without a kernel here are dequantized at load.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvserve import kernels, memory
from kvserve.config import QUANTIZATION_CHOICES
from kvserve.errors import ModelLoadError

# ggml type id -> (name, values per block, bytes per block): the formats kvserve/csrc/quant.cpp multiplies
KERNEL_FORMATS = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
                  8: ("Q8_0", 32, 34), 20: ("IQ4_NL", 32, 18), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
                  12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 23: ("IQ4_XS", 256, 136)}
FORMAT_IDS = {name: tid for tid, (name, _, _) in KERNEL_FORMATS.items()}
# the formats whose rows the kernels keep in octets (quant.cpp: the same bytes, the 32-value formats' blocks
# regrouped by 8 in each row, the quants of each Q4_K and Q6_K super-block chunk-major); their kernel type id is
# OCTETS | the ggml type
OCTET_FORMATS = {2, 3, 6, 7, 8, 12, 14, 20}
OCTETS = 256
INT8 = 200   # kvserve's own type (no ggml type): int8 per output channel, packed in groups of INT8_GROUP rows
INT8_GROUP = 16


def resolve_quantization(name: str | None, is_gguf_file: bool, device: torch.device) -> str:
    """'gguf' (keep a GGUF file's quantized weights), 'int8' (quantize the linears at load) or 'none'; auto keeps
    a GGUF's where the kernels run."""
    name = name or "auto"
    if name not in QUANTIZATION_CHOICES:
        raise ModelLoadError(f"unknown quantization {name!r}; choose from {', '.join(QUANTIZATION_CHOICES)}")
    if name == "int8" and device.type != "cpu":
        raise ModelLoadError(f"int8 weights run on the CPU only; on {device.type} leave --quantization out")
    if name == "gguf" and not is_gguf_file:
        raise ModelLoadError("quantization 'gguf' needs a .gguf model file")
    if name == "gguf" and device.type != "cpu":
        raise ModelLoadError(f"quantized GGUF weights run on the CPU only; on {device.type} pass "
                             "--quantization none to dequantize them")
    if name == "auto":   # where the kernels are vectorized (AVX2); their scalar build is slower than dequantized
        lib = kernels.load()
        return "gguf" if is_gguf_file and device.type == "cpu" and lib is not None and lib.kvserve_quant_simd() else \
            "none"
    if name in ("gguf", "int8") and kernels.load() is None:
        raise ModelLoadError(f"{name} weights need the C++ kernels, which did not build "
                             f"({kernels.status().reason}); pass --quantization none")
    return name


@dataclass
class QuantizedTensor:
    """A [rows, cols] matrix as rows of ggml blocks: data uint8 [rows, bytes per row]. octets: the rows of an
    OCTET_FORMATS format are in the kernels' order (QuantizedWeight packs them so), not the file's."""

    ggml_type: int
    data: torch.Tensor
    cols: int
    source: str = "gguf"   # "gguf": a file's blocks; "int8": quantized at load (quantize_int8, quantize_q8_0)
    octets: bool = False

    @property
    def kernel_type(self) -> int:
        """The type id the C++ kernels take."""
        return self.ggml_type | OCTETS if self.octets else self.ggml_type

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def format(self) -> str:
        return "INT8" if self.ggml_type == INT8 else KERNEL_FORMATS[self.ggml_type][0]

    def select_rows(self, order: np.ndarray) -> QuantizedTensor:
        """The rows in `order` (a row permutation such as the llama q/k unpermute)."""
        if self.ggml_type == INT8:   # rows interleave within their group; only GGUF blocks are permuted
            raise ModelLoadError("INT8 weights are quantized after the checkpoint's rows are in place")
        return replace(self, data=self.data[torch.from_numpy(order)].contiguous())

    def lib_rows(self, ids_ptr: int, n: int, out_ptr: int, out_bf16: int) -> int:
        """kvserve_quant_rows on this matrix: rows ids[:n] dequantized to out."""
        return kernels.load().kvserve_quant_rows(self.kernel_type, self.data.data_ptr(), self.data.shape[1], ids_ptr,
                                                 n, self.cols, out_ptr, out_bf16)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] by gguf-py's reference dequantization (tests and --quantization none); INT8 by its
        layout (see quantize_int8)."""
        if self.ggml_type == INT8:
            k = self.cols
            groups = self.data.reshape(-1, INT8_GROUP * int8_row_bytes(k))
            q = groups[:, :INT8_GROUP * k].view(torch.int8).reshape(-1, k // 4, INT8_GROUP, 4)
            scale = groups[:, INT8_GROUP * k:INT8_GROUP * (k + 4)].contiguous().view(torch.float32)
            return q.permute(0, 2, 1, 3).reshape(-1, INT8_GROUP, k).float().mul(scale[:, :, None]).reshape(-1, k)
        from gguf import GGMLQuantizationType, dequantize
        data = self.data
        if self.octets:   # back in the file's order
            data = data.clone()
            _repack(self.ggml_type, data, to_raw=True)
        out = dequantize(data.numpy(), GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(out.reshape(self.rows, self.cols)))


def _repack(ggml_type: int, data: torch.Tensor, to_raw: bool) -> None:
    """Rows of an OCTET_FORMATS format, in place, from the file's order to the kernels' octets (or back)."""
    lib = kernels.load()
    if lib is None:
        raise ModelLoadError("quantized weights need the C++ kernels, which did not build")
    if lib.kvserve_quant_repack(ggml_type, data.data_ptr(), data.shape[0], data.shape[1], int(to_raw)) != 0:
        raise ModelLoadError(f"no octet layout for ggml type {ggml_type}")


def is_kernel_format(ggml_type: int, cols: int) -> bool:
    """Whether a GGUF matrix of this type and row length can stay quantized."""
    return ggml_type in KERNEL_FORMATS and cols % KERNEL_FORMATS[ggml_type][1] == 0


class QuantizedWeight:
    """The packed weight of a quantized linear: its segments' rows stacked into one buffer, and the descriptor
    that kvserve_quant_matmul reads ([segments, then type, data pointer, rows, bytes per row per segment])."""

    def __init__(self, segments: list[QuantizedTensor]):
        self.source = segments[0].source
        cols = {s.cols for s in segments}
        if len(cols) != 1:
            raise ModelLoadError(f"fused quantized projections disagree on their input size: {sorted(cols)}")
        self.in_features = cols.pop()
        groups: list[list[QuantizedTensor]] = []
        for s in segments:   # neighbours of one format share a segment (q|k of a Q4_K_M file)
            if groups and (groups[-1][0].ggml_type, groups[-1][0].octets) == (s.ggml_type, s.octets):
                groups[-1].append(s)
            else:
                groups.append([s])
        nbytes = [sum(s.data.numel() for s in g) for g in groups]
        self.buffer = memory.huge_page_buffer(sum(nbytes))   # streamed every step: huge pages read faster
        self.segments = []
        for g, part in zip(groups, self.buffer.split(nbytes)):
            for s, piece in zip(g, part.split([s.data.numel() for s in g])):
                piece.copy_(s.data.reshape(-1))
            seg = replace(g[0], data=part.view(-1, g[0].data.shape[1]))
            if seg.ggml_type in OCTET_FORMATS and not seg.octets:
                _repack(seg.ggml_type, seg.data, to_raw=False)
                seg.octets = True
            self.segments.append(seg)
        self.out_features = sum(s.rows for s in self.segments)
        desc = [len(self.segments)]
        for s in self.segments:
            desc += [s.kernel_type, s.data.data_ptr(), s.rows, s.data.shape[1]]
        self.desc = torch.tensor(desc, dtype=torch.int64)
        self.desc_ptr = self.desc.data_ptr()
        self.lib = kernels.load()
        if self.lib is None:
            raise ModelLoadError("quantized weights need the C++ kernels, which did not build")

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def formats(self) -> list[str]:
        return [s.format for s in self.segments]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([s.dequantize() for s in self.segments])


Q8_0 = FORMAT_IDS["Q8_0"]
_Q8_ROWS = 2048


def can_quantize_int8(shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether a [N, K] matrix takes the INT8 format: rows in whole groups, K a multiple of 32."""
    n, k = shape
    return n % INT8_GROUP == 0 and k % 32 == 0


def int8_act_group(k: int) -> int:
    """Values per activation scale of an INT8 matmul with input size k (kvserve/csrc/quant_int8.cpp's)."""
    return 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32


def int8_row_bytes(k: int) -> int:
    """Bytes per row of an INT8 matrix: k values, its scale, and its sums per activation group."""
    return k + 4 + 4 * (k // int8_act_group(k))


def quantize_int8(w: torch.Tensor) -> QuantizedTensor:
    """W [N, K] (can_quantize_int8) as INT8: per row, s = max |w| / 127 and q = round(w / s) (to nearest even),
    |q| <= 127. Each group of 16 rows is 16 int8_row_bytes(K) bytes: K / 4 lines of 64 bytes (line j: the 16 rows'
    values 4j .. 4j + 3, row by row), then the rows' float32 scales, then per activation group (int8_act_group)
    the rows' int32 sums of q over it; data is viewed as [N, int8_row_bytes(K)]."""
    n, k = w.shape
    ig = int8_act_group(k)
    out = torch.empty(n // INT8_GROUP, INT8_GROUP * int8_row_bytes(k), dtype=torch.uint8)
    for r0 in range(0, n, _Q8_ROWS):   # in row chunks (_Q8_ROWS is a multiple of 16): the temporaries stay small
        x = w[r0:r0 + _Q8_ROWS].detach().float()
        s = x.abs().amax(1, keepdim=True) / 127
        q = torch.round(x * torch.where(s == 0, torch.zeros_like(s), 1 / s)).clamp(-127, 127).to(torch.int8)
        g0, g1 = r0 // INT8_GROUP, (r0 + x.shape[0]) // INT8_GROUP
        lines = q.reshape(-1, INT8_GROUP, k // 4, 4).permute(0, 2, 1, 3).reshape(g1 - g0, -1)
        sums = q.reshape(-1, INT8_GROUP, k // ig, ig).sum(-1, dtype=torch.int32).transpose(1, 2).contiguous()
        out[g0:g1, :INT8_GROUP * k] = lines.view(torch.uint8)
        out[g0:g1, INT8_GROUP * k:INT8_GROUP * (k + 4)] = s.reshape(-1, INT8_GROUP).view(torch.uint8)
        out[g0:g1, INT8_GROUP * (k + 4):] = sums.view(torch.uint8).reshape(g1 - g0, -1)
    return QuantizedTensor(INT8, out.view(n, int8_row_bytes(k)), k, "int8")


def quantize_for_int8(w: torch.Tensor) -> QuantizedTensor:
    """quantization="int8"'s format for one matrix: INT8, or Q8_0 where its rows do not come in groups of 16."""
    return quantize_int8(w) if can_quantize_int8(w.shape) else quantize_q8_0(w)


def quantize_q8_0(w: torch.Tensor) -> QuantizedTensor:
    """W [N, K] (K a multiple of 32) as Q8_0 rows, the bytes ggml's quantize_row_q8_0_ref (and llama-quantize)
    writes: per 32 values of a row, d = max |w| / 127, q = roundf(w * (1 / d)) (halves away from zero) in int8,
    d stored as float16."""
    n, k = w.shape
    out = torch.empty(n, k // 32, 34, dtype=torch.uint8)   # per block: float16 d, then 32 int8 values
    for r0 in range(0, n, _Q8_ROWS):   # in row chunks: the float32 temporaries stay small
        x = w[r0:r0 + _Q8_ROWS].detach().float().reshape(-1, k // 32, 32)
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        a = (x * inv).abs()
        whole = a.floor()
        q = (torch.sign(x) * (whole + (2 * (a - whole)).floor())).to(torch.int8)
        out[r0:r0 + _Q8_ROWS, :, :2] = d.to(torch.float16).view(torch.uint8)
        out[r0:r0 + _Q8_ROWS, :, 2:] = q.view(torch.uint8)
    return QuantizedTensor(Q8_0, out.view(n, -1), k, "int8")


Q4_0 = FORMAT_IDS["Q4_0"]


def quantize_q4_0(w: torch.Tensor) -> QuantizedTensor:
    """W [N, K] (K a multiple of 32) as Q4_0 rows, the bytes ggml's quantize_row_q4_0_ref writes: per 32 values
    of a row, m = the value of largest |w| (the first of ties), d = m / -8, q = min(15, trunc(w * (1 / d) + 8.5))
    in float32, packed two to a byte (values i and i + 16 in byte i, low nibble first), d stored as float16."""
    n, k = w.shape
    out = torch.empty(n, k // 32, 18, dtype=torch.uint8)   # per block: float16 d, then 16 bytes of nibbles
    for r0 in range(0, n, _Q8_ROWS):   # in row chunks: the float32 temporaries stay small
        x = w[r0:r0 + _Q8_ROWS].detach().float().reshape(-1, k // 32, 32)
        d = x.gather(-1, x.abs().argmax(-1, keepdim=True)) / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = (x * inv + 8.5).trunc().clamp(0, 15).to(torch.uint8)
        out[r0:r0 + _Q8_ROWS, :, :2] = d.to(torch.float16).view(torch.uint8)
        out[r0:r0 + _Q8_ROWS, :, 2:] = q[..., :16] | (q[..., 16:] << 4)
    return QuantizedTensor(Q4_0, out.view(n, -1), k, "int8")


_Q4_ROWS = 8192   # rows requantized at a time (to_q4_0): their float32 copy stays small


def is_wider_than_q4_0(part: QuantizedTensor) -> bool:
    """Whether a matrix is stored in more bits a weight than Q4_0's 4.5 (Q4_1, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, INT8)."""
    if part.ggml_type == INT8:
        return True
    _, values, nbytes = KERNEL_FORMATS[part.ggml_type]
    return nbytes * 8 > 4.5 * values


def to_q4_0(source: QuantizedTensor | torch.Tensor) -> QuantizedTensor:
    """A matrix requantized to Q4_0 (quantize_q4_0): a quantized one's rows dequantized by the kernels' row lookup
    (embedding_rows), or a plain weight, a chunk of rows at a time."""
    rows = source.rows if isinstance(source, QuantizedTensor) else source.shape[0]
    chunks = []
    for r0 in range(0, rows, _Q4_ROWS):
        dense = (source[r0:r0 + _Q4_ROWS] if isinstance(source, torch.Tensor)
                 else embedding_rows(source, torch.arange(r0, min(rows, r0 + _Q4_ROWS)), torch.float32))
        chunks.append(quantize_q4_0(dense).data)
    return QuantizedTensor(Q4_0, torch.cat(chunks), source.shape[1], "int8")


def _int8_target(name: str) -> bool:
    return (name.startswith("model.layers.") and name.endswith("_proj.weight")) or name in (
        "model.embed_tokens.weight", "lm_head.weight")


def int8_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """quantization="int8" as the checkpoint streams in: each decoder projection weight (model.layers.*_proj.weight),
    the token embedding and the output head (input size a multiple of 32) are quantized (quantize_for_int8) before
    the next tensor is read, so the model's dense matrices are never filled (their never-touched storage never
    becomes resident); load_packed_weights assembles the blocks as it does a GGUF's (a tied head multiplies the
    embedding's blocks), and quantize_linears_int8 then catches any linear left dense."""
    for name, t in weights:
        if isinstance(t, torch.Tensor) and t.dim() == 2 and _int8_target(name) and t.shape[1] % 32 == 0:
            yield name, quantize_for_int8(t)
        else:
            yield name, t


def quantize_linears_int8(model: torch.nn.Module) -> int:
    """quantization="int8": every Linear still dense is quantized (quantize_for_int8; its plain weight freed as it
    goes), multiplied by the int8 kernels. Returns how many were quantized here (one whose input size is not a
    multiple of 32 stays dense, and so does one marked keep_dense: an MoE router)."""
    from kvserve.model.layers import Linear
    from kvserve.model.linear_method import keep_quantized
    count = 0
    for m in model.modules():
        if not isinstance(m, Linear) or m.quantized is not None or m.weight.shape[1] % 32 or m.keep_dense:
            continue
        keep_quantized(m, QuantizedWeight([quantize_for_int8(m.weight)]))
        count += 1
    return count


def quantized_matmul(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [M, K] (float32 or bf16) @ W^T -> [M, N] in x's dtype, by kvserve_quant_matmul's int8 dot products on the
    blocks, for every M: each row's result is the same whatever else is in its step (batching, chunked prefill and
    preemption do not change a request's tokens; a dense GEMM on dequantized tiles would give prefill rows other
    roundings than decode rows)."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the quantized weight takes {weight.in_features}")
    if x.dim() != 2 or x.stride(1) != 1:
        return quantized_matmul(x.reshape(-1, x.shape[-1]).contiguous(), weight).view(*x.shape[:-1], -1)
    if x.dtype not in (torch.float32, torch.bfloat16):   # float16: computed from float32, returned as float16
        return quantized_matmul(x.float(), weight).to(x.dtype)
    y = x.new_empty(x.shape[0], weight.out_features)
    if x.shape[0]:
        rc = weight.lib.kvserve_quant_matmul(weight.desc_ptr, x.data_ptr(), x.stride(0),
                                             int(x.dtype == torch.bfloat16), y.data_ptr(), y.stride(0), x.shape[0],
                                             weight.in_features)
        if rc != 0:
            raise RuntimeError(f"kvserve_quant_matmul does not know one of the formats {weight.formats()}")
    return y


def embedding_rows(table: QuantizedTensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a quantized embedding table, dequantized into `dtype` (float32 or bf16)."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    out = torch.empty(ids.numel(), table.cols, dtype=out_dtype)
    if ids.numel():
        if int(ids.min()) < 0 or int(ids.max()) >= table.rows:
            raise IndexError(f"token id out of range for an embedding table of {table.rows} rows")
        if table.lib_rows(ids.data_ptr(), ids.numel(), out.data_ptr(), int(out_dtype == torch.bfloat16)) != 0:
            raise RuntimeError(f"kvserve_quant_rows does not know the format {table.format}")
    return out if out.dtype == dtype else out.to(dtype)


def describe(model: torch.nn.Module) -> str:
    """What a model's weights are, for the logs: 'GGUF kept quantized (Q4_K x99, Q6_K x29): 1.03 GiB quantized +
    0.00 GiB dense' (a format counted once per linear segment), 'int8 W8A8 (INT8 x121): 0.13 GiB quantized +
    0.00 GiB dense', or 'not quantized; 0.50 GiB weights'."""
    formats: Counter = Counter()
    sources = set()
    qbytes = dense = 0
    for q, d in _module_weights(model):
        if q is not None:
            formats.update(q.formats())
            sources.add(getattr(q, "source", "gguf"))
            qbytes += q.nbytes
        dense += d
    if not formats:
        fp16 = sum(getattr(getattr(m, "method", None), "kind", "") == "packed fp16" for m in model.modules())
        return f"not quantized; {dense / 2**30:.2f} GiB weights" + (f" ({fp16} matrices in fp16)" if fp16 else "")
    kinds = ", ".join(f"{k} x{v}" for k, v in sorted(formats.items()))
    what = "int8 W8A8" if sources == {"int8"} else "GGUF kept quantized"
    return f"{what} ({kinds}): {qbytes / 2**30:.2f} GiB quantized + {dense / 2**30:.2f} GiB dense"


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's (or a module's) weights as they are held: quantized blocks, and dense parameters."""
    return sum((0 if q is None else q.nbytes) + d for q, d in _module_weights(model))


def _module_weights(model: torch.nn.Module):
    """(its quantized weight or None, the bytes of its dense parameters) for every module."""
    for mod in model.modules():
        q = getattr(mod, "quantized", None)
        dense = sum(p.numel() * p.element_size() for name, p in mod.named_parameters(recurse=False)
                    # a packed copy's plain weight is shape-only: the same size
                    if not (q is not None and name == "weight"))
        yield q, dense
