"""Tensor-parallel sharding (Megatron-style): which slice of every weight a rank holds.

    q|k|v, gate|up    column-parallel: a rank holds its heads' rows (its intermediate slice's rows)
    o, down           row-parallel: a rank holds the matching input columns; partial outputs are all-reduced
    MoE experts       each expert (and the shared one) split as an MLP; the router whole; one all-reduce of the
                      block's weighted sum (kvserve/model/moe.py)
    embedding, head   vocab-parallel: a rank holds a slice of the vocabulary's rows

Heads are dealt out by KV-head group, so a rank's query heads always attend to the KV heads it holds. With at
least as many KV heads as ranks, the groups are dealt as evenly as possible (9 heads in 3 groups over 2 ranks: 6 and
3); with fewer, each KV head is replicated on ranks // num_kv_heads ranks, which split its group's query heads. The
intermediate size is split in units of 256 (whole K-quant blocks, so a GGUF's down_proj stays quantized) where it
divides, else of 32.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from kvserve.errors import InvalidRequestError
from kvserve.model.linear_roles import DECODER_LINEARS
from kvserve.model.model_config import ModelConfig
from kvserve.model.quantization import KERNEL_FORMATS, QuantizedTensor

logger = logging.getLogger("kvserve")

# HF projection name -> how it is split: "q"/"kv" heads' rows, "inter" rows, "o"/"down" input columns (the
# decoder's declared linears)
_SPLITS = {p.checkpoint: p.split for r in DECODER_LINEARS for p in r.projections}
_LINEAR_SPLITS = {(r.name, i): p.split for r in DECODER_LINEARS for i, p in enumerate(r.projections)}


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size`: [start, start + count) of the query heads, KV heads, intermediate and vocabulary."""

    rank: int
    size: int
    head_dim: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_per_rank: int   # the gathered logits' columns per rank (the last rank's slice may be shorter)
    experts: tuple[int, int] = (0, 0)   # mixture of experts: the slice of every expert's intermediate size
    shared: tuple[int, int] = (0, 0)    # and of the shared expert's

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The ModelConfig the rank's model is built from: its heads, intermediate slices and vocabulary rows."""
        moe = dict(moe_intermediate_size=self.experts[1], shared_expert_intermediate_size=self.shared[1]) \
            if cfg.num_experts else {}
        return dataclasses.replace(cfg, num_attention_heads=self.q_heads[1], num_key_value_heads=self.kv_heads[1],
                                   intermediate_size=self.intermediate[1], vocab_size=self.vocab[1], **moe)


    def shard_lora(self, linear: str, shard: int, a, b):
        """The rank's part of one projection's LoRA pair (A [r, K], scale * B [N, r]): a column-parallel
        projection keeps its output rows of B, a row-parallel one its input columns of A (the group's all-reduce
        sums the partial products, as it does the base's)."""
        start, count = self.rank_slice(_LINEAR_SPLITS[(linear, shard)])
        if _LINEAR_SPLITS[(linear, shard)] in ("o", "down"):
            return a[:, start:start + count].contiguous(), b
        return a, b[start:start + count].contiguous()

    def rank_slice(self, split: str, scope: str | None = None) -> tuple[int, int]:
        """(start, count) of the rank's rows (column-parallel) or input columns (row-parallel) for a split kind;
        scope "experts" or "shared": an MoE expert's or the shared expert's intermediate slice."""
        d = self.head_dim
        if split in ("q", "o"):
            return self.q_heads[0] * d, self.q_heads[1] * d
        if split == "kv":
            return self.kv_heads[0] * d, self.kv_heads[1] * d
        return {"experts": self.experts, "shared": self.shared}.get(scope, self.intermediate)   # inter, down


def full_projection_shapes(cfg: ModelConfig) -> dict[tuple[str, int], tuple[int, int]]:
    """(linear, shard) -> (in, out features) of the whole model's projections (what an adapter was trained on)."""
    h, q, kv, i = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.intermediate_size
    shapes = {"q": (h, q), "kv": (h, kv), "inter": (h, i), "o": (q, h), "down": (i, h)}
    # an MoE model's MLPs take no adapter where some layer is MoE (kvserve/lora/layers.py roles_of)
    moe = bool(cfg.num_experts) and cfg.moe_layers != []
    return {key: shapes[split] for key, split in _LINEAR_SPLITS.items() if not (moe and split in ("inter", "down"))}


def make_plans(cfg: ModelConfig, size: int) -> list[ShardPlan]:
    """Every rank's plan; InvalidRequestError where the heads cannot be split over `size` ranks."""
    if cfg.num_experts and cfg.mlp_bias and size > 1:
        raise InvalidRequestError("tensor parallelism of mixture-of-experts MLPs with biases is not supported",
                                  "tensor_parallel_size")
    if cfg.architecture == "OlmoeForCausalLM" and size > 1:   # its q/k norm's statistic spans every rank's heads
        raise InvalidRequestError("tensor parallelism of OLMoE (a q/k norm over the whole projections) is not "
                                  "supported: serve it with tensor_parallel_size 1", "tensor_parallel_size")
    h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    group = h // hkv
    if size <= hkv:
        kv = _even_split(hkv, size, 1)
        q = [(s * group, n * group) for s, n in kv]
    elif size % hkv == 0 and group % (size // hkv) == 0:
        reps = size // hkv
        per = group // reps
        kv = [(r // reps, 1) for r in range(size)]
        q = [((r // reps) * group + (r % reps) * per, per) for r in range(size)]
    else:
        raise InvalidRequestError(
            f"tensor_parallel_size {size} does not divide this model's heads: {h} attention heads in {hkv} KV-head "
            f"groups can be split over at most {hkv} ranks, or over a multiple of {hkv} that divides each group of "
            f"{group}", "tensor_parallel_size")
    inter = _intermediate_split(cfg.intermediate_size, size)
    experts = _intermediate_split(cfg.moe_intermediate_size or 0, size) if cfg.num_experts else [(0, 0)] * size
    shared = _intermediate_split(cfg.shared_expert_intermediate_size, size)
    per_rank = -(-cfg.vocab_size // size)
    vocab = [(min(r * per_rank, cfg.vocab_size), max(0, min(per_rank, cfg.vocab_size - r * per_rank)))
             for r in range(size)]
    if any(n == 0 for _, n in vocab):
        raise InvalidRequestError(f"tensor_parallel_size {size} is more than the {cfg.vocab_size} vocabulary rows",
                                  "tensor_parallel_size")
    return [ShardPlan(r, size, cfg.head_dim, q[r], kv[r], inter[r], vocab[r], per_rank, experts[r], shared[r])
            for r in range(size)]


def _intermediate_split(i: int, size: int) -> list[tuple[int, int]]:
    """An intermediate size dealt out in whole K-quant blocks (256) where it divides, else in 32s, else evenly."""
    unit = 256 if i % 256 == 0 and i // 256 >= size else 32 if i % 32 == 0 and i // 32 >= size else 1
    return _even_split(i, size, unit)


def _even_split(total: int, parts: int, unit: int) -> list[tuple[int, int]]:
    """(start, count) of `parts` slices of `total` in whole units, the first ones one unit larger where uneven."""
    units = total // unit
    out, start = [], 0
    for r in range(parts):
        n = (units // parts + (r < units % parts)) * unit
        if r == parts - 1:
            n = total - start   # a remainder below one unit goes to the last rank
        out.append((start, n))
        start += n
    return out


def shard_weights(weights: Iterable[tuple[str, object]], plan: ShardPlan) -> Iterator[tuple[str, object]]:
    """The rank's slice of every HF-named tensor (dense or GGUF-quantized), one tensor at a time."""
    num_dequantized = 0
    for name, t in weights:
        out = shard_tensor(name, t, plan)
        num_dequantized += isinstance(t, QuantizedTensor) and not isinstance(out, QuantizedTensor)
        yield name, out
    if num_dequantized:
        logger.warning("kvserve: rank %d: %d quantized weight(s) split inside a quantization block were dequantized "
                       "for tensor parallelism", plan.rank, num_dequantized)


def shard_tensor(name: str, t, plan: ShardPlan):
    """One tensor's slice for the rank (unchanged where every rank holds all of it: norms, o/down biases)."""
    parts = name.split(".")
    kind = next((_SPLITS[p] for p in parts if p in _SPLITS), None)
    if name.startswith("model.embed_tokens.") or name.startswith("lm_head."):
        return _rows(t, *plan.vocab)
    # an MoE's experts and shared expert split like a dense MLP, each by its own size; its router stays whole
    scope = "experts" if ".mlp.experts." in name else "shared" if ".mlp.shared_expert." in name else None
    if kind in ("q", "kv", "inter"):
        return _rows(t, *plan.rank_slice(kind, scope))
    if kind in ("o", "down") and parts[-1] == "weight":
        return _cols(t, *plan.rank_slice(kind, scope))
    return t


def _rows(t, start: int, count: int):
    if isinstance(t, QuantizedTensor):
        return replace(t, data=t.data[start:start + count].contiguous())
    return t.narrow(0, start, count).contiguous()


def _cols(t, start: int, count: int):
    if isinstance(t, QuantizedTensor):
        _, values, nbytes = KERNEL_FORMATS[t.ggml_type]
        if start % values == 0 and count % values == 0 and not t.octets:   # whole blocks of the file's order
            lo, hi = start // values * nbytes, (start + count) // values * nbytes
            return replace(t, data=t.data[:, lo:hi].contiguous(), cols=count)
        return t.dequantize()[:, start:start + count].contiguous()
    return t.narrow(1, start, count).contiguous()


def check_world(size: int, num_cores: int, backend: str) -> None:
    """Refuse more local ranks than cores (each rank needs a core of its own to run its thread)."""
    if backend == "mp" and size > num_cores:
        raise InvalidRequestError(f"tensor_parallel_size {size} is more ranks than this machine's {num_cores} cores; "
                                  "each rank runs on cores of its own", "tensor_parallel_size")

