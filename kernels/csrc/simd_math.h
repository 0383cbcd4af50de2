// Vector arithmetic shared by the CPU attention kernel's files (cpu_paged_attention.cpp,
// cpu_attention_decode.cpp, cpu_attention_prefill.cpp): which instruction sets the build has
// (WEFT_AVX512, WEFT_BF16_DOT, WEFT_AMX), eight-float GCC vectors and their loads, and the
// exponential, written once for every width: exp_approx (a float, eight lanes or sixteen; every
// softmax of the kernel, and the SiLU of cpu_fused.cpp, which includes this header too), beside
// exp16_weight, the bf16 paths' lower-order one, whose result is rounded to bf16 right after.
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

#ifdef WEFT_AVX512
inline __m512 fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
#endif

// p * 2^n for an integral n in [-126, 127], 2^n built in the exponent bits (exact: the product
// rounds only where it falls below 2^-126). n = 128 gives inf, larger n garbage: callers clamp x.
// A float, eight lanes, or sixteen (AVX-512 builds).
inline float times_pow2(float p, float n) {
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline vf times_pow2(vf p, vf n) {
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#ifdef WEFT_AVX512
// vscalefps: one instruction, and the same bits as the exponent-bits product (both round p * 2^n
// once, and exp_approx's results are normal numbers, exact).
inline __m512 times_pow2(__m512 p, __m512 n) { return _mm512_scalef_ps(p, n); }
#endif

// The one exponential of the kernels (every softmax of the attention kernel, and cpu_fused.cpp's
// SiLU), written once for a float, eight lanes (vf) and sixteen (__m512, AVX-512 builds): no libm
// call, so the loops around it vectorize. x = n ln2 + r with |r| <= ln2 / 2 and exp(x) = 2^n exp(r):
// n rounded from the unrounded x log2(e) (one FMA, then the shifter 1.5 * 2^23, whose addition rounds
// to an integer); ln2 in two parts (kLn2Hi has few bits, so n * kLn2Hi is exact for the n that occur;
// ln2 = kLn2Hi - kLn2Lo); exp(r) by Cephes' expf polynomial (degree 6, highest power first:
// exp(r) = 1 + r + r^2 (kExpPoly[5] + r (kExpPoly[4] + ...))); 2^n by times_pow2. Every step is
// the same operation on every width, each FMA written out (the compiler's contraction fused a plain
// expression's pairs and not the intrinsics', which is how the 8- and 16-lane copies this replaced
// came to round apart), so a lane rounds as a float does, on every path of every build.
// Relative error about 2e-7 for x in [-87, 88]; below -87 (and -inf) the result is about 1e-38,
// not 0; a NaN stays NaN; x above 88 must be clamped by the caller (the softmaxes' x is <= 0).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = 2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

template <typename V>
inline V exp_approx(V x) {
  const V one = V{} + 1.0f;  // a constant on every width (V{} + c broadcasts c to the lanes)
  const V shifter = V{} + 12582912.0f;
  x = x < V{} - 87.0f ? V{} - 87.0f : x;  // not std::max, whose vector forms turn a NaN into -87
  const V n = fmadd(x, V{} + kLog2e, shifter) - shifter;
  V r = fmadd(n, V{} - kLn2Hi, x);  // x - n kLn2Hi
  r = fmadd(n, V{} + kLn2Lo, r);
  V p = V{} + kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = fmadd(p, r, V{} + kExpPoly[i]);
  p = fmadd(p * r, r, r) + one;
  return times_pow2(p, n);
}

#ifdef WEFT_AVX512
inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// exp(x) for the weights of the bf16 dot-product prefills, which are rounded to bf16 (relative step
// 2^-9) right after: not exp_approx on purpose, but a degree-4
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
