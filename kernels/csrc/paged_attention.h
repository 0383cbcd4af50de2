// What the CPU attention kernel's decode and prefill files share (cpu_paged_attention.cpp heads
// the kernel with its rules): prefetching, the int8 rows' rounding, the argument checks and dtype
// dispatch, and the register tiles that compute one row's attention the same way in a decode and
// a prefill ("one row's arithmetic, decodes and prefills"), so that a row's output is the same
// bits in either. Internal to each file that includes it (an unnamed namespace), but for the entry
// points the files define and cpu_paged_attention.cpp registers.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include "simd_math.h"

namespace weft_attention {

// cpu_attention_decode.cpp. bf16_dot: run bf16 caches on bf16 dot products (AVX512_BF16 builds;
// not batch-invariant, so opt-in); int8_fast: run int8 caches on the AVX-512 decode path (where
// built). kernels/cpu_attention.py passes both (WEFT_ATTENTION_BF16_DOT, WEFT_ATTENTION_INT8_FAST).
void paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& token_idx,
                            const at::Tensor& seq_lens, const at::Tensor& block_table, double scale,
                            at::Tensor out, int64_t window, const std::optional<at::Tensor>& kv_scales,
                            bool bf16_dot, bool int8_fast);

// cpu_attention_prefill.cpp. bf16_dot as for decodes; amx: run the bf16 dot-product prefills on AMX
// tiles where built (else vdpbf16ps). kernels/cpu_attention.py passes both (WEFT_ATTENTION_BF16_DOT,
// WEFT_ATTENTION_AMX).
void paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& query_start,
                             const at::Tensor& query_lens, const at::Tensor& context_lens,
                             const at::Tensor& block_table, double scale, at::Tensor out, int64_t window,
                             const std::optional<at::Tensor>& kv_scales, bool bf16_dot, bool amx);

}  // namespace weft_attention

namespace {

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


// Where an int8 cache's scales sit: K's and V's, [num_blocks, block_size] each per KV head;
// null for float caches.
struct RowScales {
  const float* keys = nullptr;
  const float* values = nullptr;
};


// ------------------------------------------------------------ int8 rows
//
// (write_kv_int8, cpu_paged_attention.cpp, writes an int8 cache's rows with it; the int8 dot-product
// decodes round their queries with it.)
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

// The tiles' softmax is written in vectors (exp_approx on eight lanes): the omp simd loops of
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
  const float alpha = exp_approx(m - m_new);  // m = -inf on the first block: alpha ~ 0, acc is 0
  vf sum = {};
  for (int64_t c = c0; c < c1; c += kW) {
    vf p = exp_approx(loadu(s + c) - m_new);
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
// larger max. A segment the row saw no key of (l == 0) leaves it as it is. One compiled copy in each
// file (not inlined), so that every caller rounds alike: the decode and prefill files compile the
// same text with the same flags.
[[gnu::noinline]] void fold_rows(const float* m, const float* l, const float* acc, int64_t rows, int64_t D, float* M,
                                 float* L, float* A) {
  for (int64_t r = 0; r < rows; ++r) {
    if (l[r] == 0.0f) continue;
    const float m_new = std::max(M[r], m[r]);
    const float a = exp_approx(M[r] - m_new), w = exp_approx(m[r] - m_new);
    L[r] = L[r] * a + l[r] * w;
    for (int64_t d = 0; d < D; ++d) A[r * D + d] = A[r * D + d] * a + acc[r * D + d] * w;
    M[r] = m_new;
  }
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

}  // namespace
