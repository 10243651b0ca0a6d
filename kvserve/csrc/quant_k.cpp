// The GGUF formats the kernels read in the file's order on 256-value activation blocks (QK below; quant_matmul.cpp
// quantizes them): Q2_K, Q3_K, Q5_K and IQ4_XS. Their unpacking (k_ints, k_quants; quants<T> on AVX2), their rows
// dequantized for embedding lookups (dequant_k_row, and dequant_typed for every kept format), and their dot
// products (row_dot_k_scalar, row_dot_k_simd). The activations take a scale per 128 values (like llama.cpp's
// block_q8_K, with two scales where it has one: a scale per 256 cost measurably more perplexity with Q5_K than
// per 128, docs/quantization.md), so a super-block's products stay integer over each
// activation scale's 4 sub-blocks: each sub-block's int8 dot products (vpmaddubsw) are weighted by its integer
// scales per 16 values (vpmaddwd, or AVX-512 VNNI's vpdpwssd) and summed, and its mins are the integer mins times
// the activations' integer sums per 16 values:
//   sum_i w_i x_i ~= sum_h dx_h (d sum_(g in h) sc_g sum_(i in g) q_i qx_i - dmin sum_(g in h) mn_g sum_(i in g) qx_i).
// Those integer sums are exact; the scalar and AVX2 paths agree up to float rounding (their float steps differ).
#include "common.h"
#if defined(__AVX2__) && !defined(KVSERVE_PORTABLE)
#include <immintrin.h>
#endif

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

namespace {

// The formats themselves (Format<T> and the type ids: quant.cpp). A super-block is 8 sub-blocks of 32 q and, per 16
// values g, an integer scale sc[g] and min mn[g] with two float factors: w = d sc q - dmin mn. Q2_K: q 2 bits, sc
// and mn 4 bits each; Q3_K: q 3 bits (its value is q - 4, so mn = sc and dmin = 4 d), sc 6 bits less 32; Q5_K: q 5
// bits, Q4_K's 6-bit scales and mins (one per 32 values, so each twice); IQ4_XS: q signed (k_signed), the entry of
// IQ4_NL_VALUES a 4-bit index picks, sc 6 bits less 32 per 32 values, no mins.
template <int T> void k_ints(const uint8_t* b, int16_t* sc, int16_t* mn, float& d, float& dmin);
template <> void k_ints<Q2_K>(const uint8_t* b, int16_t* sc, int16_t* mn, float& d, float& dmin) {
  for (int g = 0; g < 16; ++g) { sc[g] = b[g] & 0xF; mn[g] = b[g] >> 4; }
  d = fp16_to_f32(b + 80);
  dmin = fp16_to_f32(b + 82);
}
// Q3_K's 16 6-bit scales from their 12 bytes: the low 4 bits of scale g in nibble g / 8 of byte g % 8, its high 2
// in bits 2 (g / 4) of byte 8 + g % 4 (ggml's kmask unpacking)
inline void q3k_scales(const uint8_t* b, int8_t* out) {
  uint32_t a[4];
  std::memcpy(a, b + 96, 12);
  const uint32_t m2 = 0x0f0f0f0f, m1 = 0x03030303, t = a[2];
  a[2] = ((a[0] >> 4) & m2) | (((t >> 4) & m1) << 4);
  a[3] = ((a[1] >> 4) & m2) | (((t >> 6) & m1) << 4);
  a[0] = (a[0] & m2) | ((t & m1) << 4);
  a[1] = (a[1] & m2) | (((t >> 2) & m1) << 4);
  std::memcpy(out, a, 16);
  for (int g = 0; g < 16; ++g) out[g] = int8_t(out[g] - 32);
}
template <> void k_ints<Q3_K>(const uint8_t* b, int16_t* sc, int16_t* mn, float& d, float& dmin) {
  int8_t s[16];
  q3k_scales(b, s);
  for (int g = 0; g < 16; ++g) sc[g] = mn[g] = s[g];
  d = fp16_to_f32(b + 108);
  dmin = 4.f * d;
}
// IQ4_XS's 8 6-bit scales (less 32): the low 4 bits of scale j in nibble j % 2 of byte 4 + j / 2, the high 2 in
// bits 2 j of the 16-bit word at 2
inline void iq4xs_scales(const uint8_t* b, int8_t* out) {
  for (int j = 0; j < 8; ++j)
    out[j] = int8_t((((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((b[2 + j / 4] >> (2 * (j % 4))) & 3) << 4)) - 32);
}
template <> void k_ints<IQ4_XS>(const uint8_t* b, int16_t* sc, int16_t* mn, float& d, float& dmin) {
  int8_t s[8];
  iq4xs_scales(b, s);
  for (int g = 0; g < 16; ++g) { sc[g] = s[g / 2]; mn[g] = 0; }
  d = fp16_to_f32(b);
  dmin = 0.f;
}
template <> void k_ints<Q5_K>(const uint8_t* b, int16_t* sc, int16_t* mn, float& d, float& dmin) {
  uint8_t u[16];
  k4_ints(b, u);
  for (int g = 0; g < 16; ++g) { sc[g] = u[g / 2]; mn[g] = u[8 + g / 2]; }
  d = fp16_to_f32(b);
  dmin = fp16_to_f32(b + 2);
}
// sub-block j's 32 q, scalar. Q2_K and Q3_K: value 32 j + i's 2 low bits at bit 2 (j % 4) of quant byte
// 32 (j / 4) + i (Q3_K: its third bit, bit j of hmask byte i); Q5_K: Q4_K's nibbles and bit j of qh byte i;
// IQ4_XS: the value of the index in nibble i / 16 of byte 8 + 16 j + i % 16
template <int T> void k_quants(const uint8_t* b, int j, int16_t* q);
template <> void k_quants<Q2_K>(const uint8_t* b, int j, int16_t* q) {
  for (int i = 0; i < 32; ++i) q[i] = (b[16 + 32 * (j / 4) + i] >> (2 * (j % 4))) & 3;
}
template <> void k_quants<Q3_K>(const uint8_t* b, int j, int16_t* q) {
  for (int i = 0; i < 32; ++i) q[i] = ((b[32 + 32 * (j / 4) + i] >> (2 * (j % 4))) & 3) | (((b[i] >> j) & 1) << 2);
}
template <> void k_quants<Q5_K>(const uint8_t* b, int j, int16_t* q) {
  const uint8_t* qs = b + 48 + 32 * (j / 2);
  for (int i = 0; i < 32; ++i) q[i] = int16_t((j % 2 ? qs[i] >> 4 : qs[i] & 0xF) | (((b[16 + i] >> j) & 1) << 4));
}
template <> void k_quants<IQ4_XS>(const uint8_t* b, int j, int16_t* q) {
  for (int i = 0; i < 32; ++i) q[i] = IQ4_NL_VALUES[(b[8 + 16 * j + i % 16] >> (4 * (i / 16))) & 0xF];
}
template <int T> constexpr bool k_signed() { return T == IQ4_XS; }   // its q signed bytes (quants), else unsigned

#ifdef KV_HAVE_QAVX2
// sub-block j's q as bytes, unsigned (k_signed: signed)
inline __m256i two_bits(const uint8_t* qs, int j) {   // Q2_K, Q3_K: the low 2 bits of sub-block j's values
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j / 4)));
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * (j % 4))), _mm256_set1_epi8(3));
}
template <> __m256i quants<Q2_K>(const uint8_t* b, int j) { return two_bits(b + 16, j); }
// bit j of each hmask byte to bit 2 by one 16-bit shift (right by up to 5, left by up to 2: bit 2 of each byte
// receives a bit of its own byte)
template <> __m256i quants<Q3_K>(const uint8_t* b, int j) {
  const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  const __m256i at2 = j < 2 ? _mm256_sll_epi16(hm, _mm_cvtsi32_si128(2 - j))
                            : _mm256_srl_epi16(hm, _mm_cvtsi32_si128(j - 2));
  return _mm256_or_si256(two_bits(b + 32, j), _mm256_and_si256(at2, _mm256_set1_epi8(4)));
}
// q3k_scales on 4 int32 lanes: the 12 bytes as words u0 u1 u2 -> [u0 & m4 | (u2 & m2) << 4, u1 & m4 |
// (u2 >> 2 & m2) << 4, u0 >> 4 & m4 | (u2 >> 4 & m2) << 4, u1 >> 4 & m4 | (u2 >> 6 & m2) << 4] less 32 a byte
inline __m128i q3k_scales_simd(const uint8_t* b) {
  int32_t u[3];
  std::memcpy(u, b + 96, 12);   // not a 16-byte load: the block's last field ends 2 bytes after these
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_setr_epi32(u[0], u[1], u[0], u[1]), _mm_setr_epi32(0, 0, 4, 4)),
                                   _mm_set1_epi32(0x0f0f0f0f));
  const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(u[2]), _mm_setr_epi32(0, 2, 4, 6)),
                                   _mm_set1_epi32(0x03030303));
  return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi32(hi, 4)), _mm_set1_epi8(32));
}
template <> __m256i quants<IQ4_XS>(const uint8_t* b, int j) {   // signed: the table's values by in-lane lookup
  return iq4nl_values(nibbles(b + 8 + 16 * j));
}
template <> __m256i quants<Q5_K>(const uint8_t* b, int j) {
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
  const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)),
                                                        _mm256_set1_epi8(1)), 4);
  return _mm256_or_si256(k_nibbles(b + 48, j), hi);
}
#endif

// a row of these formats (k_ints): w = d sc q - dmin mn per 16 values
template <int T, typename Y>
void dequant_k_row(const uint8_t* w, int64_t nsub, Y* out) {
  static_assert(on_qk<T>());
  int16_t sc[16], mn[16];
  float d, dmin;
  for (int64_t blk = 0; blk < nsub / 8; ++blk) {
    const uint8_t* b = w + blk * Format<T>::BYTES;
    k_ints<T>(b, sc, mn, d, dmin);
    for (int j = 0; j < 8; ++j) {
      int16_t q[32];
#ifdef KV_HAVE_QAVX2
      alignas(32) uint8_t u[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(u), quants<T>(b, j));
      for (int i = 0; i < 32; ++i) q[i] = k_signed<T>() ? int8_t(u[i]) : u[i];
#else
      k_quants<T>(b, j, q);
#endif
      Y* o = out + 32 * (8 * blk + j);
      for (int i = 0; i < 32; ++i) {
        const int g = 2 * j + i / 16;
        store(o, i, d * float(sc[g]) * float(q[i]) - dmin * float(mn[g]));
      }
    }
  }
}

template <typename Y>
bool dequant_typed(int64_t type, const uint8_t* w, int64_t nsub, Y* out) {
  switch (type) {
    case OCTETS | Q4_0: dequant_octets<Q4_0>(w, nsub, out); return true;
    case OCTETS | Q4_1: dequant_octets<Q4_1>(w, nsub, out); return true;
    case OCTETS | Q5_0: dequant_octets<Q5_0>(w, nsub, out); return true;
    case OCTETS | Q5_1: dequant_octets<Q5_1>(w, nsub, out); return true;
    case OCTETS | Q8_0: dequant_octets<Q8_0>(w, nsub, out); return true;
    case OCTETS | IQ4_NL: dequant_octets<IQ4_NL>(w, nsub, out); return true;
    case OCTETS | Q4_K: dequant_octets<Q4_K>(w, nsub, out); return true;
    case OCTETS | Q6_K: dequant_octets<Q6_K>(w, nsub, out); return true;
    case Q4_0: dequant_row<Q4_0>(w, nsub, out); return true;
    case Q4_1: dequant_row<Q4_1>(w, nsub, out); return true;
    case Q5_0: dequant_row<Q5_0>(w, nsub, out); return true;
    case Q5_1: dequant_row<Q5_1>(w, nsub, out); return true;
    case Q8_0: dequant_row<Q8_0>(w, nsub, out); return true;
    case IQ4_NL: dequant_row<IQ4_NL>(w, nsub, out); return true;
    case Q4_K: dequant_row<Q4_K>(w, nsub, out); return true;
    case Q2_K: dequant_k_row<Q2_K>(w, nsub, out); return true;
    case Q3_K: dequant_k_row<Q3_K>(w, nsub, out); return true;
    case Q5_K: dequant_k_row<Q5_K>(w, nsub, out); return true;
    case IQ4_XS: dequant_k_row<IQ4_XS>(w, nsub, out); return true;
    case Q6_K: dequant_row<Q6_K>(w, nsub, out); return true;
    default: return false;
  }
}

constexpr int QKJ = 4;   // sub-blocks (of 32 values) per activation scale on QK activations: 128 values

// one 256-value block of a quantized activation row for the on_qk formats: x_i ~= dl[i / 32] q_i, one scale per QKJ
// sub-blocks, repeated for each; sum16[g] = sum of q over values 16 g .. 16 g + 15 (aligned: the kernels' 32-byte
// loads of q then never straddle a cache line)
struct alignas(64) QK {
  int8_t q[256];
  int16_t sum16[16];
  float dl[8];
};

constexpr int QKR = 8;   // rows of x per pass over a QK format's weight row (a pass holds one int32 sum per row)

// a row's super-block: isum = sum_g sc_g (q . qx over g), msum = sum_g mn_g sum16_g
inline float k_term(float dx, float d, int32_t isum, float dmin, int32_t msum) {
  return dx * (d * float(isum) - dmin * float(msum));
}

template <int T, int R>
void row_dot_k_scalar(const uint8_t* w, const QK* const* x, int64_t nblocks, float* out) {
  using F = Format<T>;
  float acc[R] = {};
  int16_t sc[16], mn[16];
  float d, dmin;
  int16_t q[32];
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const uint8_t* b = w + blk * F::BYTES;
    k_ints<T>(b, sc, mn, d, dmin);
    for (int j0 = 0; j0 < 8; j0 += QKJ) {   // the sub-blocks of one activation scale
      int32_t isum[R] = {}, msum[R] = {};
      for (int j = j0; j < j0 + QKJ; ++j) {
        k_quants<T>(b, j, q);
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x[r][blk].q + 32 * j;
          for (int h = 0; h < 2; ++h) {
            int32_t s = 0;
            for (int i = 16 * h; i < 16 * h + 16; ++i) s += int32_t(q[i]) * xq[i];
            isum[r] += s * sc[2 * j + h];
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        if (F::MIN)
          for (int g = 2 * j0; g < 2 * (j0 + QKJ); ++g) msum[r] += int32_t(mn[g]) * x[r][blk].sum16[g];
        acc[r] += k_term(x[r][blk].dl[j0], d, isum[r], dmin, msum[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

#ifdef KV_HAVE_QAVX2
// acc + the int16 pairs of p times those of s, summed per int32 lane (AVX-512 VNNI: one vpdpwssd)
inline __m256i madd_add(__m256i acc, __m256i p, __m256i s) {
#ifdef KV_HAVE_QVNNI
  return _mm256_dpwssd_epi32(acc, p, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

// the SIMD header of a super-block on QK activations: its integer scales, its mins per 16 values as int16 lanes
// (mn), and d and dmin as in k_ints; scale(j): the scales of sub-block j's int16 pair sums (lanes 0-7 its values
// 0-15, lanes 8-15 its values 16-31). Q2_K, Q3_K: sc[h] holds scales 8 h .. 8 h + 7 as int16 in both 128-bit
// halves, so that one in-lane shuffle gives a sub-block's two.
template <int T>
struct KHeader {
  static_assert(T == Q2_K || T == Q3_K);
  __m256i sc[2], mn;
  float d, dmin;
  explicit KHeader(const uint8_t* b) {
    __m256i all;   // the 16 scales in order
    if constexpr (T == Q2_K) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), lo4 = _mm_set1_epi8(0xF);
      all = _mm256_cvtepu8_epi16(_mm_and_si128(v, lo4));
      mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), lo4));
      d = fp16_to_f32(b + 80);
      dmin = fp16_to_f32(b + 82);
    } else {
      all = mn = _mm256_cvtepi8_epi16(q3k_scales_simd(b));
      d = fp16_to_f32(b + 108);
      dmin = 4.f * d;
    }
    sc[0] = _mm256_permute2x128_si256(all, all, 0x00);
    sc[1] = _mm256_permute2x128_si256(all, all, 0x11);
  }
  __m256i scale(int j) const {   // int16 2 (j % 4) in the low half, 2 (j % 4) + 1 in the high one
    const char a = char(4 * (j % 4)), b = char(a + 1), c = char(a + 2), e = char(a + 3);
    return _mm256_shuffle_epi8(sc[j / 4], _mm256_setr_epi8(a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b,
                                                           c, e, c, e, c, e, c, e, c, e, c, e, c, e, c, e));
  }
};
// Q5_K and IQ4_XS: one scale per sub-block; sc holds the 8 as int16 in both 128-bit halves (IQ4_XS: no mins)
inline __m256i scale_of(__m256i sc, int j) {
  return _mm256_shuffle_epi8(sc, _mm256_set1_epi16(int16_t(0x0100 * (2 * j + 1) + 2 * j)));
}
template <>
struct KHeader<Q5_K> {
  __m256i sc, mn;
  float d, dmin;
  explicit KHeader(const uint8_t* b) {
    const __m128i v = k4_ints_simd(b);   // 8 scales, then 8 mins
    sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(v));
    mn = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14,
                                                                 15, 15)));
    d = fp16_to_f32(b);
    dmin = fp16_to_f32(b + 2);
  }
  __m256i scale(int j) const { return scale_of(sc, j); }
};
template <>
struct KHeader<IQ4_XS> {
  __m256i sc;
  float d;
  explicit KHeader(const uint8_t* b) {   // iq4xs_scales on 8 bytes: the high bits spread 2 to a byte by shifts
    uint32_t lo4;
    uint16_t hi16;
    std::memcpy(&lo4, b + 4, 4);
    std::memcpy(&hi16, b + 2, 2);
    uint64_t h = hi16;
    h = (h | h << 24) & 0x000000FF000000FFull;
    h = (h | h << 12) & 0x000F000F000F000Full;
    h = (h | h << 6) & 0x0303030303030303ull;
    const __m128i v = _mm_cvtsi32_si128(int(lo4)), m4 = _mm_set1_epi8(0xF);
    const __m128i lo = _mm_unpacklo_epi8(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    const __m128i s = _mm_sub_epi8(_mm_or_si128(lo, _mm_cvtsi64_si128(int64_t(h << 4))), _mm_set1_epi8(32));
    sc = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(s));
    d = fp16_to_f32(b);
  }
  __m256i scale(int j) const { return scale_of(sc, j); }
};
template <int T, int R>
void row_dot_k_simd(const uint8_t* w, const QK* const* x, int64_t nblocks, float* out) {
  using F = Format<T>;
  __m256 vacc[R];   // per row: 8 lanes of float sums, added up at the end
  for (int r = 0; r < R; ++r) vacc[r] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const uint8_t* b = w + blk * F::BYTES;
    const KHeader<T> h(b);
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      // unsigned q (< 32) times signed qx (|qx| <= 127), or for k_signed |q| (<= 127) times qx carrying q's sign
      // (as Q8_0's octets; IQ4_XS has no value 0 or -128): each pair's sum fits int16 (2 * 127 * 127; vpmaddubsw
      // saturates); the pairs weighted by their scales (Q3_K's and IQ4_XS's signed)
      const __m256i q = quants<T>(b, j), s = h.scale(j), qa = k_signed<T>() ? _mm256_abs_epi8(q) : q;
      for (int r = 0; r < R; ++r) {
        __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r][blk].q + 32 * j));
        if constexpr (k_signed<T>()) xq = _mm256_sign_epi8(xq, q);
        isum[r] = madd_add(isum[r], _mm256_maddubs_epi16(qa, xq), s);
      }
      if ((j + 1) % QKJ == 0)   // the last sub-block of an activation scale
        for (int r = 0; r < R; ++r) {
          vacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(h.d * x[r][blk].dl[j]), vacc[r]);
          isum[r] = _mm256_setzero_si256();
        }
    }
    // the mins: int32 lane l holds those of sub-block l, scaled by its activation scale
    if constexpr (Format<T>::MIN) {
      const __m256 dm = _mm256_set1_ps(-h.dmin);
      for (int r = 0; r < R; ++r) {
        const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r][blk].sum16));
        const __m256 dl = _mm256_mul_ps(dm, _mm256_loadu_ps(x[r][blk].dl));
        vacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(h.mn, s16)), dl, vacc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(vacc[r]);
}
#endif

}  // namespace

#pragma GCC pop_options
