"""All decoder layers of a step in one C++ call on the CPU in bf16 (kvserve/csrc/layers.cpp), for layers declared
pre-norm, SwiGLU, one RoPE table, full attention, no q/k norm (kvserve/model/decoder.py).

The call runs the kernels the per-layer modules call, in their order, on the same shapes, so its output is
bit-identical to theirs; it saves their Python: ~10 calls per layer that each allocate a tensor and convert
ctypes arguments (docs/benchmarks.md measures it).
It applies where every piece has its C++ kernel: packed bf16 or quantized weights (each linear's method, as the
modules call it), the C++ attention backend on bf16 or FP8 pools, a q|k|v bias (Qwen2) but no other, no q/k norm
(Qwen3); anywhere else the model runs its modules (and for the one step that calibrates FP8 KV scales,
kvserve/attention/fp8.py).
"""
from __future__ import annotations

import weakref

import torch

from kvserve import kernels
from kvserve.attention import fp8, kv_layout
from kvserve.attention.backends import CpuPagedAttention

# per layer: input norm, qkv, o, post norm, gate|up, down, K pool, V pool, quantized-linear bits, FP8 KV scales,
# q|k|v bias or 0, LoRA tables or 0 (layers.cpp's L_*)
_LAYER_PTRS = 12


class FusedLayers:
    """The layer stack of one DecoderModel bound to its packed weights and KV pools; rebuilt when either changes."""

    def __init__(self, lib, layers, ptrs: torch.Tensor, tiled: bool, kv_format: int,
                 lora_tables: torch.Tensor | None = None):
        first = layers[0]
        self.lora_tables = lora_tables   # int64 [layers, 4]: what the L_LORA pointers point at
        self.lora_mapping = first.self_attn.qkv_proj.lora.mapping if lora_tables is not None else None
        attn = first.self_attn
        self.lib = lib
        self.ptrs = ptrs
        self.num_layers = len(layers)
        self.tiled = tiled
        self.kv_format = kv_format   # 0: bf16 pools, else their FP8 format (kvserve/attention/fp8.py FORMATS)
        self.hidden_size = first.input_layernorm.weight.shape[0]
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate_size = first.mlp.down_proj.weight.shape[1]
        self.eps = first.input_layernorm.eps
        self.scale = attn.attn.scale
        self.block_size = kv_layout.geometry(attn.attn.k_cache)[0]
        n = self.hidden_size + (2 * self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.scratch_per_token = n + 3 * self.intermediate_size
        self.key = binding_key(layers)
        self.tp = first.self_attn.o_proj.tp   # tensor parallelism: the stack calls its all-reduce after o and down

    def is_current(self, layers) -> bool:
        """False once the pools were rebound or the weights repacked (the pointers would be stale)."""
        return is_same_binding(self.key, layers)

    def forward(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta,
                split: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """residual: the embedding output [T, hidden] (updated in place into the residual stream) ->
        (last layer's MLP output, residual stream), as the layer modules return them. split: decode-only steps
        of 24+ sequences may share the batch out between the threads (layers.cpp; the results are the same)."""
        t = residual.shape[0]
        hidden = torch.empty_like(residual)
        scratch = residual.new_empty(t * self.scratch_per_token)
        slots, tables, table_stride, seq_lens, query_start, num_seqs = meta.kernel_args
        lora_rows = self.lora_mapping.row_slot if self.lora_mapping is not None else None
        rc = self.lib.kvserve_llama_layers_bf16(
            hidden.data_ptr(), residual.data_ptr(), self.ptrs.data_ptr(), self.num_layers, cos.data_ptr(),
            sin.data_ptr(), slots, tables, table_stride, seq_lens, query_start, num_seqs, t, self.hidden_size,
            self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size, self.block_size, self.tiled,
            self.kv_format, self.eps, self.scale, scratch.data_ptr(), int(split),
            None if lora_rows is None else lora_rows.data_ptr(), None if self.tp is None else self.tp.c_all_reduce_ptr)
        if self.tp is not None:
            self.tp.raise_if_failed()   # an exception cannot cross the C++ call: the hook keeps it
        if rc:   # (tensor parallelism: every rank refuses the same linear, before its all-reduce)
            raise RuntimeError(f"the fused layer stack stopped in layer {-1 - rc}: kvserve_quant_matmul does not know "
                               "the format or shape of one of its quantized weights")
        return hidden, residual


def binding_key(layers) -> tuple:
    """Weak references to what the pointers come from (bind_kv_cache and prepack replace them in every layer):
    weak, so that a dropped pool is freed."""
    attn = layers[0].self_attn
    return tuple(_ref(x) for x in _bound(attn))


def _bound(attn) -> tuple:
    """What a layer's pointers come from that can be replaced (the weights' packs, the pools and their scales, the
    LoRA tables)."""
    return attn.attn.k_cache, attn.attn.v_cache, attn.attn.kv_scales, attn.qkv_proj.packed, attn.qkv_proj.lora


def _ref(x):
    return (lambda: None) if x is None else weakref.ref(x)


def is_same_binding(key: tuple, layers) -> bool:
    attn = layers[0].self_attn
    return all(ref() is x for ref, x in zip(key, _bound(attn)))


def _linear_weight(m) -> tuple[int, int] | None:
    """(pointer, 1 if quantized) of what the stack multiplies for Linear m, or None where it cannot."""
    if m.quantized is not None:
        return m.quantized.desc_ptr, 1
    if m.packed is not None and m.packed.kernel is not None:
        return m.packed.kernel_ptr, 0
    return None


def _layer_refusal(layer, tp) -> str | None:
    """Which feature of this layer the stack has no kernel for, or None."""
    attn, mlp, spec = layer.self_attn, layer.mlp, layer.spec
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    cache, qkv_bias = attn.attn.k_cache, attn.qkv_proj.bias
    checks = (
        (spec.qk_norm, "q/k norm"),
        (spec.sandwich_norms, "sandwich norms"),
        (spec.activation not in ("silu", "swish"), f"activation {spec.activation}"),
        (spec.rope != 0, "a second RoPE table"),
        (attn.attn.sliding_window, "a sliding window"),   # the C++ stack attends to every key
        (attn.attn.softcap, "attention soft-capping"),
        (any(_linear_weight(m) is None for m in linears),
         "a linear without a packed bf16 or quantized weight (packed bf16 needs AVX-512 BF16)"),
        (any(m.bias is not None for m in linears[1:]), "a bias on o, gate/up or down"),
        (mlp.down_proj.tp is not tp or attn.o_proj.tp is not tp, "a tensor-parallel split it does not know"),
        (qkv_bias is not None and (qkv_bias.dtype != torch.bfloat16 or not qkv_bias.is_contiguous()),
         "a q/k/v bias not in bf16"),
        (any(n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous() for n in norms), "norms not in bf16"),
        (not isinstance(attn.attn.backend, CpuPagedAttention), "an attention backend other than the C++ one"),
        (not (cache.dtype == torch.bfloat16 or fp8.is_fp8(cache.dtype)) or not cache.is_cpu,
         "KV pools not in bf16 or FP8 on the CPU"),
        (cache.numel() == 0, "no KV pool bound"),
        (attn.head_dim > kernels.MAX_HEAD_DIM, f"head_dim above {kernels.MAX_HEAD_DIM}"),
        (attn.num_heads // attn.num_kv_heads > kernels.MAX_ROWS, "too many query heads per KV head"),
        (norms[0].weight.shape[0] > 8192, "hidden size above 8192"),
    )
    return next((why for bad, why in checks if bad), None)


def why_not_fused(layers) -> str | None:
    """Why the fused stack does not apply to these DecoderLayers as bound now (the log says it), or None."""
    lib = kernels.load()
    # the stack's bf16 ops must be vectorized (AVX-512 BF16 or AVX2); each linear's own kernel is checked per layer
    # (packed bf16 needs AVX-512 BF16, so on AVX2 the stack runs models whose linears are all quantized)
    if lib is None:
        return "no C++ kernels"
    if not lib.silu_mul_fast:
        return "no AVX2 or AVX-512 BF16 for its bf16 ops"
    if not layers:
        return "no layers"
    tp = layers[0].self_attn.o_proj.tp
    for i, layer in enumerate(layers):
        why = _layer_refusal(layer, tp)
        if why is not None:
            return f"layer {i}: {why}"
    caches = [layer.self_attn.attn.k_cache for layer in layers]
    eps = {n.eps for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
    if len({kv_layout.is_tiled(c) for c in caches}) != 1 or len({c.dtype for c in caches}) != 1 or len(eps) != 1:
        return "layers with different KV layouts, KV formats or norm eps"
    return None


def build_fused_layers(layers) -> FusedLayers | None:
    """The fused stack for these DecoderLayers, or None where one of its kernels does not apply (why_not_fused)."""
    if why_not_fused(layers) is not None:
        return None
    ptrs, lora = [], []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        cache, qkv_bias = attn.attn.k_cache, attn.qkv_proj.bias
        (qkv, q0), (o, q1), (gate_up, q2), (down, q3) = [_linear_weight(m) for m in linears]
        lora.append([0 if m.lora is None else m.lora.desc_ptr for m in linears])
        ptrs.append([norms[0].weight.data_ptr(), qkv, o, norms[1].weight.data_ptr(), gate_up, down,
                     cache.data_ptr(), attn.attn.v_cache.data_ptr(), q0 | q1 << 1 | q2 << 2 | q3 << 3,   # Q_BIT
                     attn.attn.kv_scales.data_ptr(), 0 if qkv_bias is None else qkv_bias.data_ptr(), 0])
    cache = layers[0].self_attn.attn.k_cache
    ptrs = torch.tensor(ptrs, dtype=torch.int64).reshape(-1, _LAYER_PTRS)
    lora_tables = torch.tensor(lora, dtype=torch.int64) if any(any(row) for row in lora) else None
    if lora_tables is not None:
        ptrs[:, -1] = lora_tables.data_ptr() + torch.arange(len(layers)) * lora_tables.stride(0) * 8
    return FusedLayers(kernels.load(), layers, ptrs, kv_layout.is_tiled(cache), fp8.FORMATS.get(cache.dtype, 0),
                       lora_tables)
