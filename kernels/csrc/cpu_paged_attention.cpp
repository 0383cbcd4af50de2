// Paged decode attention for CPUs: one new token per sequence, its keys and
// values read in place through the block table.
//
// The torch backend gathers every sequence's blocks into a padded tensor
// before SDPA; on CPU that copy costs more than the attention itself, since
// decode attention is bound by memory traffic. Here each key and value row
// is read once, straight from the cache.
//
// Layouts (those of services/worker/layers/attention.py):
//   query, out  [T, H, D], head dimension contiguous
//   kv_cache    [2, KVH, num_blocks, block_size, D], contiguous
//   token_idx   [n] int64: the row of query and out that decode i owns
//   seq_lens    [n] int32: keys of decode i, its new token's included
//   block_table [n, max_blocks] int32
//   window      > 0: a sliding-window layer; decode i attends to its last
//               `window` keys only, and blocks before them are never read
//               (the KV cache manager may have handed them to others)
//
// Work item (decode i, KV head h) computes the G = H / KVH query heads that
// read KV head h, so each key row is loaded once for all of them. Items are
// dealt to threads round-robin: neighbouring decodes often differ a lot in
// length, and one contiguous range per thread would leave threads idle.
// Arithmetic is fp32 whatever the cache dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// exp(x) for x <= 0 in a form the compiler vectorizes (no libm call):
// x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial
// (Cephes' expf coefficients), 2^n built in the exponent bits. Relative
// error about 2e-7; inputs below -87 give about 1e-38 instead of 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One (decode, KV head) item. kHeadDim > 0 fixes the head size at compile
// time (the common 64 and 128), so that one query head's accumulator lives
// in registers; 0 reads it from head_dim. Loops run block by block, and
// within a block head by head: the block's rows stay in L1 while each
// query head reads them.
// Blocks sit anywhere in the cache, so the hardware prefetcher cannot guess
// the next one; ask for it while the current one is processed.
template <typename scalar_t>
inline void prefetch_block(const scalar_t* block, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(block);
  const int64_t bytes = elems * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

template <typename scalar_t, int kHeadDim>
void decode_item(
    const scalar_t* __restrict__ query, int64_t q_stride_head,
    scalar_t* __restrict__ out, int64_t o_stride_head,
    const scalar_t* __restrict__ keys, const scalar_t* __restrict__ values,  // this KV head's blocks
    const int32_t* __restrict__ blocks, int64_t seq_len, int64_t block_size, int64_t head_dim,
    int64_t group, int64_t first_head, float scale, int64_t window, std::vector<float>& buf) {
  const int64_t D = kHeadDim > 0 ? kHeadDim : head_dim;
  const int64_t G = group;
  // Keys [start, seq_len) are attended; scores are indexed from start.
  const int64_t start = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
  const int64_t L = seq_len - start;
  const int64_t block_elems = block_size * D;
  const int64_t first_block = start / block_size;
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  buf.resize(G * D * 2 + G * L + G);
  float* __restrict__ qf = buf.data();         // [G, D] scaled queries
  float* __restrict__ acc = qf + G * D;        // [G, D] weighted value sums
  float* __restrict__ s = acc + G * D;         // [G, L] scores, then softmax numerators
  float* __restrict__ sums = s + G * L;        // [G]
  for (int64_t g = 0; g < G; ++g) {
    const scalar_t* q = query + (first_head + g) * q_stride_head;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(q[d]) * scale;
  }
  std::fill(acc, acc + G * D, 0.0f);

  for (int64_t b = first_block; b < num_blocks; ++b) {
    const scalar_t* __restrict__ kb = keys + static_cast<int64_t>(blocks[b]) * block_elems;
    const int64_t tokens = std::min(block_size, seq_len - b * block_size);
    const int64_t t0 = std::max<int64_t>(0, start - b * block_size);  // > 0 in the window's first block only
    if (b + 1 < num_blocks) prefetch_block(keys + static_cast<int64_t>(blocks[b + 1]) * block_elems, block_elems);
    for (int64_t g = 0; g < G; ++g) {
      const float* __restrict__ qg = qf + g * D;
      float* __restrict__ sg = s + g * L + (b * block_size + t0 - start);  // sg[t - t0]: key b * block_size + t
      for (int64_t t = t0; t < tokens; ++t) {
        const scalar_t* __restrict__ k = kb + t * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(k[d]);
        sg[t - t0] = dot;
      }
    }
  }

  for (int64_t g = 0; g < G; ++g) {
    float* __restrict__ sg = s + g * L;
    float m = sg[0];
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = exp_nonpositive(sg[t] - m);
      sum += sg[t];
    }
    sums[g] = sum;
  }

  for (int64_t b = first_block; b < num_blocks; ++b) {
    const scalar_t* __restrict__ vb = values + static_cast<int64_t>(blocks[b]) * block_elems;
    const int64_t tokens = std::min(block_size, seq_len - b * block_size);
    const int64_t t0 = std::max<int64_t>(0, start - b * block_size);
    if (b + 1 < num_blocks) prefetch_block(values + static_cast<int64_t>(blocks[b + 1]) * block_elems, block_elems);
    for (int64_t g = 0; g < G; ++g) {
      const float* __restrict__ pg = s + g * L + (b * block_size + t0 - start);
      float* __restrict__ ag = acc + g * D;
      if constexpr (kHeadDim > 0) {
        float a[kHeadDim];
        for (int64_t d = 0; d < kHeadDim; ++d) a[d] = ag[d];
        for (int64_t t = t0; t < tokens; ++t) {
          const scalar_t* __restrict__ v = vb + t * kHeadDim;
          const float p = pg[t - t0];
#pragma omp simd
          for (int64_t d = 0; d < kHeadDim; ++d) a[d] += p * static_cast<float>(v[d]);
        }
        for (int64_t d = 0; d < kHeadDim; ++d) ag[d] = a[d];
      } else {
        for (int64_t t = t0; t < tokens; ++t) {
          const scalar_t* __restrict__ v = vb + t * D;
          const float p = pg[t - t0];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<float>(v[d]);
        }
      }
    }
  }

  for (int64_t g = 0; g < G; ++g) {
    scalar_t* o = out + (first_head + g) * o_stride_head;
    const float inv = 1.0f / sums[g];
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[g * D + d] * inv);
  }
}

template <typename scalar_t>
void decode_all(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& token_idx,
                const at::Tensor& seq_lens, const at::Tensor& block_table, double scale, at::Tensor& out,
                int64_t window) {
  const int64_t n = token_idx.size(0);
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t KVH = kv_cache.size(1), num_cache_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  const int64_t G = H / KVH;
  const int64_t max_blocks = block_table.size(1);
  const int64_t head_blocks = num_cache_blocks * block_size * D;  // elements per (K or V, KV head)

  const scalar_t* q = query.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const scalar_t* cache = kv_cache.data_ptr<scalar_t>();
  const int64_t* rows = token_idx.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);

  const int64_t items = n * KVH;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t item = w; item < items; item += workers) {
        const int64_t i = item / KVH, h = item % KVH;
        const int64_t row = rows[i];
        auto run = [&](auto head_dim_tag) {
          constexpr int kHeadDim = decltype(head_dim_tag)::value;
          decode_item<scalar_t, kHeadDim>(
              q + row * qs0, qs1, o + row * os0, os1, cache + h * head_blocks, cache + (KVH + h) * head_blocks,
              table + i * max_blocks, lens[i], block_size, D, G, h * G, static_cast<float>(scale), window, buf);
        };
        if (D == 64) run(std::integral_constant<int, 64>{});
        else if (D == 128) run(std::integral_constant<int, 128>{});
        else run(std::integral_constant<int, 0>{});
      }
    }
  });
}

void paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& token_idx,
                            const at::Tensor& seq_lens, const at::Tensor& block_table, double scale,
                            at::Tensor out, int64_t window) {
  // Shapes, dtypes and bounds are checked by the Python wrapper
  // (kernels/cpu_attention.py); these guard the memory this code touches.
  TORCH_CHECK(query.device().is_cpu() && kv_cache.is_contiguous() && out.device().is_cpu(),
              "paged_decode_attention: CPU tensors and a contiguous kv_cache expected");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "paged_decode_attention: head dimension must be contiguous");
  TORCH_CHECK(token_idx.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kInt &&
                  block_table.scalar_type() == at::kInt && token_idx.is_contiguous() &&
                  seq_lens.is_contiguous() && block_table.is_contiguous(),
              "paged_decode_attention: token_idx int64, seq_lens and block_table int32, all contiguous");
  if (token_idx.size(0) == 0) return;
  switch (query.scalar_type()) {
    case at::kFloat: decode_all<float>(query, kv_cache, token_idx, seq_lens, block_table, scale, out, window); break;
    case at::kBFloat16:
      decode_all<c10::BFloat16>(query, kv_cache, token_idx, seq_lens, block_table, scale, out, window);
      break;
    case at::kHalf: decode_all<c10::Half>(query, kv_cache, token_idx, seq_lens, block_table, scale, out, window); break;
    default: TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16 expected");
  }
}

}  // namespace

TORCH_LIBRARY(weft_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor kv_cache, Tensor token_idx, Tensor seq_lens, "
      "Tensor block_table, float scale, Tensor(a!) out, int window=0) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
