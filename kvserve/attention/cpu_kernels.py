"""C++ CPU kernels (paged attention straight from the KV blocks), built with g++ at first use and cached.

The library is plain C++ with OpenMP and no torch headers, so it builds in seconds; it is called through
ctypes with raw data pointers. It goes to ~/.cache/kvserve/kernels/<hash>.so, the hash covering the source,
the flags, the compiler and the CPU (the code is built for -march=native). When no compiler is found or the
build fails, `load()` returns None and callers fall back to the pure-torch backend.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("kvserve")

_SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <algorithm>
#include <vector>
#include <omp.h>

namespace {

constexpr int KC = 32;        // keys per chunk: converted to fp32 once, reused by every query row of a tile
constexpr int MAX_D = 256;    // largest head_dim supported (checked on the Python side)
constexpr int MAX_ROWS = 64;  // query rows (tokens x q heads) per work item
constexpr int MAX_KV_ROW = 1024;  // kv heads x head_dim of the SIMD path

inline float bf16_to_f32(uint16_t x) { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept NaN
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <typename T> inline float load(const T* p, int64_t i);
template <> inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
template <typename T> inline void store(T* p, int64_t i, float v);
template <> inline void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void store<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

// One work item: sequence b, kv head g, query tokens [t0, t0 + nt) of that sequence.
// Rows are (token, q head of this kv head) pairs; every row runs its own online softmax.
template <typename T>
void attend_item(const T* q, int64_t qs, const T* kc, const T* vc, T* out, const int32_t* table, int64_t ctx_len,
                 int64_t q_len, int64_t q_row0, int64_t t0, int64_t nt, int64_t g, int64_t H, int64_t Hkv,
                 int64_t D, int64_t bs, float scale) {  // one kv head g
  const int64_t G = H / Hkv, R = nt * G;
  float qf[MAX_ROWS][MAX_D], acc[MAX_ROWS][MAX_D], m[MAX_ROWS], l[MAX_ROWS];
  int64_t limit[MAX_ROWS];
  alignas(64) float kf[KC][MAX_D];
  alignas(64) float vf[KC][MAX_D];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G, h = g * G + r % G;
    const T* src = q + (q_row0 + t) * qs + h * D;
    for (int64_t d = 0; d < D; ++d) { qf[r][d] = load(src, d) * scale; acc[r][d] = 0.f; }
    m[r] = -INFINITY; l[r] = 0.f;
    limit[r] = ctx_len - q_len + t;   // causal: the last key position this token sees
  }
  const int64_t end = limit[R - 1] + 1;
  const int64_t kv_row = Hkv * D, blk_stride = bs * kv_row;
  for (int64_t p = 0; p < end;) {
    const int64_t off = p % bs;
    const int64_t n = std::min<int64_t>({KC, bs - off, end - p});
    const int64_t base = int64_t(table[p / bs]) * blk_stride + off * kv_row + g * D;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < D; ++d) { kf[j][d] = load(kc + base + j * kv_row, d); vf[j][d] = load(vc + base + j * kv_row, d); }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t nv = std::min<int64_t>(n, limit[r] - p + 1);  // keys of this chunk the row may see
      if (nv <= 0) continue;
      float s[KC];
      float smax = -INFINITY;
      for (int64_t j = 0; j < nv; ++j) {
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qf[r][d] * kf[j][d];
        s[j] = dot;
        smax = std::max(smax, dot);
      }
      const float mnew = std::max(m[r], smax);
      const float corr = std::exp(m[r] - mnew);
      float psum = 0.f;
      for (int64_t j = 0; j < nv; ++j) { s[j] = std::exp(s[j] - mnew); psum += s[j]; }
      l[r] = l[r] * corr + psum;
      m[r] = mnew;
      float* a = acc[r];
      for (int64_t d = 0; d < D; ++d) a[d] *= corr;
      for (int64_t j = 0; j < nv; ++j) {
        const float pj = s[j];
        for (int64_t d = 0; d < D; ++d) a[d] += pj * vf[j][d];
      }
    }
    p += n;
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G, h = g * G + r % G;
    T* dst = out + ((q_row0 + t) * H + h) * D;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) store(dst, d, acc[r][d] * inv);
  }
}

#if defined(__AVX512F__) && !defined(KV_GENERIC)
#include <immintrin.h>
#define KV_HAVE_AVX512 1

// exp(x) for x <= 0 (softmax arguments): 2^(x log2 e) with a degree-6 polynomial, ~2 ulp
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// a[j] (16 vectors) -> one vector whose lane j is the sum of a[j]'s lanes
inline __m512 transpose_sum16(__m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// dot products of one query row with one key, as a vector of partial sums (D = 16 * nd)
inline __m512 qk_partial(const float* k, const __m512* qv, int nd, const float*) {
  __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
  for (int i = 1; i < nd; ++i) acc = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(k + 16 * i), acc);
  return acc;
}
inline __m512 qk_partial(const uint16_t* k, const __m512* qv, int nd, const uint16_t* qraw) {
#if defined(__AVX512BF16__)
  // bf16 pairs straight from the cache: 32 multiply-adds per instruction, no conversion
  __m512 acc = _mm512_setzero_ps();
  for (int i = 0; i < nd / 2; ++i)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qraw + 32 * i), (__m512bh)_mm512_loadu_si512(k + 32 * i));
  return acc;
#else
  __m512 acc = _mm512_mul_ps(qv[0], load16(k));
  for (int i = 1; i < nd; ++i) acc = _mm512_fmadd_ps(qv[i], load16(k + 16 * i), acc);
  return acc;
#endif
}

// Keys are taken CH = 32 at a time, in three passes over the rows so each pass is short enough for
// out-of-order execution to overlap rows (one long per-row body serializes on its reductions and exps):
//   1. scores of every row (bf16 dot products, transposed sums), 2. online-softmax update, 3. P @ V.
template <typename T>
void attend_item_simd(const T* q, int64_t qs, const T* kc, const T* vc, T* out, const int32_t* table, int64_t ctx_len,
                      int64_t q_len, int64_t q_row0, int64_t t0, int64_t nt, int64_t g0, int64_t ng, int64_t H,
                      int64_t Hkv, int64_t D, int64_t bs, float scale) {
  constexpr int CH = 32;
  const int64_t G = H / Hkv, RH = ng * G, R = nt * RH;   // RH: rows per token
  const int nd = int(D / 16);
  // compact strides: power-of-two row strides would put every row in the same L1 set
  alignas(64) float acc[MAX_ROWS * MAX_D];
  alignas(64) float vf[CH * (MAX_KV_ROW + 16)];
  alignas(64) float sc[MAX_ROWS * CH];
  float corr[MAX_ROWS], m[MAX_ROWS], l[MAX_ROWS];
  const T* qraw[MAX_ROWS];
  const T* krow[CH];
  int64_t koff[MAX_ROWS], limit[MAX_ROWS], nvis[MAX_ROWS];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / RH, h = g0 * G + r % RH;
    qraw[r] = q + (q_row0 + t) * qs + h * D;
    koff[r] = (h / G - g0) * D;
    for (int i = 0; i < nd; ++i) _mm512_store_ps(acc + r * D + 16 * i, _mm512_setzero_ps());
    m[r] = -INFINITY; l[r] = 0.f;
    limit[r] = ctx_len - q_len + t;
  }
  const int64_t end = limit[R - 1] + 1;
  const int64_t kv_row = Hkv * D, blk_stride = bs * kv_row, nvf = ng * D, vstride = nvf + 16;
  const __m512 vscale = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t p = 0; p < end; p += CH) {
    const int64_t n = std::min<int64_t>(CH, end - p);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = p + j;
      krow[j] = kc + int64_t(table[pos / bs]) * blk_stride + (pos % bs) * kv_row + g0 * D;
      const T* vrow = vc + (krow[j] - kc);
      for (int64_t i = 0; i < nvf; i += 16) _mm512_store_ps(vf + j * vstride + i, load16(vrow + i));
    }
    // 1. scores
    for (int64_t r = 0; r < R; ++r) {
      const int64_t nv = std::min<int64_t>(n, limit[r] - p + 1);
      nvis[r] = nv;
      if (nv <= 0) continue;
      __m512 qv[MAX_D / 16];
      for (int i = 0; i < nd; ++i) qv[i] = load16(qraw[r] + 16 * i);
      for (int64_t j0 = 0; j0 < nv; j0 += 16) {
        __m512 part[16];
        for (int64_t j = 0; j < 16; ++j)
          part[j] = j0 + j < nv ? qk_partial(krow[j0 + j] + koff[r], qv, nd, qraw[r]) : _mm512_setzero_ps();
        const int64_t left = nv - j0;
        const __mmask16 valid = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
        _mm512_store_ps(sc + r * CH + j0,
                        _mm512_mask_blend_ps(valid, neg_inf, _mm512_mul_ps(transpose_sum16(part), vscale)));
      }
      if (nv <= 16) _mm512_store_ps(sc + r * CH + 16, neg_inf);
    }
    // 2. online softmax: new running max, rescale factor, probabilities
    for (int64_t r = 0; r < R; ++r) {
      if (nvis[r] <= 0) continue;
      const __m512 s0 = _mm512_load_ps(sc + r * CH), s1 = _mm512_load_ps(sc + r * CH + 16);
      const float mnew = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
      const __m512 vm = _mm512_set1_ps(mnew);
      const __m512 p0 = exp512(_mm512_sub_ps(s0, vm)), p1 = exp512(_mm512_sub_ps(s1, vm));
      // masked keys hold -inf; exp512 clamps to exp(-87), so zero them explicitly
      const __m512 z0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, neg_inf, _CMP_NEQ_OQ), p0);
      const __m512 z1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, neg_inf, _CMP_NEQ_OQ), p1);
      corr[r] = std::exp(m[r] - mnew);
      l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(_mm512_add_ps(z0, z1));
      m[r] = mnew;
      _mm512_store_ps(sc + r * CH, z0);
      _mm512_store_ps(sc + r * CH + 16, z1);
    }
    // 3. acc = acc * corr + P @ V
    for (int64_t r = 0; r < R; ++r) {
      const int64_t nv = nvis[r];
      if (nv <= 0) continue;
      const __m512 vcorr = _mm512_set1_ps(corr[r]);
      const float* vr = vf + koff[r];
      const float* pr = sc + r * CH;
      for (int i0 = 0; i0 < nd; i0 += 4) {   // 4 accumulators (64 dims) in registers at a time
        const int ni = std::min(4, nd - i0);
        __m512 a[4];
        for (int i = 0; i < ni; ++i) a[i] = _mm512_mul_ps(_mm512_load_ps(acc + r * D + 16 * (i0 + i)), vcorr);
        for (int64_t j = 0; j < nv; ++j) {
          const __m512 b = _mm512_set1_ps(pr[j]);
          for (int i = 0; i < ni; ++i)
            a[i] = _mm512_fmadd_ps(b, _mm512_load_ps(vr + j * vstride + 16 * (i0 + i)), a[i]);
        }
        for (int i = 0; i < ni; ++i) _mm512_store_ps(acc + r * D + 16 * (i0 + i), a[i]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / RH, h = g0 * G + r % RH;
    T* dst = out + ((q_row0 + t) * H + h) * D;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) store(dst, d, acc[r * D + d] * inv);
  }
}
#endif

template <typename T>
void paged_attention(const T* q, int64_t qs, const T* kc, const T* vc, T* out, const int32_t* block_tables, int64_t table_stride,
                     const int32_t* seq_lens, const int32_t* query_start, int64_t B, int64_t H, int64_t Hkv,
                     int64_t D, int64_t bs, float scale) {
  const int64_t G = H / Hkv;
  bool simd = false;
#ifdef KV_HAVE_AVX512
  simd = D % 32 == 0 && Hkv * D <= MAX_KV_ROW && H <= MAX_ROWS;
#endif
  // A work item is (sequence, query tile, kv heads). With many sequences an item takes all kv heads, so it
  // reads whole contiguous KV rows; with few (single-stream decode) it takes one kv head, for parallelism.
  int64_t total_q = query_start[B];
  const int64_t ng = simd && (B >= 4 * omp_get_max_threads() || total_q > 4 * B) ? Hkv : 1;
  const int64_t tile = std::max<int64_t>(1, MAX_ROWS / (ng * G));
  const int64_t groups = Hkv / ng;
  std::vector<int64_t> first(B + 1, 0);   // first item of each sequence
  for (int64_t b = 0; b < B; ++b)
    first[b + 1] = first[b] + ((query_start[b + 1] - query_start[b] + tile - 1) / tile) * groups;
  #pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < first[B]; ++item) {
    const int64_t b = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
    const int64_t rest = item - first[b];
    const int64_t q_len = query_start[b + 1] - query_start[b];
    const int64_t tile_idx = rest / groups, g = (rest % groups) * ng;
    const int64_t t0 = tile_idx * tile, nt = std::min(tile, q_len - t0);
    const int32_t* table = block_tables + b * table_stride;
#ifdef KV_HAVE_AVX512
    if (simd) {
      attend_item_simd<T>(q, qs, kc, vc, out, table, seq_lens[b], q_len, query_start[b], t0, nt, g, ng, H, Hkv, D, bs,
                          scale);
      continue;
    }
#endif
    attend_item<T>(q, qs, kc, vc, out, table, seq_lens[b], q_len, query_start[b], t0, nt, g, H, Hkv, D, bs, scale);
  }
}

}  // namespace

extern "C" {
int kv_abi_version() { return 1; }
int kv_simd() {
#ifdef KV_HAVE_AVX512
  return 1;
#else
  return 0;
#endif
}
void kv_paged_attention_f32(const float* q, int64_t qs, const float* kc, const float* vc, float* out,
                            const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                            const int32_t* query_start, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                            float scale) {
  paged_attention<float>(q, qs, kc, vc, out, tables, table_stride, seq_lens, query_start, B, H, Hkv, D, bs, scale);
}
void kv_paged_attention_bf16(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc, uint16_t* out,
                             const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                             const int32_t* query_start, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                             float scale) {
  paged_attention<uint16_t>(q, qs, kc, vc, out, tables, table_stride, seq_lens, query_start, B, H, Hkv, D, bs,
                            scale);
}
// cache rows [slot] = k/v rows [t] (rows of n elements, element size es bytes)
void kv_write_kv(const char* k, int64_t ks, const char* v, int64_t vs, const int64_t* slots, int64_t T, int64_t n,
                 int64_t es, char* kc, char* vc) {
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kc + slots[t] * n * es, k + t * ks * es, n * es);
    std::memcpy(vc + slots[t] * n * es, v + t * vs * es, n * es);
  }
}
// out = rmsnorm(x [+ residual]) * w, bf16 rounding as torch's ops: r = bf16(x + residual) (written back to
// residual), y = bf16(r * rsqrt(mean(r^2) + eps)), out = bf16(w * y)
void kv_rmsnorm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* w, uint16_t* out, int64_t T, int64_t N,
                     float eps) {
  #pragma omp parallel for if (T * N > 65536)
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* xr = x + t * N;
    uint16_t* rr = residual ? residual + t * N : nullptr;
    float buf[8192];
    float ss = 0.f;
    for (int64_t i = 0; i < N; ++i) {
      float r = bf16_to_f32(xr[i]);
      if (rr) { r = bf16_to_f32(f32_to_bf16(r + bf16_to_f32(rr[i]))); rr[i] = f32_to_bf16(r); }
      buf[i] = r;
      ss += r * r;
    }
    const float inv = 1.f / std::sqrt(ss / float(N) + eps);
    for (int64_t i = 0; i < N; ++i)
      out[t * N + i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(buf[i] * inv)));
  }
}
// rotate (rotate_half convention) the first nh heads of every row of x in place:
// x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), cos/sin [T, D] bf16
void kv_rope_bf16(uint16_t* x, int64_t xs, const uint16_t* cos, const uint16_t* sin, int64_t T, int64_t nh, int64_t D) {
  const int64_t half = D / 2;
  #pragma omp parallel for if (T * nh * D > 65536)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < nh; ++h) {
      uint16_t* p = x + t * xs + h * D;
      const uint16_t* c = cos + t * D;
      const uint16_t* s = sin + t * D;
      float a[512];
      for (int64_t d = 0; d < D; ++d) a[d] = bf16_to_f32(p[d]);
      for (int64_t d = 0; d < D; ++d) {
        const float rot = d < half ? -a[d + half] : a[d - half];
        const float xc = bf16_to_f32(f32_to_bf16(a[d] * bf16_to_f32(c[d])));
        const float rs = bf16_to_f32(f32_to_bf16(rot * bf16_to_f32(s[d])));
        p[d] = f32_to_bf16(xc + rs);
      }
    }
}
}
"""

MAX_HEAD_DIM = 256
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-shared", "-fPIC",
          "-std=c++17"]
_lib: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvserve" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next((line for line in info.splitlines() if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _build(cxx: str, source: str | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    source = _SOURCE if source is None else source
    flags = _FLAGS + list(extra_flags)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    key = hashlib.sha256("|".join([source, " ".join(flags), version, _cpu_id()]).encode()).hexdigest()[:20]
    path = cache_dir() / f"kvserve_kernels_{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        src = Path(tmp) / "kernels.cpp"
        src.write_text(source)
        out = Path(tmp) / "kernels.so"
        proc = subprocess.run([cxx, *flags, str(src), "-o", str(out)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{proc.stderr[-4000:]}")
        os.replace(out, path)   # atomic: a concurrent builder's copy is just as good
    return path


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {
        "kv_paged_attention_f32": [p, i64, p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, f],
        "kv_paged_attention_bf16": [p, i64, p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, f],
        "kv_write_kv": [p, i64, p, i64, p, i64, i64, i64, p, p],
        "kv_rmsnorm_bf16": [p, p, p, p, i64, i64, f],
        "kv_rope_bf16": [p, i64, p, p, i64, i64, i64],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = None
    lib.kv_simd.restype = ctypes.c_int
    return lib


def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel library, built on first use; None when it cannot be built (no compiler, build error)."""
    global _lib, _tried
    if extra_flags:
        return _bind(ctypes.CDLL(str(_build(_require_compiler(), extra_flags=extra_flags))))
    if _tried:
        return _lib
    _tried = True
    cxx = _compiler()
    if cxx is None:
        logger.warning("kvserve: no C++ compiler found; using the pure-torch attention backend")
        return None
    # torch is imported first, so the library's libgomp.so.1 resolves to torch's: one OpenMP thread pool
    try:
        _lib = _bind(ctypes.CDLL(str(_build(cxx))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("kvserve: building the C++ attention kernels failed; using the pure-torch backend: %s", e)
        _lib = None
    return _lib


def _require_compiler() -> str:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler")
    return cxx


def paged_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start: torch.Tensor, num_heads: int, scale: float) -> None:
    """out[T, H*D] = causal attention of q[T, H*D] (rows may be strided) over each sequence's paged K/V."""
    _, bs, hkv, d = k_cache.shape
    fn = lib.kv_paged_attention_bf16 if q.dtype == torch.bfloat16 else lib.kv_paged_attention_f32
    fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), block_tables.data_ptr(),
       block_tables.stride(0), seq_lens.data_ptr(), query_start.data_ptr(), seq_lens.shape[0], num_heads, hkv, d,
       bs, scale)


def write_kv(lib: ctypes.CDLL, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache/v_cache rows [slot_mapping[t]] = k/v [t] (k, v: [T, Hkv*D], rows may be strided)."""
    n = k_cache.shape[-2] * k_cache.shape[-1]
    lib.kv_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(), k.shape[0], n,
                    k.element_size(), k_cache.data_ptr(), v_cache.data_ptr())


def rows_ok(x: torch.Tensor) -> bool:
    """A [T, N] tensor whose rows are contiguous (any row stride)."""
    return x.dim() == 2 and x.stride(1) == 1
