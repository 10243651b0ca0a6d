// LoRA adapters over any linear: y += (x A^T) B^T for the rows of a step that chose an adapter, batched across
// adapters (rows grouped by slot, each adapter's weights read once per call; rows of the base model cost
// nothing). The per-layer modules and the fused layer stack call this one function (kvserve/lora/layers.py).
#include "common.h"

// One linear's adapter table, as int64s (kvserve/lora/layers.py LoRAWeights.desc):
// [slots, shards, max rank R, K, N, A, Bt, ranks, offset_0 .. offset_shards]
//   A float32 [slots, shards, R, K]; Bt float32 [slots, R, N]: B transposed, the adapter's scale folded in;
//   ranks int32 [slots, shards]: the rank of a slot's adapter on a shard, 0 where it leaves the shard alone;
//   shard s owns the output columns [offset_s, offset_s+1) (q|k|v, gate|up: one shard per projection).
enum { D_SLOTS, D_SHARDS, D_RANK, D_K, D_N, D_A, D_BT, D_RANKS, D_OFFSETS };

namespace {

// sum a[k] b[k] in 16 fixed lanes: the same order whatever the addresses, so every caller gets the same bits
inline float lora_dot(const float* a, const float* b, int64_t K) {
  float acc[16] = {0.f};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[k + l] * b[k + l];
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += acc[l];
  for (; k < K; ++k) s += a[k] * b[k];
  return s;
}

constexpr int64_t LORA_COLS = 64;   // output columns per work item of the expand

template <typename T>
void lora_add(const int64_t* desc, const T* x, int64_t xs, T* y, int64_t ys, int64_t M, const int32_t* row_slot) {
  const int64_t S = desc[D_SLOTS], NS = desc[D_SHARDS], R = desc[D_RANK], K = desc[D_K], N = desc[D_N];
  const float* A = reinterpret_cast<const float*>(desc[D_A]);
  const float* Bt = reinterpret_cast<const float*>(desc[D_BT]);
  const int32_t* ranks = reinterpret_cast<const int32_t*>(desc[D_RANKS]);
  const int64_t* off = desc + D_OFFSETS;
  // rows grouped by slot, in row order within a slot (a counting sort)
  std::vector<int64_t> first(S + 1, 0);
  for (int64_t m = 0; m < M; ++m)
    if (row_slot[m] >= 0 && row_slot[m] < S) ++first[row_slot[m] + 1];
  for (int64_t s = 0; s < S; ++s) first[s + 1] += first[s];
  if (first[S] == 0) return;
  std::vector<int64_t> rows(first[S]), cursor(first.begin(), first.end() - 1);
  for (int64_t m = 0; m < M; ++m)
    if (row_slot[m] >= 0 && row_slot[m] < S) rows[cursor[row_slot[m]]++] = m;
  // the expand's work items: (shard, first column) pairs
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t sh = 0; sh < NS; ++sh)
    for (int64_t n = off[sh]; n < off[sh + 1]; n += LORA_COLS) items.emplace_back(sh, n);
  const int64_t num_items = int64_t(items.size());
  std::vector<float> xf, t;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t m0 = first[s], num = first[s + 1] - m0;
    const int32_t* rk = ranks + s * NS;
    if (num == 0 || std::all_of(rk, rk + NS, [](int32_t r) { return r == 0; })) continue;
    xf.resize(num * K);
    for (int64_t i = 0; i < num; ++i)
      for (int64_t k = 0; k < K; ++k) xf[i * K + k] = load(x + rows[m0 + i] * xs, k);
    // shrink: t[i, sh, j] = x_i . A[s, sh, j]
    t.assign(num * NS * R, 0.f);
    const int64_t num_dots = num * NS * R;
    const float* As = A + s * NS * R * K;
    #pragma omp parallel for schedule(static) if (num_dots * K > (1 << 13))
    for (int64_t d = 0; d < num_dots; ++d) {
      const int64_t i = d / (NS * R), sh = d / R % NS, j = d % R;
      if (j < rk[sh]) t[d] = lora_dot(xf.data() + i * K, As + (sh * R + j) * K, K);
    }
    // expand: y[row, n] = y[row, n] + sum_j t[i, sh, j] Bt[s, j, n], summed in float32 and rounded once
    const float* Bs = Bt + s * R * N;
    #pragma omp parallel for schedule(static) if (num * N * R > (1 << 13))
    for (int64_t it = 0; it < num_items; ++it) {
      const int64_t sh = items[it].first, n0 = items[it].second, cols = std::min(LORA_COLS, off[sh + 1] - n0);
      if (rk[sh] == 0) continue;   // a shard the adapter leaves alone
      float acc[LORA_COLS];
      for (int64_t i = 0; i < num; ++i) {
        std::fill(acc, acc + LORA_COLS, 0.f);
        const float* ti = t.data() + (i * NS + sh) * R;
        for (int64_t j = 0; j < rk[sh]; ++j) {
          const float* b = Bs + j * N + n0;
          for (int64_t c = 0; c < cols; ++c) acc[c] += ti[j] * b[c];
        }
        T* yr = y + rows[m0 + i] * ys + n0;
        for (int64_t c = 0; c < cols; ++c) store(yr, c, load(yr, c) + acc[c]);
      }
    }
  }
}

}  // namespace

extern "C" {
// y[M, N] += the LoRA delta of the rows whose row_slot is a slot (-1: the base model's rows, untouched);
// x [M, K] (row stride xs) and y (row stride ys) float32, or bf16 when x_bf16. Returns 0.
int kvserve_lora_add(const int64_t* desc, const void* x, int64_t xs, int64_t x_bf16, void* y, int64_t ys, int64_t M,
                     const int32_t* row_slot) {
  if (x_bf16)
    lora_add(desc, static_cast<const uint16_t*>(x), xs, static_cast<uint16_t*>(y), ys, M, row_slot);
  else
    lora_add(desc, static_cast<const float*>(x), xs, static_cast<float*>(y), ys, M, row_slot);
  return 0;
}
}
