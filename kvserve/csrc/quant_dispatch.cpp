// quant.cpp's formats: the row dots and dequantized rows on the AVX2 kernels (quant_avx2.cpp) where this build
// has them, the scalar ones (quant.cpp) where not, and the entry points the Python side calls.
#include "common.h"

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

namespace {

template <int T, int R>
inline void row_dot(const uint8_t* w, const QX* const* x, int64_t nsub, float* out) {
#ifdef KV_HAVE_QAVX2
  row_dot_simd<T, R>(w, x, nsub, out);
#else
  row_dot_scalar<T, R>(w, x, nsub, out);
#endif
}

template <int T, typename Y>
void dequant_row(const uint8_t* w, int64_t nsub, Y* out) {
  using F = Format<T>;
  static_assert(!on_qk<T>());
#ifdef KV_HAVE_QAVX2
  float s[16], m[8] = {};
  for (int64_t blk = 0; blk < nsub / F::SUBS; ++blk) {
    const uint8_t* b = w + blk * F::BYTES;
    header<T>(b, s, m);
    for (int j = 0; j < F::SUBS; ++j) {
      alignas(32) int8_t q[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), quants<T>(b, j));
      Y* o = out + 32 * (blk * F::SUBS + j);
      for (int g = 0; g < 4; ++g) {
        const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * g));
        const __m256 qf = _mm256_cvtepi32_ps(F::MIN ? _mm256_cvtepu8_epi32(b8) : _mm256_cvtepi8_epi32(b8));
        const __m256 v = _mm256_fmadd_ps(_mm256_set1_ps(T == Q6_K ? s[2 * j + g / 2] : s[j]), qf,
                                         _mm256_set1_ps(F::MIN ? m[j] : 0.f));
        if constexpr (std::is_same_v<Y, float>) {
          _mm256_storeu_ps(o + 8 * g, v);
        } else {
          alignas(32) float t[8];
          _mm256_store_ps(t, v);
          for (int i = 0; i < 8; ++i) store(o, 8 * g + i, t[i]);
        }
      }
    }
  }
#else
  Sub sub;
  for (int64_t j = 0; j < nsub; ++j) {
    unpack_scalar<T>(w + (j / F::SUBS) * F::BYTES, int(j % F::SUBS), sub);
    for (int i = 0; i < 32; ++i) {
      const float s = sub.s * float(sub.isc[i / 16]);
      store(out, 32 * j + i, s * float(sub.q[i]) + sub.m);
    }
  }
#endif
}

// a packed row (OCTETS) dequantized: back in the file's order first
template <int T, typename Y>
void dequant_octets(const uint8_t* w, int64_t nsub, Y* out) {
  const int64_t nb = nsub / Format<T>::SUBS;
  std::vector<uint8_t> raw(nb * Format<T>::BYTES);
  repack_row<T>(w, raw.data(), nb, true);
  dequant_row<T>(raw.data(), nsub, out);
}

}  // namespace

#pragma GCC pop_options

extern "C" {
// rows of a Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K or Q6_K matrix from the file's order to the kernels'
// (OCTETS), or back (to_raw), in place; -1 for another type
int kvserve_quant_repack(int64_t type, uint8_t* w, int64_t rows, int64_t row_bytes, int64_t to_raw) {
  bool ok = true;
  #pragma omp parallel for if (rows * row_bytes >= (1 << 20)) reduction(&& : ok)
  for (int64_t n = 0; n < rows; ++n) {
    std::vector<uint8_t> row(w + n * row_bytes, w + (n + 1) * row_bytes);
    uint8_t* dst = w + n * row_bytes;
    switch (type) {
      case Q4_0: repack_row<Q4_0>(row.data(), dst, row_bytes / Format<Q4_0>::BYTES, to_raw); break;
      case Q4_1: repack_row<Q4_1>(row.data(), dst, row_bytes / Format<Q4_1>::BYTES, to_raw); break;
      case Q5_0: repack_row<Q5_0>(row.data(), dst, row_bytes / Format<Q5_0>::BYTES, to_raw); break;
      case Q5_1: repack_row<Q5_1>(row.data(), dst, row_bytes / Format<Q5_1>::BYTES, to_raw); break;
      case Q8_0: repack_row<Q8_0>(row.data(), dst, row_bytes / Format<Q8_0>::BYTES, to_raw); break;
      case IQ4_NL: repack_row<IQ4_NL>(row.data(), dst, row_bytes / Format<IQ4_NL>::BYTES, to_raw); break;
      case Q4_K: repack_row<Q4_K>(row.data(), dst, row_bytes / Format<Q4_K>::BYTES, to_raw); break;
      case Q6_K: repack_row<Q6_K>(row.data(), dst, row_bytes / Format<Q6_K>::BYTES, to_raw); break;
      default: ok = false;
    }
  }
  return ok ? 0 : -1;
}

// 1 when the quantized matmuls are vectorized (AVX2; AVX-512 VNNI's vpdpbusd where present)
int kvserve_quant_simd() {
#ifdef KV_HAVE_QAVX2
#ifdef KV_HAVE_QVNNI
  return 2;
#else
  return 1;
#endif
#else
  return 0;
#endif
}

}
