// A whole stack of Llama-family decoder layers (no biases, no q/k norm) in bf16 in one call: the same kernels,
// in the same order, on the same buffers as the per-op Python path (kvserve/model/llama.py), so its results are
// bit-identical; what it removes is the ~10 Python calls per layer (tensor allocations, ctypes argument
// conversion, module dispatch), which cost a single-stream decode step more than its attention does.
#include "common.h"

extern "C" {
void kvserve_rmsnorm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* w, uint16_t* out, int64_t T, int64_t N,
                     float eps);
void kvserve_rope_bf16(uint16_t* x, int64_t xs, const uint16_t* cos, const uint16_t* sin, int64_t T, int64_t nh,
                  int64_t D);
void kvserve_silu_mul_bf16(const uint16_t* x, int64_t xs, uint16_t* out, int64_t T, int64_t I);
void kvserve_packed_matmul_bf16(const uint16_t* x, int64_t xs, const uint16_t* wp, uint16_t* y, int64_t ys, int64_t M,
                           int64_t N, int64_t K);
void kvserve_paged_attention_bf16(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc, uint16_t* out,
                             const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                             const int32_t* query_start, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                             float scale, int64_t tiled, int64_t window, float softcap);
void kvserve_write_kv(const char* k, int64_t ks, const char* v, int64_t vs, const int64_t* slots, int64_t T, int64_t Hkv,
                 int64_t D, int64_t es, int64_t bs, int64_t tiled, char* kc, char* vc);
void kvserve_paged_attention_fp8(const void* q, int64_t qs, const uint8_t* kc, const uint8_t* vc, void* out,
                                 const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                                 const int32_t* query_start, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                                 float scale, int64_t q_bf16, int64_t fmt, const float* kv_scales, int64_t window,
                                 float softcap);
void kvserve_write_kv_fp8(const void* k, int64_t ks, const void* v, int64_t vs, const int64_t* slots, int64_t T,
                          int64_t Hkv, int64_t D, int64_t x_bf16, int64_t fmt, const float* kv_scales, uint8_t* kc,
                          uint8_t* vc);
int kvserve_quant_matmul(const int64_t* desc, const void* x, int64_t xs, int64_t x_bf16, void* y, int64_t ys,
                         int64_t M, int64_t K);
int kvserve_lora_add(const int64_t* desc, const void* x, int64_t xs, int64_t x_bf16, void* y, int64_t ys, int64_t M,
                     const int32_t* row_slot);

// What one layer reads, as raw pointers (kvserve/model/fused.py fills one row per layer):
// input norm weight, packed qkv, packed o_proj, post-attention norm weight, packed gate|up, packed down,
// K pool, V pool, a bit mask of the linears that are quantized (Q_BIT: their pointer is then a quantized
// weight's descriptor for kvserve_quant_matmul, the function the modules' linears call), the layer's FP8 KV
// scales (float32 [K's, V's], read when the pools are FP8), the q|k|v bias (bf16, Qwen2) or 0, and the layer's
// LoRA tables or 0 (int64 [4]: the adapter table of qkv, o, gate|up, down for kvserve_lora_add, each or 0).
enum { L_IN_NORM, L_QKV, L_O, L_POST_NORM, L_GATE_UP, L_DOWN, L_K_CACHE, L_V_CACHE, L_QUANT, L_KV_SCALES, L_QKV_BIAS,
       L_LORA, L_PTRS };

// the bit of each linear in L_QUANT, by slot: qkv 1, o 2, gate|up 4, down 8
constexpr int64_t Q_BIT[L_PTRS] = {0, 1, 2, 0, 4, 8, 0, 0, 0, 0, 0, 0};

// y[T, N] += b[N] in bf16, rounded once from the float32 sum: torch's `y + bias` in the modules
static inline void add_bias_bf16(uint16_t* y, int64_t ys, const uint16_t* b, int64_t T, int64_t N) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) y[t * ys + n] = f32_to_bf16(bf16_to_f32(y[t * ys + n]) + bf16_to_f32(b[n]));
}

// y[M, N] = x[M, K] @ W^T by the linear method of layer row p's linear in slot `slot`; 0, or -1 where a quantized
// weight's descriptor names a format or shape kvserve_quant_matmul does not take
static inline int linear(const int64_t* p, int slot, const uint16_t* x, int64_t xs, uint16_t* y, int64_t ys,
                         int64_t M, int64_t N, int64_t K) {
  if (p[L_QUANT] & Q_BIT[slot])
    return kvserve_quant_matmul(reinterpret_cast<const int64_t*>(p[slot]), x, xs, 1, y, ys, M, K);
  kvserve_packed_matmul_bf16(x, xs, reinterpret_cast<const uint16_t*>(p[slot]), y, ys, M, N, K);
  return 0;
}

// y += the LoRA delta of layer row p's linear number i (0 qkv, 1 o, 2 gate|up, 3 down) for the rows that chose
// an adapter (lora_rows: each row's adapter slot or -1; null when no row of the step has one)
static inline void lora(const int64_t* p, int i, const int32_t* lora_rows, const uint16_t* x, int64_t xs, uint16_t* y,
                        int64_t ys, int64_t M) {
  if (!lora_rows || !p[L_LORA]) return;
  const int64_t desc = reinterpret_cast<const int64_t*>(p[L_LORA])[i];
  if (desc) kvserve_lora_add(reinterpret_cast<const int64_t*>(desc), x, xs, 1, y, ys, M, lora_rows);
}

// writes the step's K/V into layer row p's pools and attends over them, as the attention backend does for the
// modules: bf16 pools (TILED: the kernel layout), or FP8 pools of format KV_FMT (kvserve/attention/fp8.py)
static inline void attend(const int64_t* p, const uint16_t* qkv, int64_t nqkv, uint16_t* attn, const int64_t* slots,
                          const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                          const int32_t* query_start, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t D,
                          int64_t BS, int64_t TILED, int64_t KV_FMT, float scale) {
  const uint16_t* k = qkv + NH * D;
  const uint16_t* v = k + NKV * D;
  if (KV_FMT) {
    const float* sc = reinterpret_cast<const float*>(p[L_KV_SCALES]);
    uint8_t* kc = reinterpret_cast<uint8_t*>(p[L_K_CACHE]);
    uint8_t* vc = reinterpret_cast<uint8_t*>(p[L_V_CACHE]);
    kvserve_write_kv_fp8(k, nqkv, v, nqkv, slots, T, NKV, D, 1, KV_FMT, sc, kc, vc);
    kvserve_paged_attention_fp8(qkv, nqkv, kc, vc, attn, tables, table_stride, seq_lens, query_start, B, NH, NKV, D,
                                BS, scale, 1, KV_FMT, sc, 0, 0.f);   // no window or cap: the stack refuses them
    return;
  }
  kvserve_write_kv(reinterpret_cast<const char*>(k), nqkv, reinterpret_cast<const char*>(v), nqkv, slots, T, NKV, D,
                   2, BS, TILED, reinterpret_cast<char*>(p[L_K_CACHE]), reinterpret_cast<char*>(p[L_V_CACHE]));
  kvserve_paged_attention_bf16(qkv, nqkv, reinterpret_cast<const uint16_t*>(p[L_K_CACHE]),
                               reinterpret_cast<const uint16_t*>(p[L_V_CACHE]), attn, tables, table_stride, seq_lens,
                               query_start, B, NH, NKV, D, BS, scale, TILED, 0, 0.f);
}

// dims: T tokens, H hidden, NH / NKV heads, D head dim, I intermediate size, BS block size, TILED pool layout,
// KV_FMT the pools' FP8 format (0: bf16 pools).
// Tensor parallelism: sums a row-parallel linear's partial outputs [T, H] over the ranks, in place (TPComm).
typedef void (*AllReduceFn)(uint16_t* y, int64_t numel);

// residual [T, H]: the embedding output on entry (layer 0 normalizes it without an add), the residual stream on
// return. hidden [T, H]: the last layer's MLP output on return. scratch: T * (H + (NH + 2 NKV) D + NH D + 3 I) bf16.
// lora_rows [T]: each row's LoRA adapter slot (-1: none), or null. Each linear is base (+ bias) + LoRA, as in the
// modules (Linear.forward). Returns 0, or -1 - l where a linear of layer l refused its weights (and stops there).
static int layers_rows(uint16_t* hidden, uint16_t* residual, const int64_t* layer_ptrs,
                       int64_t L, const uint16_t* cos, const uint16_t* sin, const int64_t* slots,
                       const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                       const int32_t* query_start, int64_t B, int64_t T, int64_t H, int64_t NH, int64_t NKV,
                       int64_t D, int64_t I, int64_t BS, int64_t TILED, int64_t KV_FMT, float eps, float scale,
                       uint16_t* scratch, const int32_t* lora_rows, AllReduceFn all_reduce) {
  const int64_t nqkv = (NH + 2 * NKV) * D;
  uint16_t* normed = scratch;
  uint16_t* qkv = normed + T * H;
  uint16_t* attn = qkv + T * nqkv;
  uint16_t* gate_up = attn + T * NH * D;
  uint16_t* act = gate_up + T * 2 * I;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* p = layer_ptrs + l * L_PTRS;
    auto w = [p](int i) { return reinterpret_cast<const uint16_t*>(p[i]); };
    if (l == 0)
      kvserve_rmsnorm_bf16(residual, nullptr, w(L_IN_NORM), normed, T, H, eps);
    else
      kvserve_rmsnorm_bf16(hidden, residual, w(L_IN_NORM), normed, T, H, eps);
    const int failed = int(-1 - l);
    if (linear(p, L_QKV, normed, H, qkv, nqkv, T, nqkv, H)) return failed;
    if (p[L_QKV_BIAS]) add_bias_bf16(qkv, nqkv, w(L_QKV_BIAS), T, nqkv);
    lora(p, 0, lora_rows, normed, H, qkv, nqkv, T);
    kvserve_rope_bf16(qkv, nqkv, cos, sin, T, NH + NKV, D);
    attend(p, qkv, nqkv, attn, slots, tables, table_stride, seq_lens, query_start, B, T, NH, NKV, D, BS, TILED,
           KV_FMT, scale);
    if (linear(p, L_O, attn, NH * D, hidden, H, T, H, NH * D)) return failed;
    lora(p, 1, lora_rows, attn, NH * D, hidden, H, T);
    if (all_reduce) all_reduce(hidden, T * H);   // tensor parallelism: o is row-parallel (Linear.tp)
    kvserve_rmsnorm_bf16(hidden, residual, w(L_POST_NORM), normed, T, H, eps);
    if (linear(p, L_GATE_UP, normed, H, gate_up, 2 * I, T, 2 * I, H)) return failed;
    lora(p, 2, lora_rows, normed, H, gate_up, 2 * I, T);
    kvserve_silu_mul_bf16(gate_up, 2 * I, act, T, I);
    if (linear(p, L_DOWN, act, I, hidden, H, T, H, I)) return failed;
    lora(p, 3, lora_rows, act, I, hidden, H, T);
    if (all_reduce) all_reduce(hidden, T * H);   // and so is down
  }
  return 0;
}

// Decode-only steps of at least this many sequences split the batch between the threads instead of every
// kernel: each thread runs the whole stack on its own sequences, alone (the kernels' parallel loops inside run
// on one thread). No barrier per kernel, and while one thread's attention waits on memory the other's matmuls
// compute. The matmuls of ~12+ rows per thread stay compute-bound; below, each thread streaming all the weights
// costs more than it saves (measured by batch size on 2 cores, docs/benchmarks.md).
constexpr int64_t SPLIT_MIN_SEQS = 24;

// Returns 0, or -1 - l where a linear of layer l refused its weights (layers_rows)
int kvserve_llama_layers_bf16(uint16_t* hidden, uint16_t* residual, const int64_t* layer_ptrs,
                          int64_t L, const uint16_t* cos, const uint16_t* sin, const int64_t* slots,
                          const int32_t* tables, int64_t table_stride, const int32_t* seq_lens,
                          const int32_t* query_start, int64_t B, int64_t T, int64_t H, int64_t NH, int64_t NKV,
                          int64_t D, int64_t I, int64_t BS, int64_t TILED, int64_t KV_FMT, float eps, float scale,
                          uint16_t* scratch, int64_t split, const int32_t* lora_rows, AllReduceFn all_reduce) {
  const int nt = omp_get_max_threads();
  bool decode_only = T == B;   // one query token per sequence: sequence b is row b
  for (int64_t b = 0; decode_only && b < B; ++b) decode_only = query_start[b + 1] - query_start[b] == 1;
  if (!split || all_reduce || !decode_only || B < SPLIT_MIN_SEQS * nt / 2 || nt < 2 || omp_in_parallel()) {
    return layers_rows(hidden, residual, layer_ptrs, L, cos, sin, slots, tables, table_stride, seq_lens, query_start,
                       B, T, H, NH, NKV, D, I, BS, TILED, KV_FMT, eps, scale, scratch, lora_rows, all_reduce);
  }
  // Shares balanced on the estimated time of each sequence on one core: its row through the matmuls (~200
  // GFLOP/s) plus its attention reading K/V (~23.5 GB/s), i.e. ~0.12 bytes of K/V per matmul FLOP.
  const int64_t nqkv = (NH + 2 * NKV) * D, per_row = H + nqkv + NH * D + 3 * I;
  const double row_flops = 2.0 * (H * nqkv + NH * D * H + H * 2 * I + I * H), kv_bytes = 4.0 * NKV * D;
  std::vector<double> cum(B + 1, 0.);
  for (int64_t b = 0; b < B; ++b) cum[b + 1] = cum[b] + 0.12 * row_flops + kv_bytes * seq_lens[b];
  int failed = 0;
  #pragma omp parallel num_threads(nt) reduction(min : failed)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    auto cut = [&](int i) -> int64_t {
      return i >= n ? B : std::lower_bound(cum.begin(), cum.end(), cum[B] * i / n) - cum.begin();
    };
    const int64_t b0 = cut(tid), b1 = cut(tid + 1);
    if (b1 > b0) {
      std::vector<int32_t> qs(b1 - b0 + 1);
      for (int64_t i = 0; i <= b1 - b0; ++i) qs[i] = int32_t(i);
      failed = layers_rows(hidden + b0 * H, residual + b0 * H, layer_ptrs, L, cos + b0 * D, sin + b0 * D, slots + b0,
                           tables + b0 * table_stride, table_stride, seq_lens + b0, qs.data(), b1 - b0, b1 - b0, H,
                           NH, NKV, D, I, BS, TILED, KV_FMT, eps, scale, scratch + b0 * per_row,
                           lora_rows ? lora_rows + b0 : nullptr, nullptr);
    }
  }
  return failed;
}
}
