// Vector arithmetic shared by the CPU attention kernel's files (cpu_paged_attention.cpp,
// cpu_attention_decode.cpp, cpu_attention_prefill.cpp): which instruction sets the build has
// (WEFT_AVX512, WEFT_BF16_DOT, WEFT_AMX), eight-float GCC vectors and their loads, and the
// exponentials of the softmaxes, each written once: exp_nonpositive (a float or eight lanes, the
// register tiles' softmax), exp16_nonpositive (sixteen lanes, the AVX-512 paths) and exp16_weight
// (the bf16 paths' cheaper one, whose result is rounded to bf16 right after).
//
// Everything here is internal to the translation unit that includes it (an unnamed namespace): one
// copy per file, compiled alike, as when the kernel was one file.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

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
#endif

namespace {

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

// The exponential of every softmax here, x = n ln2 + r with |r| <= ln2 / 2 and exp(x) = 2^n exp(r):
// ln2 in two parts (kLn2Hi has few bits, so n * kLn2Hi is exact for the n that occur; ln2 =
// kLn2Hi - kLn2Lo) and Cephes' expf polynomial for exp(r), highest power first (exp(r) = 1 + r +
// r^2 (kExpPoly[5] + r (kExpPoly[4] + ...))). One set of constants for each width below.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = 2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

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
  const T n = (x * kLog2e + shifter) - shifter;
  T r = x - n * kLn2Hi;
  r = r + n * kLn2Lo;
  T p = T{} + kExpPoly[0];
  p = p * r + kExpPoly[1];
  p = p * r + kExpPoly[2];
  p = p * r + kExpPoly[3];
  p = p * r + kExpPoly[4];
  p = p * r + kExpPoly[5];
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

#ifdef WEFT_AVX512
// exp_nonpositive on 16 lanes (the same polynomial); 2^n by vscalefps.
inline __m512 exp16_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// exp(x) for the weights, which are rounded to bf16 (relative step 2^-9) right after: a degree-4
// polynomial on |r| <= ln2 / 2 (Taylor, relative error 4e-5) and a one-step reduction, no clamp (x
// is finite, and vscalefps takes 2^n to 0 for n below the range). 10 operations against 15: 4-5%
// off a bf16 prefill (512 and 2,048 fresh tokens, one thread, interleaved).
inline __m512 exp16_weight(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.69314718055994531f), x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 24), r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif  // WEFT_AVX512

}  // namespace
