"""Building blocks shared by the model families: norms, the rotation of rotary embedding (its tables: rotary.py), fused
linears, activations."""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.errors import ModelLoadError
from kvserve.model.quantization import QuantizedTensor, QuantizedWeight, embedding_rows, quantized_matmul
from kvserve.module import InferenceModule


class Linear(InferenceModule):
    """y = x W^T (+ b) with uninitialized parameters: every weight is overwritten by load_weights."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None   # packed copies of weight (prepack_linears), or its quantized form
        self.lora = None   # its LoRA adapter slots (kvserve/lora/layers.py LoRAWeights), when LoRA is enabled
        # tensor parallelism: a row-parallel linear's group (kvserve/distributed TPComm), which sums the ranks'
        # partial outputs before the bias is added
        self.tp = None

    @property
    def quantized(self) -> QuantizedWeight | None:
        """The GGUF-quantized weight this linear multiplies, when it kept one (then `weight` is shape-only)."""
        return None if self.packed is None else self.packed.quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp is None else None
        if self.packed is not None:
            y = packed_linear(x, self.packed, bias)
        elif self.weight.is_meta:   # F.linear would return a meta tensor, and the kernels would read address 0
            raise RuntimeError("this Linear's plain weight was released after packing and its pack removed; "
                               "restore_unpacked_weights(model) brings the weights back")
        else:
            y = F.linear(x, self.weight, bias)
        if self.lora is not None and self.lora.mapping.row_slot is not None:
            self.lora.apply(x, y)   # + (x A) B for the rows whose request chose an adapter
        if self.tp is not None:
            self.tp.all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y


@dataclass
class PackedWeight:
    """A CPU weight [N, K] packed once in the layout a matmul kernel streams. bf16: kvserve/csrc/gemv.cpp's
    (16 output columns x 2 inputs per 64-byte line; a GEMV up to 8 rows, register-tiled GEMM beyond) where the
    C++ kernels build with AVX-512 BF16 and K is even, else oneDNN's blocked layout. float32: oneDNN's, which
    reads a few rows' weights once (MKL's F.linear costs several single-row passes for 2-8 rows). quant: a GGUF
    weight kept in its block formats (kvserve/model/quantization.py), for any activation dtype."""

    out_features: int
    kernel: torch.Tensor | None = None   # the C++ kernels' layout
    kernel_ptr: int = 0
    lib: object = None
    onednn: torch.Tensor | None = None   # oneDNN's layout, where the C++ kernels are not available
    quant: QuantizedWeight | None = None


def _kernel_lib():
    lib = kernels.load()
    return lib if lib is not None and lib.kvserve_has_packed_matmul() else None


def can_prepack(weight: torch.Tensor) -> bool:
    """True where a packed weight is available: CPU and bf16, with the C++ matmul kernels or a torch built with
    mkldnn; CPU and float32 with mkldnn."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        return onednn_available(torch.float32)
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    if _kernel_lib() is not None and weight.shape[1] % 2 == 0:
        return True
    return onednn_available(torch.bfloat16)


@functools.cache
def onednn_available(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU pack linears of `dtype` for oneDNN (bf16 needs AVX-512 or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(8, 8, dtype=dtype)
        packed_linear(torch.ones(1, 8, dtype=dtype), PackedWeight(8, onednn=_onednn_pack(w)))
        return True
    except (RuntimeError, AttributeError):
        return False



def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)


def prepack_weights(weights: list[torch.Tensor], onednn: bool = False,
                    on_packed: Callable[[int, PackedWeight], None] | None = None) -> list[PackedWeight]:
    """Pack weights [N, K] once (they must not change afterwards). The C++ kernels' copies share one huge-page
    buffer: decode steps read it from start to end. onednn=True packs for oneDNN even where the kernels exist
    (benchmarks compare the two). on_packed(i, pack) is called as soon as weights[i] is packed (prepack_linears
    drops the plain weight there, and its entry in `weights`)."""
    lib = _kernel_lib()
    onednn = onednn or lib is None or any(w.shape[1] % 2 or w.dtype != torch.bfloat16 for w in weights)
    if not onednn:
        sizes = [kernels.packed_numel(*w.shape) for w in weights]
        parts = kernels.huge_page_buffer(2 * sum(sizes)).view(torch.bfloat16).split(sizes)
    packs = []
    for i in range(len(weights)):
        w = weights[i]
        if onednn:
            packs.append(PackedWeight(w.shape[0], onednn=_onednn_pack(w)))
        else:
            kernels.pack_weight(lib, w, parts[i])
            packs.append(PackedWeight(w.shape[0], kernel=parts[i], kernel_ptr=parts[i].data_ptr(), lib=lib))
        del w
        if on_packed is not None:
            on_packed(i, packs[-1])
    return packs


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T with a prepacked weight: the C++ kernels, faster than oneDNN at every size (benchmarks/matmul.py);
    oneDNN's path (where they do not build) is bit-identical to F.linear in bf16; in float32 it sums in another
    order than F.linear (MKL) and agrees to rounding."""
    if packed.kernel is not None:
        if x.dim() != 2 or x.stride(1) != 1:
            return packed_linear(x.reshape(-1, x.shape[-1]).contiguous(), packed, bias).view(*x.shape[:-1], -1)
        n = packed.out_features   # the call inlined: decode steps make 121 of these per token
        y = x.new_empty(x.shape[0], n)
        packed.lib.kvserve_packed_matmul_bf16(x.data_ptr(), x.stride(0), packed.kernel_ptr, y.data_ptr(), n, x.shape[0],
                                         n, x.shape[1])
    elif packed.quant is not None:
        y = quantized_matmul(x, packed.quant)
    else:
        y = torch.ops.mkldnn._linear_pointwise(x, packed.onednn, None, "none", [], "")
    return y if bias is None else y + bias


def prepack_linears(model: nn.Module, extra: list[torch.Tensor] = (),
                    release: bool = False) -> tuple[int, list[PackedWeight]]:
    """Give every bf16 CPU Linear a packed weight (quantized ones keep theirs); returns how many, and the packs of
    the `extra` weights. release: each Linear's plain weight is dropped as soon as its pack is made, where the pack
    can give it back (release_unpacked_weights' rule), so that the plain weights and the packs never both take
    the whole model's memory."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.quantized is None]
    weights = [m.weight for m in linears] + list(extra)
    if not weights or not can_prepack(weights[0]):
        return 0, []

    def packed(i: int, pack: PackedWeight) -> None:
        if i < len(linears):
            linears[i].packed = pack
            if release:
                _release_plain_weight(linears[i])
                weights[i] = None
    packs = prepack_weights(weights, on_packed=packed)
    return len(linears), packs[len(linears):]


def unpack_weight(packed: PackedWeight, in_features: int) -> torch.Tensor:
    """W [N, K] back from the C++ kernels' layout (the pack is a permutation: exact), or from a float32 oneDNN pack
    as I_K @ W^T (each entry one product by 1 plus zeros: exact for finite weights, -0.0 coming back as 0.0; an
    infinite or NaN weight makes its row NaN). Benchmarks and tests use it, through restore_unpacked_weights."""
    if packed.kernel is None:
        eye = torch.eye(in_features, dtype=torch.float32)
        return packed_linear(eye, packed).t().contiguous()
    n, k = packed.out_features, in_features
    nb = -(-n // 16)
    return packed.kernel.view(nb, k // 2, 16, 2).permute(0, 2, 1, 3).reshape(nb * 16, k)[:n].clone()


def release_unpacked_weights(model: nn.Module) -> int:
    """Drop the plain weight of every Linear that has a C++-kernel or a float32 oneDNN pack (the serving path reads
    only the pack), leaving a shape-only meta tensor; returns the bytes freed. A Linear whose pack is then removed
    raises, and restore_unpacked_weights() brings the weights back (benchmarks that switch packing off)."""
    return sum(_release_plain_weight(m) for m in model.modules() if isinstance(m, Linear))


def _release_plain_weight(m: Linear) -> int:
    """release_unpacked_weights for one Linear: the bytes freed."""
    if not _can_unpack(m.packed, m.weight.dtype) or m.weight.is_meta:
        return 0
    freed = m.weight.numel() * m.weight.element_size()
    m.weight = nn.Parameter(torch.empty(m.weight.shape, dtype=m.weight.dtype, device="meta"), requires_grad=False)
    return freed


def restore_unpacked_weights(model: nn.Module) -> None:
    """Undo release_unpacked_weights() from the packs."""
    for m in model.modules():
        if isinstance(m, Linear) and m.weight.is_meta and _can_unpack(m.packed, m.weight.dtype):
            m.weight = nn.Parameter(unpack_weight(m.packed, m.weight.shape[1]), requires_grad=False)


def _can_unpack(packed: PackedWeight | None, dtype: torch.dtype) -> bool:
    return packed is not None and (packed.kernel is not None or packed.onednn is not None and dtype == torch.float32)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (q|k|v, gate|up) in one matmul."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_sizes = dict(shard_sizes)
        offsets = [0]
        for size in shard_sizes.values():
            offsets.append(offsets[-1] + size)
        self.shard_offsets = dict(zip(shard_sizes, offsets))

    def shard(self, param: torch.Tensor, shard_id: str) -> torch.Tensor:
        """The rows of `param` (weight or bias) that hold shard `shard_id`."""
        return param.narrow(0, self.shard_offsets[shard_id], self.shard_sizes[shard_id])

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a fused output back into its shards, in declaration order."""
        return y.split(list(self.shard_sizes.values()), dim=-1)


class VocabEmbedding(InferenceModule):
    """Token embedding table with an uninitialized weight (loaded from the checkpoint)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.quantized: QuantizedWeight | None = None   # a GGUF table kept quantized (then `weight` is shape-only)
        # tensor parallelism (vocab-parallel): this rank's rows are the vocabulary from vocab_start; the others' ids
        # look up zeros, and the group's sum gives every rank every row
        self.tp = None
        self.vocab_start = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(1), 0)
        self.tp.all_reduce(out)
        return out

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return embedding_rows(self.quantized.segments[0], input_ids, self.weight.dtype)
        return F.embedding(input_ids, self.weight)


def _fast_lib(x: torch.Tensor):
    """The C++ kernel library when x is a bf16 CPU tensor with contiguous rows, else None (use torch ops)."""
    if x.dtype != torch.bfloat16 or not x.is_cpu or x.dim() != 2 or x.stride(1) != 1:
        return None
    return kernels.load()


_gpu_ops_module = None


def _gpu_ops(x: torch.Tensor):
    """kvserve.model.triton_ops where x is a 2-d bf16/fp16 CUDA tensor with contiguous rows and Triton imports
    (the engine warns at start where it does not: attention then runs in torch too), else None (use torch ops)."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2 or x.stride(1) != 1:
        return None
    global _gpu_ops_module
    if _gpu_ops_module is None:
        try:
            from kvserve.model import triton_ops
            _gpu_ops_module = triton_ops
        except ImportError:
            _gpu_ops_module = False
    return _gpu_ops_module or None


class RMSNorm(InferenceModule):
    """Root-mean-square norm, computed in float32 and cast back like the HF reference.

    With `residual`, it first adds x to the residual stream and returns (norm(x + residual), x + residual):
    one fused kernel in bf16 on the CPU (C++) and in bf16/fp16 on CUDA (Triton) instead of an add and five norm ops."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        weight = self.weight   # one nn.Module attribute lookup: this runs twice per layer per step
        lib = _fast_lib(x) if x.shape[-1] <= 8192 and weight.dtype == x.dtype else None
        if lib is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            out = torch.empty_like(x)
            lib.kvserve_rmsnorm_bf16(x.data_ptr(), None if residual is None else residual.data_ptr(),
                                weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], self.eps)
            return out if residual is None else (out, residual)
        ops = _gpu_ops(x) if x.shape[-1] <= 65536 and weight.dtype == x.dtype else None
        if ops is not None and (residual is None or residual.stride(-1) == 1):
            return ops.rmsnorm(x, weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        out = weight * x.to(dtype)
        return out if residual is None else (out, residual)


class SiluAndMul(InferenceModule):
    """silu(gate) * up for a fused [.., 2*I] gate|up tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = _fast_lib(x)
        if lib is not None and lib.silu_mul_fast and x.shape[-1] % 2 == 0:   # one pass, rounding like torch's two
            out = x.new_empty(x.shape[0], x.shape[1] // 2)
            lib.kvserve_silu_mul_bf16(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1] // 2)
            return out
        ops = _gpu_ops(x)
        if ops is not None:
            return ops.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(InferenceModule):
    """gelu(gate, tanh approximation) * up for a fused [.., 2*I] gate|up tensor (GeGLU: Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = _fast_lib(x)
        if lib is not None and lib.silu_mul_fast and x.shape[-1] % 2 == 0:   # one pass, rounding like torch's two
            out = x.new_empty(x.shape[0], x.shape[1] // 2)
            lib.kvserve_gelu_tanh_mul_bf16(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1] // 2)
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, 1, D] (rotate_half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def qk_norm_inplace(x: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int, num_kv_heads: int,
                    head_dim: int) -> bool:
    """Normalize the first num_heads heads of every row of x [T, >= (num_heads + num_kv_heads) * D] by q_norm and
    the next num_kv_heads by k_norm, in place with one C++ kernel (bf16 on the CPU; the rounding of RMSNorm on
    each head as a row); False, touching nothing, where it does not apply."""
    lib = _fast_lib(x)
    if lib is None or head_dim > 8192 or q_norm.weight.dtype != x.dtype or k_norm.weight.dtype != x.dtype \
            or q_norm.eps != k_norm.eps:
        return False
    lib.kvserve_qk_norm_bf16(x.data_ptr(), x.stride(0), q_norm.weight.data_ptr(), k_norm.weight.data_ptr(),
                             x.shape[0], num_heads, num_kv_heads, head_dim, q_norm.eps)
    return True


def rotate_heads_inplace(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor,
                         sin: torch.Tensor) -> bool:
    """Rotate the first `num_heads` heads of every row of x [T, >= num_heads * D] in place with one kernel (same
    rounding as apply_rotary): C++ for bf16 on the CPU, Triton for bf16/fp16 on CUDA; False, touching nothing,
    where neither applies."""
    if cos.dtype != x.dtype or not (cos.is_contiguous() and sin.is_contiguous()):
        return False
    ops = _gpu_ops(x)
    if ops is not None and head_dim & (head_dim - 1) == 0 and head_dim >= 2:
        ops.rope_inplace(x, num_heads, head_dim, cos, sin)
        return True
    lib = _fast_lib(x)
    if lib is None or head_dim > 512:
        return False
    lib.kvserve_rope_bf16(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), x.shape[0], num_heads, head_dim)
    return True


def load_packed_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                        packed: dict[str, tuple[str, str]], skip: Callable[[str], bool]) -> None:
    """Load HF-named tensors, routing packed projections into their fused module's shard. Quantized GGUF tensors
    (QuantizedTensor) become their module's quantized weight once all its shards are; a module whose shards mix
    quantized and dense tensors gets them all dequantized."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[tuple[str, str | None]] = set()
    quantized: dict[str, dict[str | None, QuantizedTensor]] = {}   # module name -> its quantized shards
    dense: set[str] = set()   # modules with a dense weight shard
    assembled: set[str] = set()   # modules whose quantized weight is built
    for name, tensor in weights:
        if skip(name):
            continue
        target, shard = _route(name, packed, params)
        owner = target.rsplit(".", 1)[0]
        dest = params[target]
        if shard is not None:
            dest = modules[owner].shard(dest, shard)
        if (owner in assembled and target.endswith(".weight")) or \
                (isinstance(tensor, QuantizedTensor) and (target, shard) in loaded):   # would be lost, or replace
            raise ModelLoadError(f"checkpoint tensor {name!r} appears twice")
        if isinstance(tensor, QuantizedTensor):
            _check_shape(name, dest, tensor.shape)
            shards = quantized.setdefault(owner, {})
            shards[shard] = tensor
            if _has_all_shards(modules[owner], shards) and owner not in dense:
                # assembled as soon as it can be: the file's pages behind go
                _keep_quantized(modules[owner], quantized.pop(owner), False)
                assembled.add(owner)
        else:
            _copy_checked(name, dest, tensor)
            if target.endswith(".weight"):
                dense.add(owner)
        loaded.add((target, shard))
    while quantized:   # the rest (some shards dense, or missing): popped as assembled, each freed once copied
        owner, shards = quantized.popitem()
        _keep_quantized(modules[owner], shards, owner in dense)
        del shards
    missing = sorted(_expected_slots(params, modules) - loaded, key=str)
    if missing:
        names = [t if s is None else f"{t}[{s}]" for t, s in missing]
        raise ModelLoadError(f"checkpoint is missing {len(names)} parameter(s): {', '.join(names[:20])}"
                             + (" ..." if len(names) > 20 else ""))


def _route(name: str, packed: dict[str, tuple[str, str]], params: dict) -> tuple[str, str | None]:
    """Map an HF parameter name to (our parameter name, shard id or None)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            fused, shard = packed[part]
            target = ".".join(parts[:i] + [fused] + parts[i + 1:])
            if target in params:
                return target, shard
    if name in params:
        return name, None
    raise ModelLoadError(f"checkpoint tensor {name!r} has no matching parameter in the model")


def _has_all_shards(module: nn.Module, shards: dict) -> bool:
    """Whether `shards` holds every shard of `module` (a fused MergedLinear's each; another module's one)."""
    return set(module.shard_sizes) == set(shards) if isinstance(module, MergedLinear) else True


def _keep_quantized(module: nn.Module, shards: dict[str | None, QuantizedTensor], mixed: bool) -> None:
    """Give `module` its quantized weight (its plain one made shape-only), or dequantize the shards into its plain
    weight where some shards are dense or the module cannot hold a quantized weight."""
    order = list(module.shard_sizes) if isinstance(module, MergedLinear) else [None]
    if mixed or not _has_all_shards(module, shards) or not isinstance(module, (Linear, VocabEmbedding)):
        for shard, qt in shards.items():
            dest = module.weight if shard is None else module.shard(module.weight, shard)
            with torch.no_grad():
                dest.copy_(qt.dequantize())
        return
    weight = QuantizedWeight([shards[s] for s in order])
    if isinstance(module, Linear):
        module.packed = PackedWeight(weight.out_features, quant=weight)
    else:
        module.quantized = weight
    module.weight = nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype, device="meta"),
                                 requires_grad=False)


def _check_shape(name: str, dest: torch.Tensor, shape: tuple) -> None:
    if tuple(dest.shape) != tuple(shape):
        raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(shape)}, "
                             f"the model expects {tuple(dest.shape)}")


def _copy_checked(name: str, dest: torch.Tensor, tensor: torch.Tensor) -> None:
    _check_shape(name, dest, tensor.shape)
    with torch.no_grad():
        dest.copy_(tensor)


def _expected_slots(params: dict, modules: dict) -> set[tuple[str, str | None]]:
    slots: set[tuple[str, str | None]] = set()
    for pname in params:
        owner = modules[pname.rsplit(".", 1)[0]]
        if isinstance(owner, MergedLinear):
            slots.update((pname, s) for s in owner.shard_sizes)
        else:
            slots.add((pname, None))
    return slots
