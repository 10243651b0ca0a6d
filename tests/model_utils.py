"""Helpers for the model tests: tiny random HF checkpoints and GGUF files, running our model on one sequence."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from kvserve.attention import bind_kv_cache, single_sequence_metadata
from kvserve.config import EngineConfig
from kvserve.model import load_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


# Gemma 3 as its real checkpoints differ from Llama: head_dim != hidden / heads, a query scale of its own, a window
# shorter than the test prompts, local layers on their own RoPE base, one global layer between local ones
GEMMA3 = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=8, num_hidden_layers=3,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


# Gemma 2: every other layer local, soft-caps small enough to change the scores and logits of a tiny random model
GEMMA2 = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=8, num_hidden_layers=3,
              attn_logit_softcapping=1.5, final_logit_softcapping=2.0)


# mixtures of experts in the shapes their families take: Mixtral top-2 of 8; Qwen2-MoE top-1 of 8 with a shared
# expert and a dense layer between MoE ones; Qwen3-MoE top-8 of 16, renormalized; OLMoE top-2 of 8 with its q/k
# norms over the whole projections
MOE = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=1, moe_intermediate_size=32, num_hidden_layers=3,
                      shared_expert_intermediate_size=80, mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=8, moe_intermediate_size=24, norm_topk_prob=True,
                      head_dim=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=40, norm_topk_prob=False),
}


def tiny_hf_config(family: str, **overrides):
    """A tiny transformers config of `family` (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3; the MoE ones)."""
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, OlmoeConfig,
                              Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)
    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
               "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "phi3": Phi3Config, "mixtral": MixtralConfig,
               "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig, "olmoe": OlmoeConfig}
    kwargs = {**TINY, "bos_token_id": 1, "eos_token_id": 2,
              **{"gemma2": GEMMA2, "gemma3": GEMMA3, **MOE}.get(family, {}), **overrides}
    if family == "phi3":
        kwargs.setdefault("pad_token_id", 0)   # Phi3Config's default (32000) lies past the tiny vocabulary
    if family == "qwen3":
        kwargs.setdefault("head_dim", 32)  # != hidden/heads, as in real Qwen3 checkpoints
    return classes[family](**kwargs)


def save_tiny_model(family: str, path: Path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Build a tiny random transformers model, save it as safetensors under `path`, return it (float32, eval)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(family, **overrides), dtype=torch.float32)
    _randomize_norms(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    return model.eval()


def _randomize_norms(model) -> None:
    # norm weights start at 1 and biases at 0: a loader that skipped or swapped them would go unnoticed; MoE routers
    # start near uniform, where a rounding could change the experts chosen: they get clear margins
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)


def load_ours(path: str | None, dtype: str = "float32"):
    """(model, ModelConfig) loaded by kvserve on the CPU, GGUF weights dequantized (as transformers loads them)."""
    return load_model(EngineConfig(model=path, dtype=dtype, device="cpu", quantization="none"))


def run_single_sequence(model, input_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits [T, vocab] of our model on one fresh sequence through the paged attention path."""
    dtype = next(model.parameters()).dtype
    bind_kv_cache(model, num_blocks=-(-len(input_ids) // block_size) + 1, block_size=block_size, dtype=dtype)
    ids = torch.tensor(input_ids, dtype=torch.long)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), single_sequence_metadata(len(ids), block_size=block_size))
        return model.compute_logits(hidden)


def hf_logits(hf_model, input_ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] of a transformers model on one sequence, attention mask passed explicitly."""
    ids = torch.tensor([input_ids], dtype=torch.long)
    with torch.inference_mode():
        out = hf_model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return out.logits[0].float()


@functools.cache
def bundled_ours():
    """The bundled SmolLM2 GGUF loaded by kvserve in float32, shared by every test in the session."""
    return load_ours(None, "float32")


# HF module path -> GGUF tensor stem, written out independently of kvserve's loader table
_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


# llama.cpp's Gemma 2/3 names: ffn_norm is the MLP's pre-norm, and the norms after attention and the MLP
_GEMMA_TO_GGUF = {**_HF_TO_GGUF, "post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """The GGUF tensor name llama.cpp's converter gives an HF parameter."""
    if hf_name.startswith("model.layers."):
        _, _, n, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        names = _GEMMA_TO_GGUF if arch.startswith("gemma") else _HF_TO_GGUF
        return f"blk.{n}.{names[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def llama_cpp_permute(w, n_head: int):
    """llama.cpp convert_hf_to_gguf's q/k permutation (rotate_half pairs -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, hf_model, arch: str = "llama", qtype: str = "F32",
                    raw_overrides: dict | None = None) -> Path:
    """Write a transformers model as a GGUF file the way llama.cpp's converter would (F32 or Q8_0 matrices)."""
    import gguf
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for key, value in [("block_count", cfg.num_hidden_layers), ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim),
                       ("vocab_size", cfg.vocab_size)]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    if arch.startswith("gemma"):
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(cfg, key, None):
                w.add_float32(f"{arch}.{key}", getattr(cfg, key))
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:   # llama.cpp's MoE keys
        w.add_uint32(f"{arch}.expert_count", experts)
        w.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
        w.add_uint32(f"{arch}.expert_feed_forward_length",
                     getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)
    tied = cfg.tie_word_embeddings
    for name, t in hf_model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        for gname, a in _gguf_tensors(name, _converted(name, t, cfg, arch), arch):
            _add_gguf_tensor(w, gname, a, qtype, raw_overrides or {})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# llama.cpp's MoE tensors: the router, the shared expert and its gate; the experts' stacks are _gguf_tensors'
_MOE_TO_GGUF = {"mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
                "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def _gguf_tensors(name: str, a, arch: str):
    """(GGUF name, array) of one of transformers' tensors: its experts' [E, 2I, H] gate|up stack as llama.cpp's
    ffn_gate_exps and ffn_up_exps, [E, H, I] down as ffn_down_exps; anything else under gguf_name's name."""
    if name.startswith("model.layers.") and (".mlp.experts." in name or ".mlp.gate." in name
                                             or ".mlp.shared_expert" in name):
        n = name.split(".")[2]
        if name.endswith("experts.gate_up_proj"):
            half = a.shape[1] // 2
            return [(f"blk.{n}.ffn_gate_exps.weight", a[:, :half]), (f"blk.{n}.ffn_up_exps.weight", a[:, half:])]
        if name.endswith("experts.down_proj"):
            return [(f"blk.{n}.ffn_down_exps.weight", a)]
        module, kind = name.split(".", 3)[3].rsplit(".", 1)
        return [(f"blk.{n}.{_MOE_TO_GGUF[module]}.{kind}", a.reshape(-1) if "shared_expert_gate" in module else a)]
    return [(gguf_name(name, arch), a)]


def _converted(name: str, t: torch.Tensor, cfg, arch: str):
    a = t.detach().float().numpy()
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        a = llama_cpp_permute(a, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
    if arch.startswith("gemma") and name.endswith("norm.weight"):
        a = a + 1   # llama.cpp's converter stores Gemma's norms as 1 + w
    return a


def _add_gguf_tensor(w, name: str, a, qtype: str, raw_overrides: dict) -> None:
    import gguf
    import numpy as np
    if name in raw_overrides:
        dtype, np_dtype = raw_overrides[name]
        w.add_tensor(name, a.astype(np_dtype), raw_dtype=dtype)
    elif qtype == "F32" or a.ndim == 1 or ".ffn_gate_inp" in name:   # llama.cpp keeps MoE routers in F32
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    else:
        q = getattr(gguf.GGMLQuantizationType, qtype)
        a = np.ascontiguousarray(a)
        if qtype in TEST_QUANTIZERS:   # (2-d: an MoE's [E, rows, cols] stack as rows, then back)
            blocks = TEST_QUANTIZERS[qtype](a.reshape(-1, a.shape[-1])).reshape(*a.shape[:-1], -1)
        else:
            blocks = gguf.quants.quantize(a, q)
        w.add_tensor(name, blocks, raw_dtype=q)


def _k_layout(q):
    """Values [n, 256] of 0..3 -> the 64 quant bytes of Q2_K / Q3_K: value 128 h + 32 k + i at bits 2 k of byte
    32 h + i."""
    import numpy as np
    v = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (v[:, :, 0] | v[:, :, 1] << 2 | v[:, :, 2] << 4 | v[:, :, 3] << 6).reshape(-1, 64)


def quantize_q2_k(a):
    """Q2_K blocks of a float matrix [rows, K % 256 == 0] (gguf-py only dequantizes it): per 16 values a 4-bit scale
    and min of the super-block's d and dmin, w = d sc q - dmin m, q in 0..3. A plain rounding quantizer, not
    llama.cpp's search: for tiny test models."""
    import numpy as np
    x = a.astype(np.float32).reshape(-1, 16, 16)
    lo = np.minimum(x.min(-1), 0)
    scale, m = (x.max(-1) - lo) / 3, -lo
    d, dmin = scale.max(-1, keepdims=True) / 15, m.max(-1, keepdims=True) / 15
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d > 0)), 0, 15)
    mq = np.clip(np.round(np.divide(m, dmin, out=np.zeros_like(m), where=dmin > 0)), 0, 15)
    step = (d * sc)[..., None]
    q = np.divide(x + (dmin * mq)[..., None], step, out=np.zeros_like(x), where=step > 0)
    q = np.clip(np.round(q), 0, 3)
    out = [(sc.astype(np.uint8) | mq.astype(np.uint8) << 4), _k_layout(q),
           d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8)]
    return np.concatenate(out, axis=1).reshape(a.shape[0], -1)


IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _peak(x):
    """The value of largest magnitude along the last axis (its sign kept)."""
    import numpy as np
    return np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]


def _signed_scales(x, nmax: int):
    """Groups x [n, G, size] of super-blocks: each group's scale (its peak maps to -nmax) as a 6-bit signed
    integer sc of the super-block's fp16 d (its largest scale maps to -32). Returns d [n, 1], sc [n, G] and the
    groups' steps d sc [n, G, 1]."""
    import numpy as np
    scale = -_peak(x) / nmax
    d = (-_peak(scale)[:, None] / 32).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d != 0)), -32, 31)
    return d, sc, (d * sc)[..., None]


def _iq4_index(x, step):
    """The 4-bit index of the IQ4_NL_VALUES entry nearest each x / step (0 where step is 0)."""
    import numpy as np
    y = np.divide(x, step, out=np.zeros_like(x), where=step != 0)
    return np.abs(y[..., None] - np.array(IQ4_NL_VALUES, np.float32)).argmin(-1).astype(np.uint8)


def quantize_q3_k(a):
    """Q3_K blocks of a float matrix [rows, K % 256 == 0]: per 16 values a 6-bit signed scale of the super-block's
    d, w = d sc q, q in -4..3 stored as q + 4 (its 2 low bits as Q2_K's, its third in hmask bit v / 32 of byte
    v % 32). A plain rounding quantizer, as quantize_q2_k."""
    import numpy as np
    x = a.astype(np.float32).reshape(-1, 16, 16)
    d, sc, step = _signed_scales(x, 4)   # a group's largest magnitude maps to -4
    q = np.clip(np.round(np.divide(x, step, out=np.zeros_like(x), where=step != 0)), -4, 3).astype(np.int64) + 4
    v = q.reshape(-1, 256)
    hmask = np.zeros((v.shape[0], 32), np.uint8)
    for bit in range(8):
        hmask |= ((v[:, 32 * bit:32 * bit + 32] >> 2) << bit).astype(np.uint8)
    l6 = (sc + 32).astype(np.uint8)
    scales = np.zeros((v.shape[0], 12), np.uint8)
    scales[:, :8] = (l6[:, :8] & 0xF) | (l6[:, 8:] & 0xF) << 4
    for g in range(16):
        scales[:, 8 + g % 4] |= (l6[:, g] >> 4) << (2 * (g // 4))
    out = [hmask, _k_layout(v & 3), scales, d.astype(np.float16).view(np.uint8)]
    return np.concatenate(out, axis=1).reshape(a.shape[0], -1)


def quantize_iq4_xs(a):
    """IQ4_XS blocks of a float matrix [rows, K % 256 == 0]: per 32 values a 6-bit signed scale of the super-block's
    d, each value the nearest of IQ4_NL_VALUES times it (a 4-bit index). A plain rounding quantizer, as
    quantize_q2_k."""
    import numpy as np
    x = a.astype(np.float32).reshape(-1, 8, 32)
    d, sc, step = _signed_scales(x, 127)   # a group's largest magnitude maps to -127
    idx = _iq4_index(x, step)   # [n, 8, 32]
    qs = (idx[..., :16] | idx[..., 16:] << 4).reshape(-1, 128)
    ls = (sc + 32).astype(np.uint16)
    scales_l = (ls[:, 0::2] & 0xF | (ls[:, 1::2] & 0xF) << 4).astype(np.uint8)
    scales_h = np.zeros(ls.shape[0], np.uint16)
    for j in range(8):
        scales_h |= (ls[:, j] >> 4) << (2 * j)
    out = [d.astype(np.float16).view(np.uint8), scales_h[:, None].view(np.uint8), scales_l, qs]
    return np.concatenate(out, axis=1).reshape(a.shape[0], -1)


def quantize_iq4_nl(a):
    """IQ4_NL blocks of a float matrix [rows, K % 32 == 0]: per 32 values an fp16 scale, each value the nearest of
    IQ4_NL_VALUES times it (a 4-bit index: values i and i + 16 in byte i's low and high nibbles)."""
    import numpy as np
    x = a.astype(np.float32).reshape(-1, 32)
    d = (-_peak(x)[:, None] / 127).astype(np.float16).astype(np.float32)   # the largest magnitude maps to -127
    idx = _iq4_index(x, d)
    out = [d.astype(np.float16).view(np.uint8), idx[:, :16] | idx[:, 16:] << 4]
    return np.concatenate(out, axis=1).reshape(a.shape[0], -1)


TEST_QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "IQ4_XS": quantize_iq4_xs,
                   "IQ4_NL": quantize_iq4_nl}


class FailingForward:
    """The engine's real model runner, whose forward raises once in a step that runs a marked prompt."""

    def __init__(self, runner, marker: list[int]):
        self.runner, self.marker, self.failed = runner, marker, False

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _maybe_fail(self, sched) -> None:
        if not self.failed and any(r.prompt_token_ids == self.marker for r, _ in sched.scheduled):
            self.failed = True
            raise RuntimeError("injected: the forward pass failed")

    def execute_model(self, sched):
        self._maybe_fail(sched)
        return self.runner.execute_model(sched)

    def launch(self, sched, prev):   # async scheduling's step
        self._maybe_fail(sched)
        return self.runner.launch(sched, prev)


def gguf_without_vocabulary(src: Path, dst: Path) -> Path:
    """A copy of a GGUF file without the tokenizer's arrays (its vocabulary size as a key instead): transformers'
    reader parses every array entry in Python, which makes most of its load time for a 262k-token vocabulary, and
    the logits do not depend on them."""
    import gguf
    import numpy as np
    from kvserve.model.gguf_loader import _SKIP_KEYS, _metadata_reader
    reader = _metadata_reader()(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch=arch)
    for key, field in reader.fields.items():
        if key in _SKIP_KEYS or key == "general.architecture" or key.startswith("GGUF."):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    if f"{arch}.vocab_size" not in reader.fields:
        embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
        w.add_uint32(f"{arch}.vocab_size", int(embedding.shape[1]))
    for t in reader.tensors:
        data = np.asarray(t.data)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def check_engine_greedy(path: str, tokenizer: str, hf_greedy, num_kv_blocks: int, check_engine=None) -> None:
    """The engine's greedy tokens equal transformers' (hf_greedy(prompt) -> tokens) on four prompts sharing a
    13-token prefix: in one batch, then in chunks of 7 tokens with a pool of num_kv_blocks blocks of 4 tokens so
    small that requests are preempted, each twice (the second time from the prefix cache). check_engine(engine):
    what else the test asserts of each engine."""
    from kvserve import LLM, SamplingParams
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 256, (13,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 11, 20, 30)]
    expected = [hf_greedy(p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=len(expected[0]), ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    for kwargs in ({}, dict(max_num_batched_tokens=7, num_kv_blocks=num_kv_blocks, block_size=4, max_num_seqs=4,
                            enable_prefix_caching=True)):
        llm = LLM(model=path, tokenizer=tokenizer, dtype="float32", **kwargs)
        if check_engine is not None:
            check_engine(llm.llm_engine)
        for _ in range(2):
            outputs = llm.generate(inputs, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == expected
        if kwargs:
            stats = llm.llm_engine.scheduler.stats()
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
