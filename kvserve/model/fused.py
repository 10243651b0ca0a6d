"""All decoder layers of a step in one C++ call on the CPU in bf16 (kvserve/csrc/layers.cpp), executing what each
layer declares (kvserve/model/decoder.py LayerSpec): pre-norm or sandwich norms, q/k norm, RoPE from the layer's
table, full or sliding-window attention with an optional soft-cap, a SiLU or GELU-tanh gated MLP or a mixture of
experts (its MoE block's descriptor, kvserve/model/moe.py).

The call runs the kernels the per-layer modules call, in their order, on the same shapes, so its output is
bit-identical to theirs; it saves their Python: ~10 calls per layer that each allocate a tensor and convert
ctypes arguments (benchmarks/LOG.md measures it). The layers reach C++ as typed structs (LayerDesc, LinearDesc,
StackArgs: named fields mirroring layers.cpp's, their layout checked against the library's by a test).
It applies where every piece has its C++ kernel: packed bf16 or quantized weights (each linear's method, as the
modules call it), the C++ attention backend on bf16 or FP8 pools; anywhere else the model runs its modules (and
for the one step that calibrates FP8 KV scales, kvserve/attention/fp8.py), and why_not_fused says why.
"""
from __future__ import annotations

import ctypes
import weakref

import torch

from kvserve import kernels
from kvserve.attention import fp8, kv_layout
from kvserve.attention.backends import CpuPagedAttention
from kvserve.model.linear_method import method_generation
from kvserve.model.linear_roles import DECODER_LINEARS

MAX_ROPES = 4   # layers.cpp's
_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}   # layers.cpp's Activation
_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class LinearDesc(ctypes.Structure):
    _fields_ = [("weight", _p), ("quantized", _i64), ("bias", _p), ("lora", _p), ("row_parallel", _i64)]


class LayerDesc(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_attn_norm", _p), ("pre_ffn_norm", _p), ("post_ffn_norm", _p),
                ("q_norm", _p), ("k_norm", _p), ("qkv", LinearDesc), ("o", LinearDesc), ("gate_up", LinearDesc),
                ("down", LinearDesc), ("moe", _p), ("k_cache", _p), ("v_cache", _p), ("kv_scales", _p), ("rope", _i64),
                ("kv_group", _i64), ("window", _i64), ("activation", _i64), ("scale", _f32), ("softcap", _f32)]


class StackArgs(ctypes.Structure):
    _fields_ = [("hidden", _p), ("residual", _p), ("scratch", _p), ("layers", ctypes.POINTER(LayerDesc)),
                ("num_layers", _i64), ("cos", _p * MAX_ROPES), ("sin", _p * MAX_ROPES),
                ("slots", _p), ("tables", _p), ("table_stride", _p), ("num_kv_groups", _i64),
                ("seq_lens", _p), ("query_start", _p), ("num_seqs", _i64), ("num_tokens", _i64),
                ("hidden_size", _i64), ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64),
                ("intermediate_size", _i64), ("block_size", _i64), ("tiled", _i64), ("kv_format", _i64),
                ("eps", _f32), ("split", _i64), ("lora_rows", _p), ("all_reduce", _p)]


def struct_layout() -> list[int]:
    """The sizes and offsets layers.cpp's kvserve_stack_layout reports, from the ctypes mirrors above."""
    off = lambda s, f: getattr(s, f).offset   # noqa: E731
    return [ctypes.sizeof(LinearDesc), off(LinearDesc, "bias"), off(LinearDesc, "row_parallel"),
            ctypes.sizeof(LayerDesc), off(LayerDesc, "qkv"), off(LayerDesc, "down"), off(LayerDesc, "moe"),
            off(LayerDesc, "kv_scales"),
            off(LayerDesc, "activation"), off(LayerDesc, "softcap"),
            ctypes.sizeof(StackArgs), off(StackArgs, "cos"), off(StackArgs, "num_kv_groups"),
            off(StackArgs, "num_tokens"), off(StackArgs, "kv_format"), off(StackArgs, "eps"), off(StackArgs, "split"),
            off(StackArgs, "all_reduce")]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear_desc(m) -> LinearDesc:
    """A Linear as the C++ kernels take it (its method's weight, bias, LoRA table, tensor parallelism)."""
    weight, quantized = m.method.kernel_weight()
    return LinearDesc(weight, quantized, _ptr(m.bias), None if m.lora is None else m.lora.desc_ptr,
                      int(m.tp is not None))


def _layer_desc(layer) -> LayerDesc:
    attn, spec, inner = layer.self_attn, layer.spec, layer.self_attn.attn
    norm = lambda m: None if m is None else m.weight.data_ptr()   # noqa: E731
    return LayerDesc(
        norm(layer.input_layernorm), norm(layer.post_attention_layernorm), norm(layer.pre_feedforward_layernorm),
        norm(layer.post_feedforward_layernorm), norm(attn.q_norm), norm(attn.k_norm),
        *(linear_desc(role.of(layer)) if role.held_by(layer) else LinearDesc() for role in DECODER_LINEARS),
        layer.mlp.kernel_binding().ptr if spec.moe is not None else None,   # (why_not_fused: it has one)
        inner.k_cache.data_ptr(), inner.v_cache.data_ptr(), inner.kv_scales.data_ptr(),
        spec.rope, inner.kv_group, inner.sliding_window or 0, _ACTIVATIONS[spec.activation], inner.scale,
        inner.softcap or 0.0)


class FusedLayers:
    """The layer stack of one DecoderModel bound to its packed weights and KV pools; rebuilt when either changes."""

    def __init__(self, lib, layers, tiled: bool, kv_format: int, lora_mapping=None):
        first = layers[0]
        attn = first.self_attn
        self.lib = lib
        self.lora_mapping = lora_mapping
        self.descs = (LayerDesc * len(layers))(*map(_layer_desc, layers))
        h, nh, nkv, d = first.input_layernorm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
        # the dense MLPs' intermediate size (an MoE sizes its own buffers)
        i = max((layer.mlp.down_proj.weight.shape[1] for layer in layers if layer.spec.moe is None), default=0)
        # the MoE blocks' descriptors the layers point to
        self.moe_bindings = [layer.mlp.kernel_binding() for layer in layers if layer.spec.moe is not None]
        self.args = StackArgs(layers=self.descs, num_layers=len(layers), hidden_size=h, num_heads=nh,
                              num_kv_heads=nkv, head_dim=d, intermediate_size=i,
                              block_size=kv_layout.geometry(attn.attn.k_cache)[0], tiled=int(tiled),
                              kv_format=kv_format, eps=first.input_layernorm.eps)
        self.scratch_per_token = lib.kvserve_stack_scratch_per_token(h, nh, nkv, d, i)
        self.key = binding_key(layers)
        self.tp = attn.o_proj.tp   # tensor parallelism: the stack calls its all-reduce after o and down
        self.args.all_reduce = None if self.tp is None else self.tp.c_all_reduce_ptr
        groups = 1 + max(layer.self_attn.attn.kv_group for layer in layers)
        self.slots, self.tables, self.strides = (_p * groups)(), (_p * groups)(), (_i64 * groups)()
        self.args.slots, self.args.tables = ctypes.addressof(self.slots), ctypes.addressof(self.tables)
        self.args.table_stride, self.args.num_kv_groups = ctypes.addressof(self.strides), groups
        self.args_ptr = ctypes.addressof(self.args)

    @property
    def has_lora(self) -> bool:
        """Whether the layers' linears carry LoRA adapter tables."""
        return any(d.qkv.lora or d.o.lora or d.gate_up.lora or d.down.lora for d in self.descs)

    @property
    def tiled(self) -> bool:
        return bool(self.args.tiled)

    @property
    def kv_format(self) -> int:
        """0: bf16 pools, else their FP8 format (kvserve/attention/fp8.py FORMATS)."""
        return self.args.kv_format

    def is_current(self, layers) -> bool:
        """False once the pools were rebound or the weights repacked (the pointers would be stale)."""
        return is_same_binding(self.key, layers)

    def forward(self, residual: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]], meta,
                split: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """residual: the embedding output [T, hidden] (updated in place into the residual stream); tables: each
        RoPE table's (cos, sin) for the step -> (last layer's output, residual stream), as the layer modules return
        them. split: decode-only steps of 24+ sequences may share the batch out between the threads (layers.cpp;
        the results are the same)."""
        a, t = self.args, residual.shape[0]
        hidden = torch.empty_like(residual)
        scratch = residual.new_empty(t * self.scratch_per_token)
        a.hidden, a.residual, a.scratch = hidden.data_ptr(), residual.data_ptr(), scratch.data_ptr()
        for r, (cos, sin) in enumerate(tables[:MAX_ROPES]):   # (the layers read no other: _layer_refusal)
            a.cos[r], a.sin[r] = cos.data_ptr(), sin.data_ptr()
        groups = [meta, *meta.kv_groups][:a.num_kv_groups]
        if len(groups) < a.num_kv_groups:
            raise RuntimeError(f"the step's metadata has {len(groups)} KV group(s); the layers read "
                               f"{a.num_kv_groups}")
        for g, group in enumerate(groups):
            self.slots[g], self.tables[g], self.strides[g], *_ = group.kernel_args
        _, _, _, a.seq_lens, a.query_start, a.num_seqs = meta.kernel_args
        a.num_tokens, a.split = t, int(split)
        rows = self.lora_mapping.row_slot if self.lora_mapping is not None else None
        a.lora_rows = None if rows is None else rows.data_ptr()
        rc = self.lib.kvserve_decoder_stack_bf16(self.args_ptr)
        if self.tp is not None:
            self.tp.raise_if_failed()   # an exception cannot cross the C++ call: the hook keeps it
        if rc:   # (tensor parallelism: every rank refuses the same linear, before its all-reduce)
            raise RuntimeError(f"the fused layer stack stopped in layer {-1 - rc}: kvserve_quant_matmul does not know "
                               "the format or shape of one of its quantized weights")
        return hidden, residual


def binding_key(layers) -> tuple:
    """Weak references to what the pointers come from (bind_kv_cache replaces the pools of every layer at once,
    install_lora the LoRA tables), weak so that a dropped pool is freed; and the count of method replacements
    (prepack, quantize_layers_q4_0 and load_weights replace linears' methods one by one)."""
    return tuple(_ref(x) for x in _bound(layers)) + (method_generation(),)


def _bound(layers) -> tuple:
    """The pools, their scales and the LoRA tables of the first and the last layer."""
    return tuple(x for layer in (layers[0], layers[-1]) for attn in (layer.self_attn,)
                 for x in (attn.attn.k_cache, attn.attn.v_cache, attn.attn.kv_scales, attn.qkv_proj.lora))


def _ref(x):
    return (lambda: None) if x is None else weakref.ref(x)


def is_same_binding(key: tuple, layers) -> bool:
    return key[-1] == method_generation() and all(ref() is x for ref, x in zip(key, _bound(layers)))


def _bf16_rows(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.bfloat16 and t.is_contiguous())


def _layer_refusal(layer, tp) -> str | None:
    """Which feature of this layer the stack has no kernel for, or None."""
    attn, spec = layer.self_attn, layer.spec
    moe = None if spec.moe is None else layer.mlp.kernel_refusal()
    if moe is not None:
        return f"a mixture-of-experts MLP ({moe})"
    if spec.qk_norm_whole:
        return "a q/k norm over the whole projections"
    roles = [role for role in DECODER_LINEARS if role.held_by(layer)]
    linears = [role.of(layer) for role in roles]
    norms = [n for n in (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                         layer.post_feedforward_layernorm, attn.q_norm, attn.k_norm) if n is not None]
    cache = attn.attn.k_cache
    checks = (
        (spec.activation not in _ACTIVATIONS, f"activation {spec.activation}"),
        (spec.rope >= MAX_ROPES, f"more than {MAX_ROPES} RoPE tables"),
        (any(m.method.kernel_weight() is None for m in linears),
         "a linear without a packed bf16 or quantized weight (packed bf16 needs AVX2 or AVX-512 BF16)"),
        (any(m.tp is not (tp if role.row_parallel else None) for m, role in zip(linears, roles)),
         "a tensor-parallel split it does not know"),
        (not all(_bf16_rows(m.bias) for m in linears), "a linear bias not in bf16"),
        (not all(_bf16_rows(n.weight) for n in norms), "norms not in bf16"),
        (len({n.eps for n in norms}) != 1, "norms with different eps"),
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
    # (packed bf16 needs AVX2 or AVX-512 BF16: the same CPUs)
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
    eps = {layer.input_layernorm.eps for layer in layers}
    if len({kv_layout.is_tiled(c) for c in caches}) != 1 or len({c.dtype for c in caches}) != 1 or len(eps) != 1:
        return "layers with different KV layouts, KV formats or norm eps"
    return None


def build_fused_layers(layers) -> FusedLayers | None:
    """The fused stack for these DecoderLayers, or None where one of its kernels does not apply (why_not_fused)."""
    if why_not_fused(layers) is not None:
        return None
    cache = layers[0].self_attn.attn.k_cache
    lora = layers[0].self_attn.qkv_proj.lora
    return FusedLayers(kernels.load(), layers, kv_layout.is_tiled(cache), fp8.FORMATS.get(cache.dtype, 0),
                       None if lora is None else lora.mapping)
