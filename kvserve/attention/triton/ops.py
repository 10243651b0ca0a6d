"""The Triton kernels as typed ops (torch.library): torch.compile, FakeTensor and opcheck see a schema, and a captured
CUDA graph replays the launches. The launchers make no torch.cuda calls and read no tensor's values on the host, so
they run on CPU tensors under TRITON_INTERPRET=1 too.

Eager callers take launch_write_kv / launch_unified_attention: the same launchers without the dispatcher's
per-call cost (the ops' schema checks run once per layer and step otherwise); code that torch.compile traces calls
the ops (write_kv, unified_attention)."""
from __future__ import annotations

import torch
import triton

from kvserve.attention import fp8
from kvserve.attention.triton import kernels

MIN_TILE = 16   # tl.dot's smallest dimension
# Split KV: an all-decode step cuts each sequence's keys into the most runs (a power of two, up to MAX_SPLITS) that
# keep its programs (sequences x KV heads x runs) within SPLIT_TARGET_PROGRAMS, two per SM of the 132 of an
# H100/H200: a step of at most half that many programs splits, so that it still fills the GPU
SPLIT_TARGET_PROGRAMS = 256
MAX_SPLITS = 16
# on CPU tensors (Triton's interpreter, which runs the programs one after another in Python: the tests) a step
# splits into a few runs only, enough to take the split path
INTERPRETER_SPLIT_TARGET = 4


def decode_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, target: int | None = None) -> int:
    """The splits of a step's keys, from its shapes alone (a captured graph replays them): 1 unless every sequence
    brings one token (a decode step), then the largest power of two up to MAX_SPLITS that keeps the programs
    (sequences x KV heads x splits) within `target` (SPLIT_TARGET_PROGRAMS by default)."""
    target = SPLIT_TARGET_PROGRAMS if target is None else target
    if num_tokens != num_seqs:
        return 1
    splits = 1
    while splits < MAX_SPLITS and num_seqs * num_kv_heads * splits * 2 <= target:
        splits *= 2
    return splits


def tile_shape(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): query tokens per program and the tile's rows (BLOCK_Q tokens x the query heads of one KV
    head, padded to a power of two of at least 16 rows)."""
    per_kv = num_heads // num_kv_heads
    block_m = max(MIN_TILE, triton.next_power_of_2(per_kv))
    return block_m // per_kv, block_m


def write_kv_meta(row: int, cache_dtype: torch.dtype) -> dict:
    """write_kv_kernel's constexprs for pool rows of `row` values in `cache_dtype` (the launcher's and
    compile.py's)."""
    is_fp8 = fp8.is_fp8(cache_dtype)
    return dict(ROW=row, ROW_PADDED=triton.next_power_of_2(row), FP8=is_fp8,
                FP8_MAX=fp8.largest(cache_dtype) if is_fp8 else 0.0)


def attention_meta(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, sliding_window: int,
                   is_fp8: bool, ieee: bool, softcap: float = 0.0, num_splits: int = 1) -> dict:
    """unified_attention_kernel's constexprs for a geometry (the launcher's and compile.py's); ieee: float32 dots
    without TF32."""
    block_q, block_m = tile_shape(num_heads, num_kv_heads)
    return dict(NUM_KV_HEADS=num_kv_heads, NUM_QUERIES_PER_KV=num_heads // num_kv_heads, HEAD_DIM=head_dim,
                HEAD_DIM_PADDED=head_dim_padded(head_dim), BLOCK_SIZE=block_size,
                BLOCK_Q=block_q, BLOCK_M=block_m, SLIDING_WINDOW=sliding_window, SOFTCAP=float(softcap), FP8=is_fp8,
                IEEE=ieee, NUM_SPLITS=num_splits)


def head_dim_padded(head_dim: int) -> int:
    return max(MIN_TILE, triton.next_power_of_2(head_dim))


def combine_meta(num_heads: int, head_dim: int, num_splits: int) -> dict:
    """combine_splits_kernel's constexprs (the launcher's and compile.py's)."""
    return dict(NUM_HEADS=num_heads, NUM_SPLITS=num_splits, HEAD_DIM=head_dim,
                HEAD_DIM_PADDED=head_dim_padded(head_dim))


def launch_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, kv_scales: torch.Tensor) -> None:
    """Pool rows slot_mapping[t] = k/v[t] ([T, num_kv_heads * head_dim], rows contiguous); slots < 0 are skipped;
    FP8 pools store fp8(x / scale) with kv_scales = [K's scale, V's scale]."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    kernels.write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, kv_scales, kv_scales[1:], k.stride(0), v.stride(0),
        **write_kv_meta(k_cache.shape[2] * k_cache.shape[3], k_cache.dtype))


@torch.library.custom_op("kvserve::triton_write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: torch.Tensor) -> None:
    """launch_write_kv as an op."""
    launch_write_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales)


@write_kv.register_fake
def _write_kv_fake(k, v, k_cache, v_cache, slot_mapping, kv_scales) -> None:
    return None


def launch_unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                             kv_scales: torch.Tensor, num_heads: int, scale: float,
                             sliding_window: int, softcap: float = 0.0, num_splits: int | None = None) -> torch.Tensor:
    """q: [T, num_heads * head_dim] (rows may be strided, elements contiguous) -> [T, num_heads * head_dim]: each
    token attends to its sequence's cached and new keys through the block table (sliding_window 0: no window;
    softcap c > 0: scaled scores s become c * tanh(s / c)). num_splits: split KV into that many runs (a power of
    two), by default decode_splits'."""
    num_tokens = q.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    out = q.new_empty(num_tokens, num_heads * head_dim)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    splits = num_splits
    if splits is None:
        target = SPLIT_TARGET_PROGRAMS if q.is_cuda else min(SPLIT_TARGET_PROGRAMS, INTERPRETER_SPLIT_TARGET)
        splits = decode_splits(num_tokens, num_seqs, num_kv_heads, target)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two, not {splits}")
    meta = attention_meta(num_heads, num_kv_heads, head_dim, block_size, sliding_window, fp8.is_fp8(k_cache.dtype),
                          q.dtype == torch.float32, softcap, splits)
    # the splits' partial results: [tokens, heads, splits, padded head dim] and their (max, sum) pairs
    part = q.new_empty((num_tokens, num_heads, splits, meta["HEAD_DIM_PADDED"]) if splits > 1 else (1,),
                       dtype=torch.float32)
    ml = q.new_empty((num_tokens, num_heads, splits, 2) if splits > 1 else (1,), dtype=torch.float32)
    grid = (num_tokens // meta["BLOCK_Q"] + num_seqs, num_kv_heads, splits)
    kernels.unified_attention_kernel[grid](
        out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, kv_scales, kv_scales[1:], scale,
        num_seqs, q.stride(0), head_dim, out.stride(0), head_dim, block_table.stride(0), part, ml, **meta)
    if splits > 1:
        kernels.combine_splits_kernel[(num_tokens, num_heads)](out, part, ml, out.stride(0), head_dim,
                                                               **combine_meta(num_heads, head_dim, splits))
    return out


@torch.library.custom_op("kvserve::triton_unified_attention", mutates_args=())
def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, kv_scales: torch.Tensor, num_heads: int,
                      scale: float, sliding_window: int, softcap: float) -> torch.Tensor:
    """launch_unified_attention as an op."""
    return launch_unified_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, kv_scales,
                                    num_heads, scale, sliding_window, softcap)


@unified_attention.register_fake
def _unified_attention_fake(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, kv_scales, num_heads,
                            scale, sliding_window, softcap):
    return q.new_empty(q.shape[0], num_heads * k_cache.shape[3])
