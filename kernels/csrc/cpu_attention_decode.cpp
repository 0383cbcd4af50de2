// Decodes of the CPU attention kernel (one new token per sequence): the flash-decoding items over
// the register tiles of paged_attention.h, and the opt-in paths of AVX-512 builds (int8 caches on
// 512-bit rows or int8 dot products, bf16 caches on bf16 dot products). cpu_paged_attention.cpp
// states the kernel's rules and registers the op.

#include "paged_attention.h"

namespace {

// ---------------------------------------------------------------- decode

// Partial result of one item: per query head g, the max score, the sum of
// exp(score - max) and the exp-weighted value sum [D].
struct PartialView {
  float* m;
  float* l;
  float* acc;
};

// One item's scores s [G, L] -> exp(s - max) in place, each head's max and sum into part.
inline void softmax_numerators(float* s, int64_t L, int64_t G, PartialView part) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * L;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = exp_approx(sg[t] - m);
      sum += sg[t];
    }
    part.m[g] = m;
    part.l[g] = sum;
  }
}

// s[g * stride + i] *= row_scale[i] for the n rows of G heads: an int8 cache's scales applied to
// scores or softmax numerators.
inline void scale_heads(float* s, int64_t stride, int64_t G, const float* row_scale, int64_t n) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < n; ++i) s[g * stride + i] *= row_scale[i];
}

#ifdef WEFT_AVX512
// ------------------------------------------------------ decode, int8 cache
//
// An int8 cache on an AVX-512F build, head sizes 64 and 128: each 16 int8 of a
// row widen to 16 exact fp32 in a register (vpmovsxbd, vcvtdq2ps) and meet the
// fp32 query in one FMA, so no row is widened to memory; 16 key rows' scores
// are reduced together (sum16) and scaled by a vector of 16 key scales, and
// each value row is weighted by its softmax numerator times its value scale.
// Sums are fp32 as on the generic path, in another order.

// Scores of one query head against up to 16 key rows: row r's products summed
// into one vector each, then 16 vectors reduced to one of 16 sums in four
// rounds of shuffles and adds (45 instructions for 16 rows, against 16 full
// horizontal sums). The rounds leave the sums in the lane order kSumLane; the
// rows go in in that order, which is its own inverse, so they come out in order.
constexpr int kSumLane[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

inline __m512 sum16(__m512* v) {
  __m512 w[8], z[4], u[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(z[i], z[i + 2]), _mm512_unpackhi_ps(z[i], z[i + 2]));
  const __m512d a = _mm512_castps_pd(u[0]), b = _mm512_castps_pd(u[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}



// softmax_numerators 16 lanes at a time (with it, an int8 decode in cache took 1.07x the time: the
// exponentials are a quarter of it). exp_approx keeps a NaN score NaN, so a NaN key scale reaches
// the output.
inline void softmax_numerators16(float* s, int64_t L, int64_t G, PartialView part) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * L;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < L; t += 16) {
      const __mmask16 k = static_cast<__mmask16>(L - t >= 16 ? 0xFFFF : (1u << (L - t)) - 1);
      mx = _mm512_mask_max_ps(mx, k, mx, _mm512_maskz_loadu_ps(k, sg + t));
    }
    const float m = _mm512_reduce_max_ps(mx);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t += 16) {
      const __mmask16 k = static_cast<__mmask16>(L - t >= 16 ? 0xFFFF : (1u << (L - t)) - 1);
      const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + t), mv);
      const __m512 e = exp_approx(x);
      _mm512_mask_storeu_ps(sg + t, k, e);
      sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    part.m[g] = m;
    part.l[g] = _mm512_reduce_add_ps(sum);
  }
}



// s[t] = ks[t] * (q . k[t]) for the m <= 16 int8 rows at k (row stride kZ * 16), q scaled already.
// Each head widens the rows again: widening them once into an fp32 buffer for all heads measured
// 1.05x the time (in cache and out, SmolLM2's G = 3).
template <int kZ>
inline void scores16_int8(const __m512* q, const int8_t* k, int64_t m, const float* ks, float* s) {
  const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
  __m512 v[16];
  for (int slot = 0; slot < 16; ++slot) {
    const int r = kSumLane[slot];
    __m512 a = _mm512_setzero_ps();
    if (r < m)
      for (int z = 0; z < kZ; ++z) a = _mm512_fmadd_ps(q[z], widen16(k + r * kZ * 16 + z * 16), a);
    v[slot] = a;
  }
  _mm512_mask_storeu_ps(s, mask, _mm512_mul_ps(sum16(v), _mm512_maskz_loadu_ps(mask, ks)));
}

// The value pass of one item for heads [g0, g0 + NG): each row widened once for them all, their
// accumulators in registers. s holds the numerators times the value scales.
template <int NG, int kZ>
void value_pass_int8(const float* s, int64_t L, const int8_t* values, const int32_t* blocks, int64_t lo, int64_t hi,
                     int64_t block_size, int64_t g0, float* acc_out) {
  constexpr int64_t D = kZ * 16;
  __m512 acc[NG][kZ];
  for (int g = 0; g < NG; ++g)
    for (int z = 0; z < kZ; ++z) acc[g][z] = _mm512_setzero_ps();
  for (int64_t b = lo / block_size; b <= (hi - 1) / block_size; ++b) {
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size);
    const int8_t* vb = values + static_cast<int64_t>(blocks[b]) * block_size * D + (t0 - b * block_size) * D;
    const float* p = s + g0 * L + (t0 - lo);
    for (int64_t t = 0; t < t1 - t0; ++t) {
      __m512 x[kZ];
      for (int z = 0; z < kZ; ++z) x[z] = widen16(vb + t * D + z * 16);
      for (int g = 0; g < NG; ++g) {
        const __m512 w = _mm512_set1_ps(p[g * L + t]);
        for (int z = 0; z < kZ; ++z) acc[g][z] = _mm512_fmadd_ps(w, x[z], acc[g][z]);
      }
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int z = 0; z < kZ; ++z) _mm512_storeu_ps(acc_out + (g0 + g) * D + z * 16, acc[g][z]);
}

#ifdef WEFT_BF16_DOT
// ---------------------------------------- decode, int8 cache, int8 dot products (bf16 queries)
//
// Widening each key row to fp32 once per query head is most of the int8 key pass (about 56
// instructions a row at G = 3, head size 64). A bf16 query is already rounded, so here it is rounded
// once more, to int8 per head (its fp32 scale, as the cache's rows are), and vpdpbusd multiplies
// 64 bytes of it by 64 of a key row and sums them four at a time into 16 int32 lanes: about 16
// instructions a row at G = 3. vpdpbusd takes one side unsigned, so the query goes in plus 128 and
// 128 * sum(k) comes off (one more vpdpbusd a row, shared by the heads). Products and sums are exact
// integers (at most 128 x 255 x 127 a lane); what this adds to a bf16 cache's arithmetic is the
// query's rounding (kernels.reference.round_query_int8_ref, the twin).
// The CPUs with AVX512_BF16 (Cooper Lake, Sapphire Rapids and later, Zen 4 and 5) all have
// AVX512_VNNI; a run-time check keeps the fp32 path where one does not.

inline bool has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni");
  return yes;
}

// sum16 in int32 lanes: the same shuffles, so the same kSumLane order.
inline __m512i sum16_epi32(__m512i* v) {
  __m512i w[8], z[4], u[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_i32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    z[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_i32x4(w[i], w[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(z[i], z[i + 2]), _mm512_unpackhi_epi32(z[i], z[i + 2]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(u[0], u[1]), _mm512_unpackhi_epi64(u[0], u[1]));
}


// Head g's scaled query qf [D] rounded as the cache's rows are, as D bytes of q + 128, and its
// scale (NaN where the row holds a NaN or an infinity, so that its scores are NaN).
template <int D>
inline float round_query_int8(const float* qf, uint8_t* out) {
  int8_t q[D];
  float scale;
  quantize_row(qf, D, q, &scale);
  for (int d = 0; d < D; ++d) out[d] = static_cast<uint8_t>(q[d] + 128);
  return scale;
}

// The key pass of one item: s[g * L + t - lo] = qs[g] * ks[t] * (q_g . k_t) for keys [lo, hi).
template <int kY>
__attribute__((target("avx512vnni"))) void key_pass_vnni(const uint8_t* qu, const float* qs, int64_t G,
                                                        const int8_t* keys, const int8_t* values,
                                                        const float* key_scales,
                                                        const int32_t* blocks, int64_t lo, int64_t hi,
                                                        int64_t block_size, float* s, int64_t L,
                                                        const Prefetcher<int8_t>& ahead) {
  constexpr int64_t D = kY * 64;
  const __m512i k128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = lo / block_size; b <= (hi - 1) / block_size; ++b) {
    ahead.lines_of(b);
    const int64_t first = static_cast<int64_t>(blocks[b]) * block_size;
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size);
    for (int64_t t = t0; t < t1; t += 16) {
      const int64_t m = std::min<int64_t>(16, t1 - t);
      const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
      const int8_t* k = keys + (first + t - b * block_size) * D;
      prefetch_rows(values + (first + t - b * block_size) * D, m * D);
      const __m512 ks = _mm512_maskz_loadu_ps(mask, key_scales + first + t - b * block_size);
      __m512i v[16];
      for (int slot = 0; slot < 16; ++slot) {
        const int r = kSumLane[slot];
        __m512i a = _mm512_setzero_si512();
        if (r < m)
          for (int y = 0; y < kY; ++y) a = _mm512_dpbusd_epi32(a, k128, _mm512_loadu_si512(k + r * D + y * 64));
        v[slot] = a;
      }
      const __m512i bias = sum16_epi32(v);
      for (int64_t g = 0; g < G; ++g) {
        __m512i q[kY];
        for (int y = 0; y < kY; ++y) q[y] = _mm512_loadu_si512(qu + g * D + y * 64);
        for (int slot = 0; slot < 16; ++slot) {
          const int r = kSumLane[slot];
          __m512i a = _mm512_setzero_si512();
          if (r < m)
            for (int y = 0; y < kY; ++y) a = _mm512_dpbusd_epi32(a, q[y], _mm512_loadu_si512(k + r * D + y * 64));
          v[slot] = a;
        }
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum16_epi32(v), bias));
        _mm512_mask_storeu_ps(s + g * L + (t - lo), mask, _mm512_mul_ps(dot, _mm512_mul_ps(ks, _mm512_set1_ps(qs[g]))));
      }
    }
  }
}

// The value pass of one item for heads [g0, g0 + NG) on vpdpwssd (int16 pairs into int32): each run
// of at most 128 rows has its weights (numerators times value scales, s) rounded to int16 against
// their largest (scale w_max / 32767: 2^-16 of it at most, where the bf16 path rounds each weight
// to 2^-9 of itself), two rows' int8 values are interleaved and widened to int16 pairs, and one
// vpdpwssd per 32 elements and head adds both rows' products. At most 128 x 32767 x 127 per int32
// lane, so no overflow; each run's sums go to fp32 accumulators times its scale. A NaN weight
// makes the run's scale NaN, so NaN reaches the output. Lanes come out in unpack order (lane j of
// chunk c holds element kValueLane(c, j)); the last step puts them back.
template <int NG, int kY>
__attribute__((target("avx512vnni"))) void value_pass_vnni(const float* s, int64_t L, const int8_t* values,
                                                          const int32_t* blocks, int64_t lo, int64_t hi,
                                                          int64_t block_size, int64_t g0, float* acc_out) {
  constexpr int64_t D = kY * 64;
  constexpr int kC = 4 * kY;  // int32 accumulators a head: 16 elements each
  __m512 acc[NG][kC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < kC; ++c) acc[g][c] = _mm512_setzero_ps();
  alignas(64) int16_t w16[NG][130];
  for (int64_t b = lo / block_size; b <= (hi - 1) / block_size; ++b) {
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size);
    const int8_t* vb = values + static_cast<int64_t>(blocks[b]) * block_size * D + (t0 - b * block_size) * D;
    for (int64_t r0 = 0; r0 < t1 - t0; r0 += 128) {
      const int64_t n = std::min<int64_t>(128, t1 - t0 - r0);
      float wscale[NG];
      for (int g = 0; g < NG; ++g) {
        const float* w = s + (g0 + g) * L + (t0 - lo) + r0;
        __m512 mx = _mm512_setzero_ps();
        __mmask16 nan = 0;
        for (int64_t i = 0; i < n; i += 16) {
          const __mmask16 k = static_cast<__mmask16>(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
          const __m512 x = _mm512_maskz_loadu_ps(k, w + i);
          nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
          mx = _mm512_max_ps(mx, x);
        }
        const float wmax = _mm512_reduce_max_ps(mx);
        const __m512 inv = _mm512_set1_ps(wmax > 0.0f ? 32767.0f / wmax : 0.0f);
        wscale[g] = nan ? std::numeric_limits<float>::quiet_NaN() : wmax / 32767.0f;
        for (int64_t i = 0; i < n; i += 16) {
          const __mmask16 k = static_cast<__mmask16>(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
          const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, w + i), inv));
          _mm256_mask_storeu_epi16(w16[g] + i, k, _mm512_cvtepi32_epi16(q));
        }
        w16[g][n] = 0;  // the partner of an odd run's last row
      }
      __m512i iacc[NG][kC];
      for (int g = 0; g < NG; ++g)
        for (int c = 0; c < kC; ++c) iacc[g][c] = _mm512_setzero_si512();
      const int8_t* v = vb + r0 * D;
      for (int64_t t = 0; t < n; t += 2) {
        __m512i p[NG];
        for (int g = 0; g < NG; ++g) {
          int32_t pair;
          std::memcpy(&pair, w16[g] + t, sizeof(pair));
          p[g] = _mm512_set1_epi32(pair);
        }
        for (int y = 0; y < kY; ++y) {
          const __m512i a = _mm512_loadu_si512(v + t * D + y * 64);
          const __m512i b2 = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * D + y * 64) : _mm512_setzero_si512();
          const __m512i lo8 = _mm512_unpacklo_epi8(a, b2), hi8 = _mm512_unpackhi_epi8(a, b2);
          const __m512i x[4] = {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo8)),
                                _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo8, 1)),
                                _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi8)),
                                _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi8, 1))};
          for (int g = 0; g < NG; ++g)
            for (int c = 0; c < 4; ++c) iacc[g][4 * y + c] = _mm512_dpwssd_epi32(iacc[g][4 * y + c], x[c], p[g]);
        }
      }
      for (int g = 0; g < NG; ++g) {
        const __m512 ws = _mm512_set1_ps(wscale[g]);
        for (int c = 0; c < kC; ++c) acc[g][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[g][c]), ws, acc[g][c]);
      }
    }
  }
  // Chunk 0 holds elements 0-7 and 16-23 of each 64, chunk 1 32-39 and 48-55, chunk 2 8-15 and
  // 24-31, chunk 3 40-47 and 56-63 (vpunpck works within 128-bit lanes).
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int g = 0; g < NG; ++g) {
    float* out = acc_out + (g0 + g) * D;
    for (int y = 0; y < kY; ++y) {
      const __m512* c = acc[g] + 4 * y;
      _mm512_storeu_ps(out + y * 64, _mm512_permutex2var_ps(c[0], first, c[2]));
      _mm512_storeu_ps(out + y * 64 + 16, _mm512_permutex2var_ps(c[0], second, c[2]));
      _mm512_storeu_ps(out + y * 64 + 32, _mm512_permutex2var_ps(c[1], first, c[3]));
      _mm512_storeu_ps(out + y * 64 + 48, _mm512_permutex2var_ps(c[1], second, c[3]));
    }
  }
}
#endif  // WEFT_BF16_DOT

// decode_item for an int8 cache with head size kZ * 16: the same two passes and the same
// partial result.
template <int kZ, typename scalar_t>
void decode_item_int8(const scalar_t* query, int64_t q_stride_head, const int8_t* keys, const int8_t* values,
                      RowScales rs, const int32_t* blocks, int64_t lo, int64_t hi, int64_t block_size, int64_t G,
                      float scale, std::vector<float>& buf, PartialView part) {
  constexpr int64_t D = kZ * 16;
  const int64_t L = hi - lo;
  buf.resize(G * D + G * L);
  float* qf = buf.data();  // [G, D] scaled queries
  float* s = qf + G * D;   // [G, L] scores, then softmax numerators
  load_rows(query, q_stride_head, G, D, scale, qf);
  const int64_t b_first = lo / block_size, b_last = (hi - 1) / block_size;
  Prefetcher<int8_t> ahead{keys, values, blocks, b_first, b_last, block_size * D, rs.keys, rs.values, block_size};
  ahead.start();
  bool keys_done = false;
#ifdef WEFT_BF16_DOT
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
    if (has_vnni()) {
      thread_local std::vector<uint8_t> qu;
      thread_local std::vector<float> qs;
      qu.resize(G * D);
      qs.resize(G);
      for (int64_t g = 0; g < G; ++g) qs[g] = round_query_int8<D>(qf + g * D, qu.data() + g * D);
      key_pass_vnni<D / 64>(qu.data(), qs.data(), G, keys, values, rs.keys, blocks, lo, hi, block_size, s, L,
                            ahead);
      keys_done = true;
    }
#endif
  for (int64_t b = b_first; !keys_done && b <= b_last; ++b) {
    ahead.lines_of(b);
    const int64_t first = static_cast<int64_t>(blocks[b]) * block_size;  // the block's first row
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size);
    for (int64_t t = t0; t < t1; t += 16) {
      const int64_t row = first + t - b * block_size;
      prefetch_rows(values + row * D, std::min<int64_t>(16, t1 - t) * D);
      for (int64_t g = 0; g < G; ++g) {  // the rows stay in L1 while every head reads them
        __m512 q[kZ];
        for (int z = 0; z < kZ; ++z) q[z] = _mm512_loadu_ps(qf + g * D + z * 16);
        scores16_int8<kZ>(q, keys + row * D, std::min<int64_t>(16, t1 - t), rs.keys + row, s + g * L + (t - lo));
      }
    }
  }
  softmax_numerators16(s, L, G, part);
  for (int64_t b = b_first; b <= b_last; ++b) {
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size);
    scale_heads(s + (t0 - lo), L, G, rs.values + static_cast<int64_t>(blocks[b]) * block_size + t0 - b * block_size,
                t1 - t0);
  }
  constexpr int kNG = kZ <= 4 ? 3 : 2;  // the accumulators that fit in 32 registers beside a row
  int64_t g = 0;
#ifdef WEFT_BF16_DOT
  if (keys_done) {  // a bf16 query on a CPU with VNNI: the values on int16 pairs too
    for (; g + kNG <= G; g += kNG) value_pass_vnni<kNG, D / 64>(s, L, values, blocks, lo, hi, block_size, g, part.acc);
    for (; g < G; ++g) value_pass_vnni<1, D / 64>(s, L, values, blocks, lo, hi, block_size, g, part.acc);
    return;
  }
#endif
  for (; g + kNG <= G; g += kNG) value_pass_int8<kNG, kZ>(s, L, values, blocks, lo, hi, block_size, g, part.acc);
  for (; g < G; ++g) value_pass_int8<1, kZ>(s, L, values, blocks, lo, hi, block_size, g, part.acc);
}
#endif  // WEFT_AVX512

#ifdef WEFT_BF16_DOT
// ------------------------------------------------ decode, bf16 dot products
//
// With a bf16 cache on a CPU with AVX512_BF16, vdpbf16ps multiplies 32 bf16
// pairs and adds them into 16 fp32 lanes in one instruction, so neither pass
// widens a key or value element to fp32 first. The fp32 path above spends
// about 60 instructions per key row on its score (widen, FMA, a horizontal sum
// per head) and 40 on its value row; these spend about 17 and 12. Products are
// exact in fp32 and sums are fp32, as above; what differs is that the value
// pass rounds the softmax weights to bf16 (as GPU flash attention rounds P).

// s[t] = scale * q . k[t] for the m <= 16 rows at k (row stride kZ * 32).
template <int kZ>
inline void scores16_bf16(const __m512bh* q, const c10::BFloat16* k, int64_t m, float scale, float* s) {
  __m512 v[16];
  for (int slot = 0; slot < 16; ++slot) {
    const int r = kSumLane[slot];
    __m512 a = _mm512_setzero_ps();
    if (r < m)
      for (int z = 0; z < kZ; ++z) a = _mm512_dpbf16_ps(a, q[z], as_bh(_mm512_loadu_si512(k + r * kZ * 32 + z * 32)));
    v[slot] = a;
  }
  const __m512 out = _mm512_mul_ps(sum16(v), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << m) - 1), out);
}

// acc[g] += sum over the n rows t of v of p[g][t] * v[t] for NG heads, two
// rows at a time: their elements interleaved into bf16 pairs (within each
// 128-bit lane, so the accumulators hold the head dimension in the order
// unpack_order undoes) and one vdpbf16ps per head with the pair of weights.
// pw[g] holds head g's weights in bf16, a zero after the last (odd n).
template <int NG, int kZ>
inline void weighted_pairs_bf16(const uint16_t* const* pw, const c10::BFloat16* v, int64_t n,
                                __m512 (&acc)[NG][2 * kZ]) {
  for (int64_t t = 0; t < n; t += 2) {
    __m512bh p[NG];
    for (int g = 0; g < NG; ++g) {
      uint32_t pair;
      std::memcpy(&pair, pw[g] + t, sizeof(pair));
      p[g] = as_bh(_mm512_set1_epi32(static_cast<int32_t>(pair)));
    }
    for (int z = 0; z < kZ; ++z) {
      const __m512i a = _mm512_loadu_si512(v + t * kZ * 32 + z * 32);
      const __m512i b = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * kZ * 32 + z * 32) : _mm512_setzero_si512();
      const __m512bh lo = as_bh(_mm512_unpacklo_epi16(a, b)), hi = as_bh(_mm512_unpackhi_epi16(a, b));
      for (int g = 0; g < NG; ++g) {
        acc[g][2 * z] = _mm512_dpbf16_ps(acc[g][2 * z], lo, p[g]);
        acc[g][2 * z + 1] = _mm512_dpbf16_ps(acc[g][2 * z + 1], hi, p[g]);
      }
    }
  }
}

// The accumulators of one head back in head-dimension order: of each 32
// elements, lane i of the first ("lo") vector holds element 8 * (i / 4) + i % 4,
// of the second 8 * (i / 4) + 4 + i % 4.
template <int kZ>
inline void unpack_order(const __m512 (&acc)[2 * kZ], float* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int z = 0; z < kZ; ++z) {
    _mm512_storeu_ps(out + z * 32, _mm512_permutex2var_ps(acc[2 * z], first, acc[2 * z + 1]));
    _mm512_storeu_ps(out + z * 32 + 16, _mm512_permutex2var_ps(acc[2 * z], second, acc[2 * z + 1]));
  }
}

// The value pass of one item for heads [g0, g0 + NG).
template <int NG, int kZ>
void value_pass_bf16(const float* s, int64_t L, const c10::BFloat16* values, const int32_t* blocks, int64_t lo,
                     int64_t hi, int64_t block_size, int64_t g0, const Prefetcher<c10::BFloat16>& ahead,
                     std::vector<uint16_t>& pbuf, float* acc_out) {
  constexpr int64_t D = kZ * 32;
  __m512 acc[NG][2 * kZ];
  for (int g = 0; g < NG; ++g)
    for (int z = 0; z < 2 * kZ; ++z) acc[g][z] = _mm512_setzero_ps();
  const int64_t stride = block_size + 2;  // a block's weights and a zero pad, per head
  pbuf.assign(NG * stride, 0);
  const uint16_t* pw[NG];
  for (int g = 0; g < NG; ++g) pw[g] = pbuf.data() + g * stride;
  for (int64_t b = lo / block_size; b <= (hi - 1) / block_size; ++b) {
    ahead.value_block(b);
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size), n = t1 - t0;
    for (int g = 0; g < NG; ++g) {
      uint16_t* dst = pbuf.data() + g * stride;
      const float* src = s + (g0 + g) * L + (t0 - lo);
      for (int64_t i = 0; i < n; i += 16) {
        const int64_t m = std::min<int64_t>(16, n - i);
        const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + i));
        _mm256_mask_storeu_epi16(dst + i, mask, reinterpret_cast<const __m256i&>(h));
      }
      dst[n] = 0;
    }
    const c10::BFloat16* vb = values + static_cast<int64_t>(blocks[b]) * block_size * D + (t0 - b * block_size) * D;
    weighted_pairs_bf16<NG, kZ>(pw, vb, n, acc);
  }
  for (int g = 0; g < NG; ++g) unpack_order<kZ>(acc[g], acc_out + (g0 + g) * D);
}

// decode_item for a bf16 cache with head size kZ * 32: the same two passes and
// the same partial result.
template <int kZ>
void decode_item_bf16(const c10::BFloat16* query, int64_t q_stride_head, const c10::BFloat16* keys,
                      const c10::BFloat16* values, const int32_t* blocks, int64_t lo, int64_t hi, int64_t block_size,
                      int64_t G, float scale, std::vector<float>& buf, PartialView part) {
  constexpr int64_t D = kZ * 32;
  const int64_t L = hi - lo;
  buf.resize(G * L);
  float* s = buf.data();  // [G, L] scores, then softmax numerators
  const int64_t b_first = lo / block_size, b_last = (hi - 1) / block_size;
  Prefetcher<c10::BFloat16> ahead{keys, values, blocks, b_first, b_last, block_size * D};
  ahead.start();
  for (int64_t b = b_first; b <= b_last; ++b) {
    ahead.key_block_of(b, 0, 1);
    const c10::BFloat16* kb = keys + static_cast<int64_t>(blocks[b]) * block_size * D;
    const int64_t t0 = std::max(lo, b * block_size), t1 = std::min(hi, (b + 1) * block_size);
    for (int64_t t = t0; t < t1; t += 16)
      for (int64_t g = 0; g < G; ++g) {  // the rows stay in L1 while every head reads them
        __m512bh q[kZ];
        for (int z = 0; z < kZ; ++z) q[z] = as_bh(_mm512_loadu_si512(query + g * q_stride_head + z * 32));
        scores16_bf16<kZ>(q, kb + (t - b * block_size) * D, std::min<int64_t>(16, t1 - t), scale,
                          s + g * L + (t - lo));
      }
  }
  softmax_numerators(s, L, G, part);
  thread_local std::vector<uint16_t> pbuf;
  int64_t g = 0;
  for (; g + 3 <= G; g += 3) value_pass_bf16<3, kZ>(s, L, values, blocks, lo, hi, block_size, g, ahead, pbuf, part.acc);
  for (; g < G; ++g) value_pass_bf16<1, kZ>(s, L, values, blocks, lo, hi, block_size, g, ahead, pbuf, part.acc);
}
#endif  // WEFT_BF16_DOT


// ---------------------------------------------------------------- decode items
//
// An item is a run of segments [k0, k1) of one (decode, KV head). With few (decode, KV head) pairs
// per thread (batch 1 of a model with 3 KV heads on 2 threads) a pair's segments are cut into
// several items, each storing every segment's state in its slot of the partials buffer, and a
// reduce folds them in order; otherwise an item holds all of a pair's segments and folds them as it
// goes. Items are claimed, longest first, from a shared counter so that no thread idles while
// another works.

struct DecodeItem {
  int64_t seq, head;  // decode i, KV head h
  int64_t k0, k1;     // its segments [k0, k1)
  int64_t slot;       // the first segment's slot in the partials buffer; -1: all segments, written to out
  int64_t cost;       // keys read
};

struct DecodePlan {
  std::vector<DecodeItem> items;
  std::vector<int64_t> start;       // per decode: its first visible key
  std::vector<int64_t> first_slot;  // per (decode, KV head) cut into items: its first slot, else -1
  int64_t num_slots = 0;
};

// Pairs are cut when there are too few to keep every thread busy: into about kItemsPerThread items
// per thread in all, none under kMinPartitionTokens keys (shorter ones cost more in set-up and
// reduce than they gave: a batch-1 call of 160 keys, out of cache, took 1.1x the time uncut with
// 64-key ones). Only the speed depends on these: the results are the same however a pair is cut.
constexpr int64_t kItemsPerThread = 8;
constexpr int64_t kMinPartitionTokens = 256;

DecodePlan plan_decodes(const int64_t* rows, const int32_t* lens, const int32_t* table, int64_t n, int64_t max_blocks,
                        int64_t num_tokens, int64_t KVH, int64_t num_cache_blocks, int64_t block_size,
                        int64_t window, int64_t threads) {
  DecodePlan plan;
  plan.start.resize(n);
  int64_t total_keys = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(rows[i] >= 0 && rows[i] < num_tokens, "token_idx must lie in [0, ", num_tokens, ").");
    TORCH_CHECK_VALUE(lens[i] >= 1 && lens[i] <= max_blocks * block_size, "seq_lens must lie in [1, ",
                      max_blocks * block_size, "] (block_table columns x block size), got ", lens[i], ".");
    plan.start[i] = window > 0 ? std::max<int64_t>(0, lens[i] - window) : 0;
    for (int64_t b = plan.start[i] / block_size; b * block_size < lens[i]; ++b) {
      const int32_t id = table[i * max_blocks + b];
      TORCH_CHECK_VALUE(id >= 0 && id < num_cache_blocks, "block_table entries in use must lie in [0, ",
                        num_cache_blocks, ").");
    }
    total_keys += lens[i] - plan.start[i];
  }
  const int64_t S = segment_keys(block_size);
  const int64_t target = kItemsPerThread * threads;
  int64_t per_item = std::numeric_limits<int64_t>::max();  // segments per item
  if (threads > 1 && n * KVH < target) {
    const int64_t part_tokens = std::max(kMinPartitionTokens, (total_keys * KVH + target - 1) / target);
    per_item = (part_tokens + S - 1) / S;
  }
  plan.first_slot.assign(n * KVH, -1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k_first = plan.start[i] / S, k_end = (lens[i] - 1) / S + 1;
    const bool cut = k_end - k_first > per_item;
    for (int64_t h = 0; h < KVH; ++h) {
      if (!cut) {
        plan.items.push_back({i, h, k_first, k_end, -1, lens[i] - plan.start[i]});
        continue;
      }
      plan.first_slot[i * KVH + h] = plan.num_slots;
      for (int64_t k = k_first; k < k_end; k += per_item) {
        const int64_t k1 = std::min(k_end, k + per_item);
        const int64_t cost = std::min<int64_t>(lens[i], k1 * S) - std::max(plan.start[i], k * S);
        plan.items.push_back({i, h, k, k1, plan.num_slots + k - k_first, cost});
      }
      plan.num_slots += k_end - k_first;
    }
  }
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const DecodeItem& a, const DecodeItem& b) { return a.cost > b.cost; });
  return plan;
}


template <typename scalar_t, typename cache_t, int kC>
void decode_all(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& token_idx,
                const at::Tensor& seq_lens, const at::Tensor& block_table, double scale, at::Tensor& out,
                int64_t window, const std::optional<at::Tensor>& kv_scales, [[maybe_unused]] bool bf16_dot,
                bool int8_fast_on) {
  const int64_t n = token_idx.size(0);
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t Dc = kC > 0 ? kC * kW : D;
  const int64_t KVH = kv_cache.size(1), num_cache_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  const int64_t G = H / KVH;
  const int64_t max_blocks = block_table.size(1);
  const int64_t head_blocks = num_cache_blocks * block_size * D;  // elements per (K or V, KV head)
  const scalar_t* q = query.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const cache_t* cache = kv_cache.data_ptr<cache_t>();
  const int64_t* rows = token_idx.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), os0 = out.stride(0), os1 = out.stride(1);

  const DecodePlan plan = plan_decodes(rows, lens, table, n, max_blocks, query.size(0), KVH, num_cache_blocks,
                                       block_size, window, at::get_num_threads());
  const int64_t S = segment_keys(block_size);
  const int64_t stride = G * (D + 2);  // one slot: m [G], l [G], acc [G, D]
  std::vector<float> partials(plan.num_slots * stride);
  [[maybe_unused]] const bool int8_fast = std::is_same_v<cache_t, int8_t> && int8_fast_on;
  for_each_claimed(static_cast<int64_t>(plan.items.size()), [&](int64_t k, std::vector<float>& buf) {
    const DecodeItem& it = plan.items[k];
    const int64_t row = rows[it.seq], len = lens[it.seq], first = plan.start[it.seq];
    const scalar_t* qh = q + row * qs0 + it.head * G * qs1;
    const cache_t* keys = cache + it.head * head_blocks;
    const cache_t* values = cache + (KVH + it.head) * head_blocks;
    const int32_t* blocks = table + it.seq * max_blocks;
    const RowScales rs = head_scales(kv_scales, it.head);
    RowBuffers b = row_buffers(buf, G, Dc, block_size);
    load_rows(qh, qs1, G, Dc, static_cast<float>(scale), b.qf);
    const int64_t lo = std::max(first, it.k0 * S), hi = std::min(len, it.k1 * S);
    const Prefetcher<cache_t> ahead{keys, values, blocks, lo / block_size, (hi - 1) / block_size, block_size * D,
                                    rs.keys, rs.values, block_size};
    ahead.start();
    const KeySource<cache_t> src{keys, values, rs, blocks, block_size};
    for (int64_t seg = it.k0; seg < it.k1; ++seg) {
      const int64_t s0 = std::max(first, seg * S), s1 = std::min(len, (seg + 1) * S);
      [[maybe_unused]] const PartialView part{b.seg.m, b.seg.l, b.seg.acc};
      [[maybe_unused]] thread_local std::vector<float> scores;
      bool other = false;  // run on 512-bit int8 rows or bf16 dot products (neither batch-invariant; opt-in)
#ifdef WEFT_AVX512
      if constexpr (std::is_same_v<cache_t, int8_t> && (kC == 8 || kC == 16))
        if (int8_fast) {
          decode_item_int8<kC / 2>(qh, qs1, keys, values, rs, blocks, s0, s1, block_size, G, static_cast<float>(scale),
                                   scores, part);
          other = true;
        }
#endif
#ifdef WEFT_BF16_DOT
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16> &&
                    (kC == 8 || kC == 16))
        if (bf16_dot) {
          decode_item_bf16<kC / 4>(qh, qs1, keys, values, blocks, s0, s1, block_size, G, static_cast<float>(scale),
                                   scores, part);
          other = true;
        }
#endif
      if (!other)
        segment_rows<kC>(b.seg, G, G, Dc, src, len - 1, window, s0, s1, b.kt, b.vf32, b.kb, &ahead);
      if (it.slot < 0) {
        fold_rows(b.seg.m, b.seg.l, b.seg.acc, G, Dc, b.M, b.L, b.A);
      } else {
        float* slot = partials.data() + (it.slot + seg - it.k0) * stride;
        std::copy(b.seg.m, b.seg.m + G, slot);
        std::copy(b.seg.l, b.seg.l + G, slot + G);
        std::copy(b.seg.acc, b.seg.acc + G * Dc, slot + 2 * G);
      }
    }
    if (it.slot < 0) write_heads(b.A, b.L, G, Dc, o + row * os0 + it.head * G * os1, os1);
  });
  if (plan.num_slots == 0) return;
  std::vector<int64_t> cut;
  for (int64_t p = 0; p < n * KVH; ++p)
    if (plan.first_slot[p] >= 0) cut.push_back(p);
  for_each_claimed(static_cast<int64_t>(cut.size()), [&](int64_t k, std::vector<float>& buf) {
    const int64_t p = cut[k], i = p / KVH, h = p % KVH;
    const int64_t count = (lens[i] - 1) / S + 1 - plan.start[i] / S;
    buf.resize(G * D + 2 * G);
    float* A = buf.data();
    float* M = A + G * D;
    float* L = M + G;
    std::fill(A, A + G * D, 0.0f);
    std::fill(M, M + G, -std::numeric_limits<float>::infinity());
    std::fill(L, L + G, 0.0f);
    for (int64_t s = 0; s < count; ++s) {
      const float* slot = partials.data() + (plan.first_slot[p] + s) * stride;
      fold_rows(slot, slot + G, slot + 2 * G, G, D, M, L, A);
    }
    write_heads(A, L, G, D, o + rows[i] * os0 + h * G * os1, os1);
  });
}

}  // namespace

void weft_attention::paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                                            const at::Tensor& token_idx, const at::Tensor& seq_lens,
                                            const at::Tensor& block_table, double scale, at::Tensor out,
                                            int64_t window, const std::optional<at::Tensor>& kv_scales,
                                            bool bf16_dot, bool int8_fast) {
  const char* op = "paged_decode_attention";
  check_layouts(op, query, kv_cache, out);
  check_scales(op, kv_cache, kv_scales);
  check_index(op, "token_idx", token_idx, at::kLong, 1);
  check_index(op, "seq_lens", seq_lens, at::kInt, 1);
  check_index(op, "block_table", block_table, at::kInt, 2);
  const int64_t n = token_idx.size(0);
  TORCH_CHECK_VALUE(seq_lens.size(0) == n && block_table.size(0) == n, op,
                    ": token_idx, seq_lens and block_table need one entry (row) per decode");
  TORCH_CHECK_VALUE(window >= 0, "window must be 0 (full attention) or positive, got ", window, ".");
  if (n == 0) return;
  dispatch_query_and_cache(op, query, kv_cache, [&](auto tag, auto cache_tag) {
    using scalar_t = decltype(tag);
    using cache_t = decltype(cache_tag);
    dispatch_head_dim(query.size(2), [&](auto chunks) {
      decode_all<scalar_t, cache_t, decltype(chunks)::value>(query, kv_cache, token_idx, seq_lens, block_table, scale,
                                                              out, window, kv_scales, bf16_dot, int8_fast);
    });
  });
}
