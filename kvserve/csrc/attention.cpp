// Paged attention straight from the KV blocks, and the KV cache write, in four files of the one translation unit
// (kvserve/kernels.py's _FILES, in this order): this one (the constants, the key segments and their folds, the
// portable kernel), attention_avx2.cpp, attention_avx512.cpp (AVX-512 over the standard layout [blocks, bs, Hkv,
// D], and the bf16 tiles vdpbf16ps takes), attention_dispatch.cpp (the work items and the entry points).
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

}  // namespace
