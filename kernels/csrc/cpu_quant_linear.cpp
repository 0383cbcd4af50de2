// Linear layers over weights kept packed in 8, 6, 5 or 4 bits (GGUF files), for CPUs.
//
// Four packed layouts, repacked at load from the GGUF block formats
// (services/worker/gguf_repack.py says which format goes where):
//   int8  qweight [N, K] int8, scales [N, K / G] fp32 or fp16:   w = q * s
//   int4  qweight [N, K / 2] uint8, scales and mins [N, K / 32] fp32 or fp16:
//         w = q * s + m, q in [0, 16); in each group of 32, byte j holds
//         element j in its low nibble and element j + 16 in its high one.
//         Without mins (Q4_0) each is -8 * s, formed in fp32 as it is used:
//         exact, so the bits of the same mins stored.
//   int5  int4's qweight, scales and mins plus qhigh [N, K / 8] uint8, the
//         fifth bits: per group of 32 a little-endian uint32 whose bit j is
//         element j's (Q5_0's qh as the file holds it), so q in [0, 32).
//         Without mins (Q5_0) each is -16 * s, exact as Q4_0's. With the K
//         formats' records (Q5_K) qhigh holds bit planes instead, 32 bytes a
//         super-block in the order tile_i8_super unpacks a pair of groups
//         (2p, 2p + 1): byte i, bit 2p the fifth bit of the pair's lo vector's
//         byte i (element i of group 2p for i < 16, else element i - 16 of
//         2p + 1), bit 2p + 1 that of its hi vector's (the element 16 further).
//   int6  (Q6_K) qweight [N, K / 2] uint8, the low four bits, and qhigh [N, K / 4]
//         uint8, the two high bits, as Q6_K's blocks hold them (ql and qh): per 128
//         weights 64 bytes of qweight, byte l holding element l (low nibble) and
//         l + 64 (high), byte 32 + l elements 32 + l and 96 + l, and 32 of qhigh,
//         byte l holding the high bits of elements l, 32 + l, 64 + l and 96 + l in
//         its bits 0-1, 2-3, 4-5 and 6-7; so q in [0, 64), scales per 16 (group_size
//         16, no mins) and w = (q - 32) * s. The kernels unpack 128 weights at a time
//         (int6_chunk) and take the int8 layout's integer dots: sum (q - 32) x, as
//         sum q x - 32 sum x, exactly the int8 layout's integers for Q6_K, so its bits.
// The layout is int4 where qweight holds K / 2 bytes a row (int5 where a qhigh
// tensor comes with it, int6 where the groups are 16; every op takes qhigh as its last,
// optional argument), else int8. The K
// formats' scales (and int4 mins) come per super-block of 256 weights instead,
// scales [N, K / 256, record] uint8 (SuperScales): quant_linear_i16 forms each
// group's d * sc and -(dmin * m) in fp32 as it reads them, exactly, so the bits
// of fp32 scales and mins per group holding those values; quant_linear_i8 takes
// them a super-block at a time (the super-block path, below).
// Every product q * s is exact in fp32 for the GGUF formats, so the weights
// this code rebuilds equal the gguf package's dequantization bit for bit.
// fp16 scales (the 32-element formats' own) are read by the integer-activation
// paths only, converted exactly per weight row as it is used.
//
// Batch invariance: quant_linear_i8 and quant_linear_i16 sum each (row of x,
// weight row) pair in one order, the same in every tile size, in the batch-1
// path and in every block of rows a long call is cut into, so a row's output
// has the same bits whatever other rows share the call (prefill chunks,
// speculative verify steps, other requests). They serve every row count.
//
// quant_linear_i8 (as llama.cpp does it; weft's default): each row of x is rounded to int8 per
// group of G (one fp32 scale, amax / 127), then every block of 32 is one integer dot product of
// 32 int8 pairs (VNNI vpdpbusd, or AVX2 maddubs + madd) and one fp32 FMA by the product of the
// two scales. The int4 min term is folded: sum_j x_j (q_j s + m) = s * sum_j x_j q_j + m * sum_j
// x_j, with the group sums of the rounded x computed once per call. It runs in register tiles of
// weight rows by rows of x (tile_i8_int4, tile_i8_int8): 2 x 1 at batch 1 (each x block loaded
// once for two weight rows, the next rows prefetched a share per step), 2 x 4, 4 x 2 and 4 x 1
// above, each (x row, weight row) pair with its own
// accumulator and the same operations in the same order in every tile shape. The int5 layout
// runs the int4 tiles (tile_i8_int4<..., kInt5>) with each weight row's fifth bits ORed into its
// unpacked nibbles (fifth_bits_pair; Q5_K's super-block tile from its bit planes,
// fifth_bits_of_planes); the arithmetic after is int4's. The int6 layout runs the
// int8 tiles (tile_i8_int8<..., kInt6>) on its weights unpacked 128 at a time into a small buffer
// per weight row, with 32 sum x taken off each lane's dot (ActInt8::bias). fp16 scales and
// mins are converted in registers as they are read. The weights are read once per block of x
// rows, packed; nothing is stored but int6's 128 bytes a tile row. Numerics: x is rounded to int8 (an error of up to amax / 254
// per element); the rest is exact integer arithmetic and fp32 sums in another order than the
// twin's.
// The super-block path (Q4_K, Q5_K, Q6_K: the int4, int5 or int6 layout with the K formats'
// records), as llama.cpp's Q4_K and Q6_K x Q8_K dots: each row of x is rounded to int8 per 256
// instead (one scale, amax / 127, with integer sums per 32 for the mins, or Q6_K's 32 times each
// pair's sum), and per super-block of each (weight row, x row) the groups' maddubs sums are
// multiplied by their sc in vpmaddwd (where the per-group path multiplies by ones) and added in
// int32, then converted and FMAed once by d times x's scale; Q4_K's and Q5_K's min term is an
// integer vpmaddwd of the eight m with x's sums, times dmin times x's scale, once per super-block
// (tile_i8_super, super_min_terms, tile_i8_super6; the scalar loop dot_row_scalar_super). The same
// operations in the same order for a pair in every tile shape and build (the AVX-512 build runs
// them two weight rows to a zmm, tile_i8_super_zmm and tile_i8_super6_zmm): batch invariant. The fp32-scale fallback of the K formats (K past the
// records' reach, a tensor-parallel slice off super-blocks) keeps the per-group path.
// quant_linear_i16: the same with x rounded to int16 (amax / 32767, 258 times finer), the
// weights widened to int16 in registers and pairs multiplied and added in int32 (VNNI
// vpdpwssd, AVX2 vpmaddwd): about half the instructions per weight of the fp32 path,
// and close enough to it that the default model keeps its greedy tokens. Both ops are one
// template (quant_linear_integer): the same checks, the same walk of weight rows in tiles
// (rows_tiles), the same scalar loop for builds without AVX2; only the rounding of x and the
// tile kernels (TilesI8, TilesI16) differ.
// quant_linear (fp32 activations): a weight row dequantized in registers, or a
// tile of kTileRows rows into an L1 buffer for more rows of x; differs from a
// float matmul over the dequantized weight only in the order of the sums.
// dequantize_rows (many rows of x): the caller turns a chunk of rows back
// into fp32 and runs a float GEMM on it.
//
// Built once per instruction set (kernels/cpu_quant_linear.py): AVX-512 with
// VNNI, AVX2 + FMA, and generic (the scalar loops, which are also the tails'). The
// AVX-512 build (WEFT_ZMM) runs quant_linear_i8's tiles of an even number of weight
// rows (all but the 1 x 4 and 1 x 1 tails) two weight rows to a 512-bit vector: each
// half is the 8-lane accumulator of the 256-bit tile, x's bytes and scales broadcast
// into both halves, the same operations per lane, so the same bits as the AVX2 build
// (tile_i8_int4_zmm, tile_i8_int8_zmm, min_terms_zmm; 4 x 4 tiles above 3 rows of x), and so
// does the super-block path (tile_i8_super_zmm, tile_i8_super6_zmm: each int32 lane's products
// from vpdpbusd, scaled by one exact vpdpwssd, lane_sc_zmm). From 8 rows of x the tiles of a block of four weight rows share its
// weight side, formed once (rows_tiles' Block: SuperRows, Super6Rows), and every zmm tile sums its
// accumulators eight at a time (hsums).
// Everything else (quant_linear_i16, the fp32 paths) is the AVX2 code with VNNI dots
// on 256-bit vectors. Each build
// registers its ops under its own namespace (QUANT_LIBRARY_NS), so a process can
// load several and tests can compare them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <string>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define WEFT_AVX2 1
#endif
#if defined(WEFT_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define WEFT_VNNI 1
#endif
#if defined(WEFT_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define WEFT_ZMM 1  // quant_linear_i8's tiles of an even number of weight rows run on 512-bit vectors
#endif

#ifndef QUANT_LIBRARY_NS
#define QUANT_LIBRARY_NS weft_quant
#endif
// An indirection so QUANT_LIBRARY_NS is expanded before TORCH_LIBRARY pastes it into names.
#define WEFT_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace {

constexpr int64_t kTileRows = 4;
constexpr int64_t kInt4Group = 32;

// One weight row of the int8 layout, dequantized into out[K].
void dequant_row_int8(const int8_t* q, const float* scales, int64_t K, int64_t group, float* out) {
  for (int64_t g = 0; g < K / group; ++g) {
    const int8_t* qg = q + g * group;
    float* og = out + g * group;
    int64_t j = 0;
#ifdef WEFT_AVX2
    const __m256 s = _mm256_set1_ps(scales[g]);
    for (; j + 8 <= group; j += 8) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + j));
      _mm256_storeu_ps(og + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s));
    }
#endif
    for (; j < group; ++j) og[j] = static_cast<float>(qg[j]) * scales[g];
  }
}

// The factor of the implied mins (none stored) of Q4_0 (-8, int4) and Q5_0 (-16, int5): a power of
// two, so each min, factor times the scale, is exact in fp32, the value a stored min would hold.
inline float implied_min_factor(bool int5) { return int5 ? -16.f : -8.f; }

// The fifth bit of element j of group g of an int5 row (its qhigh at h), as 0 or 16: from the
// group's word, or (planes: Q5_K with its records) bit 2p or 2p + 1 of its super-block's planes.
inline int fifth_bit(const uint8_t* h, int64_t g, int64_t j, bool planes) {
  if (!planes) return ((h[g * 4 + j / 8] >> (j % 8)) & 1) << 4;
  const int64_t byte = g % 2 * 16 + j % 16, bit = g % 8 / 2 * 2 + j / 16;
  return ((h[g / 8 * 32 + byte] >> bit) & 1) << 4;
}

// Element j of an int6 row (its low bits at q, its high bits at h): q in [0, 64).
inline int int6_value(const uint8_t* q, const uint8_t* h, int64_t j) {
  const int64_t chunk = j / 128, quarter = j % 128 / 32, l = j % 32;  // quarter: which 32 of the 128
  const uint8_t byte = q[chunk * 64 + quarter % 2 * 32 + l];
  const int low = quarter < 2 ? (byte & 0x0F) : (byte >> 4);
  return low | ((h[chunk * 32 + l] >> (2 * quarter)) & 3) << 4;
}

#ifdef WEFT_AVX2
// 0x10 in byte i of `bytes` where its bit i % 8 is set, else 0.
inline __m256i bits_to_0x10(__m256i bytes) {
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

// The fifth bits of one int5 group (its qhigh word at h) as bytes in element order, 0x10 where set:
// the word broadcast, byte i / 8 of it shuffled into byte i (elements 0-15 in the low 128 bits,
// 16-31 in the high, as int4_block has them), then the bit of each byte tested.
inline __m256i fifth_bits(const uint8_t* h) {
  uint32_t word;
  std::memcpy(&word, h, 4);
  const __m256i which = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  return bits_to_0x10(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(word)), which));
}

// The fifth bits of two consecutive int5 groups b, b + 1 (their words at h) in the order the tiles
// unpack a pair of groups' nibbles: lo holds elements 0-15 of b then 0-15 of b + 1, hi elements
// 16-31 of b then 16-31 of b + 1.
inline void fifth_bits_pair(const uint8_t* h, __m256i& lo, __m256i& hi) {
  int64_t words;
  std::memcpy(&words, h, 8);
  const __m256i v = _mm256_set1_epi64x(words);  // each 128-bit lane: b's four bytes, b + 1's four
  lo = bits_to_0x10(
      _mm256_shuffle_epi8(v, _mm256_setr_epi64x(0, 0x0101010101010101, 0x0404040404040404, 0x0505050505050505)));
  hi = bits_to_0x10(_mm256_shuffle_epi8(
      v, _mm256_setr_epi64x(0x0202020202020202, 0x0303030303030303, 0x0606060606060606, 0x0707070707070707)));
}

// Bit kBit of each byte of v as 0x10, the byte's other bits cleared: the 16-bit shift moves each
// byte's bit kBit onto its bit 4 (by at most 4 places, so no byte's bit 4 receives the other's).
template <int kBit>
inline __m256i bit_as_0x10(__m256i v) {
  __m256i moved = v;
  if constexpr (kBit < 4) moved = _mm256_slli_epi16(v, 4 - kBit);
  if constexpr (kBit > 4) moved = _mm256_srli_epi16(v, kBit - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

// The fifth bits of Q5_K's pair kPair (groups 2 kPair, 2 kPair + 1) of a super-block, from its 32
// bytes of bit planes, in fifth_bits_pair's order: a shift and a mask each, where the per-group
// words take a broadcast, two shuffles and two tests (ggml's Q5_K dot reads its qh so).
template <int kPair>
inline void fifth_bits_of_planes(__m256i planes, __m256i& lo, __m256i& hi) {
  lo = bit_as_0x10<2 * kPair>(planes);
  hi = bit_as_0x10<2 * kPair + 1>(planes);
}

// The fifth bits of group g of a Q5_K row (its bit planes at h) as bytes in element order, 0x10
// where set: the group is half g % 2 of its pair's lo and hi vectors, so its elements 0-15 are bit
// 2p, its 16-31 bit 2p + 1, of that half's 16 plane bytes (p = g % 8 / 2).
inline __m256i fifth_bits_of_group_planes(const uint8_t* h, int64_t g) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + g / 8 * 32 + g % 2 * 16));
  const int bit = static_cast<int>(g % 8 / 2 * 2);
  const __m128i one = _mm_set1_epi8(1);
  const __m128i low = _mm_and_si128(_mm_srl_epi16(half, _mm_cvtsi32_si128(bit)), one);
  const __m128i high = _mm_and_si128(_mm_srl_epi16(half, _mm_cvtsi32_si128(bit + 1)), one);
  return _mm256_slli_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1), 4);
}

// Group g's low (elements 0-15) and high (16-31) nibbles as bytes (qg its 16 bytes), with the
// fifth bits where the row has them (h its qhigh row, not null; planes: Q5_K's bit planes).
inline void group_bytes(const uint8_t* qg, const uint8_t* h, int64_t g, bool planes, __m128i& low, __m128i& high) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
  low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  if (h != nullptr) {
    const __m256i fifth = planes ? fifth_bits_of_group_planes(h, g) : fifth_bits(h + g * 4);
    low = _mm_or_si128(low, _mm256_castsi256_si128(fifth));
    high = _mm_or_si128(high, _mm256_extracti128_si256(fifth, 1));
  }
}
#endif

// Weights [128 c, 128 c + 128) of an int6 row (low bits at q, high bits at h) as bytes q in
// [0, 64), in element order: Q6_K's own unpacking, four 32-byte vectors from two of low bits and
// one of high bits (the masked 16-bit shifts move no bit across a byte). int6_vectors leaves them in
// registers (blocks 4c .. 4c + 3), int6_chunk stores them into out[128].
#ifdef WEFT_AVX2
inline void int6_vectors(const uint8_t* q, const uint8_t* h, int64_t c, __m256i (&parts)[4]) {
  const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 64));
  const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 64 + 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + c * 32));
  const __m256i low = _mm256_set1_epi8(0x0F);
  parts[0] = _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x03)), 4));
  parts[1] = _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x0C)), 2));
  parts[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(qh, _mm256_set1_epi8(0x30)));
  parts[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                             _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(static_cast<char>(0xC0))), 2));
}
#endif

inline void int6_chunk(const uint8_t* q, const uint8_t* h, int64_t c, uint8_t* out) {
#ifdef WEFT_AVX2
  __m256i parts[4];
  int6_vectors(q, h, c, parts);
  for (int i = 0; i < 4; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * i), parts[i]);
#else
  for (int64_t e = 0; e < 128; ++e) out[e] = static_cast<uint8_t>(int6_value(q, h, c * 128 + e));
#endif
}

// One weight row of the int6 layout, dequantized into out[K]: 128 weights at a time unpacked to
// int8 q - 32, then as the int8 layout (the same products, so the same bits).
void dequant_row_int6(const uint8_t* q, const uint8_t* h, const float* scales, int64_t K, float* out) {
  alignas(32) uint8_t chunk[128];
  alignas(32) int8_t values[128];
  for (int64_t c = 0; c < K / 128; ++c) {
    int6_chunk(q, h, c, chunk);
    for (int e = 0; e < 128; ++e) values[e] = static_cast<int8_t>(chunk[e] - 32);
    dequant_row_int8(values, scales + 8 * c, 128, 16, out + c * 128);
  }
}

// One weight row of the int4 or (high: its qhigh row; planes: Q5_K's bit planes) int5 layout,
// dequantized into out[K].
void dequant_row_int4(const uint8_t* q, const uint8_t* high, bool planes, const float* scales, const float* mins,
                      int64_t K, float* out) {
  for (int64_t g = 0; g < K / kInt4Group; ++g) {
    const uint8_t* qg = q + g * (kInt4Group / 2);
    float* og = out + g * kInt4Group;
    const float min = mins[g];
#ifdef WEFT_AVX2
    const __m256 s = _mm256_set1_ps(scales[g]);
    const __m256 m = _mm256_set1_ps(min);
    __m128i low, hi;
    group_bytes(qg, high, g, planes, low, hi);
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), hi, _mm_srli_si128(hi, 8)};
    for (int p = 0; p < 4; ++p) {
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]));
      _mm256_storeu_ps(og + 8 * p, _mm256_fmadd_ps(v, s, m));
    }
#else
    // One rounding (fma), as the AVX2 build's FMA: the same bits in every build.
    for (int64_t j = 0; j < kInt4Group / 2; ++j) {
      const int lo5 = high != nullptr ? fifth_bit(high, g, j, planes) : 0;
      const int hi5 = high != nullptr ? fifth_bit(high, g, j + 16, planes) : 0;
      og[j] = std::fma(static_cast<float>((qg[j] & 0x0F) | lo5), scales[g], min);
      og[j + kInt4Group / 2] = std::fma(static_cast<float>((qg[j] >> 4) | hi5), scales[g], min);
    }
#endif
  }
}

// Where the integer-activation tiles read a weight row's scales (and int4 mins) from: fp32 or fp16
// per group, or the K formats' records per super-block of 256 weights (SuperScales).
enum class ScaleKind { kFloat, kHalf, kSuper };

// The K formats' scales, scales [N, K / 256, record] uint8: per super-block of 256 weights, fp16 d,
// then for the int4 layout (Q4_K) fp16 dmin, the 8 groups' uint8 sc and their uint8 m (20 bytes),
// for the int8 layout by 16 (Q6_K) the 16 groups' int8 sc (18 bytes). A group's scale is
// float(d) * sc and its min -(float(dmin) * m), formed in fp32 as they are read: a half times an
// integer under 2^8 is exact in fp32, so these are the values an fp32 scale tensor would hold.
struct SuperScales {
  static constexpr int64_t kWeights = 256;
  static int64_t record_bytes(bool int4, int64_t group) {
    return int4 ? 4 + 2 * (kWeights / group) : 2 + kWeights / group;
  }
  static float half_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return c10::detail::fp16_ieee_to_fp32_value(h);
  }
  // Group g's scale of a row's records (its min: RowScales).
  static float scale(const uint8_t* row, int64_t g, bool int4, int64_t group) {
    const int64_t per = kWeights / group;
    const uint8_t* r = row + g / per * record_bytes(int4, group);
    const float sc = int4 ? static_cast<float>(r[4 + g % per]) : static_cast<float>(static_cast<int8_t>(r[2 + g % per]));
    return half_at(r) * sc;
  }
};

struct Packed {
  const uint8_t* qweight;
  int64_t row_bytes;  // bytes of qweight per row
  bool int4_layout;     // int4 or int5: two weights a byte (qweight [N, K / 2]), groups of 32, mins
  const float* scales;  // fp32 scales, or null when they are fp16 (scales_h)
  const float* mins;    // null for the int8 layout, when fp16 (mins_h) and when implied (Q4_0)
  int64_t groups;       // groups per row
  int64_t group;
  int64_t K;
  int64_t N;  // rows
  // fp16 scales and mins (the GGUF blocks' own d and m, kept as they are: exact, and 2 bytes a
  // group less than fp32); only the integer-activation paths read them.
  const uint16_t* scales_h = nullptr;
  const uint16_t* mins_h = nullptr;
  // The K formats' records (SuperScales), the mins inside; only the integer-activation paths read them.
  const uint8_t* super = nullptr;
  // The int5 layout's fifth bits, [N, K / 8] (a uint32 per group of 32; bit planes per super-block
  // with records, fifth_planes), or the int6 layout's two high bits, [N, K / 4]; null for int4 and int8.
  const uint8_t* qhigh = nullptr;
  // int6: Q6_K's low and high bits (qweight, qhigh), groups of 16, no mins; the int8 layout's
  // integer dots (int4_layout false).
  bool int6_layout = false;

  bool int4() const { return int4_layout; }  // two weights a byte of qweight, with mins: int4 or int5
  bool int5() const { return int4_layout && qhigh != nullptr; }
  // Q5_K with its records: the fifth bits as bit planes per super-block (the top of the file).
  bool fifth_planes() const { return int5() && super != nullptr; }
  bool int6() const { return int6_layout; }
  // Q4_K, Q5_K and Q6_K (int4, int5 or int6 with the K formats' records): quant_linear_i8 rounds x
  // per 256 and dots a super-block at a time (tile_i8_super, tile_i8_super6).
  bool super_blocks() const { return (int4_layout || int6_layout) && super != nullptr; }
  int64_t high_row_bytes() const { return int6_layout ? K / 4 : K / 8; }
  const uint8_t* high_row(int64_t n) const { return qhigh != nullptr ? qhigh + n * high_row_bytes() : nullptr; }
  // Whether the int4 layout stores its mins; without, each is implied_min_factor times its scale
  // (Q4_0, Q5_0).
  bool has_mins() const { return mins != nullptr || mins_h != nullptr; }
  float implied_min(float scale) const { return implied_min_factor(int5()) * scale; }
  ScaleKind scale_kind() const {
    return super != nullptr ? ScaleKind::kSuper : scales_h != nullptr ? ScaleKind::kHalf : ScaleKind::kFloat;
  }
  int64_t scale_bytes() const { return scales_h != nullptr ? 2 : 4; }  // of one group's scale (not kSuper)
  // Bytes of scales a row (with a kSuper row's mins).
  int64_t scale_row_bytes() const {
    return super != nullptr ? K / SuperScales::kWeights * SuperScales::record_bytes(int4_layout, group)
                            : groups * scale_bytes();
  }
  const void* scale_row(int64_t n) const {
    if (super != nullptr) return super + n * scale_row_bytes();
    return scales_h != nullptr ? static_cast<const void*>(scales_h + n * groups) : scales + n * groups;
  }
  const void* min_row(int64_t n) const {
    return mins_h != nullptr ? static_cast<const void*>(mins_h + n * groups) : mins + n * groups;
  }
};

#ifdef WEFT_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[i] = hsum(v[i]) for i < count, the same adds of the same lanes (each a sum of its halves, then
// lanes 0 + 2 and 1 + 3, then those two), eight vectors at a time transposed into one: 7 shuffles
// and 7 adds for eight sums where hsum takes 3 and 3 for each.
inline void hsums(const __m256* v, int count, float* out) {
  int i = 0;
  for (; i + 8 <= count; i += 8) {
    // Lane j of the result holds vector j's sum when the pairs below take (0, 4), (1, 5), (2, 6), (3, 7).
    auto halves_added = [&](int a, int b) {  // [a's halves added | b's]
      return _mm256_add_ps(_mm256_permute2f128_ps(v[i + a], v[i + b], 0x20),
                           _mm256_permute2f128_ps(v[i + a], v[i + b], 0x31));
    };
    const __m256 p0 = halves_added(0, 4), p1 = halves_added(1, 5), p2 = halves_added(2, 6), p3 = halves_added(3, 7);
    auto pairs_added = [](__m256 x, __m256 y) {  // per 128 bits: x's lanes 0 + 2, 1 + 3, then y's
      return _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
    };
    const __m256 t01 = pairs_added(p0, p1), t23 = pairs_added(p2, p3);
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(2, 0, 2, 0)),
                                            _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 1, 3, 1))));
  }
  for (; i < count; ++i) out[i] = hsum(v[i]);
}
#endif

// out[m][r] = dot(x[m], w[r]) for the kTileRows rows of w (K floats apart), rows m0..m0+count of x.
void dot_rows(const float* x, int64_t ldx, int64_t count, const float* w, int64_t K, float* out, int64_t ldo,
              int64_t rows) {
  int64_t m = 0;
#ifdef WEFT_AVX2
  for (; m + 2 <= count; m += 2) {
    const float* x0 = x + m * ldx;
    const float* x1 = x0 + ldx;
    __m256 acc[2][kTileRows];
    for (auto& a : acc) for (auto& v : a) v = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 a0 = _mm256_loadu_ps(x0 + k), a1 = _mm256_loadu_ps(x1 + k);
      for (int64_t r = 0; r < kTileRows; ++r) {
        const __m256 wv = _mm256_loadu_ps(w + r * K + k);
        acc[0][r] = _mm256_fmadd_ps(a0, wv, acc[0][r]);
        acc[1][r] = _mm256_fmadd_ps(a1, wv, acc[1][r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      out[m * ldo + r] = hsum(acc[0][r]);
      out[(m + 1) * ldo + r] = hsum(acc[1][r]);
    }
  }
  for (; m < count; ++m) {
    const float* x0 = x + m * ldx;
    __m256 acc[kTileRows];
    for (auto& v : acc) v = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 a0 = _mm256_loadu_ps(x0 + k);
      for (int64_t r = 0; r < kTileRows; ++r) acc[r] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(w + r * K + k), acc[r]);
    }
    for (int64_t r = 0; r < rows; ++r) out[m * ldo + r] = hsum(acc[r]);
  }
#endif
  for (; m < count; ++m) {
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += x[m * ldx + k] * w[r * K + k];
      out[m * ldo + r] = sum;
    }
  }
}

// half_scales: whether the caller reads fp16 scales and mins (the integer-activation paths); the
// fp32-activation paths dequantize with fp32 ones. Every path reads the K formats' records
// (SuperScales: scales [N, K / 256, record] uint8, no mins) through RowScales. The layout is int4 where qweight holds K / 2 bytes a row; its mins are
// optional (none: Q4_0's and Q5_0's, implied by the scales); with qhigh it is int5.
Packed packed_of(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                 const c10::optional<at::Tensor>& qhigh, int64_t group_size, int64_t K, bool half_scales = false) {
  TORCH_CHECK(qweight.dim() == 2, "quant_linear: qweight shape");
  const bool nibbles = qweight.size(1) * 2 == K;  // int4, int5 or (groups of 16) int6
  const bool int6 = nibbles && group_size == 16;
  const bool int4 = nibbles && !int6;
  TORCH_CHECK(nibbles || qweight.size(1) == K, "quant_linear: qweight shape");
  const bool half = scales.scalar_type() == at::kHalf;
  const bool super = scales.dim() == 3 && scales.scalar_type() == at::kByte;
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() &&
                  (scales.scalar_type() == at::kFloat || super || (half_scales && half)),
              "quant_linear: contiguous qweight and ", half_scales ? "fp32 or fp16" : "fp32",
              " scales expected (or the K formats' records)");
  TORCH_CHECK(qweight.scalar_type() == (nibbles ? at::kByte : at::kChar), "quant_linear: qweight must be ",
              nibbles ? "uint8 (int4, int5 or int6 layout)" : "int8 (int8 layout)");
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && K % group_size == 0 && (!int4 || group_size == kInt4Group) &&
                  (!int6 || K % 128 == 0),
              "quant_linear: group_size must divide K and be a multiple of 16 (32 for int4 and int5; 16 for int6, "
              "K a multiple of 128)");
  const int64_t N = qweight.size(0), groups = K / group_size;
  TORCH_CHECK(int4 || !mins.has_value(), "quant_linear: mins go with the int4 layout (qweight [N, K / 2]) only");
  if (super) {
    TORCH_CHECK((int4 || group_size == 16) && !mins.has_value() && K % SuperScales::kWeights == 0 &&
                    scales.size(0) == N && scales.size(1) == K / SuperScales::kWeights &&
                    scales.size(2) == SuperScales::record_bytes(int4, group_size) && groups <= 1024,
                "quant_linear: super-block scales: [N, K / 256, 20] for int4, [N, K / 256, 18] for int8 by 16, no "
                "mins, K <= 32768 (int4) or 16384");
  } else {
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == groups, "quant_linear: scales shape");
  }
  if (mins.has_value()) {
    TORCH_CHECK(mins->is_contiguous() && mins->scalar_type() == scales.scalar_type() && mins->sizes() == scales.sizes(),
                "quant_linear: mins must be shaped like scales, in their dtype");
  }
  Packed w{static_cast<const uint8_t*>(qweight.data_ptr()), qweight.size(1), int4, nullptr, nullptr, groups, group_size,
           K, N};
  w.int6_layout = int6;
  if (super) {
    w.super = static_cast<const uint8_t*>(scales.data_ptr());
  } else if (half) {
    TORCH_CHECK(groups <= 1024, "quant_linear: fp16 scales take at most 1024 groups a row (K <= 32768 at 32 a group)");
    w.scales_h = static_cast<const uint16_t*>(scales.data_ptr());
    if (mins.has_value()) w.mins_h = static_cast<const uint16_t*>(mins->data_ptr());
  } else {
    w.scales = scales.data_ptr<float>();
    if (mins.has_value()) w.mins = mins->data_ptr<float>();
  }
  TORCH_CHECK(!int4 || mins.has_value() || groups <= 1024,
              "quant_linear: implied mins (none given) take at most 1024 groups a row (K <= 32768)");
  TORCH_CHECK(!int6 || qhigh.has_value(), "quant_linear: a uint8 qweight [N, K / 2] with groups of 16 is the int6 "
              "layout, which needs its qhigh [N, K / 4]");
  if (qhigh.has_value()) {
    TORCH_CHECK(nibbles && qhigh->scalar_type() == at::kByte && qhigh->is_contiguous() && qhigh->dim() == 2 &&
                    qhigh->size(0) == N && qhigh->size(1) == (int6 ? K / 4 : K / 8),
                "quant_linear: qhigh must be contiguous uint8 beside a qweight [N, K / 2]: [N, K / 8] (int5's fifth "
                "bits, groups of 32) or [N, K / 4] (int6's high bits, groups of 16)");
    w.qhigh = static_cast<const uint8_t*>(qhigh->data_ptr());
  }
  return w;
}

// count fp16 values from h as fp32 into out.
inline void halves_to_floats(const uint16_t* h, int64_t count, float* out) {
  int64_t i = 0;
#ifdef WEFT_AVX2
  for (; i + 8 <= count; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  }
#endif
  for (; i < count; ++i) out[i] = c10::detail::fp16_ieee_to_fp32_value(h[i]);
}

// Weight row n's scales and mins as fp32: pointers into the tensors where they are fp32, else
// the row's fp16 values converted (exactly) into this object's buffers, on its owner's stack. Made
// once per weight row and block of x rows, so the conversion is a small share of the row's work.
// fp16 layouts come only from 32-column groups (gguf_repack), so K up to 32,768.
struct RowScales {
  static constexpr int64_t kMaxGroups = 1024;
  const float* s = nullptr;
  const float* m = nullptr;
  alignas(32) float s_buf[kMaxGroups];
  alignas(32) float m_buf[kMaxGroups];

  RowScales() = default;
  RowScales(const Packed& w, int64_t n) { read(w, n); }
  void read(const Packed& w, int64_t n) {
    m = nullptr;
    if (w.super != nullptr) {
      // SuperScales::scale and ::min's products, each record's halves converted once.
      const uint8_t* row = static_cast<const uint8_t*>(w.scale_row(n));
      const int64_t per = SuperScales::kWeights / w.group, bytes = SuperScales::record_bytes(w.int4(), w.group);
      for (int64_t sb = 0; sb < w.K / SuperScales::kWeights; ++sb) {
        const uint8_t* r = row + sb * bytes;
        const float d = SuperScales::half_at(r);
        float* sg = s_buf + sb * per;
        if (w.int4()) {
          const float dmin = SuperScales::half_at(r + 2);
          for (int64_t i = 0; i < per; ++i) {
            sg[i] = d * static_cast<float>(r[4 + i]);
            m_buf[sb * per + i] = -(dmin * static_cast<float>(r[4 + per + i]));
          }
        } else {
          for (int64_t i = 0; i < per; ++i) sg[i] = d * static_cast<float>(static_cast<int8_t>(r[2 + i]));
        }
      }
      s = s_buf;
      if (w.int4()) m = m_buf;
      return;
    }
    if (w.scales != nullptr) {
      s = w.scales + n * w.groups;
      if (w.mins != nullptr) m = w.mins + n * w.groups;
    } else {
      halves_to_floats(w.scales_h + n * w.groups, w.groups, s_buf);
      s = s_buf;
      if (w.mins_h != nullptr) {
        halves_to_floats(w.mins_h + n * w.groups, w.groups, m_buf);
        m = m_buf;
      }
    }
    if (w.int4() && m == nullptr) {
      for (int64_t g = 0; g < w.groups; ++g) m_buf[g] = w.implied_min(s[g]);
      m = m_buf;
    }
  }
};

// Weight row n dequantized into out[K] (the fp32-activation paths), its scales and mins as RowScales
// reads them (fp32 per group, or the K formats' records).
void dequant_row(const Packed& w, int64_t n, float* out) {
  const RowScales rs(w, n);
  const uint8_t* q = w.qweight + n * w.row_bytes;
  if (w.int6()) {
    dequant_row_int6(q, w.high_row(n), rs.s, w.K, out);
  } else if (!w.int4()) {
    dequant_row_int8(reinterpret_cast<const int8_t*>(q), rs.s, w.K, w.group, out);
  } else {
    dequant_row_int4(q, w.high_row(n), w.fifth_planes(), rs.s, rs.m, w.K, out);
  }
}

#ifdef WEFT_AVX2
// The 8 weights of part p (0..3) of group g of an int4 row (q its bytes; int5: h its qhigh row, else
// null), dequantized in registers.
struct GroupInt4 {
  __m256 w[4];
  GroupInt4(const uint8_t* q, const uint8_t* h, int64_t g, bool planes, float scale, float min) {
    const __m256 s = _mm256_set1_ps(scale), m = _mm256_set1_ps(min);
    __m128i low, high;
    group_bytes(q + g * (kInt4Group / 2), h, g, planes, low, high);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), s, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))), s, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)), s, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8))), s, m);
  }
};

inline __m256 int8x8(const int8_t* q, __m256 s) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s);
}

// out[r * ldo] = dot(x[r], W[n]) for R rows of x, W's row dequantized in registers as it
// streams by (the decode case: each weight byte is read once, nothing is stored). Four
// accumulators per row of x hide the FMA latency.
template <int R>
void dot_row_streaming(const Packed& w, int64_t n, const float* x, int64_t ldx, float* out, int64_t ldo) {
  __m256 acc[R][4];
  for (auto& a : acc) for (auto& v : a) v = _mm256_setzero_ps();
  const RowScales rs(w, n);
  const float* s = rs.s;
  const uint8_t* q = w.qweight + n * w.row_bytes;
  if (w.int4()) {
    const uint8_t* high = w.high_row(n);
    for (int64_t g = 0; g < w.groups; ++g) {
      const GroupInt4 grp(q, high, g, w.fifth_planes(), s[g], rs.m[g]);
      for (int r = 0; r < R; ++r) {
        const float* xg = x + r * ldx + g * kInt4Group;
        for (int p = 0; p < 4; ++p) acc[r][p] = _mm256_fmadd_ps(grp.w[p], _mm256_loadu_ps(xg + 8 * p), acc[r][p]);
      }
    }
  } else {
    // int8, or int6 unpacked 128 weights at a time into int8 q - 32 (the same weights).
    alignas(32) uint8_t chunk[128];
    alignas(32) int8_t values[128];
    const uint8_t* high = w.high_row(n);
    for (int64_t k = 0; k < w.K; k += 16) {
      const int8_t* q8 = reinterpret_cast<const int8_t*>(q) + k;
      if (w.int6()) {
        if (k % 128 == 0) {
          int6_chunk(q, high, k / 128, chunk);
          for (int e = 0; e < 128; ++e) values[e] = static_cast<int8_t>(chunk[e] - 32);
        }
        q8 = values + k % 128;
      }
      const __m256 sv = _mm256_set1_ps(s[k / w.group]);  // groups are multiples of 16
      const __m256 w0 = int8x8(q8, sv), w1 = int8x8(q8 + 8, sv);
      const int p = (k / 16) & 1;
      for (int r = 0; r < R; ++r) {
        const float* xk = x + r * ldx + k;
        acc[r][2 * p] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xk), acc[r][2 * p]);
        acc[r][2 * p + 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xk + 8), acc[r][2 * p + 1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r * ldo] = hsum(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
  }
}
#endif

// Rows of x up to which quant_linear streams W through registers once per pair of rows,
// rather than dequantizing tiles into a buffer shared by all rows.
constexpr int64_t kStreamingMaxRows = 4;

// out [M, N] = x [M, K] @ W^T, W packed.
void quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& mins, int64_t group_size, at::Tensor out,
                  const c10::optional<at::Tensor>& qhigh) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "quant_linear: x must be fp32 [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  const Packed w = packed_of(qweight, scales, mins, qhigh, group_size, K);
  const int64_t N = qweight.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  out.stride(1) == 1,
              "quant_linear: out must be fp32 [M, N] with contiguous rows");
  if (M == 0 || N == 0) return;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
#ifdef WEFT_AVX2
  if (M <= kStreamingMaxRows) {
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) dot_row_streaming<2>(w, n, xp + m * ldx, ldx, op + m * ldo + n, ldo);
        if (m < M) dot_row_streaming<1>(w, n, xp + m * ldx, ldx, op + m * ldo + n, ldo);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kTileRows * K, 0.f);  // rows past N stay zero
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows, rows = std::min(kTileRows, N - n0);
      for (int64_t r = 0; r < rows; ++r) dequant_row(w, n0 + r, buf.data() + r * K);
      dot_rows(xp, ldx, M, buf.data(), K, op + n0, ldo, rows);
    }
  });
}

// out [count, K] fp32 = rows [start, start + count) of the packed W.
void dequantize_rows(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                     int64_t group_size, int64_t start, at::Tensor out, const c10::optional<at::Tensor>& qhigh) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous(),
              "dequantize_rows: out must be contiguous fp32 [count, K]");
  const int64_t count = out.size(0), K = out.size(1);
  const Packed w = packed_of(qweight, scales, mins, qhigh, group_size, K);
  TORCH_CHECK(start >= 0 && start + count <= qweight.size(0), "dequantize_rows: rows out of range");
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequant_row(w, start + i, op + i * K);
  });
}

// ---- int8 activations (quant_linear_i8) ----

constexpr int64_t kBlock = 32;  // elements per integer dot: one 256-bit vector of int8

// Rows of x rounded to int8, per group of `group` (the weight's: 16 or 32) with one fp32
// scale amax / 127, zero-padded to whole blocks of 32. For the int4 and int5 layouts also a copy in
// the order its bytes unpack to two blocks at a time (see dot_row_i8): per pair of blocks
// b, b + 1, elements 0-15 of b, 0-15 of b + 1, 16-31 of b, 16-31 of b + 1, with the scales
// spread over the lanes their integer dots land in.
struct ActInt8 {
  int64_t blocks = 0;  // blocks of 32 per row, K rounded up
  int64_t group = 0;   // of the rounding: the weight's group, or 256 for the super-block path
  std::vector<int8_t> q;       // [M, blocks * 32]
  std::vector<float> scales;   // [M, blocks * 32 / group], 0 past K
  std::vector<float> sums;     // [M, K / 32]: fp32 sums of x per 32, for the int4 min term
  std::vector<int8_t> paired;  // int4 only: [M, blocks / 2 * 64]
  std::vector<float> lanes;    // int4 only, not the super-block path: [M, blocks / 2 * 8], lanes 0-3
                               // block b's scale, 4-7 b + 1's
  // The super-block path only (group 256), Q4_K and Q5_K: [M, K / 32], the integer sums of the
  // rounded x per 32 (at most 32 * 127 in magnitude), for the min term in integers.
  std::vector<int16_t> bsums;
  // The super-block path only, Q4_K and Q5_K: [M, ceil(K / 512) * 8], x's scales as the min terms
  // take them, two super-blocks a step: lanes 0-3 super-block 2p's, 4-7 2p + 1's (0 past K).
  std::vector<float> super_lanes;
  // The super-block path only, Q6_K: [M, K / 2], 32 times the sum of each pair of rounded x (at most
  // 32 * 2 * 127 = 8128), what tile_i8_super6 takes off each maddubs pair of q and x to make the
  // pairs of q - 32.
  std::vector<int16_t> pair_bias;
  // int6 only: [M, blocks * 8], lane i of block b 32 times the sum of its rounded x 4i..4i + 3: what
  // the int6 tiles take off dot_u8s8(q, x) to make the dots of q - 32
  std::vector<int32_t> bias;
  // The super-block path on AVX-512, Q6_K: [M, blocks * 8], -32 times the sum of each lane's four
  // rounded x (bias negated), where tile_i8_super6_zmm's vpdpbusd starts.
  std::vector<int32_t> minus_bias;
  // The int8 layout on AVX-512 (tile_i8_int8_zmm): [M, blocks * 32], q + 128 as unsigned bytes.
  std::vector<uint8_t> qu;
  int64_t row_scales() const { return blocks * kBlock / group; }
  const int8_t* qrow(int64_t m) const { return q.data() + m * blocks * kBlock; }
  const uint8_t* qu_row(int64_t m) const { return qu.data() + m * blocks * kBlock; }
  const float* srow(int64_t m) const { return scales.data() + m * row_scales(); }
  const int8_t* paired_row(int64_t m) const { return paired.data() + m * (blocks / 2) * 2 * kBlock; }
  const float* lanes_row(int64_t m) const { return lanes.data() + m * (blocks / 2) * 8; }
  const int32_t* bias_row(int64_t m) const { return bias.data() + m * blocks * 8; }
  const int32_t* minus_bias_row(int64_t m) const { return minus_bias.data() + m * blocks * 8; }
  const int16_t* bsums_row(int64_t m) const { return bsums.data() + m * blocks; }
  int64_t super_pairs() const { return (row_scales() + 1) / 2; }
  const float* super_lanes_row(int64_t m) const { return super_lanes.data() + m * super_pairs() * 8; }
  const int16_t* pair_bias_row(int64_t m) const { return pair_bias.data() + m * blocks * kBlock / 2; }
};

// x[0..n) -> q[0..n) int8 or int16 (scale amax / 127 or amax / 32767); returns the scale,
// and in *sum_out the sum of the rounded group (d * sum q), so that the int4 min term too
// is that of the rounded x: the result is W times x rounded, up to the order of fp32 sums,
// which the fp32 kernels reproduce from 32 rows on (services/worker/layers/quantized_linear.py).
// The scale is NaN where the group holds a NaN or an infinity, so that reaches the output
// as the fp32 path would carry it.
template <typename T>
float quantize_group(const float* x, int64_t n, T* q, float* sum_out) {
  constexpr float kMax = sizeof(T) == 1 ? 127.f : 32767.f;
  float amax = 0.f, sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    amax = std::max(amax, std::fabs(x[j]));
    sum += x[j];
  }
  if (!std::isfinite(sum)) {
    std::fill(q, q + n, 0);
    *sum_out = std::nanf("");
    return std::nanf("");
  }
  const float d = amax / kMax;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  int32_t qsum = 0;
  // nearbyint rounds half to even in the default rounding mode, like torch.round in the twin.
  for (int64_t j = 0; j < n; ++j) {
    q[j] = static_cast<T>(std::nearbyint(x[j] * inv));
    qsum += q[j];
  }
  *sum_out = d * static_cast<float>(qsum);
  return d;
}

// Fills a.paired from a.q and, with lanes (int4 rounded per 32: one scale per block), a.lanes from
// a.scales.
void pair_blocks(ActInt8& a, int64_t M, bool lanes) {
  const int64_t pairs = a.blocks / 2, half = kBlock / 2;
  a.paired.assign(M * pairs * 2 * kBlock, 0);
  if (lanes) a.lanes.assign(M * pairs * 8, 0.f);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int8_t* q = a.qrow(m);
      int8_t* out = a.paired.data() + m * pairs * 2 * kBlock;
      for (int64_t p = 0; p < pairs; ++p) {
        const int8_t* b0 = q + 2 * p * kBlock;
        const int8_t* b1 = b0 + kBlock;
        int8_t* o = out + p * 2 * kBlock;
        std::copy(b0, b0 + half, o);
        std::copy(b1, b1 + half, o + half);
        std::copy(b0 + half, b0 + kBlock, o + 2 * half);
        std::copy(b1 + half, b1 + kBlock, o + 3 * half);
        if (lanes) {
          const float* s = a.srow(m);
          float* l = a.lanes.data() + m * pairs * 8;
          std::fill(l + p * 8, l + p * 8 + 4, s[2 * p]);
          std::fill(l + p * 8 + 4, l + p * 8 + 8, s[2 * p + 1]);
        }
      }
    }
  });
}

// Fills a.pair_bias from a.q (the int6 super-block path's; see ActInt8).
void pair_biases(ActInt8& a, int64_t M) {
  const int64_t pairs = a.blocks * kBlock / 2;
  a.pair_bias.assign(M * pairs, 0);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int8_t* q = a.qrow(m);
      int16_t* bias = a.pair_bias.data() + m * pairs;
      for (int64_t i = 0; i < pairs; ++i) bias[i] = static_cast<int16_t>(32 * (q[2 * i] + q[2 * i + 1]));
    }
  });
}

// Fills a.bsums from a.q and a.super_lanes from a.scales (the super-block path's; see ActInt8).
void block_sums(ActInt8& a, int64_t M) {
  a.bsums.assign(M * a.blocks, 0);
  const int64_t supers = a.row_scales(), pairs = a.super_pairs();
  a.super_lanes.assign(M * pairs * 8, 0.f);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int8_t* q = a.qrow(m);
      for (int64_t b = 0; b < a.blocks; ++b) {
        int32_t sum = 0;
        for (int64_t j = 0; j < kBlock; ++j) sum += q[b * kBlock + j];
        a.bsums[m * a.blocks + b] = static_cast<int16_t>(sum);
      }
      float* lanes = a.super_lanes.data() + m * pairs * 8;
      for (int64_t sb = 0; sb < supers; ++sb) std::fill_n(lanes + sb / 2 * 8 + sb % 2 * 4, 4, a.srow(m)[sb]);
    }
  });
}

// Rows of x a thread takes against its weight rows at a time: about kBlockBytes of rounded x,
// which stays in cache while the weight rows stream by once per block (a long prefill would
// otherwise read all of x from memory for every weight row). At least kMinBlockRows, so a wide
// layer does not read its weights once per 4 rows. Blocking changes only which (row, weight row)
// pairs are computed when, never the arithmetic of one pair: a row's result is the same bits
// whatever the other rows are (the batch invariance services/worker/layers/quantized_linear.py
// promises).
constexpr int64_t kBlockBytes = 256 << 10;
constexpr int64_t kMinBlockRows = 16;

inline int64_t x_rows_per_block(int64_t row_bytes) {
  return std::max(kMinBlockRows, kBlockBytes / std::max<int64_t>(1, row_bytes) / 4 * 4);
}

// Rows of x rounded to int16 per weight group (quant_linear_i16): no padding, no paired copy.
struct ActInt16 {
  int64_t group = 0, groups = 0;
  std::vector<int16_t> q;     // [M, K]
  std::vector<float> scales;  // [M, K / group]
  std::vector<float> sums;    // [M, K / group]: sums of the rounded x per group (int4: 32)
  const int16_t* qrow(int64_t m) const { return q.data() + m * groups * group; }
  const float* srow(int64_t m) const { return scales.data() + m * groups; }
};

// Rows [0, M) of x rounded per group (quantize_group) into q, scales and sums, each row's
// values q_stride and s_stride apart (sums K / group apart; none when sums is null). Each row is
// rounded alone (its result does not depend on the others'), so rows go in parallel.
template <typename T>
void round_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group, T* q, int64_t q_stride, float* scales,
                int64_t s_stride, float* sums) {
  const int64_t groups = K / group;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t g = 0; g < groups; ++g) {
        float sum;
        scales[m * s_stride + g] = quantize_group(x + m * ldx + g * group, group, q + m * q_stride + g * group, &sum);
        if (sums != nullptr) sums[m * groups + g] = sum;
      }
    }
  });
}

// Fills out (a.bias, or with factor -32 a.minus_bias) from a.q: factor times the sum of each lane's
// four rounded x (the int6 layout's; see ActInt8).
void bias_blocks(ActInt8& a, int64_t M, std::vector<int32_t>& out, int32_t factor = 32) {
  const int64_t lanes = a.blocks * 8;
  out.assign(M * lanes, 0);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int8_t* q = a.qrow(m);
      int32_t* bias = out.data() + m * lanes;
      for (int64_t i = 0; i < lanes; ++i) bias[i] = factor * (q[4 * i] + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3]);
    }
  });
}

// Rows of x rounded for quant_linear_i8 against w: per weight group (sums: the int4 layout's float
// group sums and paired copy; bias: int6's), or for the super-block path (the K formats' records)
// per 256, with for Q4_K and Q5_K (sums) integer sums per 32 and the paired copy, for Q6_K (bias)
// the pairs' biases.
ActInt8 quantize_activations(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group, bool sums,
                             bool bias, bool super) {
  ActInt8 a;
  a.blocks = (K + kBlock - 1) / kBlock;
  a.group = super ? SuperScales::kWeights : group;
  a.q.assign(M * a.blocks * kBlock, 0);
  a.scales.assign(M * a.row_scales(), 0.f);
  const bool float_sums = sums && !super;
  if (float_sums) a.sums.assign(M * (K / kBlock), 0.f);  // int4: group == 32
  round_rows(x, ldx, M, K, a.group, a.q.data(), a.blocks * kBlock, a.scales.data(), a.row_scales(),
             float_sums ? a.sums.data() : nullptr);
  if (super && sums) {
    pair_blocks(a, M, /*lanes=*/false);
    block_sums(a, M);
  } else if (super && bias) {
    pair_biases(a, M);
#ifdef WEFT_ZMM
    bias_blocks(a, M, a.minus_bias, -32);
#endif
  } else if (sums) {
    pair_blocks(a, M, /*lanes=*/true);
  } else if (bias) {
    bias_blocks(a, M, a.bias);
  }
#ifdef WEFT_ZMM
  if (!sums && !bias && !super) {
    a.qu.resize(a.q.size());
    for (size_t i = 0; i < a.q.size(); ++i) a.qu[i] = static_cast<uint8_t>(a.q[i] + 128);
  }
#endif
  return a;
}

ActInt16 quantize_activations_i16(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group) {
  ActInt16 a;
  a.group = group;
  a.groups = K / group;
  a.q.assign(M * K, 0);
  a.scales.assign(M * a.groups, 0.f);
  a.sums.assign(M * a.groups, 0.f);
  round_rows(x, ldx, M, K, group, a.q.data(), K, a.scales.data(), a.groups, a.sums.data());
  return a;
}

// The int4 min term of row n: sum over groups of m[g] * (sum of x over group g).
float min_term(const float* mins, const float* xsums, int64_t groups) {
  int64_t g = 0;
  float total = 0.f;
#ifdef WEFT_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(xsums + g), acc);
  total = hsum(acc);
#endif
  for (; g < groups; ++g) total += mins[g] * xsums[g];
  return total;
}

#ifdef WEFT_AVX2
// 8 int32 lanes, lane i the sum of the products of bytes 4i..4i+3 of u (unsigned) and s (signed):
// lanes 0-3 cover elements 0-15 of the block, lanes 4-7 elements 16-31.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef WEFT_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  // Pairs of products fit int16 here: |s| <= 127 (x is rounded into [-127, 127]) and u <= 128 (the
  // int8 layout's |w|: a pair at most 2 * 128 * 127 = 32512) or u < 64 (int6's q: 2 * 63 * 127 = 16002).
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// dot_u8s8(u0, s0) + dot_u8s8(u1, s1), for u below 32 (the int4 and int5 weights).
inline __m256i dot2_u8s8(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#ifdef WEFT_VNNI
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
#else
  // Each maddubs pair is at most 2 * 31 * 127 = 7874 (int5; int4's 2 * 15 * 127), so the sum of two,
  // at most 15748, fits int16.
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

// The 32 4-bit weights of a group as bytes, in element order (low nibbles are 0-15).
inline __m256i int4_block(const uint8_t* qg) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1);
}

// The 32 weights of group g of a row of the int4 or (kInt5: the row's fifth bits at h) int5 layout
// as bytes, in element order.
template <bool kInt5>
inline __m256i int4or5_block(const uint8_t* q, const uint8_t* h, int64_t g) {
  const __m256i nibbles = int4_block(q + g * (kInt4Group / 2));
  if constexpr (kInt5) return _mm256_or_si256(nibbles, fifth_bits(h + g * 4));
  return nibbles;
}

// lanes 0-3 = lo, 4-7 = hi: the scales of the two groups of 16 a block spans.
inline __m256 halves(float lo, float hi) {
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(lo)), _mm_set1_ps(hi), 1);
}

#endif

// The same sums in plain loops (targets without AVX2), for int8 or int16 activations.
template <class Act>
void dot_row_scalar(const Packed& w, const RowScales& rs, int64_t n, const Act& a, int64_t m, float* out) {
  const float* sw = rs.s;
  const float* xs = a.srow(m);
  const auto* xq = a.qrow(m);
  const uint8_t* q = w.qweight + n * w.row_bytes;
  const uint8_t* high = w.high_row(n);
  float total = 0.f;
  for (int64_t g = 0; g < w.groups; ++g) {
    int32_t dot = 0;
    for (int64_t j = 0; j < w.group; ++j) {
      int32_t wq;
      if (w.int4()) {
        const uint8_t byte = q[g * (kInt4Group / 2) + j % (kInt4Group / 2)];
        wq = j < kInt4Group / 2 ? (byte & 0x0F) : (byte >> 4);
        if (high != nullptr) wq |= fifth_bit(high, g, j, w.fifth_planes());
      } else if (w.int6()) {
        wq = int6_value(q, high, g * w.group + j) - 32;
      } else {
        wq = reinterpret_cast<const int8_t*>(q)[g * w.group + j];
      }
      dot += wq * xq[g * w.group + j];
    }
    total += (sw[g] * xs[g]) * static_cast<float>(dot);
  }
  if (w.int4()) total += min_term(rs.m, a.sums.data() + m * w.groups, w.groups);
  *out = total;
}

// The super-block path (the K formats against x rounded per 256) in plain loops: per super-block
// the integer sum of each group's dot times its sc (and for Q4_K and Q5_K of each group's x sum times
// its m), then one product each by d (dmin) times x's scale. Batch invariant like every path here (a
// row alone).
void dot_row_scalar_super(const Packed& w, int64_t n, const ActInt8& a, int64_t m, float* out) {
  const uint8_t* q = w.qweight + n * w.row_bytes;
  const uint8_t* high = w.high_row(n);
  const uint8_t* records = static_cast<const uint8_t*>(w.scale_row(n));
  const int8_t* xq = a.qrow(m);
  const int16_t* bsums = w.int4() ? a.bsums_row(m) : nullptr;
  const int64_t per = SuperScales::kWeights / w.group, record = SuperScales::record_bytes(w.int4(), w.group);
  float total = 0.f, min_total = 0.f;
  for (int64_t sb = 0; sb < w.K / SuperScales::kWeights; ++sb) {
    const uint8_t* r = records + sb * record;
    int32_t dots = 0, mins = 0;
    for (int64_t i = 0; i < per; ++i) {
      const int64_t g = sb * per + i;
      int32_t dot = 0;
      for (int64_t j = 0; j < w.group; ++j) {
        int32_t wq;
        if (w.int6()) {
          wq = int6_value(q, high, g * w.group + j) - 32;
        } else {
          const uint8_t byte = q[g * (kInt4Group / 2) + j % (kInt4Group / 2)];
          wq = j < kInt4Group / 2 ? (byte & 0x0F) : (byte >> 4);
          if (high != nullptr) wq |= fifth_bit(high, g, j, /*planes=*/true);
        }
        dot += wq * xq[g * w.group + j];
      }
      if (w.int6()) {
        dots += static_cast<int8_t>(r[2 + i]) * dot;
      } else {
        dots += r[4 + i] * dot;
        mins += r[4 + per + i] * bsums[g];
      }
    }
    const float xs = a.srow(m)[sb];
    total += static_cast<float>(dots) * (SuperScales::half_at(r) * xs);
    if (w.int4()) min_total += static_cast<float>(mins) * (SuperScales::half_at(r + 2) * xs);
  }
  *out = total - min_total;
}

#ifdef WEFT_AVX2
// Rows of W this far ahead are prefetched: the hardware prefetcher alone left the
// decode matmul well under the read bandwidth on small layers.
constexpr int64_t kPrefetchRows = 8;

inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// Step `step` of a tile that reads `bytes` of each of its RW weight rows a step: prefetches the
// matching share of the RW rows at ahead (contiguous, RW * bytes a step), so a batch-1 tile asks
// for the next tile's weights a few cache lines at a time while it computes, instead of in one
// burst before it (which, from memory, left the loads of the tile waiting behind the burst: 1.7x
// slower at K = 2048). Nothing when ahead is null.
template <int RW>
inline void prefetch_share(const uint8_t* ahead, int64_t step, int64_t bytes) {
  if (ahead == nullptr) return;
  const char* c = reinterpret_cast<const char*>(ahead) + step * RW * bytes;
  for (int64_t off = 0; off < RW * bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

#endif

#ifdef WEFT_AVX2
// ---- int4 weights against int8 activations in register tiles (quant_linear_i8's int4 path) ----
//
// A tile is RW weight rows by RX rows of x. Per pair of 32-blocks, each weight row's 32 bytes
// are unpacked once (low and high nibbles) for all RX rows of x, and each row of x's paired
// blocks (ActInt8::paired) are read once for all RW weight rows: RW * RX integer dots, each
// with one FMA by the product of the two scales into that (weight row, x row)'s own
// accumulator. Every (weight row, x row) pair runs the same operations in the same order
// whatever tile it falls in: one accumulator, pairs of blocks in order, a lone last block,
// then one horizontal sum plus the min term. So a row's output does not depend on the tile
// shape, on M, or on the other rows of x (batch invariance).

// Scales and mins are read where they lie, fp16 (the 32-element GGUF formats) or fp32 (the K
// formats' fp32-scale fallback), and converted in registers: exact either way, so both give the same
// bits. (The K formats' records take the super-block tiles, tile_i8_super.)
template <ScaleKind kScales, bool kInt5>
struct Int4Scales {
  static_assert(kScales != ScaleKind::kSuper, "Q4_K and Q5_K records take tile_i8_super");
  static constexpr bool kHalf = kScales == ScaleKind::kHalf;
  const void* s;
  const void* m;  // null where implied (Q4_0, Q5_0)
  // The factor of implied mins, a constant of the layout: a member read at run time left the int4
  // batch-1 tiles 3-5% slower (AVX2, Zen 3).
  static constexpr float kImplied = kInt5 ? -16.f : -8.f;
  // Pair p's two block scales as lanes 0-3 (block 2p) and 4-7 (block 2p + 1).
  __m256 pair(int64_t p) const {
    __m128 two;
    if constexpr (kHalf) {
      int32_t bits;
      std::memcpy(&bits, static_cast<const uint16_t*>(s) + 2 * p, 4);
      two = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
    } else {
      two = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const float*>(s) + 2 * p)));
    }
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  }
  // The scales of blocks b..b + 7, in order.
  __m256 eight(int64_t b) const {
    if constexpr (kHalf) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(s) + b)));
    } else {
      return _mm256_loadu_ps(static_cast<const float*>(s) + b);
    }
  }
  float scale(int64_t b) const {
    return kHalf ? c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(s)[b])
                 : static_cast<const float*>(s)[b];
  }
  // The mins of blocks g..g + 7, in order: stored, or implied by the scales (m null: Q4_0, Q5_0).
  __m256 eight_mins(int64_t g) const {
    if (m == nullptr) return _mm256_mul_ps(eight(g), _mm256_set1_ps(kImplied));  // exact: a power of two
    if constexpr (kHalf) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(m) + g)));
    } else {
      return _mm256_loadu_ps(static_cast<const float*>(m) + g);
    }
  }
  float min(int64_t g) const {
    if (m == nullptr) return kImplied * scale(g);
    return kHalf ? c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(m)[g])
                 : static_cast<const float*>(m)[g];
  }
};

// The groups past the last whole eight of the min terms (min_terms, min_terms_zmm), added in order
// to out[i][r] after its horizontal sum: one scalar FMA per (weight row, x row) and group.
template <int RW, int RX, ScaleKind kScales, bool kInt5>
inline void min_terms_tail(const Int4Scales<kScales, kInt5> (&sc)[RW], const float* const (&xsums)[RX], int64_t g,
                           int64_t groups, float (&out)[RW][RX]) {
  for (; g < groups; ++g) {
    for (int i = 0; i < RW; ++i) {
      const float mg = sc[i].min(g);
      for (int r = 0; r < RX; ++r) out[i][r] = std::fma(mg, xsums[r][g], out[i][r]);
    }
  }
}

// The int4 min term of every (weight row, x row) of a tile into out[i][r]: sum over groups of
// min[g] * xsums[g] as eight lanes of FMAs over the groups in order, one horizontal sum, then the
// rest in order, the same for every pair whatever the tile. Each weight row's eight mins are
// formed once for all the tile's rows of x (for implied mins and the K formats that takes arithmetic).
template <int RW, int RX, ScaleKind kScales, bool kInt5>
void min_terms(const Int4Scales<kScales, kInt5> (&sc)[RW], const ActInt8& a, int64_t m0, int64_t groups,
               float (&out)[RW][RX]) {
  __m256 acc[RW][RX];
  for (auto& per_w : acc) for (auto& v : per_w) v = _mm256_setzero_ps();
  const float* xsums[RX];
  for (int r = 0; r < RX; ++r) xsums[r] = a.sums.data() + (m0 + r) * groups;
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    for (int i = 0; i < RW; ++i) {
      const __m256 mv = sc[i].eight_mins(g);
      for (int r = 0; r < RX; ++r) acc[i][r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsums[r] + g), acc[i][r]);
    }
  }
  for (int i = 0; i < RW; ++i) {
    for (int r = 0; r < RX; ++r) out[i][r] = hsum(acc[i][r]);
  }
  min_terms_tail<RW, RX>(sc, xsums, g, groups, out);
}

template <ScaleKind kScales, bool kInt5>
Int4Scales<kScales, kInt5> int4_scales(const Packed& w, int64_t n) {
  return {w.scale_row(n), w.has_mins() ? w.min_row(n) : nullptr};
}

// A tile's int4 (or int5) weight rows [n, n + RW): each row's bytes, fifth bits (null for int4),
// scales and mins.
template <int RW, ScaleKind kScales, bool kInt5>
struct Int4Rows {
  const uint8_t* q[RW];
  const uint8_t* h[RW];
  Int4Scales<kScales, kInt5> sc[RW];
  Int4Rows(const Packed& w, int64_t n) {
    for (int i = 0; i < RW; ++i) {
      q[i] = w.qweight + (n + i) * w.row_bytes;
      h[i] = kInt5 ? w.high_row(n + i) : nullptr;
      sc[i] = int4_scales<kScales, kInt5>(w, n + i);
    }
  }
};

// A tile's rows [m0, m0 + RX) of x: the rounded values in the int4 pair order and the scale lanes.
template <int RX>
struct PairedXRows {
  const int8_t* xp[RX];
  const float* xl[RX];
  PairedXRows(const ActInt8& a, int64_t m0) {
    for (int r = 0; r < RX; ++r) {
      xp[r] = a.paired_row(m0 + r);
      xl[r] = a.lanes_row(m0 + r);
    }
  }
};

// kInt5: the int5 layout, each weight row's fifth bits ORed into its nibbles as they are unpacked
// (fifth_bits_pair); the rest is the int4 tile's, operation for operation.
template <int RW, int RX, ScaleKind kScales, bool kInt5>
void tile_i8_int4(const Packed& w, int64_t n, const ActInt8& a, int64_t m0, float* out, int64_t ldo,
                  const uint8_t* ahead) {
  __m256 acc[RW][RX];
  for (auto& per_w : acc) for (auto& v : per_w) v = _mm256_setzero_ps();
  const int64_t groups = w.groups, pairs = groups / 2;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  Int4Rows<RW, kScales, kInt5> rows(w, n);
  auto& q = rows.q;
  auto& h = rows.h;
  auto& sc = rows.sc;
  const PairedXRows<RX> xs(a, m0);
  const auto& xp = xs.xp;
  const auto& xl = xs.xl;
  // One pair of blocks for every (weight row, x row) of the tile, the scale products given.
  auto pair_step = [&](int64_t p, auto&& scale_of) {
    prefetch_share<RW>(ahead, p, kBlock);
    for (int i = 0; i < RW; ++i) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[i] + p * kBlock));
      __m256i lo = _mm256_and_si256(bytes, mask), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
      if constexpr (kInt5) {
        __m256i lo5, hi5;
        fifth_bits_pair(h[i] + p * 8, lo5, hi5);  // groups 2p, 2p + 1: 8 bytes
        lo = _mm256_or_si256(lo, lo5);
        hi = _mm256_or_si256(hi, hi5);
      }
      for (int r = 0; r < RX; ++r) {
        const int8_t* x = xp[r] + p * 2 * kBlock;
        const __m256i dot = dot2_u8s8(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), hi,
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + kBlock)));
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale_of(i, r), acc[i][r]);
      }
    }
  };
  // Four pairs at a time: the eight blocks' scales of each weight row loaded as one vector. At one
  // row of x, each x row's eight too, multiplied once, and each pair's two products spread over
  // its lanes by a permute; above, each weight row's pair of scales is spread once (one permute per
  // weight row, not per (weight row, x row)) and multiplied by x's scale lanes (ActInt8::lanes).
  // The products are the same floats the one-pair steps below make: only the route differs.
  int64_t p = 0;
  for (; p + 4 <= pairs; p += 4) {
    __m256 ws8[RW], xs8[RX];
    for (int i = 0; i < RW; ++i) ws8[i] = sc[i].eight(2 * p);
    if constexpr (RX == 1) xs8[0] = _mm256_loadu_ps(a.srow(m0) + 2 * p);
    for (int j = 0; j < 4; ++j) {
      const __m256i spread = _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1);
      if constexpr (RX == 1) {
        pair_step(p + j, [&](int i, int) { return _mm256_permutevar8x32_ps(_mm256_mul_ps(ws8[i], xs8[0]), spread); });
      } else {
        __m256 ws[RW];
        for (int i = 0; i < RW; ++i) ws[i] = _mm256_permutevar8x32_ps(ws8[i], spread);
        const int64_t pj = p + j;
        pair_step(pj, [&](int i, int r) { return _mm256_mul_ps(ws[i], _mm256_loadu_ps(xl[r] + pj * 8)); });
      }
    }
  }
  for (; p < pairs; ++p) {
    __m256 ws[RW];
    for (int i = 0; i < RW; ++i) ws[i] = sc[i].pair(p);
    pair_step(p, [&](int i, int r) { return _mm256_mul_ps(ws[i], _mm256_loadu_ps(xl[r] + p * 8)); });
  }
  if (groups % 2) {
    const int64_t b = groups - 1;
    for (int i = 0; i < RW; ++i) {
      const __m256i u = int4or5_block<kInt5>(q[i], h[i], b);
      const __m256 ws = _mm256_set1_ps(sc[i].scale(b));
      for (int r = 0; r < RX; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qrow(m0 + r) + b * kBlock));
        const __m256 xs = _mm256_set1_ps(a.srow(m0 + r)[b]);
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, xv)), _mm256_mul_ps(ws, xs), acc[i][r]);
      }
    }
  }
  float mins[RW][RX];
  min_terms<RW, RX>(sc, a, m0, groups, mins);
  for (int i = 0; i < RW; ++i) {
    for (int r = 0; r < RX; ++r) out[r * ldo + i] = hsum(acc[i][r]) + mins[i][r];
  }
}

// ---- Q4_K and Q5_K a super-block at a time (quant_linear_i8's super-block path) ----
//
// llama.cpp's Q4_K x Q8_K dot, in weft's tiles: x rounded per 256 (one scale, ActInt8 with group
// 256 and integer sums per 32); per super-block and (weight row, x row) the eight groups' dots are
// summed in int32 lanes, each group's by the vpmaddwd that multiplies it by its 6-bit sc (where the
// per-32 path multiplies by ones), so one conversion and one FMA by d times x's scale per 256
// weights instead of per 32; the min term is an integer dot of the eight m with x's sums per 32,
// times dmin times x's scale, once per super-block (super_min_terms). Every (weight row, x row) pair
// runs the same operations in the same order whatever the tile (the accumulator's lanes, super-blocks
// in order, one horizontal sum, the min term): batch invariant.

constexpr int64_t kSuperRecord = 20;  // bytes of a Q4_K or Q5_K record: fp16 d, fp16 dmin, 8 sc, 8 m
constexpr int64_t kSuperPairs = SuperScales::kWeights / (2 * kBlock);  // pairs of groups a super-block

// A super-block's eight sc (the record at r) as int16, the same eight in both 128-bit halves.
inline __m256i super_sc16(const uint8_t* r) {
  return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 4))));
}

// Pair j's scales from super_sc16: sc[2j] in the eight int16 of the low half, sc[2j + 1] in the high
// half's, as the pair's maddubs sums lie (group 2j's in the low half, 2j + 1's in the high).
inline __m256i pair_sc16(__m256i sc16, int j) {
  const int16_t lo = static_cast<int16_t>((4 * j) | (4 * j + 1) << 8), hi = static_cast<int16_t>(lo + 0x0202);
  return _mm256_shuffle_epi8(
      sc16, _mm256_setr_epi16(lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi));
}

// A pair's integer dot, scaled per group, for one (weight row, x row): lo and hi the pair's
// unpacked weights (under 32), x its paired x, sc its pair_sc16. Each maddubs pair is at most
// 2 * 31 * 127 = 7874 (int5; int4 2 * 15 * 127), the lo and hi ones' sum at most 15748, in int16;
// vpmaddwd by sc <= 63 then makes int32 lanes of at most 2 * 15748 * 63 = 1984248.
inline __m256i scaled_dot2(__m256i lo, __m256i hi, const int8_t* x, __m256i sc) {
  const __m256i pairs =
      _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                       _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + kBlock))));
  return _mm256_madd_epi16(pairs, sc);
}

// The min terms' weight lanes of super-blocks sb and sb + 1 of a row (r0 its record of sb; lone:
// sb the last, the second's lanes 0): the eight m of each as int16 (lanes 0-7, 8-15), and dmin
// (fp32 lanes 0-3, 4-7).
inline __m256i super_pair_mins(const uint8_t* r0, bool lone) {
  auto m16 = [](const uint8_t* r) {
    return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 12)));
  };
  return _mm256_inserti128_si256(_mm256_castsi128_si256(m16(r0)), lone ? _mm_setzero_si128() : m16(r0 + kSuperRecord),
                                 1);
}
inline __m256 super_pair_dmin(const uint8_t* r0, bool lone) {
  return halves(SuperScales::half_at(r0 + 2), lone ? 0.f : SuperScales::half_at(r0 + kSuperRecord + 2));
}

// The min terms of a super-block tile, sum over super-blocks of dmin * xs * sum_g m_g * bsum_g,
// into out[i][r]: two super-blocks a step (lanes 0-3 the first, 4-7 the second, each lane an exact
// vpmaddwd of two m <= 63 by two x sums |bsum| <= 32 * 127: at most 512064), converted and FMAed
// by dmin times x's scale; a lone last super-block with its high half zero; one horizontal sum.
template <int RW, int RX>
void super_min_terms(const uint8_t* const (&rec)[RW], const ActInt8& a, int64_t m0, int64_t supers,
                     float (&out)[RW][RX]) {
  __m256 acc[RW][RX];
  for (auto& per_w : acc) for (auto& v : per_w) v = _mm256_setzero_ps();
  const int16_t* bs[RX];
  const float* xs[RX];
  for (int r = 0; r < RX; ++r) {
    bs[r] = a.bsums_row(m0 + r);
    xs[r] = a.srow(m0 + r);
  }
  auto step = [&](int64_t sb, bool lone) {
    for (int i = 0; i < RW; ++i) {
      const uint8_t* r0 = rec[i] + sb * kSuperRecord;
      const __m256i mins = super_pair_mins(r0, lone);
      const __m256 dmin = super_pair_dmin(r0, lone);
      for (int r = 0; r < RX; ++r) {
        const int16_t* b = bs[r] + sb * 8;
        const __m256i sums = lone ? _mm256_inserti128_si256(_mm256_setzero_si256(),
                                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 0)
                                  : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
        const __m256 scale = _mm256_mul_ps(dmin, halves(xs[r][sb], lone ? 0.f : xs[r][sb + 1]));
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins, sums)), scale, acc[i][r]);
      }
    }
  };
  int64_t sb = 0;
  for (; sb + 2 <= supers; sb += 2) step(sb, false);
  if (sb < supers) step(sb, true);
  for (int i = 0; i < RW; ++i) {
    for (int r = 0; r < RX; ++r) out[i][r] = hsum(acc[i][r]);
  }
}

// What a Q4_K or Q5_K super-block tile reads (weight rows [n, n + RW), rows [m0, m0 + RX) of x),
// the same for the 256-bit tile and the 512-bit one.
template <int RW, int RX, bool kInt5>
struct SuperOperands {
  const uint8_t* q[RW];    // nibbles
  const uint8_t* h[RW];    // Q5_K's bit planes
  const uint8_t* rec[RW];  // records
  const int8_t* xp[RX];    // paired x
  const float* xs[RX];     // x's scale per 256
  // Q5_K: the fifth bits of the rows at ahead, a row holding a quarter as many bytes of them as of
  // nibbles.
  const uint8_t* ahead_high;
  SuperOperands(const Packed& w, int64_t n, const ActInt8& a, int64_t m0, const uint8_t* ahead)
      : ahead_high(kInt5 && ahead != nullptr ? w.qhigh + (ahead - w.qweight) / 4 : nullptr) {
    for (int i = 0; i < RW; ++i) {
      q[i] = w.qweight + (n + i) * w.row_bytes;
      h[i] = kInt5 ? w.high_row(n + i) : nullptr;
      rec[i] = static_cast<const uint8_t*>(w.scale_row(n + i));
    }
    for (int r = 0; r < RX; ++r) {
      xp[r] = a.paired_row(m0 + r);
      xs[r] = a.srow(m0 + r);
    }
  }
  __m256i sc16(int i, int64_t sb) const { return super_sc16(rec[i] + sb * kSuperRecord); }
  float d(int i, int64_t sb) const { return SuperScales::half_at(rec[i] + sb * kSuperRecord); }
};

// Q4_K (kInt5: Q5_K, its fifth bits as bit planes) weight rows [n, n + RW) against rows
// [m0, m0 + RX) of x rounded per 256.
template <int RW, int RX, bool kInt5>
void tile_i8_super(const Packed& w, int64_t n, const ActInt8& a, int64_t m0, float* out, int64_t ldo,
                   const uint8_t* ahead) {
  __m256 acc[RW][RX];
  for (auto& per_w : acc) for (auto& v : per_w) v = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const SuperOperands<RW, RX, kInt5> op(w, n, a, m0, ahead);
  const int64_t supers = w.K / SuperScales::kWeights;
  for (int64_t sb = 0; sb < supers; ++sb) {
    __m256i sums[RW][RX];
    for (auto& per_w : sums) for (auto& v : per_w) v = _mm256_setzero_si256();
    __m256i sc16[RW], planes[RW];
    for (int i = 0; i < RW; ++i) {
      sc16[i] = op.sc16(i, sb);
      if constexpr (kInt5) planes[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(op.h[i] + sb * 32));
    }
    if constexpr (kInt5 && RX == 1) prefetch_share<RW>(op.ahead_high, sb, 32);  // the next rows' planes
    // Pair j of the super-block; j a constant, so the planes' shifts are immediates.
    auto pair_step = [&](auto pair) {
      constexpr int j = decltype(pair)::value;
      const int64_t p = sb * kSuperPairs + j;
      prefetch_share<RW>(ahead, p, kBlock);
      for (int i = 0; i < RW; ++i) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(op.q[i] + p * kBlock));
        __m256i lo = _mm256_and_si256(bytes, mask), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
        if constexpr (kInt5) {
          __m256i lo5, hi5;
          fifth_bits_of_planes<j>(planes[i], lo5, hi5);
          lo = _mm256_or_si256(lo, lo5);
          hi = _mm256_or_si256(hi, hi5);
        }
        const __m256i sc = pair_sc16(sc16[i], j);
        for (int r = 0; r < RX; ++r) {
          sums[i][r] = _mm256_add_epi32(sums[i][r], scaled_dot2(lo, hi, op.xp[r] + p * 2 * kBlock, sc));
        }
      }
    };
    static_assert(kSuperPairs == 4, "a super-block is four pairs of groups");
    pair_step(std::integral_constant<int, 0>{});
    pair_step(std::integral_constant<int, 1>{});
    pair_step(std::integral_constant<int, 2>{});
    pair_step(std::integral_constant<int, 3>{});
    // Four pairs a lane, at most 4 * 1984248 = 7936992 < 2^24: converted to fp32 exactly.
    for (int i = 0; i < RW; ++i) {
      const __m256 d = _mm256_set1_ps(op.d(i, sb));
      for (int r = 0; r < RX; ++r) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(op.xs[r][sb]));
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][r]), scale, acc[i][r]);
      }
    }
  }
  float mins[RW][RX];
  super_min_terms<RW, RX>(op.rec, a, m0, supers, mins);
  for (int i = 0; i < RW; ++i) {
    for (int r = 0; r < RX; ++r) out[r * ldo + i] = hsum(acc[i][r]) - mins[i][r];
  }
}

// The int8 layout in the same tiles: per block of 32, a weight row's bytes loaded once (their
// magnitudes for maddubs, their signs moved onto x), one integer dot per (weight row, x row) and
// one FMA by the product of the scales (per half block where the group is 16). A half block at
// the end (K a multiple of 16 only) reads x's zero padding.
template <ScaleKind kScales, int G>
struct Int8Scales {
  static constexpr bool kHalf = kScales == ScaleKind::kHalf;
  const void* s;
  // kSuper: group g's scale, d * sc of its super-block's record.
  float super_scale(int64_t g) const { return SuperScales::scale(static_cast<const uint8_t*>(s), g, false, G); }
  // kSuper, G 16: the 16 group scales of super-block sb (d * sc, the floats super_scale gives),
  // groups 0-7 in out[0] and 8-15 in out[1]: the record read once for its eight blocks.
  void sixteen(int64_t sb, __m256 (&out)[2]) const {
    const uint8_t* r = static_cast<const uint8_t*>(s) + sb * SuperScales::record_bytes(false, G);
    const __m256 d = _mm256_set1_ps(SuperScales::half_at(r));
    for (int h = 0; h < 2; ++h) {
      const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 2 + 8 * h));
      out[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    }
  }
  // The scales of blocks b..b + 7, in order (G 32, fp32 or fp16 scales).
  __m256 eight(int64_t b) const {
    static_assert(G == 32 && kScales != ScaleKind::kSuper, "eight block scales: groups of 32, one scale each");
    if constexpr (kHalf) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(s) + b)));
    } else {
      return _mm256_loadu_ps(static_cast<const float*>(s) + b);
    }
  }
  // Block b's scale in all lanes (G 32), or group 2b's in lanes 0-3 and 2b + 1's in 4-7 (G 16;
  // the second 0 in a half block, whose x lanes are zero).
  __m256 block(int64_t b, bool half) const {
    if constexpr (G == 32) {
      if constexpr (kScales == ScaleKind::kSuper) {
        return _mm256_set1_ps(super_scale(b));
      } else if constexpr (kHalf) {
        return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<const uint16_t*>(s)[b])));
      } else {
        return _mm256_broadcast_ss(static_cast<const float*>(s) + b);
      }
    } else {
      float lo, hi;
      if constexpr (kScales == ScaleKind::kSuper) {
        lo = super_scale(2 * b);
        hi = half ? 0.f : super_scale(2 * b + 1);
      } else if constexpr (kHalf) {
        const uint16_t* h = static_cast<const uint16_t*>(s);
        const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(h[2 * b] | (half ? 0 : int32_t{h[2 * b + 1]} << 16)));
        lo = _mm_cvtss_f32(two);
        hi = _mm_cvtss_f32(_mm_movehdup_ps(two));
      } else {
        lo = static_cast<const float*>(s)[2 * b];
        hi = half ? 0.f : static_cast<const float*>(s)[2 * b + 1];
      }
      return halves(lo, hi);
    }
  }
};

// A tile's int8 (or int6) weight rows [n, n + RW): each row's bytes, high bits (int6; else null)
// and scales.
template <int RW, ScaleKind kScales, int G>
struct Int8Rows {
  const int8_t* q[RW];
  const uint8_t* h[RW];
  Int8Scales<kScales, G> sc[RW];
  Int8Rows(const Packed& w, int64_t n) {
    for (int i = 0; i < RW; ++i) {
      q[i] = reinterpret_cast<const int8_t*>(w.qweight + (n + i) * w.row_bytes);
      h[i] = w.high_row(n + i);
      sc[i] = {w.scale_row(n + i)};
    }
  }
  // Block b of row i (half: its first 16 bytes, the rest 0).
  __m256i block(int i, int64_t b, bool half) const {
    const int8_t* qb = q[i] + b * kBlock;
    return half ? _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)), 0)
                : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb));
  }
  // int6: each row's weights [128 c, 128 c + 128) unpacked into chunk (q in [0, 64)), once for the
  // four blocks that read them (unpacked apart from the dots, whose registers it would crowd).
  alignas(32) uint8_t chunk[RW][128];
  void unpack(int64_t c) {
    for (int i = 0; i < RW; ++i) int6_chunk(reinterpret_cast<const uint8_t*>(q[i]), h[i], c, chunk[i]);
  }
  // int6: block b of row i, unsigned, from the unpacked chunk (b in the last one unpacked).
  __m256i unsigned_block(int i, int64_t b) const {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(chunk[i] + b % 4 * kBlock));
  }
};

// kInt6: the int6 layout, its weights unpacked 128 at a time (Int8Rows::unpack) as unsigned q in
// [0, 64): each lane's dot is dot_u8s8(q, x) less 32 times the sum of its four x (ActInt8::bias),
// exactly the integer sum (q - 32) x the int8 layout's vpsignb route gives for Q6_K, so its bits.
// The rest is the int8 tile's, operation for operation.
template <int RW, int RX, ScaleKind kScales, int G, bool kInt6>
void tile_i8_int8(const Packed& w, int64_t n, const ActInt8& a, int64_t m0, float* out, int64_t ldo,
                  const uint8_t* ahead) {
  __m256 acc[RW][RX];
  for (auto& per_w : acc) for (auto& v : per_w) v = _mm256_setzero_ps();
  Int8Rows<RW, kScales, G> rows(w, n);
  auto& sc = rows.sc;
  const int64_t whole = w.K / kBlock;
  // A step's prefetch share: int6 reads 24 bytes of a weight row a block (16 of low bits, 8 of high
  // bits, in two tensors); its low bits are prefetched here, the high bits with the scales.
  constexpr int64_t kStepBytes = kInt6 ? kBlock / 2 : kBlock;
  // One block for every (weight row, x row) of the tile: weight row i's scale lanes given
  // (scale_of(i)), and the product of those with x row r's (times_x(ws, r)).
  auto step = [&](int64_t b, bool half, auto&& scale_of, auto&& times_x) {
    prefetch_share<RW>(ahead, b, kStepBytes);
    if constexpr (kInt6) {
      if (b % 4 == 0) rows.unpack(b / 4);  // K a multiple of 128: no half block
    }
    for (int i = 0; i < RW; ++i) {
      __m256i sgn, u;
      if constexpr (kInt6) {
        u = rows.unsigned_block(i, b);
      } else {
        sgn = rows.block(i, b, half);
        u = _mm256_abs_epi8(sgn);  // -128 becomes 0x80, which is 128 as unsigned
      }
      const __m256 ws = scale_of(i);
      for (int r = 0; r < RX; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qrow(m0 + r) + b * kBlock));
        const __m256 scale = times_x(ws, r);
        __m256i dot;
        if constexpr (kInt6) {
          const __m256i bias = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bias_row(m0 + r) + b * 8));
          dot = _mm256_sub_epi32(dot_u8s8(u, xv), bias);
        } else {
          dot = dot_u8s8(u, _mm256_sign_epi8(xv, sgn));
        }
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[i][r]);
      }
    }
  };
  // x row r's scale of block b in all lanes, times the weight row's (G 32); its groups 2b and
  // 2b + 1 in the two halves (G 16).
  const auto by_block = [&](int64_t b) {
    return [&a, m0, b](__m256 ws, int r) { return _mm256_mul_ps(ws, _mm256_broadcast_ss(a.srow(m0 + r) + b)); };
  };
  const auto by_groups = [&](int64_t b) {
    return [&a, m0, b](__m256 ws, int r) {
      const float* xs = a.srow(m0 + r);
      return _mm256_mul_ps(ws, halves(xs[2 * b], xs[2 * b + 1]));
    };
  };
  if constexpr (kScales == ScaleKind::kSuper && G == 16) {
    // Q6_K (K a multiple of 256: whole super-blocks, no half block): each weight row's 16 group
    // scales formed once per super-block, each block's two spread over its lanes by a permute;
    // the same floats block() gives, without decoding the record per block.
    for (int64_t sb = 0; sb < whole / 8; ++sb) {
      __m256 s16[RW][2];
      for (int i = 0; i < RW; ++i) sc[i].sixteen(sb, s16[i]);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const int lo = 2 * (j % 4), hi = lo + 1;
        const __m256i spread = _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi);
        const int64_t b = sb * 8 + j;
        step(b, false, [&](int i) { return _mm256_permutevar8x32_ps(s16[i][j / 4], spread); }, by_groups(b));
      }
    }
  } else if constexpr (G == 32 && kScales != ScaleKind::kSuper && !kInt6) {
    // Q8_0 (and the int8 copy): eight blocks' scales a step, read and converted as one vector per
    // weight row; at one row of x multiplied by x's eight scales once, each block's product taken
    // by a permute (above one row, each weight row's scale spread once and multiplied by x's).
    // The same floats as per block (a product of the same two scales): only the route differs.
    // Gemma 3 270M's Q8_0 output head (262,144 x 640) at one row of x, 1.3x (AVX2, Zen 1).
    int64_t b = 0;
    for (; b + 8 <= whole; b += 8) {
      __m256 ws8[RW];
      for (int i = 0; i < RW; ++i) ws8[i] = sc[i].eight(b);
      if constexpr (RX == 1) {
        const __m256 xs8 = _mm256_loadu_ps(a.srow(m0) + b);
        for (int i = 0; i < RW; ++i) ws8[i] = _mm256_mul_ps(ws8[i], xs8);
      }
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i lane = _mm256_set1_epi32(j);
        auto ws_of = [&](int i) { return _mm256_permutevar8x32_ps(ws8[i], lane); };
        if constexpr (RX == 1) {
          step(b + j, false, ws_of, [](__m256 product, int) { return product; });
        } else {
          step(b + j, false, ws_of, by_block(b + j));
        }
      }
    }
    for (; b < whole; ++b) step(b, false, [&](int i) { return sc[i].block(b, false); }, by_block(b));
    if (whole < a.blocks) step(whole, true, [&](int i) { return sc[i].block(whole, true); }, by_block(whole));
  } else {
    const auto by_x = [&](int64_t b) {
      if constexpr (G == 16) {
        return by_groups(b);
      } else {
        return by_block(b);
      }
    };
    for (int64_t b = 0; b < whole; ++b) step(b, false, [&](int i) { return sc[i].block(b, false); }, by_x(b));
    if (whole < a.blocks) step(whole, true, [&](int i) { return sc[i].block(whole, true); }, by_x(whole));
  }
  for (int i = 0; i < RW; ++i) {
    for (int r = 0; r < RX; ++r) out[r * ldo + i] = hsum(acc[i][r]);
  }
}

// Q6_K weight rows [n, n + RW) against rows [m0, m0 + RX) of x rounded per 256: the super-block
// path for the int6 layout (llama.cpp's Q6_K x Q8_K dot in weft's tiles). Per block of 32 (a
// weight row's weights unpacked 128 at a time, into four registers at one row of x, int6_vectors,
// else into a buffer, Int8Rows::unpack), maddubs of q in [0, 64) by x (a pair at most
// 2 * 63 * 127 = 16002) less x's pair biases (ActInt8::pair_bias) gives the pairs of (q - 32) x,
// each in [-8128, 7874], in int16; vpmaddwd by the two groups' signed sc (|sc| <= 128) makes int32
// lanes of at most 2 * 8128 * 128 = 2080768, and a super-block's eight blocks at most 16646144 <
// 2^24 a lane: converted to fp32 exactly, once per super-block, and FMAed by d times x's scale. The
// same operations in the same order for a pair in every tile shape.
// What a Q6_K super-block tile reads (weight rows [n, n + RW), rows [m0, m0 + RX) of x), the same
// for the 256-bit tile and the 512-bit one.
template <int RW, int RX>
struct Super6Operands {
  static constexpr int64_t kRecord = 18;  // fp16 d, 16 int8 sc
  Int8Rows<RW, ScaleKind::kSuper, 16> rows;
  const uint8_t* q[RW];    // low bits
  const uint8_t* h[RW];    // high bits
  const uint8_t* rec[RW];  // records
  const int8_t* xq[RX];    // x
  const int16_t* xb[RX];   // x's pair biases
  const int32_t* xm[RX];   // the zmm tile's: x's lane biases, negated (ActInt8::minus_bias)
  const float* xs[RX];     // x's scale per 256
  // The high bits of the rows at ahead: a row holds half as many bytes of them as of low bits.
  const uint8_t* ahead_high;
  Super6Operands(const Packed& w, int64_t n, const ActInt8& a, int64_t m0, const uint8_t* ahead)
      : rows(w, n), ahead_high(ahead == nullptr ? nullptr : w.qhigh + (ahead - w.qweight) / 2) {
    for (int i = 0; i < RW; ++i) {
      q[i] = reinterpret_cast<const uint8_t*>(rows.q[i]);
      h[i] = rows.h[i];
      rec[i] = static_cast<const uint8_t*>(w.scale_row(n + i));
    }
    for (int r = 0; r < RX; ++r) {
      xq[r] = a.qrow(m0 + r);
      xb[r] = a.pair_bias_row(m0 + r);
      xm[r] = a.minus_bias.empty() ? nullptr : a.minus_bias_row(m0 + r);
      xs[r] = a.srow(m0 + r);
    }
  }
  // Weight row i's sc of groups 0-7 (half 0) or 8-15 (half 1) of super-block sb, as int16 in both
  // 128-bit halves.
  __m256i sc16(int i, int64_t sb, int half) const {
    const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec[i] + sb * kRecord + 2 + 8 * half));
    return _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc));
  }
  float d(int i, int64_t sb) const { return SuperScales::half_at(rec[i] + sb * kRecord); }
};

template <int RW, int RX>
void tile_i8_super6(const Packed& w, int64_t n, const ActInt8& a, int64_t m0, float* out, int64_t ldo,
                    const uint8_t* ahead) {
  __m256 acc[RW][RX];
  for (auto& per_w : acc) for (auto& v : per_w) v = _mm256_setzero_ps();
  Super6Operands<RW, RX> op(w, n, a, m0, ahead);
  const int64_t supers = w.K / SuperScales::kWeights;
  for (int64_t sb = 0; sb < supers; ++sb) {
    __m256i sums[RW][RX];
    for (auto& per_w : sums) for (auto& v : per_w) v = _mm256_setzero_si256();
    __m256i sc16[RW][2];  // groups 0-7 and 8-15 of the super-block, as int16 in both halves
    for (int i = 0; i < RW; ++i) {
      for (int half = 0; half < 2; ++half) sc16[i][half] = op.sc16(i, sb, half);
    }
    // Block b of weight row i (its q in u, its pair's scales sc) against every row of x. Each
    // (weight row, x row) sum takes the blocks in order whichever way u comes.
    auto block = [&](int i, int64_t b, __m256i u, __m256i sc) {
      for (int r = 0; r < RX; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(op.xq[r] + b * kBlock));
        const __m256i bias = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(op.xb[r] + b * kBlock / 2));
        const __m256i pairs = _mm256_sub_epi16(_mm256_maddubs_epi16(u, xv), bias);
        sums[i][r] = _mm256_add_epi32(sums[i][r], _mm256_madd_epi16(pairs, sc));
      }
    };
    if constexpr (RX == 1) {
      // At one row of x, each weight row's next 128 weights unpacked into four registers and used
      // there (1.04-1.06x the buffer's round trip below).
      for (int half = 0; half < 2; ++half) {
        const int64_t c = sb * 2 + half;
        // The next rows' share of this chunk: 64 bytes of low bits and 32 of high bits a row.
        for (int j = 0; j < 2; ++j) prefetch_share<RW>(ahead, c * 2 + j, kBlock);
        prefetch_share<RW>(op.ahead_high, c, kBlock);
        for (int i = 0; i < RW; ++i) {
          __m256i u[4];
          int6_vectors(op.q[i], op.h[i], c, u);
          for (int j = 0; j < 4; ++j) block(i, c * 4 + j, u[j], pair_sc16(sc16[i][half], j));
        }
      }
    } else {
      // Above, through a buffer (Int8Rows::unpack): the four registers a weight row beside the
      // tile's RW x RX sums read 0.93-0.98x.
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const int64_t b = sb * 8 + j;
        prefetch_share<RW>(ahead, b, kBlock / 2);  // 16 bytes of low bits a block; high bits with the scales
        if (j % 4 == 0) op.rows.unpack(b / 4);
        for (int i = 0; i < RW; ++i) {
          block(i, b, op.rows.unsigned_block(i, b), pair_sc16(sc16[i][j / 4], j % 4));
        }
      }
    }
    for (int i = 0; i < RW; ++i) {
      const __m256 d = _mm256_set1_ps(op.d(i, sb));
      for (int r = 0; r < RX; ++r) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(op.xs[r][sb]));
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][r]), scale, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < RW; ++i) {
    for (int r = 0; r < RX; ++r) out[r * ldo + i] = hsum(acc[i][r]);
  }
}

#ifdef WEFT_ZMM
// ---- the same tiles on 512-bit vectors (AVX-512 builds) ----
//
// Two weight rows share a zmm: row 2h's accumulator in lanes 0-7, row 2h + 1's in lanes 8-15,
// each exactly the 8-lane accumulator of the 256-bit tiles above; a row of x's bytes and scales
// are broadcast into both halves (vbroadcasti64x4 from memory). So each 512-bit vpdpbusd,
// conversion and FMA does the work of two 256-bit ones with the same operations on the same values
// per lane, the int4 nibbles are unpacked once per two rows, and each half is summed at the end by
// the same hsum: the bits are those of the 256-bit tiles (and of the AVX2 build).

// Row a's 256 bits in lanes 0-7, row b's in lanes 8-15.
inline __m512i rows2(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
inline __m512 rows2(__m256 a, __m256 b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}
inline __m512i rows2(const void* a, const void* b) {
  return rows2(_mm256_loadu_si256(static_cast<const __m256i*>(a)), _mm256_loadu_si256(static_cast<const __m256i*>(b)));
}
// 256 bits in both halves.
inline __m512i both(const void* p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
inline __m512 both(__m256 v) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v))); }
inline __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// Out[r * ldo + i] for the RW weight rows (even) of a tile: each half's hsum plus its row's tail.
template <int RW, int RX, class Tail>
inline void store_halves(const __m512 (&acc)[RW / 2][RX], float* out, int64_t ldo, Tail&& tail) {
  __m256 halves[RX][RW];  // weight row 2h's lanes, then 2h + 1's
  for (int r = 0; r < RX; ++r) {
    for (int h = 0; h < RW / 2; ++h) {
      halves[r][2 * h] = _mm512_castps512_ps256(acc[h][r]);
      halves[r][2 * h + 1] = high_half(acc[h][r]);
    }
  }
  float sums[RX][RW];
  hsums(&halves[0][0], RX * RW, &sums[0][0]);
  for (int r = 0; r < RX; ++r) {
    for (int i = 0; i < RW; ++i) out[r * ldo + i] = sums[r][i] + tail(i, r);
  }
}

// min_terms with two weight rows to a zmm: each half the same eight FMA lanes over the groups in
// order, the same hsum, then the same scalar tail; each weight row's mins formed once for all the
// tile's rows of x.
template <int RW, int RX, ScaleKind kScales, bool kInt5>
void min_terms_zmm(const Int4Scales<kScales, kInt5> (&sc)[RW], const ActInt8& a, int64_t m0, int64_t groups,
                   float (&out)[RW][RX]) {
  constexpr int H = RW / 2;
  __m512 acc[H][RX];
  for (auto& per_w : acc) for (auto& v : per_w) v = _mm512_setzero_ps();
  const float* xsums[RX];
  for (int r = 0; r < RX; ++r) xsums[r] = a.sums.data() + (m0 + r) * groups;
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    for (int h = 0; h < H; ++h) {
      const __m512 mv = rows2(sc[2 * h].eight_mins(g), sc[2 * h + 1].eight_mins(g));
      for (int r = 0; r < RX; ++r) acc[h][r] = _mm512_fmadd_ps(mv, both(_mm256_loadu_ps(xsums[r] + g)), acc[h][r]);
    }
  }
  for (int h = 0; h < H; ++h) {
    for (int r = 0; r < RX; ++r) {
      out[2 * h][r] = hsum(_mm512_castps512_ps256(acc[h][r]));
      out[2 * h + 1][r] = hsum(high_half(acc[h][r]));
    }
  }
  min_terms_tail<RW, RX>(sc, xsums, g, groups, out);
}

// tile_i8_int4 with weight rows two to a zmm (kInt5: each row's fifth bits as the 256-bit tile
// forms them, put side by side).
template <int RW, int RX, ScaleKind kScales, bool kInt5>
void tile_i8_int4_zmm(const Packed& w, int64_t n, const ActInt8& a, int64_t m0, float* out, int64_t ldo,
                      const uint8_t* ahead) {
  static_assert(RW % 2 == 0, "two weight rows a zmm");
  constexpr int H = RW / 2;
  __m512 acc[H][RX];
  for (auto& per_w : acc) for (auto& v : per_w) v = _mm512_setzero_ps();
  const int64_t groups = w.groups, pairs = groups / 2;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  Int4Rows<RW, kScales, kInt5> rows(w, n);
  auto& q = rows.q;
  auto& hb = rows.h;
  auto& sc = rows.sc;
  const PairedXRows<RX> xs(a, m0);
  const auto& xp = xs.xp;
  const auto& xl = xs.xl;
  auto pair_step = [&](int64_t p, auto&& scale_of) {
    prefetch_share<RW>(ahead, p, kBlock);
    for (int h = 0; h < H; ++h) {
      const __m512i bytes = rows2(q[2 * h] + p * kBlock, q[2 * h + 1] + p * kBlock);
      __m512i lo = _mm512_and_si512(bytes, mask), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask);
      if constexpr (kInt5) {
        __m256i lo0, hi0, lo1, hi1;
        fifth_bits_pair(hb[2 * h] + p * 8, lo0, hi0);
        fifth_bits_pair(hb[2 * h + 1] + p * 8, lo1, hi1);
        lo = _mm512_or_si512(lo, rows2(lo0, lo1));
        hi = _mm512_or_si512(hi, rows2(hi0, hi1));
      }
      for (int r = 0; r < RX; ++r) {
        const int8_t* x = xp[r] + p * 2 * kBlock;
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, both(x)), hi,
                                                both(x + kBlock));
        acc[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale_of(h, r), acc[h][r]);
      }
    }
  };
  // Four pairs at a time: the eight block scales of each two weight rows loaded as one vector and
  // spread over each pair's lanes by one permute, then multiplied by x's scales as ActInt8::lanes
  // holds them (already spread): the same products the 256-bit tiles make, one permute per two
  // weight rows rather than one per (weight row, x row).
  alignas(64) static constexpr int32_t kSpread[4][16] = {
      {0, 0, 0, 0, 1, 1, 1, 1, 8, 8, 8, 8, 9, 9, 9, 9},
      {2, 2, 2, 2, 3, 3, 3, 3, 10, 10, 10, 10, 11, 11, 11, 11},
      {4, 4, 4, 4, 5, 5, 5, 5, 12, 12, 12, 12, 13, 13, 13, 13},
      {6, 6, 6, 6, 7, 7, 7, 7, 14, 14, 14, 14, 15, 15, 15, 15}};
  int64_t p = 0;
  for (; p + 4 <= pairs; p += 4) {
    __m512 ws16[H];
    for (int h = 0; h < H; ++h) ws16[h] = rows2(sc[2 * h].eight(2 * p), sc[2 * h + 1].eight(2 * p));
    for (int j = 0; j < 4; ++j) {
      const __m512i spread = _mm512_load_si512(kSpread[j]);
      __m512 ws[H];
      for (int h = 0; h < H; ++h) ws[h] = _mm512_permutexvar_ps(spread, ws16[h]);
      const int64_t pj = p + j;
      pair_step(pj, [&](int h, int r) { return _mm512_mul_ps(ws[h], both(_mm256_loadu_ps(xl[r] + pj * 8))); });
    }
  }
  for (; p < pairs; ++p) {
    __m512 ws[H];
    for (int h = 0; h < H; ++h) ws[h] = rows2(sc[2 * h].pair(p), sc[2 * h + 1].pair(p));
    pair_step(p, [&](int h, int r) { return _mm512_mul_ps(ws[h], both(_mm256_loadu_ps(xl[r] + p * 8))); });
  }
  if (groups % 2) {
    const int64_t b = groups - 1;
    for (int h = 0; h < H; ++h) {
      const __m512i u = rows2(int4or5_block<kInt5>(q[2 * h], hb[2 * h], b),
                              int4or5_block<kInt5>(q[2 * h + 1], hb[2 * h + 1], b));
      const __m512 ws = rows2(_mm256_set1_ps(sc[2 * h].scale(b)), _mm256_set1_ps(sc[2 * h + 1].scale(b)));
      for (int r = 0; r < RX; ++r) {
        const __m512i xv = both(a.qrow(m0 + r) + b * kBlock);
        const __m512 xs = _mm512_set1_ps(a.srow(m0 + r)[b]);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xv);
        acc[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, xs), acc[h][r]);
      }
    }
  }
  float mins[RW][RX];
  min_terms_zmm<RW, RX>(sc, a, m0, groups, mins);
  store_halves<RW, RX>(acc, out, ldo, [&](int i, int r) { return mins[i][r]; });
}

// tile_i8_int8 with weight rows two to a zmm. vpsignb has no 512-bit form: vpdpbusd takes x + 128
// (ActInt8::qu) as its unsigned bytes and the weights as they are, from an accumulator of -128
// times each lane's four weights (one per weight row and block, for every row of x), which leaves
// the exact integer sum w x, the same int32 dot as vpsignb's route, so the same bits; one
// instruction a (weight row, x row) pair where moving the signs onto x took two. kInt6: each row's blocks
// unpacked and their dots less x's bias, as the 256-bit tile does, put side by side.
template <int RW, int RX, ScaleKind kScales, int G, bool kInt6>
void tile_i8_int8_zmm(const Packed& w, int64_t n, const ActInt8& a, int64_t m0, float* out, int64_t ldo,
                      const uint8_t* ahead) {
  static_assert(RW % 2 == 0, "two weight rows a zmm");
  constexpr int H = RW / 2;
  __m512 acc[H][RX];
  for (auto& per_w : acc) for (auto& v : per_w) v = _mm512_setzero_ps();
  Int8Rows<RW, kScales, G> rows(w, n);
  auto& sc = rows.sc;
  const int64_t whole = w.K / kBlock;
  constexpr int64_t kStepBytes = kInt6 ? kBlock / 2 : kBlock;  // of each row's qweight a block
  auto step = [&](int64_t b, bool half) {
    prefetch_share<RW>(ahead, b, kStepBytes);
    if constexpr (kInt6) {
      if (b % 4 == 0) rows.unpack(b / 4);
    }
    for (int h = 0; h < H; ++h) {
      __m512i wv, less;  // int8: the weights, and -128 times each lane's four
      if constexpr (kInt6) {
        wv = rows2(rows.unsigned_block(2 * h, b), rows.unsigned_block(2 * h + 1, b));
      } else {
        wv = rows2(rows.block(2 * h, b, half), rows.block(2 * h + 1, b, half));
        less = _mm512_sub_epi32(_mm512_setzero_si512(),
                                _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(-128), wv));
      }
      const __m512 ws = rows2(sc[2 * h].block(b, half), sc[2 * h + 1].block(b, half));
      for (int r = 0; r < RX; ++r) {
        const float* xs = a.srow(m0 + r);
        __m512 scale;
        if constexpr (G == 16) {
          scale = _mm512_mul_ps(ws, both(halves(xs[2 * b], xs[2 * b + 1])));
        } else {
          scale = _mm512_mul_ps(ws, _mm512_set1_ps(xs[b]));
        }
        __m512i dot;
        if constexpr (kInt6) {
          const __m512i xv = both(a.qrow(m0 + r) + b * kBlock);
          dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv), both(a.bias_row(m0 + r) + b * 8));
        } else {
          dot = _mm512_dpbusd_epi32(less, both(a.qu_row(m0 + r) + b * kBlock), wv);
        }
        acc[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[h][r]);
      }
    }
  };
  for (int64_t b = 0; b < whole; ++b) step(b, false);
  if (whole < a.blocks) step(whole, true);
  store_halves<RW, RX>(acc, out, ldo, [](int, int) { return 0.f; });
}

// The scales of pair_sc16 (Q4_K, Q5_K) or of block j of a half super-block (Q6_K), from sc16 in
// both halves of a zmm (each half a row's super_sc16 or Super6Operands::sc16), one to an int32
// lane: sc[2j] in lanes 0-3 of each half and sc[2j + 1] in lanes 4-7, as int16 over a zero high
// word, so vpdpwssd of a lane holding an int32 t in int16 range by it adds t * sc.
inline __m512i lane_sc_zmm(__m512i sc16, int j) {
  const int32_t lo = (4 * j) | (4 * j + 1) << 8 | 0x80 << 16 | static_cast<int32_t>(0x80u << 24), hi = lo + 0x0202;
  return _mm512_shuffle_epi8(sc16, _mm512_broadcast_i64x4(_mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi)));
}

// scaled_dot2 for two weight rows at once (lo and hi two rows' unpacked pairs, x broadcast into both
// halves) added to sums, sc from lane_sc_zmm: each lane's eight products (its four bytes of lo by x,
// of hi by x's next block) in two vpdpbusd (at most 8 * 31 * 127 = 31496: an int16 in the lane's
// low word), then times its group scale by vpdpwssd: the int32 the 256-bit tile's two maddubs, add
// and vpmaddwd give the lane (exact, as the lanes' bounds in scaled_dot2 show), in three instructions
// where those are four.
inline __m512i scaled_dot2_add(__m512i sums, __m512i lo, __m512i hi, const int8_t* x, __m512i sc) {
  const __m512i dots =
      _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, both(x)), hi, both(x + kBlock));
  return _mm512_dpwssd_epi32(sums, dots, sc);
}

// The weight side of a block of four Q4_K or Q5_K weight rows that the zmm super-block tiles read
// (tile_i8_super_zmm, super_min_terms_zmm), formed once per block of rows_tiles for all the tiles
// against it rather than by each tile: the shuffles that form it issue on one port where the
// tiles' multiplies issue on two, and at 16 rows of x four tiles share a block (the min terms had
// taken about a fifth of a 16-row call). Per pair of weight rows k (rows 2k and 2k + 1 of the
// block, a half each): d of each super-block in eight lanes; per pair of super-blocks p the m as
// int16 and dmin in super_min_terms' lanes (0-3 super-block 2p's, 4-7 2p + 1's; 0 past the last).
struct SuperRows {
  int64_t supers = 0, pairs = 0;
  std::vector<float> d;       // [2, supers, 16]
  std::vector<int16_t> mins;  // [2, pairs, 32]
  std::vector<float> dmin;    // [2, pairs, 16]
  static bool shares(const Packed&) { return true; }  // 8 KiB at K = 8192
  void fill(const Packed& w, int64_t n) {
    supers = w.K / SuperScales::kWeights;
    pairs = (supers + 1) / 2;
    d.resize(2 * supers * 16);
    mins.resize(2 * pairs * 32);
    dmin.resize(2 * pairs * 16);
    for (int k = 0; k < 2; ++k) {
      const uint8_t* rec[2] = {static_cast<const uint8_t*>(w.scale_row(n + 2 * k)),
                               static_cast<const uint8_t*>(w.scale_row(n + 2 * k + 1))};
      for (int64_t sb = 0; sb < supers; ++sb) {
        auto d8 = [&](int i) { return _mm256_set1_ps(SuperScales::half_at(rec[i] + sb * kSuperRecord)); };
        _mm512_storeu_ps(&d[(k * supers + sb) * 16], rows2(d8(0), d8(1)));
      }
      for (int64_t p = 0; p < pairs; ++p) {
        const bool lone = 2 * p + 1 == supers;
        const uint8_t* r0[2] = {rec[0] + 2 * p * kSuperRecord, rec[1] + 2 * p * kSuperRecord};
        _mm512_storeu_si512(&mins[(k * pairs + p) * 32], rows2(super_pair_mins(r0[0], lone), super_pair_mins(r0[1], lone)));
        _mm512_storeu_ps(&dmin[(k * pairs + p) * 16], rows2(super_pair_dmin(r0[0], lone), super_pair_dmin(r0[1], lone)));
      }
    }
  }
  __m512 d_of(int k, int64_t sb) const { return _mm512_loadu_ps(&d[(k * supers + sb) * 16]); }
  __m512i mins_of(int k, int64_t p) const { return _mm512_loadu_si512(&mins[(k * pairs + p) * 32]); }
  __m512 dmin_of(int k, int64_t p) const { return _mm512_loadu_ps(&dmin[(k * pairs + p) * 16]); }
};

// super_min_terms with weight rows two to a zmm, pairs k0, k0 + 1, ... of the block's SuperRows:
// each half the 256-bit lanes of one row (the same vpmaddwd of its m by x's sums, conversion,
// product of dmin and x's scales and FMA, over the same super-blocks in the same order, the same
// hsum), x's sums and scales (ActInt8::super_lanes) broadcast into both halves: the same bits.
template <int RW, int RX>
void super_min_terms_zmm(const SuperRows& sr, int k0, const ActInt8& a, int64_t m0, float (&out)[RW][RX]) {
  constexpr int H = RW / 2;
  __m512 acc[H][RX];
  for (auto& per_w : acc) for (auto& v : per_w) v = _mm512_setzero_ps();
  const int16_t* bs[RX];
  const float* lanes[RX];
  for (int r = 0; r < RX; ++r) {
    bs[r] = a.bsums_row(m0 + r);
    lanes[r] = a.super_lanes_row(m0 + r);
  }
  auto step = [&](int64_t p, bool lone) {
    __m512i sums[RX];
    __m512 xscale[RX];
    for (int r = 0; r < RX; ++r) {
      const int16_t* b = bs[r] + p * 16;
      sums[r] = lone ? _mm512_broadcast_i64x4(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))))
                     : both(b);
      xscale[r] = both(_mm256_loadu_ps(lanes[r] + p * 8));
    }
    for (int k = 0; k < H; ++k) {
      const __m512i mins = sr.mins_of(k0 + k, p);
      const __m512 dmin = sr.dmin_of(k0 + k, p);
      for (int r = 0; r < RX; ++r) {
        const __m512 scale = _mm512_mul_ps(dmin, xscale[r]);
        acc[k][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(mins, sums[r])), scale, acc[k][r]);
      }
    }
  };
  const int64_t whole = sr.supers / 2;
  for (int64_t p = 0; p < whole; ++p) step(p, false);
  if (whole < sr.pairs) step(whole, true);
  __m256 halves[RW][RX];
  for (int k = 0; k < H; ++k) {
    for (int r = 0; r < RX; ++r) {
      halves[2 * k][r] = _mm512_castps512_ps256(acc[k][r]);
      halves[2 * k + 1][r] = high_half(acc[k][r]);
    }
  }
  hsums(&halves[0][0], RW * RX, &out[0][0]);
}

// tile_i8_super with weight rows two to a zmm: each half the 8 int32 sums and 8 fp32 lanes of the
// 256-bit tile, the same operations per lane in the same order (a vpmaddwd and an add fused into
// one exact vpdpwssd), the same min terms (super_min_terms) and the same hsum: the same bits.
template <int RW, int RX, bool kInt5>
void tile_i8_super_zmm(const Packed& w, int64_t n, const ActInt8& a, int64_t m0, float* out, int64_t ldo,
                       const uint8_t* ahead, const SuperRows* sr, int k0) {
  static_assert(RW % 2 == 0, "two weight rows a zmm");
  constexpr int H = RW / 2;
  __m512 acc[H][RX];
  for (auto& per_w : acc) for (auto& v : per_w) v = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const SuperOperands<RW, RX, kInt5> op(w, n, a, m0, ahead);
  const int64_t supers = w.K / SuperScales::kWeights;
  for (int64_t sb = 0; sb < supers; ++sb) {
    __m512i sums[H][RX];
    for (auto& per_w : sums) for (auto& v : per_w) v = _mm512_setzero_si512();
    __m512i sc16[H], planes[H];
    for (int k = 0; k < H; ++k) {
      sc16[k] = rows2(op.sc16(2 * k, sb), op.sc16(2 * k + 1, sb));
      if constexpr (kInt5) planes[k] = rows2(op.h[2 * k] + sb * 32, op.h[2 * k + 1] + sb * 32);
    }
    if constexpr (kInt5 && RX == 1) prefetch_share<RW>(op.ahead_high, sb, 32);
    auto pair_step = [&](auto pair) {
      constexpr int j = decltype(pair)::value;
      const int64_t p = sb * kSuperPairs + j;
      prefetch_share<RW>(ahead, p, kBlock);
      for (int k = 0; k < H; ++k) {
        const __m512i bytes = rows2(op.q[2 * k] + p * kBlock, op.q[2 * k + 1] + p * kBlock);
        __m512i lo = _mm512_and_si512(bytes, mask), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask);
        if constexpr (kInt5) {
          // fifth_bits_of_planes on both rows' planes at once: bit_as_0x10's shift and mask per lane.
          constexpr int kLo = 2 * j, kHi = 2 * j + 1;
          auto as_0x10 = [&](auto bit) {
            constexpr int b = decltype(bit)::value;
            __m512i moved = planes[k];
            if constexpr (b < 4) moved = _mm512_slli_epi16(planes[k], 4 - b);
            if constexpr (b > 4) moved = _mm512_srli_epi16(planes[k], b - 4);
            return _mm512_and_si512(moved, _mm512_set1_epi8(0x10));
          };
          lo = _mm512_or_si512(lo, as_0x10(std::integral_constant<int, kLo>{}));
          hi = _mm512_or_si512(hi, as_0x10(std::integral_constant<int, kHi>{}));
        }
        const __m512i sc = lane_sc_zmm(sc16[k], j);
        for (int r = 0; r < RX; ++r) {
          sums[k][r] = scaled_dot2_add(sums[k][r], lo, hi, op.xp[r] + p * 2 * kBlock, sc);
        }
      }
    };
    static_assert(kSuperPairs == 4, "a super-block is four pairs of groups");
    pair_step(std::integral_constant<int, 0>{});
    pair_step(std::integral_constant<int, 1>{});
    pair_step(std::integral_constant<int, 2>{});
    pair_step(std::integral_constant<int, 3>{});
    for (int k = 0; k < H; ++k) {
      const __m512 d = sr != nullptr ? sr->d_of(k0 + k, sb)
                                     : rows2(_mm256_set1_ps(op.d(2 * k, sb)), _mm256_set1_ps(op.d(2 * k + 1, sb)));
      for (int r = 0; r < RX; ++r) {
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(op.xs[r][sb]));
        acc[k][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[k][r]), scale, acc[k][r]);
      }
    }
  }
  float mins[RW][RX];
  if (sr != nullptr) {
    super_min_terms_zmm<RW, RX>(*sr, k0, a, m0, mins);
  } else {
    super_min_terms<RW, RX>(op.rec, a, m0, supers, mins);
  }
  store_halves<RW, RX>(acc, out, ldo, [&](int i, int r) { return -mins[i][r]; });
}

// The weights of a block of four Q6_K weight rows unpacked (int6_chunk: q in [0, 64)) once for all
// the zmm tiles against them (tile_i8_super6_zmm above one row of x), as SuperRows is for Q4_K:
// at 16 rows of x each tile unpacked them again, about two-fifths of its vector operations.
struct Super6Rows {
  int64_t K = 0;
  std::vector<uint8_t> q;  // [4, K]
  // Up to 16 KiB: at K = 8192 (32 KiB) the tiles read it back from L2 slower than they unpack it
  // (0.83-0.98x at 8 and 16 rows of x; 1.11-1.17x at K = 2048 and 3072).
  static bool shares(const Packed& w) { return w.K <= 4096; }
  void fill(const Packed& w, int64_t n) {
    K = w.K;
    q.resize(4 * K);
    for (int i = 0; i < 4; ++i) {
      const uint8_t* low = w.qweight + (n + i) * w.row_bytes;
      for (int64_t c = 0; c < K / 128; ++c) int6_chunk(low, w.high_row(n + i), c, &q[i * K + c * 128]);
    }
  }
  // Block b of rows 2k and 2k + 1, a half each.
  __m512i block_of(int k, int64_t b) const { return rows2(&q[2 * k * K + b * kBlock], &q[(2 * k + 1) * K + b * kBlock]); }
};

// tile_i8_super6 with weight rows two to a zmm: each row's blocks unpacked as the 256-bit tile
// unpacks them and put side by side, x's bytes and pair biases broadcast into both halves, the
// same maddubs, subtract and vpmaddwd per lane with the add fused into vpdpwssd (exact): the
// same bits.
template <int RW, int RX>
void tile_i8_super6_zmm(const Packed& w, int64_t n, const ActInt8& a, int64_t m0, float* out, int64_t ldo,
                        const uint8_t* ahead, const Super6Rows* sr, int k0) {
  static_assert(RW % 2 == 0, "two weight rows a zmm");
  constexpr int H = RW / 2;
  __m512 acc[H][RX];
  for (auto& per_w : acc) for (auto& v : per_w) v = _mm512_setzero_ps();
  Super6Operands<RW, RX> op(w, n, a, m0, ahead);
  const int64_t supers = w.K / SuperScales::kWeights;
  for (int64_t sb = 0; sb < supers; ++sb) {
    __m512i sums[H][RX];
    for (auto& per_w : sums) for (auto& v : per_w) v = _mm512_setzero_si512();
    __m512i sc16[H][2];  // groups 0-7 and 8-15 of the super-block, two rows side by side
    for (int k = 0; k < H; ++k) {
      for (int half = 0; half < 2; ++half) {
        sc16[k][half] = rows2(op.sc16(2 * k, sb, half), op.sc16(2 * k + 1, sb, half));
      }
    }
    // Each lane's four (q - 32) x in one vpdpbusd from x's negated lane bias (at most 4 * 32 * 127 =
    // 16256 in magnitude: an int16 in the lane's low word, its high word the sign), then times the
    // lane's group scale by vpdpwssd against lane_sc_zmm: the int32 the 256-bit tile's maddubs pairs,
    // subtract and vpmaddwd give each lane, so the same bits, in two instructions where those are three.
    auto block = [&](int k, int64_t b, __m512i u, __m512i sc) {
      for (int r = 0; r < RX; ++r) {
        const __m512i dots = _mm512_dpbusd_epi32(both(op.xm[r] + b * 8), u, both(op.xq[r] + b * kBlock));
        sums[k][r] = _mm512_dpwssd_epi32(sums[k][r], dots, sc);
      }
    };
    if constexpr (RX == 1) {
      for (int half = 0; half < 2; ++half) {
        const int64_t c = sb * 2 + half;
        for (int j = 0; j < 2; ++j) prefetch_share<RW>(ahead, c * 2 + j, kBlock);
        prefetch_share<RW>(op.ahead_high, c, kBlock);
        for (int k = 0; k < H; ++k) {
          __m256i u0[4], u1[4];
          int6_vectors(op.q[2 * k], op.h[2 * k], c, u0);
          int6_vectors(op.q[2 * k + 1], op.h[2 * k + 1], c, u1);
          for (int j = 0; j < 4; ++j) block(k, c * 4 + j, rows2(u0[j], u1[j]), lane_sc_zmm(sc16[k][half], j));
        }
      }
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const int64_t b = sb * 8 + j;
        prefetch_share<RW>(ahead, b, kBlock / 2);
        if (sr == nullptr && j % 4 == 0) op.rows.unpack(b / 4);
        for (int k = 0; k < H; ++k) {
          block(k, b,
                sr != nullptr ? sr->block_of(k0 + k, b)
                              : rows2(op.rows.unsigned_block(2 * k, b), op.rows.unsigned_block(2 * k + 1, b)),
                lane_sc_zmm(sc16[k][j / 4], j % 4));
        }
      }
    }
    for (int k = 0; k < H; ++k) {
      const __m512 d = rows2(_mm256_set1_ps(op.d(2 * k, sb)), _mm256_set1_ps(op.d(2 * k + 1, sb)));
      for (int r = 0; r < RX; ++r) {
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(op.xs[r][sb]));
        acc[k][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[k][r]), scale, acc[k][r]);
      }
    }
  }
  store_halves<RW, RX>(acc, out, ldo, [](int, int) { return 0.f; });
}
#endif

// ---- int16 activations in register tiles (quant_linear_i16) ----
//
// x rounded to int16 per weight group (scale amax / 32767: 258 times finer than int8), the
// weights widened to int16 in registers, pairs multiplied and added in int32 (VNNI vpdpwssd,
// or AVX2 vpmaddwd), one fp32 FMA per group; the int4 min term folded as in the int8 path.

// 8 int32 lanes of pairwise products of int16 w and x, added to acc.
inline __m256i dot_s16(__m256i acc, __m256i w, __m256i x) {
#ifdef WEFT_VNNI
  return _mm256_dpwssd_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

// Groups whose scale products (weight's times x's) are computed ahead, 8 at a time, so the
// inner loop broadcasts each from memory instead of multiplying scalars.
constexpr int64_t kScaleChunk = 64;

// Group g of one packed weight row widened to int16: w0 (and w1, for 32-column groups); kInt5: the
// int5 layout, h the row's fifth bits (kPlanes: Q5_K's bit planes); kInt6: the int6 layout (groups
// of 16), h its high bits.
template <bool kInt4, bool kInt5, bool kInt6, int G, bool kPlanes>
inline void widen_group_i16(const uint8_t* q, const uint8_t* h, int64_t g, __m256i& w0, __m256i& w1) {
  if constexpr (kInt6) {
    // Group g's 16 weights: the 16 bytes of low and of high bits that hold them (int6_chunk's
    // unpacking, for one of its eight groups of 16), less 32.
    static_assert(G == 16, "int6 groups are 16");
    const int64_t c = g / 8, quarter = g % 8 / 2, half = g % 2;
    const __m128i ql = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * 64 + quarter % 2 * 32 + half * 16));
    const __m128i qh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + c * 32 + half * 16));
    const __m128i low = _mm_and_si128(quarter < 2 ? ql : _mm_srli_epi16(ql, 4), _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srl_epi16(qh, _mm_cvtsi32_si128(static_cast<int>(2 * quarter))),
                                       _mm_set1_epi8(0x03));
    w0 = _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32)));
  } else if constexpr (kInt5) {
    const __m256i bytes = kPlanes ? _mm256_or_si256(int4or5_block<false>(q, h, g), fifth_bits_of_group_planes(h, g))
                                  : int4or5_block<true>(q, h, g);
    w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(bytes));
    w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(bytes, 1));
  } else if constexpr (kInt4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * (kInt4Group / 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    w0 = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
    w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
  } else {
    const int8_t* qg = reinterpret_cast<const int8_t*>(q) + g * G;
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)));
    if constexpr (G == 32) w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16)));
  }
}

// prod[j] = weight scale j x activation scale j for the cn groups of one scale chunk.
inline void scale_products(float* prod, const float* sw, const float* xs, int64_t cn) {
  int64_t j = 0;
  for (; j + 8 <= cn; j += 8) _mm256_store_ps(prod + j, _mm256_mul_ps(_mm256_loadu_ps(sw + j), _mm256_loadu_ps(xs + j)));
  for (; j < cn; ++j) prod[j] = sw[j] * xs[j];
}

// RW weight rows by RX rows of x. Each (weight row, x row) pair has two accumulators, even
// groups into the first and odd ones into the second (so two FMA chains per pair), each group one
// integer dot and one FMA by the scale product; then one horizontal sum of the two and the min
// term. The same operations in the same order in every tile shape (batch invariance).
template <int RW, int RX, bool kInt4, bool kInt5, bool kInt6, int G, bool kPlanes>
void tile_i16(const Packed& w, int64_t n, const ActInt16& a, int64_t m0, float* out, int64_t ldo) {
  __m256 acc[RW][RX][2];
  for (auto& per_w : acc) for (auto& two : per_w) two[0] = two[1] = _mm256_setzero_ps();
  RowScales rs[RW];
  const uint8_t* q[RW];
  const uint8_t* h[RW];
  for (int i = 0; i < RW; ++i) {
    rs[i].read(w, n + i);
    q[i] = w.qweight + (n + i) * w.row_bytes;
    h[i] = w.high_row(n + i);
  }
  alignas(32) float prod[RW][RX][kScaleChunk];
  auto step = [&](int64_t g, int64_t c0, int slot) {
    __m256i x0[RX], x1[RX];
    for (int r = 0; r < RX; ++r) {
      const int16_t* xg = a.qrow(m0 + r) + g * G;
      x0[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg));
      x1[r] = x0[r];
      if constexpr (G == 32) x1[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16));
    }
    for (int i = 0; i < RW; ++i) {
      __m256i w0, w1;
      widen_group_i16<kInt4, kInt5, kInt6, G, kPlanes>(q[i], h[i], g, w0, w1);
      for (int r = 0; r < RX; ++r) {
        __m256i dot = dot_s16(_mm256_setzero_si256(), w0, x0[r]);
        if constexpr (G == 32) dot = dot_s16(dot, w1, x1[r]);
        acc[i][r][slot] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&prod[i][r][g - c0]), acc[i][r][slot]);
      }
    }
  };
  for (int64_t c0 = 0; c0 < w.groups; c0 += kScaleChunk) {
    const int64_t cn = std::min(kScaleChunk, w.groups - c0);
    for (int i = 0; i < RW; ++i) {
      for (int r = 0; r < RX; ++r) scale_products(prod[i][r], rs[i].s + c0, a.srow(m0 + r) + c0, cn);
    }
    int64_t g = c0;
    for (; g + 2 <= c0 + cn; g += 2) {
      step(g, c0, 0);
      step(g + 1, c0, 1);
    }
    if (g < c0 + cn) step(g, c0, 0);
  }
  for (int i = 0; i < RW; ++i) {
    for (int r = 0; r < RX; ++r) {
      float total = hsum(_mm256_add_ps(acc[i][r][0], acc[i][r][1]));
      if constexpr (kInt4) total += min_term(rs[i].m, a.sums.data() + (m0 + r) * w.groups, w.groups);
      out[r * ldo + i] = total;
    }
  }
}

// What the tiles of a layout without a per-block weight side (rows_tiles' Block) get.
struct NoBlock {
  static bool shares(const Packed&) { return false; }
  void fill(const Packed&, int64_t) {}
};

// The int8-activation tile of a layout (kInt5: int4 with fifth bits; kInt6: int8 unpacked from
// nibbles and two high bits; kScales: where its scales are read from).
template <bool kInt4, bool kInt5, bool kInt6, ScaleKind kScales, int G>
struct TilesI8 {
  using Act = ActInt8;
  // Q4_K, Q5_K (tile_i8_super) and Q6_K (tile_i8_super6) with their records: x rounded per 256.
  static constexpr bool kSuperBlocks = (kInt4 || kInt6) && kScales == ScaleKind::kSuper;
#ifdef WEFT_ZMM
  // The weight side the zmm Q4_K and Q5_K tiles of a block of four weight rows share (SuperRows).
  using Block = std::conditional_t<kSuperBlocks && kInt4, SuperRows,
                                   std::conditional_t<kSuperBlocks && kInt6, Super6Rows, NoBlock>>;
#else
  using Block = NoBlock;
#endif
#ifdef WEFT_ZMM
  static constexpr int kWide = 4;  // 4 x 4: two rows a zmm, 8 zmm accumulators
#else
  static constexpr int kWide = 2;  // weight rows of a tile against four rows of x: 2 x 4, 8 accumulators
#endif
  static constexpr bool kSpreads = true;  // the tile takes a prefetch share (prefetch_share)
  // At one row of x the share takes Q6_K's high bits and Q5_K's bit planes too (tile_i8_super6,
  // tile_i8_super), not the burst with the scales.
  static constexpr bool kSpreadsHigh = kSuperBlocks;
#ifdef WEFT_ZMM
  static constexpr bool kSpreadsRows = true;  // above one row of x too: the first tile of four weight rows
#else
  static constexpr bool kSpreadsRows = false;
#endif
  // k0: the tile's first pair of weight rows within its block of four (block).
  template <int RW, int RX>
  static void tile(const Packed& w, int64_t n, const Act& a, int64_t m0, float* out, int64_t ldo,
                   const uint8_t* ahead, [[maybe_unused]] const Block* block, [[maybe_unused]] int k0) {
#ifdef WEFT_ZMM
    if constexpr (RW % 2 == 0 && kSuperBlocks) {
      if constexpr (kInt4) {
        tile_i8_super_zmm<RW, RX, kInt5>(w, n, a, m0, out, ldo, ahead, block, k0);
      } else {
        tile_i8_super6_zmm<RW, RX>(w, n, a, m0, out, ldo, ahead, block, k0);
      }
      return;
    }
    if constexpr (RW % 2 == 0 && !kSuperBlocks) {
      if constexpr (kInt4) {
        tile_i8_int4_zmm<RW, RX, kScales, kInt5>(w, n, a, m0, out, ldo, ahead);
      } else {
        tile_i8_int8_zmm<RW, RX, kScales, G, kInt6>(w, n, a, m0, out, ldo, ahead);
      }
      return;
    }
#endif
    if constexpr (kSuperBlocks && kInt4) {
      tile_i8_super<RW, RX, kInt5>(w, n, a, m0, out, ldo, ahead);  // AVX2, and AVX-512's one-row tails
    } else if constexpr (kSuperBlocks) {
      tile_i8_super6<RW, RX>(w, n, a, m0, out, ldo, ahead);
    } else if constexpr (kInt4) {
      tile_i8_int4<RW, RX, kScales, kInt5>(w, n, a, m0, out, ldo, ahead);
    } else {
      tile_i8_int8<RW, RX, kScales, G, kInt6>(w, n, a, m0, out, ldo, ahead);
    }
  }
};

// The int16-activation tile of a layout (scales converted per weight row, whatever their kind).
template <bool kInt4, bool kInt5, bool kInt6, ScaleKind kScales, int G>
struct TilesI16 {
  using Act = ActInt16;
  using Block = NoBlock;
  static constexpr int kWide = 1;  // two accumulators a pair: 1 x 4 keeps 8
  static constexpr bool kSpreads = false;
  static constexpr bool kSpreadsHigh = false;
  static constexpr bool kSpreadsRows = false;
  template <int RW, int RX>
  static void tile(const Packed& w, int64_t n, const Act& a, int64_t m0, float* out, int64_t ldo, const uint8_t*,
                   const Block*, int) {
    // Q5_K's records come with its fifth bits as bit planes.
    tile_i16<RW, RX, kInt4, kInt5, kInt6, G, kInt5 && kScales == ScaleKind::kSuper>(w, n, a, m0, out, ldo);
  }
};

// Above one row of x, AVX-512 tiles spread the prefetch of weight rows up to this long (int4 K <=
// 8192, int8 K <= 4096): one row of x per call, from memory, 1.2-1.6x at 2-4 rows of x and K = 2048,
// but 0.8x for the 8 KiB rows of Q8_0 at K = 8192, where the burst stays.
constexpr int64_t kSpreadRowBytes = 4096;

// Weight rows [begin, end) against rows [m0, m1) of x, in the tiles of Tiles, four weight rows at
// a time (with row_blocks): four rows of x as 4 / kWide tiles of kWide x 4, two rows as tiles of
// 2 kWide x 2, the last one as 4 x 1 (each x block loaded once for four weight rows). Weight rows
// past a multiple of four (all of them without row_blocks) go one at a time, 1 x 4 and 1 x 1. Rows
// of W kPrefetchRows ahead are prefetched with their scales and mins (the hardware prefetcher alone
// leaves a batch-1 step short of the read bandwidth). At one row of x (a batch-1 decode step) the
// int8 path runs two 2 x 1 tiles instead of the 4 x 1, each spreading the prefetch of two of the
// next four weight rows over its own steps (prefetch_share), with Q6_K's high bits and Q5_K's bit
// planes (Tiles::kSpreadsHigh: in the burst they left Q6_K's tile 1.1-1.4x slower); the scales and
// mins still go ahead at once (in the share Q6_K's read 0.93x). From memory that read 1.1-1.4x
// faster than one 4 x 1 tile doing the same (fewer rows walked at once: at K = 8192 four rows are
// 4 KiB apart, the same L1 sets).
template <class Tiles>
void rows_tiles(const Packed& w, int64_t begin, int64_t end, const typename Tiles::Act& a, int64_t m0, int64_t m1,
                float* op, int64_t ldo, bool row_blocks) {
  // The weight side of a block of four rows, formed once for its tiles where two or more tiles of
  // rows of x share it (8 rows and more; below, each tile forms its own as it goes).
  typename Tiles::Block block;
  const bool share = m1 - m0 >= 8 && Tiles::Block::shares(w);
  int64_t block_n = begin;
  auto tile = [&](auto rw, auto rx, int64_t n, int64_t m, const uint8_t* ahead = nullptr) {
    Tiles::template tile<decltype(rw)::value, decltype(rx)::value>(
        w, n, a, m, op + m * ldo + n, ldo, ahead, share ? &block : nullptr, static_cast<int>((n - block_n) / 2));
  };
  const bool spread = Tiles::kSpreads && m1 - m0 == 1;
  const bool spread_rows = Tiles::kSpreadsRows && m1 - m0 > 1 && w.row_bytes <= kSpreadRowBytes;
  auto prefetch = [&](int64_t n, int64_t rows) {
    const int64_t ahead = std::min(n + kPrefetchRows, w.N - rows);
    if (!((spread || spread_rows) && rows == 4)) prefetch_bytes(w.qweight + ahead * w.row_bytes, rows * w.row_bytes);
    prefetch_bytes(w.scale_row(ahead), rows * w.scale_row_bytes());
    if (w.has_mins()) prefetch_bytes(w.min_row(ahead), rows * w.groups * w.scale_bytes());
    const bool high_spread = spread && rows == 4 && Tiles::kSpreadsHigh;
    if (w.qhigh != nullptr && !high_spread) prefetch_bytes(w.high_row(ahead), rows * w.high_row_bytes());
  };
  constexpr int kWide = Tiles::kWide;
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  using Wide = std::integral_constant<int, kWide>;
  using Wide2 = std::integral_constant<int, std::min(4, 2 * kWide)>;
  int64_t n = begin;
  for (; row_blocks && n + 4 <= end; n += 4) {
    prefetch(n, 4);
    if (share) block.fill(w, n);
    block_n = n;
    // Above one row of x (AVX-512, rows up to kSpreadRowBytes): the block's first tile prefetches
    // the four weight rows kPrefetchRows ahead a share per step, the other tiles none.
    const uint8_t* ahead = spread_rows ? w.qweight + std::min(n + kPrefetchRows, w.N - 4) * w.row_bytes : nullptr;
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) {
      for (int j = 0; j < 4; j += kWide, ahead = nullptr) tile(Wide{}, Four{}, n + j, m, ahead);
    }
    for (; m + 2 <= m1; m += 2) {
      for (int j = 0; j < 4; j += Wide2::value, ahead = nullptr) tile(Wide2{}, Two{}, n + j, m, ahead);
    }
    if (m < m1 && spread) {
      // Batch 1: two tiles of 2 x 1, each prefetching its share of the next four rows (two).
      tile(Two{}, One{}, n, m, w.qweight + std::min(n + 4, w.N - 2) * w.row_bytes);
      tile(Two{}, One{}, n + 2, m, w.qweight + std::min(n + 6, w.N - 2) * w.row_bytes);
    } else if (m < m1) {
      tile(Four{}, One{}, n, m, ahead);
    }
  }
  for (; n < end; ++n) {
    prefetch(n, 1);
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) tile(One{}, Four{}, n, m);
    for (; m < m1; ++m) tile(One{}, One{}, n, m);
  }
}

// Calls f(kInt4, kInt5, kInt6, kScales, G) with w's layout as compile-time constants
// (std::bool_constant and std::integral_constant): int4 or int5 (groups of 32), int6 (16), or int8
// by 32 or 16; fp32, fp16 or (int4, int5, int6 and int8 by 16: the K formats) super-block scales.
template <class F>
void with_layout(const Packed& w, F&& f) {
  using Yes = std::true_type;
  using No = std::false_type;
  using G32 = std::integral_constant<int, 32>;
  using G16 = std::integral_constant<int, 16>;
  using Float = std::integral_constant<ScaleKind, ScaleKind::kFloat>;
  using Half = std::integral_constant<ScaleKind, ScaleKind::kHalf>;
  using Super = std::integral_constant<ScaleKind, ScaleKind::kSuper>;
  const ScaleKind kind = w.scale_kind();
  auto by_kind = [&](auto int4, auto int5, auto int6, auto g, bool super_allowed) {
    if (kind == ScaleKind::kSuper && super_allowed) {
      f(int4, int5, int6, Super{}, g);
    } else if (kind == ScaleKind::kHalf) {
      f(int4, int5, int6, Half{}, g);
    } else {
      f(int4, int5, int6, Float{}, g);
    }
  };
  if (w.int5()) {
    by_kind(Yes{}, Yes{}, No{}, G32{}, true);
  } else if (w.int4()) {
    by_kind(Yes{}, No{}, No{}, G32{}, true);
  } else if (w.int6()) {
    by_kind(No{}, No{}, Yes{}, G16{}, true);
  } else if (w.group == 32) {
    by_kind(No{}, No{}, No{}, G32{}, false);  // packed_of admits no super-block scales here
  } else {
    by_kind(No{}, No{}, No{}, G16{}, true);
  }
}
#endif

// Whether the tiles take four weight rows at a time (rows_tiles' row_blocks; the default); off,
// row by row, the loop batch-1 steps ran before, kept so benchmarks can compare the two in one
// process (set_single_row_blocks). Process-wide, for measurements only.
bool single_row_blocks = true;

void set_single_row_blocks(bool on) { single_row_blocks = on; }

// out [M, N] = x [M, K] @ W^T with x rounded to int8 (Int8) or int16 per weight group (see the top
// of the file): the checks, the rounding of x, then the weight rows split between the threads, each
// walking its rows against blocks of x rows.
template <bool kInt8>
void quant_linear_integer(const char* name, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& qhigh,
                          int64_t group_size, at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, name,
              ": x must be fp32 [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  const Packed w = packed_of(qweight, scales, mins, qhigh, group_size, K, /*half_scales=*/true);
  TORCH_CHECK(group_size == 16 || group_size == 32, name, ": group_size must be 16 or 32");
  const int64_t N = qweight.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  out.stride(1) == 1,
              name, ": out must be fp32 [M, N] with contiguous rows");
  if (M == 0 || N == 0) return;
  using Act = std::conditional_t<kInt8, ActInt8, ActInt16>;
  const Act a = [&] {
    if constexpr (kInt8) {
      return quantize_activations(x.data_ptr<float>(), x.stride(0), M, K, group_size, w.int4(), w.int6(),
                                  w.super_blocks());
    } else {
      return quantize_activations_i16(x.data_ptr<float>(), x.stride(0), M, K, group_size);
    }
  }();
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  const int64_t rows_per_block = x_rows_per_block(kInt8 ? K * (w.int4() ? 2 : 1) : 2 * K);
  const bool row_blocks = single_row_blocks;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += rows_per_block) {
      const int64_t m1 = std::min(M, m0 + rows_per_block);
#ifdef WEFT_AVX2
      with_layout(w, [&](auto int4, auto int5, auto int6, auto kind, auto g) {
        using Tiles = std::conditional_t<kInt8, TilesI8<int4.value, int5.value, int6.value, kind.value, g.value>,
                                         TilesI16<int4.value, int5.value, int6.value, kind.value, g.value>>;
        rows_tiles<Tiles>(w, begin, end, a, m0, m1, op, ldo, row_blocks);
      });
#else
      for (int64_t n = begin; n < end; ++n) {
        if constexpr (kInt8) {
          if (w.super_blocks()) {
            for (int64_t m = m0; m < m1; ++m) dot_row_scalar_super(w, n, a, m, op + m * ldo + n);
            continue;
          }
        }
        const RowScales rs(w, n);
        for (int64_t m = m0; m < m1; ++m) dot_row_scalar(w, rs, n, a, m, op + m * ldo + n);
      }
#endif
    }
  });
}

void quant_linear_i8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& mins, int64_t group_size, at::Tensor out,
                     const c10::optional<at::Tensor>& qhigh) {
  quant_linear_integer<true>("quant_linear_i8", x, qweight, scales, mins, qhigh, group_size, out);
}

void quant_linear_i16(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& mins, int64_t group_size, at::Tensor out,
                      const c10::optional<at::Tensor>& qhigh) {
  quant_linear_integer<false>("quant_linear_i16", x, qweight, scales, mins, qhigh, group_size, out);
}

// Which instruction set this build's quant_linear_i8 runs on.
std::string isa() {
#if defined(WEFT_VNNI)
  return "avx512vnni";
#elif defined(WEFT_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace

WEFT_TORCH_LIBRARY(QUANT_LIBRARY_NS, m) {
  // qhigh last and optional: the int5 layout's fifth bits (None: int4 or int8), so calls written for
  // the two older layouts stay valid.
  m.def(
      "quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int group_size, Tensor(a!) out, "
      "Tensor? qhigh=None) -> ()");
  m.def(
      "dequantize_rows(Tensor qweight, Tensor scales, Tensor? mins, int group_size, int start, Tensor(a!) out, "
      "Tensor? qhigh=None) -> ()");
  m.def(
      "quant_linear_i8(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int group_size, Tensor(a!) out, "
      "Tensor? qhigh=None) -> ()");
  m.def(
      "quant_linear_i16(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int group_size, Tensor(a!) out, "
      "Tensor? qhigh=None) -> ()");
  m.def("isa() -> str", &isa);
  m.def("set_single_row_blocks(bool on) -> ()", &set_single_row_blocks);
  m.impl("quant_linear", c10::DispatchKey::CPU, &quant_linear);
  m.impl("quant_linear_i8", c10::DispatchKey::CPU, &quant_linear_i8);
  m.impl("quant_linear_i16", c10::DispatchKey::CPU, &quant_linear_i16);
  m.impl("dequantize_rows", c10::DispatchKey::CPU, &dequantize_rows);
}
