// The integer product of an int8 linear layer on AVX2 (no VNNI): acc = q W^T, exact in int32.
//
// The int8 dense copy (services/worker/layers/int8_linear.py) rounds x's rows and W's rows to int8
// and scales the integer product back. Where the CPU has AVX2 alone, torch._int_mm runs a scalar
// loop (about 3 GMAC/s on two cores) and the fp32 GEMM reaches about 80: this kernel brings the
// int8 copy to the CPU's byte dot products.
//   q     [M, K] int8, contiguous (x's rows, rotated and rounded), K % 4 == 0
//   wp    [N / 16, K / 4, 16, 4] int8, every byte in [-127, 127]: W [N, K] packed once
//         (kernels.cpu_amx_int8.pack_weight, the layout the AMX and VNNI kernels read): for each
//         block of 16 rows of W, word p (columns 4p .. 4p + 3) of each of its rows, 64 bytes
//   acc   [M, N] int32, contiguous: the integers torch._int_mm(q, W.t()) gives
// AVX2 multiplies bytes only in vpmaddubsw: unsigned times signed, each pair of products summed
// into an int16 with saturation. So each product goes in as |x| times w with x's sign on it
// (vpsignb): |x| <= 128 and |w| <= 127 keep a pair's sum within 2 * 128 * 127 = 32,512, below
// int16's limit, so nothing saturates and the sums are exact (w = -128 would flip to itself,
// hence the weight's range; q may hold any int8). vpmaddwd by ones then sums two pairs into an
// int32 lane: 4 operations for 32 products, where vpdpbusd takes one.
// For each word p, a row's word broadcast times the two vectors of a W block (8 outputs each)
// adds 16 outputs' products. A register tile holds R rows x NB blocks of sums (up to 4 x 1, 2 x 2
// or 1 x 4: 8 of the 16 vector registers); a thread walks its share of W's blocks in strips of NB,
// and for each strip every tile of rows over the whole of K, so the strip is read from memory once
// and from cache for the other row tiles. Long steps go through q in chunks of rows that stay in
// L2.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__)
#define WEFT_AVX2 1
#include <immintrin.h>
#endif

namespace {

bool available() {
#ifdef WEFT_AVX2
  return true;
#else
  return false;
#endif
}

#ifdef WEFT_AVX2

constexpr int kMaxRows = 4;  // rows of a register tile
// Rows of q a chunk holds: 192 rows of the widest K here (1,536), 288 KiB, stay in a core's L2
// beside a strip of W.
constexpr int64_t kChunkRows = 192;
// Words of K each block's stream is asked for ahead of its loads (1 KiB): a step of a few rows
// reads W at 30-32 GB/s with it, 27-29 without (all 121 matrices of the default model, 2 threads,
// 1-2 rows; the read bandwidth is about 39 GB/s).
constexpr int64_t kPrefetchWords = 16;

// R rows of q (row stride K) times NB blocks of wp, into acc (row stride N, at the tile's first
// output).
template <int R, int NB>
void dot_tile(const int8_t* q, const int8_t* wp, int32_t* acc, int64_t K, int64_t N) {
  constexpr int V = 2 * NB;  // vectors of 8 outputs
  __m256i sum[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) sum[r][v] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t words = K / 4, block = 16 * K;  // a block's bytes
  for (int64_t p = 0; p < words; ++p) {
    __m256i w[V];
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b)  // (past a block's end: the next one's, or nothing; prefetches never fault)
      _mm_prefetch(reinterpret_cast<const char*>(wp + b * block + (p + kPrefetchWords) * 64), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v)
      w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (v / 2) * block + p * 64 + 32 * (v % 2)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t word;
      __builtin_memcpy(&word, q + r * K + 4 * p, 4);
      const __m256i x = _mm256_set1_epi32(word);
      const __m256i magnitude = _mm256_abs_epi8(x);  // -128 becomes 128, as an unsigned byte
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w[v], x));
        sum[r][v] = _mm256_add_epi32(sum[r][v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * N + 8 * v), sum[r][v]);
}

using TileFn = void (*)(const int8_t*, const int8_t*, int32_t*, int64_t, int64_t);

// Strips of four blocks for one row (a batch-1 decode step: four streams of W in flight read it at
// 34-38 GB/s, against 29-30 with two and one), two for two rows, one block for three or four.
TileFn tile_for(int rows, int nb) {
  switch (rows) {
    case 1: return nb == 1 ? &dot_tile<1, 1> : nb == 2 ? &dot_tile<1, 2> : nb == 3 ? &dot_tile<1, 3> : &dot_tile<1, 4>;
    case 2: return nb == 1 ? &dot_tile<2, 1> : &dot_tile<2, 2>;
    case 3: return &dot_tile<3, 1>;
    default: return &dot_tile<4, 1>;
  }
}

void int8_matmul_avx2(const int8_t* q, const int8_t* wp, int32_t* acc, int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = N / 16;
  // Strips of two blocks where every tile has at most two rows.
  const int64_t strip_blocks = M == 1 ? 4 : M <= 2 ? 2 : 1;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = 0; chunk < M; chunk += kChunkRows) {
      // The chunk's rows in tiles of as even a size as kMaxRows allows (10 rows: 4, 3, 3).
      const int64_t rows = std::min(kChunkRows, M - chunk);
      const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows, base = rows / tiles, longer = rows % tiles;
      for (int64_t b0 = begin; b0 < end; b0 += strip_blocks) {
        const int nb = static_cast<int>(std::min<int64_t>(strip_blocks, end - b0));
        const int8_t* strip = wp + b0 * 16 * K;
        int64_t m0 = chunk;
        for (int64_t t = 0; t < tiles; ++t) {
          const int r = static_cast<int>(base + (t < longer));
          tile_for(r, nb)(q + m0 * K, strip, acc + m0 * N + b0 * 16, K, N);
          m0 += r;
        }
      }
    }
  });
}

#endif  // WEFT_AVX2

void int8_matmul(const at::Tensor& q, const at::Tensor& wp, at::Tensor& acc) {
  TORCH_CHECK(available(), "int8_matmul needs AVX2 and the kernel's AVX2 build.");
  TORCH_CHECK_VALUE(q.dim() == 2 && wp.dim() == 4 && acc.dim() == 2,
                    "q must be [M, K], the packed weight [N / 16, K / 4, 16, 4] and acc [M, N].");
  for (const at::Tensor* t : {&q, &wp})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kChar && t->is_contiguous() && t->device().is_cpu(),
                      "q and the packed weight must be contiguous int8 CPU tensors.");
  TORCH_CHECK_VALUE(acc.scalar_type() == at::kInt && acc.is_contiguous() && acc.device().is_cpu(),
                    "acc must be a contiguous int32 CPU tensor.");
  const int64_t M = q.size(0), K = q.size(1), N = wp.size(0) * 16;
  TORCH_CHECK_VALUE(K % 4 == 0 && K > 0, "int8_matmul needs in_features % 4 == 0, got ", K, ".");
  TORCH_CHECK_VALUE(wp.size(1) * 4 == K && wp.size(2) == 16 && wp.size(3) == 4,
                    "the packed weight must be [N / 16, ", K / 4, ", 16, 4] for q's ", K, " columns.");
  TORCH_CHECK_VALUE(acc.size(0) == M && acc.size(1) == N, "acc must be [", M, ", ", N, "].");
  if (M == 0 || N == 0) return;
#ifdef WEFT_AVX2
  int8_matmul_avx2(q.data_ptr<int8_t>(), wp.data_ptr<int8_t>(), acc.data_ptr<int32_t>(), M, N, K);
#endif
}

}  // namespace

TORCH_LIBRARY(weft_avx2_int8, m) {
  m.def("int8_matmul(Tensor q, Tensor packed_weight, Tensor(a!) acc) -> ()");
  m.def("available() -> bool", &available);
  m.impl("int8_matmul", c10::DispatchKey::CPU, &int8_matmul);
}
