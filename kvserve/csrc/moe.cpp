// The mixture-of-experts MLP in bf16 in one call (kvserve/model/moe.py declares it): the router, the softmax over
// the experts and each token's top k in float32, the tokens grouped by expert (a counting sort, stable in token
// order), each chosen expert's gated MLP once over its gathered rows with the dense models' kernels (packed bf16 or
// quantized), the rows added back into float32 sums times their routing weights (experts in increasing order), and
// Qwen2-MoE's shared expert scaled by its sigmoid gate. The layer modules (SparseMoE) and the fused layer stack
// (layers.cpp) both call kvserve_moe_bf16, so the two paths agree bit for bit; experts no token chose are not read.
#include "common.h"

extern "C" {

// One MoE block as bound (kvserve/model/moe.py MoEBinding). LinearDesc: layers.cpp.
struct MoEDesc {
  LinearDesc router;            // [E, H]
  const LinearDesc* experts;    // expert e: gate_up at [2 e], down at [2 e + 1]
  LinearDesc shared_gate_up;    // weight null: no shared expert
  LinearDesc shared_down;
  LinearDesc shared_gate;       // [1, H]
  int64_t num_experts, top_k, intermediate_size, shared_intermediate_size, renormalize, activation;
};

int64_t kvserve_moe_layout(int64_t* out) {
  const int64_t v[] = {sizeof(MoEDesc), KV_FIELD(MoEDesc, experts), KV_FIELD(MoEDesc, shared_gate),
                       KV_FIELD(MoEDesc, num_experts), KV_FIELD(MoEDesc, activation)};
  const int64_t n = sizeof(v) / sizeof(v[0]);
  if (out)
    for (int64_t i = 0; i < n; ++i) out[i] = v[i];
  return n;
}

// logits [T, E] (bf16) -> each token's k largest softmax probabilities w [T, k] (float32, renormalized to sum 1
// where renorm) and their experts ids [T, k], largest first (ties: the lower expert id first)
void kvserve_moe_route(const uint16_t* logits, int64_t T, int64_t E, int64_t k, int64_t renorm, float* w,
                       int32_t* ids) {
  std::vector<float> p(E);
  std::vector<char> taken(E);
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* l = logits + t * E;
    float mx = -INFINITY, sum = 0.f;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, bf16_to_f32(l[e]));
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(bf16_to_f32(l[e]) - mx));
    std::fill(taken.begin(), taken.end(), 0);
    float chosen = 0.f;
    for (int64_t j = 0; j < k; ++j) {   // (a row of NaNs still names k distinct experts, with NaN weights)
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = 1;
      ids[t * k + j] = int32_t(best);
      chosen += (w[t * k + j] = p[best] / sum);
    }
    if (renorm)
      for (int64_t j = 0; j < k; ++j) w[t * k + j] /= chosen;
  }
}

// a linear of the block: layers.cpp's base_matmul, plus its bias (no LoRA, no tensor parallelism here)
static int moe_linear(const LinearDesc& L, const uint16_t* x, int64_t xs, uint16_t* y, int64_t ys, int64_t M,
                      int64_t N, int64_t K) {
  if (base_matmul(L, x, xs, y, ys, M, N, K)) return -1;
  if (L.bias) add_bias_bf16(y, ys, L.bias, M, N);
  return 0;
}

// y[M, H] = down(act(gate_up(x))) for one expert's M rows; work: M * (3 I) bf16
static int expert_mlp(const LinearDesc& gate_up, const LinearDesc& down, int64_t activation, const uint16_t* x,
                      int64_t M, int64_t H, int64_t I, uint16_t* work, uint16_t* y) {
  uint16_t* gu = work;
  uint16_t* act = gu + M * 2 * I;
  if (moe_linear(gate_up, x, H, gu, 2 * I, M, 2 * I, H)) return -1;
  gated_act(activation, gu, act, M, I);
  return moe_linear(down, act, I, y, H, M, H, I);
}

// Groups of at most this many rows run one expert per thread, each expert's matmuls on its thread alone (decode
// steps: k experts of a row or two each; one parallel region a block instead of two a chosen expert); bigger
// groups (prefill) run one expert at a time, its matmuls parallel inside.
constexpr int64_t EXPERT_PER_THREAD_ROWS = 8;

// the chosen experts' MLPs: rows [count[e], count[e + 1]) of xs (the choices' rows, gathered in expert order) into
// the same rows of y. 0, or -1 where a quantized weight's descriptor is refused.
static int run_experts(const MoEDesc& d, const std::vector<int32_t>& count, const uint16_t* xs, int64_t H,
                       uint16_t* y) {
  const int64_t E = d.num_experts, I = d.intermediate_size;
  std::vector<int64_t> active;
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e)
    if (count[e + 1] > count[e]) active.push_back(e), most = std::max<int64_t>(most, count[e + 1] - count[e]);
  const int nt = omp_in_parallel() ? 1 : omp_get_max_threads();
  const bool per_thread = most <= EXPERT_PER_THREAD_ROWS && nt > 1 && int64_t(active.size()) >= nt;
  std::vector<uint16_t> work((per_thread ? nt : 1) * most * 3 * I);
  uint16_t* w0 = work.data();
  int failed = 0;
  auto one = [&](int64_t e, uint16_t* w) {
    const int64_t r0 = count[e], n = count[e + 1] - r0;
    return expert_mlp(d.experts[2 * e], d.experts[2 * e + 1], d.activation, xs + r0 * H, n, H, I, w, y + r0 * H);
  };
  if (per_thread) {
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nt) reduction(min : failed)
    for (int64_t i = 0; i < int64_t(active.size()); ++i)
      failed = std::min(failed, one(active[i], w0 + omp_get_thread_num() * most * 3 * I));
  } else {
    for (int64_t e : active)
      if (one(e, w0)) return -1;
  }
  return failed;
}

// out[T, H] (bf16) = the MoE block of x[T, H]; 0, or -1 where a quantized weight's descriptor is refused
int kvserve_moe_bf16(const MoEDesc* desc, const uint16_t* x, int64_t T, int64_t H, uint16_t* out) {
  const MoEDesc& d = *desc;
  const int64_t E = d.num_experts, k = d.top_k, I = d.intermediate_size, S = d.shared_intermediate_size;
  std::vector<uint16_t> logits(T * E);
  std::vector<float> w(T * k), acc(T * H, 0.f);
  std::vector<int32_t> ids(T * k), count(E + 1, 0), order(T * k);
  if (moe_linear(d.router, x, H, logits.data(), E, T, E, H)) return -1;
  kvserve_moe_route(logits.data(), T, E, k, d.renormalize, w.data(), ids.data());
  for (int64_t c = 0; c < T * k; ++c) ++count[ids[c] + 1];
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];   // count[e]: where expert e's choices start
  std::vector<int32_t> fill(count.begin(), count.end() - 1);
  for (int64_t c = 0; c < T * k; ++c) order[fill[ids[c]]++] = int32_t(c);   // stable: token order per expert
  std::vector<uint16_t> xs(T * k * H), y(std::max(T * k, S ? T : 0) * H);
  for (int64_t i = 0; i < T * k; ++i) std::memcpy(&xs[i * H], x + (order[i] / k) * H, H * sizeof(uint16_t));
  if (run_experts(d, count, xs.data(), H, y.data())) return -1;
  for (int64_t i = 0; i < T * k; ++i) {   // experts in increasing order, each token's rows in token order
    float* a = &acc[(order[i] / k) * H];
    const float wi = w[order[i]];
    const uint16_t* yi = &y[i * H];
    for (int64_t h = 0; h < H; ++h) a[h] += bf16_to_f32(yi[h]) * wi;
  }
  if (S) {   // + sigmoid(x . g) * shared(x)
    std::vector<uint16_t> work(T * 3 * S);
    if (expert_mlp(d.shared_gate_up, d.shared_down, d.activation, x, T, H, S, work.data(), y.data())) return -1;
    uint16_t* gate = work.data();
    if (moe_linear(d.shared_gate, x, H, gate, 1, T, 1, H)) return -1;
    for (int64_t t = 0; t < T; ++t) {
      const float g = 1.f / (1.f + std::exp(-bf16_to_f32(gate[t])));
      for (int64_t h = 0; h < H; ++h) acc[t * H + h] += g * bf16_to_f32(y[t * H + h]);
    }
  }
  for (int64_t i = 0; i < T * H; ++i) out[i] = f32_to_bf16(acc[i]);
  return 0;
}
}
