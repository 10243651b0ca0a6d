// GGUF-quantized weights kept in their block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: 32 values a block;
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS: 256 a block in 8 sub-blocks of 32): their unpacking, the dot products of
// the 32-value formats, Q4_K and Q6_K, and their rows dequantized for embedding lookups (those on 256-value
// activation blocks, Q2_K, Q3_K, Q5_K and IQ4_XS, are quant_k.cpp's). Here: the formats and the scalar code; the
// AVX2 kernels are quant_avx2.cpp's, the choice between the two and the entry points quant_dispatch.cpp's, and the
// matmul over them is quant_matmul.cpp's.
// For those formats, as llama.cpp does, x is quantized first, per row and 32 values, to int8 with one float scale
// (QX below); each block (sub-block) of W is unpacked in registers to 32 small integers q with a float scale s (and
// a min m for the formats that have one: w = s q + m; the K-quants' integer scales k: w = s k q + m), and the 32
// products come from integer dot products:
//   sum_i w_i x_i ~= s dx k sum_i q_i qx_i + m dx sum_i qx_i.
// The integer sums are exact, so the AVX2 path (vpmaddubsw and vpmaddwd; vpdpbusd where AVX-512 VNNI has it, the
// same integers and the same float steps, so the same bits) and the scalar one agree up to float rounding (their
// float steps differ). A step reads each quantized row once for up to QMR rows of x.
#include "common.h"
#if (defined(__AVX2__) || defined(__F16C__)) && !defined(KVSERVE_PORTABLE)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(KVSERVE_PORTABLE)
#define KV_HAVE_QAVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KV_HAVE_QVNNI 1   // AVX-512 VNNI's dot products (vpdpbusd, vpdpwssd) on the AVX2 path's 256-bit registers
#endif
#endif

// Each row's sums in a fixed order, whatever the row tile it shares (a request's result must not depend on its
// batch): -ffast-math's reassociation would let the compiler reorder them differently in each instantiation.
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

namespace {

// ggml type ids (gguf's GGMLQuantizationType), and kvserve's own INT8 (quant_int8.cpp; no ggml type)
enum QType { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
             IQ4_NL = 20, IQ4_XS = 23, INT8 = 200 };

// eight 32-value blocks of a quantized activation row, block b: x_i ~= d[b] q_i, sum[b] = d[b] * sum_i q_i. The
// quants are chunk-major: q[c][4 b + i] is value 4 c + i of block b, so that one 32-byte load holds 4 values of
// each of the 8 blocks and the kernels' int32 lanes are the blocks (one float step serves 8 blocks). A row's last
// QX, when K / 32 is not a multiple of 8, has zeros (q, d, sum and halves) for the blocks past the row's end.
// halves[2 b + h] = the sum of q over values 16 h .. 16 h + 15 of block b (Q6_K has a scale per 16 values; with
// VNNI, Q8_0 and IQ4_NL take off their offset of 128 by the block's sum, both halves).
struct alignas(32) QX {
  int8_t q[8][32];
  float d[8];
  float sum[8];
  int16_t halves[16];
};
constexpr int QXB = 8;   // blocks per QX

// value i of block b of a QX
inline int8_t qx_value(const QX& o, int b, int i) { return o.q[i / 4][4 * b + i % 4]; }

inline float fp16_to_f32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__) && !defined(KVSERVE_PORTABLE)
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {   // subnormal: normalize
    int e = -1;
    uint32_t m = man;
    do { ++e; m <<= 1; } while (!(m & 0x400));
    u = sign | uint32_t(112 - e) << 23 | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// the 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4)
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// all 8 scales and mins of a Q4_K / Q5_K super-block at once: the 12 packed bytes rearranged into 8 scale bytes
// then 8 min bytes (llama.cpp's kmask trick; scale_min_k4 per sub-block, unrolled)
inline void k4_ints(const uint8_t* b, uint8_t* out) {
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  const uint32_t mask6 = 0x3f3f3f3f, mask4 = 0x0f0f0f0f, mask2 = 0x03030303;
  u[3] = ((u[2] >> 4) & mask4) | (((u[1] >> 6) & mask2) << 4);
  const uint32_t mins_lo = u[1] & mask6;
  u[1] = (u[2] & mask4) | (((u[0] >> 6) & mask2) << 4);
  u[2] = mins_lo;
  u[0] &= mask6;
  std::memcpy(out, u, 16);
}

// One sub-block of 32 weights: q[i] (0..63 unsigned with a min, or signed), scale s and min m (w = s q + m), and
// for Q6_K the integer scales of its two halves (isc; 1 elsewhere) by which the halves' integer sums are weighted.
struct Sub {
  int8_t q[32];
  float s, m;
  int isc[2];
};

// the scalar unpacking of sub-block j (0..subs-1) of the block at b; the formats' definitions as in ggml-quants.c
template <int T> void unpack_scalar(const uint8_t* b, int j, Sub& o);

template <> void unpack_scalar<Q4_0>(const uint8_t* b, int, Sub& o) {
  o.s = fp16_to_f32(b); o.m = 0; o.isc[0] = o.isc[1] = 1;
  for (int i = 0; i < 16; ++i) { o.q[i] = int8_t((b[2 + i] & 0xF) - 8); o.q[i + 16] = int8_t((b[2 + i] >> 4) - 8); }
}
template <> void unpack_scalar<Q4_1>(const uint8_t* b, int, Sub& o) {
  o.s = fp16_to_f32(b); o.m = fp16_to_f32(b + 2); o.isc[0] = o.isc[1] = 1;
  for (int i = 0; i < 16; ++i) { o.q[i] = int8_t(b[4 + i] & 0xF); o.q[i + 16] = int8_t(b[4 + i] >> 4); }
}
inline void unpack5(const uint8_t* qh4, const uint8_t* qs, int offset, Sub& o) {
  uint32_t qh;
  std::memcpy(&qh, qh4, 4);
  for (int i = 0; i < 16; ++i) {
    o.q[i] = int8_t(((qs[i] & 0xF) | (((qh >> i) & 1) << 4)) - offset);
    o.q[i + 16] = int8_t(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - offset);
  }
}
template <> void unpack_scalar<Q5_0>(const uint8_t* b, int, Sub& o) {
  o.s = fp16_to_f32(b); o.m = 0; o.isc[0] = o.isc[1] = 1;
  unpack5(b + 2, b + 6, 16, o);
}
template <> void unpack_scalar<Q5_1>(const uint8_t* b, int, Sub& o) {
  o.s = fp16_to_f32(b); o.m = fp16_to_f32(b + 2); o.isc[0] = o.isc[1] = 1;
  unpack5(b + 4, b + 8, 0, o);
}
// ggml's IQ4_NL / IQ4_XS values, by 4-bit index
alignas(16) constexpr int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69,
                                                 89, 113};
template <> void unpack_scalar<IQ4_NL>(const uint8_t* b, int, Sub& o) {   // Q4_0's nibbles, the table's values
  o.s = fp16_to_f32(b); o.m = 0; o.isc[0] = o.isc[1] = 1;
  for (int i = 0; i < 16; ++i) { o.q[i] = IQ4_NL_VALUES[b[2 + i] & 0xF]; o.q[i + 16] = IQ4_NL_VALUES[b[2 + i] >> 4]; }
}
template <> void unpack_scalar<Q8_0>(const uint8_t* b, int, Sub& o) {
  o.s = fp16_to_f32(b); o.m = 0; o.isc[0] = o.isc[1] = 1;
  std::memcpy(o.q, b + 2, 32);
}
inline void k4_scales(const uint8_t* b, int j, Sub& o) {
  int sc, mn;
  scale_min_k4(j, b + 4, sc, mn);
  o.s = fp16_to_f32(b) * float(sc);
  o.m = -(fp16_to_f32(b + 2) * float(mn));
  o.isc[0] = o.isc[1] = 1;
}
template <> void unpack_scalar<Q4_K>(const uint8_t* b, int j, Sub& o) {
  k4_scales(b, j, o);
  const uint8_t* qs = b + 16 + 32 * (j / 2);
  for (int i = 0; i < 32; ++i) o.q[i] = int8_t(j % 2 ? qs[i] >> 4 : qs[i] & 0xF);
}
template <> void unpack_scalar<Q6_K>(const uint8_t* b, int j, Sub& o) {
  const int h = j / 4, i4 = j % 4;
  const uint8_t* ql = b + 64 * h + 32 * (i4 & 1);
  const uint8_t* qh = b + 128 + 32 * h;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h);
  o.s = fp16_to_f32(b + 208); o.m = 0;
  o.isc[0] = sc[2 * i4]; o.isc[1] = sc[2 * i4 + 1];
  for (int i = 0; i < 32; ++i)
    o.q[i] = int8_t((((ql[i] >> (4 * (i4 >> 1))) & 0xF) | (((qh[i] >> (2 * i4)) & 3) << 4)) - 32);
}

template <int T> struct Format;
template <> struct Format<Q4_0> { static constexpr int SUBS = 1, BYTES = 18; static constexpr bool MIN = false; };
template <> struct Format<Q4_1> { static constexpr int SUBS = 1, BYTES = 20; static constexpr bool MIN = true; };
template <> struct Format<Q5_0> { static constexpr int SUBS = 1, BYTES = 22; static constexpr bool MIN = false; };
template <> struct Format<Q5_1> { static constexpr int SUBS = 1, BYTES = 24; static constexpr bool MIN = true; };
template <> struct Format<Q8_0> { static constexpr int SUBS = 1, BYTES = 34; static constexpr bool MIN = false; };
template <> struct Format<IQ4_NL> { static constexpr int SUBS = 1, BYTES = 18; static constexpr bool MIN = false; };
template <> struct Format<Q2_K> { static constexpr int SUBS = 8, BYTES = 84; static constexpr bool MIN = true; };
template <> struct Format<Q3_K> { static constexpr int SUBS = 8, BYTES = 110; static constexpr bool MIN = true; };
template <> struct Format<IQ4_XS> { static constexpr int SUBS = 8, BYTES = 136; static constexpr bool MIN = false; };
template <> struct Format<Q4_K> { static constexpr int SUBS = 8, BYTES = 144; static constexpr bool MIN = true; };
template <> struct Format<Q5_K> { static constexpr int SUBS = 8, BYTES = 176; static constexpr bool MIN = true; };
template <> struct Format<Q6_K> { static constexpr int SUBS = 8, BYTES = 210; static constexpr bool MIN = false; };

// the formats on 256-value activation blocks (quant_k.cpp)
template <int T> constexpr bool on_qk() { return T == Q2_K || T == Q3_K || T == Q5_K || T == IQ4_XS; }

// The 32-value formats' fields and where they sit in a block: the 4- and 5-bit formats' quants as unsigned bytes
// with a min or offset (w = s q + m; Q4_0: m = -8 s, Q5_0: m = -16 s), Q8_0's as signed bytes, IQ4_NL's as
// indices (nibbles, as Q4_0's) into its table of signed values
template <int T> struct Layout;
template <> struct Layout<Q4_0> { static constexpr int QS = 2, QH = -1, M = -1, OFFSET = 8; };
template <> struct Layout<Q4_1> { static constexpr int QS = 4, QH = -1, M = 2, OFFSET = 0; };
template <> struct Layout<Q5_0> { static constexpr int QS = 6, QH = 2, M = -1, OFFSET = 16; };
template <> struct Layout<Q5_1> { static constexpr int QS = 8, QH = 4, M = 2, OFFSET = 0; };
template <> struct Layout<Q8_0> { static constexpr int QS = 2, QH = -1, M = -1, OFFSET = 0; };   // signed bytes
template <> struct Layout<IQ4_NL> { static constexpr int QS = 2, QH = -1, M = -1, OFFSET = 0; };   // table indices
// the 32-value formats whose values are signed bytes in the kernels' registers (Q8_0's; IQ4_NL's table values)
template <int T> constexpr bool signed_octets() { return T == Q8_0 || T == IQ4_NL; }

// The 32-value formats as the kernels keep them (kvserve_quant_repack; type id OCTETS | the ggml type): the same
// bytes as the file's blocks, reordered within each row. A row's blocks go in groups of 8 (the last group holds the
// rest), and a group of g holds its blocks' fields one after another: the g scales (fp16), the g mins (Q4_1, Q5_1),
// the g 32-bit high-bit words (Q5_0, Q5_1; each word's bits transposed, qh_transpose, so that a chunk's high bits
// come out with one shift), then for c = 0, 1, ... the g blocks' quant bytes 4 c .. 4 c + 3 (4-/5-bit and IQ4_NL: c
// < 4, nibbles of values 4 c + i and 16 + 4 c + i; Q8_0: c < 8, values 4 c + i). One 32-byte load of a full group
// then gives a chunk of each of the 8 blocks in the int32 lanes QX's chunk-major activations want, with no
// shuffling at run time.
constexpr int64_t OCTETS = 256;

// where byte k of block b of a group of g blocks sits in the group, in the kernels' order
template <int T> inline int octet_pos(int g, int b, int k) {
  using L = Layout<T>;
  if (k < 2) return 2 * b + k;   // the scale
  int base = 2 * g;
  if constexpr (L::M >= 0) {
    if (k < L::M + 2) return base + 2 * b + k - L::M;
    base += 2 * g;
  }
  if constexpr (L::QH >= 0) {
    if (k < L::QH + 4) return base + 4 * b + k - L::QH;
    base += 4 * g;
  }
  const int n = k - L::QS;   // quant byte n = 4 c + i
  return base + 4 * ((n / 4) * g + b) + n % 4;
}

// Q4_K super-blocks as the kernels keep them (OCTETS | Q4_K): d, dmin and the 12 bytes of scales and mins as in
// the file, then the 256 quants chunk-major as an octet of a 32-value format, sub-block b in lane b: byte
// 16 + 32 c + 4 b + i holds value 4 c + i of sub-block b in its low nibble and value 16 + 4 c + i in its high one
// (the file: value v of sub-block b in nibble b % 2 of byte 16 + 32 (b / 2) + v). One super-block, src to dst.
inline int bits(const uint8_t* p, int at, int shift, int mask) { return (p[at] >> shift) & mask; }
inline void k4_repack(const uint8_t* src, uint8_t* dst, bool to_raw) {
  std::memcpy(dst, src, 16);
  const uint8_t* s = src + 16;
  uint8_t* d = dst + 16;
  if (!to_raw) {   // packed byte 32 c + 4 b + i: values 4 c + i and 16 + 4 c + i of sub-block b
    for (int c = 0; c < 4; ++c)
      for (int b = 0; b < 8; ++b)
        for (int i = 0; i < 4; ++i) {
          const int at = 32 * (b / 2) + 4 * c + i, shift = 4 * (b % 2);
          d[32 * c + 4 * b + i] = uint8_t(bits(s, at, shift, 0xF) | bits(s, at + 16, shift, 0xF) << 4);
        }
  } else {   // file byte 32 p + v: value v of sub-blocks 2 p and 2 p + 1
    for (int p = 0; p < 4; ++p)
      for (int v = 0; v < 32; ++v) {
        const int at = 32 * (v % 16 / 4) + 8 * p + v % 4, shift = 4 * (v / 16);
        d[32 * p + v] = uint8_t(bits(s, at, shift, 0xF) | bits(s, at + 4, shift, 0xF) << 4);
      }
  }
}

// Q6_K super-blocks as the kernels keep them (OCTETS | Q6_K): each 6-bit value's low 4 bits where Q4_K's packed
// super-block has its value (bytes 0..127), its high 2 bits chunk-major too: bits 2 (v % 16 / 4) and up of byte
// 128 + 32 (v / 16) + 4 b + v % 4 hold those of value v of sub-block b; the 16 scales and d as in the file (bytes
// 192..209). The file: value v of sub-block b = 4 h + k has its low bits in byte 64 h + 32 (k % 2) + v at shift
// 4 (k / 2), its high bits in byte 128 + 32 h + v at shift 2 k.
inline void k6_repack(const uint8_t* src, uint8_t* dst, bool to_raw) {
  std::memcpy(dst + 192, src + 192, 18);
  if (!to_raw) {
    for (int c = 0; c < 4; ++c)   // low bits: byte 32 c + 4 b + i, values 4 c + i and 16 + 4 c + i of sub-block b
      for (int b = 0; b < 8; ++b)
        for (int i = 0; i < 4; ++i) {
          const int h = b / 4, k = b % 4, at = 64 * h + 32 * (k % 2) + 4 * c + i, shift = 4 * (k / 2);
          dst[32 * c + 4 * b + i] = uint8_t(bits(src, at, shift, 0xF) | bits(src, at + 16, shift, 0xF) << 4);
        }
    for (int half = 0; half < 2; ++half)   // high bits: byte 128 + 32 half + 4 b + i, values 16 half + 4 c + i
      for (int b = 0; b < 8; ++b)
        for (int i = 0; i < 4; ++i) {
          int v = 0;
          for (int c = 0; c < 4; ++c)
            v |= bits(src, 128 + 32 * (b / 4) + 16 * half + 4 * c + i, 2 * (b % 4), 3) << 2 * c;
          dst[128 + 32 * half + 4 * b + i] = uint8_t(v);
        }
  } else {
    for (int h = 0; h < 2; ++h)   // low bits: byte 64 h + 32 m + v, value v of sub-blocks 4 h + m and 4 h + m + 2
      for (int m = 0; m < 2; ++m)
        for (int v = 0; v < 32; ++v) {
          const int at = 32 * (v % 16 / 4) + 4 * (4 * h + m) + v % 4, shift = 4 * (v / 16);
          dst[64 * h + 32 * m + v] = uint8_t(bits(src, at, shift, 0xF) | bits(src, at + 8, shift, 0xF) << 4);
        }
    for (int h = 0; h < 2; ++h)   // high bits: byte 128 + 32 h + v, value v of sub-blocks 4 h + k at bits 2 k
      for (int v = 0; v < 32; ++v) {
        int bitsv = 0;
        for (int k = 0; k < 4; ++k)
          bitsv |= bits(src, 128 + 32 * (v / 16) + 4 * (4 * h + k) + v % 4, 2 * (v % 16 / 4), 3) << 2 * k;
        dst[128 + 32 * h + v] = uint8_t(bitsv);
      }
  }
}

// A 5-bit block's 32 high bits (Q5_0, Q5_1) in the file's order (bit v: value v) -> the kernels' (bit c of byte i:
// value 4 c + i, the value that chunk c holds in byte i of the block's lane), or back (to_raw), in place at p
inline void qh_transpose(uint8_t* p, bool to_raw) {
  uint32_t in, out = 0;
  std::memcpy(&in, p, 4);
  for (int i = 0; i < 4; ++i) {
    if (to_raw) {   // byte i's bit c to bit 4 c + i: spread 8 bits 4 apart
      uint32_t x = (in >> 8 * i) & 0xFFu;
      x = (x | x << 12) & 0x000F000Fu;
      x = (x | x << 6) & 0x03030303u;
      x = (x | x << 3) & 0x11111111u;
      out |= x << i;
    } else {   // bits i, 4 + i, ..., 28 + i gathered into byte i
      uint32_t x = (in >> i) & 0x11111111u;
      x = (x | x >> 3) & 0x03030303u;
      x = (x | x >> 6) & 0x000F000Fu;
      x = (x | x >> 12) & 0xFFu;
      out |= x << 8 * i;
    }
  }
  std::memcpy(p, &out, 4);
}

// a row of nb blocks from the file's order to the kernels' (or back, to_raw), src to dst
template <int T> void repack_row(const uint8_t* src, uint8_t* dst, int64_t nb, bool to_raw) {
  constexpr int B = Format<T>::BYTES;
  if constexpr (T == Q4_K) {
    for (int64_t j = 0; j < nb; ++j) k4_repack(src + j * B, dst + j * B, to_raw);
  } else if constexpr (T == Q6_K) {
    for (int64_t j = 0; j < nb; ++j) k6_repack(src + j * B, dst + j * B, to_raw);
  } else {
    for (int64_t o = 0; o < nb; o += 8) {
      const int g = int(std::min<int64_t>(8, nb - o));
      for (int b = 0; b < g; ++b) {
        for (int k = 0; k < B; ++k) {
          const int64_t raw = (o + b) * B + k, packed = o * B + octet_pos<T>(g, b, k);
          dst[to_raw ? raw : packed] = src[to_raw ? packed : raw];
        }
        if constexpr (Layout<T>::QH >= 0)
          qh_transpose(dst + (to_raw ? (o + b) * B + Layout<T>::QH : o * B + octet_pos<T>(g, b, Layout<T>::QH)),
                       to_raw);
      }
    }
  }
}

// block j of a packed row of nb blocks, in the file's order, to out
template <int T> void octet_block(const uint8_t* packed, int64_t nb, int64_t j, uint8_t* out) {
  constexpr int B = Format<T>::BYTES;
  if constexpr (Format<T>::SUBS == 8) {
    repack_row<T>(packed + j * B, out, 1, true);
  } else {
    const int64_t o = j - j % 8;
    const int g = int(std::min<int64_t>(8, nb - o)), b = int(j % 8);
    for (int k = 0; k < B; ++k) out[k] = packed[o * B + octet_pos<T>(g, b, k)];
    if constexpr (Layout<T>::QH >= 0) qh_transpose(out + Layout<T>::QH, true);
  }
}

template <int T> constexpr bool in_octets() {
  return T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q5_1 || T == Q8_0 || T == IQ4_NL || T == Q4_K || T == Q6_K;
}
// the bytes of one group of 8 blocks of 32 values (Q4_K: one super-block)
template <int T> constexpr int64_t octet_bytes() {
  return Format<T>::SUBS == 8 ? Format<T>::BYTES : QXB * Format<T>::BYTES;
}

constexpr int QMR = 8;   // rows of x per pass over a weight row (a verification step of k = 7 drafts in one)

// out[r] = dot(W row w, x row r) over its nsub blocks of 32 values for R rows, scalar; the formats in_octets
// (the on_qk ones: quant_k.cpp), packed so
template <int T, int R>
void row_dot_scalar(const uint8_t* w, const QX* const* x, int64_t nsub, float* out) {
  using F = Format<T>;
  static_assert(in_octets<T>());
  float acc[R] = {};
  Sub sub;
  uint8_t raw[F::BYTES];
  for (int64_t j = 0; j < nsub; ++j) {
    if constexpr (F::SUBS == 8) {   // a sub-block of the super-block, back in the file's order once per super-block
      if (j % 8 == 0) octet_block<T>(w, nsub / 8, j / 8, raw);
      unpack_scalar<T>(raw, int(j % 8), sub);
    } else {
      octet_block<T>(w, nsub, j, raw);
      unpack_scalar<T>(raw, 0, sub);
    }
    for (int r = 0; r < R; ++r) {
      int32_t dot = 0;
      const QX& xo = x[r][j / QXB];
      const int b = int(j % QXB);
      for (int h = 0; h < 2; ++h) {   // Q6_K: each half weighted by its integer scale (1 elsewhere)
        int32_t part = 0;
        for (int i = 16 * h; i < 16 * h + 16; ++i) part += int32_t(sub.q[i]) * qx_value(xo, b, i);
        dot += part * sub.isc[h];
      }
      acc[r] += float(dot) * (sub.s * xo.d[b]);
      if (F::MIN) acc[r] += sub.m * xo.sum[b];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

}  // namespace

#pragma GCC pop_options
