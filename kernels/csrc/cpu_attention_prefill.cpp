// Prefills of the CPU attention kernel (several new tokens per sequence, causal among themselves,
// over the cached context before them): tiles of query tokens over the register tiles of
// paged_attention.h, and the opt-in paths of AVX512_BF16 builds (bf16 dot products, AMX tiles).
// cpu_paged_attention.cpp states the kernel's rules and registers the op.

#include "paged_attention.h"

#ifdef WEFT_AMX
#include "amx_tiles.h"
#endif

namespace {

// ---------------------------------------------------------------- prefill

// A tile of query tokens times G heads is at most kMaxRows query rows: the
// more rows share a block's transposed keys, the less the transpose costs
// (32 -> 96 rows: 0.46x -> 0.7x of SDPA's speed on a 2,048-token prefill).
constexpr int64_t kMaxRows = 96;

struct PrefillItem {
  int64_t seq, head;
  int64_t j0, j1;  // new tokens [j0, j1) of the sequence
  int64_t cost;    // keys the tile reads: claimed longest first
};


// ---------------------------------------------------------------- prefill items

template <typename scalar_t, typename cache_t, int kC>
void prefill_item(const scalar_t* query, int64_t qs0, int64_t qs1, scalar_t* out, int64_t os0, int64_t os1,
                  const cache_t* keys, const cache_t* values, RowScales rs, const int32_t* blocks, int64_t context,
                  int64_t j0, int64_t j1, int64_t block_size, int64_t D, int64_t G, float scale, int64_t window,
                  std::vector<float>& buf) {
  const int64_t rows = (j1 - j0) * G;
  const int64_t Dc = kC > 0 ? kC * kW : D;
  RowBuffers b = row_buffers(buf, rows, Dc, block_size);
  for (int64_t j = j0; j < j1; ++j) load_rows(query + j * qs0, qs1, G, Dc, scale, b.qf + (j - j0) * G * Dc);
  // Token j sits at position context + j and sees keys (pos - window, pos]: blocks wholly before
  // the first token's window are never read.
  const int64_t pos0 = context + j0;
  const int64_t first = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0, last = context + j1 - 1;
  const KeySource<cache_t> src{keys, values, rs, blocks, block_size};
  const int64_t S = segment_keys(block_size);
  for (int64_t k = first / S; k * S <= last; ++k) {
    segment_rows<kC>(b.seg, rows, G, Dc, src, pos0, window, std::max(first, k * S), std::min(last + 1, (k + 1) * S),
                     b.kt, b.vf32, b.kb, static_cast<const Prefetcher<cache_t>*>(nullptr));
    fold_rows(b.seg.m, b.seg.l, b.seg.acc, rows, Dc, b.M, b.L, b.A);
  }
  for (int64_t j = j0; j < j1; ++j)
    write_heads(b.A + (j - j0) * G * Dc, b.L + (j - j0) * G, G, Dc, out + j * os0, os1);
}

// ------------------------------------------------- prefill, bf16 dot products
//
// bf16 caches on CPUs with AVX512_BF16: vdpbf16ps multiplies pairs of bf16
// and adds both products to an fp32 lane, twice the multiply-adds of an fp32
// FMA per instruction, and keys and values need no widening to fp32.
//
// Scores come out transposed, S^T [key, row], 16 query rows to a vector: the
// tile's queries are packed once as pairs along D (qp[p][r] = Q[r][2p],
// Q[r][2p+1] as one 32-bit word), and one vdpbf16ps of a key pair broadcast
// straight from the cache block adds that pair's products to 16 rows' scores.
// Keys are not copied at all, and the softmax runs down the columns: the max,
// the exponentials and the sum are lane-wise over 16 rows at once, with no
// horizontal reductions. The weights P are rounded to bf16 (as GPU flash
// attention takes P in bf16) and kept as pairs along t, pw[t/2][r]; values are
// packed per chunk as pairs along t too (vp[t/2][d] = V[t][d], V[t+1][d]), so
// one vdpbf16ps of a row's weight pair broadcast adds two keys' weighted values
// to 16 lanes of its accumulator. The query is used as it is in the cache's
// dtype, the softmax scale multiplies the fp32 scores, and each row's sum of
// weights is that of the rounded weights: the output is an exact weighted mean
// of the values with bf16 weights.
//
// Other dtypes, head sizes other than 64, 128 or 256, CPUs without the flag,
// and WEFT_ATTENTION_BF16_DOT unset or 0 take the fp32 path above.

#ifdef WEFT_BF16_DOT

// Rows per block: scores, softmax and values run a block at a time, so that its scores and weights
// stay in L1 and, on the diagonal chunk, each block skips the keys none of its rows sees.
constexpr int64_t kBfBlockRows = 48;  // 3 vectors of 16 rows
constexpr int kBfKeys = 8;            // keys per score pass: 8 keys x 3 row vectors = 24 accumulators

inline uint32_t pair_at(const uint16_t* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}


// The chunk's values [base, base + tokens) packed as vp [kb / 2, D] words: pairs of tokens, the
// one past an odd `tokens` zero (its weight is 0, and 0 x a stale NaN would not be).
template <int D>
void pack_values_bf16(const uint16_t* values, const int32_t* blocks, int64_t base, int64_t tokens,
                      int64_t block_size, uint32_t* vp) {
  // Word i of a pair's 32 lanes: element i / 2 of the first row (i even) or of the second (i odd).
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i ilo = _mm512_load_si512(lo_idx);
  const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
  for (int64_t t = 0; t < tokens; t += 2) {
    const int64_t pos = base + t;
    const uint16_t* a = values + static_cast<int64_t>(blocks[pos / block_size]) * block_size * D + pos % block_size * D;
    const int64_t pos1 = pos + 1;
    const uint16_t* b = t + 1 < tokens ? values + static_cast<int64_t>(blocks[pos1 / block_size]) * block_size * D +
                                             pos1 % block_size * D
                                       : nullptr;
    uint32_t* dst = vp + t / 2 * D;
    for (int d = 0; d < D; d += 32) {
      const __m512i x = _mm512_loadu_si512(a + d);
      const __m512i y = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(x, ilo, y));
      _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(x, ihi, y));
    }
  }
}

// S^T [kBfKeys keys, NRV x 16 rows] = scale x K . Q^T, key i's row at kr[i], the rows' query pairs
// at qp [D / 2, q_ld]; key i's scores go to s + i * s_ld.
template <int NRV, int D>
inline void score_keys_bf16(const uint16_t* const* kr, const uint32_t* qp, int64_t q_ld, float scale, float* s,
                            int64_t s_ld) {
  __m512 a[kBfKeys][NRV];
  for (int i = 0; i < kBfKeys; ++i)
    for (int v = 0; v < NRV; ++v) a[i][v] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    __m512bh q[NRV];
    for (int v = 0; v < NRV; ++v) q[v] = as_bh(_mm512_loadu_si512(qp + p * q_ld + v * 16));
    for (int i = 0; i < kBfKeys; ++i) {
      const __m512bh k = as_bh(_mm512_set1_epi32(static_cast<int32_t>(pair_at(kr[i] + 2 * p))));
      for (int v = 0; v < NRV; ++v) a[i][v] = _mm512_dpbf16_ps(a[i][v], k, q[v]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < kBfKeys; ++i)
    for (int v = 0; v < NRV; ++v) _mm512_storeu_ps(s + i * s_ld + v * 16, _mm512_mul_ps(a[i][v], sc));
}

// Online softmax of 16 rows (the lanes) over the chunk's key pairs [tp0, tp1): key t's scores at
// s + t * s_ld (kScaled: times s_scale, for scores the AMX tiles leave unscaled), visible to a row
// when its position `pos` >= base + t > `low` (pos - window, or -1; pos -1 for a padding row). The
// weights go to pw [tp, 16 rows] words as bf16 pairs (t, t + 1);
// m, l and alpha (the factor the rows' accumulators take before this chunk's values) are updated.
// kFull: every lane sees every key of the range (off the diagonal, no window edge): no masks.
template <bool kFull, bool kScaled = false>
inline void softmax_rows_bf16(const float* s, int64_t s_ld, int64_t tp0, int64_t tp1, int64_t base, const int32_t* pos,
                              const int32_t* low, float* m, float* l, float* alpha, uint32_t* pw, int64_t pw_ld,
                              float s_scale = 1.0f) {
  // Word r of the weights: row r's weights for keys t (low half) and t + 1, from cvtne2ps's halves.
  alignas(64) static const uint16_t pair_idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pv = _mm512_loadu_si512(pos), lv = _mm512_loadu_si512(low);
  auto visible = [&](int64_t t) -> __mmask16 {
    if constexpr (kFull) return 0xFFFF;
    const __m512i k = _mm512_set1_epi32(static_cast<int32_t>(base + t));
    return _mm512_cmple_epi32_mask(k, pv) & _mm512_cmpgt_epi32_mask(k, lv);
  };
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 sc = _mm512_set1_ps(s_scale);
  auto score = [&](int64_t t) {
    if constexpr (kScaled) return _mm512_mul_ps(_mm512_loadu_ps(s + t * s_ld), sc);
    return _mm512_loadu_ps(s + t * s_ld);
  };
  __m512 mx = ninf;
  for (int64_t t = 2 * tp0; t < 2 * tp1; ++t) mx = _mm512_mask_max_ps(mx, visible(t), mx, score(t));
  const __m512 m_old = _mm512_loadu_ps(m);
  const __m512 m_new = _mm512_max_ps(m_old, mx);
  // Rows that have seen no key yet keep m = -inf and take alpha 1 (exp of -inf - -inf is NaN); on a
  // row's first chunk m_old = -inf gives alpha ~ 1e-38 against an accumulator of 0.
  const __m512 al = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, ninf, _CMP_EQ_OQ),
                                         exp_approx(_mm512_sub_ps(m_old, m_new)), _mm512_set1_ps(1.0f));
  const __m512i idx = _mm512_load_si512(pair_idx);
  const __m512i high = _mm512_set1_epi32(-65536);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t tp = tp0; tp < tp1; ++tp) {
    __m512 p[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t t = 2 * tp + h;
      const __mmask16 k = visible(t);
      const __m512 x = _mm512_sub_ps(score(t), m_new);
      if constexpr (kFull) p[h] = exp16_weight(x);
      else p[h] = k ? _mm512_maskz_mov_ps(k, exp16_weight(x)) : _mm512_setzero_ps();
    }
    const __m512i w = _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    _mm512_storeu_si512(pw + tp * pw_ld, w);
    // The rounded weights, back in fp32 (a bf16 is the top half of an fp32).
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_and_si512(w, high)));
  }
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), al, sum));
  _mm512_storeu_ps(m, m_new);
  _mm512_storeu_ps(alpha, al);
}

// acc [NR rows, D] = alpha x acc + P . V over token pairs [tp0, tp1), columns [d0, d0 + ND x 16);
// row r's weight pair for tp at pw[tp * pw_ld + r].
template <int NR, int ND, int D>
inline void value_rows_bf16(const uint32_t* pw, int64_t pw_ld, const uint32_t* vp, int64_t tp0, int64_t tp1,
                            int64_t d0, const float* alpha, float* acc) {
  __m512 a[NR][ND];
  for (int r = 0; r < NR; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < ND; ++c) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d0 + c * 16), al);
  }
  for (int64_t tp = tp0; tp < tp1; ++tp) {
    __m512bh v[ND];
    for (int c = 0; c < ND; ++c) v[c] = as_bh(_mm512_loadu_si512(vp + tp * D + d0 + c * 16));
    for (int r = 0; r < NR; ++r) {
      const __m512bh pp = as_bh(_mm512_set1_epi32(static_cast<int32_t>(pw[tp * pw_ld + r])));
      for (int c = 0; c < ND; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pp, v[c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(acc + r * D + d0 + c * 16, a[r][c]);
}

// The value pass for n rows: 6 rows x 4 vectors of accumulators (head size 64), else 3 x 8.
template <int D>
inline void values_bf16(int64_t n, const uint32_t* pw, int64_t pw_ld, const uint32_t* vp, int64_t tp0, int64_t tp1,
                        const float* alpha, float* acc) {
  constexpr int ND = D == 64 ? 4 : 8;
  constexpr int NR = 24 / ND;
  for (int64_t r = 0; r < n; r += NR) {
    const int64_t k = std::min<int64_t>(NR, n - r);
    for (int64_t d0 = 0; d0 < D; d0 += ND * 16) {
      const uint32_t* p = pw + r;
      const float* al = alpha + r;
      float* ac = acc + r * D;
      switch (k) {
        case 6: if constexpr (NR >= 6) value_rows_bf16<6, ND, D>(p, pw_ld, vp, tp0, tp1, d0, al, ac); break;
        case 5: if constexpr (NR >= 5) value_rows_bf16<5, ND, D>(p, pw_ld, vp, tp0, tp1, d0, al, ac); break;
        case 4: if constexpr (NR >= 4) value_rows_bf16<4, ND, D>(p, pw_ld, vp, tp0, tp1, d0, al, ac); break;
        case 3: value_rows_bf16<3, ND, D>(p, pw_ld, vp, tp0, tp1, d0, al, ac); break;
        case 2: value_rows_bf16<2, ND, D>(p, pw_ld, vp, tp0, tp1, d0, al, ac); break;
        default: value_rows_bf16<1, ND, D>(p, pw_ld, vp, tp0, tp1, d0, al, ac); break;
      }
    }
  }
}

// An int8 cache's rows for the bf16 prefill (bf16 queries): each chunk's keys and values, times
// their scales, are rounded to bf16 into rows of their own, then read as a bf16 cache's would be.
// The rounding is a bf16 cache's (2^-9 of each value), on top of the weights' that this path
// already makes. 1.0-1.05x a bf16 cache's time here; the fp32 path took 2.6-3.3x (48 x 40 and
// 1 x 2,048 fresh tokens, scripts/int8_kv_bench.py).
struct Int8Rows {
  const int8_t* keys;
  const int8_t* values;
  RowScales rs;
};

// rows [tokens, D] (bf16 bits) = the int8 rows [base, base + tokens) of a sequence times their scales.
template <int D>
void stage_bf16(const int8_t* src, const float* row_scale, const int32_t* blocks, int64_t base, int64_t tokens,
                int64_t block_size, uint16_t* rows) {
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t pos = base + t;
    const int64_t slot = static_cast<int64_t>(blocks[pos / block_size]) * block_size + pos % block_size;
    const __m512 sc = _mm512_set1_ps(row_scale[slot]);
    for (int d = 0; d < D; d += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(widen16(src + slot * D + d), sc));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + t * D + d), reinterpret_cast<const __m256i&>(h));
    }
  }
}

#ifdef WEFT_AMX
// ------------------------------------------------------- prefill, AMX tiles
//
// On CPUs with AMX (amx_tile, amx_bf16) the bf16 prefill's two products run on tiles: one
// tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32, 8,192 multiply-adds
// where a vdpbf16ps does 32. The vdpbf16ps path's layouts are nearly the tiles' already:
// - scores S^T [16 keys, 16 rows] = K . Q^T: A is 16 key rows straight from a cache block (32 of
//   their D per tile, row stride D; so the block size must be a multiple of 16, and a group of 16
//   keys never crosses a block), B the queries' pairs qp [D / 2, ld] as they are;
// - values O [16 rows, 16 of D] += P . V: A is the weights row-major, 16 rows x 32 keys (the
//   softmax writes them as pairs per key, pw [t / 2, rows], so each 16 x 16 block of words is
//   transposed once), B the chunk's values as pairs along t, vp [t / 2, D], as packed for vdpbf16ps.
// The softmax, its masks and the rescaling between chunks stay the vdpbf16ps path's vector code;
// scores are scaled in the softmax (the tiles give Q . K unscaled). Sums are fp32, in another order.
// Linux hands a process the tile state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM); where
// that fails the vdpbf16ps path runs.

// Keys a value tile takes (its K: 16 pairs); a score tile takes 16.
constexpr int64_t kAmxKeys = 32;

// S^T [16 keys, nv x 16 rows] = K . Q^T, unscaled: the keys' rows from k (row stride D), the rows'
// query pairs at qp [D / 2, q_ld]; key i's scores go to s + i * s_ld. Tiles 0-2 hold the scores.
template <int D>
inline void score_tiles_amx(const uint16_t* k, const uint32_t* qp, int64_t q_ld, int64_t nv, float* s, int64_t s_ld) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int dd = 0; dd < D / 32; ++dd) {
    _tile_loadd(3, k + dd * 32, D * 2);
    const uint32_t* q = qp + dd * 16 * q_ld;
    _tile_loadd(4, q, q_ld * 4);
    _tile_dpbf16ps(0, 3, 4);
    if (nv > 1) {
      _tile_loadd(5, q + 16, q_ld * 4);
      _tile_dpbf16ps(1, 3, 5);
    }
    if (nv > 2) {
      _tile_loadd(6, q + 32, q_ld * 4);
      _tile_dpbf16ps(2, 3, 6);
    }
  }
  _tile_stored(0, s, s_ld * 4);
  if (nv > 1) _tile_stored(1, s + 16, s_ld * 4);
  if (nv > 2) _tile_stored(2, s + 32, s_ld * 4);
}

// For each of nv vectors of 16 rows: acc [16 rows, D] = alpha x acc + P . V over the key pairs
// [gp0, gp1) (whole tiles of 16 pairs), P the softmax's pw [pair, kBfBlockRows] (the pairs past the
// last it wrote zeroed by the caller), transposed into pr [16 rows, pr_ld] first. Tiles 0-3 hold
// four 16-column blocks of acc, 4 the weights, 5-7 the values.
template <int D>
void values_amx(int64_t nv, const uint32_t* pw, const uint32_t* vp, int64_t gp0, int64_t gp1, const float* alpha,
                float* acc, uint32_t* pr, int64_t pr_ld) {
  for (int64_t v = 0; v < nv; ++v) {
    for (int64_t gp = gp0; gp < gp1; gp += 16) {
      __m512i x[16];
      for (int i = 0; i < 16; ++i) x[i] = _mm512_loadu_si512(pw + (gp + i) * kBfBlockRows + v * 16);
      weft_amx::transpose16x16(x);
      for (int r = 0; r < 16; ++r) _mm512_storeu_si512(pr + r * pr_ld + gp, x[r]);
    }
    float* a = acc + v * 16 * D;
    for (int r = 0; r < 16; ++r) {
      const __m512 al = _mm512_set1_ps(alpha[v * 16 + r]);
      for (int d = 0; d < D; d += 16) _mm512_storeu_ps(a + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(a + r * D + d), al));
    }
    for (int d0 = 0; d0 < D; d0 += 64) {
      _tile_loadd(0, a + d0, D * 4);
      _tile_loadd(1, a + d0 + 16, D * 4);
      _tile_loadd(2, a + d0 + 32, D * 4);
      _tile_loadd(3, a + d0 + 48, D * 4);
      for (int64_t gp = gp0; gp < gp1; gp += 16) {
        _tile_loadd(4, pr + gp, pr_ld * 4);
        const uint32_t* b = vp + gp * D + d0;
        _tile_loadd(5, b, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 16, D * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, b + 32, D * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 48, D * 4);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, a + d0, D * 4);
      _tile_stored(1, a + d0 + 16, D * 4);
      _tile_stored(2, a + d0 + 32, D * 4);
      _tile_stored(3, a + d0 + 48, D * 4);
    }
  }
}

#endif  // WEFT_AMX

// A tile's rows for the bf16 paths: row r's position pos[r] and the floor low[r] its keys lie above
// (pos - window, or -1), both -1 for the padding rows [rows, ld), which see no key; and the queries
// as bf16 pairs along D, transposed, qp [D / 2, ld], the padding rows 0.
template <int D>
void tile_rows_bf16(const uint16_t* query, int64_t qs0, int64_t qs1, int64_t context, int64_t j0, int64_t rows,
                    int64_t ld, int64_t G, int64_t window, int32_t* pos, int32_t* low, uint32_t* qp) {
  for (int64_t r = 0; r < ld; ++r) {
    const int64_t p = r < rows ? context + j0 + r / G : -1;
    pos[r] = static_cast<int32_t>(p);
    low[r] = static_cast<int32_t>(window > 0 ? p - window : -1);
  }
  std::fill(qp, qp + D / 2 * ld, 0u);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* q = query + (j0 + r / G) * qs0 + r % G * qs1;
    for (int p = 0; p < D / 2; ++p) qp[p * ld + r] = pair_at(q + 2 * p);
  }
}

// prefill_item for bf16 with vdpbf16ps, or with AMX tiles (kAmx: a head size of a multiple of 64,
// a block size of 16) (the arguments are prefill_item's, the head size fixed;
// for an int8 cache, keys and values are null and i8 says where its rows are).
// Per chunk: pack its values once for the tile, then per block of kBfBlockRows rows: scores over
// the keys some row of the block sees (on the diagonal chunk the later ones are skipped), the
// softmax 16 rows at a time, and the value pass over the key pairs some row sees.
template <int D, bool kAmx = false>
void prefill_item_bf16(const uint16_t* query, int64_t qs0, int64_t qs1, c10::BFloat16* out, int64_t os0,
                       int64_t os1, const uint16_t* keys, const uint16_t* values, const int32_t* blocks,
                       int64_t context, int64_t j0, int64_t j1, int64_t block_size, int64_t G, float scale,
                       int64_t window, std::vector<float>& buf, const Int8Rows* i8 = nullptr) {
  const int64_t rows = (j1 - j0) * G;
  const int64_t ld = (rows + 15) / 16 * 16;  // rows padded to whole vectors
  const int64_t chunk = std::max<int64_t>(1, kChunkKeys / block_size) * block_size;
  // Keys are taken kGroup at a time: kBfKeys a score pass, an AMX value tile kAmxKeys.
#ifdef WEFT_AMX
  constexpr int64_t kGroup = kAmx ? kAmxKeys : kBfKeys;
#else
  static_assert(!kAmx, "AMX tiles need an AMX build");
  constexpr int64_t kGroup = kBfKeys;
#endif
  const int64_t kb = (chunk + kGroup - 1) / kGroup * kGroup;
  buf.resize(ld * D + 3 * ld + kb * kBfBlockRows);
  float* acc = buf.data();  // [ld, D] (tiles take whole vectors of 16 rows)
  float* m = acc + ld * D;  // [ld]
  float* l = m + ld;          // [ld]
  float* alpha = l + ld;      // [ld]
  float* s = alpha + ld;      // [kb, kBfBlockRows] one block's scores, transposed
  thread_local std::vector<uint32_t> words;
  words.resize(D / 2 * ld + kb / 2 * D + kb * kBfBlockRows);
  uint32_t* qp = words.data();     // [D / 2, ld] the queries as bf16 pairs, transposed
  uint32_t* vp = qp + D / 2 * ld;  // [kb / 2, D] the chunk's values
  uint32_t* pw = vp + kb / 2 * D;  // [kb / 2, kBfBlockRows] one block's weights
  [[maybe_unused]] uint32_t* pr = pw + kb / 2 * kBfBlockRows;  // [kBfBlockRows, kb / 2] AMX: pw transposed
  thread_local std::vector<int32_t> limits;
  limits.resize(2 * ld);
  int32_t* pos = limits.data();  // [ld] each row's position, -1 for padding: it sees no key
  int32_t* low = pos + ld;       // [ld] the key positions a row sees are above this
  tile_rows_bf16<D>(query, qs0, qs1, context, j0, rows, ld, G, window, pos, low, qp);
  std::fill(acc, acc + ld * D, 0.0f);
  std::fill(m, m + ld, -std::numeric_limits<float>::infinity());
  std::fill(l, l + ld, 0.0f);
#ifdef WEFT_AMX
  if constexpr (kAmx) weft_amx::configure();
#endif

  const int64_t first_key = window > 0 ? std::max<int64_t>(0, context + j0 - window + 1) : 0;
  const int64_t last_key = context + j1 - 1;
  for (int64_t base = first_key / block_size * block_size; base <= last_key; base += chunk) {
    const int64_t tokens = std::min(chunk, last_key + 1 - base);
    // Where the chunk's rows are read: the cache's blocks, or an int8 cache's staged rows (one block
    // of `chunk` rows, at 0).
    const uint16_t* kc = keys;
    const uint16_t* vc = values;
    const int32_t* bl = blocks;
    int64_t cb = base, cbs = block_size;
    if (i8 != nullptr) {
      thread_local std::vector<uint16_t> staged;
      staged.resize(2 * chunk * D);
      stage_bf16<D>(i8->keys, i8->rs.keys, blocks, base, tokens, block_size, staged.data());
      stage_bf16<D>(i8->values, i8->rs.values, blocks, base, tokens, block_size, staged.data() + chunk * D);
      static const int32_t kFirst = 0;
      kc = staged.data();
      vc = staged.data() + chunk * D;
      bl = &kFirst;
      cb = 0;
      cbs = chunk;
    }
    pack_values_bf16<D>(vc, bl, cb, tokens, cbs, vp);
    // Value tiles take whole groups of kAmxKeys: the pairs past the chunk's are zero.
    if constexpr (kAmx) std::fill(vp + (tokens + 1) / 2 * D, vp + kb / 2 * D, 0u);
    // Key t's row, the chunk's last one for t past it (a score pass takes kBfKeys keys; those
    // scores are never read).
    auto key_row = [&](int64_t t) {
      const int64_t p = cb + std::min(t, tokens - 1);
      return kc + static_cast<int64_t>(bl[p / cbs]) * cbs * D + p % cbs * D;
    };
    for (int64_t r0 = 0; r0 < rows; r0 += kBfBlockRows) {
      const int64_t n = std::min(kBfBlockRows, rows - r0);
      const int64_t nv = (n + 15) / 16;
      // Rows are in token order: the first sees the lowest keys, the last the highest.
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[r0] - window + 1 - base) : 0;
      const int64_t hi = std::min(tokens, pos[r0 + n - 1] + 1 - base);
      if (lo >= hi) continue;  // no row of the block sees this chunk: nothing changes
      const int64_t k0 = lo / kGroup * kGroup, tp1 = (hi + 1) / 2;
#ifdef WEFT_AMX
      if constexpr (kAmx) {
        // 16 keys a tile, from one block (the block size is a multiple of 16); those past hi are
        // later tokens or stale rows, and never read (every row's mask hides them).
        for (int64_t t = k0; t < hi; t += 16)
          score_tiles_amx<D>(key_row(t), qp + r0, ld, nv, s + t * kBfBlockRows, kBfBlockRows);
      }
#endif
      if constexpr (!kAmx) {
        for (int64_t t = k0; t < hi; t += kBfKeys) {
          const uint16_t* kr[kBfKeys];
          for (int i = 0; i < kBfKeys; ++i) kr[i] = key_row(t + i);
          float* st = s + t * kBfBlockRows;
          const uint32_t* q = qp + r0;
          if (nv == 3) score_keys_bf16<3, D>(kr, q, ld, scale, st, kBfBlockRows);
          else if (nv == 2) score_keys_bf16<2, D>(kr, q, ld, scale, st, kBfBlockRows);
          else score_keys_bf16<1, D>(kr, q, ld, scale, st, kBfBlockRows);
        }
      }
      for (int64_t v = 0; v < nv; ++v) {
        const int64_t r = r0 + v * 16;
        // The first row sees the fewest later keys, the last the fewest earlier ones.
        const bool full = r + 16 <= rows && pos[r] >= base + 2 * tp1 - 1 && low[r + 15] < base + k0;
        auto softmax = full ? softmax_rows_bf16<true, kAmx> : softmax_rows_bf16<false, kAmx>;
        softmax(s + v * 16, kBfBlockRows, k0 / 2, tp1, base, pos + r, low + r, m + r, l + r, alpha + r, pw + v * 16,
                kBfBlockRows, scale);
      }
#ifdef WEFT_AMX
      if constexpr (kAmx) {
        const int64_t gp1 = (tp1 + 15) / 16 * 16;  // whole value tiles; k0 / 2 is a multiple of 16
        std::fill(pw + tp1 * kBfBlockRows, pw + gp1 * kBfBlockRows, 0u);
        values_amx<D>(nv, pw, vp, k0 / 2, gp1, alpha + r0, acc + r0 * D, pr, kb / 2);
      }
#endif
      if constexpr (!kAmx) values_bf16<D>(n, pw, kBfBlockRows, vp, k0 / 2, tp1, alpha + r0, acc + r0 * D);
    }
  }
#ifdef WEFT_AMX
  if constexpr (kAmx) _tile_release();
#endif
  for (int64_t j = j0; j < j1; ++j)
    write_heads(acc + (j - j0) * G * D, l + (j - j0) * G, G, D, out + j * os0, os1);
}

#endif  // WEFT_BF16_DOT

template <typename scalar_t, typename cache_t, int kC>
void prefill_all(const at::Tensor& query, const at::Tensor& kv_cache, const int64_t* starts, const int32_t* qlens,
                 const int32_t* ctx, const int32_t* table, int64_t R, int64_t max_blocks, double scale, at::Tensor& out,
                 int64_t window, const std::optional<at::Tensor>& kv_scales, [[maybe_unused]] bool bf16_dot,
                 [[maybe_unused]] bool amx_on) {
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t KVH = kv_cache.size(1), num_cache_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  const int64_t G = H / KVH;
  const int64_t head_blocks = num_cache_blocks * block_size * D;
  const int64_t tile = std::max<int64_t>(1, kMaxRows / G);
  std::vector<PrefillItem> items;
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j0 = 0; j0 < qlens[i]; j0 += tile) {
      const int64_t j1 = std::min<int64_t>(qlens[i], j0 + tile);
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx[i] + j0 - window + 1) : 0;
      for (int64_t h = 0; h < KVH; ++h) items.push_back({i, h, j0, j1, ctx[i] + j1 - first});
    }
  std::stable_sort(items.begin(), items.end(),
                   [](const PrefillItem& a, const PrefillItem& b) { return a.cost > b.cost; });
  const scalar_t* q = query.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const cache_t* cache = kv_cache.data_ptr<cache_t>();
#ifdef WEFT_AMX
  // AMX tiles read 16 keys from one block: block sizes of a multiple of 16 (an int8 cache's staged
  // chunk is then one block of whole cache blocks), head sizes of a multiple of 64.
  const bool amx = bf16_dot && amx_on && block_size % 16 == 0 && kC * kW % 64 == 0 && weft_amx::permitted();
#endif
  for_each_claimed(static_cast<int64_t>(items.size()), [&](int64_t k, std::vector<float>& buf) {
    const PrefillItem& it = items[k];
    const int64_t first_head = it.head * G * query.stride(1);
#ifdef WEFT_BF16_DOT
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> &&
                  (std::is_same_v<cache_t, c10::BFloat16> || std::is_same_v<cache_t, int8_t>) &&
                  (kC == 8 || kC == 16 || kC == 32)) {
      if (bf16_dot) {  // the bits of the bf16s, as the intrinsics take them
        const uint16_t* q16 = reinterpret_cast<const uint16_t*>(q);
        const uint16_t *k16 = nullptr, *v16 = nullptr;
        Int8Rows i8{};
        if constexpr (std::is_same_v<cache_t, int8_t>) {
          i8 = {cache + it.head * head_blocks, cache + (KVH + it.head) * head_blocks, head_scales(kv_scales, it.head)};
        } else {
          k16 = reinterpret_cast<const uint16_t*>(cache + it.head * head_blocks);
          v16 = reinterpret_cast<const uint16_t*>(cache + (KVH + it.head) * head_blocks);
        }
        auto item = prefill_item_bf16<kC * kW>;
#ifdef WEFT_AMX
        if constexpr (kC * kW % 64 == 0) {
          if (amx) item = prefill_item_bf16<kC * kW, true>;
        }
#endif
        item(q16 + starts[it.seq] * query.stride(0) + first_head, query.stride(0),
                                   query.stride(1), o + starts[it.seq] * out.stride(0) + it.head * G * out.stride(1),
                                   out.stride(0), out.stride(1), k16, v16, table + it.seq * max_blocks, ctx[it.seq],
                                   it.j0, it.j1, block_size, G, static_cast<float>(scale), window, buf,
                                   std::is_same_v<cache_t, int8_t> ? &i8 : nullptr);
        return;
      }
    }
#endif
    prefill_item<scalar_t, cache_t, kC>(
        q + starts[it.seq] * query.stride(0) + first_head, query.stride(0), query.stride(1),
        o + starts[it.seq] * out.stride(0) + it.head * G * out.stride(1), out.stride(0), out.stride(1),
        cache + it.head * head_blocks, cache + (KVH + it.head) * head_blocks, head_scales(kv_scales, it.head),
        table + it.seq * max_blocks, ctx[it.seq], it.j0, it.j1, block_size, D, G, static_cast<float>(scale), window,
        buf);
  });
}

void check_prefills(const int64_t* starts, const int32_t* qlens, const int32_t* ctx, const int32_t* table, int64_t R,
                    int64_t max_blocks, int64_t num_tokens, int64_t num_cache_blocks, int64_t block_size,
                    int64_t window) {
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK_VALUE(qlens[i] >= 1 && ctx[i] >= 0, "query_lens must be positive and context_lens non-negative.");
    TORCH_CHECK_VALUE(starts[i] >= 0 && starts[i] + qlens[i] <= num_tokens, "query_start + query_lens must lie in [0, ",
                      num_tokens, "].");
    const int64_t seq_len = static_cast<int64_t>(ctx[i]) + qlens[i];
    TORCH_CHECK_VALUE(seq_len <= max_blocks * block_size, "context_lens + query_lens must be at most ",
                      max_blocks * block_size, " (block_table columns x block size), got ", seq_len, ".");
    const int64_t first = window > 0 ? std::max<int64_t>(0, ctx[i] - window + 1) : 0;
    for (int64_t b = first / block_size; b * block_size < seq_len; ++b) {
      const int32_t id = table[i * max_blocks + b];
      TORCH_CHECK_VALUE(id >= 0 && id < num_cache_blocks, "block_table entries in use must lie in [0, ",
                        num_cache_blocks, ").");
    }
  }
}

}  // namespace

void weft_attention::paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                                             const at::Tensor& query_start, const at::Tensor& query_lens,
                                             const at::Tensor& context_lens, const at::Tensor& block_table,
                                             double scale, at::Tensor out, int64_t window,
                                             const std::optional<at::Tensor>& kv_scales, bool bf16_dot,
                                             bool amx) {
  const char* op = "paged_prefill_attention";
  check_layouts(op, query, kv_cache, out);
  check_scales(op, kv_cache, kv_scales);
  check_index(op, "query_start", query_start, at::kLong, 1);
  check_index(op, "query_lens", query_lens, at::kInt, 1);
  check_index(op, "context_lens", context_lens, at::kInt, 1);
  check_index(op, "block_table", block_table, at::kInt, 2);
  const int64_t R = query_start.size(0);
  TORCH_CHECK_VALUE(query_lens.size(0) == R && context_lens.size(0) == R && block_table.size(0) == R, op,
                    ": query_start, query_lens, context_lens and block_table need one entry (row) per sequence");
  TORCH_CHECK_VALUE(window >= 0, "window must be 0 (full attention) or positive, got ", window, ".");
  if (R == 0) return;
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int32_t* qlens = query_lens.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1);
  check_prefills(starts, qlens, ctx, table, R, max_blocks, query.size(0), kv_cache.size(2), kv_cache.size(3), window);
  dispatch_query_and_cache(op, query, kv_cache, [&](auto tag, auto cache_tag) {
    using scalar_t = decltype(tag);
    using cache_t = decltype(cache_tag);
    dispatch_head_dim(query.size(2), [&](auto chunks) {
      prefill_all<scalar_t, cache_t, decltype(chunks)::value>(query, kv_cache, starts, qlens, ctx, table, R,
                                                               max_blocks, scale, out, window, kv_scales, bf16_dot,
                                                               amx);
    });
  });
}
