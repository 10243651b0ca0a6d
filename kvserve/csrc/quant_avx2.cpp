// The AVX2 kernels of quant.cpp's 32-value formats, Q4_K and Q6_K (and AVX-512 VNNI's dot products on their
// 256-bit registers, KV_HAVE_QVNNI): unpacking in registers, the integer dot products of a row tile, the
// activations' row repacked for them. Their scalar counterparts, the formats and KV_HAVE_QAVX2 are quant.cpp's;
// quant_dispatch.cpp picks between the two and exports the entry points.
#include "common.h"

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

namespace {

#ifdef KV_HAVE_QAVX2
// acc + 8 int32 sums of 4 products each of unsigned u and signed s bytes (no saturation: |u s| <= 128 * 127, so
// a pair's sum stays in int16); the AVX2 path's (with VNNI the signed formats take vpdpbusd as unsigned ones)
inline __m256i dot_u8s8_add(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

// 16 bytes of nibbles -> 32 bytes: low nibbles then high nibbles (ggml's order within a 32-value block)
inline __m256i nibbles(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}
// bit i of the 32-bit word at p -> 0x10 in byte i
inline __m256i bits_to_0x10(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(int(x)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// The SIMD unpacking, in two parts: header() decodes a block's scales once (s[j], m[j] per sub-block j; Q6_K: s
// per 16 values, d * its int8 scale), quants() gives sub-block j's 32 q as bytes (unsigned where there is a min).
template <int T> void header(const uint8_t* b, float* s, float* m);
template <int T> __m256i quants(const uint8_t* b, int j);
template <> void header<Q4_0>(const uint8_t* b, float* s, float*) { s[0] = fp16_to_f32(b); }
template <> __m256i quants<Q4_0>(const uint8_t* b, int) { return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8)); }
template <> void header<Q4_1>(const uint8_t* b, float* s, float* m) {
  s[0] = fp16_to_f32(b);
  m[0] = fp16_to_f32(b + 2);
}
template <> __m256i quants<Q4_1>(const uint8_t* b, int) { return nibbles(b + 4); }
template <> void header<Q5_0>(const uint8_t* b, float* s, float*) { s[0] = fp16_to_f32(b); }
template <> __m256i quants<Q5_0>(const uint8_t* b, int) {
  return _mm256_sub_epi8(_mm256_or_si256(nibbles(b + 6), bits_to_0x10(b + 2)), _mm256_set1_epi8(16));
}
template <> void header<Q5_1>(const uint8_t* b, float* s, float* m) {
  s[0] = fp16_to_f32(b);
  m[0] = fp16_to_f32(b + 2);
}
template <> __m256i quants<Q5_1>(const uint8_t* b, int) { return _mm256_or_si256(nibbles(b + 8), bits_to_0x10(b + 4)); }
template <> void header<Q8_0>(const uint8_t* b, float* s, float*) { s[0] = fp16_to_f32(b); }
template <> void header<IQ4_NL>(const uint8_t* b, float* s, float*) { s[0] = fp16_to_f32(b); }
inline __m256i iq4nl_values(__m256i idx) {   // bytes 0..15 -> IQ4_NL_VALUES, by in-lane lookup
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(
      IQ4_NL_VALUES))), idx);
}
template <> __m256i quants<IQ4_NL>(const uint8_t* b, int) { return iq4nl_values(nibbles(b + 2)); }
template <> __m256i quants<Q8_0>(const uint8_t* b, int) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
}
// 8 bytes -> 8 floats times f, stored to out
inline void bytes_times(const void* p, bool is_signed, float f, float* out) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i i = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(f)));
}
inline void k4_header(const uint8_t* b, float* s, float* m) {
  uint8_t u[16];
  k4_ints(b, u);
  bytes_times(u, false, fp16_to_f32(b), s);
  bytes_times(u + 8, false, -fp16_to_f32(b + 2), m);
}
inline __m256i k_nibbles(const uint8_t* qs, int j) {   // sub-block j's 32 nibbles of a Q4_K / Q5_K super-block
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j / 2)));
  return _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0xF));
}
template <> void header<Q4_K>(const uint8_t* b, float* s, float* m) { k4_header(b, s, m); }
template <> __m256i quants<Q4_K>(const uint8_t* b, int j) { return k_nibbles(b + 16, j); }
template <> void header<Q6_K>(const uint8_t* b, float* s, float*) {
  const float d = fp16_to_f32(b + 208);
  bytes_times(b + 192, true, d, s);
  bytes_times(b + 200, true, d, s + 8);
}
inline __m256i q6_unsigned(const uint8_t* b, int j) {   // sub-block j of a Q6_K block as 0..63 (q + 32)
  const int h = j / 4, i4 = j % 4;
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (i4 & 1)));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
  const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (i4 >> 1))), _mm256_set1_epi8(0xF));
  const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * i4)),
                                                        _mm256_set1_epi8(3)), 4);
  return _mm256_or_si256(lo, hi);
}
template <> __m256i quants<Q6_K>(const uint8_t* b, int j) {
  return _mm256_sub_epi8(q6_unsigned(b, j), _mm256_set1_epi8(32));
}

// An octet's factors, lane b for block b: w = s (k q) + m, with k16 the integer weights of a block's int16 pair sums
// (k16[0] for its values 0..15, k16[1] for 16..31; 1 for the 32-value formats, Q4_K: the sub-block's scale, Q6_K:
// those of its two halves) and m its min (times the activations' block sum); Q6_K's offset of 32 stays integer:
// kh holds lane b's two scales, for the activations' halves.
struct OctetScales {
  __m256 s, m;
  __m256i k16[2], kh;
};

// byte i of each lane of v: its low nibble into lo, its high one into hi
KV_ALWAYS_INLINE void split_nibbles(__m256i v, __m256i& lo, __m256i& hi) {
  const __m256i lo4 = _mm256_set1_epi8(0xF);
  lo = _mm256_and_si256(v, lo4);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
}

// o's factors (k16 = 1, s, m) for a group of g blocks of a 32-value format, its fp16 fields read by load16(at)
template <int T, typename Load16>
KV_ALWAYS_INLINE void octet_scales(int g, Load16 load16, OctetScales& o) {
  using L = Layout<T>;
  o.k16[0] = o.k16[1] = _mm256_set1_epi16(1);
  o.s = _mm256_cvtph_ps(load16(0));
  o.m = L::M >= 0 ? _mm256_cvtph_ps(load16(octet_pos<T>(g, 0, L::M)))
                  : _mm256_mul_ps(o.s, _mm256_set1_ps(-float(L::OFFSET)));
}

// An octet of 8 weight blocks of the 32-value formats, chunk-major as QX's quants: q[c] holds values 4 c .. 4 c + 3
// of block b as its int32 lane b (unsigned; signed_octets: signed); o.s and o.m the blocks' scales and mins (m =
// -offset * s where the format has an offset). The fields are read through load32(at), the 32 bytes of a field (a
// chunk of quant bytes, the high-bit words) at offset `at` of a group of g blocks (octet_pos), and load16(at), the
// 8 fp16 scales or mins there; lane b from block b, zero where there is none.
template <int T, typename Load32, typename Load16>
KV_ALWAYS_INLINE void octet_fields(int g, Load32 load32, Load16 load16, __m256i* q, OctetScales& o) {
  using L = Layout<T>;
  octet_scales<T>(g, load16, o);
  if constexpr (T == Q8_0) {   // a byte per value
    for (int c = 0; c < 8; ++c) q[c] = load32(octet_pos<T>(g, 0, L::QS + 4 * c));
    return;
  }
  for (int c = 0; c < 4; ++c)   // byte i of lane b: value 4 c + i (low nibble) and 16 + 4 c + i (high)
    split_nibbles(load32(octet_pos<T>(g, 0, L::QS + 4 * c)), q[c], q[c + 4]);
  if constexpr (T == IQ4_NL)   // the indices' values, signed
    for (int c = 0; c < 8; ++c) q[c] = iq4nl_values(q[c]);
  if constexpr (L::QH >= 0) {   // bit c of byte i of a block's qh (qh_transpose): value 4 c + i's 0x10
    const __m256i h = load32(octet_pos<T>(g, 0, L::QH));
    for (int c = 0; c < 8; ++c) {   // bit c to bit 4 of each byte (16-bit shifts of <= 4 bring no other byte's)
      const __m256i at4 = c < 4 ? _mm256_slli_epi16(h, 4 - c) : c == 4 ? h : _mm256_srli_epi16(h, c - 4);
      q[c] = _mm256_or_si256(q[c], _mm256_and_si256(at4, _mm256_set1_epi8(0x10)));
    }
  }
}

// a group of g packed weight blocks at w (OCTETS; FULL: g = 8) as an octet. A partial group's loads are masked to
// its bytes (an odd g's last dword of fp16 reaches into the next field: those halves are masked again).
template <int T, bool FULL>
inline void octet(const uint8_t* w, int g, __m256i* q, OctetScales& o) {
  if constexpr (FULL) {
    octet_fields<T>(8, [&](int at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + at)); },
                    [&](int at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + at)); }, q, o);
  } else {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i in_g = _mm256_cmpgt_epi32(_mm256_set1_epi32(g), lane);   // lanes < g
    const __m256i in_h = _mm256_cmpgt_epi32(_mm256_set1_epi32((g + 1) / 2), lane);   // the dwords of g fp16
    const __m128i in_g16 = _mm_cmpgt_epi16(_mm_set1_epi16(int16_t(g)), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
    octet_fields<T>(g, [&](int at) { return _mm256_maskload_epi32(reinterpret_cast<const int*>(w + at), in_g); },
                    [&](int at) {
                      const __m256i h = _mm256_maskload_epi32(reinterpret_cast<const int*>(w + at), in_h);
                      return _mm_and_si128(_mm256_castsi256_si128(h), in_g16);
                    }, q, o);
  }
}

// The last groups of t blocks (t = 1, 2 or 4) of `rows` <= 8 / t consecutive weight rows, row_bytes apart from w,
// as one octet: lane b holds block b % t of row b / t (zero past the rows). A row whose blocks do not come in 8s
// then costs its own last group an eighth of an octet per t blocks, not a whole one.
alignas(64) constexpr uint8_t ZERO_GROUP[8 * 34] = {};   // the fields of an absent row: no group is larger
template <int T, int t>
KV_ALWAYS_INLINE void tail_octet(const uint8_t* w, int64_t row_bytes, int rows, __m256i* q, OctetScales& o) {
  static_assert(t == 1 || t == 2 || t == 4);
  const uint8_t* row[8 / t];
  for (int i = 0; i < 8 / t; ++i) row[i] = i < rows ? w + i * row_bytes : ZERO_GROUP;
  const auto part = [&](auto zero, int i, int at) {   // the bytes of row i's field at `at`, as `zero`'s type
    auto v = zero;
    std::memcpy(&v, row[i] + at, sizeof v);
    return v;
  };
  const auto load32 = [&](int at) {   // 4 t bytes of each row
    if constexpr (t == 1)
      return _mm256_setr_epi32(part(0, 0, at), part(0, 1, at), part(0, 2, at), part(0, 3, at), part(0, 4, at),
                               part(0, 5, at), part(0, 6, at), part(0, 7, at));
    else if constexpr (t == 2)
      return _mm256_setr_epi64x(part(int64_t(0), 0, at), part(int64_t(0), 1, at), part(int64_t(0), 2, at),
                                part(int64_t(0), 3, at));
    else
      return _mm256_setr_m128i(part(_mm_setzero_si128(), 0, at), part(_mm_setzero_si128(), 1, at));
  };
  const auto load16 = [&](int at) {   // 2 t bytes (t fp16) of each row
    if constexpr (t == 1)
      return _mm_setr_epi16(part(int16_t(0), 0, at), part(int16_t(0), 1, at), part(int16_t(0), 2, at),
                            part(int16_t(0), 3, at), part(int16_t(0), 4, at), part(int16_t(0), 5, at),
                            part(int16_t(0), 6, at), part(int16_t(0), 7, at));
    else if constexpr (t == 2)
      return _mm_setr_epi32(part(0, 0, at), part(0, 1, at), part(0, 2, at), part(0, 3, at));
    else
      return _mm_set_epi64x(part(int64_t(0), 1, at), part(int64_t(0), 0, at));
  };
  octet_fields<T>(t, load32, load16, q, o);
}

// 128 bytes of nibbles at p, chunk-major (Q4_K, Q6_K packed): q[c] the low nibbles of bytes 32 c .. 32 c + 31,
// q[c + 4] their high ones
inline void nibble_chunks(const uint8_t* p, __m256i* q) {
  for (int c = 0; c < 4; ++c)
    split_nibbles(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * c)), q[c], q[c + 4]);
}

// a Q4_K super-block (OCTETS) as an octet of its 8 sub-blocks: q and m as above, s = d in every lane, and k16 the
// sub-blocks' integer scales (lane b: sub-block b's in every int16 of the lane), by which vpmaddwd (AVX2) or vpmulld
// (k16_to_32's, AVX-512 VNNI) weights their sums
// k4_ints on 4 int32 lanes, for a Q4_K / Q5_K super-block at b: its 12 bytes of scales and mins as words u0 u1 u2
// -> [scales 0-3, scales 4-7, mins 0-3, mins 4-7] = [u0 & 63, (u2 & 15) | (u0 >> 6 & 3) << 4, u1 & 63,
// (u2 >> 4 & 15) | (u1 >> 6 & 3) << 4]
inline __m128i k4_ints_simd(const uint8_t* b) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));   // u0 u1 u2 and 4 quant bytes
  const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));   // u0 u2 u1 u2
  const __m128i top = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));   // u0 u0 u1 u1
  const __m128i lo = _mm_and_si128(a, _mm_setr_epi32(0x3f3f3f3f, 0, 0x3f3f3f3f, 0));
  const __m128i hi = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                                   _mm_setr_epi32(0, 0x0f0f0f0f, 0, 0x0f0f0f0f));
  const __m128i up = _mm_and_si128(_mm_srli_epi32(top, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(_mm_or_si128(lo, hi), up);
}
// a Q4_K super-block's factors (octet<Q4_K>'s, without its quants)
inline void q4k_scales(const uint8_t* w, OctetScales& o) {
  const __m128i sm = k4_ints_simd(w);   // 8 scales, then 8 mins
  o.k16[0] = o.k16[1] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sm, sm));
  int32_t d_dmin;
  std::memcpy(&d_dmin, w, 4);
  const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(d_dmin));   // d, dmin
  o.s = _mm256_broadcastss_ps(dd);
  o.m = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))),
                      _mm256_broadcastss_ps(_mm_sub_ps(_mm_setzero_ps(), _mm_movehdup_ps(dd))));
}
template <>
inline void octet<Q4_K, true>(const uint8_t* w, int, __m256i* q, OctetScales& o) {
  q4k_scales(w, o);
  nibble_chunks(w + 16, q);
}
// a Q6_K super-block (OCTETS): q unsigned (0..63: the value + 32), each half of a sub-block weighted by its int8
// scale; the offset of 32 is taken off the integer sums: 32 (sc_lo x_lo + sc_hi x_hi) over the halves' sums
template <>
inline void octet<Q6_K, true>(const uint8_t* w, int, __m256i* q, OctetScales& o) {
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192));   // sub-block b: 2 b, 2 b + 1
  const __m128i lo = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14));
  const __m128i hi = _mm_shuffle_epi8(sc, _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15));
  o.k16[0] = _mm256_cvtepi8_epi16(lo);
  o.k16[1] = _mm256_cvtepi8_epi16(hi);
  o.kh = _mm256_cvtepi8_epi16(sc);
  o.s = _mm256_set1_ps(fp16_to_f32(w + 208));
  o.m = _mm256_setzero_ps();
  nibble_chunks(w, q);
  const __m256i h[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128)),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 160))};
  const __m256i top2 = _mm256_set1_epi8(0x30);
  for (int c = 0; c < 8; ++c) {   // values 4 c .. 4 c + 3: bits 2 (c % 4) of h[c / 4], moved to bits 4 and 5
    const __m256i v = h[c / 4];
    const int k = c % 4;
    const __m256i at4 = k == 0 ? _mm256_slli_epi16(v, 4) : k == 1 ? _mm256_slli_epi16(v, 2)
                      : k == 2 ? v : _mm256_srli_epi16(v, 2);
    q[c] = _mm256_or_si256(q[c], _mm256_and_si256(at4, top2));
  }
}

template <int T> constexpr int pair_run() {   // chunks whose int16 pair sums add unwidened: |q| <= 15, 31, 63
  static_assert(!signed_octets<T>());   // none: their chunks widen one by one (octet_rows)
  if constexpr (T == Q6_K) return 2;
  else if constexpr (T == Q4_K) return 8;
  else return Layout<T>::QH >= 0 ? 4 : 8;
}
template <int T> constexpr bool int_scales() { return Format<T>::SUBS == 8; }   // Q4_K's, Q6_K's k16 (not 1)
#ifdef KV_HAVE_QVNNI
// k16's integer scales (a lane's two int16 hold the same one) as int32 lanes
inline __m256i k16_to_32(__m256i k16) { return _mm256_srai_epi32(_mm256_slli_epi32(k16, 16), 16); }
#endif
template <int T> constexpr bool adds_min() {   // a term m * the activations' block sum (a min, or an offset's)
  if constexpr (Format<T>::SUBS == 8) return Format<T>::MIN;
  else return Format<T>::MIN || Layout<T>::OFFSET != 0;
}

// R rows at once over the formats packed in octets (Q4_K, Q6_K: a super-block per octet, each sub-block's sum
// weighted by its integer scale, Q6_K's per 16-value half). Each group of 8 blocks: each block's integer dot
// product lands in its own int32 lane (int16 pair sums added before widening: 4-bit values over all 8 chunks, 5-bit
// over 4, Q6_K's 6-bit over 2, Q8_0's and IQ4_NL's none: |w| times x carrying w's sign, widened chunk by chunk;
// with AVX-512 VNNI every format's sums go straight to int32 by vpdpbusd, then times the integer scales by vpmulld;
// Q6_K's offset of 32 then taken off with the activations' integer sums per half; Q8_0 and IQ4_NL go in as the
// unsigned w + 128, shared by the rows, and 128 times the block's integer sum of x is taken off: the sign trick's
// integer, x being -127..127 (clamp127, common.h), one instruction a chunk and row instead of two), then one
// float step per group and row: acc += float(dot) * s * dx + m * sum of x. A partial last group (the 32-value
// formats; a K-quant row is whole super-blocks) runs as a full one whose missing blocks have zero scales, mins and
// activations; one of 1, 2 or 4 blocks shares an octet with those of the next rows instead (tail_dot, from
// quant_matmul.cpp's tiles).
template <int T, int R>
KV_ALWAYS_INLINE void octet_rows(const __m256i* q, const OctetScales& sc, const QX* const* xo, __m256* acc) {
#ifdef KV_HAVE_QVNNI
  constexpr bool SIGNED_AVX2 = false;   // signed weights as w + 128 (below)
#else
  constexpr bool SIGNED_AVX2 = signed_octets<T>();
#endif
  __m256i isums[SIGNED_AVX2 ? R : 1];   // Q8_0, IQ4_NL: chunk by chunk over the rows (|w| and w held once)
  if constexpr (SIGNED_AVX2) {
    for (int r = 0; r < R; ++r) isums[r] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i qa = _mm256_abs_epi8(q[c]);
      for (int r = 0; r < R; ++r) {
        const __m256i xq = _mm256_load_si256(reinterpret_cast<const __m256i*>(xo[r]->q[c]));
        isums[r] = dot_u8s8_add(isums[r], qa, _mm256_sign_epi8(xq, q[c]));
      }
    }
  }
#ifdef KV_HAVE_QVNNI
  __m256i k32[2];   // the K-quants' integer scales as int32 lanes (Q6_K: per half; Q4_K: the same in both)
  if constexpr (int_scales<T>())
    for (int h = 0; h < 2; ++h) k32[h] = k16_to_32(sc.k16[h]);
  __m256i qu[signed_octets<T>() ? 8 : 1];   // Q8_0, IQ4_NL: w + 128 as unsigned bytes
  if constexpr (signed_octets<T>())
    for (int c = 0; c < 8; ++c) qu[c] = _mm256_xor_si256(q[c], _mm256_set1_epi8(char(0x80)));
#endif
  for (int r = 0; r < R; ++r) {
    __m256i isum = _mm256_setzero_si256();
    if constexpr (SIGNED_AVX2) {
      isum = isums[r];
    } else {
#ifdef KV_HAVE_QVNNI   // exact int32 sums by vpdpbusd, two chains (values 0-15, 16-31), then the integer scales
      __m256i half[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int c = 0; c < 4; ++c)
        for (int h = 0; h < 2; ++h)
          half[h] = _mm256_dpbusd_epi32(half[h], signed_octets<T>() ? qu[c + 4 * h] : q[c + 4 * h],
                                        _mm256_load_si256(reinterpret_cast<const __m256i*>(xo[r]->q[c + 4 * h])));
      if constexpr (signed_octets<T>()) {
        const __m256i halves = _mm256_load_si256(reinterpret_cast<const __m256i*>(xo[r]->halves));
        isum = _mm256_sub_epi32(_mm256_add_epi32(half[0], half[1]),
                                _mm256_slli_epi32(_mm256_madd_epi16(halves, _mm256_set1_epi16(1)), 7));
      } else if constexpr (T == Q6_K)
        isum = _mm256_add_epi32(_mm256_mullo_epi32(half[0], k32[0]), _mm256_mullo_epi32(half[1], k32[1]));
      else
        isum = int_scales<T>() ? _mm256_mullo_epi32(_mm256_add_epi32(half[0], half[1]), k32[0])
                               : _mm256_add_epi32(half[0], half[1]);
#else
      constexpr int RUN = pair_run<T>();
      for (int c0 = 0; c0 < 8; c0 += RUN) {
        __m256i s16 = _mm256_setzero_si256();
        for (int c = c0; c < c0 + RUN; ++c) {
          const __m256i xq = _mm256_load_si256(reinterpret_cast<const __m256i*>(xo[r]->q[c]));
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(q[c], xq));
        }
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(s16, sc.k16[c0 / 4]));
      }
#endif
    }
    if constexpr (T == Q6_K) {
      const __m256i halves = _mm256_load_si256(reinterpret_cast<const __m256i*>(xo[r]->halves));
      isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_madd_epi16(halves, sc.kh), 5));
    }
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sc.s, _mm256_load_ps(xo[r]->d)), acc[r]);
    if constexpr (adds_min<T>()) acc[r] = _mm256_fmadd_ps(sc.m, _mm256_load_ps(xo[r]->sum), acc[r]);
  }
}

// acc[r] += octets o0 .. o1 - 1 of the dot of weight row w (nsub blocks) and x row r, in float lanes (not summed
// across: a row's octets taken in runs, as quant_matmul.cpp's rows_in_runs, sum to the same bits as in one pass).
// PREFETCH: the weights `ahead` bytes on are prefetched into L2 (rows_in_runs: the next unit's); a row in one pass
// leaves its weights to the hardware's prefetchers (a prefetch 2 KiB ahead in the row, once needed for the long
// rows that now go in runs, no longer pays: benchmarks/LOG.md)
template <int T, int R, bool PREFETCH = false>
KV_ALWAYS_INLINE void octets_dot(const uint8_t* w, const QX* const* x, int64_t nsub, int64_t o0, int64_t o1,
                                 __m256* acc, int64_t ahead = 0) {
  static_assert(in_octets<T>());
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* group = w + o * octet_bytes<T>();
    if constexpr (PREFETCH)   // prefetches never fault: those past the matrix's end are harmless
      for (int64_t at = 0; at < octet_bytes<T>(); at += 64)
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(group) + ahead + at), _MM_HINT_T1);
    __m256i q[8];
    OctetScales sc;
    if constexpr (Format<T>::SUBS == 8) {   // whole super-blocks
      octet<T, true>(group, QXB, q, sc);
    } else {
      const int g = int(std::min<int64_t>(QXB, nsub - o * QXB));
      if (g == QXB) octet<T, true>(group, g, q, sc);
      else octet<T, false>(group, g, q, sc);
    }
    const QX* xo[R];
    for (int r = 0; r < R; ++r) xo[r] = x[r] + o;
    octet_rows<T, R>(q, sc, xo, acc);
  }
}
template <int T, int R>
void row_dot_simd(const uint8_t* w, const QX* const* x, int64_t nsub, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  octets_dot<T, R>(w, x, nsub, 0, (nsub + QXB - 1) / QXB, acc);
  for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]);
}

// Two weight rows (wa, wb) against R <= 4 rows of x over noct whole octets, for the 4-bit formats (Q4_0, Q4_1,
// Q4_K): each chunk of x serves both weight rows, and the octets are decoded a pair of chunks at a time into few
// registers (row_dot_simd holds a whole octet, and its R rows' sums spill). The integer sums and float steps are
// octet_rows', so each result equals row_dot_simd's bit for bit.
template <int T> constexpr bool in_pairs() {
  if constexpr (T == Q4_0 || T == Q4_1 || T == Q4_K) return true;
  else return false;
}
template <int T> constexpr int pair_chunks_at(int c) {   // the 32 bytes of chunks c (low nibbles) and c + 4 (high)
  if constexpr (T == Q4_K) return 16 + 32 * c;
  else return octet_pos<T>(QXB, 0, Layout<T>::QS + 4 * c);
}
template <int T> KV_ALWAYS_INLINE void pair_scales(const uint8_t* g, OctetScales& o) {   // as octet's
  if constexpr (T == Q4_K)
    q4k_scales(g, o);
  else
    octet_scales<T>(QXB, [&](int at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + at)); }, o);
}
template <int T, int R>
void row_dot_pair(const uint8_t* wa, const uint8_t* wb, const QX* const* x, int64_t noct, float* outa,
                  float* outb) {
  static_assert(in_pairs<T>() && pair_run<T>() == 8 && R <= 4);
  __m256 acca[R], accb[R];
  for (int r = 0; r < R; ++r) acca[r] = accb[r] = _mm256_setzero_ps();
  for (int64_t o = 0; o < noct; ++o) {
    const uint8_t* ga = wa + o * octet_bytes<T>();
    const uint8_t* gb = wb + o * octet_bytes<T>();
    __m256i sa[R], sb[R];
    for (int r = 0; r < R; ++r) sa[r] = sb[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ga + pair_chunks_at<T>(c)));
      const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + pair_chunks_at<T>(c)));
      __m256i al, ah, bl, bh;
      split_nibbles(va, al, ah);
      split_nibbles(vb, bl, bh);
      for (int r = 0; r < R; ++r) {
        const QX& xo = x[r][o];
        const __m256i xl = _mm256_load_si256(reinterpret_cast<const __m256i*>(xo.q[c]));
        const __m256i xh = _mm256_load_si256(reinterpret_cast<const __m256i*>(xo.q[c + 4]));
#ifdef KV_HAVE_QVNNI   // int32 sums
        sa[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(sa[r], al, xl), ah, xh);
        sb[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(sb[r], bl, xl), bh, xh);
#else   // int16 pair sums
        sa[r] = _mm256_add_epi16(_mm256_add_epi16(sa[r], _mm256_maddubs_epi16(al, xl)), _mm256_maddubs_epi16(ah, xh));
        sb[r] = _mm256_add_epi16(_mm256_add_epi16(sb[r], _mm256_maddubs_epi16(bl, xl)), _mm256_maddubs_epi16(bh, xh));
#endif
        __asm__ volatile("" : "+x"(sa[r]), "+x"(sb[r]));   // keeps GCC from hoisting every product (and spilling)
      }
    }
    OctetScales fa, fb;
    pair_scales<T>(ga, fa);
    pair_scales<T>(gb, fb);
#ifdef KV_HAVE_QVNNI
    const auto ints = [](__m256i s, const OctetScales& f) {   // the sums times the integer scales (Q4_K)
      return int_scales<T>() ? _mm256_mullo_epi32(s, k16_to_32(f.k16[0])) : s;
    };
#else
    const auto ints = [](__m256i s, const OctetScales& f) { return _mm256_madd_epi16(s, f.k16[0]); };
#endif
    for (int r = 0; r < R; ++r) {
      const QX& xo = x[r][o];
      const __m256 d = _mm256_load_ps(xo.d), sum = _mm256_load_ps(xo.sum);
      acca[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints(sa[r], fa)), _mm256_mul_ps(fa.s, d), acca[r]);
      accb[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints(sb[r], fb)), _mm256_mul_ps(fb.s, d), accb[r]);
      if constexpr (adds_min<T>()) {
        acca[r] = _mm256_fmadd_ps(fa.m, sum, acca[r]);
        accb[r] = _mm256_fmadd_ps(fb.m, sum, accb[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    outa[r] = hsum8(acca[r]);
    outb[r] = hsum8(accb[r]);
  }
}

// The rows' last groups of t blocks by tail_octet: out[i][r] += the dot product of the last group of weight row i
// (rows <= 8 / t of them, row_bytes apart from w) and that of x row r, taken from xt[r] (repeat_tail's). Each lane
// is the same float step as row_dot_simd's, so a row's result does not depend on the rows beside it.
template <int T, int R, int t, int OUT>
void tail_dot(const uint8_t* w, int64_t row_bytes, int rows, const QX* const* xt, float (*out)[OUT]) {
  __m256i q[8];
  OctetScales sc;
  tail_octet<T, t>(w, row_bytes, rows, q, sc);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  octet_rows<T, R>(q, sc, xt, acc);
  for (int r = 0; r < R; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    for (int i = 0; i < rows; ++i) {
      float sum = 0.f;
      for (int b = i * t; b < i * t + t; ++b) sum += lanes[b];
      out[i][r] += sum;
    }
  }
}

// x's last octet of t blocks (t = 1, 2, 4) with block b % t in lane b, as tail_dot takes it
inline void repeat_tail(const QX& last, int t, QX& out) {
  const __m256i idx = _mm256_and_si256(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(t - 1));
  for (int c = 0; c < 8; ++c) {
    const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(last.q[c]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.q[c]), _mm256_permutevar8x32_epi32(v, idx));
  }
  _mm256_store_ps(out.d, _mm256_permutevar8x32_ps(_mm256_load_ps(last.d), idx));
  _mm256_store_ps(out.sum, _mm256_permutevar8x32_ps(_mm256_load_ps(last.sum), idx));
  const __m256i halves = _mm256_load_si256(reinterpret_cast<const __m256i*>(last.halves));   // lane b: block b's
  _mm256_store_si256(reinterpret_cast<__m256i*>(out.halves), _mm256_permutevar8x32_epi32(halves, idx));
}
#endif

}  // namespace

#pragma GCC pop_options
