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
//
// int8_linear is the whole layer in one call for fp32 x: its rows rotated and rounded as
// quantize_rows_int8 rounds them (int8_rows.h, the same code), the integer product, and each tile's
// sums scaled back into fp32 on their way out of the registers, (acc * row_scale) * col_scale as
// scale_int32 computes it: the numbers of the three kernels in a row, bit for bit, without two of
// the calls (a batch-1 decode step makes 121 of them; each cost about as much as the GEMM's work
// on the smaller matrices).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#define WEFT_AVX2 1
#include <immintrin.h>
#endif

#include "int8_rows.h"

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

// Where a tile's sums go: int32 into acc, or (with row_scale) scaled back into fp32 out. Pointers
// at the tile's first row and first output; row stride N.
struct TileOut {
  int32_t* acc = nullptr;
  float* out = nullptr;
  const float* row_scale = nullptr;  // set: fp32 out = (sum * row_scale[r]) * col_scale[n]
  const float* col_scale = nullptr;
};

// R rows of q (row stride K) times NB blocks of wp, into `to`.
template <int R, int NB>
void dot_tile(const int8_t* q, const int8_t* wp, const TileOut& to, int64_t K, int64_t N) {
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
  if (to.row_scale == nullptr) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to.acc + r * N + 8 * v), sum[r][v]);
    return;
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256 row = _mm256_set1_ps(to.row_scale[r]);
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(sum[r][v]), row);  // as scale_int32: (acc * r) * col
      _mm256_storeu_ps(to.out + r * N + 8 * v, _mm256_mul_ps(scaled, _mm256_loadu_ps(to.col_scale + 8 * v)));
    }
  }
}

using TileFn = void (*)(const int8_t*, const int8_t*, const TileOut&, int64_t, int64_t);

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

// to: the whole product's (its first row and output).
void int8_matmul_avx2(const int8_t* q, const int8_t* wp, const TileOut& to, int64_t M, int64_t N, int64_t K) {
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
          const int64_t first = m0 * N + b0 * 16;
          TileOut tile;
          if (to.row_scale == nullptr) {
            tile.acc = to.acc + first;
          } else {
            tile.out = to.out + first;
            tile.row_scale = to.row_scale + m0;
            tile.col_scale = to.col_scale + b0 * 16;
          }
          tile_for(r, nb)(q + m0 * K, strip, tile, K, N);
          m0 += r;
        }
      }
    }
  });
}

// Rows of x a thread rounds before a second one helps (a decode step's one row: in the caller's).
constexpr int64_t kRoundGrainRows = 16;

#endif  // WEFT_AVX2

void check_packed(const at::Tensor& wp, int64_t K, const char* op) {
  TORCH_CHECK_VALUE(wp.dim() == 4 && wp.scalar_type() == at::kChar && wp.is_contiguous() && wp.device().is_cpu(),
                    op, ": the packed weight must be a contiguous int8 CPU tensor [N / 16, K / 4, 16, 4].");
  TORCH_CHECK_VALUE(K % 4 == 0 && K > 0, op, " needs in_features % 4 == 0, got ", K, ".");
  TORCH_CHECK_VALUE(wp.size(1) * 4 == K && wp.size(2) == 16 && wp.size(3) == 4, op,
                    ": the packed weight must be [N / 16, ", K / 4, ", 16, 4] for ", K, " columns.");
}

void int8_matmul(const at::Tensor& q, const at::Tensor& wp, at::Tensor& acc) {
  TORCH_CHECK(available(), "int8_matmul needs AVX2 and the kernel's AVX2 build.");
  TORCH_CHECK_VALUE(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && q.device().is_cpu(),
                    "int8_matmul: q must be a contiguous int8 CPU tensor [M, K].");
  TORCH_CHECK_VALUE(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous() && acc.device().is_cpu(),
                    "int8_matmul: acc must be a contiguous int32 CPU tensor [M, N].");
  const int64_t M = q.size(0), K = q.size(1), N = wp.size(0) * 16;
  check_packed(wp, K, "int8_matmul");
  TORCH_CHECK_VALUE(acc.size(0) == M && acc.size(1) == N, "acc must be [", M, ", ", N, "].");
  if (M == 0 || N == 0) return;
#ifdef WEFT_AVX2
  TileOut to;
  to.acc = acc.data_ptr<int32_t>();
  int8_matmul_avx2(q.data_ptr<int8_t>(), wp.data_ptr<int8_t>(), to, M, N, K);
#endif
}

// out [M, N] fp32 = x [M, K] fp32 (rows contiguous, any row stride) rotated in blocks of
// hadamard_block (0: not rotated) and rounded to int8 per row, times W, scaled back by the row's
// scale and col_scale [N] (W's row scales).
void int8_linear(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& col_scale, int64_t hadamard_block,
                 at::Tensor& out) {
  TORCH_CHECK(available(), "int8_linear needs AVX2 and the kernel's AVX2 build.");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() &&
                        (x.size(1) <= 1 || x.stride(1) == 1),
                    "int8_linear: x must be a float32 CPU tensor [M, K] with contiguous rows.");
  const int64_t M = x.size(0), K = x.size(1), N = wp.size(0) * 16;
  check_packed(wp, K, "int8_linear");
  TORCH_CHECK_VALUE(hadamard_block == 0 || ((hadamard_block == 4 || hadamard_block == 16 || hadamard_block == 64) &&
                                            K % hadamard_block == 0),
                    "int8_linear: hadamard_block must be 0, or 4, 16 or 64 dividing K (", K, "), got ",
                    hadamard_block, ".");
  TORCH_CHECK_VALUE(col_scale.dim() == 1 && col_scale.size(0) == N && col_scale.scalar_type() == at::kFloat &&
                        col_scale.is_contiguous() && col_scale.device().is_cpu(),
                    "int8_linear: col_scale must be a contiguous float32 CPU tensor [", N, "].");
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.scalar_type() == at::kFloat &&
                        out.is_contiguous() && out.device().is_cpu(),
                    "int8_linear: out must be a contiguous float32 CPU tensor [", M, ", ", N, "].");
  if (M == 0 || N == 0) return;
#ifdef WEFT_AVX2
  std::vector<int8_t> q(M * K);
  std::vector<float> row_scale(M);
  const float* xp = x.data_ptr<float>();
  const int64_t sx = x.stride(0);
  at::parallel_for(0, M, kRoundGrainRows, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(K);
    for (int64_t i = begin; i < end; ++i)
      quantize_row(xp + i * sx, K, hadamard_block, scratch.data(), q.data() + i * K, row_scale.data() + i);
  });
  TileOut to;
  to.out = out.data_ptr<float>();
  to.row_scale = row_scale.data();
  to.col_scale = col_scale.data_ptr<float>();
  int8_matmul_avx2(q.data(), wp.data_ptr<int8_t>(), to, M, N, K);
#endif
}

}  // namespace

TORCH_LIBRARY(weft_avx2_int8, m) {
  m.def("int8_matmul(Tensor q, Tensor packed_weight, Tensor(a!) acc) -> ()");
  m.def("int8_linear(Tensor x, Tensor packed_weight, Tensor col_scale, int hadamard_block, Tensor(a!) out) -> ()");
  m.def("available() -> bool", &available);
  m.impl("int8_matmul", c10::DispatchKey::CPU, &int8_matmul);
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
}
