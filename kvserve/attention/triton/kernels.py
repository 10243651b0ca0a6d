"""Triton kernels over the standard paged layout (kvserve/attention/kv_layout.py): K/V pools
[num_blocks, block_size, num_kv_heads, head_dim], a slot s = block * block_size + offset being one row.

write_kv_kernel: new K/V rows into their slots (slot < 0: a padding row, skipped), FP8 pools scaled and saturated.
unified_attention_kernel: one launch for a whole mixed step (decodes, fresh and chunked prefills, verification rows).
combine_splits_kernel: a split-KV step's result from its splits' partial ones.

unified_attention_kernel's programs: axis 0 walks "query blocks" of BLOCK_Q query tokens of one sequence, axis 1
the KV heads. A program takes its query tokens times the num_queries_per_kv query heads that share its KV head as
the BLOCK_M rows of one tile, so GQA heads share every K/V load:

    rows:  m = 0 .. BLOCK_M-1   query token  q_block * BLOCK_Q + m // num_queries_per_kv
                                query head   kv_head * num_queries_per_kv + m % num_queries_per_kv

Sequence i owns the query blocks query_start_loc[i] // BLOCK_Q + i ... (at most cdiv(len, BLOCK_Q) of them fit in
that room, since floor(a/B) + cdiv(n, B) <= floor((a + n)/B) + 1); a program finds its sequence by binary search over
that bound, so the grid depends only on the step's token and sequence counts (no host reads of the lengths: a
captured graph replays it) and programs past a sequence's last query block return at once.

Query token j of a sequence with seq_len keys, query_len of them new, sits at position seq_len - query_len + j and
sees keys 0 .. that position (causal), and with a sliding window W only the last W of them. Softmax is the online
one (running max M, sum L, rescaled accumulator), over K/V tiles of one paged block each.

Split KV (NUM_SPLITS > 1, flash-decoding): axis 2 cuts each program's blocks into NUM_SPLITS runs of about equal
length, so that a step of few sequences (a decode of one long sequence: as many programs as KV heads) still
spreads over the GPU. Each split stores its rows' unnormalized accumulator with their running max and sum, and
combine_splits_kernel merges them: out = sum_s e^(M_s - M) acc_s / sum_s e^(M_s - M) L_s, M = max_s M_s (a split
that saw no key of a row holds M_s = -inf and weighs 0).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
                    k_stride, v_stride, ROW: tl.constexpr, ROW_PADDED: tl.constexpr, FP8: tl.constexpr,
                    FP8_MAX: tl.constexpr):
    """Pool row slot_mapping[t] = k/v[t] (num_kv_heads * head_dim values), one program per token."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, ROW_PADDED)
    mask = offs < ROW
    k = tl.load(k_ptr + t.to(tl.int64) * k_stride + offs, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * v_stride + offs, mask=mask)
    if FP8:
        # fp8(x / scale) as kvserve.attention.fp8.quantize: float32 products by the reciprocal, saturated, rounded
        # to nearest even
        k = tl.clamp(k.to(tl.float32) * (1.0 / tl.load(k_scale_ptr)), -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) * (1.0 / tl.load(v_scale_ptr)), -FP8_MAX, FP8_MAX)
        k = k.to(k_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        v = v.to(v_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    dst = slot * ROW + offs
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence i whose query-block room (query_start_loc[i] // BLOCK_Q + i) starts last at or before q_block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def unified_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
        k_scale_ptr, v_scale_ptr, scale, num_seqs, q_stride_t, q_stride_h, out_stride_t, out_stride_h,
        block_table_stride, part_ptr, ml_ptr,
        NUM_KV_HEADS: tl.constexpr, NUM_QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        SLIDING_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
        NUM_SPLITS: tl.constexpr):
    """out[t, h] = softmax(scale * q[t, h] K^T) V over the keys token t sees (see the module docstring); with
    NUM_SPLITS > 1 split program_id(2)'s share of the keys into part/ml [tokens, heads, NUM_SPLITS, ...] instead."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    offs_n = tl.arange(0, BLOCK_SIZE)
    query_pos = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV   # within the sequence's new tokens
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_ok = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (query_pos < query_len)
    dim_ok = offs_d < HEAD_DIM
    token = (q_start + query_pos).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h + offs_d[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    abs_pos = context_len + query_pos          # each row's absolute position: it sees keys <= abs_pos
    # the keys the tile's last valid row sees end the loop; a window starts it at the first row's first key
    last_pos = tl.minimum(context_len + q_block_local * BLOCK_Q + BLOCK_Q - 1, seq_len - 1)
    num_blocks = last_pos // BLOCK_SIZE + 1
    first_block = 0
    if SLIDING_WINDOW > 0:
        first_block = tl.maximum(context_len + q_block_local * BLOCK_Q - SLIDING_WINDOW + 1, 0) // BLOCK_SIZE
    row_stride = NUM_KV_HEADS * HEAD_DIM
    if NUM_SPLITS > 1:   # this split's run of the blocks
        per_split = tl.cdiv(num_blocks - first_block, NUM_SPLITS)
        lo = first_block + tl.program_id(2) * per_split
        hi = tl.minimum(lo + per_split, num_blocks)
    else:
        lo = first_block
        hi = num_blocks
    for j in range(lo, hi):
        block = tl.load(block_table_ptr + seq.to(tl.int64) * block_table_stride + j).to(tl.int64)
        key_pos = j * BLOCK_SIZE + offs_n
        kv_off = (block * BLOCK_SIZE + offs_n).to(tl.int64) * row_stride + kv_head * HEAD_DIM
        key_ok = key_pos < seq_len
        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None], mask=dim_ok[:, None] & key_ok[None, :],
                    other=0.0)                                            # [HEAD_DIM_PADDED, BLOCK_SIZE]
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=key_ok[:, None] & dim_ok[None, :],
                    other=0.0)                                            # [BLOCK_SIZE, HEAD_DIM_PADDED]
        if FP8:   # back to the queries' dtype as kvserve.attention.fp8.dequantize: float32 products, one rounding
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale
        if SOFTCAP > 0:   # s -> cap * tanh(s / cap), tanh(x) = sign(x) (1 - e^-2|x|) / (1 + e^-2|x|)
            e = tl.exp(-2.0 * tl.abs(s) / SOFTCAP)
            t = (1.0 - e) / (1.0 + e)
            s = SOFTCAP * tl.where(s < 0, -t, t)
        visible = (key_pos[None, :] <= abs_pos[:, None]) & key_ok[None, :]
        if SLIDING_WINDOW > 0:
            visible = visible & (abs_pos[:, None] - key_pos[None, :] < SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row that sees no key yet keeps m = -inf; it subtracts 0 instead, so no NaN from -inf - -inf
        m_sub = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp(s - m_sub[:, None])
        alpha = tl.exp(m_i - m_sub)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        if IEEE:
            acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
    if NUM_SPLITS > 1:   # unnormalized, with the running max and sum: combine_splits_kernel merges the splits
        at = (token * (NUM_KV_HEADS * NUM_QUERIES_PER_KV) + head) * NUM_SPLITS + tl.program_id(2)
        tl.store(part_ptr + at[:, None] * HEAD_DIM_PADDED + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + at * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + at * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * out_stride_t + head[:, None] * out_stride_h + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def combine_splits_kernel(out_ptr, part_ptr, ml_ptr, out_stride_t, out_stride_h, NUM_HEADS: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr):
    """out[t, h] from the NUM_SPLITS partial results of unified_attention_kernel (program (t, h))."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    at = (t * NUM_HEADS + h) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    m = tl.load(ml_ptr + at * 2)
    l = tl.load(ml_ptr + at * 2 + 1)
    m_max = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(m_max > float("-inf"), m_max, 0.0))   # 0 for a split without keys (M_s = -inf)
    acc = tl.load(part_ptr + at[:, None] * HEAD_DIM_PADDED + offs_d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + t * out_stride_t + h * out_stride_h + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
