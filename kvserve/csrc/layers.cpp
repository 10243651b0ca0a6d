// A stack of decoder layers in bf16 in one call, executing what each layer declares (kvserve/model/decoder.py
// LayerSpec, described for this file by kvserve/model/fused.py): pre-norm or sandwich norms, q/k norm, RoPE from
// one of several tables, full or sliding-window attention with an optional soft-cap, a SiLU or GELU-tanh gated MLP
// or a mixture of experts (moe.cpp).
// Every op is the kernel the per-layer modules call, in their order, on the same buffers, so the results are
// bit-identical; what it removes is the ~10 Python calls per layer (tensor allocations, ctypes argument conversion,
// module dispatch).
#include "common.h"

#include <cstddef>

extern "C" {
void kvserve_rmsnorm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* w, uint16_t* out, int64_t T, int64_t N,
                     float eps);
void kvserve_qk_norm_bf16(uint16_t* x, int64_t xs, const uint16_t* qw, const uint16_t* kw, int64_t T, int64_t nh,
                          int64_t nkv, int64_t D, float eps);
void kvserve_rope_bf16(uint16_t* x, int64_t xs, const uint16_t* cos, const uint16_t* sin, int64_t T, int64_t nh,
                  int64_t D);
void kvserve_silu_mul_bf16(const uint16_t* x, int64_t xs, uint16_t* out, int64_t T, int64_t I);
void kvserve_gelu_tanh_mul_bf16(const uint16_t* x, int64_t xs, uint16_t* out, int64_t T, int64_t I);
void kvserve_packed_matmul_f16(const uint16_t* x, int64_t xs, const uint16_t* wp, uint16_t* y, int64_t ys, int64_t M,
                               int64_t N, int64_t K);
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

struct MoEDesc;   // moe.cpp: an MoE MLP
int kvserve_moe_bf16(const MoEDesc* desc, const uint16_t* x, int64_t T, int64_t H, uint16_t* out);

// Tensor parallelism: sums a row-parallel linear's partial outputs [T, H] over the ranks, in place (TPComm).
typedef void (*AllReduceFn)(uint16_t* y, int64_t numel);

constexpr int MAX_ROPES = 4;
enum Activation : int64_t { ACT_SILU = 0, ACT_GELU_TANH = 1 };

// One linear as its method describes it (kvserve/model/layers.py LinearMethod.kernel_weight).
struct LinearDesc {
  const void* weight;     // packed bf16 or fp16 weight (kvserve_packed_matmul_*), or a quantized weight's descriptor
  int64_t quantized;      // 0: packed bf16; 1: weight is a kvserve_quant_matmul descriptor; 2: packed fp16
  const uint16_t* bias;   // bf16 [out], or null
  const int64_t* lora;    // the adapter table for kvserve_lora_add, or null
  int64_t row_parallel;   // tensor parallelism: the ranks' partial outputs are summed (then the bias added)
};

// One decoder layer as declared (kvserve/model/decoder.py LayerSpec) and bound (weights, pools).
struct LayerDesc {
  const uint16_t* input_norm;
  const uint16_t* post_attn_norm;   // pre-norm layers: the MLP's norm; sandwich: the norm of attention's output
  const uint16_t* pre_ffn_norm;     // sandwich norms (Gemma), else null
  const uint16_t* post_ffn_norm;
  const uint16_t* q_norm;           // per-head q/k norm weights [D], or null
  const uint16_t* k_norm;
  LinearDesc qkv, o, gate_up, down;
  const MoEDesc* moe;               // a mixture-of-experts MLP (then gate_up and down are unused), or null
  void* k_cache;
  void* v_cache;
  const float* kv_scales;           // FP8 pools: float32 [K's, V's]
  int64_t rope;                     // which RoPE table (StackArgs.cos/sin)
  int64_t kv_group;                 // which block tables (StackArgs.slots/tables, < num_kv_groups)
  int64_t window;                   // sliding window in tokens, 0: none
  int64_t activation;               // Activation
  float scale;
  float softcap;                    // 0: none
};

// One call: the step's buffers, metadata and dimensions. residual [T, H]: the embedding output on entry (layer 0
// normalizes it without an add), the residual stream on return; hidden [T, H]: the last layer's output on return.
// scratch: T * scratch_per_token(...) bf16. lora_rows [T]: each row's adapter slot (-1: none), or null.
struct StackArgs {
  uint16_t* hidden;
  uint16_t* residual;
  uint16_t* scratch;
  const LayerDesc* layers;
  int64_t num_layers;
  const uint16_t* cos[MAX_ROPES];
  const uint16_t* sin[MAX_ROPES];
  const int64_t** slots;   // per KV group (kvserve/core/kv_groups.py): its slot mapping, block table, row stride
  const int32_t** tables;
  int64_t* table_stride;
  int64_t num_kv_groups;
  const int32_t* seq_lens;
  const int32_t* query_start;
  int64_t num_seqs, num_tokens;
  int64_t hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, block_size, tiled, kv_format;
  float eps;
  int64_t split;   // decode-only steps of SPLIT_MIN_SEQS+ sequences may share the batch out between the threads
  const int32_t* lora_rows;
  AllReduceFn all_reduce;
};

// the sizes and offsets of the structs above, for kvserve/model/fused.py's test that its ctypes mirror matches
#define KV_FIELD(S, f) offsetof(S, f)
int64_t kvserve_stack_layout(int64_t* out) {
  const int64_t v[] = {
      sizeof(LinearDesc), KV_FIELD(LinearDesc, bias), KV_FIELD(LinearDesc, row_parallel),
      sizeof(LayerDesc), KV_FIELD(LayerDesc, qkv), KV_FIELD(LayerDesc, down), KV_FIELD(LayerDesc, moe),
      KV_FIELD(LayerDesc, kv_scales),
      KV_FIELD(LayerDesc, activation), KV_FIELD(LayerDesc, softcap),
      sizeof(StackArgs), KV_FIELD(StackArgs, cos), KV_FIELD(StackArgs, num_kv_groups), KV_FIELD(StackArgs, num_tokens),
      KV_FIELD(StackArgs, kv_format), KV_FIELD(StackArgs, eps), KV_FIELD(StackArgs, split),
      KV_FIELD(StackArgs, all_reduce)};
  const int64_t n = sizeof(v) / sizeof(v[0]);
  if (out)
    for (int64_t i = 0; i < n; ++i) out[i] = v[i];
  return n;
}

// bf16 values per token of StackArgs.scratch
int64_t kvserve_stack_scratch_per_token(int64_t H, int64_t NH, int64_t NKV, int64_t D, int64_t I) {
  return 2 * H + (NH + 2 * NKV) * D + NH * D + 3 * I;
}

// y[T, N] += b[N] in bf16, rounded once from the float32 sum: torch's `y + bias` in the modules
static inline void add_bias_bf16(uint16_t* y, int64_t ys, const uint16_t* b, int64_t T, int64_t N) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) y[t * ys + n] = f32_to_bf16(bf16_to_f32(y[t * ys + n]) + bf16_to_f32(b[n]));
}

// y[M, N] = x[M, K] @ W^T by the linear's method: the packed bf16 or fp16 matmul, or the quantized one; 0, or -1
// where a quantized weight's descriptor names a format or shape kvserve_quant_matmul does not take
static inline int base_matmul(const LinearDesc& L, const uint16_t* x, int64_t xs, uint16_t* y, int64_t ys, int64_t M,
                              int64_t N, int64_t K) {
  if (L.quantized == 1)
    return kvserve_quant_matmul(reinterpret_cast<const int64_t*>(L.weight), x, xs, 1, y, ys, M, K) ? -1 : 0;
  if (L.quantized == 2)
    kvserve_packed_matmul_f16(x, xs, reinterpret_cast<const uint16_t*>(L.weight), y, ys, M, N, K);
  else
    kvserve_packed_matmul_bf16(x, xs, reinterpret_cast<const uint16_t*>(L.weight), y, ys, M, N, K);
  return 0;
}

// act[M, I] = activation(gate) * up for gate_up [M, 2 I] (SiLU or GELU-tanh, Activation)
static inline void gated_act(int64_t activation, const uint16_t* gate_up, uint16_t* act, int64_t M, int64_t I) {
  if (activation == ACT_GELU_TANH)
    kvserve_gelu_tanh_mul_bf16(gate_up, 2 * I, act, M, I);
  else
    kvserve_silu_mul_bf16(gate_up, 2 * I, act, M, I);
}

// y[M, N] = x[M, K] @ W^T (+ b) + LoRA, as Linear.forward: base by the linear's method, bias (after the ranks' sum
// where the linear is row-parallel), LoRA delta for the rows that chose an adapter. 0, or -1 where a quantized
// weight's descriptor names a format or shape kvserve_quant_matmul does not take.
static inline int linear(const LinearDesc& L, const StackArgs& a, const uint16_t* x, int64_t xs, uint16_t* y,
                         int64_t ys, int64_t M, int64_t N, int64_t K) {
  if (base_matmul(L, x, xs, y, ys, M, N, K)) return -1;
  const bool reduce = L.row_parallel && a.all_reduce;
  if (L.bias && !reduce) add_bias_bf16(y, ys, L.bias, M, N);
  if (a.lora_rows && L.lora) kvserve_lora_add(L.lora, x, xs, 1, y, ys, M, a.lora_rows);
  if (reduce) {
    a.all_reduce(y, M * N);   // (the stack's row-parallel outputs are whole rows: ys == N)
    if (L.bias) add_bias_bf16(y, ys, L.bias, M, N);
  }
  return 0;
}

// writes the step's K/V into the layer's pools and attends over them, as the attention backend does for the
// modules: bf16 pools (tiled: the kernel layout), or FP8 pools of format kv_format (kvserve/attention/fp8.py)
static inline void attend(const LayerDesc& L, const StackArgs& a, const uint16_t* qkv, int64_t nqkv, uint16_t* out) {
  const int64_t NH = a.num_heads, NKV = a.num_kv_heads, D = a.head_dim, g = L.kv_group;
  const uint16_t* k = qkv + NH * D;
  const uint16_t* v = k + NKV * D;
  if (a.kv_format) {
    uint8_t* kc = reinterpret_cast<uint8_t*>(L.k_cache);
    uint8_t* vc = reinterpret_cast<uint8_t*>(L.v_cache);
    kvserve_write_kv_fp8(k, nqkv, v, nqkv, a.slots[g], a.num_tokens, NKV, D, 1, a.kv_format, L.kv_scales, kc, vc);
    kvserve_paged_attention_fp8(qkv, nqkv, kc, vc, out, a.tables[g], a.table_stride[g], a.seq_lens, a.query_start,
                                a.num_seqs, NH, NKV, D, a.block_size, L.scale, 1, a.kv_format, L.kv_scales,
                                L.window, L.softcap);
    return;
  }
  kvserve_write_kv(reinterpret_cast<const char*>(k), nqkv, reinterpret_cast<const char*>(v), nqkv, a.slots[g],
                   a.num_tokens, NKV, D, 2, a.block_size, a.tiled, reinterpret_cast<char*>(L.k_cache),
                   reinterpret_cast<char*>(L.v_cache));
  kvserve_paged_attention_bf16(qkv, nqkv, reinterpret_cast<const uint16_t*>(L.k_cache),
                               reinterpret_cast<const uint16_t*>(L.v_cache), out, a.tables[g], a.table_stride[g],
                               a.seq_lens, a.query_start, a.num_seqs, NH, NKV, D, a.block_size, L.scale, a.tiled,
                               L.window, L.softcap);
}

// The layers in order, as DecoderLayer.forward runs them. Returns 0, or -1 - l where a linear of layer l refused
// its weights (and stops there).
static int layers_rows(const StackArgs& a) {
  const int64_t T = a.num_tokens, H = a.hidden_size, NH = a.num_heads, NKV = a.num_kv_heads, D = a.head_dim,
                I = a.intermediate_size;
  const int64_t nqkv = (NH + 2 * NKV) * D;
  uint16_t* normed = a.scratch;
  uint16_t* qkv = normed + T * H;
  uint16_t* attn = qkv + T * nqkv;
  uint16_t* gate_up = attn + T * NH * D;
  uint16_t* act = gate_up + T * 2 * I;
  uint16_t* tmp = act + T * I;   // sandwich norms: the normalized attention output
  uint16_t* hidden = a.hidden;
  for (int64_t l = 0; l < a.num_layers; ++l) {
    const LayerDesc& L = a.layers[l];
    const int failed = int(-1 - l);
    kvserve_rmsnorm_bf16(l == 0 ? a.residual : hidden, l == 0 ? nullptr : a.residual, L.input_norm, normed, T, H,
                         a.eps);
    if (linear(L.qkv, a, normed, H, qkv, nqkv, T, nqkv, H)) return failed;
    if (L.q_norm) kvserve_qk_norm_bf16(qkv, nqkv, L.q_norm, L.k_norm, T, NH, NKV, D, a.eps);
    kvserve_rope_bf16(qkv, nqkv, a.cos[L.rope], a.sin[L.rope], T, NH + NKV, D);
    attend(L, a, qkv, nqkv, attn);
    if (linear(L.o, a, attn, NH * D, hidden, H, T, H, NH * D)) return failed;
    if (L.pre_ffn_norm) {   // x + norm(attn(..)), then the MLP's own norm
      kvserve_rmsnorm_bf16(hidden, nullptr, L.post_attn_norm, tmp, T, H, a.eps);
      kvserve_rmsnorm_bf16(tmp, a.residual, L.pre_ffn_norm, normed, T, H, a.eps);
    } else {
      kvserve_rmsnorm_bf16(hidden, a.residual, L.post_attn_norm, normed, T, H, a.eps);
    }
    if (L.moe) {
      if (kvserve_moe_bf16(L.moe, normed, T, H, hidden)) return failed;
    } else {
      if (linear(L.gate_up, a, normed, H, gate_up, 2 * I, T, 2 * I, H)) return failed;
      gated_act(L.activation, gate_up, act, T, I);
      if (linear(L.down, a, act, I, hidden, H, T, H, I)) return failed;
    }
    if (L.post_ffn_norm) kvserve_rmsnorm_bf16(hidden, nullptr, L.post_ffn_norm, hidden, T, H, a.eps);
  }
  return 0;
}

// Decode-only steps of at least this many sequences split the batch between the threads instead of every
// kernel: each thread runs the whole stack on its own sequences, alone (the kernels' parallel loops inside run
// on one thread). No barrier per kernel, and while one thread's attention waits on memory the other's matmuls
// compute. The matmuls of ~12+ rows per thread stay compute-bound; below, each thread streaming all the weights
// costs more than it saves. A tunable (the sequences per thread from which the split pays): benchmarks/
// fused_stack_ab.py measures the split against the kernels' own threads by batch size; benchmarks/LOG.md has runs.
constexpr int64_t SPLIT_MIN_SEQS = 24;
// A tunable of the split's balance, never of a result: the bytes of K/V one core reads in the time it takes for
// one matmul FLOP (its matmul rate over its memory read rate).
constexpr double KV_BYTES_PER_FLOP = 0.12;

// Returns 0, or -1 - l where a linear of layer l refused its weights (layers_rows)
int kvserve_decoder_stack_bf16(const StackArgs* args) {
  const StackArgs& a = *args;
  const int64_t B = a.num_seqs, T = a.num_tokens;
  const int nt = omp_get_max_threads();
  bool decode_only = T == B;   // one query token per sequence: sequence b is row b
  for (int64_t b = 0; decode_only && b < B; ++b) decode_only = a.query_start[b + 1] - a.query_start[b] == 1;
  // (an MoE's experts see a few rows each: every thread would stream most experts' weights)
  bool moe = false;
  for (int64_t l = 0; l < a.num_layers; ++l) moe = moe || a.layers[l].moe;
  if (!a.split || a.all_reduce || moe || !decode_only || B < SPLIT_MIN_SEQS * nt / 2 || nt < 2 || omp_in_parallel())
    return layers_rows(a);
  // Shares balanced on the estimated time of each sequence on one core: its row through the matmuls plus its
  // attention reading K/V, weighed by KV_BYTES_PER_FLOP.
  const int64_t H = a.hidden_size, NH = a.num_heads, NKV = a.num_kv_heads, D = a.head_dim, I = a.intermediate_size;
  const int64_t nqkv = (NH + 2 * NKV) * D, per_row = kvserve_stack_scratch_per_token(H, NH, NKV, D, I);
  const double row_flops = 2.0 * (H * nqkv + NH * D * H + H * 2 * I + I * H), kv_bytes = 4.0 * NKV * D;
  std::vector<double> cum(B + 1, 0.);
  for (int64_t b = 0; b < B; ++b) cum[b + 1] = cum[b] + KV_BYTES_PER_FLOP * row_flops + kv_bytes * a.seq_lens[b];
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
      StackArgs part = a;   // this thread's rows: sequence b is row b
      part.hidden = a.hidden + b0 * H;
      part.residual = a.residual + b0 * H;
      part.scratch = a.scratch + b0 * per_row;
      for (int r = 0; r < MAX_ROPES; ++r)
        if (a.cos[r]) part.cos[r] = a.cos[r] + b0 * D, part.sin[r] = a.sin[r] + b0 * D;
      std::vector<const int64_t*> slots(a.num_kv_groups);
      std::vector<const int32_t*> tables(a.num_kv_groups);
      for (int64_t g = 0; g < a.num_kv_groups; ++g)
        slots[g] = a.slots[g] + b0, tables[g] = a.tables[g] + b0 * a.table_stride[g];
      part.slots = slots.data();
      part.tables = tables.data();
      part.seq_lens = a.seq_lens + b0;
      part.query_start = qs.data();
      part.num_seqs = part.num_tokens = b1 - b0;
      part.lora_rows = a.lora_rows ? a.lora_rows + b0 : nullptr;
      failed = layers_rows(part);
    }
  }
  return failed;
}
}
