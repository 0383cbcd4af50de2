// Linear layers over weights kept packed in 8 or 4 bits (GGUF files), for CPUs.
//
// Two packed layouts, repacked at load from the GGUF block formats
// (services/worker/layers/quantized_linear.py says which format goes where):
//   int8  qweight [N, K] int8, scales [N, K / G] fp32:          w = q * s
//   int4  qweight [N, K / 2] uint8, scales and mins [N, K / 32] fp32:
//         w = q * s + m, q in [0, 16); in each group of 32, byte j holds
//         element j in its low nibble and element j + 16 in its high one.
// Every product q * s is exact in fp32 for the GGUF formats, so the weights
// this code rebuilds equal the gguf package's dequantization bit for bit;
// results differ from a float matmul only in the order of the sums.
//
// quant_linear (few rows of x, the decode case): a tile of kTileRows weight
// rows is dequantized into a buffer that stays in L1, then every row of x is
// dotted with it, two rows of x at a time. The weights are read from memory
// once per call, packed, which is what makes batch-1 decode faster than over
// fp32 weights: it is bound by the bytes of weights read.
// dequantize_rows (many rows of x): the caller turns a chunk of rows back
// into fp32 and runs a float GEMM on it.
//
// Built for AVX2 + FMA (kernels/cpu_quant_linear.py); the scalar loops are
// the other targets' path and the tails'.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define WEFT_AVX2 1
#endif

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

// One weight row of the int4 layout, dequantized into out[K].
void dequant_row_int4(const uint8_t* q, const float* scales, const float* mins, int64_t K, float* out) {
  for (int64_t g = 0; g < K / kInt4Group; ++g) {
    const uint8_t* qg = q + g * (kInt4Group / 2);
    float* og = out + g * kInt4Group;
#ifdef WEFT_AVX2
    const __m256 s = _mm256_set1_ps(scales[g]);
    const __m256 m = _mm256_set1_ps(mins[g]);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int p = 0; p < 4; ++p) {
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]));
      _mm256_storeu_ps(og + 8 * p, _mm256_fmadd_ps(v, s, m));
    }
#else
    for (int64_t j = 0; j < kInt4Group / 2; ++j) {
      og[j] = static_cast<float>(qg[j] & 0x0F) * scales[g] + mins[g];
      og[j + kInt4Group / 2] = static_cast<float>(qg[j] >> 4) * scales[g] + mins[g];
    }
#endif
  }
}

struct Packed {
  const uint8_t* qweight;
  int64_t row_bytes;  // bytes of qweight per row
  const float* scales;
  const float* mins;  // null for the int8 layout
  int64_t groups;     // groups per row
  int64_t group;
  int64_t K;

  void dequant_row(int64_t n, float* out) const {
    const float* s = scales + n * groups;
    if (mins == nullptr) {
      dequant_row_int8(reinterpret_cast<const int8_t*>(qweight + n * row_bytes), s, K, group, out);
    } else {
      dequant_row_int4(qweight + n * row_bytes, s, mins + n * groups, K, out);
    }
  }
};

#ifdef WEFT_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
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

Packed packed_of(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                 int64_t group_size, int64_t K) {
  const bool int4 = mins.has_value();
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kFloat,
              "quant_linear: contiguous qweight and fp32 scales expected");
  TORCH_CHECK(qweight.scalar_type() == (int4 ? at::kByte : at::kChar), "quant_linear: qweight must be ",
              int4 ? "uint8 (int4 layout)" : "int8 (int8 layout)");
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && K % group_size == 0 && (!int4 || group_size == kInt4Group),
              "quant_linear: group_size must divide K and be a multiple of 16 (32 for int4)");
  const int64_t N = qweight.size(0), groups = K / group_size;
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) == (int4 ? K / 2 : K), "quant_linear: qweight shape");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == groups, "quant_linear: scales shape");
  if (int4) {
    TORCH_CHECK(mins->is_contiguous() && mins->scalar_type() == at::kFloat && mins->sizes() == scales.sizes(),
                "quant_linear: mins must be fp32 and shaped like scales");
  }
  return Packed{static_cast<const uint8_t*>(qweight.data_ptr()), qweight.size(1), scales.data_ptr<float>(),
                int4 ? mins->data_ptr<float>() : nullptr, groups, group_size, K};
}

#ifdef WEFT_AVX2
// The 8 weights of part p (0..3) of a group of 32, dequantized in registers.
struct GroupInt4 {
  __m256 w[4];
  GroupInt4(const uint8_t* qg, float scale, float min) {
    const __m256 s = _mm256_set1_ps(scale), m = _mm256_set1_ps(min);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
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
  const float* s = w.scales + n * w.groups;
  const uint8_t* q = w.qweight + n * w.row_bytes;
  if (w.mins != nullptr) {
    const float* m = w.mins + n * w.groups;
    for (int64_t g = 0; g < w.groups; ++g) {
      const GroupInt4 grp(q + g * (kInt4Group / 2), s[g], m[g]);
      for (int r = 0; r < R; ++r) {
        const float* xg = x + r * ldx + g * kInt4Group;
        for (int p = 0; p < 4; ++p) acc[r][p] = _mm256_fmadd_ps(grp.w[p], _mm256_loadu_ps(xg + 8 * p), acc[r][p]);
      }
    }
  } else {
    const int8_t* q8 = reinterpret_cast<const int8_t*>(q);
    for (int64_t k = 0; k < w.K; k += 16) {
      const __m256 sv = _mm256_set1_ps(s[k / w.group]);  // groups are multiples of 16
      const __m256 w0 = int8x8(q8 + k, sv), w1 = int8x8(q8 + k + 8, sv);
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
                  const c10::optional<at::Tensor>& mins, int64_t group_size, at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "quant_linear: x must be fp32 [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  const Packed w = packed_of(qweight, scales, mins, group_size, K);
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
      for (int64_t r = 0; r < rows; ++r) w.dequant_row(n0 + r, buf.data() + r * K);
      dot_rows(xp, ldx, M, buf.data(), K, op + n0, ldo, rows);
    }
  });
}

// out [count, K] fp32 = rows [start, start + count) of the packed W.
void dequantize_rows(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                     int64_t group_size, int64_t start, at::Tensor out) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous(),
              "dequantize_rows: out must be contiguous fp32 [count, K]");
  const int64_t count = out.size(0), K = out.size(1);
  const Packed w = packed_of(qweight, scales, mins, group_size, K);
  TORCH_CHECK(start >= 0 && start + count <= qweight.size(0), "dequantize_rows: rows out of range");
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) w.dequant_row(start + i, op + i * K);
  });
}

}  // namespace

TORCH_LIBRARY(weft_quant, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int group_size, Tensor(a!) out) -> ()");
  m.def(
      "dequantize_rows(Tensor qweight, Tensor scales, Tensor? mins, int group_size, int start, Tensor(a!) out) -> ()");
  m.impl("quant_linear", c10::DispatchKey::CPU, &quant_linear);
  m.impl("dequantize_rows", c10::DispatchKey::CPU, &dequantize_rows);
}
