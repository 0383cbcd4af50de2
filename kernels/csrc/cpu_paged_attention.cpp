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
// the kernel reads memory through them. The WEFT_ATTENTION_* switches above reach the kernel as
// arguments of its ops (kernels/cpu_attention.py reads them); the kernel reads no environment.
//
// Files: this one (the rules, the cache writes, the ops' registration); paged_attention.h
// (what decodes and prefills share: checks, dispatch, the register tiles of "one row's arithmetic");
// simd_math.h (vector types and loads, the exponentials); cpu_attention_decode.cpp and
// cpu_attention_prefill.cpp (the two kernels and their AVX-512 paths); amx_tiles.h (AMX set-up).

#include <torch/library.h>

#include "paged_attention.h"

namespace {

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

// The checks both cache writes make (cache_dtype: the cache's, int8 or the key's): key and value
// [T, KVH, D] of one dtype, contiguous in D, a contiguous cache [2, KVH, num_blocks, block_size, D]
// of theirs, every slot below num_blocks x block_size (a negative one skips its token).
void check_kv_write(const char* op, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                    at::ScalarType cache_dtype, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(key.dim() == 3 && value.sizes() == key.sizes() && value.scalar_type() == key.scalar_type(), op,
                    ": key and value must be [T, KVH, D] of one dtype");
  TORCH_CHECK_VALUE(kv_cache.scalar_type() == cache_dtype && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                        kv_cache.is_contiguous(),
                    op, ": kv_cache must be a contiguous ", cache_dtype == at::kChar ? "int8 tensor" : "tensor of the key's dtype",
                    " [2, KVH, num_blocks, block_size, D]");
  TORCH_CHECK_VALUE(kv_cache.size(1) == key.size(1) && kv_cache.size(4) == key.size(2), op,
                    ": key and value [T, KVH, D] must match kv_cache's KV heads and head size");
  TORCH_CHECK_VALUE(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu(), op,
                    ": CPU tensors expected");
  TORCH_CHECK_VALUE(key.stride(2) == 1 && value.stride(2) == 1, op,
                    ": key and value must be contiguous in the head dimension");
  check_index(op, "slot_mapping", slot_mapping, at::kLong, 1);
  TORCH_CHECK_VALUE(slot_mapping.size(0) == key.size(0), op, ": slot_mapping needs one entry per token");
  const int64_t slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK_VALUE(slot[t] < slots, "slot_mapping entries must be below num_blocks x block_size = ", slots,
                      " (negative: skip the token), got ", slot[t], ".");
}

// Token t's key and value rows copied into slot slot_mapping[t] of a float cache of their dtype
// (a negative slot skips the token): index_copy_'s result (kernels.reference.write_kv_ref) in one
// call for both, where the torch ops cost 11-12 us each at one token (Zen 1), twice a layer.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slot_mapping) {
  const char* op = "write_kv";
  dispatch_dtype(op, key.scalar_type(), [](auto) {});  // a float dtype
  check_kv_write(op, key, value, kv_cache, key.scalar_type(), slot_mapping);
  const int64_t T = key.size(0), KVH = key.size(1), D = key.size(2);
  const int64_t slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t elem = key.element_size(), bytes = D * elem;
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  // About 64 KiB per task: a decode step's few tokens stay on one thread.
  const int64_t grain = std::max<int64_t>(1, 65536 / (2 * KVH * bytes));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;
      for (int64_t h = 0; h < KVH; ++h) {
        const int64_t kr = h * slots + slot[t], vr = (KVH + h) * slots + slot[t];  // rows of [2 * KVH, slots]
        std::memcpy(cache + kr * bytes, k + (t * key.stride(0) + h * key.stride(1)) * elem, bytes);
        std::memcpy(cache + vr * bytes, v + (t * value.stride(0) + h * value.stride(1)) * elem, bytes);
      }
    }
  });
}

void write_kv_int8(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, at::Tensor kv_scales,
                   const at::Tensor& slot_mapping) {
  const char* op = "write_kv_int8";
  check_kv_write(op, key, value, kv_cache, at::kChar, slot_mapping);
  check_scales(op, kv_cache, kv_scales);
  const int64_t T = key.size(0), KVH = key.size(1), D = key.size(2);
  const int64_t slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
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

// The switches (bf16_dot, int8_fast, amx) come from kernels/cpu_attention.py, which reads them from
// the environment through services/env.py; their defaults here are those of the variables unset.
TORCH_LIBRARY(weft_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor kv_cache, Tensor token_idx, Tensor seq_lens, "
      "Tensor block_table, float scale, Tensor(a!) out, int window=0, Tensor? kv_scales=None, "
      "bool bf16_dot=False, bool int8_fast=True) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &weft_attention::paged_decode_attention);
  m.def(
      "paged_prefill_attention(Tensor query, Tensor kv_cache, Tensor query_start, Tensor query_lens, "
      "Tensor context_lens, Tensor block_table, float scale, Tensor(a!) out, int window=0, Tensor? kv_scales=None, "
      "bool bf16_dot=False, bool amx=True) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &weft_attention::paged_prefill_attention);
  m.def(
      "write_kv_int8(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor(b!) kv_scales, Tensor slot_mapping) "
      "-> ()");
  m.impl("write_kv_int8", c10::DispatchKey::CPU, &write_kv_int8);
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, &write_kv);
}
