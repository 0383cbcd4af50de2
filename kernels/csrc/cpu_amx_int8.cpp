// The integer product of an int8 linear layer on AMX int8 tiles: acc = q W^T, exact in int32.
//
// The int8 dense copy (services/worker/layers/int8_linear.py) rounds x's rows and W's rows to int8
// and scales the integer product back. At a decode step's few rows that product is a read of W:
// oneDNN's int8 matmul read it at about a third of the machine's read bandwidth there, no faster
// than its bf16 GEMM reads twice the bytes. This kernel streams W at close to the bandwidth:
//   q    [M, K] int8, contiguous (x's rows, rotated and rounded), K % 64 == 0
//   wp   [N / 16, K / 4, 16, 4] int8: W [N, K] in the tiles' B layout, packed once (pack_weight):
//        for each block of 16 rows of W, word p of each row, 16 words to a 64-byte line
//   acc  [M16, N] int32, contiguous, M16 = M rounded up to a multiple of 16: its first M rows are
//        the integers torch._int_mm(q, W.t()) gives (the rest scratch)
// A tile's A operand is 16 rows of q, 64 of their K (row stride K), read as they are (a last group
// of fewer than 16 rows is copied into a zero-padded scratch first); its B operand is 16 of a
// block's words, 1 KiB at consecutive addresses; a C tile is acc's 16 x 16 block, stored in place.
// Threads split W's blocks; long steps (prefills) go through q in chunks of rows that stay in
// cache while a thread's share of W passes over them.
//
// Linux grants the tile state on request (weft_amx::permitted); available() says whether it did.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define WEFT_AMX 1
#include "amx_tiles.h"
#endif

namespace {

bool available() {
#ifdef WEFT_AMX
  return weft_amx::permitted();
#else
  return false;
#endif
}

#ifdef WEFT_AMX

// Rows of q a chunk holds: 256 rows of the widest K here (1,536) are 384 KiB, within a core's L2
// beside its share of a layer's weight.
constexpr int64_t kChunkRows = 256;

// Tile numbers are literals (GCC's intrinsics paste them into the instruction), so each count of
// row groups has its own body. For MT (1 or 2) groups of 16 rows of q and nb blocks of W (MT 1:
// up to 3, C tiles 0-2 for blocks 0-2; MT 2: up to 2, C tiles 0, 1 for group 0's blocks and 2, 3
// for group 1's), the other tiles hold q's and W's operands, each loaded tile used by nb or MT
// products. ldc: acc's row stride in bytes.
#define WEFT_Q(t, m) _tile_loadd(t, q + (m) * 16 * K + kb * 64, K)
#define WEFT_W(t, n) _tile_loadd(t, wp + (n) * 16 * K + kb * 1024, 64)

template <int MT>
void dot_blocks(const int8_t* q, const int8_t* wp, int64_t K, int nb, int32_t* c, int64_t ldc) {
  _tile_zero(0);
  if (MT == 2 || nb > 2) _tile_zero(2);
  if (nb > 1) _tile_zero(1);
  if (MT == 2 && nb > 1) _tile_zero(3);
  for (int64_t kb = 0; kb < K / 64; ++kb) {
    if constexpr (MT == 1) {  // q: tile 4; W: 5-7
      WEFT_Q(4, 0);
      WEFT_W(5, 0);
      _tile_dpbssd(0, 4, 5);
      if (nb > 1) {
        WEFT_W(6, 1);
        _tile_dpbssd(1, 4, 6);
      }
      if (nb > 2) {
        WEFT_W(7, 2);
        _tile_dpbssd(2, 4, 7);
      }
    } else {  // q: 4, 5; W: 6, 7
      WEFT_Q(4, 0);
      WEFT_Q(5, 1);
      WEFT_W(6, 0);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(2, 5, 6);
      if (nb > 1) {
        WEFT_W(7, 1);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(3, 5, 7);
      }
    }
  }
  const int64_t down = 16 * ldc / 4;
  _tile_stored(0, c, ldc);
  if (MT == 1) {
    if (nb > 1) _tile_stored(1, c + 16, ldc);
    if (nb > 2) _tile_stored(2, c + 32, ldc);
  } else {
    _tile_stored(2, c + down, ldc);
    if (nb > 1) {
      _tile_stored(1, c + 16, ldc);
      _tile_stored(3, c + down + 16, ldc);
    }
  }
}

#undef WEFT_Q
#undef WEFT_W

void int8_matmul_amx(const int8_t* q_in, const int8_t* wp, int32_t* acc, int64_t M, int64_t N, int64_t K) {
  const int64_t groups_of_rows = (M + 15) / 16;
  // A last group of fewer than 16 rows goes through a zero-padded copy of q.
  std::vector<int8_t> padded;
  const int8_t* q = q_in;
  if (M % 16 != 0) {
    padded.assign(groups_of_rows * 16 * K, 0);
    std::copy(q_in, q_in + M * K, padded.begin());
    q = padded.data();
  }
  // One group of rows: three W blocks share its q tile. More: two blocks, and two groups of rows a
  // pass; the passes after the first over the same blocks read W from cache.
  const int per_group = groups_of_rows == 1 ? 3 : 2;
  const int64_t blocks = N / 16, groups = (blocks + per_group - 1) / per_group;
  const int64_t chunk_groups = kChunkRows / 16, ldc = N * 4;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    weft_amx::configure();
    for (int64_t chunk = 0; chunk < groups_of_rows; chunk += chunk_groups) {
      const int64_t chunk_end = std::min(groups_of_rows, chunk + chunk_groups);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t b0 = g * per_group;
        const int nb = static_cast<int>(std::min<int64_t>(per_group, blocks - b0));
        const int8_t* wb = wp + b0 * 16 * K;
        for (int64_t m0 = chunk; m0 < chunk_end; m0 += 2) {
          int32_t* c = acc + m0 * 16 * N + b0 * 16;
          if (chunk_end - m0 == 1)
            dot_blocks<1>(q + m0 * 16 * K, wb, K, nb, c, ldc);
          else
            dot_blocks<2>(q + m0 * 16 * K, wb, K, nb, c, ldc);
        }
      }
    }
    _tile_release();
  });
}

#endif  // WEFT_AMX

void int8_matmul(const at::Tensor& q, const at::Tensor& wp, at::Tensor& acc) {
  TORCH_CHECK(available(), "int8_matmul needs AMX tiles (amx_tile, amx_int8) and the kernel's AMX build.");
  TORCH_CHECK_VALUE(q.dim() == 2 && wp.dim() == 4 && acc.dim() == 2,
                    "q must be [M, K], the packed weight [N / 16, K / 4, 16, 4] and acc [M16, N].");
  for (const at::Tensor* t : {&q, &wp})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kChar && t->is_contiguous() && t->device().is_cpu(),
                      "q and the packed weight must be contiguous int8 CPU tensors.");
  TORCH_CHECK_VALUE(acc.scalar_type() == at::kInt && acc.is_contiguous() && acc.device().is_cpu(),
                    "acc must be a contiguous int32 CPU tensor.");
  const int64_t M = q.size(0), K = q.size(1), N = wp.size(0) * 16;
  TORCH_CHECK_VALUE(K % 64 == 0 && K > 0, "int8_matmul needs in_features % 64 == 0, got ", K, ".");
  TORCH_CHECK_VALUE(wp.size(1) * 4 == K && wp.size(2) == 16 && wp.size(3) == 4,
                    "the packed weight must be [N / 16, ", K / 4, ", 16, 4] for q's ", K, " columns.");
  const int64_t rows = (M + 15) / 16 * 16;
  TORCH_CHECK_VALUE(acc.size(0) == rows && acc.size(1) == N, "acc must be [", rows, ", ", N, "].");
  if (M == 0 || N == 0) return;
#ifdef WEFT_AMX
  int8_matmul_amx(q.data_ptr<int8_t>(), wp.data_ptr<int8_t>(), acc.data_ptr<int32_t>(), M, N, K);
#endif
}

}  // namespace

TORCH_LIBRARY(weft_amx_int8, m) {
  m.def("int8_matmul(Tensor q, Tensor packed_weight, Tensor(a!) acc) -> ()");
  m.def("available() -> bool", &available);
  m.impl("int8_matmul", c10::DispatchKey::CPU, &int8_matmul);
}
