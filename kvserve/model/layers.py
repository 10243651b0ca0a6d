"""Building blocks shared by the model families: norms, the rotation of rotary embedding (its tables: rotary.py), fused
linears, activations."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.errors import ModelLoadError
from kvserve.memory import return_freed_memory
from kvserve.model.linear_method import (DENSE, LinearMethod, can_prepack, keep_quantized, method_attribute,
                                         prepack_weights, shape_only)
from kvserve.model.quantization import QuantizedTensor, QuantizedWeight
from kvserve.module import InferenceModule


class Linear(InferenceModule):
    """y = x W^T (+ b) by its method (kvserve/model/linear_method.py): the plain weight, packed for a kernel, or
    kept quantized. Parameters start uninitialized: every weight is overwritten by load_weights."""

    method = method_attribute

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.method: LinearMethod = DENSE
        self.lora = None   # its LoRA adapter slots (kvserve/lora/layers.py LoRAWeights), when LoRA is enabled
        # tensor parallelism: a row-parallel linear's group (kvserve/distributed TPComm), which sums the ranks'
        # partial outputs before the bias is added
        self.tp = None
        self.keep_dense = False   # quantization="int8" leaves it dense (an MoE router: routing at full precision)

    @property
    def quantized(self) -> QuantizedWeight | None:
        """The quantized weight this linear multiplies, when it kept one (then `weight` is shape-only)."""
        return self.method.quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias if self.tp is None else None)
        if self.lora is not None and self.lora.mapping.row_slot is not None:
            self.lora.apply(x, y)   # + (x A) B for the rows whose request chose an adapter
        if self.tp is not None:
            self.tp.all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y


def prepack_linears(model: nn.Module, extra: list[torch.Tensor] = (),
                    release: bool = False) -> tuple[int, list[LinearMethod]]:
    """Give every dense bf16 or float32 CPU Linear a packed method (quantized ones keep theirs); returns how many,
    and the methods of the `extra` weights. release: each Linear's plain weight is dropped as soon as its pack is
    made, where the pack can give it back (release_unpacked_weights' rule), so that the plain weights and the packs
    never both take the whole model's memory; the C++ packs consume each plain weight as they go (the `extra` ones
    too: the caller drops them), so not even the largest (a tied embedding table) is held twice."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.quantized is None]
    weights = [m.weight for m in linears] + list(extra)
    if not weights or not can_prepack(weights[0]):
        return 0, []

    freed = 0

    def packed(i: int, method: LinearMethod) -> None:
        nonlocal freed
        if i < len(linears):
            linears[i].method = method
            if release:
                freed += _release_plain_weight(linears[i])
                weights[i] = None
                if freed >= _TRIM_BYTES:   # glibc keeps freed weights resident until trimmed: the packs and the
                    return_freed_memory()  # plain weights would otherwise peak together
                    freed = 0
    packs = prepack_weights(weights, on_packed=packed, consume=release)
    return len(linears), packs[len(linears):]


_TRIM_BYTES = 32 << 20


def release_unpacked_weights(model: nn.Module) -> int:
    """Drop the plain weight of every Linear whose method can give it back (the serving path reads only the
    method), leaving a shape-only meta tensor; returns the bytes freed. A Linear whose method is then reset raises,
    and restore_unpacked_weights() brings the weights back (benchmarks that switch packing off)."""
    return sum(_release_plain_weight(m) for m in model.modules() if isinstance(m, Linear))


def _release_plain_weight(m: Linear) -> int:
    """release_unpacked_weights for one Linear: the bytes freed."""
    if not m.method.can_unpack() or m.weight.is_meta:
        return 0
    freed = m.weight.numel() * m.weight.element_size()
    shape_only(m)
    return freed


def restore_unpacked_weights(model: nn.Module) -> None:
    """Undo release_unpacked_weights() (and a tied embedding's release, CausalLM.prepack) from the methods."""
    for m in model.modules():
        if isinstance(m, (Linear, VocabEmbedding)) and m.weight.is_meta and m.method.can_unpack():
            m.weight = nn.Parameter(m.method.unpack(m.weight.shape[1]), requires_grad=False)


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

    method = method_attribute

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.method: LinearMethod = DENSE   # or a table kept quantized (then `weight` is shape-only)
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

    @property
    def quantized(self) -> QuantizedWeight | None:
        return self.method.quant

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.method.rows(self, input_ids)


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
        ops = _gpu_ops(x)
        if ops is not None:
            return ops.gelu_tanh_mul(x)
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
    keep_quantized(module, QuantizedWeight([shards[s] for s in order]))


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
