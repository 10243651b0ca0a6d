// GGUF-quantized weights kept in their block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: 32 values a block;
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS: 256 a block in 8 sub-blocks of 32): their unpacking, the dot products of
// the 32-value formats, Q4_K and Q6_K, and their rows dequantized for embedding lookups (those on 256-value
// activation blocks, Q2_K, Q3_K, Q5_K and IQ4_XS, are quant_k.cpp's). The matmul over them is quant_matmul.cpp's.
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
