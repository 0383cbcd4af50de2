// Paged attention for CPUs: decodes (one new token per sequence) and
// prefills/chunks (several new tokens, causal among themselves, over the
// cached context before them), their keys and values read in place through
// the block table.
//
// The torch path gathers every sequence's blocks into a contiguous tensor
// before SDPA; on CPU that copy costs more than the attention itself for
// decodes, which are bound by memory traffic. Here each key and value row is
// read once, straight from the cache, for all the query heads that share it.
//
// Layouts (those of services/worker/layers/attention.py):
//   query, out  [T, H, D], head dimension contiguous
//   kv_cache    [2, KVH, num_blocks, block_size, D], contiguous: the query's
//               dtype, or int8 with
//   kv_scales   [2, KVH, num_blocks, block_size] fp32, contiguous: row x of
//               the cache stands for x * its scale (write_kv_int8 writes both)
//   block_table [n, max_blocks] int32
//   window      > 0: a sliding-window layer; the token at position p sees
//               keys (p - window, p] only, and blocks wholly before that are
//               never read (the KV cache manager may have handed them to others)
//
// Batch invariance (the rule every default path keeps): a query row's output depends on its
// query, its sequence's keys and values and its position only, bit for bit: not on the other
// sequences or rows in the call, the thread count, how the work is cut, or whether the row comes
// as a decode, a prefill, a prefill chunk or a speculative-decoding verify row. So every row, in
// both kernels, takes the same steps ("one row's arithmetic"): its keys in segments of 256 at fixed
// positions of the sequence, each in chunks of about 64 keys at fixed positions, on the same
// register tiles (each row's own scores, max, sum and accumulator; explicit FMAs), the segments'
// results folded in order. What may depend on the batch is only how rows are grouped into tiles
// and items and which thread runs them, none of which changes a row's operations. Not invariant,
// and opt-in: the bf16 dot-product and AMX paths (WEFT_ATTENTION_BF16_DOT=1, AVX512_BF16 builds)
// and the int8 cache's AVX-512 decode paths (an int8 cache is itself opt-in).
//
// Decode work (flash-decoding, vLLM's "paged attention v2"): an item is a run of segments of one
// (decode, KV head). With few (decode, KV head) pairs per thread — batch 1 of a model with 3 KV
// heads on 2 threads — a pair's segments are cut into several items whose segment results a
// reduce folds in order ("decode items"). Items are claimed, longest first, from a shared counter
// so that no thread idles while another works.
//
// Prefill work: an item is a tile of consecutive query tokens of one
// (sequence, KV head), i.e. tile x G query rows, run flash-attention style
// (online softmax) over chunks of whole cache blocks (about 64 keys); each
// chunk's keys are transposed once into fp32 so that a row's scores over the
// chunk are vector FMAs, and both products run on register tiles of 6 query
// rows sized for AVX2's 16 registers ("prefill, AVX2 tiles"; AVX-512 builds
// run them too). A decode is the same computation for its one token's G rows.
//
// int8 caches (any query dtype) halve the bytes a decode reads from a bf16
// one: key t's score is scale * kscale[t] * (q . k[t]) and value t weighs
// p[t] * vscale[t], the softmax's sum taken over the p[t] themselves.
// Decodes at head sizes 64 and 128 on AVX-512F builds widen the int8 rows in
// 512-bit registers ("decode, int8 cache"), or, for bf16 queries on AVX512_BF16
// builds with VNNI, run on int8 dot products ("decode, int8 cache, int8 dot
// products"); WEFT_ATTENTION_INT8_FAST=0 keeps them on the generic path. Prefills of bf16 queries on AVX512_BF16 round
// each chunk's keys and values (times their scales) to bf16 for the bf16 dot
// products; others dequantize each chunk into the fp32 path's buffers.
//
// Arithmetic is fp32 whatever the cache dtype, but for bf16 caches on
// AVX512_BF16 CPUs (head sizes 64 and 128 for decodes, 64, 128 and 256 for
// prefills): there both run on bf16 dot products ("decode, bf16 dot products",
// "prefill, bf16 dot products") where WEFT_ATTENTION_BF16_DOT=1; unset or 0 keeps them on fp32.
// On CPUs with AMX tiles those prefills run their two products on tiles ("prefill, AMX tiles";
// block sizes of a multiple of 16, head sizes of 64); WEFT_ATTENTION_AMX=0 keeps vdpbf16ps.
// Index bounds are checked here, on every call (the checks cost microseconds):
// the kernel reads memory through them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define WEFT_AVX512 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define WEFT_BF16_DOT 1
#endif
#if defined(WEFT_BF16_DOT) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define WEFT_AMX 1
#include "amx_tiles.h"
#endif

namespace {

// A 0/1 switch read on every call (a getenv), unset meaning 1.
inline bool switch_on(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || std::strcmp(v, "1") == 0) return true;
  TORCH_CHECK_VALUE(std::strcmp(v, "0") == 0, name, " must be 0 or 1, got '", v, "'.");
  return false;
}

// A 0/1 switch read on every call, unset meaning 0.
inline bool switch_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && switch_on(name);
}

// WEFT_ATTENTION_BF16_DOT=1 runs bf16 attention on bf16 dot products (AVX512_BF16 builds; not
// batch-invariant, so opt-in); WEFT_ATTENTION_INT8_FAST=0 keeps int8-cache decodes on the generic
// path: to measure one against the other and to test the generic path on a CPU that has the
// instructions.
inline bool bf16_dot_enabled() { return switch_set("WEFT_ATTENTION_BF16_DOT"); }
// WEFT_ATTENTION_AMX=0 keeps bf16 prefills on vdpbf16ps where the build has AMX tiles.
inline bool amx_enabled() { return switch_on("WEFT_ATTENTION_AMX"); }
inline bool int8_fast_enabled() { return switch_on("WEFT_ATTENTION_INT8_FAST"); }

#ifdef WEFT_BF16_DOT
inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }  // the same bits
#endif

// Eight floats as one GCC vector: AVX2 registers with -mavx2, pairs of SSE
// ones otherwise, so there is one code path for every target.
constexpr int kW = 8;
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef uint16_t vh __attribute__((vector_size(16)));

inline vf loadu(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

inline vf load8(const float* p) { return loadu(p); }

inline vf load8(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  vh h;
  std::memcpy(&h, p, sizeof(h));
  vu u = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline vf load8(const c10::Half* p) {
  vf f;
  for (int i = 0; i < kW; ++i) f[i] = static_cast<float>(p[i]);
  return f;
}

typedef int8_t vb __attribute__((vector_size(8)));

inline vf load8(const int8_t* p) {  // exact: every int8 is an fp32
  vb b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vf);
}

inline float hsum(vf v) {
  v += __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, vi{2, 3, 0, 1, 6, 7, 4, 5});
  v += __builtin_shuffle(v, vi{1, 0, 3, 2, 5, 4, 7, 6});
  return v[0];
}

// a * b + c, rounded once where the build has FMA (twice otherwise), on eight lanes or a float.
// Written out in the tiles rather than left to the compiler's contraction, which may fuse another
// pair where the same source is inlined into another tile: a row must round alike in every tile.
inline vf fmadd(vf a, vf b, vf c) {
#ifdef __FMA__
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

inline float fmadd(float a, float b, float c) {
#ifdef __FMA__
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x}; }

// exp(x) for x <= 0 in a form the compiler vectorizes (no libm call), on a
// float or on eight lanes (vf, the prefill tiles' softmax): x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (Cephes' expf coefficients),
// 2^n built in the exponent bits. Relative error about 2e-7; inputs below -87
// (and -inf) give about 1e-38, not 0; a NaN stays NaN.
template <typename T>
inline T exp_nonpositive(T x) {
  constexpr bool kLanes = !std::is_same_v<T, float>;
  if constexpr (kLanes)
    x = x < -87.0f ? T{} - 87.0f : x;
  else
    x = std::max(x, -87.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const T n = (x * 1.44269504088896341f + shifter) - shifter;
  T r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  T scale;
  if constexpr (kLanes) {
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    std::memcpy(&scale, &bits, sizeof(scale));
  } else {
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    std::memcpy(&scale, &bits, sizeof(scale));
  }
  return p * scale;
}

// Blocks sit anywhere in the cache, so the hardware prefetcher cannot guess
// the next one; ask for it while the current one is processed.
template <typename scalar_t>
inline void prefetch_block(const scalar_t* block, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(block);
  const int64_t bytes = elems * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// The int8 key passes ask for each group of rows' values (into L2) as they read its keys, so that
// the value pass after the softmax finds the item's values in cache. With only each block's first
// lines asked for ahead (Prefetcher::lines_of), an int8 decode step waited on its values: 1.23x
// the time at 32 x 384 keys in blocks shuffled over 256 MiB (scripts/int8_kv_bench.py).
inline void prefetch_rows(const int8_t* rows, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(rows);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

// Software prefetch about kPrefetchBytes ahead (a number of blocks, two at
// least), spread over the current block's rows (a few cache lines per row) so
// that the misses overlap the arithmetic instead of queueing all at once. The
// key pass runs ahead into the first value blocks, so the value pass starts
// with them in cache. 64 KiB (16 blocks of fp32 keys at head size 64): with
// blocks shuffled over the cache every block is a TLB miss, and more of them
// in flight beat a shorter distance here (5.4-7.5 against 4.0-5.6 GB/s at 16
// KiB, runs alternated; equal in pool order). ATTENTION_PREFETCH_KIB overrides it,
// for such measurements.
#ifndef ATTENTION_PREFETCH_KIB
#define ATTENTION_PREFETCH_KIB 64
#endif
constexpr int64_t kPrefetchBytes = ATTENTION_PREFETCH_KIB * 1024;

// The distance is in bytes, so int8 blocks (a quarter of fp32's) run four times as many blocks
// ahead. An int8 cache's block scales (block_size floats for K, as many for V) are small runs of
// their own, asked for with the block's keys so that both passes find them in cache.
template <typename scalar_t>
struct Prefetcher {
  const scalar_t* keys;
  const scalar_t* values;
  const int32_t* blocks;
  int64_t b_first, b_last, block_elems;
  const float* key_scales = nullptr;  // an int8 cache's, else null
  const float* value_scales = nullptr;
  int64_t block_size = 0;
  int64_t distance = std::max<int64_t>(2, kPrefetchBytes / (block_elems * static_cast<int64_t>(sizeof(scalar_t))));

  // Lines of the block `distance` ahead of b in the key pass (then of the
  // first value blocks): row `row` of `rows` asks for its share.
  void key_block_of(int64_t b, int64_t row, int64_t rows) const {
    const int64_t ahead = b + distance;
    const int64_t value_ahead = ahead - b_last - 1 + b_first;
    const scalar_t* base;
    if (ahead <= b_last) base = keys + static_cast<int64_t>(blocks[ahead]) * block_elems;
    else if (value_ahead <= b_last) base = values + static_cast<int64_t>(blocks[value_ahead]) * block_elems;
    else return;
    share(base, row, rows);
    if (key_scales != nullptr && row == 0 && ahead <= b_last) scales_of(ahead);
  }

  // One line each of the key and value blocks `distance` ahead of b, and their scales: the page
  // walks and first misses start early, the hardware prefetcher streams the rest of each block.
  // For the int8 decode path, whose compute leaves less slack: the whole-block prefetches cost it
  // 1.12x the time (32 x 384 and 1 x 2,048 keys shuffled over 240 MiB; none at all measured the same
  // as these lines).
  void lines_of(int64_t b) const {
    const int64_t ahead = b + distance;
    if (ahead > b_last) return;
    const int64_t at = static_cast<int64_t>(blocks[ahead]) * block_elems;
    __builtin_prefetch(keys + at, 0, 3);
    __builtin_prefetch(values + at, 0, 3);
    if (key_scales != nullptr) scales_of(ahead);
  }

  void scales_of(int64_t b) const {
    const int64_t at = static_cast<int64_t>(blocks[b]) * block_size;
    prefetch_block(key_scales + at, block_size);
    prefetch_block(value_scales + at, block_size);
  }

  // Before the first block: the blocks the key pass reaches before its
  // prefetches run `distance` ahead get one line each. Each is a page of its
  // own, likely out of the TLB after the layers between two attention calls:
  // asking for them together overlaps those misses instead of meeting them one
  // by one.
  void start() const {
    for (int64_t b = b_first; b <= std::min(b_last, b_first + distance - 1); ++b) {
      __builtin_prefetch(keys + static_cast<int64_t>(blocks[b]) * block_elems, 0, 3);
      if (key_scales != nullptr) {  // the int8 paths: their values' first lines too
        __builtin_prefetch(values + static_cast<int64_t>(blocks[b]) * block_elems, 0, 3);
        scales_of(b);
      }
    }
  }

  // The key and value blocks `distance` ahead of b, whole (the decode items read a block's keys and
  // values together, a chunk at a time).
  void whole_block(int64_t b) const {
    const int64_t ahead = b + distance;
    if (ahead > b_last) return;
    const int64_t at = static_cast<int64_t>(blocks[ahead]) * block_elems;
    prefetch_block(keys + at, block_elems);
    prefetch_block(values + at, block_elems);
    if (key_scales != nullptr) scales_of(ahead);
  }

  void value_block(int64_t b) const {
    const int64_t ahead = b + distance;
    if (ahead <= b_last) prefetch_block(values + static_cast<int64_t>(blocks[ahead]) * block_elems, block_elems);
  }

  void share(const scalar_t* base, int64_t row, int64_t rows) const {
    const char* p = reinterpret_cast<const char*>(base);
    const int64_t bytes = block_elems * static_cast<int64_t>(sizeof(scalar_t));
    const int64_t per_row = (bytes / 64 + rows - 1) / rows * 64;
    for (int64_t off = row * per_row; off < std::min(bytes, (row + 1) * per_row); off += 64)
      __builtin_prefetch(p + off, 0, 3);
  }
};

// dst[g * D + d] = src[g * stride + d] * scale, in fp32.
template <typename scalar_t>
void load_rows(const scalar_t* src, int64_t stride, int64_t rows, int64_t D, float scale, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) dst[r * D + d] = static_cast<float>(src[r * stride + d]) * scale;
}

// ---------------------------------------------------------------- decode

// Partial result of one item: per query head g, the max score, the sum of
// exp(score - max) and the exp-weighted value sum [D].
struct PartialView {
  float* m;
  float* l;
  float* acc;
};

// One item's scores s [G, L] -> exp(s - max) in place, each head's max and sum into part.
inline void softmax_numerators(float* s, int64_t L, int64_t G, PartialView part) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * L;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = exp_nonpositive(sg[t] - m);
      sum += sg[t];
    }
    part.m[g] = m;
    part.l[g] = sum;
  }
}

// s[g * stride + i] *= row_scale[i] for the n rows of G heads: an int8 cache's scales applied to
// scores or softmax numerators.
inline void scale_heads(float* s, int64_t stride, int64_t G, const float* row_scale, int64_t n) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < n; ++i) s[g * stride + i] *= row_scale[i];
}

// Where an int8 cache's scales sit: K's and V's, [num_blocks, block_size] each per KV head;
// null for float caches.
struct RowScales {
  const float* keys = nullptr;
  const float* values = nullptr;
};

#ifdef WEFT_AVX512
// ------------------------------------------------------ decode, int8 cache
//
// An int8 cache on an AVX-512F build, head sizes 64 and 128: each 16 int8 of a
// row widen to 16 exact fp32 in a register (vpmovsxbd, vcvtdq2ps) and meet the
// fp32 query in one FMA, so no row is widened to memory; 16 key rows' scores
// are reduced together (sum16) and scaled by a vector of 16 key scales, and
// each value row is weighted by its softmax numerator times its value scale.
// Sums are fp32 as on the generic path, in another order.

// Scores of one query head against up to 16 key rows: row r's products summed
// into one vector each, then 16 vectors reduced to one of 16 sums in four
// rounds of shuffles and adds (45 instructions for 16 rows, against 16 full
// horizontal sums). The rounds leave the sums in the lane order kSumLane; the
// rows go in in that order, which is its own inverse, so they come out in order.
constexpr int kSumLane[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

inline __m512 sum16(__m512* v) {
  __m512 w[8], z[4], u[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(z[i], z[i + 2]), _mm512_unpackhi_ps(z[i], z[i + 2]));
  const __m512d a = _mm512_castps_pd(u[0]), b = _mm512_castps_pd(u[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

// exp_nonpositive on 16 lanes (the same polynomial); 2^n by vscalefps.
inline __m512 exp16_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// softmax_numerators 16 lanes at a time (with it, an int8 decode in cache took 1.07x the time: the
// exponentials are a quarter of it). A NaN score stays NaN (exp16_nonpositive's clamp would make
// it ~0), so a NaN key scale reaches the output.
inline void softmax_numerators16(float* s, int64_t L, int64_t G, PartialView part) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * L;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < L; t += 16) {
      const __mmask16 k = static_cast<__mmask16>(L - t >= 16 ? 0xFFFF : (1u << (L - t)) - 1);
      mx = _mm512_mask_max_ps(mx, k, mx, _mm512_maskz_loadu_ps(k, sg + t));
    }
    const float m = _mm512_reduce_max_ps(mx);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t += 16) {
      const __mmask16 k = static_cast<__mmask16>(L - t >= 16 ? 0xFFFF : (1u << (L - t)) - 1);
      const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + t), mv);
      const __m512 e = _mm512_mask_mov_ps(exp16_nonpositive(x), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
      _mm512_mask_storeu_ps(sg + t, k, e);
      sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    part.m[g] = m;
    part.l[g] = _mm512_reduce_add_ps(sum);
  }
}

inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// s[t] = ks[t] * (q . k[t]) for the m <= 16 int8 rows at k (row stride kZ * 16), q scaled already.
// Each head widens the rows again: widening them once into an fp32 buffer for all heads measured
// 1.05x the time (in cache and out, SmolLM2's G = 3).
template <int kZ>
inline void scores16_int8(const __m512* q, const int8_t* k, int64_t m, const float* ks, float* s) {
  const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
  __m512 v[16];
  for (int slot = 0; slot < 16; ++slot) {
    const int r = kSumLane[slot];
    __m512 a = _mm512_setzero_ps();
    if (r < m)
      for (int z = 0; z < kZ; ++z) a = _mm512_fmadd_ps(q[z], widen16(k + r * kZ * 16 + z * 16), a);
    v[slot] = a;
  }
  _mm512_mask_storeu_ps(s, mask, _mm512_mul_ps(sum16(v), _mm512_maskz_loadu_ps(mask, ks)));
}

// The value pass of one item for heads [g0, g0 + NG): each row widened once for them all, their
// accumulators in registers. s holds the numerators times the value scales.
template <int NG, int kZ>
void value_pass_int8(const float* s, int64_t L, const int8_t* values, const int32_t* blocks, int64_t lo, int64_t hi,
                     int64_t block_size, int64_t g0, float* acc_out) {
  constexpr int64_t D = kZ * 16;
  __m512 acc[NG][kZ];
  for (int g = 0; g < NG; ++g)
    for (int z = 0; z < kZ; ++z) acc[g][z] = _mm512_setzero_ps();
  for (int64_t b = lo / block_size; b <= (hi - 1) / block_size; ++b) {
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size);
    const int8_t* vb = values + static_cast<int64_t>(blocks[b]) * block_size * D + (t0 - b * block_size) * D;
    const float* p = s + g0 * L + (t0 - lo);
    for (int64_t t = 0; t < t1 - t0; ++t) {
      __m512 x[kZ];
      for (int z = 0; z < kZ; ++z) x[z] = widen16(vb + t * D + z * 16);
      for (int g = 0; g < NG; ++g) {
        const __m512 w = _mm512_set1_ps(p[g * L + t]);
        for (int z = 0; z < kZ; ++z) acc[g][z] = _mm512_fmadd_ps(w, x[z], acc[g][z]);
      }
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int z = 0; z < kZ; ++z) _mm512_storeu_ps(acc_out + (g0 + g) * D + z * 16, acc[g][z]);
}

#ifdef WEFT_BF16_DOT
// ---------------------------------------- decode, int8 cache, int8 dot products (bf16 queries)
//
// Widening each key row to fp32 once per query head is most of the int8 key pass (about 56
// instructions a row at G = 3, head size 64). A bf16 query is already rounded, so here it is rounded
// once more, to int8 per head (its fp32 scale, as the cache's rows are), and vpdpbusd multiplies
// 64 bytes of it by 64 of a key row and sums them four at a time into 16 int32 lanes: about 16
// instructions a row at G = 3. vpdpbusd takes one side unsigned, so the query goes in plus 128 and
// 128 * sum(k) comes off (one more vpdpbusd a row, shared by the heads). Products and sums are exact
// integers (at most 128 x 255 x 127 a lane); what this adds to a bf16 cache's arithmetic is the
// query's rounding (kernels.reference.round_query_int8_ref, the twin).
// The CPUs with AVX512_BF16 (Cooper Lake, Sapphire Rapids and later, Zen 4 and 5) all have
// AVX512_VNNI; a run-time check keeps the fp32 path where one does not.

inline bool has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni");
  return yes;
}

// sum16 in int32 lanes: the same shuffles, so the same kSumLane order.
inline __m512i sum16_epi32(__m512i* v) {
  __m512i w[8], z[4], u[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_i32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    z[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_i32x4(w[i], w[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(z[i], z[i + 2]), _mm512_unpackhi_epi32(z[i], z[i + 2]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(u[0], u[1]), _mm512_unpackhi_epi64(u[0], u[1]));
}

template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t D, int8_t* q, float* scale);  // "int8 cache writes"

// Head g's scaled query qf [D] rounded as the cache's rows are, as D bytes of q + 128, and its
// scale (NaN where the row holds a NaN or an infinity, so that its scores are NaN).
template <int D>
inline float round_query_int8(const float* qf, uint8_t* out) {
  int8_t q[D];
  float scale;
  quantize_row(qf, D, q, &scale);
  for (int d = 0; d < D; ++d) out[d] = static_cast<uint8_t>(q[d] + 128);
  return scale;
}

// The key pass of one item: s[g * L + t - lo] = qs[g] * ks[t] * (q_g . k_t) for keys [lo, hi).
template <int kY>
__attribute__((target("avx512vnni"))) void key_pass_vnni(const uint8_t* qu, const float* qs, int64_t G,
                                                        const int8_t* keys, const int8_t* values,
                                                        const float* key_scales,
                                                        const int32_t* blocks, int64_t lo, int64_t hi,
                                                        int64_t block_size, float* s, int64_t L,
                                                        const Prefetcher<int8_t>& ahead) {
  constexpr int64_t D = kY * 64;
  const __m512i k128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = lo / block_size; b <= (hi - 1) / block_size; ++b) {
    ahead.lines_of(b);
    const int64_t first = static_cast<int64_t>(blocks[b]) * block_size;
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size);
    for (int64_t t = t0; t < t1; t += 16) {
      const int64_t m = std::min<int64_t>(16, t1 - t);
      const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
      const int8_t* k = keys + (first + t - b * block_size) * D;
      prefetch_rows(values + (first + t - b * block_size) * D, m * D);
      const __m512 ks = _mm512_maskz_loadu_ps(mask, key_scales + first + t - b * block_size);
      __m512i v[16];
      for (int slot = 0; slot < 16; ++slot) {
        const int r = kSumLane[slot];
        __m512i a = _mm512_setzero_si512();
        if (r < m)
          for (int y = 0; y < kY; ++y) a = _mm512_dpbusd_epi32(a, k128, _mm512_loadu_si512(k + r * D + y * 64));
        v[slot] = a;
      }
      const __m512i bias = sum16_epi32(v);
      for (int64_t g = 0; g < G; ++g) {
        __m512i q[kY];
        for (int y = 0; y < kY; ++y) q[y] = _mm512_loadu_si512(qu + g * D + y * 64);
        for (int slot = 0; slot < 16; ++slot) {
          const int r = kSumLane[slot];
          __m512i a = _mm512_setzero_si512();
          if (r < m)
            for (int y = 0; y < kY; ++y) a = _mm512_dpbusd_epi32(a, q[y], _mm512_loadu_si512(k + r * D + y * 64));
          v[slot] = a;
        }
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum16_epi32(v), bias));
        _mm512_mask_storeu_ps(s + g * L + (t - lo), mask, _mm512_mul_ps(dot, _mm512_mul_ps(ks, _mm512_set1_ps(qs[g]))));
      }
    }
  }
}

// The value pass of one item for heads [g0, g0 + NG) on vpdpwssd (int16 pairs into int32): each run
// of at most 128 rows has its weights (numerators times value scales, s) rounded to int16 against
// their largest (scale w_max / 32767: 2^-16 of it at most, where the bf16 path rounds each weight
// to 2^-9 of itself), two rows' int8 values are interleaved and widened to int16 pairs, and one
// vpdpwssd per 32 elements and head adds both rows' products. At most 128 x 32767 x 127 per int32
// lane, so no overflow; each run's sums go to fp32 accumulators times its scale. A NaN weight
// makes the run's scale NaN, so NaN reaches the output. Lanes come out in unpack order (lane j of
// chunk c holds element kValueLane(c, j)); the last step puts them back.
template <int NG, int kY>
__attribute__((target("avx512vnni"))) void value_pass_vnni(const float* s, int64_t L, const int8_t* values,
                                                          const int32_t* blocks, int64_t lo, int64_t hi,
                                                          int64_t block_size, int64_t g0, float* acc_out) {
  constexpr int64_t D = kY * 64;
  constexpr int kC = 4 * kY;  // int32 accumulators a head: 16 elements each
  __m512 acc[NG][kC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < kC; ++c) acc[g][c] = _mm512_setzero_ps();
  alignas(64) int16_t w16[NG][130];
  for (int64_t b = lo / block_size; b <= (hi - 1) / block_size; ++b) {
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size);
    const int8_t* vb = values + static_cast<int64_t>(blocks[b]) * block_size * D + (t0 - b * block_size) * D;
    for (int64_t r0 = 0; r0 < t1 - t0; r0 += 128) {
      const int64_t n = std::min<int64_t>(128, t1 - t0 - r0);
      float wscale[NG];
      for (int g = 0; g < NG; ++g) {
        const float* w = s + (g0 + g) * L + (t0 - lo) + r0;
        __m512 mx = _mm512_setzero_ps();
        __mmask16 nan = 0;
        for (int64_t i = 0; i < n; i += 16) {
          const __mmask16 k = static_cast<__mmask16>(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
          const __m512 x = _mm512_maskz_loadu_ps(k, w + i);
          nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
          mx = _mm512_max_ps(mx, x);
        }
        const float wmax = _mm512_reduce_max_ps(mx);
        const __m512 inv = _mm512_set1_ps(wmax > 0.0f ? 32767.0f / wmax : 0.0f);
        wscale[g] = nan ? std::numeric_limits<float>::quiet_NaN() : wmax / 32767.0f;
        for (int64_t i = 0; i < n; i += 16) {
          const __mmask16 k = static_cast<__mmask16>(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
          const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, w + i), inv));
          _mm256_mask_storeu_epi16(w16[g] + i, k, _mm512_cvtepi32_epi16(q));
        }
        w16[g][n] = 0;  // the partner of an odd run's last row
      }
      __m512i iacc[NG][kC];
      for (int g = 0; g < NG; ++g)
        for (int c = 0; c < kC; ++c) iacc[g][c] = _mm512_setzero_si512();
      const int8_t* v = vb + r0 * D;
      for (int64_t t = 0; t < n; t += 2) {
        __m512i p[NG];
        for (int g = 0; g < NG; ++g) {
          int32_t pair;
          std::memcpy(&pair, w16[g] + t, sizeof(pair));
          p[g] = _mm512_set1_epi32(pair);
        }
        for (int y = 0; y < kY; ++y) {
          const __m512i a = _mm512_loadu_si512(v + t * D + y * 64);
          const __m512i b2 = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * D + y * 64) : _mm512_setzero_si512();
          const __m512i lo8 = _mm512_unpacklo_epi8(a, b2), hi8 = _mm512_unpackhi_epi8(a, b2);
          const __m512i x[4] = {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo8)),
                                _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo8, 1)),
                                _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi8)),
                                _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi8, 1))};
          for (int g = 0; g < NG; ++g)
            for (int c = 0; c < 4; ++c) iacc[g][4 * y + c] = _mm512_dpwssd_epi32(iacc[g][4 * y + c], x[c], p[g]);
        }
      }
      for (int g = 0; g < NG; ++g) {
        const __m512 ws = _mm512_set1_ps(wscale[g]);
        for (int c = 0; c < kC; ++c) acc[g][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[g][c]), ws, acc[g][c]);
      }
    }
  }
  // Chunk 0 holds elements 0-7 and 16-23 of each 64, chunk 1 32-39 and 48-55, chunk 2 8-15 and
  // 24-31, chunk 3 40-47 and 56-63 (vpunpck works within 128-bit lanes).
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int g = 0; g < NG; ++g) {
    float* out = acc_out + (g0 + g) * D;
    for (int y = 0; y < kY; ++y) {
      const __m512* c = acc[g] + 4 * y;
      _mm512_storeu_ps(out + y * 64, _mm512_permutex2var_ps(c[0], first, c[2]));
      _mm512_storeu_ps(out + y * 64 + 16, _mm512_permutex2var_ps(c[0], second, c[2]));
      _mm512_storeu_ps(out + y * 64 + 32, _mm512_permutex2var_ps(c[1], first, c[3]));
      _mm512_storeu_ps(out + y * 64 + 48, _mm512_permutex2var_ps(c[1], second, c[3]));
    }
  }
}
#endif  // WEFT_BF16_DOT

// decode_item for an int8 cache with head size kZ * 16: the same two passes and the same
// partial result.
template <int kZ, typename scalar_t>
void decode_item_int8(const scalar_t* query, int64_t q_stride_head, const int8_t* keys, const int8_t* values,
                      RowScales rs, const int32_t* blocks, int64_t lo, int64_t hi, int64_t block_size, int64_t G,
                      float scale, std::vector<float>& buf, PartialView part) {
  constexpr int64_t D = kZ * 16;
  const int64_t L = hi - lo;
  buf.resize(G * D + G * L);
  float* qf = buf.data();  // [G, D] scaled queries
  float* s = qf + G * D;   // [G, L] scores, then softmax numerators
  load_rows(query, q_stride_head, G, D, scale, qf);
  const int64_t b_first = lo / block_size, b_last = (hi - 1) / block_size;
  Prefetcher<int8_t> ahead{keys, values, blocks, b_first, b_last, block_size * D, rs.keys, rs.values, block_size};
  ahead.start();
  bool keys_done = false;
#ifdef WEFT_BF16_DOT
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
    if (has_vnni()) {
      thread_local std::vector<uint8_t> qu;
      thread_local std::vector<float> qs;
      qu.resize(G * D);
      qs.resize(G);
      for (int64_t g = 0; g < G; ++g) qs[g] = round_query_int8<D>(qf + g * D, qu.data() + g * D);
      key_pass_vnni<D / 64>(qu.data(), qs.data(), G, keys, values, rs.keys, blocks, lo, hi, block_size, s, L,
                            ahead);
      keys_done = true;
    }
#endif
  for (int64_t b = b_first; !keys_done && b <= b_last; ++b) {
    ahead.lines_of(b);
    const int64_t first = static_cast<int64_t>(blocks[b]) * block_size;  // the block's first row
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size);
    for (int64_t t = t0; t < t1; t += 16) {
      const int64_t row = first + t - b * block_size;
      prefetch_rows(values + row * D, std::min<int64_t>(16, t1 - t) * D);
      for (int64_t g = 0; g < G; ++g) {  // the rows stay in L1 while every head reads them
        __m512 q[kZ];
        for (int z = 0; z < kZ; ++z) q[z] = _mm512_loadu_ps(qf + g * D + z * 16);
        scores16_int8<kZ>(q, keys + row * D, std::min<int64_t>(16, t1 - t), rs.keys + row, s + g * L + (t - lo));
      }
    }
  }
  softmax_numerators16(s, L, G, part);
  for (int64_t b = b_first; b <= b_last; ++b) {
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size);
    scale_heads(s + (t0 - lo), L, G, rs.values + static_cast<int64_t>(blocks[b]) * block_size + t0 - b * block_size,
                t1 - t0);
  }
  constexpr int kNG = kZ <= 4 ? 3 : 2;  // the accumulators that fit in 32 registers beside a row
  int64_t g = 0;
#ifdef WEFT_BF16_DOT
  if (keys_done) {  // a bf16 query on a CPU with VNNI: the values on int16 pairs too
    for (; g + kNG <= G; g += kNG) value_pass_vnni<kNG, D / 64>(s, L, values, blocks, lo, hi, block_size, g, part.acc);
    for (; g < G; ++g) value_pass_vnni<1, D / 64>(s, L, values, blocks, lo, hi, block_size, g, part.acc);
    return;
  }
#endif
  for (; g + kNG <= G; g += kNG) value_pass_int8<kNG, kZ>(s, L, values, blocks, lo, hi, block_size, g, part.acc);
  for (; g < G; ++g) value_pass_int8<1, kZ>(s, L, values, blocks, lo, hi, block_size, g, part.acc);
}
#endif  // WEFT_AVX512

#ifdef WEFT_BF16_DOT
// ------------------------------------------------ decode, bf16 dot products
//
// With a bf16 cache on a CPU with AVX512_BF16, vdpbf16ps multiplies 32 bf16
// pairs and adds them into 16 fp32 lanes in one instruction, so neither pass
// widens a key or value element to fp32 first. The fp32 path above spends
// about 60 instructions per key row on its score (widen, FMA, a horizontal sum
// per head) and 40 on its value row; these spend about 17 and 12. Products are
// exact in fp32 and sums are fp32, as above; what differs is that the value
// pass rounds the softmax weights to bf16 (as GPU flash attention rounds P).

// s[t] = scale * q . k[t] for the m <= 16 rows at k (row stride kZ * 32).
template <int kZ>
inline void scores16_bf16(const __m512bh* q, const c10::BFloat16* k, int64_t m, float scale, float* s) {
  __m512 v[16];
  for (int slot = 0; slot < 16; ++slot) {
    const int r = kSumLane[slot];
    __m512 a = _mm512_setzero_ps();
    if (r < m)
      for (int z = 0; z < kZ; ++z) a = _mm512_dpbf16_ps(a, q[z], as_bh(_mm512_loadu_si512(k + r * kZ * 32 + z * 32)));
    v[slot] = a;
  }
  const __m512 out = _mm512_mul_ps(sum16(v), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << m) - 1), out);
}

// acc[g] += sum over the n rows t of v of p[g][t] * v[t] for NG heads, two
// rows at a time: their elements interleaved into bf16 pairs (within each
// 128-bit lane, so the accumulators hold the head dimension in the order
// unpack_order undoes) and one vdpbf16ps per head with the pair of weights.
// pw[g] holds head g's weights in bf16, a zero after the last (odd n).
template <int NG, int kZ>
inline void weighted_pairs_bf16(const uint16_t* const* pw, const c10::BFloat16* v, int64_t n,
                                __m512 (&acc)[NG][2 * kZ]) {
  for (int64_t t = 0; t < n; t += 2) {
    __m512bh p[NG];
    for (int g = 0; g < NG; ++g) {
      uint32_t pair;
      std::memcpy(&pair, pw[g] + t, sizeof(pair));
      p[g] = as_bh(_mm512_set1_epi32(static_cast<int32_t>(pair)));
    }
    for (int z = 0; z < kZ; ++z) {
      const __m512i a = _mm512_loadu_si512(v + t * kZ * 32 + z * 32);
      const __m512i b = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * kZ * 32 + z * 32) : _mm512_setzero_si512();
      const __m512bh lo = as_bh(_mm512_unpacklo_epi16(a, b)), hi = as_bh(_mm512_unpackhi_epi16(a, b));
      for (int g = 0; g < NG; ++g) {
        acc[g][2 * z] = _mm512_dpbf16_ps(acc[g][2 * z], lo, p[g]);
        acc[g][2 * z + 1] = _mm512_dpbf16_ps(acc[g][2 * z + 1], hi, p[g]);
      }
    }
  }
}

// The accumulators of one head back in head-dimension order: of each 32
// elements, lane i of the first ("lo") vector holds element 8 * (i / 4) + i % 4,
// of the second 8 * (i / 4) + 4 + i % 4.
template <int kZ>
inline void unpack_order(const __m512 (&acc)[2 * kZ], float* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int z = 0; z < kZ; ++z) {
    _mm512_storeu_ps(out + z * 32, _mm512_permutex2var_ps(acc[2 * z], first, acc[2 * z + 1]));
    _mm512_storeu_ps(out + z * 32 + 16, _mm512_permutex2var_ps(acc[2 * z], second, acc[2 * z + 1]));
  }
}

// The value pass of one item for heads [g0, g0 + NG).
template <int NG, int kZ>
void value_pass_bf16(const float* s, int64_t L, const c10::BFloat16* values, const int32_t* blocks, int64_t lo,
                     int64_t hi, int64_t block_size, int64_t g0, const Prefetcher<c10::BFloat16>& ahead,
                     std::vector<uint16_t>& pbuf, float* acc_out) {
  constexpr int64_t D = kZ * 32;
  __m512 acc[NG][2 * kZ];
  for (int g = 0; g < NG; ++g)
    for (int z = 0; z < 2 * kZ; ++z) acc[g][z] = _mm512_setzero_ps();
  const int64_t stride = block_size + 2;  // a block's weights and a zero pad, per head
  pbuf.assign(NG * stride, 0);
  const uint16_t* pw[NG];
  for (int g = 0; g < NG; ++g) pw[g] = pbuf.data() + g * stride;
  for (int64_t b = lo / block_size; b <= (hi - 1) / block_size; ++b) {
    ahead.value_block(b);
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size), n = t1 - t0;
    for (int g = 0; g < NG; ++g) {
      uint16_t* dst = pbuf.data() + g * stride;
      const float* src = s + (g0 + g) * L + (t0 - lo);
      for (int64_t i = 0; i < n; i += 16) {
        const int64_t m = std::min<int64_t>(16, n - i);
        const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + i));
        _mm256_mask_storeu_epi16(dst + i, mask, reinterpret_cast<const __m256i&>(h));
      }
      dst[n] = 0;
    }
    const c10::BFloat16* vb = values + static_cast<int64_t>(blocks[b]) * block_size * D + (t0 - b * block_size) * D;
    weighted_pairs_bf16<NG, kZ>(pw, vb, n, acc);
  }
  for (int g = 0; g < NG; ++g) unpack_order<kZ>(acc[g], acc_out + (g0 + g) * D);
}

// decode_item for a bf16 cache with head size kZ * 32: the same two passes and
// the same partial result.
template <int kZ>
void decode_item_bf16(const c10::BFloat16* query, int64_t q_stride_head, const c10::BFloat16* keys,
                      const c10::BFloat16* values, const int32_t* blocks, int64_t lo, int64_t hi, int64_t block_size,
                      int64_t G, float scale, std::vector<float>& buf, PartialView part) {
  constexpr int64_t D = kZ * 32;
  const int64_t L = hi - lo;
  buf.resize(G * L);
  float* s = buf.data();  // [G, L] scores, then softmax numerators
  const int64_t b_first = lo / block_size, b_last = (hi - 1) / block_size;
  Prefetcher<c10::BFloat16> ahead{keys, values, blocks, b_first, b_last, block_size * D};
  ahead.start();
  for (int64_t b = b_first; b <= b_last; ++b) {
    ahead.key_block_of(b, 0, 1);
    const c10::BFloat16* kb = keys + static_cast<int64_t>(blocks[b]) * block_size * D;
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size);
    for (int64_t t = t0; t < t1; t += 16)
      for (int64_t g = 0; g < G; ++g) {  // the rows stay in L1 while every head reads them
        __m512bh q[kZ];
        for (int z = 0; z < kZ; ++z) q[z] = as_bh(_mm512_loadu_si512(query + g * q_stride_head + z * 32));
        scores16_bf16<kZ>(q, kb + (t - b * block_size) * D, std::min<int64_t>(16, t1 - t), scale,
                          s + g * L + (t - lo));
      }
  }
  softmax_numerators(s, L, G, part);
  thread_local std::vector<uint16_t> pbuf;
  int64_t g = 0;
  for (; g + 3 <= G; g += 3) value_pass_bf16<3, kZ>(s, L, values, blocks, lo, hi, block_size, g, ahead, pbuf, part.acc);
  for (; g < G; ++g) value_pass_bf16<1, kZ>(s, L, values, blocks, lo, hi, block_size, g, ahead, pbuf, part.acc);
}
#endif  // WEFT_BF16_DOT

template <typename scalar_t>
void write_heads(const float* acc, const float* l, int64_t G, int64_t D, scalar_t* out, int64_t o_stride_head) {
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / l[g];
    for (int64_t d = 0; d < D; ++d) out[g * o_stride_head + d] = static_cast<scalar_t>(acc[g * D + d] * inv);
  }
}

void check_layouts(const char* op, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& out) {
  TORCH_CHECK_VALUE(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2 && out.sizes() == query.sizes(),
                    op, ": query and out [T, H, D], kv_cache [2, KVH, num_blocks, block_size, D] expected");
  TORCH_CHECK_VALUE(query.device().is_cpu() && kv_cache.device().is_cpu() && out.device().is_cpu(), op,
                    ": CPU tensors expected");
  TORCH_CHECK_VALUE(kv_cache.is_contiguous() && query.stride(2) == 1 && out.stride(2) == 1, op,
                    ": kv_cache contiguous, query and out contiguous in the head dimension expected");
  TORCH_CHECK_VALUE(kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(1) == 0, op,
                    ": query heads must be a multiple of KV heads, and head sizes agree");
  TORCH_CHECK_VALUE(out.scalar_type() == query.scalar_type(), op, ": query and out must share one dtype");
  TORCH_CHECK_VALUE(kv_cache.scalar_type() == query.scalar_type() || kv_cache.scalar_type() == at::kChar, op,
                    ": kv_cache must be int8 or share the query's dtype");
}

// kv_scales goes with an int8 cache and only with one: [2, KVH, num_blocks, block_size] fp32, contiguous.
void check_scales(const char* op, const at::Tensor& kv_cache, const std::optional<at::Tensor>& kv_scales) {
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK_VALUE(int8 == kv_scales.has_value(), op,
                    int8 ? ": an int8 kv_cache needs kv_scales" : ": kv_scales go with an int8 kv_cache only");
  if (!int8) return;
  const at::Tensor& sc = *kv_scales;
  TORCH_CHECK_VALUE(sc.scalar_type() == at::kFloat && sc.dim() == 4 && sc.is_contiguous() && sc.device().is_cpu() &&
                        sc.sizes() == kv_cache.sizes().slice(0, 4),
                    op, ": kv_scales must be a contiguous float32 CPU tensor [2, KVH, num_blocks, block_size]");
}

void check_index(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.dim() == dim && t.is_contiguous() && t.device().is_cpu(), op, ": ",
                    name, " must be a contiguous ", dim, "-D ", dtype, " CPU tensor");
}

// Calls fn with a std::integral_constant of the head size's vector chunks
// (64, 128 and 256 are specialised; 0: any size, read at run time).
template <typename Fn>
void dispatch_head_dim(int64_t D, Fn&& fn) {
  if (D == 64) fn(std::integral_constant<int, 64 / kW>{});
  else if (D == 128) fn(std::integral_constant<int, 128 / kW>{});
  else if (D == 256) fn(std::integral_constant<int, 256 / kW>{});
  else fn(std::integral_constant<int, 0>{});
}

template <typename Fn>
void dispatch_dtype(const char* op, at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK_VALUE(false, op, ": float32, bfloat16 or float16 expected");
  }
}

// Calls fn with a value of the query's dtype and one of the cache's (the same, or int8).
template <typename Fn>
void dispatch_query_and_cache(const char* op, const at::Tensor& query, const at::Tensor& kv_cache, Fn&& fn) {
  dispatch_dtype(op, query.scalar_type(), [&](auto tag) {
    if (kv_cache.scalar_type() == at::kChar) fn(tag, int8_t{});
    else fn(tag, tag);
  });
}

// ---------------------------------------------------------------- prefill

// A tile of query tokens times G heads is at most kMaxRows query rows: the
// more rows share a block's transposed keys, the less the transpose costs
// (32 -> 96 rows: 0.46x -> 0.7x of SDPA's speed on a 2,048-token prefill).
constexpr int64_t kMaxRows = 96;

struct PrefillItem {
  int64_t seq, head;
  int64_t j0, j1;  // new tokens [j0, j1) of the sequence
  int64_t cost;    // keys the tile reads: claimed longest first
};

// Keys are taken a chunk of whole cache blocks at a time, about kChunkKeys of
// them: each chunk costs per query row a max, a rescale of the accumulator
// and a call; over 16-key blocks those cost as much as the dot products.
constexpr int64_t kChunkKeys = 64;

// Converts the keys [base, base + tokens) of a sequence, a run of whole cache
// blocks, to fp32: keys transposed into kt [D, kb], values into vf32 [kb, D]
// (unless vf32 is null: the values are read in place);
// an int8 cache's rows times their scales (the dequantized cache).
template <typename cache_t>
void load_chunk(const cache_t* keys, const cache_t* values, RowScales rs, const int32_t* blocks, int64_t base,
                int64_t tokens, int64_t block_size, int64_t D, int64_t kb, float* kt, float* vf32) {
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t pos = base + t;
    const int64_t slot = static_cast<int64_t>(blocks[pos / block_size]) * block_size + pos % block_size;
    const cache_t* kr = keys + slot * D;
    const cache_t* vr = values + slot * D;
    if constexpr (std::is_same_v<cache_t, int8_t>) {
      const float ks = rs.keys[slot], vs = rs.values[slot];
      for (int64_t d = 0; d < D; ++d) kt[d * kb + t] = static_cast<float>(kr[d]) * ks;
      if (vf32 != nullptr)
        for (int64_t d = 0; d < D; ++d) vf32[t * D + d] = static_cast<float>(vr[d]) * vs;
    } else {
      for (int64_t d = 0; d < D; ++d) kt[d * kb + t] = static_cast<float>(kr[d]);
      if (vf32 != nullptr)
        for (int64_t d = 0; d < D; ++d) vf32[t * D + d] = static_cast<float>(vr[d]);
    }
  }
}

// ------------------------------------------------------------ prefill, AVX2 tiles
//
// AVX2 has 16 vector registers. The shapes first tuned for AVX-512's 32 (4 rows x 4 key vectors of
// scores, 3 heads x 8 vectors of values) spilled their accumulators to the stack on every step here.
// Each chunk is taken kTileRows query rows at a time instead, both products on tiles of 6 rows x 2 vectors:
// 12 accumulators, the 2 vectors of keys (or values) of one step and the broadcast query element (or
// weight), 15 registers, no spills. 6 rows is two tokens of SmolLM2's 3 heads per KV head; 2 vectors
// divide 64-key chunks and head sizes of a multiple of 16. A tile's scores, softmax and values run
// back to back, while its scores are in L1.
//
// The value pass is the product P [rows, keys] x V [keys, D] over the span of keys any of the tile's
// rows sees: the weights of keys a row does not see are 0, so the tile runs without branches, each
// value vector loaded once for its 6 rows, whatever tokens they belong to. The accumulators' rescale
// by the online softmax's alpha is folded into the tile's load of them. One consequence: a value
// row that is not finite (an int8 row with a NaN scale) reaches, as 0 x NaN, the tile's rows that do
// not see it too, where the per-token value pass left them finite. Otherwise a row's result does not
// depend on its tile's other rows: its scores are its own FMA chains, its softmax its own lanes
// (keys it does not see add 0 to its sum), its value pass adds exact zeros for keys it does not see.
// That is what lets a decode's G rows equal the same rows inside any prefill tile.
//
// Measured on a 2-core Zen 3 (scripts/prefill_kernel_vs_sdpa.py, SmolLM2's heads, 2 threads): fp32,
// 2,048 new tokens from 67-70 ms on the shapes above to 37-38 ms; 64 after 448, 1.11-1.15 -> 0.61-0.76
// ms; bf16 queries (the same fp32 arithmetic) 73-76 -> 38-40 ms. The two tile loops then take about
// 80% of the time (perf, one thread), the exponentials most of the rest.

constexpr int kTileRows = 6;  // query rows per tile
constexpr int kTileVecs = 2;  // vectors of keys (scores) or of D (values) per tile

// load_chunk for the tiles: eight keys at a time, their rows transposed into kt by 8 x 8 blocks of
// vector shuffles rather than one scalar store per element (75 ms against 69 for the 2,048-token fp32
// prefill on one thread, once the products were on tiles); the rest of the chunk's keys, and of D,
// one by one.
template <typename cache_t>
void load_chunk8(const cache_t* keys, const cache_t* values, RowScales rs, const int32_t* blocks, int64_t base,
                 int64_t tokens, int64_t block_size, int64_t D, int64_t kb, float* kt, float* vf32) {
  constexpr bool kInt8 = std::is_same_v<cache_t, int8_t>;
  int64_t t = 0;
  // Key base + t's block and offset in it, stepped along (a division per key cost a decode more
  // than its scores).
  int64_t blk = base / block_size, off = base % block_size;
  for (; t + kW <= tokens; t += kW) {
    const cache_t* kr[kW];
    float ks[kW];
    for (int i = 0; i < kW; ++i) {
      const int64_t slot = static_cast<int64_t>(blocks[blk]) * block_size + off;
      if (++off == block_size) {
        off = 0;
        ++blk;
      }
      kr[i] = keys + slot * D;
      ks[i] = kInt8 ? rs.keys[slot] : 1.0f;
      if (vf32 == nullptr) continue;
      const cache_t* vr = values + slot * D;
      const float vs = kInt8 ? rs.values[slot] : 1.0f;
      for (int64_t d = 0; d < D; ++d) vf32[(t + i) * D + d] = static_cast<float>(vr[d]) * vs;
    }
    int64_t d = 0;
    for (; d + kW <= D; d += kW) {
      vf x[kW];
      for (int i = 0; i < kW; ++i) x[i] = load8(kr[i] + d) * ks[i];
      // rows i, lanes d -> rows d, lanes i: pairs of rows interleaved, then pairs of pairs, then halves
      vf y[kW], z[kW];
      for (int i = 0; i < kW; i += 2) {
        y[i] = __builtin_shuffle(x[i], x[i + 1], vi{0, 8, 1, 9, 4, 12, 5, 13});
        y[i + 1] = __builtin_shuffle(x[i], x[i + 1], vi{2, 10, 3, 11, 6, 14, 7, 15});
      }
      for (int i = 0; i < kW; i += 4)
        for (int j = 0; j < 2; ++j) {
          z[i + j] = __builtin_shuffle(y[i + j], y[i + j + 2], vi{0, 1, 8, 9, 4, 5, 12, 13});
          z[i + j + 2] = __builtin_shuffle(y[i + j], y[i + j + 2], vi{2, 3, 10, 11, 6, 7, 14, 15});
        }
      // z[0..3]: dims (0, 2, 1, 3) of keys 0-3 in the low half, dims (4, 6, 5, 7) in the high; z[4..7] keys 4-7
      constexpr int order[4] = {0, 2, 1, 3};
      for (int j = 0; j < 4; ++j) {
        storeu(kt + (d + order[j]) * kb + t, __builtin_shuffle(z[j], z[j + 4], vi{0, 1, 2, 3, 8, 9, 10, 11}));
        storeu(kt + (d + order[j] + 4) * kb + t, __builtin_shuffle(z[j], z[j + 4], vi{4, 5, 6, 7, 12, 13, 14, 15}));
      }
    }
    for (; d < D; ++d)
      for (int i = 0; i < kW; ++i) kt[d * kb + t + i] = static_cast<float>(kr[i][d]) * ks[i];
  }
  if (t < tokens)
    load_chunk(keys, values, rs, blocks, base + t, tokens - t, block_size, D, kb, kt + t,
               vf32 == nullptr ? nullptr : vf32 + t * D);
}

// S[r, :NB * kW] = Q[r, :] . Kt[:, :NB * kW] for the NR rows from q (row stride D) and keys
// transposed to Kt [D, ld]; s has row stride ld.
template <int NR, int NB>
[[gnu::always_inline]] inline void score_tile(const float* q, int64_t D, const float* kt, int64_t ld, float* s) {
  vf a[NR][NB] = {};
  for (int64_t d = 0; d < D; ++d) {
    vf k[NB];
    for (int c = 0; c < NB; ++c) k[c] = loadu(kt + d * ld + c * kW);
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NB; ++c) a[r][c] = fmadd(splat(q[r * D + d]), k[c], a[r][c]);
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NB; ++c) storeu(s + r * ld + c * kW, a[r][c]);
}

// acc[r, :NV * kW] = acc[r, :NV * kW] * alpha[r] + sum over t in [t0, t1) of p[r * ld + t] * v[t, :NV * kW]
// for NR rows (acc's and v's row stride D); v fp32, or a float cache's rows read in place (widened
// exactly).
template <int NR, int NV, typename T>
[[gnu::always_inline]] inline void value_tile(const float* p, int64_t ld, const T* v, int64_t D, int64_t t0,
                                              int64_t t1, const float* alpha, float* acc) {
  vf a[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) a[r][c] = loadu(acc + r * D + c * kW) * alpha[r];
  for (int64_t t = t0; t < t1; ++t) {
    vf x[NV];
    for (int c = 0; c < NV; ++c) x[c] = load8(v + t * D + c * kW);
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NV; ++c) a[r][c] = fmadd(splat(p[r * ld + t]), x[c], a[r][c]);
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) storeu(acc + r * D + c * kW, a[r][c]);
}

// The tiles' softmax is written in vectors (exp_nonpositive on eight lanes): the omp simd loops of
// the per-row softmax it replaced compiled to a scalar max and peeled ends, and took the 2,048-token
// fp32 prefill 81 ms against 75 on one thread.
inline float hmax(vf v) {
  v = v > __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3}) ? v : __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3});
  v = v > __builtin_shuffle(v, vi{2, 3, 0, 1, 6, 7, 4, 5}) ? v : __builtin_shuffle(v, vi{2, 3, 0, 1, 6, 7, 4, 5});
  return std::max(v[0], v[1]);
}

// One online-softmax step on whole vectors of a row's scores s[c0, c1) (c0 and c1 multiples of kW,
// the visible keys [vis_lo, vis_hi) among them, at least one): updates the row's max m and sum l,
// leaves the weights in s[c0, c1), 0 outside the visible keys, and returns the factor alpha its
// accumulator is to be rescaled by (value_tile applies it). Lanes outside the visible keys are masked
// rather than branched around; kAll: the row sees all of [c0, c1), as in every chunk of a causal
// prefill but the ones on its diagonal, and needs no masks.
template <bool kAll>
inline float softmax_lanes(float* s, int64_t c0, int64_t c1, int64_t vis_lo, int64_t vis_hi, float& m, float& l) {
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const vi lo = vi{} + static_cast<int32_t>(vis_lo - c0), hi = vi{} + static_cast<int32_t>(vis_hi - c0);
  auto seen = [&](int64_t c) {  // all ones in the lanes of visible keys
    const vi t = lane + static_cast<int32_t>(c - c0);
    return kAll ? vi{} - 1 : (t >= lo && t < hi);
  };
  vf mx = vf{} - std::numeric_limits<float>::infinity();
  for (int64_t c = c0; c < c1; c += kW) {
    const vf x = loadu(s + c);
    mx = (seen(c) && x > mx) ? x : mx;
  }
  const float m_new = std::max(m, hmax(mx));
  const float alpha = exp_nonpositive(m - m_new);  // m = -inf on the first block: alpha ~ 0, acc is 0
  vf sum = {};
  for (int64_t c = c0; c < c1; c += kW) {
    vf p = exp_nonpositive(loadu(s + c) - m_new);
    if constexpr (!kAll) p = seen(c) ? p : vf{};
    storeu(s + c, p);
    sum += p;
  }
  l = l * alpha + hsum(sum);
  m = m_new;
  return alpha;
}

inline float softmax_weights8(float* s, int64_t c0, int64_t c1, int64_t vis_lo, int64_t vis_hi, float& m, float& l) {
  if (vis_lo <= c0 && vis_hi >= c1) return softmax_lanes<true>(s, c0, c1, vis_lo, vis_hi, m, l);
  return softmax_lanes<false>(s, c0, c1, vis_lo, vis_hi, m, l);
}

// Where a chunk's value rows are: run i holds the chunk's keys [start[i], start[i + 1]), key t's
// row at base[i] + t * D. One run over the chunk's fp32 copy, or one per cache block where the
// values are read in place.
template <typename T>
struct ValueRuns {
  static constexpr int kMax = 64;
  const T* base[kMax];
  int64_t start[kMax + 1];
  int n = 0;
};

// Which keys of a chunk each of the item's tokens sees (prefill_item's rule).
struct ChunkKeys {
  int64_t first_pos;  // the item's first token's position, less the chunk's first key's
  int64_t window;
  int64_t tokens;     // keys in the chunk
  // Token j sees the chunk's keys [lo(j), hi(j)), none where hi(j) <= lo(j); both grow with j.
  int64_t lo(int64_t j) const { return window > 0 ? std::max<int64_t>(0, first_pos + j - window + 1) : 0; }
  int64_t hi(int64_t j) const { return std::min(tokens, first_pos + j + 1); }
};

// The item's buffers (prefill_item's), rows of kb scores and of D accumulators.
struct TileBuffers {
  const float* qf;  // [rows, D]
  float* s;         // [rows, kb]
  float* acc;       // [rows, D]
  float* m;         // [rows]
  float* l;         // [rows]
};

// NR rows from row r0 (token r / G, head r % G) over one chunk: the keys [c0, c1) of it that any of
// them sees, rounded out to whole vectors, scored; each row's online softmax; then the weighted values.
template <int NR, typename T>
[[gnu::always_inline]] inline void chunk_tile(TileBuffers b, int64_t r0, int64_t G, int64_t D, const float* kt,
                                              const ValueRuns<T>& v, int64_t kb, ChunkKeys keys) {
  // The first row's lo and the last row's hi bound the keys the tile's rows see.
  const int64_t t0 = keys.lo(r0 / G), t1 = keys.hi((r0 + NR - 1) / G);
  if (t0 >= t1) return;  // no row sees a key of the chunk: their state stays as it is
  const int64_t c0 = t0 / kW * kW, c1 = (t1 + kW - 1) / kW * kW;
  const float* q = b.qf + r0 * D;
  float* s = b.s + r0 * kb;
  // Tiles of 3 rows or fewer (a decode's) take 4 vectors a step: 12 accumulators still fit. Each
  // lane's sum is the same whatever the tile's width.
  constexpr int kVecs = NR <= 3 ? 2 * kTileVecs : kTileVecs;
  int64_t c = c0;
  for (; c + kVecs * kW <= c1; c += kVecs * kW) score_tile<NR, kVecs>(q, D, kt + c, kb, s + c);
  for (; c < c1; c += kW) score_tile<NR, 1>(q, D, kt + c, kb, s + c);

  float alpha[NR];
  for (int i = 0; i < NR; ++i) {
    const int64_t r = r0 + i;
    const int64_t lo = keys.lo(r / G), hi = keys.hi(r / G);
    if (lo < hi) {
      alpha[i] = softmax_weights8(b.s + r * kb, c0, c1, lo, hi, b.m[r], b.l[r]);
    } else {  // a row that sees none of the keys its neighbours see weighs them 0
      alpha[i] = 1.0f;
      std::fill(b.s + r * kb + c0, b.s + r * kb + c1, 0.0f);
    }
  }

  // Run by run of value rows: the first scales the accumulators by alpha, the others by 1 (exact), so
  // the sums are the same however the rows are laid out.
  float* acc = b.acc + r0 * D;
  float ones[NR];
  std::fill(ones, ones + NR, 1.0f);
  const float* scale = alpha;
  for (int i = 0; i < v.n; ++i) {
    const int64_t u0 = std::max(t0, v.start[i]), u1 = std::min(t1, v.start[i + 1]);
    if (u0 >= u1) continue;
    const T* rows = v.base[i];
    int64_t d = 0;
    for (; d + kVecs * kW <= D; d += kVecs * kW) value_tile<NR, kVecs>(s, kb, rows + d, D, u0, u1, scale, acc + d);
    for (; d + kW <= D; d += kW) value_tile<NR, 1>(s, kb, rows + d, D, u0, u1, scale, acc + d);
    for (; d < D; ++d)  // head sizes not a multiple of kW
      for (int r = 0; r < NR; ++r) {
        float x = acc[r * D + d] * scale[r];
        for (int64_t t = u0; t < u1; ++t) x = fmadd(s[r * kb + t], static_cast<float>(rows[t * D + d]), x);
        acc[r * D + d] = x;
      }
    scale = ones;
  }
}

// One chunk of keys for all the item's rows, kTileRows at a time, the last tile holding the rest.
template <typename T>
[[gnu::always_inline]] inline void chunk_tiles(TileBuffers b, int64_t rows, int64_t G, int64_t D, const float* kt,
                                               const ValueRuns<T>& v, int64_t kb, ChunkKeys keys) {
  static_assert(kTileRows == 6, "the switch below holds the tiles of 1 to 5 rows");
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) chunk_tile<kTileRows>(b, r, G, D, kt, v, kb, keys);
  switch (rows - r) {
    case 5: chunk_tile<5>(b, r, G, D, kt, v, kb, keys); break;
    case 4: chunk_tile<4>(b, r, G, D, kt, v, kb, keys); break;
    case 3: chunk_tile<3>(b, r, G, D, kt, v, kb, keys); break;
    case 2: chunk_tile<2>(b, r, G, D, kt, v, kb, keys); break;
    case 1: chunk_tile<1>(b, r, G, D, kt, v, kb, keys); break;
    default: break;
  }
}

// ------------------------------------------------ one row's arithmetic, decodes and prefills
//
// A row (one query token, one head) is computed by the same steps wherever it is: in a decode (one
// token, its G heads), a prefill, a chunk of one or a speculative-decoding verify step (several
// tokens). Keys are taken in segments of kSegmentKeys at fixed positions of the sequence (keys [0,
// S), [S, 2S), ...), each segment in chunks at fixed positions too, on the tiles above: each row's
// online softmax from a fresh state per segment, then the segment's max, sum and weighted values
// folded into the row's running ones (fold_rows), segment after segment. A decode whose keys are
// cut into partitions for the threads cuts them at segment boundaries and folds the partitions'
// segments in the same order, so where the work went changes nothing.

// Keys per segment: a multiple of the chunk, at least kSegmentKeys keys where a chunk is shorter.
constexpr int64_t kSegmentKeys = 256;

// Items of at most this many rows read a float cache's values in place (segment_rows).
constexpr int64_t kInPlaceRows = 8;

inline int64_t chunk_keys(int64_t block_size) { return std::max<int64_t>(1, kChunkKeys / block_size) * block_size; }

inline int64_t segment_keys(int64_t block_size) {
  const int64_t chunk = chunk_keys(block_size);
  return std::max<int64_t>(1, kSegmentKeys / chunk) * chunk;
}

// Where a (sequence, KV head)'s keys and values are read: its caches, an int8 cache's scales, its
// block table.
template <typename cache_t>
struct KeySource {
  const cache_t* keys;
  const cache_t* values;
  RowScales rs;
  const int32_t* blocks;
  int64_t block_size;
};

// An item's buffers: the segment's state (TileBuffers: queries, scores, m, l, acc), the running
// state the segments fold into (M, L, A), and a chunk's keys (transposed) and values in fp32.
struct RowBuffers {
  TileBuffers seg;
  float* qf;  // seg.qf, written
  float* A;  // [rows, D]
  float* M;  // [rows]
  float* L;  // [rows]
  float* kt;
  float* vf32;
  int64_t kb;
};

inline RowBuffers row_buffers(std::vector<float>& buf, int64_t rows, int64_t D, int64_t block_size) {
  const int64_t kb = (chunk_keys(block_size) + kW - 1) / kW * kW;
  buf.resize(3 * rows * D + 4 * rows + 2 * D * kb + rows * kb);
  float* p = buf.data();
  auto take = [&](int64_t n) {
    float* at = p;
    p += n;
    return at;
  };
  RowBuffers b;
  float* qf = take(rows * D);
  float* acc = take(rows * D);
  float* m = take(rows);
  float* l = take(rows);
  b.A = take(rows * D);
  b.M = take(rows);
  b.L = take(rows);
  b.kt = take(D * kb);
  b.vf32 = take(kb * D);
  b.seg = TileBuffers{qf, take(rows * kb), acc, m, l};
  b.qf = qf;
  b.kb = kb;
  std::fill(b.A, b.A + rows * D, 0.0f);
  std::fill(b.M, b.M + rows, -std::numeric_limits<float>::infinity());
  std::fill(b.L, b.L + rows, 0.0f);
  std::fill(b.kt, b.kt + D * kb, 0.0f);  // lanes no row sees are read: finite, whatever they hold
  return b;
}

// The segment state (b.m, b.l, b.acc) of `rows` rows (row r: token r / G at position pos0 + r / G,
// head r % G) over the keys [lo, hi) of one segment (lo past the segment's start only where a
// window hides the keys before it): each chunk of the segment read from the cache (the blocks
// holding [lo, hi) only), its keys and values converted to fp32, and run on the tiles.
template <int kC, typename cache_t>
void segment_rows(TileBuffers b, int64_t rows, int64_t G, int64_t D, const KeySource<cache_t>& src, int64_t pos0,
                  int64_t window, int64_t lo, int64_t hi, float* kt, float* vf32, int64_t kb,
                  const Prefetcher<cache_t>* ahead) {
  const int64_t Dc = kC > 0 ? kC * kW : D;  // a constant where the head size is specialised
  const int64_t bs = src.block_size, chunk = chunk_keys(bs);
  // Few rows (a decode's) read a float cache's values in place rather than copy them first (a
  // prefill's many rows share the copy); the sums are the same bits either way.
  constexpr bool kInPlace = std::is_same_v<cache_t, float> || std::is_same_v<cache_t, c10::BFloat16>;
  [[maybe_unused]] const bool in_place = rows <= kInPlaceRows && bs >= kW && chunk / bs <= ValueRuns<cache_t>::kMax;
  std::fill(b.acc, b.acc + rows * Dc, 0.0f);
  std::fill(b.m, b.m + rows, -std::numeric_limits<float>::infinity());
  std::fill(b.l, b.l + rows, 0.0f);
  for (int64_t cb = lo / chunk * chunk; cb < hi; cb += chunk) {
    const int64_t ld0 = std::max(cb, lo / bs * bs), ld1 = std::min(cb + chunk, hi);
    if (ahead != nullptr)
      for (int64_t blk = ld0 / bs; blk * bs < ld1; ++blk) ahead->whole_block(blk);
    const ChunkKeys keys{pos0 - cb, window, ld1 - cb};
    if constexpr (kInPlace) {
      if (in_place) {  // the values read from their blocks
        load_chunk8(src.keys, src.values, src.rs, src.blocks, ld0, ld1 - ld0, bs, Dc, kb, kt + (ld0 - cb),
                    static_cast<float*>(nullptr));
        ValueRuns<cache_t> runs;
        for (int64_t blk = ld0 / bs; blk * bs < ld1; ++blk) {
          runs.base[runs.n] = src.values + (static_cast<int64_t>(src.blocks[blk]) * bs + cb - blk * bs) * Dc;
          runs.start[runs.n++] = std::max(ld0, blk * bs) - cb;
        }
        runs.start[runs.n] = ld1 - cb;
        chunk_tiles(b, rows, G, Dc, kt, runs, kb, keys);
        continue;
      }
    }
    load_chunk8(src.keys, src.values, src.rs, src.blocks, ld0, ld1 - ld0, bs, Dc, kb, kt + (ld0 - cb),
                vf32 + (ld0 - cb) * Dc);
    ValueRuns<float> copy;
    copy.base[0] = vf32;
    copy.start[0] = 0;
    copy.start[1] = kb;
    copy.n = 1;
    chunk_tiles(b, rows, G, Dc, kt, copy, kb, keys);
  }
}

// Folds each row's segment state (m, l, acc) into its running one (M, L, A): both rescaled to the
// larger max. A segment the row saw no key of (l == 0) leaves it as it is. One compiled copy (not
// inlined), so that every caller rounds alike.
[[gnu::noinline]] void fold_rows(const float* m, const float* l, const float* acc, int64_t rows, int64_t D, float* M,
                                 float* L, float* A) {
  for (int64_t r = 0; r < rows; ++r) {
    if (l[r] == 0.0f) continue;
    const float m_new = std::max(M[r], m[r]);
    const float a = exp_nonpositive(M[r] - m_new), w = exp_nonpositive(m[r] - m_new);
    L[r] = L[r] * a + l[r] * w;
    for (int64_t d = 0; d < D; ++d) A[r * D + d] = A[r * D + d] * a + acc[r * D + d] * w;
    M[r] = m_new;
  }
}

// ---------------------------------------------------------------- prefill items

template <typename scalar_t, typename cache_t, int kC>
void prefill_item(const scalar_t* query, int64_t qs0, int64_t qs1, scalar_t* out, int64_t os0, int64_t os1,
                  const cache_t* keys, const cache_t* values, RowScales rs, const int32_t* blocks, int64_t context,
                  int64_t j0, int64_t j1, int64_t block_size, int64_t D, int64_t G, float scale, int64_t window,
                  std::vector<float>& buf) {
  const int64_t rows = (j1 - j0) * G;
  const int64_t Dc = kC > 0 ? kC * kW : D;
  RowBuffers b = row_buffers(buf, rows, Dc, block_size);
  for (int64_t j = j0; j < j1; ++j) load_rows(query + j * qs0, qs1, G, Dc, scale, b.qf + (j - j0) * G * Dc);
  // Token j sits at position context + j and sees keys (pos - window, pos]: blocks wholly before
  // the first token's window are never read.
  const int64_t pos0 = context + j0;
  const int64_t first = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0, last = context + j1 - 1;
  const KeySource<cache_t> src{keys, values, rs, blocks, block_size};
  const int64_t S = segment_keys(block_size);
  for (int64_t k = first / S; k * S <= last; ++k) {
    segment_rows<kC>(b.seg, rows, G, Dc, src, pos0, window, std::max(first, k * S), std::min(last + 1, (k + 1) * S),
                     b.kt, b.vf32, b.kb, static_cast<const Prefetcher<cache_t>*>(nullptr));
    fold_rows(b.seg.m, b.seg.l, b.seg.acc, rows, Dc, b.M, b.L, b.A);
  }
  for (int64_t j = j0; j < j1; ++j)
    write_heads(b.A + (j - j0) * G * Dc, b.L + (j - j0) * G, G, Dc, out + j * os0, os1);
}

// ---------------------------------------------------------------- decode items
//
// An item is a run of segments [k0, k1) of one (decode, KV head). With few (decode, KV head) pairs
// per thread (batch 1 of a model with 3 KV heads on 2 threads) a pair's segments are cut into
// several items, each storing every segment's state in its slot of the partials buffer, and a
// reduce folds them in order; otherwise an item holds all of a pair's segments and folds them as it
// goes. Items are claimed, longest first, from a shared counter so that no thread idles while
// another works.

struct DecodeItem {
  int64_t seq, head;  // decode i, KV head h
  int64_t k0, k1;     // its segments [k0, k1)
  int64_t slot;       // the first segment's slot in the partials buffer; -1: all segments, written to out
  int64_t cost;       // keys read
};

struct DecodePlan {
  std::vector<DecodeItem> items;
  std::vector<int64_t> start;       // per decode: its first visible key
  std::vector<int64_t> first_slot;  // per (decode, KV head) cut into items: its first slot, else -1
  int64_t num_slots = 0;
};

// Pairs are cut when there are too few to keep every thread busy: into about kItemsPerThread items
// per thread in all, none under kMinPartitionTokens keys (shorter ones cost more in set-up and
// reduce than they gave: a batch-1 call of 160 keys, out of cache, took 1.1x the time uncut with
// 64-key ones). Only the speed depends on these: the results are the same however a pair is cut.
constexpr int64_t kItemsPerThread = 8;
constexpr int64_t kMinPartitionTokens = 256;

DecodePlan plan_decodes(const int64_t* rows, const int32_t* lens, const int32_t* table, int64_t n, int64_t max_blocks,
                        int64_t num_tokens, int64_t KVH, int64_t num_cache_blocks, int64_t block_size,
                        int64_t window, int64_t threads) {
  DecodePlan plan;
  plan.start.resize(n);
  int64_t total_keys = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(rows[i] >= 0 && rows[i] < num_tokens, "token_idx must lie in [0, ", num_tokens, ").");
    TORCH_CHECK_VALUE(lens[i] >= 1 && lens[i] <= max_blocks * block_size, "seq_lens must lie in [1, ",
                      max_blocks * block_size, "] (block_table columns x block size), got ", lens[i], ".");
    plan.start[i] = window > 0 ? std::max<int64_t>(0, lens[i] - window) : 0;
    for (int64_t b = plan.start[i] / block_size; b * block_size < lens[i]; ++b) {
      const int32_t id = table[i * max_blocks + b];
      TORCH_CHECK_VALUE(id >= 0 && id < num_cache_blocks, "block_table entries in use must lie in [0, ",
                        num_cache_blocks, ").");
    }
    total_keys += lens[i] - plan.start[i];
  }
  const int64_t S = segment_keys(block_size);
  const int64_t target = kItemsPerThread * threads;
  int64_t per_item = std::numeric_limits<int64_t>::max();  // segments per item
  if (threads > 1 && n * KVH < target) {
    const int64_t part_tokens = std::max(kMinPartitionTokens, (total_keys * KVH + target - 1) / target);
    per_item = (part_tokens + S - 1) / S;
  }
  plan.first_slot.assign(n * KVH, -1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k_first = plan.start[i] / S, k_end = (lens[i] - 1) / S + 1;
    const bool cut = k_end - k_first > per_item;
    for (int64_t h = 0; h < KVH; ++h) {
      if (!cut) {
        plan.items.push_back({i, h, k_first, k_end, -1, lens[i] - plan.start[i]});
        continue;
      }
      plan.first_slot[i * KVH + h] = plan.num_slots;
      for (int64_t k = k_first; k < k_end; k += per_item) {
        const int64_t k1 = std::min(k_end, k + per_item);
        const int64_t cost = std::min<int64_t>(lens[i], k1 * S) - std::max(plan.start[i], k * S);
        plan.items.push_back({i, h, k, k1, plan.num_slots + k - k_first, cost});
      }
      plan.num_slots += k_end - k_first;
    }
  }
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const DecodeItem& a, const DecodeItem& b) { return a.cost > b.cost; });
  return plan;
}

template <typename Fn>
void for_each_claimed(int64_t count, Fn&& fn) {
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t w = begin; w < end; ++w)
      for (int64_t k = next.fetch_add(1); k < count; k = next.fetch_add(1)) fn(k, buf);
  });
}

// Where head h's key and value scales start (null for a float cache, whose kv_scales is absent).
RowScales head_scales(const std::optional<at::Tensor>& kv_scales, int64_t h) {
  if (!kv_scales) return {};
  const int64_t KVH = kv_scales->size(1), per_head = kv_scales->size(2) * kv_scales->size(3);
  const float* base = kv_scales->data_ptr<float>();
  return {base + h * per_head, base + (KVH + h) * per_head};
}

template <typename scalar_t, typename cache_t, int kC>
void decode_all(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& token_idx,
                const at::Tensor& seq_lens, const at::Tensor& block_table, double scale, at::Tensor& out,
                int64_t window, const std::optional<at::Tensor>& kv_scales) {
  const int64_t n = token_idx.size(0);
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t Dc = kC > 0 ? kC * kW : D;
  const int64_t KVH = kv_cache.size(1), num_cache_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  const int64_t G = H / KVH;
  const int64_t max_blocks = block_table.size(1);
  const int64_t head_blocks = num_cache_blocks * block_size * D;  // elements per (K or V, KV head)
  const scalar_t* q = query.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const cache_t* cache = kv_cache.data_ptr<cache_t>();
  const int64_t* rows = token_idx.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), os0 = out.stride(0), os1 = out.stride(1);

  const DecodePlan plan = plan_decodes(rows, lens, table, n, max_blocks, query.size(0), KVH, num_cache_blocks,
                                       block_size, window, at::get_num_threads());
  const int64_t S = segment_keys(block_size);
  const int64_t stride = G * (D + 2);  // one slot: m [G], l [G], acc [G, D]
  std::vector<float> partials(plan.num_slots * stride);
  [[maybe_unused]] const bool bf16_dot = bf16_dot_enabled();
  [[maybe_unused]] const bool int8_fast = std::is_same_v<cache_t, int8_t> && int8_fast_enabled();
  for_each_claimed(static_cast<int64_t>(plan.items.size()), [&](int64_t k, std::vector<float>& buf) {
    const DecodeItem& it = plan.items[k];
    const int64_t row = rows[it.seq], len = lens[it.seq], first = plan.start[it.seq];
    const scalar_t* qh = q + row * qs0 + it.head * G * qs1;
    const cache_t* keys = cache + it.head * head_blocks;
    const cache_t* values = cache + (KVH + it.head) * head_blocks;
    const int32_t* blocks = table + it.seq * max_blocks;
    const RowScales rs = head_scales(kv_scales, it.head);
    RowBuffers b = row_buffers(buf, G, Dc, block_size);
    load_rows(qh, qs1, G, Dc, static_cast<float>(scale), b.qf);
    const int64_t lo = std::max(first, it.k0 * S), hi = std::min(len, it.k1 * S);
    const Prefetcher<cache_t> ahead{keys, values, blocks, lo / block_size, (hi - 1) / block_size, block_size * D,
                                    rs.keys, rs.values, block_size};
    ahead.start();
    const KeySource<cache_t> src{keys, values, rs, blocks, block_size};
    for (int64_t seg = it.k0; seg < it.k1; ++seg) {
      const int64_t s0 = std::max(first, seg * S), s1 = std::min(len, (seg + 1) * S);
      [[maybe_unused]] const PartialView part{b.seg.m, b.seg.l, b.seg.acc};
      [[maybe_unused]] thread_local std::vector<float> scores;
      bool other = false;  // run on 512-bit int8 rows or bf16 dot products (neither batch-invariant; opt-in)
#ifdef WEFT_AVX512
      if constexpr (std::is_same_v<cache_t, int8_t> && (kC == 8 || kC == 16))
        if (int8_fast) {
          decode_item_int8<kC / 2>(qh, qs1, keys, values, rs, blocks, s0, s1, block_size, G, static_cast<float>(scale),
                                   scores, part);
          other = true;
        }
#endif
#ifdef WEFT_BF16_DOT
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16> &&
                    (kC == 8 || kC == 16))
        if (bf16_dot) {
          decode_item_bf16<kC / 4>(qh, qs1, keys, values, blocks, s0, s1, block_size, G, static_cast<float>(scale),
                                   scores, part);
          other = true;
        }
#endif
      if (!other)
        segment_rows<kC>(b.seg, G, G, Dc, src, len - 1, window, s0, s1, b.kt, b.vf32, b.kb, &ahead);
      if (it.slot < 0) {
        fold_rows(b.seg.m, b.seg.l, b.seg.acc, G, Dc, b.M, b.L, b.A);
      } else {
        float* slot = partials.data() + (it.slot + seg - it.k0) * stride;
        std::copy(b.seg.m, b.seg.m + G, slot);
        std::copy(b.seg.l, b.seg.l + G, slot + G);
        std::copy(b.seg.acc, b.seg.acc + G * Dc, slot + 2 * G);
      }
    }
    if (it.slot < 0) write_heads(b.A, b.L, G, Dc, o + row * os0 + it.head * G * os1, os1);
  });
  if (plan.num_slots == 0) return;
  std::vector<int64_t> cut;
  for (int64_t p = 0; p < n * KVH; ++p)
    if (plan.first_slot[p] >= 0) cut.push_back(p);
  for_each_claimed(static_cast<int64_t>(cut.size()), [&](int64_t k, std::vector<float>& buf) {
    const int64_t p = cut[k], i = p / KVH, h = p % KVH;
    const int64_t count = (lens[i] - 1) / S + 1 - plan.start[i] / S;
    buf.resize(G * D + 2 * G);
    float* A = buf.data();
    float* M = A + G * D;
    float* L = M + G;
    std::fill(A, A + G * D, 0.0f);
    std::fill(M, M + G, -std::numeric_limits<float>::infinity());
    std::fill(L, L + G, 0.0f);
    for (int64_t s = 0; s < count; ++s) {
      const float* slot = partials.data() + (plan.first_slot[p] + s) * stride;
      fold_rows(slot, slot + G, slot + 2 * G, G, D, M, L, A);
    }
    write_heads(A, L, G, D, o + rows[i] * os0 + h * G * os1, os1);
  });
}

void paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& token_idx,
                            const at::Tensor& seq_lens, const at::Tensor& block_table, double scale,
                            at::Tensor out, int64_t window, const std::optional<at::Tensor>& kv_scales) {
  const char* op = "paged_decode_attention";
  check_layouts(op, query, kv_cache, out);
  check_scales(op, kv_cache, kv_scales);
  check_index(op, "token_idx", token_idx, at::kLong, 1);
  check_index(op, "seq_lens", seq_lens, at::kInt, 1);
  check_index(op, "block_table", block_table, at::kInt, 2);
  const int64_t n = token_idx.size(0);
  TORCH_CHECK_VALUE(seq_lens.size(0) == n && block_table.size(0) == n, op,
                    ": token_idx, seq_lens and block_table need one entry (row) per decode");
  TORCH_CHECK_VALUE(window >= 0, "window must be 0 (full attention) or positive, got ", window, ".");
  if (n == 0) return;
  dispatch_query_and_cache(op, query, kv_cache, [&](auto tag, auto cache_tag) {
    using scalar_t = decltype(tag);
    using cache_t = decltype(cache_tag);
    dispatch_head_dim(query.size(2), [&](auto chunks) {
      decode_all<scalar_t, cache_t, decltype(chunks)::value>(query, kv_cache, token_idx, seq_lens, block_table, scale,
                                                              out, window, kv_scales);
    });
  });
}

// ------------------------------------------------- prefill, bf16 dot products
//
// bf16 caches on CPUs with AVX512_BF16: vdpbf16ps multiplies pairs of bf16
// and adds both products to an fp32 lane, twice the multiply-adds of an fp32
// FMA per instruction, and keys and values need no widening to fp32.
//
// Scores come out transposed, S^T [key, row], 16 query rows to a vector: the
// tile's queries are packed once as pairs along D (qp[p][r] = Q[r][2p],
// Q[r][2p+1] as one 32-bit word), and one vdpbf16ps of a key pair broadcast
// straight from the cache block adds that pair's products to 16 rows' scores.
// Keys are not copied at all, and the softmax runs down the columns: the max,
// the exponentials and the sum are lane-wise over 16 rows at once, with no
// horizontal reductions. The weights P are rounded to bf16 (as GPU flash
// attention takes P in bf16) and kept as pairs along t, pw[t/2][r]; values are
// packed per chunk as pairs along t too (vp[t/2][d] = V[t][d], V[t+1][d]), so
// one vdpbf16ps of a row's weight pair broadcast adds two keys' weighted values
// to 16 lanes of its accumulator. The query is used as it is in the cache's
// dtype, the softmax scale multiplies the fp32 scores, and each row's sum of
// weights is that of the rounded weights: the output is an exact weighted mean
// of the values with bf16 weights.
//
// Other dtypes, head sizes other than 64, 128 or 256, CPUs without the flag,
// and WEFT_ATTENTION_BF16_DOT unset or 0 take the fp32 path above.

#ifdef WEFT_BF16_DOT

// Rows per block: scores, softmax and values run a block at a time, so that its scores and weights
// stay in L1 and, on the diagonal chunk, each block skips the keys none of its rows sees.
constexpr int64_t kBfBlockRows = 48;  // 3 vectors of 16 rows
constexpr int kBfKeys = 8;            // keys per score pass: 8 keys x 3 row vectors = 24 accumulators

inline uint32_t pair_at(const uint16_t* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// exp(x) for the weights, which are rounded to bf16 (relative step 2^-9) right after: a degree-4
// polynomial on |r| <= ln2 / 2 (Taylor, relative error 4e-5) and a one-step reduction, no clamp (x
// is finite, and vscalefps takes 2^n to 0 for n below the range). 10 operations against 15: 4-5%
// off a bf16 prefill (512 and 2,048 fresh tokens, one thread, interleaved).
inline __m512 exp16_weight(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.69314718055994531f), x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 24), r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// The chunk's values [base, base + tokens) packed as vp [kb / 2, D] words: pairs of tokens, the
// one past an odd `tokens` zero (its weight is 0, and 0 x a stale NaN would not be).
template <int D>
void pack_values_bf16(const uint16_t* values, const int32_t* blocks, int64_t base, int64_t tokens,
                      int64_t block_size, uint32_t* vp) {
  // Word i of a pair's 32 lanes: element i / 2 of the first row (i even) or of the second (i odd).
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i ilo = _mm512_load_si512(lo_idx);
  const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
  for (int64_t t = 0; t < tokens; t += 2) {
    const int64_t pos = base + t;
    const uint16_t* a = values + static_cast<int64_t>(blocks[pos / block_size]) * block_size * D + pos % block_size * D;
    const int64_t pos1 = pos + 1;
    const uint16_t* b = t + 1 < tokens ? values + static_cast<int64_t>(blocks[pos1 / block_size]) * block_size * D +
                                             pos1 % block_size * D
                                       : nullptr;
    uint32_t* dst = vp + t / 2 * D;
    for (int d = 0; d < D; d += 32) {
      const __m512i x = _mm512_loadu_si512(a + d);
      const __m512i y = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(x, ilo, y));
      _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(x, ihi, y));
    }
  }
}

// S^T [kBfKeys keys, NRV x 16 rows] = scale x K . Q^T, key i's row at kr[i], the rows' query pairs
// at qp [D / 2, q_ld]; key i's scores go to s + i * s_ld.
template <int NRV, int D>
inline void score_keys_bf16(const uint16_t* const* kr, const uint32_t* qp, int64_t q_ld, float scale, float* s,
                            int64_t s_ld) {
  __m512 a[kBfKeys][NRV];
  for (int i = 0; i < kBfKeys; ++i)
    for (int v = 0; v < NRV; ++v) a[i][v] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    __m512bh q[NRV];
    for (int v = 0; v < NRV; ++v) q[v] = as_bh(_mm512_loadu_si512(qp + p * q_ld + v * 16));
    for (int i = 0; i < kBfKeys; ++i) {
      const __m512bh k = as_bh(_mm512_set1_epi32(static_cast<int32_t>(pair_at(kr[i] + 2 * p))));
      for (int v = 0; v < NRV; ++v) a[i][v] = _mm512_dpbf16_ps(a[i][v], k, q[v]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < kBfKeys; ++i)
    for (int v = 0; v < NRV; ++v) _mm512_storeu_ps(s + i * s_ld + v * 16, _mm512_mul_ps(a[i][v], sc));
}

// Online softmax of 16 rows (the lanes) over the chunk's key pairs [tp0, tp1): key t's scores at
// s + t * s_ld (kScaled: times s_scale, for scores the AMX tiles leave unscaled), visible to a row
// when its position `pos` >= base + t > `low` (pos - window, or -1; pos -1 for a padding row). The
// weights go to pw [tp, 16 rows] words as bf16 pairs (t, t + 1);
// m, l and alpha (the factor the rows' accumulators take before this chunk's values) are updated.
// kFull: every lane sees every key of the range (off the diagonal, no window edge): no masks.
template <bool kFull, bool kScaled = false>
inline void softmax_rows_bf16(const float* s, int64_t s_ld, int64_t tp0, int64_t tp1, int64_t base, const int32_t* pos,
                              const int32_t* low, float* m, float* l, float* alpha, uint32_t* pw, int64_t pw_ld,
                              float s_scale = 1.0f) {
  // Word r of the weights: row r's weights for keys t (low half) and t + 1, from cvtne2ps's halves.
  alignas(64) static const uint16_t pair_idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pv = _mm512_loadu_si512(pos), lv = _mm512_loadu_si512(low);
  auto visible = [&](int64_t t) -> __mmask16 {
    if constexpr (kFull) return 0xFFFF;
    const __m512i k = _mm512_set1_epi32(static_cast<int32_t>(base + t));
    return _mm512_cmple_epi32_mask(k, pv) & _mm512_cmpgt_epi32_mask(k, lv);
  };
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 sc = _mm512_set1_ps(s_scale);
  auto score = [&](int64_t t) {
    if constexpr (kScaled) return _mm512_mul_ps(_mm512_loadu_ps(s + t * s_ld), sc);
    return _mm512_loadu_ps(s + t * s_ld);
  };
  __m512 mx = ninf;
  for (int64_t t = 2 * tp0; t < 2 * tp1; ++t) mx = _mm512_mask_max_ps(mx, visible(t), mx, score(t));
  const __m512 m_old = _mm512_loadu_ps(m);
  const __m512 m_new = _mm512_max_ps(m_old, mx);
  // Rows that have seen no key yet keep m = -inf and take alpha 1 (exp of -inf - -inf is NaN); on a
  // row's first chunk m_old = -inf gives alpha ~ 1e-38 against an accumulator of 0.
  const __m512 al = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, ninf, _CMP_EQ_OQ),
                                         exp16_nonpositive(_mm512_sub_ps(m_old, m_new)), _mm512_set1_ps(1.0f));
  const __m512i idx = _mm512_load_si512(pair_idx);
  const __m512i high = _mm512_set1_epi32(-65536);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t tp = tp0; tp < tp1; ++tp) {
    __m512 p[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t t = 2 * tp + h;
      const __mmask16 k = visible(t);
      const __m512 x = _mm512_sub_ps(score(t), m_new);
      if constexpr (kFull) p[h] = exp16_weight(x);
      else p[h] = k ? _mm512_maskz_mov_ps(k, exp16_weight(x)) : _mm512_setzero_ps();
    }
    const __m512i w = _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    _mm512_storeu_si512(pw + tp * pw_ld, w);
    // The rounded weights, back in fp32 (a bf16 is the top half of an fp32).
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_and_si512(w, high)));
  }
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), al, sum));
  _mm512_storeu_ps(m, m_new);
  _mm512_storeu_ps(alpha, al);
}

// acc [NR rows, D] = alpha x acc + P . V over token pairs [tp0, tp1), columns [d0, d0 + ND x 16);
// row r's weight pair for tp at pw[tp * pw_ld + r].
template <int NR, int ND, int D>
inline void value_rows_bf16(const uint32_t* pw, int64_t pw_ld, const uint32_t* vp, int64_t tp0, int64_t tp1,
                            int64_t d0, const float* alpha, float* acc) {
  __m512 a[NR][ND];
  for (int r = 0; r < NR; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < ND; ++c) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d0 + c * 16), al);
  }
  for (int64_t tp = tp0; tp < tp1; ++tp) {
    __m512bh v[ND];
    for (int c = 0; c < ND; ++c) v[c] = as_bh(_mm512_loadu_si512(vp + tp * D + d0 + c * 16));
    for (int r = 0; r < NR; ++r) {
      const __m512bh pp = as_bh(_mm512_set1_epi32(static_cast<int32_t>(pw[tp * pw_ld + r])));
      for (int c = 0; c < ND; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pp, v[c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(acc + r * D + d0 + c * 16, a[r][c]);
}

// The value pass for n rows: 6 rows x 4 vectors of accumulators (head size 64), else 3 x 8.
template <int D>
inline void values_bf16(int64_t n, const uint32_t* pw, int64_t pw_ld, const uint32_t* vp, int64_t tp0, int64_t tp1,
                        const float* alpha, float* acc) {
  constexpr int ND = D == 64 ? 4 : 8;
  constexpr int NR = 24 / ND;
  for (int64_t r = 0; r < n; r += NR) {
    const int64_t k = std::min<int64_t>(NR, n - r);
    for (int64_t d0 = 0; d0 < D; d0 += ND * 16) {
      const uint32_t* p = pw + r;
      const float* al = alpha + r;
      float* ac = acc + r * D;
      switch (k) {
        case 6: if constexpr (NR >= 6) value_rows_bf16<6, ND, D>(p, pw_ld, vp, tp0, tp1, d0, al, ac); break;
        case 5: if constexpr (NR >= 5) value_rows_bf16<5, ND, D>(p, pw_ld, vp, tp0, tp1, d0, al, ac); break;
        case 4: if constexpr (NR >= 4) value_rows_bf16<4, ND, D>(p, pw_ld, vp, tp0, tp1, d0, al, ac); break;
        case 3: value_rows_bf16<3, ND, D>(p, pw_ld, vp, tp0, tp1, d0, al, ac); break;
        case 2: value_rows_bf16<2, ND, D>(p, pw_ld, vp, tp0, tp1, d0, al, ac); break;
        default: value_rows_bf16<1, ND, D>(p, pw_ld, vp, tp0, tp1, d0, al, ac); break;
      }
    }
  }
}

// An int8 cache's rows for the bf16 prefill (bf16 queries): each chunk's keys and values, times
// their scales, are rounded to bf16 into rows of their own, then read as a bf16 cache's would be.
// The rounding is a bf16 cache's (2^-9 of each value), on top of the weights' that this path
// already makes. 1.0-1.05x a bf16 cache's time here; the fp32 path took 2.6-3.3x (48 x 40 and
// 1 x 2,048 fresh tokens, scripts/int8_kv_bench.py).
struct Int8Rows {
  const int8_t* keys;
  const int8_t* values;
  RowScales rs;
};

// rows [tokens, D] (bf16 bits) = the int8 rows [base, base + tokens) of a sequence times their scales.
template <int D>
void stage_bf16(const int8_t* src, const float* row_scale, const int32_t* blocks, int64_t base, int64_t tokens,
                int64_t block_size, uint16_t* rows) {
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t pos = base + t;
    const int64_t slot = static_cast<int64_t>(blocks[pos / block_size]) * block_size + pos % block_size;
    const __m512 sc = _mm512_set1_ps(row_scale[slot]);
    for (int d = 0; d < D; d += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(widen16(src + slot * D + d), sc));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + t * D + d), reinterpret_cast<const __m256i&>(h));
    }
  }
}

#ifdef WEFT_AMX
// ------------------------------------------------------- prefill, AMX tiles
//
// On CPUs with AMX (amx_tile, amx_bf16) the bf16 prefill's two products run on tiles: one
// tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32, 8,192 multiply-adds
// where a vdpbf16ps does 32. The vdpbf16ps path's layouts are nearly the tiles' already:
// - scores S^T [16 keys, 16 rows] = K . Q^T: A is 16 key rows straight from a cache block (32 of
//   their D per tile, row stride D; so the block size must be a multiple of 16, and a group of 16
//   keys never crosses a block), B the queries' pairs qp [D / 2, ld] as they are;
// - values O [16 rows, 16 of D] += P . V: A is the weights row-major, 16 rows x 32 keys (the
//   softmax writes them as pairs per key, pw [t / 2, rows], so each 16 x 16 block of words is
//   transposed once), B the chunk's values as pairs along t, vp [t / 2, D], as packed for vdpbf16ps.
// The softmax, its masks and the rescaling between chunks stay the vdpbf16ps path's vector code;
// scores are scaled in the softmax (the tiles give Q . K unscaled). Sums are fp32, in another order.
// Linux hands a process the tile state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM); where
// that fails the vdpbf16ps path runs.

// Keys a value tile takes (its K: 16 pairs); a score tile takes 16.
constexpr int64_t kAmxKeys = 32;

// S^T [16 keys, nv x 16 rows] = K . Q^T, unscaled: the keys' rows from k (row stride D), the rows'
// query pairs at qp [D / 2, q_ld]; key i's scores go to s + i * s_ld. Tiles 0-2 hold the scores.
template <int D>
inline void score_tiles_amx(const uint16_t* k, const uint32_t* qp, int64_t q_ld, int64_t nv, float* s, int64_t s_ld) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int dd = 0; dd < D / 32; ++dd) {
    _tile_loadd(3, k + dd * 32, D * 2);
    const uint32_t* q = qp + dd * 16 * q_ld;
    _tile_loadd(4, q, q_ld * 4);
    _tile_dpbf16ps(0, 3, 4);
    if (nv > 1) {
      _tile_loadd(5, q + 16, q_ld * 4);
      _tile_dpbf16ps(1, 3, 5);
    }
    if (nv > 2) {
      _tile_loadd(6, q + 32, q_ld * 4);
      _tile_dpbf16ps(2, 3, 6);
    }
  }
  _tile_stored(0, s, s_ld * 4);
  if (nv > 1) _tile_stored(1, s + 16, s_ld * 4);
  if (nv > 2) _tile_stored(2, s + 32, s_ld * 4);
}

// For each of nv vectors of 16 rows: acc [16 rows, D] = alpha x acc + P . V over the key pairs
// [gp0, gp1) (whole tiles of 16 pairs), P the softmax's pw [pair, kBfBlockRows] (the pairs past the
// last it wrote zeroed by the caller), transposed into pr [16 rows, pr_ld] first. Tiles 0-3 hold
// four 16-column blocks of acc, 4 the weights, 5-7 the values.
template <int D>
void values_amx(int64_t nv, const uint32_t* pw, const uint32_t* vp, int64_t gp0, int64_t gp1, const float* alpha,
                float* acc, uint32_t* pr, int64_t pr_ld) {
  for (int64_t v = 0; v < nv; ++v) {
    for (int64_t gp = gp0; gp < gp1; gp += 16) {
      __m512i x[16];
      for (int i = 0; i < 16; ++i) x[i] = _mm512_loadu_si512(pw + (gp + i) * kBfBlockRows + v * 16);
      weft_amx::transpose16x16(x);
      for (int r = 0; r < 16; ++r) _mm512_storeu_si512(pr + r * pr_ld + gp, x[r]);
    }
    float* a = acc + v * 16 * D;
    for (int r = 0; r < 16; ++r) {
      const __m512 al = _mm512_set1_ps(alpha[v * 16 + r]);
      for (int d = 0; d < D; d += 16) _mm512_storeu_ps(a + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(a + r * D + d), al));
    }
    for (int d0 = 0; d0 < D; d0 += 64) {
      _tile_loadd(0, a + d0, D * 4);
      _tile_loadd(1, a + d0 + 16, D * 4);
      _tile_loadd(2, a + d0 + 32, D * 4);
      _tile_loadd(3, a + d0 + 48, D * 4);
      for (int64_t gp = gp0; gp < gp1; gp += 16) {
        _tile_loadd(4, pr + gp, pr_ld * 4);
        const uint32_t* b = vp + gp * D + d0;
        _tile_loadd(5, b, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 16, D * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, b + 32, D * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 48, D * 4);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, a + d0, D * 4);
      _tile_stored(1, a + d0 + 16, D * 4);
      _tile_stored(2, a + d0 + 32, D * 4);
      _tile_stored(3, a + d0 + 48, D * 4);
    }
  }
}

#endif  // WEFT_AMX

// A tile's rows for the bf16 paths: row r's position pos[r] and the floor low[r] its keys lie above
// (pos - window, or -1), both -1 for the padding rows [rows, ld), which see no key; and the queries
// as bf16 pairs along D, transposed, qp [D / 2, ld], the padding rows 0.
template <int D>
void tile_rows_bf16(const uint16_t* query, int64_t qs0, int64_t qs1, int64_t context, int64_t j0, int64_t rows,
                    int64_t ld, int64_t G, int64_t window, int32_t* pos, int32_t* low, uint32_t* qp) {
  for (int64_t r = 0; r < ld; ++r) {
    const int64_t p = r < rows ? context + j0 + r / G : -1;
    pos[r] = static_cast<int32_t>(p);
    low[r] = static_cast<int32_t>(window > 0 ? p - window : -1);
  }
  std::fill(qp, qp + D / 2 * ld, 0u);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* q = query + (j0 + r / G) * qs0 + r % G * qs1;
    for (int p = 0; p < D / 2; ++p) qp[p * ld + r] = pair_at(q + 2 * p);
  }
}

// prefill_item for bf16 with vdpbf16ps, or with AMX tiles (kAmx: a head size of a multiple of 64,
// a block size of 16) (the arguments are prefill_item's, the head size fixed;
// for an int8 cache, keys and values are null and i8 says where its rows are).
// Per chunk: pack its values once for the tile, then per block of kBfBlockRows rows: scores over
// the keys some row of the block sees (on the diagonal chunk the later ones are skipped), the
// softmax 16 rows at a time, and the value pass over the key pairs some row sees.
template <int D, bool kAmx = false>
void prefill_item_bf16(const uint16_t* query, int64_t qs0, int64_t qs1, c10::BFloat16* out, int64_t os0,
                       int64_t os1, const uint16_t* keys, const uint16_t* values, const int32_t* blocks,
                       int64_t context, int64_t j0, int64_t j1, int64_t block_size, int64_t G, float scale,
                       int64_t window, std::vector<float>& buf, const Int8Rows* i8 = nullptr) {
  const int64_t rows = (j1 - j0) * G;
  const int64_t ld = (rows + 15) / 16 * 16;  // rows padded to whole vectors
  const int64_t chunk = std::max<int64_t>(1, kChunkKeys / block_size) * block_size;
  // Keys are taken kGroup at a time: kBfKeys a score pass, an AMX value tile kAmxKeys.
#ifdef WEFT_AMX
  constexpr int64_t kGroup = kAmx ? kAmxKeys : kBfKeys;
#else
  static_assert(!kAmx, "AMX tiles need an AMX build");
  constexpr int64_t kGroup = kBfKeys;
#endif
  const int64_t kb = (chunk + kGroup - 1) / kGroup * kGroup;
  buf.resize(ld * D + 3 * ld + kb * kBfBlockRows);
  float* acc = buf.data();  // [ld, D] (tiles take whole vectors of 16 rows)
  float* m = acc + ld * D;  // [ld]
  float* l = m + ld;          // [ld]
  float* alpha = l + ld;      // [ld]
  float* s = alpha + ld;      // [kb, kBfBlockRows] one block's scores, transposed
  thread_local std::vector<uint32_t> words;
  words.resize(D / 2 * ld + kb / 2 * D + kb * kBfBlockRows);
  uint32_t* qp = words.data();     // [D / 2, ld] the queries as bf16 pairs, transposed
  uint32_t* vp = qp + D / 2 * ld;  // [kb / 2, D] the chunk's values
  uint32_t* pw = vp + kb / 2 * D;  // [kb / 2, kBfBlockRows] one block's weights
  [[maybe_unused]] uint32_t* pr = pw + kb / 2 * kBfBlockRows;  // [kBfBlockRows, kb / 2] AMX: pw transposed
  thread_local std::vector<int32_t> limits;
  limits.resize(2 * ld);
  int32_t* pos = limits.data();  // [ld] each row's position, -1 for padding: it sees no key
  int32_t* low = pos + ld;       // [ld] the key positions a row sees are above this
  tile_rows_bf16<D>(query, qs0, qs1, context, j0, rows, ld, G, window, pos, low, qp);
  std::fill(acc, acc + ld * D, 0.0f);
  std::fill(m, m + ld, -std::numeric_limits<float>::infinity());
  std::fill(l, l + ld, 0.0f);
#ifdef WEFT_AMX
  if constexpr (kAmx) weft_amx::configure();
#endif

  const int64_t first_key = window > 0 ? std::max<int64_t>(0, context + j0 - window + 1) : 0;
  const int64_t last_key = context + j1 - 1;
  for (int64_t base = first_key / block_size * block_size; base <= last_key; base += chunk) {
    const int64_t tokens = std::min(chunk, last_key + 1 - base);
    // Where the chunk's rows are read: the cache's blocks, or an int8 cache's staged rows (one block
    // of `chunk` rows, at 0).
    const uint16_t* kc = keys;
    const uint16_t* vc = values;
    const int32_t* bl = blocks;
    int64_t cb = base, cbs = block_size;
    if (i8 != nullptr) {
      thread_local std::vector<uint16_t> staged;
      staged.resize(2 * chunk * D);
      stage_bf16<D>(i8->keys, i8->rs.keys, blocks, base, tokens, block_size, staged.data());
      stage_bf16<D>(i8->values, i8->rs.values, blocks, base, tokens, block_size, staged.data() + chunk * D);
      static const int32_t kFirst = 0;
      kc = staged.data();
      vc = staged.data() + chunk * D;
      bl = &kFirst;
      cb = 0;
      cbs = chunk;
    }
    pack_values_bf16<D>(vc, bl, cb, tokens, cbs, vp);
    // Value tiles take whole groups of kAmxKeys: the pairs past the chunk's are zero.
    if constexpr (kAmx) std::fill(vp + (tokens + 1) / 2 * D, vp + kb / 2 * D, 0u);
    // Key t's row, the chunk's last one for t past it (a score pass takes kBfKeys keys; those
    // scores are never read).
    auto key_row = [&](int64_t t) {
      const int64_t p = cb + std::min(t, tokens - 1);
      return kc + static_cast<int64_t>(bl[p / cbs]) * cbs * D + p % cbs * D;
    };
    for (int64_t r0 = 0; r0 < rows; r0 += kBfBlockRows) {
      const int64_t n = std::min(kBfBlockRows, rows - r0);
      const int64_t nv = (n + 15) / 16;
      // Rows are in token order: the first sees the lowest keys, the last the highest.
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[r0] - window + 1 - base) : 0;
      const int64_t hi = std::min(tokens, pos[r0 + n - 1] + 1 - base);
      if (lo >= hi) continue;  // no row of the block sees this chunk: nothing changes
      const int64_t k0 = lo / kGroup * kGroup, tp1 = (hi + 1) / 2;
#ifdef WEFT_AMX
      if constexpr (kAmx) {
        // 16 keys a tile, from one block (the block size is a multiple of 16); those past hi are
        // later tokens or stale rows, and never read (every row's mask hides them).
        for (int64_t t = k0; t < hi; t += 16)
          score_tiles_amx<D>(key_row(t), qp + r0, ld, nv, s + t * kBfBlockRows, kBfBlockRows);
      }
#endif
      if constexpr (!kAmx) {
        for (int64_t t = k0; t < hi; t += kBfKeys) {
          const uint16_t* kr[kBfKeys];
          for (int i = 0; i < kBfKeys; ++i) kr[i] = key_row(t + i);
          float* st = s + t * kBfBlockRows;
          const uint32_t* q = qp + r0;
          if (nv == 3) score_keys_bf16<3, D>(kr, q, ld, scale, st, kBfBlockRows);
          else if (nv == 2) score_keys_bf16<2, D>(kr, q, ld, scale, st, kBfBlockRows);
          else score_keys_bf16<1, D>(kr, q, ld, scale, st, kBfBlockRows);
        }
      }
      for (int64_t v = 0; v < nv; ++v) {
        const int64_t r = r0 + v * 16;
        // The first row sees the fewest later keys, the last the fewest earlier ones.
        const bool full = r + 16 <= rows && pos[r] >= base + 2 * tp1 - 1 && low[r + 15] < base + k0;
        auto softmax = full ? softmax_rows_bf16<true, kAmx> : softmax_rows_bf16<false, kAmx>;
        softmax(s + v * 16, kBfBlockRows, k0 / 2, tp1, base, pos + r, low + r, m + r, l + r, alpha + r, pw + v * 16,
                kBfBlockRows, scale);
      }
#ifdef WEFT_AMX
      if constexpr (kAmx) {
        const int64_t gp1 = (tp1 + 15) / 16 * 16;  // whole value tiles; k0 / 2 is a multiple of 16
        std::fill(pw + tp1 * kBfBlockRows, pw + gp1 * kBfBlockRows, 0u);
        values_amx<D>(nv, pw, vp, k0 / 2, gp1, alpha + r0, acc + r0 * D, pr, kb / 2);
      }
#endif
      if constexpr (!kAmx) values_bf16<D>(n, pw, kBfBlockRows, vp, k0 / 2, tp1, alpha + r0, acc + r0 * D);
    }
  }
#ifdef WEFT_AMX
  if constexpr (kAmx) _tile_release();
#endif
  for (int64_t j = j0; j < j1; ++j)
    write_heads(acc + (j - j0) * G * D, l + (j - j0) * G, G, D, out + j * os0, os1);
}

#endif  // WEFT_BF16_DOT

template <typename scalar_t, typename cache_t, int kC>
void prefill_all(const at::Tensor& query, const at::Tensor& kv_cache, const int64_t* starts, const int32_t* qlens,
                 const int32_t* ctx, const int32_t* table, int64_t R, int64_t max_blocks, double scale, at::Tensor& out,
                 int64_t window, const std::optional<at::Tensor>& kv_scales) {
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t KVH = kv_cache.size(1), num_cache_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  const int64_t G = H / KVH;
  const int64_t head_blocks = num_cache_blocks * block_size * D;
  const int64_t tile = std::max<int64_t>(1, kMaxRows / G);
  std::vector<PrefillItem> items;
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j0 = 0; j0 < qlens[i]; j0 += tile) {
      const int64_t j1 = std::min<int64_t>(qlens[i], j0 + tile);
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx[i] + j0 - window + 1) : 0;
      for (int64_t h = 0; h < KVH; ++h) items.push_back({i, h, j0, j1, ctx[i] + j1 - first});
    }
  std::stable_sort(items.begin(), items.end(),
                   [](const PrefillItem& a, const PrefillItem& b) { return a.cost > b.cost; });
  const scalar_t* q = query.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const cache_t* cache = kv_cache.data_ptr<cache_t>();
  [[maybe_unused]] const bool bf16_dot = bf16_dot_enabled();
  [[maybe_unused]] const bool amx_on = amx_enabled();  // read (and a bad value refused) on every build
#ifdef WEFT_AMX
  // AMX tiles read 16 keys from one block: block sizes of a multiple of 16 (an int8 cache's staged
  // chunk is then one block of whole cache blocks), head sizes of a multiple of 64.
  const bool amx = bf16_dot && amx_on && block_size % 16 == 0 && kC * kW % 64 == 0 && weft_amx::permitted();
#endif
  for_each_claimed(static_cast<int64_t>(items.size()), [&](int64_t k, std::vector<float>& buf) {
    const PrefillItem& it = items[k];
    const int64_t first_head = it.head * G * query.stride(1);
#ifdef WEFT_BF16_DOT
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> &&
                  (std::is_same_v<cache_t, c10::BFloat16> || std::is_same_v<cache_t, int8_t>) &&
                  (kC == 8 || kC == 16 || kC == 32)) {
      if (bf16_dot) {  // the bits of the bf16s, as the intrinsics take them
        const uint16_t* q16 = reinterpret_cast<const uint16_t*>(q);
        const uint16_t *k16 = nullptr, *v16 = nullptr;
        Int8Rows i8{};
        if constexpr (std::is_same_v<cache_t, int8_t>) {
          i8 = {cache + it.head * head_blocks, cache + (KVH + it.head) * head_blocks, head_scales(kv_scales, it.head)};
        } else {
          k16 = reinterpret_cast<const uint16_t*>(cache + it.head * head_blocks);
          v16 = reinterpret_cast<const uint16_t*>(cache + (KVH + it.head) * head_blocks);
        }
        auto item = prefill_item_bf16<kC * kW>;
#ifdef WEFT_AMX
        if constexpr (kC * kW % 64 == 0) {
          if (amx) item = prefill_item_bf16<kC * kW, true>;
        }
#endif
        item(q16 + starts[it.seq] * query.stride(0) + first_head, query.stride(0),
                                   query.stride(1), o + starts[it.seq] * out.stride(0) + it.head * G * out.stride(1),
                                   out.stride(0), out.stride(1), k16, v16, table + it.seq * max_blocks, ctx[it.seq],
                                   it.j0, it.j1, block_size, G, static_cast<float>(scale), window, buf,
                                   std::is_same_v<cache_t, int8_t> ? &i8 : nullptr);
        return;
      }
    }
#endif
    prefill_item<scalar_t, cache_t, kC>(
        q + starts[it.seq] * query.stride(0) + first_head, query.stride(0), query.stride(1),
        o + starts[it.seq] * out.stride(0) + it.head * G * out.stride(1), out.stride(0), out.stride(1),
        cache + it.head * head_blocks, cache + (KVH + it.head) * head_blocks, head_scales(kv_scales, it.head),
        table + it.seq * max_blocks, ctx[it.seq], it.j0, it.j1, block_size, D, G, static_cast<float>(scale), window,
        buf);
  });
}

void check_prefills(const int64_t* starts, const int32_t* qlens, const int32_t* ctx, const int32_t* table, int64_t R,
                    int64_t max_blocks, int64_t num_tokens, int64_t num_cache_blocks, int64_t block_size,
                    int64_t window) {
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK_VALUE(qlens[i] >= 1 && ctx[i] >= 0, "query_lens must be positive and context_lens non-negative.");
    TORCH_CHECK_VALUE(starts[i] >= 0 && starts[i] + qlens[i] <= num_tokens, "query_start + query_lens must lie in [0, ",
                      num_tokens, "].");
    const int64_t seq_len = static_cast<int64_t>(ctx[i]) + qlens[i];
    TORCH_CHECK_VALUE(seq_len <= max_blocks * block_size, "context_lens + query_lens must be at most ",
                      max_blocks * block_size, " (block_table columns x block size), got ", seq_len, ".");
    const int64_t first = window > 0 ? std::max<int64_t>(0, ctx[i] - window + 1) : 0;
    for (int64_t b = first / block_size; b * block_size < seq_len; ++b) {
      const int32_t id = table[i * max_blocks + b];
      TORCH_CHECK_VALUE(id >= 0 && id < num_cache_blocks, "block_table entries in use must lie in [0, ",
                        num_cache_blocks, ").");
    }
  }
}

void paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& query_start,
                             const at::Tensor& query_lens, const at::Tensor& context_lens,
                             const at::Tensor& block_table, double scale, at::Tensor out, int64_t window,
                             const std::optional<at::Tensor>& kv_scales) {
  const char* op = "paged_prefill_attention";
  check_layouts(op, query, kv_cache, out);
  check_scales(op, kv_cache, kv_scales);
  check_index(op, "query_start", query_start, at::kLong, 1);
  check_index(op, "query_lens", query_lens, at::kInt, 1);
  check_index(op, "context_lens", context_lens, at::kInt, 1);
  check_index(op, "block_table", block_table, at::kInt, 2);
  const int64_t R = query_start.size(0);
  TORCH_CHECK_VALUE(query_lens.size(0) == R && context_lens.size(0) == R && block_table.size(0) == R, op,
                    ": query_start, query_lens, context_lens and block_table need one entry (row) per sequence");
  TORCH_CHECK_VALUE(window >= 0, "window must be 0 (full attention) or positive, got ", window, ".");
  if (R == 0) return;
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int32_t* qlens = query_lens.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1);
  check_prefills(starts, qlens, ctx, table, R, max_blocks, query.size(0), kv_cache.size(2), kv_cache.size(3), window);
  dispatch_query_and_cache(op, query, kv_cache, [&](auto tag, auto cache_tag) {
    using scalar_t = decltype(tag);
    using cache_t = decltype(cache_tag);
    dispatch_head_dim(query.size(2), [&](auto chunks) {
      prefill_all<scalar_t, cache_t, decltype(chunks)::value>(query, kv_cache, starts, qlens, ctx, table, R,
                                                               max_blocks, scale, out, window, kv_scales);
    });
  });
}

// ------------------------------------------------------------ int8 cache writes
//
// Each (token, KV head) row x of D values becomes D int8 and one fp32 scale,
// in fp32 arithmetic, each step one correctly rounded operation:
//   amax  = max |x|                     (exact)
//   scale = amax / 127
//   inv   = min(127 / amax, FLT_MAX)    (a zero row's 127 / 0 = inf, or a tiny
//                                        amax's overflow, becomes finite)
//   q     = clamp(nearbyint(x * inv), -127, 127)   (round half to even)
// A zero row gets scale 0 and zeros; a row holding a NaN or an infinity gets a
// NaN scale (and zeros), so that attention over it is NaN rather than finite
// and wrong. kernels.reference.quantize_kv_rows_ref is the bit-exact twin.
template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t D, int8_t* q, float* scale) {
  float amax = 0.0f, poison = 0.0f;  // poison: 0, or NaN when some x is not finite (x * 0)
#pragma omp simd reduction(max : amax) reduction(+ : poison)
  for (int64_t d = 0; d < D; ++d) {
    const float v = static_cast<float>(x[d]);
    amax = std::max(amax, std::fabs(v));
    poison += v * 0.0f;
  }
  if (poison != 0.0f) {
    std::memset(q, 0, D);
    *scale = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float inv = std::min(127.0f / amax, FLT_MAX);
  for (int64_t d = 0; d < D; ++d)
    q[d] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(x[d]) * inv), -127.0f, 127.0f));
  *scale = amax / 127.0f;
}

#ifdef WEFT_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// quantize_row 16 lanes at a time, for D a multiple of 16: the same operations, so the same bits
// (the max of |x| is exact in any order; vrndscaleps rounds half to even), in half quantize_row's
// time (2,048 tokens x 3 KV heads x 64, one thread: 176 against 358 us).
template <typename scalar_t>
void quantize_row16(const scalar_t* x, int64_t D, int8_t* q, float* scale) {
  __m512 amax = _mm512_setzero_ps(), poison = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 v = load16(x + d);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    poison = _mm512_add_ps(poison, _mm512_mul_ps(v, _mm512_setzero_ps()));
  }
  if (_mm512_reduce_add_ps(poison) != 0.0f) {
    std::memset(q, 0, D);
    *scale = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float a = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(std::min(127.0f / a, FLT_MAX));
  for (int64_t d = 0; d < D; d += 16) {
    __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(load16(x + d), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + d), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
  }
  *scale = a / 127.0f;
}
#endif

void write_kv_int8(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, at::Tensor kv_scales,
                   const at::Tensor& slot_mapping) {
  const char* op = "write_kv_int8";
  TORCH_CHECK_VALUE(key.dim() == 3 && value.sizes() == key.sizes() && value.scalar_type() == key.scalar_type(), op,
                    ": key and value must be [T, KVH, D] of one dtype");
  TORCH_CHECK_VALUE(kv_cache.scalar_type() == at::kChar && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                        kv_cache.is_contiguous(),
                    op, ": kv_cache must be a contiguous int8 tensor [2, KVH, num_blocks, block_size, D]");
  TORCH_CHECK_VALUE(kv_cache.size(1) == key.size(1) && kv_cache.size(4) == key.size(2), op,
                    ": key and value [T, KVH, D] must match kv_cache's KV heads and head size");
  check_scales(op, kv_cache, kv_scales);
  TORCH_CHECK_VALUE(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu(), op,
                    ": CPU tensors expected");
  TORCH_CHECK_VALUE(key.stride(2) == 1 && value.stride(2) == 1, op,
                    ": key and value must be contiguous in the head dimension");
  check_index(op, "slot_mapping", slot_mapping, at::kLong, 1);
  const int64_t T = key.size(0), KVH = key.size(1), D = key.size(2);
  TORCH_CHECK_VALUE(slot_mapping.size(0) == T, op, ": slot_mapping needs one entry per token");
  const int64_t slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_VALUE(slot[t] < slots, "slot_mapping entries must be below num_blocks x block_size = ", slots,
                      " (negative: skip the token), got ", slot[t], ".");
  int8_t* cache = kv_cache.data_ptr<int8_t>();
  float* scales = kv_scales.data_ptr<float>();
  dispatch_dtype(op, key.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* k = key.data_ptr<scalar_t>();
    const scalar_t* v = value.data_ptr<scalar_t>();
    // About 16K elements per task: a decode step's few tokens stay on one thread.
    const int64_t grain = std::max<int64_t>(1, 16384 / (KVH * D));
    auto quantize = quantize_row<scalar_t>;
#ifdef WEFT_AVX512
    if (D % 16 == 0) quantize = quantize_row16<scalar_t>;
#endif
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (slot[t] < 0) continue;
        for (int64_t h = 0; h < KVH; ++h) {
          const int64_t kr = h * slots + slot[t], vr = (KVH + h) * slots + slot[t];  // rows of [2 * KVH, slots]
          quantize(k + t * key.stride(0) + h * key.stride(1), D, cache + kr * D, scales + kr);
          quantize(v + t * value.stride(0) + h * value.stride(1), D, cache + vr * D, scales + vr);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY(weft_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor kv_cache, Tensor token_idx, Tensor seq_lens, "
      "Tensor block_table, float scale, Tensor(a!) out, int window=0, Tensor? kv_scales=None) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
  m.def(
      "paged_prefill_attention(Tensor query, Tensor kv_cache, Tensor query_start, Tensor query_lens, "
      "Tensor context_lens, Tensor block_table, float scale, Tensor(a!) out, int window=0, Tensor? kv_scales=None) "
      "-> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
  m.def(
      "write_kv_int8(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor(b!) kv_scales, Tensor slot_mapping) "
      "-> ()");
  m.impl("write_kv_int8", c10::DispatchKey::CPU, &write_kv_int8);
}
