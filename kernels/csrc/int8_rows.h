// Rounding one row of activations to int8 for an integer GEMM, shared by the kernels that do it
// (cpu_fused.cpp's quantize_rows_int8 and the MLP's fused pass, cpu_avx2_int8.cpp's one-call
// linear): scale = amax(row) / 127, q = round(x / scale), optionally after an orthonormal
// Walsh-Hadamard rotation of the row in blocks of 4, 16 or 64. Every build gives the same bits as
// the torch twins (kernels.reference.quantize_rows_int8_ref), so a row rounds alike whichever
// kernel rounds it. Written for -O3 with AVX2 + FMA or AVX-512 (the rotation of 64-element blocks
// in registers there), plain loops elsewhere.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Independent partial sums (or maxima) a reduction keeps: without fast-math the compiler may not
// reorder one float sum, so a loop over kLanes of them is what it vectorizes.
constexpr int64_t kLanes = 16;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Max of |row[0, n)| in fp32, kLanes partial maxima; NaN where the row holds a NaN
// or an infinity (v - v is 0 for every finite v, NaN otherwise).
template <typename T>
inline float abs_max(const T* row, int64_t n) {
  float lanes[kLanes] = {0.0f};
  float poison[kLanes] = {0.0f};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      float v = to_float(row[j + l]);
      lanes[l] = std::max(lanes[l], std::fabs(v));
      poison[l] += v - v;
    }
  }
  float best = 0.0f, bad = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) {
    best = std::max(best, lanes[l]);
    bad += poison[l];
  }
  for (; j < n; ++j) {
    float v = to_float(row[j]);
    best = std::max(best, std::fabs(v));
    bad += v - v;
  }
  return bad == 0.0f ? best : std::numeric_limits<float>::quiet_NaN();
}

// row[0, n) = src[0, n) in fp32, times `norm` (a power of two: exact).
template <typename T>
inline void widen_row(float* row, const T* src, int64_t n, float norm) {
  int64_t j = 0;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256 s = _mm256_set1_ps(norm);
    for (; j + 8 <= n; j += 8) {
      __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
      __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
      _mm256_storeu_ps(row + j, _mm256_mul_ps(v, s));
    }
  }
#endif
  for (; j < n; ++j) row[j] = to_float(src[j]) * norm;
}

// q[0, n) = round(row[0, n) * inv), ties to even (as torch.round), |values| <= 127.
inline void round_row(int8_t* q, const float* row, int64_t n, float inv) {
  int64_t j = 0;
#if defined(__AVX2__)
  // cvtps rounds in the default mode, to nearest even; the packs saturate (nothing to
  // saturate here) and interleave 128-bit lanes, which the permute puts back in order.
  const __m256 s = _mm256_set1_ps(inv);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (; j + 32 <= n; j += 32) {
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + j), s));
    __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + j + 8), s));
    __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + j + 16), s));
    __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + j + 24), s));
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j), _mm256_permutevar8x32_epi32(bytes, order));
  }
#endif
  // nearbyint: no add follows the product for the compiler to fuse into an FMA.
  for (; j < n; ++j) q[j] = static_cast<int8_t>(static_cast<int32_t>(std::nearbyint(row[j] * inv)));
}

// The rotation: an orthonormal Walsh-Hadamard transform over each block of `block`
// consecutive elements (4, 16 or 64), in place. Stage h (1, 2, 4, ...) replaces each pair
// (a, c) = (row[i], row[i + h]), i with bit h clear, by (a + c, a - c); the row comes scaled by
// 1 / sqrt(block) already (widen_row), so the transform is orthonormal. The twin
// (kernels.reference.hadamard_rows_ref) does the same adds in the same order: bit for bit.
inline void hadamard_blocks_scalar(float* row, int64_t n, int64_t block) {
  for (int64_t base = 0; base < n; base += block)
    for (int64_t h = 1; h < block; h *= 2)
      for (int64_t g = base; g < base + block; g += 2 * h)
        for (int64_t i = g; i < g + h; ++i) {
          const float a = row[i], c = row[i + h];
          row[i] = a + c;
          row[i + h] = a - c;
        }
}

// Stages h >= lanes of a block held in registers v[0, kN): across registers, pairs (r, r + h / lanes).
template <typename V, int kN, typename Add, typename Sub>
inline void stages_across(V (&v)[kN], Add add, Sub sub) {
  for (int h = 1; h < kN; h *= 2)
    for (int g = 0; g < kN; g += 2 * h)
      for (int r = g; r < g + h; ++r) {
        const V a = v[r], c = v[r + h];
        v[r] = add(a, c);
        v[r + h] = sub(a, c);
      }
}

#if defined(__AVX512F__)
// Stage h < 16 inside one 16-float vector: each lane adds its partner's value (lane i ^ h) to
// its own times +1 (bit h clear: a + c) or -1 (set: a - c). The product by +-1 is exact, so
// the fused add rounds once, as the twin's add or subtract does.
template <int kH>
inline __m512 stage_in_vector(__m512 v) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __mmask16 high = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(kH));
  const __m512 sign = _mm512_mask_blend_ps(high, _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f));
  __m512 partner;
  if constexpr (kH == 1) partner = _mm512_permute_ps(v, 0xB1);        // 1 0 3 2
  else if constexpr (kH == 2) partner = _mm512_permute_ps(v, 0x4E);   // 2 3 0 1
  else if constexpr (kH == 4) partner = _mm512_shuffle_f32x4(v, v, 0xB1);  // 128-bit lanes 1 0 3 2
  else partner = _mm512_shuffle_f32x4(v, v, 0x4E);                    // 128-bit lanes 2 3 0 1
  return _mm512_fmadd_ps(v, sign, partner);
}

inline __m512 rotate16(__m512 v) {
  return stage_in_vector<8>(stage_in_vector<4>(stage_in_vector<2>(stage_in_vector<1>(v))));
}

// A 64-element block in four registers: stages 1-8 within each, 16 and 32 across them.
inline void hadamard64(__m512 (&v)[4]) {
  for (auto& r : v) r = rotate16(r);
  stages_across(v, [](__m512 a, __m512 c) { return _mm512_add_ps(a, c); },
                [](__m512 a, __m512 c) { return _mm512_sub_ps(a, c); });
}

template <typename T>
inline __m512 load16_scaled(const T* src, __m512 norm) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)), norm);
  } else {
    return _mm512_mul_ps(_mm512_loadu_ps(src), norm);
  }
}

// row[0, n) = the rotated src (n a multiple of 64) in one pass, each block in registers; returns
// the row's amax, NaN where it holds a NaN or infinity (as abs_max).
// The amax is an integer max over the magnitudes' bits: for floats of one sign the integer
// order is theirs, with infinity above every finite value and NaN above infinity.
template <typename T>
inline float rotate64_row(float* row, const T* src, int64_t n, float norm) {
  const __m512 s = _mm512_set1_ps(norm);
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  __m512i best = _mm512_setzero_si512();
  for (int64_t j = 0; j < n; j += 64) {
    __m512 v[4];
    for (int k = 0; k < 4; ++k) v[k] = load16_scaled(src + j + 16 * k, s);
    hadamard64(v);
    for (int k = 0; k < 4; ++k) {
      _mm512_storeu_ps(row + j + 16 * k, v[k]);
      best = _mm512_max_epi32(best, _mm512_and_si512(_mm512_castps_si512(v[k]), magnitude));
    }
  }
  const int32_t bits = _mm512_reduce_max_epi32(best);
  if (bits >= 0x7f800000) return std::numeric_limits<float>::quiet_NaN();  // a NaN or infinity
  float amax;
  std::memcpy(&amax, &bits, sizeof(amax));
  return amax;
}

// q[0, n) = round(row[0, n) * inv) for n a multiple of 16 (round_row, 16 at a time).
inline void round_row16(int8_t* q, const float* row, int64_t n, float inv) {
  const __m512 s = _mm512_set1_ps(inv);
  for (int64_t j = 0; j < n; j += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + j), s))));
}
#elif defined(__AVX2__)
// The same with eight-float registers: stages 1-4 within each, 8-32 across eight of them.
template <int kH>
inline __m256 stage_in_vector(__m256 v) {
  const __m256 sign = kH == 1   ? _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1)
                      : kH == 2 ? _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1)
                                : _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
  __m256 partner;
  if constexpr (kH == 1) partner = _mm256_permute_ps(v, 0xB1);
  else if constexpr (kH == 2) partner = _mm256_permute_ps(v, 0x4E);
  else partner = _mm256_permute2f128_ps(v, v, 0x01);
  return _mm256_fmadd_ps(v, sign, partner);
}

template <typename T>
inline __m256 load8_scaled(const T* src, __m256 norm) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)), norm);
  } else {
    return _mm256_mul_ps(_mm256_loadu_ps(src), norm);
  }
}

template <typename T>
inline float rotate64_row(float* row, const T* src, int64_t n, float norm) {
  const __m256 s = _mm256_set1_ps(norm), magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 best = _mm256_setzero_ps(), poison = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 64) {
    __m256 v[8];
    for (int k = 0; k < 8; ++k) v[k] = stage_in_vector<4>(stage_in_vector<2>(stage_in_vector<1>(
                                    load8_scaled(src + j + 8 * k, s))));
    stages_across(v, [](__m256 a, __m256 c) { return _mm256_add_ps(a, c); },
                  [](__m256 a, __m256 c) { return _mm256_sub_ps(a, c); });
    for (int k = 0; k < 8; ++k) {
      _mm256_storeu_ps(row + j + 8 * k, v[k]);
      best = _mm256_max_ps(best, _mm256_and_ps(v[k], magnitude));
      poison = _mm256_add_ps(poison, _mm256_sub_ps(v[k], v[k]));
    }
  }
  float lanes[8], bad[8];
  _mm256_storeu_ps(lanes, best);
  _mm256_storeu_ps(bad, poison);
  float amax = 0.0f, sum = 0.0f;
  for (int l = 0; l < 8; ++l) {
    amax = std::max(amax, lanes[l]);
    sum += bad[l];
  }
  return sum == 0.0f ? amax : std::numeric_limits<float>::quiet_NaN();
}
#endif

// One row: src[0, n) rotated (block > 1) and rounded, its scale into *scale; row is n floats of
// scratch. 1 / sqrt(block) is a power of two for the block sizes allowed (4^k): exact.
template <typename T>
inline void quantize_row(const T* src, int64_t n, int64_t block, float* row, int8_t* q, float* scale) {
  const float norm = block > 1 ? 1.0f / std::sqrt(static_cast<float>(block)) : 1.0f;
  float amax;
#if defined(__AVX2__)
  if (block == 64) {
    amax = rotate64_row(row, src, n, norm);
  } else
#endif
  {
    widen_row(row, src, n, norm);
    if (block > 1) hadamard_blocks_scalar(row, n, block);
    amax = abs_max(row, n);
  }
  const float d = amax / 127.0f;
  *scale = d;
  if (!std::isfinite(d)) {  // NaN scale, zero integers: the product comes out NaN
    std::memset(q, 0, n);
    return;
  }
  const float inv = d > 0.0f ? 1.0f / d : 0.0f;
#if defined(__AVX512F__)
  if (block == 64) return round_row16(q, row, n, inv);
#endif
  round_row(q, row, n, inv);
}

}  // namespace
