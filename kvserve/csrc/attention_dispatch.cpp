// The paged attention's work items (sequences x kv heads x query tokens, split into key segments where too few
// for the threads) and which kernel runs them; the KV cache write; the C entry points.
#include "common.h"

namespace {

// The kernel a step of these shapes takes over the standard layout: 512 (AVX-512), 2 (AVX2) or 0 (portable)
template <typename T, typename KV>
int standard_path(int64_t H, int64_t Hkv, int64_t D) {
#ifdef KV_HAVE_AVX512
  if ((std::is_same<T, KV>::value || kFp8<KV>) && D % 32 == 0 && Hkv * D <= MAX_KV_ROW && H <= MAX_ROWS) return 512;
#endif
#ifdef KV_HAVE_AVX2
  if ((std::is_same<T, KV>::value || kAvx2Kv<KV>) && D % 16 == 0) return 2;
#endif
  (void)H; (void)Hkv; (void)D;
  return 0;
}

// tiled: K/V are in the bf16 kernel layout (bf16 only, bs % 16 == 0, D % 32 == 0), else [blocks, bs, Hkv, D]
// KV: the pools' element type: T, or an FP8 format (standard layout; kv_scales: K's, V's)
template <typename T, typename KV = T>
void paged_attention(const T* q, int64_t qs, const KV* kc, const KV* vc, T* out, const int32_t* block_tables,
                     int64_t table_stride, const int32_t* seq_lens, const int32_t* query_start, int64_t B, int64_t H,
                     int64_t Hkv, int64_t D, int64_t bs, float scale, bool tiled, const float* kv_scales,
                     int64_t window, float softcap) {
  const int64_t G = H / Hkv;
  const int path = standard_path<T, KV>(H, Hkv, D);
  const bool simd = path == 512, avx2 = path == 2;
  (void)avx2;
  const float k_scale = kv_scales ? kv_scales[0] : 1.f, v_scale = kv_scales ? kv_scales[1] : 1.f;
  // A work item is (sequence, query tile, kv heads), decided per sequence. The tiled kernel takes all kv heads
  // when the step has many sequences and every row of the sequence fits one item (decodes, short chunks), else
  // one kv head per item with the longest token tiles (prefill; shorter ones where the step has few items,
  // below). The AVX-512 kernel on the standard layout takes all kv heads for queries of more than 4 tokens, one
  // for decodes; the AVX2 kernel always one. Both prefetch the next chunk's rows of the heads they take; for
  // decodes, one head per item ran faster than whole rows (benchmarks/attention_kernel.py).
  const bool many = B >= 4 * omp_get_max_threads();
  // first item, kv heads per item, tokens per item, runs of key segments (items) per tile and kv heads
  std::vector<int64_t> first(B + 1, 0), ngs(B), tiles(B), runs(B, 1);
  const auto count_items = [&] {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t q_len = query_start[b + 1] - query_start[b];
      first[b + 1] = first[b] + ((q_len + tiles[b] - 1) / tiles[b]) * (Hkv / ngs[b]) * runs[b];
    }
  };
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = query_start[b + 1] - query_start[b];
    ngs[b] = tiled ? (many && q_len * H <= MAX_ROWS ? Hkv : 1) : simd && q_len > 4 ? Hkv : 1;
    tiles[b] = std::max<int64_t>(1, MAX_ROWS / (ngs[b] * G));
  }
  count_items();
  const int64_t threads = omp_get_max_threads();
  if (first[B] < 2 * threads) {
    // few items (one sequence verifying drafts, a short chunk): shorter query tiles, so that the threads get
    // about as many each (3 kv heads on 2 threads would leave one thread a third of the work). A row's result
    // does not depend on its tile: its keys go in the same chunks. In the tiled kernel that holds for finite
    // K/V: it multiplies the V of a later row's keys in a row's last chunk by a probability of 0, so an inf or
    // NaN there reaches the rows that share its tile.
    for (int64_t b = 0; b < B; ++b) {
      const int64_t q_len = query_start[b + 1] - query_start[b];
      const int64_t per_seq = (2 * threads + B - 1) / B, groups = Hkv / ngs[b];
      const int64_t want = (per_seq + groups - 1) / groups;   // query tiles of this sequence
      tiles[b] = std::min(tiles[b], std::max<int64_t>(1, (q_len + want - 1) / want));
    }
    count_items();
  }
  // still fewer items than threads, or not shared evenly (a sequence or two decoding, 3 kv heads on 2 threads): the
  // kernels that fold key segments cut each sequence's keys into runs of segments, about 2 items a thread, and a
  // second pass folds the states of the rows that span segments
  // (not inside a parallel region: the fused layer stack's decode shares sequences out between the threads)
  std::vector<int64_t> part_at(B, -1), segs(B, 1), seg0(B, 0);   // a split sequence's states, segments, first one
  std::unique_ptr<float[]> parts;
  float* parts0 = nullptr;
  if (first[B] > 0 && (first[B] < threads || (first[B] < 2 * threads && first[B] % threads)) && (tiled || avx2) &&
      !omp_in_parallel()) {
    const int64_t pieces = (2 * threads + first[B] - 1) / first[B];
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t q_len = query_start[b + 1] - query_start[b];
      segs[b] = (seq_lens[b] + SEG - 1) / SEG;
      seg0[b] = window_first(seq_lens[b] - q_len, window) / SEG;   // the first token's first key (a window's)
      runs[b] = std::min(segs[b] - seg0[b], pieces);
      if (runs[b] <= 1) {
        runs[b] = 1;
        continue;
      }
      part_at[b] = total;
      total += q_len * H * segs[b] * part_stride(D);
    }
    count_items();
    if (total > 0) {
      split_steps.fetch_add(1, std::memory_order_relaxed);
      parts.reset(new float[total + 16]);   // (+16: room to align the states to 64 bytes)
      parts0 = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(parts.get()) + 63) & ~uintptr_t(63));
      for (int64_t i = D; i < total; i += part_stride(D)) parts0[i] = -INFINITY;   // every state empty to begin with
    }
  }
  #pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < first[B]; ++item) {
    const int64_t b = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
    const int64_t ng = ngs[b], tile = tiles[b], groups = Hkv / ng;
    const int64_t run = (item - first[b]) % runs[b], rest = (item - first[b]) / runs[b];
    const int64_t q_len = query_start[b + 1] - query_start[b];
    const int64_t tile_idx = rest / groups, g = (rest % groups) * ng;
    const int64_t t0 = tile_idx * tile, nt = std::min(tile, q_len - t0);
    const int32_t* table = block_tables + b * table_stride;
    Segments sg;
    if (runs[b] > 1) {   // segments seg0 + [run n / runs, (run + 1) n / runs) of the n from seg0 on
      const int64_t n = segs[b] - seg0[b];
      sg = Segments{(seg0[b] + run * n / runs[b]) * SEG, (seg0[b] + (run + 1) * n / runs[b]) * SEG,
                    parts0 + part_at[b], segs[b]};
    }
#ifdef KV_HAVE_BF16_TILE
    if constexpr (std::is_same<T, uint16_t>::value && std::is_same<KV, uint16_t>::value) {
      if (tiled) {
        attend_item_tiled(q, qs, kc, vc, out, table, seq_lens[b], q_len, query_start[b], t0, nt, g, ng, H, Hkv, D,
                          bs, scale, window, softcap, sg);
        continue;
      }
    }
#endif
#ifdef KV_HAVE_AVX512
    if constexpr (std::is_same<T, KV>::value || kFp8<KV>) {
      if (simd) {
        attend_item_simd<T, KV>(q, qs, kc, vc, out, table, seq_lens[b], q_len, query_start[b], t0, nt, g, ng, H, Hkv,
                                D, bs, scale, k_scale, v_scale, window, softcap);
        continue;
      }
    }
#endif
#ifdef KV_HAVE_AVX2
    if constexpr (std::is_same<T, KV>::value || kAvx2Kv<KV>) {
      if (avx2) {
        attend_item_avx2<T, KV>(q, qs, kc, vc, out, table, seq_lens[b], q_len, query_start[b], t0, nt, g, H, Hkv, D,
                                bs, scale, k_scale, v_scale, window, softcap, sg);
        continue;
      }
    }
#endif
    attend_item<T, KV>(q, qs, kc, vc, out, table, seq_lens[b], q_len, query_start[b], t0, nt, g, H, Hkv, D, bs, scale,
                       k_scale, v_scale, window, softcap);
  }
  // split sequences: each row that spans segments folds its segments' states in order, as an unsplit item would
  for (int64_t b = 0; b < B; ++b) {
    if (part_at[b] < 0) continue;
    const int64_t q_len = query_start[b + 1] - query_start[b];
    #pragma omp parallel for schedule(static) if (q_len * H >= 16)
    for (int64_t row = 0; row < q_len * H; ++row) {
      const int64_t t = row / H, limit = seq_lens[b] - q_len + t, f = window_first(limit, window);
      if (!spans_segments(f, limit)) continue;
      alignas(64) float acc[MAX_D] = {};
      float m = -INFINITY, l = 0.f;
      const float* slot = parts0 + part_at[b] + row * segs[b] * part_stride(D);
      for (int64_t sgi = f / SEG; sgi <= limit / SEG; ++sgi) {
        const float* st = slot + sgi * part_stride(D);
        fold_segment(acc, m, l, st, st[D], st[D + 1], D);
      }
      T* dst = out + (query_start[b] * H + row) * D;
#ifdef KV_HAVE_BF16_TILE
      if constexpr (std::is_same<T, uint16_t>::value && std::is_same<KV, uint16_t>::value)
        if (tiled) {
          store_row_tiled(dst, acc, l, D);
          continue;
        }
#endif
#ifdef KV_HAVE_AVX2
      if constexpr (std::is_same<T, KV>::value || kAvx2Kv<KV>) store_row_avx2<T, KV>(dst, acc, l, v_scale, D);
#endif
      (void)dst;
    }
  }
}

// cache rows of the tokens: slot s = block * bs + offset; row_elems = Hkv * D elements of es bytes (standard
// layout), or the kernel layout's tiles for bf16 (tiled)
void write_kv(const char* k, int64_t ks, const char* v, int64_t vs, const int64_t* slots, int64_t T, int64_t Hkv,
              int64_t D, int64_t es, int64_t bs, bool tiled, char* kc, char* vc) {
  const int64_t n = Hkv * D;
  if (!tiled) {
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(kc + slots[t] * n * es, k + t * ks * es, n * es);
      std::memcpy(vc + slots[t] * n * es, v + t * vs * es, n * es);
    }
    return;
  }
  const uint16_t* k16 = reinterpret_cast<const uint16_t*>(k);
  const uint16_t* v16 = reinterpret_cast<const uint16_t*>(v);
  uint16_t* kc16 = reinterpret_cast<uint16_t*>(kc);
  uint16_t* vc16 = reinterpret_cast<uint16_t*>(vc);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t], j = s % 16;
    const int64_t group = (s / bs) * (bs / 16) + (s % bs) / 16;
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t base = (group * Hkv + g) * 16 * D;
      const uint16_t* kr = k16 + t * ks + g * D;
      const uint16_t* vr = v16 + t * vs + g * D;
      uint16_t* kt = kc16 + base + 2 * j;                      // K[d / 2][j][d % 2]
      uint16_t* vt = vc16 + base + (j / 2) * 2 * D + j % 2;    // V[j / 2][d][j % 2]
      for (int64_t d = 0; d < D; d += 2) { kt[16 * d] = kr[d]; kt[16 * d + 1] = kr[d + 1]; }
      for (int64_t d = 0; d < D; ++d) vt[2 * d] = vr[d];
    }
  }
}

// FP8 pools (standard layout): rows [slots[t]] = fp8(k[t] / k_scale), fp8(v[t] / v_scale); k/v float32 or bf16
template <typename T>
void write_kv_fp8(const T* k, int64_t ks, const T* v, int64_t vs, const int64_t* slots, int64_t T_, int64_t n,
                  int fmt, const float* kv_scales, uint8_t* kc, uint8_t* vc) {
  const float kinv = 1.f / kv_scales[0], vinv = 1.f / kv_scales[1];   // torch multiplies by the reciprocal too
  #pragma omp parallel for schedule(static) if (T_ * n >= 16384)
  for (int64_t t = 0; t < T_; ++t) {
    uint8_t* kd = kc + slots[t] * n;
    uint8_t* vd = vc + slots[t] * n;
    for (int64_t i = 0; i < n; ++i) {
      kd[i] = fp8_encode(load(k + t * ks, i) * kinv, fmt);
      vd[i] = fp8_encode(load(v + t * vs, i) * vinv, fmt);
    }
  }
}

}  // namespace

extern "C" {
int kvserve_simd() {
#ifdef KV_HAVE_AVX512
  return 1;
#else
  return 0;
#endif
}
// 1 when the AVX2 kernels are built (attention, bf16 norms, RoPE and SiLU on 8 lanes)
int kvserve_avx2() {
#ifdef KV_HAVE_AVX2
  return 1;
#else
  return 0;
#endif
}
// 1 when the AVX2 attention kernel reads FP8 pools (F16C widens them), else the portable kernel does
int kvserve_fp8_avx2() {
#ifdef KV_HAVE_AVX2
  return kAvx2Kv<fp8_e4m3> ? 1 : 0;
#else
  return 0;
#endif
}
// the kernel FP8 pools (fmt: FP8_E4M3, FP8_E5M2) of these shapes take under float32 queries: 512 (AVX-512), 2 (AVX2)
// or 0 (portable); paged_attention dispatches by the same function
int kvserve_fp8_attention_path(int64_t H, int64_t Hkv, int64_t D, int64_t fmt) {
  return fmt == FP8_E4M3 ? standard_path<float, fp8_e4m3>(H, Hkv, D) : standard_path<float, fp8_e5m2>(H, Hkv, D);
}
// how many attention calls have split their keys into runs of segments (a diagnostic: the tests check a step splits)
int64_t kvserve_attention_split_steps() { return split_steps.load(); }
// 1 when bf16 caches can take the kernel layout (AVX-512 BF16)
int kvserve_bf16_tiles() {
#ifdef KV_HAVE_BF16_TILE
  return 1;
#else
  return 0;
#endif
}
void kvserve_paged_attention_f32(const float* q, int64_t qs, const float* kc, const float* vc, float* out,
                            const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                            const int32_t* query_start, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                            float scale, int64_t window, float softcap) {
  paged_attention<float>(q, qs, kc, vc, out, tables, table_stride, seq_lens, query_start, B, H, Hkv, D, bs, scale,
                         false, nullptr, window, softcap);
}
void kvserve_paged_attention_bf16(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc, uint16_t* out,
                             const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                             const int32_t* query_start, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                             float scale, int64_t tiled, int64_t window, float softcap) {
  paged_attention<uint16_t>(q, qs, kc, vc, out, tables, table_stride, seq_lens, query_start, B, H, Hkv, D, bs,
                            scale, tiled != 0, nullptr, window, softcap);
}
// q, out: float32 or bf16 (q_bf16); kc, vc: FP8 pools of format fmt (FP8_E4M3, FP8_E5M2) in the standard layout
void kvserve_paged_attention_fp8(const void* q, int64_t qs, const uint8_t* kc, const uint8_t* vc, void* out,
                                 const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                                 const int32_t* query_start, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                                 float scale, int64_t q_bf16, int64_t fmt, const float* kv_scales, int64_t window,
                                 float softcap) {
  auto run = [&](auto q_t, auto kv_t) {
    using TQ = std::remove_pointer_t<decltype(q_t)>;
    using KV = std::remove_pointer_t<decltype(kv_t)>;
    paged_attention<TQ, KV>(static_cast<const TQ*>(q), qs, reinterpret_cast<const KV*>(kc),
                            reinterpret_cast<const KV*>(vc), static_cast<TQ*>(out), tables, table_stride, seq_lens,
                            query_start, B, H, Hkv, D, bs, scale, false, kv_scales, window, softcap);
  };
  if (q_bf16) {
    if (fmt == FP8_E4M3) run((uint16_t*)nullptr, (fp8_e4m3*)nullptr); else run((uint16_t*)nullptr, (fp8_e5m2*)nullptr);
  } else {
    if (fmt == FP8_E4M3) run((float*)nullptr, (fp8_e4m3*)nullptr); else run((float*)nullptr, (fp8_e5m2*)nullptr);
  }
}
void kvserve_write_kv_fp8(const void* k, int64_t ks, const void* v, int64_t vs, const int64_t* slots, int64_t T,
                          int64_t Hkv, int64_t D, int64_t x_bf16, int64_t fmt, const float* kv_scales, uint8_t* kc,
                          uint8_t* vc) {
  if (x_bf16)
    write_kv_fp8(static_cast<const uint16_t*>(k), ks, static_cast<const uint16_t*>(v), vs, slots, T, Hkv * D,
                 int(fmt), kv_scales, kc, vc);
  else
    write_kv_fp8(static_cast<const float*>(k), ks, static_cast<const float*>(v), vs, slots, T, Hkv * D, int(fmt),
                 kv_scales, kc, vc);
}
void kvserve_write_kv(const char* k, int64_t ks, const char* v, int64_t vs, const int64_t* slots, int64_t T, int64_t Hkv,
                 int64_t D, int64_t es, int64_t bs, int64_t tiled, char* kc, char* vc) {
  write_kv(k, ks, v, vs, slots, T, Hkv, D, es, bs, tiled != 0, kc, vc);
}
}
