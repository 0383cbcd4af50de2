// Fused element-wise kernels for CPUs: the small ops of a Llama layer, each
// one pass over the activations instead of several torch ops.
//
//   fused_add_rms_norm  residual = x + residual; x = norm(residual) * weight
//                       (both in place, vLLM's semantic: no new tensors)
//   rms_norm            out = norm(x) * weight
//   silu_and_mul        out = silu(gate) * up for x = [gate | up]
//   rotary_neox         query and key rotated in place, neox style
//   quantize_rows_int8  scale = amax(row) / 127, q = round(x / scale), optionally after
//                       an orthonormal Walsh-Hadamard rotation of the row
//   scale_int32         out = acc * row_scale * col_scale (+ bias): an integer
//                       GEMM's result back to the activation dtype (int32, or the
//                       fp32 that oneDNN's int8 GEMM writes, integers all the same)
//   scale_silu_quantize_int8  the three in one pass for the MLP: the gate/up GEMM's int32
//                       result scaled back, silu(gate) * up, rounded for the down GEMM
//
// Rows may be strided (a row stride, the last dimension contiguous): q, k and
// v are views of one projection. Arithmetic is fp32 whatever the dtype, with
// values rounded to the activation dtype where the torch path rounds them
// (the new residual, and the normalized row before the weight multiplies it),
// so bf16 results round as the torch twins' do.
//
// Loops are written for the compiler to vectorize (-O3 -mavx2 -mfma): the
// reductions keep kLanes independent partial sums, since without fast-math
// the compiler may not reorder one float sum.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "int8_rows.h"
#include "simd_math.h"

namespace {

// Elements a thread should have before a second one helps: below this the
// thread hand-off costs more than the work (one decode row is 576 floats).
constexpr int64_t kGrainElements = 32768;

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// exp(x) of SiLU's -g, which may be positive: simd_math.h's exp_approx (every width alike, so the
// AVX2, AVX-512 and scalar loops agree), clamped above at 88 as well (exp(88) ~ 1.7e38: silu ~ 0).
template <typename V>
inline V exp_clamped(V x) {
  return exp_approx(x > V{} + 88.0f ? V{} + 88.0f : x);
}

inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

// Sum of squares of row[0, n) in fp32, kLanes partial sums.
template <typename T>
inline float sum_of_squares(const T* row, int64_t n) {
  float lanes[kLanes] = {0.0f};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      float v = to_float(row[j + l]);
      lanes[l] += v * v;
    }
  }
  float total = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) total += lanes[l];
  for (; j < n; ++j) {
    float v = to_float(row[j]);
    total += v * v;
  }
  return total;
}

// dst[j] = round(round(src[j] * rstd) * weight[j]), Hugging Face's order.
template <typename T>
inline void scale_row(T* dst, const T* src, const T* weight, float rstd, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    float normed = to_float(from_float<T>(to_float(src[j]) * rstd));
    dst[j] = from_float<T>(normed * to_float(weight[j]));
  }
}

template <typename T>
void fused_add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const int64_t sx = x.stride(0), sr = residual.stride(0);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* xr = xp + i * sx;
      T* rr = rp + i * sr;
      for (int64_t j = 0; j < n; ++j) rr[j] = from_float<T>(to_float(xr[j]) + to_float(rr[j]));
      float rstd = 1.0f / std::sqrt(sum_of_squares(rr, n) / static_cast<float>(n) + eps);
      scale_row(xr, rr, wp, rstd, n);
    }
  });
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const int64_t sx = x.stride(0), so = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xr = xp + i * sx;
      float rstd = 1.0f / std::sqrt(sum_of_squares(xr, n) / static_cast<float>(n) + eps);
      scale_row(op + i * so, xr, wp, rstd, n);
    }
  });
}

// A post-norm sublayer's end and the next pre-norm (Gemma 3's layer): per row, out = norm(x) * w_post,
// residual += out, out = norm(residual) * w_pre. rms_norm_impl's steps and the residual add (as
// torch's add_ rounds it) in that order, so the bits of the three calls it stands for.
template <typename T>
void norm_add_norm_impl(at::Tensor& out, at::Tensor& residual, const at::Tensor& x, const at::Tensor& w_post,
                        const at::Tensor& w_pre, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const int64_t sx = x.stride(0), sr = residual.stride(0), so = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* post = w_post.data_ptr<T>();
  const T* pre = w_pre.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xr = xp + i * sx;
      T* rr = rp + i * sr;
      T* orow = op + i * so;
      float rstd = 1.0f / std::sqrt(sum_of_squares(xr, n) / static_cast<float>(n) + eps);
      scale_row(orow, xr, post, rstd, n);
      for (int64_t j = 0; j < n; ++j) rr[j] = from_float<T>(to_float(rr[j]) + to_float(orow[j]));
      rstd = 1.0f / std::sqrt(sum_of_squares(rr, n) / static_cast<float>(n) + eps);
      scale_row(orow, rr, pre, rstd, n);
    }
  });
}

#if defined(__AVX512F__)
// Up to 16 values (the first m) in fp32, zeros past them.
inline __m512 load_some(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_some(const c10::BFloat16* p, __mmask16 m) {
  const __m256i half = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Rounded to bf16 as c10::BFloat16 rounds a float: to nearest even, a NaN to 0x7fc0.
inline __m256i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
}

inline void store_some(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store_some(c10::BFloat16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, round_bf16(v)); }
#endif

// The GeLU's tanh form as a sigmoid: 0.5 g (1 + tanh(y)) = g / (1 + exp(-2y)), y = sqrt(2 / pi)
// (g + 0.044715 g^3), so 2y = g (kGeluA + kGeluB g^2): the same pass as the SiLU's, with this argument
// (where 1 + tanh(y) cancels to 0 for gates below about -5, this keeps its digits).
constexpr float kGeluA = 1.59576912161f;   // 2 sqrt(2 / pi)
constexpr float kGeluB = 0.0713548162726f;  // 2 sqrt(2 / pi) 0.044715

// out[0, n) = act(gate) * up, in fp32, rounded to T: act SiLU, or (kGelu) the GeLU's tanh form.
// SiLU-and-mul and the MLP's fused pass both run this, so their results agree on every build. Each
// width takes the same operations (the argument's FMA written out), so a lane rounds as a float does.
template <bool kGelu, typename T>
inline void act_mul_row(const T* gate, const T* up, T* out, int64_t n) {
#if defined(__AVX512F__)
  // Written out: the compiler's vectorization of the loop below ran about 3 cycles an element.
  const __m512 one = _mm512_set1_ps(1.0f), minus = _mm512_set1_ps(-1.0f);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
    const __m512 g = load_some(gate + j, m), u = load_some(up + j, m);
    __m512 z = g;
    if constexpr (kGelu)
      z = _mm512_mul_ps(g, _mm512_fmadd_ps(_mm512_set1_ps(kGeluB), _mm512_mul_ps(g, g), _mm512_set1_ps(kGeluA)));
    const __m512 act = _mm512_div_ps(g, _mm512_add_ps(one, exp_clamped(_mm512_mul_ps(z, minus))));
    store_some(out + j, _mm512_mul_ps(act, u), m);
  }
#else
  int64_t j = 0;
#if defined(__AVX2__)
  // fp32 rows (the model dtype where AVX2 is all there is): 8 lanes at a time, as above; the
  // scalar loop ran about 40 ns an element.
  if constexpr (std::is_same_v<T, float>) {
    const __m256 one = _mm256_set1_ps(1.0f), minus = _mm256_set1_ps(-1.0f);
    for (; j + 8 <= n; j += 8) {
      const __m256 g = _mm256_loadu_ps(gate + j), u = _mm256_loadu_ps(up + j);
      __m256 z = g;
      if constexpr (kGelu)
        z = _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_set1_ps(kGeluB), _mm256_mul_ps(g, g), _mm256_set1_ps(kGeluA)));
      const __m256 act = _mm256_div_ps(g, _mm256_add_ps(one, (__m256)exp_clamped((vf)_mm256_mul_ps(z, minus))));
      _mm256_storeu_ps(out + j, _mm256_mul_ps(act, u));
    }
  }
#endif
  for (; j < n; ++j) {
    const float g = to_float(gate[j]);
    float z = g;
    if constexpr (kGelu) z = g * std::fma(kGeluB, g * g, kGeluA);
    out[j] = from_float<T>(g / (1.0f + exp_clamped(-z)) * to_float(up[j]));
  }
#endif
}

template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  act_mul_row<false>(gate, up, out, n);
}

#if defined(__AVX512F__)
// Up to 16 accumulators as fp32: int32 converted (as static_cast<float> rounds), fp32 as is.
inline __m512 load_acc(const int32_t* acc, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, acc));
}
inline __m512 load_acc(const float* acc, __mmask16 m) { return _mm512_maskz_loadu_ps(m, acc); }
#endif

// out[0, n) = acc * r * col[j] in fp32 ((acc * r) * col, as written), rounded to T.
// A: int32_t (torch._int_mm's result) or float (oneDNN's int8 GEMM's, the same integers).
template <typename T, typename A>
inline void scale_int32_row(const A* acc, float r, const float* col, T* out, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 rv = _mm512_set1_ps(r);
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
    const __m512 a = load_acc(acc + j, m);
    store_some(out + j, _mm512_mul_ps(_mm512_mul_ps(a, rv), _mm512_maskz_loadu_ps(m, col + j)), m);
  }
#endif
  for (; j < n; ++j) out[j] = from_float<T>(static_cast<float>(acc[j]) * r * col[j]);
}

template <bool kGelu, typename T>
void act_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = out.size(0), n = out.size(1);
  const int64_t sx = x.stride(0), so = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) act_mul_row<kGelu>(xp + i * sx, xp + i * sx + n, op + i * so, n);
  });
}

// Rotates the heads of one token's row in place: pairs (i, i + half).
template <typename T>
inline void rotate_heads(T* row, int64_t num_heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    T* x1 = row + h * head_dim;
    T* x2 = x1 + half;
    for (int64_t j = 0; j < half; ++j) {
      float a = to_float(x1[j]), b = to_float(x2[j]);
      x1[j] = from_float<T>(a * cos[j] - b * sin[j]);
      x2[j] = from_float<T>(b * cos[j] + a * sin[j]);
    }
  }
}

template <typename T>
void rotary_impl(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos,
                 const at::Tensor& sin, int64_t head_dim) {
  const int64_t tokens = query.size(0);
  const int64_t q_heads = query.size(1) / head_dim, k_heads = key.size(1) / head_dim;
  const int64_t sq = query.stride(0), sk = key.stride(0), table_stride = cos.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  T* qp = query.data_ptr<T>();
  T* kp = key.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, tokens, grain_rows(query.size(1) + key.size(1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * table_stride;
      const float* s = sp + pos[t] * table_stride;
      rotate_heads(qp + t * sq, q_heads, head_dim, c, s);
      rotate_heads(kp + t * sk, k_heads, head_dim, c, s);
    }
  });
}


// QK-norm and the rotation of one step (Gemma 3's lean path): each head's row of query
// and key normalized (rms_norm_impl's steps, its weight per head) into the outputs, which are then
// rotated in place (rotary_impl's). The bits of the norms and the rotation called apart.
template <typename T>
void qk_norm_rotary_impl(const at::Tensor& positions, at::Tensor& query_out, at::Tensor& key_out,
                         const at::Tensor& query, const at::Tensor& key, const at::Tensor& q_weight,
                         const at::Tensor& k_weight, float eps, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t head_dim) {
  const int64_t tokens = query.size(0), d = head_dim;
  const int64_t q_heads = query.size(1) / d, k_heads = key.size(1) / d;
  const int64_t sq = query.stride(0), sk = key.stride(0), soq = query_out.stride(0), sok = key_out.stride(0);
  const int64_t table_stride = cos.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  T* oq = query_out.data_ptr<T>();
  T* ok = key_out.data_ptr<T>();
  const T* qw = q_weight.data_ptr<T>();
  const T* kw = k_weight.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const auto norm_heads = [&](T* dst, const T* src, int64_t heads, const T* w) {
    for (int64_t h = 0; h < heads; ++h) {
      const float rstd = 1.0f / std::sqrt(sum_of_squares(src + h * d, d) / static_cast<float>(d) + eps);
      scale_row(dst + h * d, src + h * d, w, rstd, d);
    }
  };
  at::parallel_for(0, tokens, grain_rows(query.size(1) + key.size(1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      norm_heads(oq + t * soq, qp + t * sq, q_heads, qw);
      norm_heads(ok + t * sok, kp + t * sk, k_heads, kw);
      const float* c = cp + pos[t] * table_stride;
      const float* s = sp + pos[t] * table_stride;
      rotate_heads(oq + t * soq, q_heads, d, c, s);
      rotate_heads(ok + t * sok, k_heads, d, c, s);
    }
  });
}

template <typename T>
void quantize_rows_int8_impl(at::Tensor& q, at::Tensor& scale, const at::Tensor& x, int64_t block) {
  const int64_t rows = x.size(0), n = x.size(1);
  const int64_t sx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(n);
    for (int64_t i = begin; i < end; ++i) quantize_row(xp + i * sx, n, block, buffer.data(), qp + i * n, sp + i);
  });
}

// The MLP between its two int8 GEMMs in one pass a row: the gate/up product's int32 row scaled
// back (as scale_int32, rounded to T), silu(gate) * up (as silu_and_mul, rounded to T), then
// rotated and rounded for the down projection (as quantize_rows_int8). The same arithmetic
// as the three kernels one after the other, bit for bit, without writing the [rows, 2I] and
// [rows, I] activations out and reading them back.
template <typename T, typename A>
void scale_silu_quantize_impl(at::Tensor& q, at::Tensor& scale, const at::Tensor& acc,
                              const at::Tensor& row_scale, const at::Tensor& col_scale, int64_t block) {
  const int64_t rows = acc.size(0), n = acc.size(1) / 2;
  const A* ap = acc.data_ptr<A>();
  const float* rs = row_scale.data_ptr<float>();
  const float* cs = col_scale.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    std::vector<T> gate_up(2 * n), act(n);
    std::vector<float> buffer(n);
    for (int64_t i = begin; i < end; ++i) {
      const A* ar = ap + i * 2 * n;
      const float r = rs[i];
      scale_int32_row(ar, r, cs, gate_up.data(), 2 * n);
      silu_mul_row(gate_up.data(), gate_up.data() + n, act.data(), n);
      quantize_row(act.data(), n, block, buffer.data(), qp + i * n, sp + i);
    }
  });
}

template <typename T, typename A>
void scale_int32_impl(at::Tensor& out, const at::Tensor& acc, const at::Tensor& row_scale,
                      const at::Tensor& col_scale, const c10::optional<at::Tensor>& bias) {
  const int64_t rows = acc.size(0), n = acc.size(1);
  const int64_t so = out.stride(0);
  const A* ap = acc.data_ptr<A>();
  const float* rs = row_scale.data_ptr<float>();
  const float* cs = col_scale.data_ptr<float>();
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    // With a bias the products go through a buffer first: written in one expression, the
    // compiler may fuse product and add into one FMA, which rounds differently from the twin.
    std::vector<float> products(bp == nullptr ? 0 : n);
    for (int64_t i = begin; i < end; ++i) {
      const A* ar = ap + i * n;
      T* o = op + i * so;
      const float r = rs[i];
      if (bp == nullptr) {
        scale_int32_row(ar, r, cs, o, n);
        continue;
      }
      for (int64_t j = 0; j < n; ++j) products[j] = static_cast<float>(ar[j]) * r * cs[j];
      for (int64_t j = 0; j < n; ++j) o[j] = from_float<T>(products[j] + to_float(bp[j]));
    }
  });
}

// The Python wrappers (kernels/cpu_fused.py) check shapes, dtypes and bounds
// with clear messages; these checks guard the memory this code touches.
void check_rows(const at::Tensor& t, int64_t rows, int64_t n, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(0) == rows && t.size(1) == n &&
                  t.stride(1) == 1 && t.scalar_type() == dtype,
              what, ": a CPU [rows, n] tensor of the activation dtype, contiguous in its last dimension");
}

void check_dtype(at::ScalarType dtype, const char* what) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, what, ": float32 or bfloat16 expected");
}

// An integer GEMM's result: torch._int_mm's int32, or oneDNN's fp32 holding the same integers.
at::ScalarType acc_dtype(const at::Tensor& acc, const char* what) {
  TORCH_CHECK(acc.scalar_type() == at::kInt || acc.scalar_type() == at::kFloat, what,
              ": acc must be int32 or float32");
  return acc.scalar_type();
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_dtype(x.scalar_type(), "fused_add_rms_norm");
  check_rows(x, x.size(0), x.size(1), x.scalar_type(), "fused_add_rms_norm x");
  check_rows(residual, x.size(0), x.size(1), x.scalar_type(), "fused_add_rms_norm residual");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: weight [n] of the activation dtype");
  if (x.scalar_type() == at::kFloat) fused_add_rms_norm_impl<float>(x, residual, weight, eps);
  else fused_add_rms_norm_impl<c10::BFloat16>(x, residual, weight, eps);
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_dtype(x.scalar_type(), "rms_norm");
  check_rows(x, x.size(0), x.size(1), x.scalar_type(), "rms_norm x");
  check_rows(out, x.size(0), x.size(1), x.scalar_type(), "rms_norm out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight [n] of the activation dtype");
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(out, x, weight, eps);
  else rms_norm_impl<c10::BFloat16>(out, x, weight, eps);
}

template <bool kGelu>
void act_and_mul(at::Tensor out, const at::Tensor& x, const char* op, const char* x_name, const char* out_name) {
  check_dtype(x.scalar_type(), op);
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, op, ": x [rows, 2n] expected");
  check_rows(x, x.size(0), x.size(1), x.scalar_type(), x_name);
  check_rows(out, x.size(0), x.size(1) / 2, x.scalar_type(), out_name);
  if (x.scalar_type() == at::kFloat) act_and_mul_impl<kGelu, float>(out, x);
  else act_and_mul_impl<kGelu, c10::BFloat16>(out, x);
}

// Whether a and b ([rows, n] each, rows contiguous) share no byte.
bool apart(const at::Tensor& a, const at::Tensor& b) {
  if (a.size(0) == 0 || b.size(0) == 0) return true;
  const char* pa = static_cast<const char*>(a.data_ptr());
  const char* pb = static_cast<const char*>(b.data_ptr());
  const int64_t na = ((a.size(0) - 1) * a.stride(0) + a.size(1)) * a.element_size();
  const int64_t nb = ((b.size(0) - 1) * b.stride(0) + b.size(1)) * b.element_size();
  return pa + na <= pb || pb + nb <= pa;
}

void norm_add_norm(at::Tensor out, at::Tensor residual, const at::Tensor& x, const at::Tensor& w_post,
                   const at::Tensor& w_pre, double eps) {
  check_dtype(x.scalar_type(), "norm_add_norm");
  TORCH_CHECK(x.dim() == 2, "norm_add_norm: x [T, N] expected");
  check_rows(x, x.size(0), x.size(1), x.scalar_type(), "norm_add_norm x");
  check_rows(residual, x.size(0), x.size(1), x.scalar_type(), "norm_add_norm residual");
  check_rows(out, x.size(0), x.size(1), x.scalar_type(), "norm_add_norm out");
  for (const at::Tensor* w : {&w_post, &w_pre})
    TORCH_CHECK(w->is_contiguous() && w->numel() == x.size(1) && w->scalar_type() == x.scalar_type() &&
                    w->device().is_cpu(),
                "norm_add_norm: weights [n] of the activation dtype");
  TORCH_CHECK(apart(out, x) && apart(out, residual) && apart(x, residual),
              "norm_add_norm: out, residual and x must not overlap");
  if (x.scalar_type() == at::kFloat) norm_add_norm_impl<float>(out, residual, x, w_post, w_pre, eps);
  else norm_add_norm_impl<c10::BFloat16>(out, residual, x, w_post, w_pre, eps);
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  act_and_mul<false>(out, x, "silu_and_mul", "silu_and_mul x", "silu_and_mul out");
}

void gelu_tanh_and_mul(at::Tensor out, const at::Tensor& x) {
  act_and_mul<true>(out, x, "gelu_tanh_and_mul", "gelu_tanh_and_mul x", "gelu_tanh_and_mul out");
}

// rotary_neox's argument checks (op names the caller in the messages): false for an empty step.
bool check_rotary(const char* op, const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                  const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim) {
  check_dtype(query.scalar_type(), op);
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, op, ": an even head_dim expected");
  const int64_t tokens = query.size(0);
  TORCH_CHECK(query.dim() == 2 && key.dim() == 2 && query.size(1) % head_dim == 0 && key.size(1) % head_dim == 0,
              op, ": query [T, H * D] and key [T, KVH * D] expected");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && query.size(0) == key.size(0) &&
                  query.stride(1) == 1 && key.stride(1) == 1 && key.scalar_type() == query.scalar_type(),
              op, ": query and key: CPU [rows, n] tensors of the activation dtype, contiguous in their last dimension");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == tokens, op,
              ": positions [T] int64, contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.strides() == sin.strides() && cos.stride(1) == 1 &&
                  cos.size(1) >= head_dim / 2,
              op, ": cos and sin [P, >= D / 2] float32 tables of one layout");
  if (tokens == 0) return false;
  // One plain loop: min() and max() as torch ops would cost four dispatches a layer.
  const int64_t* pos = positions.data_ptr<int64_t>();
  const uint64_t table_rows = static_cast<uint64_t>(cos.size(0));
  bool inside = true;
  for (int64_t t = 0; t < tokens; ++t) inside &= static_cast<uint64_t>(pos[t]) < table_rows;
  TORCH_CHECK(inside, op, ": positions must lie in [0, ", cos.size(0), ")");
  return true;
}

void rotary_neox(const at::Tensor& positions, at::Tensor query, at::Tensor key, const at::Tensor& cos,
                 const at::Tensor& sin, int64_t head_dim) {
  if (!check_rotary("rotary_neox", positions, query, key, cos, sin, head_dim)) return;
  if (query.scalar_type() == at::kFloat) rotary_impl<float>(positions, query, key, cos, sin, head_dim);
  else rotary_impl<c10::BFloat16>(positions, query, key, cos, sin, head_dim);
}

// Whether a and b ([rows, n] each, rows contiguous) are the same tensor.
bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.strides() == b.strides() && a.sizes() == b.sizes();
}

void qk_norm_rotary(const at::Tensor& positions, at::Tensor query_out, at::Tensor key_out, const at::Tensor& query,
                    const at::Tensor& key, const at::Tensor& q_weight, const at::Tensor& k_weight, double eps,
                    const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim) {
  const char* op = "qk_norm_rotary";
  if (!check_rotary(op, positions, query, key, cos, sin, head_dim)) return;
  const int64_t tokens = query.size(0);
  check_rows(query_out, tokens, query.size(1), query.scalar_type(), "qk_norm_rotary query_out");
  check_rows(key_out, tokens, key.size(1), query.scalar_type(), "qk_norm_rotary key_out");
  for (const at::Tensor* w : {&q_weight, &k_weight})
    TORCH_CHECK(w->is_contiguous() && w->numel() == head_dim && w->scalar_type() == query.scalar_type() &&
                    w->device().is_cpu(),
                op, ": weights [head_dim] of the activation dtype");
  TORCH_CHECK((same(query_out, query) || apart(query_out, query)) && (same(key_out, key) || apart(key_out, key)) &&
                  apart(query_out, key) && apart(key_out, query) && apart(query_out, key_out),
              op, ": each output is its input or shares no memory with the other tensors");
  if (query.scalar_type() == at::kFloat)
    qk_norm_rotary_impl<float>(positions, query_out, key_out, query, key, q_weight, k_weight, eps, cos, sin, head_dim);
  else
    qk_norm_rotary_impl<c10::BFloat16>(positions, query_out, key_out, query, key, q_weight, k_weight, eps, cos, sin,
                                       head_dim);
}

void quantize_rows_int8(at::Tensor q, at::Tensor scale, const at::Tensor& x, int64_t hadamard_block) {
  check_dtype(x.scalar_type(), "quantize_rows_int8");
  TORCH_CHECK(x.dim() == 2, "quantize_rows_int8: x [rows, n] expected");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(hadamard_block == 0 || ((hadamard_block == 4 || hadamard_block == 16 || hadamard_block == 64) &&
                                      n % hadamard_block == 0),
              "quantize_rows_int8: hadamard_block must be 0, or 4, 16 or 64 dividing the row");
  check_rows(x, rows, n, x.scalar_type(), "quantize_rows_int8 x");
  TORCH_CHECK(q.is_contiguous(), "quantize_rows_int8: q must be contiguous");
  check_rows(q, rows, n, at::kChar, "quantize_rows_int8 q (int8)");
  TORCH_CHECK(scale.device().is_cpu() && scale.is_contiguous() && scale.numel() == rows &&
                  scale.scalar_type() == at::kFloat,
              "quantize_rows_int8: scale [rows] float32, contiguous");
  if (x.scalar_type() == at::kFloat) quantize_rows_int8_impl<float>(q, scale, x, hadamard_block);
  else quantize_rows_int8_impl<c10::BFloat16>(q, scale, x, hadamard_block);
}

void scale_int32(at::Tensor out, const at::Tensor& acc, const at::Tensor& row_scale, const at::Tensor& col_scale,
                 const c10::optional<at::Tensor>& bias) {
  check_dtype(out.scalar_type(), "scale_int32");
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous(), "scale_int32: acc [rows, n] contiguous expected");
  const int64_t rows = acc.size(0), n = acc.size(1);
  check_rows(acc, rows, n, acc_dtype(acc, "scale_int32"), "scale_int32 acc (int32 or float32)");
  check_rows(out, rows, n, out.scalar_type(), "scale_int32 out");
  TORCH_CHECK(row_scale.device().is_cpu() && row_scale.is_contiguous() && row_scale.numel() == rows &&
                  row_scale.scalar_type() == at::kFloat,
              "scale_int32: row_scale [rows] float32, contiguous");
  TORCH_CHECK(col_scale.device().is_cpu() && col_scale.is_contiguous() && col_scale.numel() == n &&
                  col_scale.scalar_type() == at::kFloat,
              "scale_int32: col_scale [n] float32, contiguous");
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->is_contiguous() && bias->numel() == n &&
                    bias->scalar_type() == out.scalar_type(),
                "scale_int32: bias [n] of the output dtype, contiguous");
  }
  const bool integer = acc.scalar_type() == at::kInt;
  if (out.scalar_type() == at::kFloat) {
    if (integer) scale_int32_impl<float, int32_t>(out, acc, row_scale, col_scale, bias);
    else scale_int32_impl<float, float>(out, acc, row_scale, col_scale, bias);
  } else {
    if (integer) scale_int32_impl<c10::BFloat16, int32_t>(out, acc, row_scale, col_scale, bias);
    else scale_int32_impl<c10::BFloat16, float>(out, acc, row_scale, col_scale, bias);
  }
}

void scale_silu_quantize_int8(at::Tensor q, at::Tensor scale, const at::Tensor& acc, const at::Tensor& row_scale,
                              const at::Tensor& col_scale, int64_t hadamard_block, at::ScalarType dtype) {
  check_dtype(dtype, "scale_silu_quantize_int8");
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.size(1) % 2 == 0,
              "scale_silu_quantize_int8: acc [rows, 2n] contiguous expected");
  const int64_t rows = acc.size(0), n = acc.size(1) / 2;
  check_rows(acc, rows, 2 * n, acc_dtype(acc, "scale_silu_quantize_int8"),
             "scale_silu_quantize_int8 acc (int32 or float32)");
  TORCH_CHECK(hadamard_block == 0 || ((hadamard_block == 4 || hadamard_block == 16 || hadamard_block == 64) &&
                                      n % hadamard_block == 0),
              "scale_silu_quantize_int8: hadamard_block must be 0, or 4, 16 or 64 dividing n");
  TORCH_CHECK(q.is_contiguous(), "scale_silu_quantize_int8: q must be contiguous");
  check_rows(q, rows, n, at::kChar, "scale_silu_quantize_int8 q (int8)");
  TORCH_CHECK(scale.device().is_cpu() && scale.is_contiguous() && scale.numel() == rows &&
                  scale.scalar_type() == at::kFloat,
              "scale_silu_quantize_int8: scale [rows] float32, contiguous");
  TORCH_CHECK(row_scale.device().is_cpu() && row_scale.is_contiguous() && row_scale.numel() == rows &&
                  row_scale.scalar_type() == at::kFloat,
              "scale_silu_quantize_int8: row_scale [rows] float32, contiguous");
  TORCH_CHECK(col_scale.device().is_cpu() && col_scale.is_contiguous() && col_scale.numel() == 2 * n &&
                  col_scale.scalar_type() == at::kFloat,
              "scale_silu_quantize_int8: col_scale [2n] float32, contiguous");
  const bool integer = acc.scalar_type() == at::kInt;
  if (dtype == at::kFloat) {
    if (integer) scale_silu_quantize_impl<float, int32_t>(q, scale, acc, row_scale, col_scale, hadamard_block);
    else scale_silu_quantize_impl<float, float>(q, scale, acc, row_scale, col_scale, hadamard_block);
  } else {
    if (integer) scale_silu_quantize_impl<c10::BFloat16, int32_t>(q, scale, acc, row_scale, col_scale, hadamard_block);
    else scale_silu_quantize_impl<c10::BFloat16, float>(q, scale, acc, row_scale, col_scale, hadamard_block);
  }
}

// Row r's index of its maximum into out[r]: the first one on ties, the first NaN where the row holds
// one (what torch's max(dim=-1).indices gives). Two passes over the row: its maximum in lanes (a
// NaN flagged apart: vmaxps keeps the lanes where it meets one), then the first element equal to it, a chunk of
// 32 tested at a time. One [1, 262,144] row of fp32 logits (Gemma 3's vocabulary), one thread
// (Zen 1): 62 us against torch's 331; 16 rows of 49,152 on two threads, 85 us against 510.
int64_t argmax_row(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool any_nan = false;
  int64_t j = 0;
#if defined(__AVX2__)
  // Four vectors of lanes; vmaxps(v, m) keeps m where v is NaN, vcmpunordps flags the NaN.
  __m256 m[4], bad = _mm256_setzero_ps();
  for (auto& v : m) v = _mm256_set1_ps(best);
  for (; j + 32 <= n; j += 32) {
    for (int k = 0; k < 4; ++k) {
      const __m256 v = _mm256_loadu_ps(x + j + 8 * k);
      m[k] = _mm256_max_ps(v, m[k]);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
  for (float v : lanes) best = v > best ? v : best;
  any_nan = _mm256_movemask_ps(bad) != 0;
#endif
  for (; j < n; ++j) {
    best = x[j] > best ? x[j] : best;
    any_nan |= x[j] != x[j];
  }
  int64_t i = 0;
#if defined(__AVX2__)
  if (!any_nan) {  // the first chunk of 32 holding best, then the element
    const __m256 b = _mm256_set1_ps(best);
    for (; i + 32 <= n; i += 32) {
      __m256 hit = _mm256_cmp_ps(_mm256_loadu_ps(x + i), b, _CMP_EQ_OQ);
      for (int k = 1; k < 4; ++k) hit = _mm256_or_ps(hit, _mm256_cmp_ps(_mm256_loadu_ps(x + i + 8 * k), b, _CMP_EQ_OQ));
      if (_mm256_movemask_ps(hit) != 0) break;
    }
  }
#endif
  for (; i < n; ++i) {
    if (any_nan ? x[i] != x[i] : x[i] == best) return i;
  }
  return 0;  // unreachable for n > 0: best is one of the row's values (or -inf, its first)
}

void argmax_rows(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0 &&
                        x.stride(1) == 1,
                    "argmax_rows: x must be a float32 CPU tensor [rows, n], n > 0, contiguous in its rows");
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.scalar_type() == at::kLong && out.dim() == 1 &&
                        out.size(0) == x.size(0) && out.is_contiguous(),
                    "argmax_rows: out must be a contiguous int64 CPU tensor [rows]");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  const float* px = x.data_ptr<float>();
  int64_t* po = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) po[r] = argmax_row(px + r * stride, n);
  });
}

}  // namespace

TORCH_LIBRARY(weft_fused, m) {
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("qk_norm_rotary(Tensor positions, Tensor(a!) query_out, Tensor(b!) key_out, Tensor query, Tensor key, "
        "Tensor q_weight, Tensor k_weight, float eps, Tensor cos, Tensor sin, int head_dim) -> ()");
  m.def("norm_add_norm(Tensor(a!) out, Tensor(b!) residual, Tensor x, Tensor w_post, Tensor w_pre, float eps) -> ()");
  m.def("rotary_neox(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin, int head_dim) -> ()");
  m.def("quantize_rows_int8(Tensor(a!) q, Tensor(b!) scale, Tensor x, int hadamard_block) -> ()");
  m.def("scale_int32(Tensor(a!) out, Tensor acc, Tensor row_scale, Tensor col_scale, Tensor? bias) -> ()");
  m.def("scale_silu_quantize_int8(Tensor(a!) q, Tensor(b!) scale, Tensor acc, Tensor row_scale, Tensor col_scale, "
        "int hadamard_block, ScalarType dtype) -> ()");
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &fused_add_rms_norm);
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("gelu_tanh_and_mul", c10::DispatchKey::CPU, &gelu_tanh_and_mul);
  m.impl("norm_add_norm", c10::DispatchKey::CPU, &norm_add_norm);
  m.impl("qk_norm_rotary", c10::DispatchKey::CPU, &qk_norm_rotary);
  m.impl("rotary_neox", c10::DispatchKey::CPU, &rotary_neox);
  m.impl("quantize_rows_int8", c10::DispatchKey::CPU, &quantize_rows_int8);
  m.impl("scale_int32", c10::DispatchKey::CPU, &scale_int32);
  m.impl("scale_silu_quantize_int8", c10::DispatchKey::CPU, &scale_silu_quantize_int8);
  m.def("argmax_rows(Tensor(a!) out, Tensor x) -> ()");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
}
