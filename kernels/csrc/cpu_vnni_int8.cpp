// The integer product of an int8 linear layer on AVX-512 VNNI: acc = q W^T, exact in int32.
//
// The int8 dense copy (services/worker/layers/int8_linear.py) rounds x's rows and W's rows to int8
// and scales the integer product back. torch._int_mm's GEMM reads W well below the machine's read
// bandwidth at a decode step's few rows; this kernel streams it:
//   q     [M, K] int8, contiguous (x's rows, rotated and rounded), K % 4 == 0
//   wp    [N / 16, K / 4, 16, 4] int8: W [N, K] packed once (kernels.cpu_amx_int8.pack_weight, the
//         same layout as the AMX tiles' B operand): for each block of 16 rows of W, word p (columns
//         4p .. 4p + 3) of each of its rows, one 64-byte vector a word
//   bias  [N] int32: -128 * (the sum of each row of W), made once with the packing
//   acc   [M, N] int32, contiguous: the integers torch._int_mm(q, W.t()) gives
// vpdpbusd multiplies unsigned bytes by signed ones, so q's bytes go in with their sign bit flipped
// (q + 128, in 0 .. 255) and each sum starts at bias: (q + 128) . w - 128 * sum(w) = q . w, exactly
// (|q . w| < 2^31 for any K below 2^17).
// For each word p, one vector of a W block times one row's word broadcast adds 16 outputs' products.
// A register tile holds R rows x NB blocks of sums (up to 6 x 4 = 24 of the 32 vector registers);
// a thread walks its share of W's blocks in strips of NB, and for each strip every tile of rows
// (as even in size as 6 allows) over the whole of K, so the strip (NB * 16 * K bytes) is read from
// memory once and from cache for the other row tiles. (Passes over 64 words of K at a time, to
// keep a strip's part in L1, measured slower.) Long steps go through q in chunks of rows that
// stay in L2.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WEFT_VNNI 1
#include <immintrin.h>
#endif

namespace {

bool available() {
#ifdef WEFT_VNNI
  return true;
#else
  return false;
#endif
}

#ifdef WEFT_VNNI

constexpr int kMaxRows = 6;    // rows of a register tile
constexpr int kMaxBlocks = 4;  // W blocks (16 outputs each) of a register tile
// Rows of q a chunk holds: 192 rows of the widest K here (1,536), 288 KiB, stay in a core's L2
// beside a strip of W.
constexpr int64_t kChunkRows = 192;

// R rows of qu (q with flipped sign bits, row stride K) times NB blocks of wp, into acc (row
// stride N, at the tile's first output).
template <int R, int NB>
void dot_tile(const uint8_t* qu, const int8_t* wp, const int32_t* bias, int32_t* acc, int64_t K, int64_t N) {
  __m512i sum[R][NB];
#pragma GCC unroll 8
  for (int b = 0; b < NB; ++b) {
    const __m512i start = _mm512_loadu_si512(bias + 16 * b);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sum[r][b] = start;
  }
  const int64_t words = K / 4, block = 16 * K;  // a block's bytes
  for (int64_t p = 0; p < words; ++p) {
    __m512i w[NB];
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) w[b] = _mm512_loadu_si512(wp + b * block + p * 64);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t word;
      __builtin_memcpy(&word, qu + r * K + 4 * p, 4);
      const __m512i x = _mm512_set1_epi32(word);
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) sum[r][b] = _mm512_dpbusd_epi32(sum[r][b], x, w[b]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) _mm512_storeu_si512(acc + r * N + 16 * b, sum[r][b]);
}

using TileFn = void (*)(const uint8_t*, const int8_t*, const int32_t*, int32_t*, int64_t, int64_t);

template <int R>
constexpr TileFn tile_for_blocks(int nb) {
  return nb == 1 ? &dot_tile<R, 1> : nb == 2 ? &dot_tile<R, 2> : nb == 3 ? &dot_tile<R, 3> : &dot_tile<R, 4>;
}

TileFn tile_for(int rows, int nb) {
  switch (rows) {
    case 1: return tile_for_blocks<1>(nb);
    case 2: return tile_for_blocks<2>(nb);
    case 3: return tile_for_blocks<3>(nb);
    case 4: return tile_for_blocks<4>(nb);
    case 5: return tile_for_blocks<5>(nb);
    default: return tile_for_blocks<6>(nb);
  }
}

void int8_matmul_vnni(const int8_t* q, const int8_t* wp, const int32_t* bias, int32_t* acc, int64_t M,
                      int64_t N, int64_t K) {
  // q's bytes + 128 (the sign bit flipped), once for every thread to read.
  std::unique_ptr<uint8_t[]> flipped(new uint8_t[M * K]);
  uint8_t* qu = flipped.get();
  at::parallel_for(0, M * K, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) qu[i] = static_cast<uint8_t>(q[i]) ^ 0x80;
  });
  const int64_t blocks = N / 16;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = 0; chunk < M; chunk += kChunkRows) {
      // The chunk's rows in tiles of as even a size as kMaxRows allows (32 rows: 6, 6, 5, 5, 5, 5).
      const int64_t rows = std::min(kChunkRows, M - chunk);
      const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows, base = rows / tiles, longer = rows % tiles;
      for (int64_t b0 = begin; b0 < end; b0 += kMaxBlocks) {
        const int nb = static_cast<int>(std::min<int64_t>(kMaxBlocks, end - b0));
        const int8_t* strip = wp + b0 * 16 * K;
        int64_t m0 = chunk;
        for (int64_t t = 0; t < tiles; ++t) {
          const int r = static_cast<int>(base + (t < longer));
          tile_for(r, nb)(qu + m0 * K, strip, bias + b0 * 16, acc + m0 * N + b0 * 16, K, N);
          m0 += r;
        }
      }
    }
  });
}

#endif  // WEFT_VNNI

void int8_matmul(const at::Tensor& q, const at::Tensor& wp, const at::Tensor& bias, at::Tensor& acc) {
  TORCH_CHECK(available(), "int8_matmul needs AVX-512 VNNI and the kernel's VNNI build.");
  TORCH_CHECK_VALUE(q.dim() == 2 && wp.dim() == 4 && bias.dim() == 1 && acc.dim() == 2,
                    "q must be [M, K], the packed weight [N / 16, K / 4, 16, 4], bias [N] and acc [M, N].");
  for (const at::Tensor* t : {&q, &wp})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kChar && t->is_contiguous() && t->device().is_cpu(),
                      "q and the packed weight must be contiguous int8 CPU tensors.");
  for (const at::Tensor* t : {&bias, static_cast<const at::Tensor*>(&acc)})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                      "bias and acc must be contiguous int32 CPU tensors.");
  const int64_t M = q.size(0), K = q.size(1), N = wp.size(0) * 16;
  TORCH_CHECK_VALUE(K % 4 == 0 && K > 0, "int8_matmul needs in_features % 4 == 0, got ", K, ".");
  TORCH_CHECK_VALUE(wp.size(1) * 4 == K && wp.size(2) == 16 && wp.size(3) == 4,
                    "the packed weight must be [N / 16, ", K / 4, ", 16, 4] for q's ", K, " columns.");
  TORCH_CHECK_VALUE(bias.size(0) == N, "bias must be [", N, "], got [", bias.size(0), "].");
  TORCH_CHECK_VALUE(acc.size(0) == M && acc.size(1) == N, "acc must be [", M, ", ", N, "].");
  if (M == 0 || N == 0) return;
#ifdef WEFT_VNNI
  int8_matmul_vnni(q.data_ptr<int8_t>(), wp.data_ptr<int8_t>(), bias.data_ptr<int32_t>(),
                   acc.data_ptr<int32_t>(), M, N, K);
#endif
}

}  // namespace

TORCH_LIBRARY(weft_vnni_int8, m) {
  m.def("int8_matmul(Tensor q, Tensor packed_weight, Tensor bias, Tensor(a!) acc) -> ()");
  m.def("available() -> bool", &available);
  m.impl("int8_matmul", c10::DispatchKey::CPU, &int8_matmul);
}
