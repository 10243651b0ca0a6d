// Paged attention straight from the KV blocks, and the KV cache write: portable, AVX2 and AVX-512 paths over the
// standard layout [blocks, bs, Hkv, D] (bf16, float32 or FP8 pools), and a bf16 path over the kernel layout (tiles
// vdpbf16ps takes).
#include "common.h"

namespace {

constexpr int KC = 32;        // keys per chunk: every query row of a work item passes over them together
constexpr int MAX_D = 256;    // largest head_dim supported (checked on the Python side)
constexpr int MAX_ROWS = 64;  // query rows (tokens x q heads) per work item
constexpr int MAX_KV_ROW = 1024;  // kv heads x head_dim of the SIMD path
// FP8 pools: the SIMD kernels widen E4M3 to 2^-8 of its value (fp8_as_fp16) and carry the 2^8 in their scales
template <typename KV> constexpr bool kFp8 = std::is_same_v<KV, fp8_e4m3> || std::is_same_v<KV, fp8_e5m2>;
template <typename KV> constexpr float kFp8Unit = std::is_same_v<KV, fp8_e4m3> ? 256.f : 1.f;

// Sliding window W (0: none): a token whose last visible key is `limit` sees keys [limit - W + 1, limit].
inline int64_t window_first(int64_t limit, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, limit - window + 1) : 0;
}
// Logit soft-capping (Gemma 2): a scaled score s becomes cap * tanh(s / cap); cap 0: none. Scores [lo, nv) of a row.
inline void soft_cap(float* s, int64_t lo, int64_t nv, float cap) {
  if (cap > 0.f)
    for (int64_t j = lo; j < nv; ++j) s[j] = cap * std::tanh(s[j] / cap);
}
// Where a work item's pass over the keys starts: the chunk (of KC keys, or a block where blocks are shorter) that
// holds its earliest row's first key. Chunks sit on one grid from position 0 whatever the start, so a row meets
// its keys in the same chunks in every tile and step, and its result does not depend on them.
inline int64_t chunk_start(int64_t first, int64_t bs) {
  const int64_t step = std::lcm<int64_t>(bs, KC);
  return first / step * step;
}

// Key segments: a row whose keys [first, limit] lie in more than one segment of SEG positions (one grid from
// position 0, on the chunks' grid) runs its online softmax per segment and folds the segments' states in order
// (fold_segment). Its result then does not depend on whether one work item takes all its segments, or each of
// several items a run of them and stores each segment's state for a second pass to fold: a step of too few work
// items for the threads (one sequence decoding, a model with one or two kv heads) splits its sequences' keys so
// that every thread gets keys to read (flash-decoding). The AVX2 and bf16-tile kernels take them.
constexpr int64_t SEG = 1024;
static_assert(SEG % KC == 0, "segments are whole chunks");
inline bool spans_segments(int64_t first, int64_t limit) { return first / SEG != limit / SEG; }
inline int64_t part_stride(int64_t D) { return D + 16; }
// what a work item takes: keys [lo, hi) (whole segments); split: one run of a split sequence's segments, whose rows
// that span segments store each segment's state (the unnormalized accumulator, then the running max and sum) at
// part[((token * H + head) * nseg + segment) * part_stride(D)]
struct Segments {
  int64_t lo = 0, hi = INT64_MAX;
  float* part = nullptr;
  int64_t nseg = 1;
  bool split() const { return part != nullptr; }
  float* slot(int64_t token, int64_t head, int64_t H, int64_t segment, int64_t D) const {
    return part + ((token * H + head) * nseg + segment) * part_stride(D);
  }
  bool owns(int64_t key) const { return lo <= key && key < hi; }   // a row within one segment: written by its item
};
// (A, M, L) <- the fold of a segment's state (a, m, l) into it: M' = max(M, m), A e^(M - M') + a e^(m - M') and
// L likewise; an empty state (m = -inf) changes nothing. One compiled copy for every caller: an item folds its
// segments as the second pass folds split items' states.
__attribute__((noinline, noclone)) void fold_segment(float* A, float& M, float& L, const float* a, float m, float l,
                                                     int64_t D) {
  if (m == -INFINITY) return;
  // one of the two factors is e^0 = 1 exactly: one exp (an empty A, M = -inf, takes e^-inf = 0)
  const float e1 = M >= m ? 1.f : std::exp(M - m), e2 = M >= m ? std::exp(m - M) : 1.f;
  for (int64_t d = 0; d < D; ++d) A[d] = std::fma(a[d], e2, A[d] * e1);
  L = std::fma(l, e2, L * e1);
  M = std::max(M, m);
}
std::atomic<int64_t> split_steps{0};   // steps whose keys were split so far (kvserve_attention_split_steps)
// a segment's state into its slot of a split sequence's states
inline void store_part(float* slot, const float* a, float m, float l, int64_t D) {
  std::copy(a, a + D, slot);
  slot[D] = m;
  slot[D + 1] = l;
}
// What a work item keeps for its rows' segments (the AVX2 and bf16-tile kernels alike): which rows span segments,
// and, in an unsplit item, their finished segments folded.
struct RowFolds {
  alignas(64) float folded[MAX_ROWS * MAX_D];
  float fm[MAX_ROWS], fl[MAX_ROWS];
  bool multi[MAX_ROWS];

  void init(int64_t r, int64_t first, int64_t limit, const Segments& sg, int64_t D) {
    multi[r] = spans_segments(first, limit);
    fm[r] = -INFINITY;
    fl[r] = 0.f;
    if (multi[r] && !sg.split()) std::memset(folded + r * D, 0, D * sizeof(float));
  }
  // a segment ends before key p: row r's state (acc, m, l; row `token`, `head` of the sequence) folded, or
  // stored where the item is split, and the next segment started afresh
  void end_segment(const Segments& sg, int64_t r, int64_t p, int64_t token, int64_t head, int64_t H, float* acc,
                   float& m, float& l, int64_t D) {
    if (!multi[r]) return;
    if (sg.split())
      store_part(sg.slot(token, head, H, p / SEG - 1, D), acc, m, l, D);
    else
      fold_segment(folded + r * D, fm[r], fl[r], acc, m, l, D);
    std::memset(acc, 0, D * sizeof(float));
    m = -INFINITY;
    l = 0.f;
  }
  // the item done with row r (keys [first, ...]; the item took [start, end)): store(acc, l) writes its output
  // where the row is the item's to write, else its last segment's state goes to its slot
  template <typename Store>
  void finish(const Segments& sg, int64_t r, int64_t first, int64_t start, int64_t end, int64_t token, int64_t head,
              int64_t H, float* acc, float m, float l, int64_t D, Store store) {
    if (!multi[r]) {   // a split item writes the rows within its segments
      if (!sg.split() || sg.owns(first)) store(acc, l);
    } else if (sg.split()) {
      if (start < end) store_part(sg.slot(token, head, H, (end - 1) / SEG, D), acc, m, l, D);
    } else {
      fold_segment(folded + r * D, fm[r], fl[r], acc, m, l, D);
      store(folded + r * D, fl[r]);
    }
  }
};

// One query row's online-softmax step over the chunk's keys kf / vf [0, nv) (float32): scores, exps, and P @ V
// into its accumulator a, with its running max m and sum l.
inline void row_update(const float* qr, float* a, float& m, float& l, const float (*kf)[MAX_D],
                       const float (*vf)[MAX_D], int64_t nv, int64_t D, float softcap) {
  float s[KC];
  for (int64_t j = 0; j < nv; ++j) {
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += qr[d] * kf[j][d];
    s[j] = dot;
  }
  soft_cap(s, 0, nv, softcap);
  float smax = -INFINITY;
  for (int64_t j = 0; j < nv; ++j) smax = std::max(smax, s[j]);
  const float mnew = std::max(m, smax);
  const float corr = std::exp(m - mnew);
  float psum = 0.f;
  for (int64_t j = 0; j < nv; ++j) { s[j] = std::exp(s[j] - mnew); psum += s[j]; }
  l = l * corr + psum;
  m = mnew;
  for (int64_t d = 0; d < D; ++d) a[d] *= corr;
  for (int64_t j = 0; j < nv; ++j) {
    const float pj = s[j];
    for (int64_t d = 0; d < D; ++d) a[d] += pj * vf[j][d];
  }
}

#ifdef KV_HAVE_AVX2
// lanes 0-3: the sums of the lanes of a0 .. a3
KV_ALWAYS_INLINE __m128 transpose_sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// 16 values of a K or V row as two float vectors, in the AVX2 kernel's order of dims: bf16 as its 8 even and 8
// odd values (a shift or an and on one load, no conversion pass), float32 as they come. Queries and accumulators
// use the same order (q16), and the output is put back in place (unpermute16).
KV_ALWAYS_INLINE void load16_halves(const uint16_t* p, __m256& a, __m256& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xffff0000u))));
}
KV_ALWAYS_INLINE void load16_halves(const float* p, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(p);
  b = _mm256_loadu_ps(p + 8);
}
#ifdef __F16C__
// FP8 as fp16 codes, 16 at a time, for vcvtph2ps to widen exactly. E5M2 is fp16's upper byte. E4M3's exponent and
// mantissa sit below fp16's by 7 bits (S.EEEE.MMM -> S.0EEEE.MMM0000000: 2^-8 of its value, denormals too;
// kFp8Unit); its one NaN code is made fp16's NaN.
KV_ALWAYS_INLINE __m256i fp8_as_fp16(const fp8_e5m2* p) {
  return _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
}
KV_ALWAYS_INLINE __m256i fp8_as_fp16(const fp8_e4m3* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 1), _mm256_set1_epi16(int16_t(0xbfff)));
  const __m256i m7 = _mm256_set1_epi16(0x7f);
  return _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(w, m7), m7),
                                             _mm256_set1_epi16(0x7e00)));
}
// 16 values as they come (no split)
template <typename KV, typename = std::enable_if_t<kFp8<KV>>>
KV_ALWAYS_INLINE void load16_halves(const KV* p, __m256& a, __m256& b) {
  fp16_halves(fp8_as_fp16(p), a, b);
}
template <typename KV> constexpr bool kAvx2Kv = kFp8<KV>;
#else
template <typename KV> constexpr bool kAvx2Kv = false;
#endif
// the order of dims the K/V type loads in: bf16 split into even and odd values, the others as they come
template <typename KV> constexpr bool kSplit16 = std::is_same_v<KV, uint16_t>;
template <typename KV, typename T> inline void q16(const T* src, float scale, float* dst) {   // 16 values so
  for (int k = 0; k < 8; ++k) {
    dst[k] = load(src, kSplit16<KV> ? 2 * k : k) * scale;
    dst[8 + k] = load(src, kSplit16<KV> ? 2 * k + 1 : 8 + k) * scale;
  }
}
template <typename KV> inline int unpermute16(int k) {   // where value k of 16 sits in that order
  return kSplit16<KV> ? (k % 2) * 8 + k / 2 : k;
}

// the scores of NR (1 or 2) query rows q[r] against keys j .. j + 3 of the chunk (rows kr[j], D = 16 n16) into
// s[r][j ..]: each key's loads serve both rows, each row's sums are its own
template <int NR, typename T>
KV_ALWAYS_INLINE void scores4(const float* const* q, const T* const* kr, int64_t j, int64_t n16, float* const* s) {
  __m256 a[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < 4; ++k) a[r][k] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n16; ++i) {
    __m256 qa[NR], qb[NR];
    for (int r = 0; r < NR; ++r) {
      qa[r] = _mm256_load_ps(q[r] + 16 * i);
      qb[r] = _mm256_load_ps(q[r] + 16 * i + 8);
    }
    for (int k = 0; k < 4; ++k) {
      __m256 ka, kb;
      load16_halves(kr[j + k] + 16 * i, ka, kb);
      for (int r = 0; r < NR; ++r) a[r][k] = _mm256_fmadd_ps(qb[r], kb, _mm256_fmadd_ps(qa[r], ka, a[r][k]));
    }
  }
  for (int r = 0; r < NR; ++r) _mm_store_ps(s[r] + j, transpose_sum4(a[r][0], a[r][1], a[r][2], a[r][3]));
}

// the lines of rows[j0, j1) (each `bytes` long) on their way to L2: the next chunk's K and V rows, a few at a time
// while this chunk computes (a burst at a chunk's start overflows the miss queues: benchmarks/LOG.md, tiled kernel)
template <typename T>
KV_ALWAYS_INLINE void prefetch_rows(const T* const* rows, int64_t j0, int64_t j1, int64_t bytes) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(rows[j]) + b, _MM_HINT_T1);
}

// dims 16 i0 .. 16 (i0 + NI) of NR rows' accumulators (in load16_halves' order): acc = acc * corr + the sum over
// keys j0 <= j < j1 of p[r][j] v[j] (rows vr[j])
template <int NR, int NI, typename T>
KV_ALWAYS_INLINE void pv_rows(float* const* acc, const float* const* p, const float* corr, const T* const* vr,
                              int64_t j0, int64_t j1, int64_t i0) {
  __m256 a[NR][2 * NI];
  for (int r = 0; r < NR; ++r) {
    const __m256 c = _mm256_set1_ps(corr[r]);
    for (int i = 0; i < 2 * NI; ++i) a[r][i] = _mm256_mul_ps(_mm256_load_ps(acc[r] + 16 * i0 + 8 * i), c);
  }
  for (int64_t j = j0; j < j1; ++j) {
    __m256 v[2 * NI];
    for (int i = 0; i < NI; ++i) load16_halves(vr[j] + 16 * (i0 + i), v[2 * i], v[2 * i + 1]);
    for (int r = 0; r < NR; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p[r] + j);
      for (int i = 0; i < 2 * NI; ++i) a[r][i] = _mm256_fmadd_ps(pj, v[i], a[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < 2 * NI; ++i) _mm256_store_ps(acc[r] + 16 * i0 + 8 * i, a[r][i]);
}

template <int NR, typename T>
inline void pv_dims(float* const* acc, const float* const* p, const float* corr, const T* const* vr, int64_t j0,
                    int64_t j1, int64_t n16) {
  int64_t i0 = 0;
  for (; i0 + 2 <= n16; i0 += 2) pv_rows<NR, 2>(acc, p, corr, vr, j0, j1, i0);
  if (i0 < n16) pv_rows<NR, 1>(acc, p, corr, vr, j0, j1, i0);
}

// the online-softmax step of one row over its keys [lo, nv) of the chunk's raw scores s [KC]: updates its running
// max m and sum l, sets the rescale factor corr and turns s into exp(s - m), exactly 0 outside [lo, nv)
inline void softmax_chunk(float* s, int64_t lo, int64_t nv, float& m, float& l, float& corr) {
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), vn = _mm256_set1_ps(float(nv));
  const __m256 vlo = _mm256_set1_ps(float(lo));
  const auto visible = [&](int64_t j) {
    const __m256 pos = _mm256_add_ps(lane, _mm256_set1_ps(float(j)));
    return _mm256_and_ps(_mm256_cmp_ps(pos, vn, _CMP_LT_OQ), _mm256_cmp_ps(pos, vlo, _CMP_GE_OQ));
  };
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < nv; j += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_load_ps(s + j), visible(j)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float mnew = std::max(m, _mm_cvtss_f32(h));
  corr = std::exp(m - mnew);
  const __m256 vm = _mm256_set1_ps(mnew);
  __m256 psum = _mm256_setzero_ps();
  for (int64_t j = 0; j < KC; j += 8) {
    const __m256 e = j < nv ? _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_load_ps(s + j), vm)), visible(j))
                            : _mm256_setzero_ps();
    _mm256_store_ps(s + j, e);
    psum = _mm256_add_ps(psum, e);
  }
  l = l * corr + hsum8(psum);
  m = mnew;
}

// One work item on 8 lanes (D % 16 == 0; K/V of the query's type): sequence b, kv head g, query tokens
// [t0, t0 + nt). Per chunk of KC key positions (fixed positions, so a row's result does not depend on its tile or
// step), three passes over the rows, two rows at a time, reading K and V straight from the cache, so that
// out-of-order execution overlaps rows and each load serves both: 1. scores, 2. online-softmax update, 3. P @ V.
// A row's sums are its own in every pass and it reads no key past its causal limit (a pair's P @ V runs together
// over the keys both see, then the longer row alone, its factor 1), so its result does not depend on its partner.
// The next chunk's K and V rows are prefetched into L2 while this chunk's scores are computed: a sequence's blocks
// lie anywhere in the pool, so no hardware prefetcher can tell where its next rows are.
// KV: the query's type, or an FP8 format (F16C), whose K scale is folded into the queries, V's into the output.
// a row's output from its accumulator (in load16_halves' order of dims) and sum
// (one compiled copy: an item's rows and the second pass's round alike)
template <typename T, typename KV>
__attribute__((noinline)) void store_row_avx2(T* dst, const float* acc, float l, float v_scale, int64_t D) {
  const float inv = v_scale * kFp8Unit<KV> / l;
  for (int64_t d = 0; d < D; d += 16)
    for (int k = 0; k < 16; ++k) store(dst, d + k, acc[d + unpermute16<KV>(k)] * inv);
}

template <typename T, typename KV>
void attend_item_avx2(const T* q, int64_t qs, const KV* kc, const KV* vc, T* out, const int32_t* table,
                      int64_t ctx_len, int64_t q_len, int64_t q_row0, int64_t t0, int64_t nt, int64_t g, int64_t H,
                      int64_t Hkv, int64_t D, int64_t bs, float scale, float k_scale, float v_scale, int64_t window,
                      float softcap, const Segments& sg) {
  const int64_t G = H / Hkv, R = nt * G, n16 = D / 16;
  alignas(32) float qf[MAX_ROWS][MAX_D], acc[MAX_ROWS][MAX_D];
  RowFolds folds;
  alignas(32) float s[MAX_ROWS][KC];
  alignas(32) static const KV zero_row[MAX_D] = {};   // the keys past a chunk's end, up to a multiple of 4
  const KV* kr[KC];
  const KV* vr[KC];
  const KV* nk[KC];   // the next chunk's K and V rows (prefetched during this chunk's scores)
  const KV* nvr[KC];
  float m[MAX_ROWS], l[MAX_ROWS], corr[MAX_ROWS];
  int64_t limit[MAX_ROWS], first[MAX_ROWS], nv[MAX_ROWS], lo[MAX_ROWS];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G, h = g * G + r % G;
    const T* src = q + (q_row0 + t) * qs + h * D;
    for (int64_t d = 0; d < D; d += 16) q16<KV>(src + d, scale * k_scale * kFp8Unit<KV>, qf[r] + d);
    for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(acc[r] + d, _mm256_setzero_ps());
    m[r] = -INFINITY; l[r] = 0.f;
    limit[r] = ctx_len - q_len + t;   // causal: the last key position this token sees
    first[r] = window_first(limit[r], window);
    folds.init(r, first[r], limit[r], sg, D);
  }
  const int64_t end = std::min(limit[R - 1] + 1, sg.hi), start = std::max(chunk_start(first[0], bs), sg.lo);
  const int64_t kv_row = Hkv * D, blk_stride = bs * kv_row, row_bytes = D * int64_t(sizeof(KV));
  const auto rows_of = [&](int64_t p, int64_t n, const KV** k, const KV** v) {   // chunk p's rows, block by block
    for (int64_t j = 0; j < n;) {
      const int64_t off = (p + j) % bs, run = std::min(n - j, bs - off);
      const int64_t at = int64_t(table[(p + j) / bs]) * blk_stride + off * kv_row + g * D;
      for (int64_t i = 0; i < run; ++i, ++j) {
        k[j] = kc + at + i * kv_row;
        v[j] = vc + at + i * kv_row;
      }
    }
  };
  int64_t p = start;
  if (p < end) rows_of(p, std::min<int64_t>(KC, end - p), nk, nvr);
  for (; p < end; p += KC) {
    if (p % SEG == 0 && p > start)
      for (int64_t r = 0; r < R; ++r) folds.end_segment(sg, r, p, t0 + r / G, g * G + r % G, H, acc[r], m[r], l[r], D);
    const int64_t n = std::min<int64_t>(KC, end - p), n4 = (n + 3) & ~int64_t(3);
    std::copy(nk, nk + n, kr);
    std::copy(nvr, nvr + n, vr);
    const int64_t nn = std::max<int64_t>(0, std::min<int64_t>(KC, end - p - KC));   // the next chunk's keys
    if (nn > 0) rows_of(p + KC, nn, nk, nvr);
    for (int64_t j = n; j < n4; ++j) kr[j] = vr[j] = zero_row;
    for (int64_t r = 0; r < R; ++r) {   // the row sees keys [lo, nv) of the chunk
      nv[r] = std::max<int64_t>(0, std::min<int64_t>(n, limit[r] - p + 1));
      lo[r] = std::max<int64_t>(0, first[r] - p);
      if (lo[r] >= nv[r]) nv[r] = lo[r] = 0;
    }
    int64_t fetched = 0;   // the next chunk's rows prefetched so far: four keys a step of the first scores
    const auto fetch_next = [&](int64_t upto) {
      upto = std::min(upto, nn);
      if (fetched < upto) {
        prefetch_rows(nk, fetched, upto, row_bytes);
        prefetch_rows(nvr, fetched, upto, row_bytes);
        fetched = upto;
      }
    };
    int64_t r = 0;
    for (; r + 1 < R; r += 2) {   // 1. scores
      const float* qq[2] = {qf[r], qf[r + 1]};
      float* ss[2] = {s[r], s[r + 1]};
      for (int64_t j = 0; j < std::max(nv[r], nv[r + 1]); j += 4) {
        fetch_next(j + 4);
        scores4<2>(qq, kr, j, n16, ss);
      }
    }
    if (r < R) {
      const float* qq[1] = {qf[r]};
      float* ss[1] = {s[r]};
      for (int64_t j = 0; j < nv[r]; j += 4) {
        fetch_next(j + 4);
        scores4<1>(qq, kr, j, n16, ss);
      }
    }
    fetch_next(nn);   // the rest, where the rows saw fewer keys of this chunk than the next one has
    for (r = 0; r < R; ++r) {   // 2. online softmax
      corr[r] = 1.f;
      if (nv[r] <= 0) continue;
      soft_cap(s[r], lo[r], nv[r], softcap);
      softmax_chunk(s[r], lo[r], nv[r], m[r], l[r], corr[r]);
    }
    const float one = 1.f;
    for (r = 0; r < R; r += 2) {   // 3. P @ V: the keys both rows see together, then the longer row's rest alone
      const int64_t pair = r + 1 < R, both = pair ? std::min(nv[r], nv[r + 1]) : 0;
      if (both > 0) {
        float* aa[2] = {acc[r], acc[r + 1]};
        const float* pp[2] = {s[r], s[r + 1]};
        pv_dims<2>(aa, pp, corr + r, vr, 0, both, n16);
      }
      for (int64_t i = r; i <= r + pair; ++i) {
        if (nv[i] <= both) continue;
        float* aa[1] = {acc[i]};
        const float* pp[1] = {s[i]};
        pv_dims<1>(aa, pp, both > 0 ? &one : corr + i, vr, both, nv[i], n16);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G, h = g * G + r % G;
    T* dst = out + ((q_row0 + t) * H + h) * D;
    folds.finish(sg, r, first[r], start, end, t, h, H, acc[r], m[r], l[r], D,
                 [&](const float* a, float sum) { store_row_avx2<T, KV>(dst, a, sum, v_scale, D); });
  }
}
#endif

// One work item: sequence b, kv head g, query tokens [t0, t0 + nt) of that sequence.
// Rows are (token, q head of this kv head) pairs; every row runs its own online softmax.
// KV: the pools' element type (T, or an FP8 format whose values are scaled by k_scale / v_scale).
template <typename T, typename KV = T>
void attend_item(const T* q, int64_t qs, const KV* kc, const KV* vc, T* out, const int32_t* table, int64_t ctx_len,
                 int64_t q_len, int64_t q_row0, int64_t t0, int64_t nt, int64_t g, int64_t H, int64_t Hkv,
                 int64_t D, int64_t bs, float scale, float k_scale, float v_scale, int64_t window, float softcap) {  // one kv head g
  const int64_t G = H / Hkv, R = nt * G;
  alignas(64) float qf[MAX_ROWS][MAX_D], acc[MAX_ROWS][MAX_D];
  float m[MAX_ROWS], l[MAX_ROWS];
  int64_t limit[MAX_ROWS], first[MAX_ROWS];
  alignas(64) float kf[KC][MAX_D];
  alignas(64) float vf[KC][MAX_D];
  const float qscale = scale * k_scale;   // K's scale folded into the queries, V's into the output
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G, h = g * G + r % G;
    const T* src = q + (q_row0 + t) * qs + h * D;
    for (int64_t d = 0; d < D; ++d) { qf[r][d] = load(src, d) * qscale; acc[r][d] = 0.f; }
    m[r] = -INFINITY; l[r] = 0.f;
    limit[r] = ctx_len - q_len + t;   // causal: the last key position this token sees
    first[r] = window_first(limit[r], window);
  }
  const int64_t end = limit[R - 1] + 1;
  const int64_t kv_row = Hkv * D, blk_stride = bs * kv_row;
  for (int64_t p = chunk_start(first[0], bs); p < end;) {
    const int64_t off = p % bs;
    const int64_t n = std::min<int64_t>({KC, bs - off, end - p});
    const int64_t base = int64_t(table[p / bs]) * blk_stride + off * kv_row + g * D;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < D; ++d) { kf[j][d] = load(kc + base + j * kv_row, d); vf[j][d] = load(vc + base + j * kv_row, d); }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t nv = std::min<int64_t>(n, limit[r] - p + 1);  // keys [lo, nv) of this chunk the row sees
      const int64_t lo = std::max<int64_t>(0, first[r] - p);
      if (nv <= lo) continue;
      row_update(qf[r], acc[r], m[r], l[r], kf + lo, vf + lo, nv - lo, D, softcap);
    }
    p += n;
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G, h = g * G + r % G;
    T* dst = out + ((q_row0 + t) * H + h) * D;
    const float inv = v_scale / l[r];
    for (int64_t d = 0; d < D; ++d) store(dst, d, acc[r][d] * inv);
  }
}


#ifdef KV_HAVE_AVX512
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

// FP8 pools, 16 values widened exactly (fp8_as_fp16: E4M3 as 2^-8 of its value)
template <typename KV, typename = std::enable_if_t<kFp8<KV>>>
KV_ALWAYS_INLINE __m512 load16(const KV* p) {
  return _mm512_cvtph_ps(fp8_as_fp16(p));
}

// Keys are taken CH = 32 at a time, in three passes over the rows so each pass is short enough for
// out-of-order execution to overlap rows (one long per-row body serializes on its reductions and exps):
//   1. scores of every row (bf16 dot products, transposed sums), 2. online-softmax update, 3. P @ V.
// FP8 pools (KV) are widened once a chunk, K as V is, so the rows of an item share the conversion; K's scale
// multiplies the scores, V's the output.
template <typename T, typename KV = T>
void attend_item_simd(const T* q, int64_t qs, const KV* kc, const KV* vc, T* out, const int32_t* table,
                      int64_t ctx_len, int64_t q_len, int64_t q_row0, int64_t t0, int64_t nt, int64_t g0, int64_t ng,
                      int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale, float k_scale, float v_scale,
                      int64_t window, float softcap) {
  constexpr int CH = KC;
  constexpr bool fp8 = kFp8<KV>;
  const int64_t G = H / Hkv, RH = ng * G, R = nt * RH;   // RH: rows per token
  const int nd = int(D / 16);
  // compact strides: power-of-two row strides would put every row in the same L1 set
  alignas(64) float acc[MAX_ROWS * MAX_D];
  alignas(64) float vf[CH * (MAX_KV_ROW + 16)];
  alignas(64) float kf[fp8 ? CH * (MAX_KV_ROW + 16) : 1];
  alignas(64) float sc[MAX_ROWS * CH];
  float corr[MAX_ROWS], m[MAX_ROWS], l[MAX_ROWS];
  const T* qraw[MAX_ROWS];
  const KV* krow[CH];
  int64_t koff[MAX_ROWS], limit[MAX_ROWS], first[MAX_ROWS], nvis[MAX_ROWS], lo[MAX_ROWS];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / RH, h = g0 * G + r % RH;
    qraw[r] = q + (q_row0 + t) * qs + h * D;
    koff[r] = (h / G - g0) * D;
    for (int i = 0; i < nd; ++i) _mm512_store_ps(acc + r * D + 16 * i, _mm512_setzero_ps());
    m[r] = -INFINITY; l[r] = 0.f;
    limit[r] = ctx_len - q_len + t;
    first[r] = window_first(limit[r], window);
  }
  const int64_t end = limit[R - 1] + 1;
  const int64_t kv_row = Hkv * D, blk_stride = bs * kv_row, nvf = ng * D, vstride = nvf + 16;
  const __m512 vscale = _mm512_set1_ps(scale * k_scale * kFp8Unit<KV>), neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t p = chunk_start(first[0], bs); p < end; p += CH) {
    const int64_t n = std::min<int64_t>(CH, end - p), nn = std::max<int64_t>(0, std::min<int64_t>(CH, end - p - CH));
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = p + j;
      krow[j] = kc + int64_t(table[pos / bs]) * blk_stride + (pos % bs) * kv_row + g0 * D;
      const KV* vrow = vc + (krow[j] - kc);
      for (int64_t i = 0; i < nvf; i += 16) _mm512_store_ps(vf + j * vstride + i, load16(vrow + i));
      if constexpr (fp8)
        for (int64_t i = 0; i < nvf; i += 16) _mm512_store_ps(kf + j * vstride + i, load16(krow[j] + i));
      if (j < nn) {   // the next chunk's row j on its way to L2 (blocks lie anywhere: no hardware prefetcher knows)
        const int64_t at = int64_t(table[(pos + CH) / bs]) * blk_stride + ((pos + CH) % bs) * kv_row + g0 * D;
        for (int64_t b = 0; b < nvf * int64_t(sizeof(KV)); b += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(kc + at) + b, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(vc + at) + b, _MM_HINT_T1);
        }
      }
    }
    // 1. scores of the keys [lo, nv) of the chunk the row sees; -inf elsewhere
    for (int64_t r = 0; r < R; ++r) {
      const int64_t nv = std::min<int64_t>(n, limit[r] - p + 1);
      lo[r] = std::max<int64_t>(0, first[r] - p);
      nvis[r] = nv > lo[r] ? nv : 0;
      if (nvis[r] <= 0) continue;
      __m512 qv[MAX_D / 16];
      for (int i = 0; i < nd; ++i) qv[i] = load16(qraw[r] + 16 * i);
      for (int64_t j0 = 0; j0 < nv; j0 += 16) {
        __m512 part[16];
        for (int64_t j = 0; j < 16; ++j) {
          if (j0 + j >= nv || j0 + j < lo[r])
            part[j] = _mm512_setzero_ps();
          else if constexpr (fp8)
            part[j] = qk_partial(kf + (j0 + j) * vstride + koff[r], qv, nd, nullptr);
          else
            part[j] = qk_partial(krow[j0 + j] + koff[r], qv, nd, qraw[r]);
        }
        const int64_t left = nv - j0, skip = std::min<int64_t>(16, std::max<int64_t>(0, lo[r] - j0));
        const __mmask16 valid = (left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1)) &
                                __mmask16(0xffffu << skip);
        _mm512_store_ps(sc + r * CH + j0,
                        _mm512_mask_blend_ps(valid, neg_inf, _mm512_mul_ps(transpose_sum16(part), vscale)));
      }
      if (nv <= 16) _mm512_store_ps(sc + r * CH + 16, neg_inf);
      soft_cap(sc + r * CH, lo[r], nv, softcap);
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
        for (int64_t j = lo[r]; j < nv; ++j) {
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
    const float inv = v_scale * kFp8Unit<KV> / l[r];
    for (int64_t d = 0; d < D; ++d) store(dst, d, acc[r * D + d] * inv);
  }
}
#endif

#if defined(KV_HAVE_AVX512) && defined(__AVX512BF16__)
#define KV_HAVE_BF16_TILE 1
// The bf16 kernel layout of the cache (kvserve/attention/kv_layout.py): each block holds bs / 16 groups of 16
// keys; per group and kv head, a K tile [D/2][16][2] (dim pair k of the 16 keys in one 64-byte vector) and a
// V tile [8][D][2] (key pairs 2k, 2k+1 interleaved per dim). Both are what vdpbf16ps takes, straight from the
// cache: scores acc[16 keys] += q[dim pair k] (broadcast) . K[k]; output acc[16 dims] += (p_2k, p_2k+1)
// (broadcast) . V[k]. The kernel reads the tiles in address order and never transposes or copies K/V.
// P is rounded to bf16, as flash attention does on GPUs.
constexpr int TCH = 32;   // keys per chunk: two 16-key groups
constexpr int PF_CHUNKS = 1;   // a tunable: the prefetch distance in chunks (benchmarks/attention_kernel.py)

inline int64_t tile_offset(const int32_t* table, int64_t pos, int64_t bs, int64_t Hkv, int64_t D, int64_t g) {
  return ((int64_t(table[pos / bs]) * (bs / 16) + (pos % bs) / 16) * Hkv + g) * 16 * D;
}

// raw scores of NR rows against the 32 keys of the chunk (K0: keys 0-15, K1: 16-31): s[2r + h] covers keys 16h..
// pf (or nullptr): the K tiles of a chunk ahead, prefetched one line per line read
template <int NR>
inline void tile_scores(const __m512i* K0, const __m512i* K1, int nd2, const int32_t* const* qd, __m512* s,
                        const __m512i* const* pf) {
  __m512 a[NR][2];
  for (int r = 0; r < NR; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int k = 0; k < nd2; ++k) {
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(pf[0] + k), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(pf[1] + k), _MM_HINT_T1);
    }
    const __m512bh k0 = (__m512bh)_mm512_load_si512(K0 + k), k1 = (__m512bh)_mm512_load_si512(K1 + k);
    for (int r = 0; r < NR; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(qd[r][k]);
      a[r][0] = _mm512_dpbf16_ps(a[r][0], qb, k0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], qb, k1);
    }
  }
  for (int r = 0; r < NR; ++r) { s[2 * r] = a[r][0]; s[2 * r + 1] = a[r][1]; }
}

// acc[r][16 (i0 + i) ...] = acc * corr[r] + P_r @ V over NI accumulators (16 dims each) and np key pairs;
// V[k] points at key pair k's D / 16 vectors
// pf (or nullptr): the two V tiles of a chunk ahead, prefetched one line per line read
template <int NR, int NI>
inline void tile_pv(const __m512i* const* V, int nseg, int i0, int np, const int32_t* const* pp, float* const* acc,
                    const float* corr, const __m512i* const* pf) {
  __m512 a[NR][NI];
  for (int r = 0; r < NR; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
    for (int i = 0; i < NI; ++i) a[r][i] = _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * (i0 + i)), c);
  }
  for (int k = 0; k < np; ++k) {
    if (pf)
      for (int i = 0; i < NI; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(pf[k / 8] + (k % 8) * nseg + i0 + i), _MM_HINT_T1);
    __m512bh v[NI];
    for (int i = 0; i < NI; ++i) v[i] = (__m512bh)_mm512_load_si512(V[k] + i0 + i);
    for (int r = 0; r < NR; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(pp[r][k]);
      for (int i = 0; i < NI; ++i) a[r][i] = _mm512_dpbf16_ps(a[r][i], pb, v[i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NI; ++i) _mm512_store_ps(acc[r] + 16 * (i0 + i), a[r][i]);
}

template <int NR>
inline void tile_pv_rows(const __m512i* const* V, int nseg, int np, const int32_t* const* pp, float* const* acc,
                         const float* corr, const __m512i* const* pf) {
  int i0 = 0;
  for (; i0 + 4 <= nseg; i0 += 4) tile_pv<NR, 4>(V, nseg, i0, np, pp, acc, corr, pf);
  if (i0 < nseg) tile_pv<NR, 2>(V, nseg, i0, np, pp, acc, corr, pf);   // nseg is even (D % 32 == 0)
}

// online softmax of one row over the chunk's raw scores (s0: keys 0-15, s1: 16-31), keys [lo, nv) visible:
// updates the running max m and sum l, sets the rescale factor corr and the bf16 probability pairs pp
inline void softmax_row(__m512 s0, __m512 s1, int64_t lo, int64_t nv, float scale, float softcap, float& m,
                        float& l, float& corr, int32_t* pp) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
  const uint32_t seen = (nv >= 32 ? 0xffffffffu : (1u << nv) - 1) & (0xffffffffu << lo);   // lo < nv <= 32
  const __mmask16 m0 = __mmask16(seen), m1 = __mmask16(seen >> 16);
  s0 = _mm512_mask_blend_ps(m0, neg_inf, _mm512_mul_ps(s0, vscale));
  s1 = _mm512_mask_blend_ps(m1, neg_inf, _mm512_mul_ps(s1, vscale));
  if (softcap > 0.f) {
    alignas(64) float s[32];
    _mm512_store_ps(s, s0);
    _mm512_store_ps(s + 16, s1);
    soft_cap(s, lo, nv, softcap);
    s0 = _mm512_load_ps(s);
    s1 = _mm512_load_ps(s + 16);
  }
  const float mnew = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
  const __m512 vm = _mm512_set1_ps(mnew);
  const __m512 z0 = _mm512_maskz_mov_ps(m0, exp512(_mm512_sub_ps(s0, vm)));
  const __m512 z1 = _mm512_maskz_mov_ps(m1, exp512(_mm512_sub_ps(s1, vm)));
  corr = std::exp(m - mnew);
  l = l * corr + _mm512_reduce_add_ps(_mm512_add_ps(z0, z1));
  m = mnew;
  _mm512_store_si512(pp, (__m512i)_mm512_cvtne2ps_pbh(z1, z0));
}

// One work item over the kernel layout: sequence b, kv heads [g0, g0 + ng), query tokens [t0, t0 + nt). Rows are
// kv-head-major (kv head, token, q head of that kv head), so each kv head's rows are one range whose causal
// limits grow.
// a row's output from its accumulator and sum (one compiled copy: an item's rows and the second pass's round alike)
__attribute__((noinline)) void store_row_tiled(uint16_t* dst, const float* acc, float l, int64_t D) {
  const __m512 inv = _mm512_set1_ps(1.f / l);
  for (int64_t d = 0; d < D; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + d), inv)));
}

void attend_item_tiled(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc, uint16_t* out,
                       const int32_t* table, int64_t ctx_len, int64_t q_len, int64_t q_row0, int64_t t0, int64_t nt,
                       int64_t g0, int64_t ng, int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale,
                       int64_t window, float softcap, const Segments& sg) {
  const int64_t G = H / Hkv, RH = nt * G, R = ng * RH;   // RH: rows per kv head
  const int nd2 = int(D / 2), nseg = int(D / 16);
  const int64_t tile = 16 * D;   // elements of one K (or V) tile
  alignas(64) float acc[MAX_ROWS * MAX_D];
  RowFolds folds;
  int64_t tok[MAX_ROWS], head[MAX_ROWS];
  alignas(64) int32_t pp[MAX_ROWS][16];
  alignas(64) __m512i vlast[MAX_D / 16];   // a last key pair whose second key lies past the end, that key zeroed
  float m[MAX_ROWS], l[MAX_ROWS], corr[MAX_ROWS];
  const int32_t* qd[MAX_ROWS];
  const int32_t* ppr[MAX_ROWS];
  float* accr[MAX_ROWS];
  int64_t limit[MAX_ROWS], first[MAX_ROWS], hrow[MAX_ROWS];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + (r % RH) / G, h = (g0 + r / RH) * G + r % G;
    tok[r] = t;
    head[r] = h;
    hrow[r] = (q_row0 + t) * H + h;
    qd[r] = reinterpret_cast<const int32_t*>(q + (q_row0 + t) * qs + h * D);
    ppr[r] = pp[r];
    accr[r] = acc + r * D;
    std::memset(accr[r], 0, D * sizeof(float));
    m[r] = -INFINITY; l[r] = 0.f;
    limit[r] = ctx_len - q_len + t;
    first[r] = window_first(limit[r], window);
    folds.init(r, first[r], limit[r], sg, D);
  }
  const int64_t end = std::min(limit[RH - 1] + 1, sg.hi), start = std::max(chunk_start(first[0], bs), sg.lo);
  // per kv head: rows before r0 have seen all their keys, rows from r1 on have not reached their first
  int64_t r0[MAX_ROWS], r1[MAX_ROWS];
  for (int64_t gi = 0; gi < ng; ++gi) r0[gi] = r1[gi] = gi * RH;
  static_assert(TCH == KC, "the tiled kernel's chunks are on chunk_start's grid");
  for (int64_t p = start; p < end; p += TCH) {
    if (p % SEG == 0 && p > start)
      for (int64_t r = 0; r < R; ++r) folds.end_segment(sg, r, p, tok[r], head[r], H, accr[r], m[r], l[r], D);
    const int64_t n = std::min<int64_t>(TCH, end - p);
    // the chunk's two groups; a second group past the end reuses the first (its keys are masked out)
    const int64_t base0 = tile_offset(table, p, bs, Hkv, D, g0);
    const int64_t base1 = n > 16 ? tile_offset(table, p + 16, bs, Hkv, D, g0) : base0;
    // the tiles PF_CHUNKS ahead go to L2 one line per line the chunk reads: a burst of prefetches at the start of
    // each chunk overflows the miss queues (benchmarks/LOG.md)
    const int64_t ahead = p + PF_CHUNKS * TCH;
    const bool prefetch = ahead < end;
    const int64_t pf0 = prefetch ? tile_offset(table, ahead, bs, Hkv, D, g0) : 0;
    const int64_t pf1 = prefetch && ahead + 16 < end ? tile_offset(table, ahead + 16, bs, Hkv, D, g0) : pf0;
    const int np = int((n + 1) / 2);
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t rall = (gi + 1) * RH;   // a kv head's rows: their limits and firsts grow
      while (r0[gi] < rall && limit[r0[gi]] < p) ++r0[gi];
      while (r1[gi] < rall && first[r1[gi]] < p + n) ++r1[gi];
      const int64_t rend = r1[gi];
      if (r0[gi] >= rend) continue;
      const __m512i* K0 = reinterpret_cast<const __m512i*>(kc + base0 + gi * tile);
      const __m512i* K1 = reinterpret_cast<const __m512i*>(kc + base1 + gi * tile);
      const __m512i* V[TCH / 2];
      for (int k = 0; k < np; ++k)
        V[k] = reinterpret_cast<const __m512i*>(vc + (k < 8 ? base0 : base1) + gi * tile) + (k % 8) * nseg;
      if (n % 2) {   // P of the missing key is 0, but 0 * (stale inf or NaN) is not: zero that key's V
        for (int i = 0; i < nseg; ++i) vlast[i] = _mm512_maskz_mov_epi16(0x55555555u, _mm512_load_si512(V[np - 1] + i));
        V[np - 1] = vlast;
      }
      const __m512i* pfk[2] = {reinterpret_cast<const __m512i*>(kc + pf0 + gi * tile),
                               reinterpret_cast<const __m512i*>(kc + pf1 + gi * tile)};
      const __m512i* pfv[2] = {reinterpret_cast<const __m512i*>(vc + pf0 + gi * tile),
                               reinterpret_cast<const __m512i*>(vc + pf1 + gi * tile)};
      for (int64_t rb = r0[gi]; rb < rend; rb += 4) {
        const int nr = int(std::min<int64_t>(4, rend - rb));
        const __m512i* const* pf = prefetch && rb == r0[gi] ? pfk : nullptr;   // the first row block prefetches
        __m512 s[8];
        switch (nr) {
          case 4: tile_scores<4>(K0, K1, nd2, qd + rb, s, pf); break;
          case 3: tile_scores<3>(K0, K1, nd2, qd + rb, s, pf); break;
          case 2: tile_scores<2>(K0, K1, nd2, qd + rb, s, pf); break;
          default: tile_scores<1>(K0, K1, nd2, qd + rb, s, pf); break;
        }
        for (int i = 0; i < nr; ++i) {
          const int64_t r = rb + i, nv = std::min<int64_t>(n, limit[r] - p + 1);   // >= 1 for rows from r0
          softmax_row(s[2 * i], s[2 * i + 1], std::max<int64_t>(0, first[r] - p), nv, scale, softcap, m[r], l[r],
                      corr[r], pp[r]);   // lo < nv for rows before r1
        }
      }
      for (int64_t rb = r0[gi]; rb < rend; rb += 4) {
        const int nr = int(std::min<int64_t>(4, rend - rb));
        const __m512i* const* pf = prefetch && rb == r0[gi] ? pfv : nullptr;
        switch (nr) {
          case 4: tile_pv_rows<4>(V, nseg, np, ppr + rb, accr + rb, corr + rb, pf); break;
          case 3: tile_pv_rows<3>(V, nseg, np, ppr + rb, accr + rb, corr + rb, pf); break;
          case 2: tile_pv_rows<2>(V, nseg, np, ppr + rb, accr + rb, corr + rb, pf); break;
          default: tile_pv_rows<1>(V, nseg, np, ppr + rb, accr + rb, corr + rb, pf); break;
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    uint16_t* dst = out + hrow[r] * D;
    folds.finish(sg, r, first[r], start, end, tok[r], head[r], H, accr[r], m[r], l[r], D,
                 [&](const float* a, float sum) { store_row_tiled(dst, a, sum, D); });
  }
}
#endif

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
