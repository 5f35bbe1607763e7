// The vector loops the decode kernels spend their time in (issue 15): weight-row dot products
// and the GLU activation over whole buffers. AVX-512 where compiled for it, else AVX2 + FMA
// (x86-64-v3), else a scalar form. References: the scalar k3k::dot / k3k::activate in common.h (and, through the
// kernels' tests, the torch layers they replace).
//
// Batch invariance: a row's dot product and an element's activation are computed the same way
// wherever the element sits in its buffer (masked tails, no scalar remainder loop), so a token's
// result never depends on how many other tokens share the step.
#pragma once

#include "core/common.h"

#include <algorithm>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define K3K_AVX512 1  // the masked 16-bit loads need BW + VL beside F
#elif defined(__AVX2__) && defined(__FMA__)
#define K3K_AVX2 1
#endif

namespace k3k {

inline float as_float(float v) { return v; }
inline float as_float(uint16_t v) { return bf16_bits(v); }

#ifdef K3K_AVX512
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const uint16_t* w) {  // bf16 bits -> fp32: the top half of each lane
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)w)), 16));
}
inline __m512 load16(const float* w, __mmask16 m) { return _mm512_maskz_loadu_ps(m, w); }
inline __m512 load16(const uint16_t* w, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w)), 16));
}
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }
#endif

#ifdef K3K_AVX2
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {  // bf16 bits -> fp32: the top half of each lane
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)w)), 16));
}
// the first min(left, 8) elements, zeros after them (AVX2 has no 16-bit masked load: staged)
template <typename W>
inline __m256 load8(const W* w, int64_t left) {
  if (left >= 8) return load8(w);
  alignas(32) float v[8] = {};
  for (int64_t i = 0; i < left; ++i) v[i] = as_float(w[i]);
  return _mm256_load_ps(v);
}
// lanes summed in one fixed order (halves, then pairs, then the last two)
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// sum_k x[k] w[k], w float or bf16 bits. Four accumulators over 64 columns (one FMA chain would
// wait on its own latency: about a core's memory bandwidth, so the dot would set the speed),
// then 16 at a time, then a masked tail. Float and bf16 rows of equal values give equal sums, so
// a bf16 row may be staged as floats (reused over several tokens) without changing a result.
#ifdef K3K_AVX512
// row_dot's four chains added into one vector, before its horizontal sum
template <typename W>
__attribute__((always_inline)) inline __m512 row_dot_vec(const float* x, const W* w, int64_t K) {
  __m512 v0 = _mm512_setzero_ps(), v1 = _mm512_setzero_ps(), v2 = _mm512_setzero_ps(), v3 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    v0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16(w + k), v0);
    v1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), load16(w + k + 16), v1);
    v2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 32), load16(w + k + 32), v2);
    v3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 48), load16(w + k + 48), v3);
  }
  for (; k < K; k += 16) {
    const __mmask16 m = tail_mask(K - k);
    v0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), load16(w + k, m), v0);
  }
  return _mm512_add_ps(_mm512_add_ps(v0, v1), _mm512_add_ps(v2, v3));
}

// sum(v[m]) for 16 vectors, as one vector: lane 4k + j holds sum(v[k + 4j]) (three levels of
// 128-bit-lane shuffles and adds: ~3 instructions a sum, where a reduction apiece takes ~8).
// Each sum's tree involves its own vector's lanes alone, so it never depends on the others.
inline __m512 sums16(const __m512* v) {
  __m512 a[8], b[4];
  for (int k = 0; k < 8; ++k)  // 256-bit halves: v[2k]'s in the low one, v[2k + 1]'s in the high
    a[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // 128-bit lanes: v[4k], v[4k + 1], v[4k + 2], v[4k + 3]
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xDD));
  // within lanes: b[0] holds v0..v3 (lane k: v[k]), b[1] v4..v7, b[2] v8..v11, b[3] v12..v15
  const __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
  const __m512 u1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u0), _mm512_castps_pd(u1))),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u0), _mm512_castps_pd(u1))));
}

// sum(v[r]) in lane r for n <= 16 vectors (sums16 with its lanes in row order; lanes past n 0)
inline __m512 sums_rows(const __m512* v, int n) {
  __m512 a[16];
  for (int m = 0; m < 16; ++m) {  // sums16 puts v[k + 4j] in lane 4k + j: row r = 4k + j goes to m = k + 4j
    const int r = 4 * (m % 4) + m / 4;
    a[m] = r < n ? v[r] : _mm512_setzero_ps();
  }
  return sums16(a);
}
#endif

template <typename W>
inline float row_dot(const float* x, const W* w, int64_t K) {
#ifdef K3K_AVX512
  return _mm512_reduce_add_ps(row_dot_vec(x, w, K));
#elif defined(K3K_AVX2)
  // the same shape at 8 lanes: four accumulators over 32 columns, then 8 at a time into v0
  __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps(), v2 = _mm256_setzero_ps(), v3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    v0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8(w + k), v0);
    v1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), load8(w + k + 8), v1);
    v2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), load8(w + k + 16), v2);
    v3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), load8(w + k + 24), v3);
  }
  for (; k < K; k += 8) v0 = _mm256_fmadd_ps(load8(x + k, K - k), load8(w + k, K - k), v0);
  return reduce_add8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
#else
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) acc += x[k] * as_float(w[k]);
  return acc;
#endif
}

// out[t * ldo] = row_dot(x[t], w, K) for T <= 3 token rows x[t]: each 8 weight columns loaded
// (and widened, for bf16) once for all T tokens, each token's sum in row_dot's own four chains
// and order, so the results are row_dot's bits whatever tile a token sits in.
template <int T, typename W>
inline void row_dot_tile(const float* const* x, const W* w, int64_t K, float* out, int64_t ldo) {
#ifdef K3K_AVX2
  __m256 a[T][4];
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < 4; ++c) a[t][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    for (int c = 0; c < 4; ++c) {
      const __m256 wv = load8(w + k + 8 * c);
      for (int t = 0; t < T; ++t) a[t][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x[t] + k + 8 * c), wv, a[t][c]);
    }
  for (; k < K; k += 8) {
    const __m256 wv = load8(w + k, K - k);
    for (int t = 0; t < T; ++t) a[t][0] = _mm256_fmadd_ps(load8(x[t] + k, K - k), wv, a[t][0]);
  }
  for (int t = 0; t < T; ++t)
    out[t * ldo] = reduce_add8(_mm256_add_ps(_mm256_add_ps(a[t][0], a[t][1]), _mm256_add_ps(a[t][2], a[t][3])));
#else
  for (int t = 0; t < T; ++t) out[t * ldo] = row_dot(x[t], w, K);
#endif
}

// out[m * ldo] = row_dot(x[m], w, K) for all M token rows, three at a time
template <typename W>
inline void row_dot_rows(const float* const* x, int64_t M, const W* w, int64_t K, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) row_dot_tile<3>(x + m, w, K, out + m * ldo, ldo);
  if (M - m == 2) row_dot_tile<2>(x + m, w, K, out + m * ldo, ldo);
  if (M - m == 1) row_dot_tile<1>(x + m, w, K, out + m * ldo, ldo);
}

#if defined(K3K_AVX512) && defined(__AVX512BF16__)
#define K3K_DPBF16 1  // bf16 weight rows meet bf16 activations in vdpbf16ps (32 products per instruction)

// bf16 bits (round to nearest even) of n floats: the activations' form for bf16 dots. Wherever a
// bf16 weight meets an activation, the blocks have rounded it to bf16 already (the model dtype),
// so this is exact there.
inline void to_bf16_bits(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i))));
  for (; i < n; ++i) out[i] = c10::BFloat16(x[i]).x;
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// out[m * ldo + r] = sum_k xb[m * ldx + k] w[r][k] for R weight rows and T activation rows, all
// bf16 bits, fp32 sums: products of bf16 pairs are exact in fp32, summed by vdpbf16ps in two
// chains over alternate 32-column blocks, then a masked tail into the first. A tile of 3 rows x 4
// tokens holds 24 accumulators and loads 14 vectors per 24 products' instructions (one row
// against 8 tokens loaded 18 per 16). Each (row, token) sum takes the same steps whatever tile
// it sits in, so no result depends on R, T or the batch (batch invariance).
template <int R, int T>
inline void dot_tile_bf16(const uint16_t* xb, int64_t ldx, const uint16_t* const* w, int64_t K, float* out,
                          int64_t ldo, int64_t pf = 0) {
  __m512 a0[R][T], a1[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) a0[r][t] = a1[r][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    __m512bh w0[R];
    if (pf)
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + k + pf), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + k + pf + 32), _MM_HINT_T1);
      }
    for (int r = 0; r < R; ++r) w0[r] = as_bh(_mm512_loadu_si512(w[r] + k));
    for (int t = 0; t < T; ++t) {
      const __m512bh x = as_bh(_mm512_loadu_si512(xb + t * ldx + k));
      for (int r = 0; r < R; ++r) a0[r][t] = _mm512_dpbf16_ps(a0[r][t], x, w0[r]);
    }
    for (int r = 0; r < R; ++r) w0[r] = as_bh(_mm512_loadu_si512(w[r] + k + 32));
    for (int t = 0; t < T; ++t) {
      const __m512bh x = as_bh(_mm512_loadu_si512(xb + t * ldx + k + 32));
      for (int r = 0; r < R; ++r) a1[r][t] = _mm512_dpbf16_ps(a1[r][t], x, w0[r]);
    }
  }
  for (; k < K; k += 32) {
    const __mmask32 mk = K - k >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (K - k)) - 1);
    __m512bh w0[R];
    for (int r = 0; r < R; ++r) w0[r] = as_bh(_mm512_maskz_loadu_epi16(mk, w[r] + k));
    for (int t = 0; t < T; ++t) {
      const __m512bh x = as_bh(_mm512_maskz_loadu_epi16(mk, xb + t * ldx + k));
      for (int r = 0; r < R; ++r) a0[r][t] = _mm512_dpbf16_ps(a0[r][t], x, w0[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][t], a1[r][t]));
}

template <int R>
inline void dot_rows_tiled_bf16(const uint16_t* xb, int64_t ldx, int64_t M, const uint16_t* const* w, int64_t K,
                                float* out, int64_t ldo, int64_t pf) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4, pf = 0) dot_tile_bf16<R, 4>(xb + m * ldx, ldx, w, K, out + m * ldo, ldo, pf);
  xb += m * ldx, out += m * ldo;
  switch (M - m) {
    case 1: dot_tile_bf16<R, 1>(xb, ldx, w, K, out, ldo, pf); break;
    case 2: dot_tile_bf16<R, 2>(xb, ldx, w, K, out, ldo, pf); break;
    case 3: dot_tile_bf16<R, 3>(xb, ldx, w, K, out, ldo, pf); break;
    default: break;
  }
}

// Weight rows per tile for M activation rows of a matrix (or the matrices one call reads) of
// `bytes`: 3 from 6 rows up, where the tile's reuse of each activation load pays (cold 1024 x 2048
// bf16 matrices, 16 rows: 10 -> 15 GB/s); below, 3 still where the weights sit in cache (up to
// 1 MB: a tiny model's, whose 2-chain dots one row at a time waited on their latency: 128 x 384,
// one row 3.4 -> 2.4 us), 1 for larger ones, which stream from memory and read faster one row at
// a time (4096 x 1024 cold, 1-2 rows: ~150 vs ~160-195 us). The tile never changes a bit.
inline int tile_rows_bf16(int64_t M, int64_t bytes = INT64_MAX) { return M >= 6 || bytes <= (1 << 20) ? 3 : 1; }

// R (1 to 3) weight rows w[r] against the M rows of xb: out[m * ldo + r]. pf (elements, 0 for
// none): while the first activation tile runs, each w[r] + pf is prefetched into L2 along with
// it, the next tile's rows where they sit that far on, so a matrix streaming from memory is
// fetched while the tiles of the rows before it compute.
inline void dot_rows_bf16(const uint16_t* xb, int64_t ldx, int64_t M, const uint16_t* const* w, int R, int64_t K,
                          float* out, int64_t ldo, int64_t pf = 0) {
  switch (R) {
    case 1: return dot_rows_tiled_bf16<1>(xb, ldx, M, w, K, out, ldo, pf);
    case 2: return dot_rows_tiled_bf16<2>(xb, ldx, M, w, K, out, ldo, pf);
    case 3: return dot_rows_tiled_bf16<3>(xb, ldx, M, w, K, out, ldo, pf);
    default: TORCH_CHECK(false, "dot_rows_bf16 takes 1 to 3 weight rows, got ", R);
  }
}

// one weight row w against the M rows of xb: out[m * ldo]
inline void dot_rows_bf16(const uint16_t* xb, int64_t ldx, int64_t M, const uint16_t* w, int64_t K, float* out,
                          int64_t ldo) {
  dot_rows_tiled_bf16<1>(xb, ldx, M, &w, K, out, ldo, 0);
}
#endif

// MXFP4 rows meet vectors in "split" order: per 32-column group, its 16 even columns then its
// 16 odd ones, the order the nibbles decode in (no interleaving permutes: decoding is the cost
// of a 4-bit dot here). `split32` puts a vector in that order once per token.
inline void split32(const float* x, int64_t K, float* out) {
  for (int64_t g = 0; g < K; g += 32)
    for (int64_t i = 0; i < 16; ++i) out[g + i] = x[g + 2 * i], out[g + 16 + i] = x[g + 2 * i + 1];
}

// row_dot(xs, decode_mxfp4_row<true>(...)) for xs in split order, without writing the row out:
// the same decoded vectors into the same accumulators in the same order (two groups per 64
// columns, a last odd group into v0), so the sum is bitwise the staged one's.
#ifdef K3K_AVX512
// mxfp4_row_dot's vector before its horizontal sum (row_dot_vec's, bitwise)
__attribute__((always_inline)) inline __m512 mxfp4_row_dot_vec(const float* xs, const uint8_t* packed,
                                                               const uint8_t* scale, int64_t K) {
  const float* pow2 = e8m0().v;
  __m512 v0 = _mm512_setzero_ps(), v1 = _mm512_setzero_ps(), v2 = _mm512_setzero_ps(), v3 = _mm512_setzero_ps();
  int64_t g = 0;
  const int64_t groups = K / 32;
  for (; g + 2 <= groups; g += 2) {
    __m512 a, b, c, d;
    decode_mxfp4_split(packed + g * 16, pow2[scale[g]], a, b);
    decode_mxfp4_split(packed + (g + 1) * 16, pow2[scale[g + 1]], c, d);
    const float* x = xs + g * 32;
    v0 = _mm512_fmadd_ps(_mm512_loadu_ps(x), a, v0);
    v1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), b, v1);
    v2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + 32), c, v2);
    v3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + 48), d, v3);
  }
  if (g < groups) {
    __m512 a, b;
    decode_mxfp4_split(packed + g * 16, pow2[scale[g]], a, b);
    v0 = _mm512_fmadd_ps(_mm512_loadu_ps(xs + g * 32), a, v0);
    v0 = _mm512_fmadd_ps(_mm512_loadu_ps(xs + g * 32 + 16), b, v0);
  }
  return _mm512_add_ps(_mm512_add_ps(v0, v1), _mm512_add_ps(v2, v3));
}
#endif

inline float mxfp4_row_dot(const float* xs, const uint8_t* packed, const uint8_t* scale, int64_t K) {
#ifdef K3K_AVX512
  return _mm512_reduce_add_ps(mxfp4_row_dot_vec(xs, packed, scale, K));
#elif defined(K3K_AVX2)
  // row_dot's 32-column step is one group: its four split vectors into v0..v3
  const float* pow2 = e8m0().v;
  __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps(), v2 = _mm256_setzero_ps(), v3 = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / 32; ++g) {
    __m256 e0, e1, o0, o1;
    decode_mxfp4_split(packed + g * 16, pow2[scale[g]], e0, e1, o0, o1);
    const float* x = xs + g * 32;
    v0 = _mm256_fmadd_ps(_mm256_loadu_ps(x), e0, v0);
    v1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), e1, v1);
    v2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), o0, v2);
    v3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), o1, v3);
  }
  return reduce_add8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
#else
  std::vector<float> row(K);
  decode_mxfp4_row<true>(packed, scale, K, row.data());
  return row_dot(xs, row.data(), K);
#endif
}

#ifdef K3K_DPBF16
// MXFP4 rows for vdpbf16ps: a packed row becomes bf16 bits once per (expert, row) and meets all
// of that expert's tokens in dot_rows_bf16, so its decode is paid once per row, not per token,
// and the dot runs at the bf16 rate (one vdpbf16ps per 32 products, no per-group scaling).
//
// "nib64" order, the order for_mxfp4_rows_bf16 decodes in: a 64-column block (code byte i holds
// columns 2i and 2i + 1) comes out as two 32-word halves, half h holding, for each 128-bit lane
// k = 0..3, 8 columns mxfp4_col(k, 8h + j), j = 0..7, where lane 0 holds the first group's even
// columns, lane 1 the second group's evens, 2 the first's odds, 3 the second's odds; a lone last
// 32-column group its evens 0-14, odds 1-15, evens 16-30, odds 17-31. Activations are put in the
// same order once per token (mxfp4_order_bf16).
inline int64_t mxfp4_col(int64_t lane, int64_t i) { return (lane & 1) * 32 + 2 * i + (lane >> 1); }

inline void mxfp4_order_bf16(const uint16_t* x, int64_t K, uint16_t* out) {
  int64_t g = 0;
  for (; g + 64 <= K; g += 64)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t k = 0; k < 4; ++k)
        for (int64_t j = 0; j < 8; ++j) out[g + 32 * h + 8 * k + j] = x[g + mxfp4_col(k, 8 * h + j)];
  for (; g < K; g += 32)
    for (int64_t q = 0; q < 4; ++q)  // evens 0-14, odds 1-15, evens 16-30, odds 17-31
      for (int64_t j = 0; j < 8; ++j) out[g + 8 * q + j] = x[g + 16 * (q >> 1) + 2 * j + (q & 1)];
}

// The scales a row can fold into bf16 exponents: E2M1 magnitudes 0.5 .. 6 times 2^(s - 127) stay
// bf16 normals for s in [2, 252] (vdpbf16ps reads denormals as zero; 0xFF is NaN).
constexpr int kFoldLo = 2, kFoldHi = 252;

// R packed rows (row r: K/2 code bytes at packed[r], K/32 E8M0 scales at scale[r]; K a multiple
// of 32) as bf16 bits in "nib64" order (mxfp4_order: the order in-lane shuffles produce), each
// value E2M1 x 2^(s - 127) exactly. Per 64 columns (two groups, 32 code bytes): the bytes go to
// all four 128-bit lanes, lanes 0-1 keep low nibbles (even columns), 2-3 high ones (odd); two
// vpshufb look up each code's bf16 low and high byte, two byte unpacks make 64 bf16 words, and
// the group's scale is added to the exponent of the nonzero ones (bits + (s - 127) << 7) - no
// lane-crossing permute, where a 16-bit permute per 32 values set the speed before (one token:
// ~15 GB/s of codes on two cores). Hands each 64-column block to pair(col, w0[R], w1[R]) (its
// first and second 32 words) and a lone last group to lone(col, v[R]). Returns false, having
// stopped early, when a row's scale lies outside [kFoldLo, kFoldHi]: the caller takes an FP32
// path (or its rows one at a time). `pf` (bytes, 0 for none): each row's codes (and scales)
// that far on are prefetched as the row is read, so rows streaming from memory arrive in time
// where several decode side by side (the hardware prefetcher lost them: 4 rows at once without
// it ran slower than one).
// Always inlined: compiled apart, its pair() lambda kept the caller's accumulators in memory,
// a load and a store around every vdpbf16ps (400 M experts, 16 tokens: ~10-16% of moe_experts).
template <int R, typename Pair, typename Lone>
__attribute__((always_inline)) inline bool for_mxfp4_rows_bf16(const uint8_t* const* packed,
                                                               const uint8_t* const* scale, int64_t K, Pair&& pair,
                                                               Lone&& lone, int64_t pf = 0) {
  // E2M1 as bf16 bits (0, .5, 1, 1.5, 2, 3, 4, 6, then negated): low bytes, high bytes, per lane
  const __m512i lo_tab = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, char(0x80), char(0xC0), 0, 0x40, char(0x80), char(0xC0),
                                                              0, 0, char(0x80), char(0xC0), 0, 0x40, char(0x80), char(0xC0)));
  const __m512i hi_tab = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, char(0x80),
                                                              char(0xBF), char(0xBF), char(0xBF), char(0xC0), char(0xC0),
                                                              char(0xC0), char(0xC0)));
  // a pair's two 16-bit shifts (one dword) to the lanes of its groups: 0 and 2 the first, 1 and 3 the second
  const __m512i spread = _mm512_set_epi64(0x0302030203020302, 0x0302030203020302, 0x0100010001000100,
                                          0x0100010001000100, 0x0302030203020302, 0x0302030203020302,
                                          0x0100010001000100, 0x0100010001000100);
  const __m512i low4 = _mm512_set1_epi8(15), magnitude = _mm512_set1_epi16(0x7FFF);
  const int64_t groups = K / 32;
  alignas(64) int16_t sh[R][32];
  if (pf)
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(scale[r] + pf / 16), _MM_HINT_T0);
  for (int64_t c = 0; c < groups; c += 32) {  // 32 groups' shifts at a time
    const int64_t n = std::min<int64_t>(32, groups - c);
    const __mmask32 live = n == 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << n) - 1);
    for (int r = 0; r < R; ++r) {
      const __m512i s = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(live, scale[r] + c));
      if (_mm512_mask_cmplt_epi16_mask(live, s, _mm512_set1_epi16(kFoldLo)) |
          _mm512_mask_cmpgt_epi16_mask(live, s, _mm512_set1_epi16(kFoldHi)))
        return false;
      _mm512_store_si512(sh[r], _mm512_slli_epi16(_mm512_sub_epi16(s, _mm512_set1_epi16(127)), 7));
    }
    int64_t g = c;
    for (; g + 2 <= c + n; g += 2) {
      __m512i w0[R], w1[R];
      if (pf && !(g & 3))  // the 64-byte line pf bytes on in each row
        for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(packed[r] + pf + g * 16), _MM_HINT_T0);
      for (int r = 0; r < R; ++r) {
        const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed[r] + g * 16)));
        const __m512i idx = _mm512_and_si512(_mm512_mask_srli_epi16(b, 0xFFFF0000u, b, 4), low4);
        const __m512i lo = _mm512_shuffle_epi8(lo_tab, idx), hi = _mm512_shuffle_epi8(hi_tab, idx);
        int32_t both;
        std::memcpy(&both, &sh[r][g - c], sizeof both);
        const __m512i shift = _mm512_shuffle_epi8(_mm512_set1_epi32(both), spread);
        const __m512i a = _mm512_unpacklo_epi8(lo, hi), d = _mm512_unpackhi_epi8(lo, hi);
        w0[r] = _mm512_mask_add_epi16(a, _mm512_test_epi16_mask(a, magnitude), a, shift);  // +-0 keep their bits
        w1[r] = _mm512_mask_add_epi16(d, _mm512_test_epi16_mask(d, magnitude), d, shift);
      }
      pair(g * 32, w0, w1);
    }
    if (g < c + n) {  // the rows' last, lone group: lanes 0 and 2 low nibbles, 1 and 3 high ones
      __m512i v[R];
      for (int r = 0; r < R; ++r) {
        const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed[r] + g * 16)));
        const __m512i idx = _mm512_and_si512(_mm512_mask_srli_epi16(b, 0xFF00FF00u, b, 4), low4);
        const __m512i lo = _mm512_shuffle_epi8(lo_tab, idx), hi = _mm512_shuffle_epi8(hi_tab, idx);
        // bytes 0-7 of each lane (unpacklo) then 8-15 (unpackhi), lanes 0-1 of each
        const __m512i w = _mm512_shuffle_i64x2(_mm512_unpacklo_epi8(lo, hi), _mm512_unpackhi_epi8(lo, hi), 0x44);
        v[r] = _mm512_mask_add_epi16(w, _mm512_test_epi16_mask(w, magnitude), w, _mm512_set1_epi16(sh[r][g - c]));
      }
      lone(g * 32, v);
    }
  }
  return true;
}

// the row's bf16 bits into out [K] (nib64 order); pf as for_mxfp4_rows_bf16's
inline bool decode_mxfp4_row_bf16(const uint8_t* packed, const uint8_t* scale, int64_t K, uint16_t* out,
                                  int64_t pf = 0) {
  return for_mxfp4_rows_bf16<1>(
      &packed, &scale, K,
      [&](int64_t k, const __m512i* a, const __m512i* b) {
        _mm512_storeu_si512(out + k, a[0]), _mm512_storeu_si512(out + k + 32, b[0]);
      },
      [&](int64_t k, const __m512i* v) { _mm512_storeu_si512(out + k, v[0]); }, pf);
}

// dot_tile_bf16<1, T> of each of R decoded rows, decoding in registers (no staging: the form for
// a few tokens, where a row's store and reload would cost as much as its dots): out[t * ldo + r].
// Each (row, token) sum takes dot_tile_bf16's instructions on the same values in the same two
// chains, so the same bits as the staged form and whatever R; R rows side by side give R x 2 x T
// independent vdpbf16ps chains where one row's two would wait on their latency, and each
// activation load serves R rows (one token, prefetching: 22 -> 31 GB/s of codes on two cores).
template <int R, int T>
inline bool mxfp4_dot_tile_bf16(const uint16_t* xs, int64_t ldx, const uint8_t* const* packed,
                                const uint8_t* const* scale, int64_t K, float* out, int64_t ldo, int64_t pf = 0) {
  __m512 a0[R][T], a1[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) a0[r][t] = a1[r][t] = _mm512_setzero_ps();
  const bool ok = for_mxfp4_rows_bf16<R>(
      packed, scale, K,
      [&](int64_t k, const __m512i* w0, const __m512i* w1) {
        for (int t = 0; t < T; ++t) {
          const __m512bh x0 = as_bh(_mm512_loadu_si512(xs + t * ldx + k)), x1 = as_bh(_mm512_loadu_si512(xs + t * ldx + k + 32));
          for (int r = 0; r < R; ++r) {
            a0[r][t] = _mm512_dpbf16_ps(a0[r][t], x0, as_bh(w0[r]));
            a1[r][t] = _mm512_dpbf16_ps(a1[r][t], x1, as_bh(w1[r]));
          }
        }
      },
      [&](int64_t k, const __m512i* v) {
        for (int t = 0; t < T; ++t) {
          const __m512bh x = as_bh(_mm512_loadu_si512(xs + t * ldx + k));
          for (int r = 0; r < R; ++r) a0[r][t] = _mm512_dpbf16_ps(a0[r][t], x, as_bh(v[r]));
        }
      }, pf);
  if (ok)
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][t], a1[r][t]));
  return ok;
}

// Rows per in-register MXFP4 tile for T <= 4 tokens: as many as keep R x T x 2 accumulators
// (and the decoded pair) within the 32 vector registers (3 x 3: 18 + 6 + the 5 tables; 400 M
// experts, 16 tokens: ~5% over 2 x 3).
constexpr int mxfp4_tile_rows(int64_t T) { return T <= 2 ? 4 : T == 3 ? 3 : 2; }
#endif

#ifdef K3K_AVX512
// e^x, 16 lanes: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), e^r by Cephes' degree-6
// expf polynomial, times 2^n by scalef; within 2 ulp of expf over the clamped range.
inline __m512 exp16(__m512 x) {
  // clamp with x second: min/max return their second operand when either is NaN, so NaN stays NaN
  x = _mm512_max_ps(_mm512_set1_ps(-87.3365447504f), _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// tanh through expm1(2x) (accurate near 0: a Taylor series below |2x| = 0.5, e^2x - 1 above),
// +-1 beyond |x| = 9 as fast_tanh
inline __m512 tanh16(__m512 x) {
  const __m512 y = _mm512_add_ps(x, x);
  __m512 t = _mm512_set1_ps(1.f / 40320.f);
  for (float c : {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f})
    t = _mm512_fmadd_ps(t, y, _mm512_set1_ps(c));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(t, y), y, y);  // y + y^2 (1/2 + y/6 + ...)
  const __m512 ay = _mm512_abs_ps(y);
  const __m512 e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ay, _mm512_set1_ps(0.5f), _CMP_LT_OQ),
                                        _mm512_sub_ps(exp16(y), _mm512_set1_ps(1.f)), small);
  const __m512 th = _mm512_div_ps(e, _mm512_add_ps(e, _mm512_set1_ps(2.f)));
  const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(9.f), _CMP_GT_OQ);
  return _mm512_mask_blend_ps(big, th, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                            _mm512_set1_ps(-1.f), _mm512_set1_ps(1.f)));
}

// 1 / (1 + e^-x); 0 where e^-x overflows fp32 (x < -88.38), as the scalar form's 1 / inf
inline __m512 sigmoid16(__m512 x) {
  const __m512 s = _mm512_div_ps(_mm512_set1_ps(1.f),
                                 _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.3762626647949f), _CMP_LT_OQ), s,
                              _mm512_setzero_ps());
}

// round to the nearest bf16 (ties to even), NaN -> quiet NaN, as c10::BFloat16 does
inline __m512 round_bf16_16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                                     _mm512_set1_epi32(int(0xFFFF0000u)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(r), _mm512_set1_ps(NAN));
}
#endif

#ifdef K3K_AVX2
// exp16 .. round_bf16_16 at 8 lanes, the same arithmetic: 2^n as two exact power-of-two
// products (AVX2 has no scalef; n in [-126, 128] splits into halves that are normal floats)
inline __m256 pow2i8(__m256i n) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23)); }
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.3365447504f), _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);  // NaN lanes: p is NaN
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2i8(half)), pow2i8(_mm256_sub_epi32(ni, half)));
}
inline __m256 abs8(__m256 x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
inline __m256 tanh8(__m256 x) {
  const __m256 y = _mm256_add_ps(x, x);
  __m256 t = _mm256_set1_ps(1.f / 40320.f);
  for (float c : {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f})
    t = _mm256_fmadd_ps(t, y, _mm256_set1_ps(c));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(t, y), y, y);
  const __m256 e = _mm256_blendv_ps(_mm256_sub_ps(exp8(y), _mm256_set1_ps(1.f)), small,
                                    _mm256_cmp_ps(abs8(y), _mm256_set1_ps(0.5f), _CMP_LT_OQ));
  const __m256 th = _mm256_div_ps(e, _mm256_add_ps(e, _mm256_set1_ps(2.f)));
  const __m256 one = _mm256_blendv_ps(_mm256_set1_ps(-1.f), _mm256_set1_ps(1.f),
                                      _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
  return _mm256_blendv_ps(th, one, _mm256_cmp_ps(abs8(x), _mm256_set1_ps(9.f), _CMP_GT_OQ));
}
inline __m256 sigmoid8(__m256 x) {
  const __m256 s = _mm256_div_ps(_mm256_set1_ps(1.f),
                                 _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
  return _mm256_blendv_ps(s, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-88.3762626647949f), _CMP_LT_OQ));
}
inline __m256 round_bf16_8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                                     _mm256_set1_epi32(int(0xFFFF0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_set1_ps(NAN), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
#endif

// Natural log of x > 0 (normal floats), Cephes' logf: the mantissa taken to [sqrt(1/2), sqrt(2)),
// a degree-8 polynomial in m - 1, the exponent's ln 2 in two parts; within ~2 ulp of logf.
constexpr float kLogPoly[9] = {7.0376836292E-2f, -1.1514610310E-1f, 1.1676998740E-1f, -1.2420140846E-1f,
                               1.4249322787E-1f, -1.6668057665E-1f, 2.0000714765E-1f, -2.4999993993E-1f,
                               3.3333331174E-1f};
#ifdef K3K_AVX512
inline __m512 log16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  __m512 e = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127)));
  __m512 m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFF)),
                                                 _mm512_set1_epi32(0x3F800000)));  // [1, 2)
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356237f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.f));
  const __m512 t = _mm512_sub_ps(m, _mm512_set1_ps(1.f)), z = _mm512_mul_ps(t, t);
  __m512 y = _mm512_set1_ps(kLogPoly[0]);
  for (int i = 1; i < 9; ++i) y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(kLogPoly[i]));
  y = _mm512_mul_ps(_mm512_mul_ps(y, t), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fmadd_ps(z, _mm512_set1_ps(-0.5f), y);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(t, y));
}
// softplus with torch's threshold (x past 20 is x): log1p(e^x) as log(u) * e^x / (u - 1), u = 1 + e^x
// (the correction keeps log1p's accuracy where u rounds), e^x itself where u rounds to 1
inline __m512 softplus16(__m512 x) {
  const __m512 y = exp16(x), u = _mm512_add_ps(_mm512_set1_ps(1.f), y), d = _mm512_sub_ps(u, _mm512_set1_ps(1.f));
  const __mmask16 exact = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_EQ_OQ);
  const __m512 l = _mm512_mask_blend_ps(exact, _mm512_mul_ps(log16(u), _mm512_div_ps(y, d)), y);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(20.f), _CMP_GT_OQ), l, x);
}
#endif
#ifdef K3K_AVX2
inline __m256 log8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF)),
                                                 _mm256_set1_epi32(0x3F800000)));
  const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356237f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
  e = _mm256_blendv_ps(e, _mm256_add_ps(e, _mm256_set1_ps(1.f)), big);
  const __m256 t = _mm256_sub_ps(m, _mm256_set1_ps(1.f)), z = _mm256_mul_ps(t, t);
  __m256 y = _mm256_set1_ps(kLogPoly[0]);
  for (int i = 1; i < 9; ++i) y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(kLogPoly[i]));
  y = _mm256_mul_ps(_mm256_mul_ps(y, t), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fmadd_ps(z, _mm256_set1_ps(-0.5f), y);
  return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(t, y));
}
inline __m256 softplus8(__m256 x) {
  const __m256 y = exp8(x), u = _mm256_add_ps(_mm256_set1_ps(1.f), y), d = _mm256_sub_ps(u, _mm256_set1_ps(1.f));
  const __m256 l = _mm256_blendv_ps(_mm256_mul_ps(log8(u), _mm256_div_ps(y, d)), y,
                                    _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_EQ_OQ));
  return _mm256_blendv_ps(l, x, _mm256_cmp_ps(x, _mm256_set1_ps(20.f), _CMP_GT_OQ));
}
#endif

// out[i] = f(x[i]) for n floats, 16 (AVX-512, masked tail) or 8 (AVX2, staged tail) lanes at a
// time, else one at a time; an element's result never depends on where it sits. out may alias x.
template <typename F16, typename F8, typename F1>
inline void map_n(const float* x, float* out, int64_t n, F16&& f16, F8&& f8, F1&& f1) {
#ifdef K3K_AVX512
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(out + i, m, f16(_mm512_maskz_loadu_ps(m, x + i), i));
  }
#elif defined(K3K_AVX2)
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t left = std::min<int64_t>(8, n - i);
    const __m256 r = f8(load8(x + i, left), i);
    if (left == 8) {
      _mm256_storeu_ps(out + i, r);
    } else {
      alignas(32) float v[8];
      _mm256_store_ps(v, r);
      std::copy(v, v + left, out + i);
    }
  }
#else
  for (int64_t i = 0; i < n; ++i) out[i] = f1(x[i], i);
#endif
}

// KDA's per-channel decay g = e^gate for n channels from z (f_b(f_a x)) and dt_bias: K3
// lb * sigmoid(rate (z + dt)), Kimi-Linear -rate softplus(z + dt) (common.h / kda_decode.cpp's
// scalar forms, in vector transcendentals: ~3 libm calls per channel were a tenth of a decode step)
inline void kda_decay_n(const float* z, const float* dt, int64_t n, bool k3, float lb, float rate, float* g) {
  map_n(z, g, n,
#ifdef K3K_AVX512
        [&](__m512 v, int64_t i) {
          const __m512 zz = _mm512_add_ps(v, _mm512_maskz_loadu_ps(tail_mask(n - i), dt + i));
          return exp16(k3 ? _mm512_mul_ps(_mm512_set1_ps(lb), sigmoid16(_mm512_mul_ps(_mm512_set1_ps(rate), zz)))
                          : _mm512_mul_ps(_mm512_set1_ps(-rate), softplus16(zz)));
        },
#else
        [](auto v, int64_t) { return v; },
#endif
#ifdef K3K_AVX2
        [&](__m256 v, int64_t i) {
          const __m256 zz = _mm256_add_ps(v, load8(dt + i, n - i));
          return exp8(k3 ? _mm256_mul_ps(_mm256_set1_ps(lb), sigmoid8(_mm256_mul_ps(_mm256_set1_ps(rate), zz)))
                         : _mm256_mul_ps(_mm256_set1_ps(-rate), softplus8(zz)));
        },
#else
        [](auto v, int64_t) { return v; },
#endif
        [&](float v, int64_t i) {
          const float zz = v + dt[i];
          const float sp = zz > 20.f ? zz : std::log1p(std::exp(zz));
          return std::exp(k3 ? lb * sigmoid(rate * zz) : -rate * sp);
        });
}

// out[i] = x[i] * sigmoid(x[i]) (SiLU); out may alias x
inline void silu_n(const float* x, float* out, int64_t n) {
  map_n(x, out, n,
#ifdef K3K_AVX512
        [](__m512 v, int64_t) { return _mm512_mul_ps(v, sigmoid16(v)); },
#else
        [](auto v, int64_t) { return v; },
#endif
#ifdef K3K_AVX2
        [](__m256 v, int64_t) { return _mm256_mul_ps(v, sigmoid8(v)); },
#else
        [](auto v, int64_t) { return v; },
#endif
        [](float v, int64_t) { return v * sigmoid(v); });
}

// out[i] = sigmoid(x[i]); out may alias x
inline void sigmoid_n(const float* x, float* out, int64_t n) {
  map_n(x, out, n,
#ifdef K3K_AVX512
        [](__m512 v, int64_t) { return sigmoid16(v); },
#else
        [](auto v, int64_t) { return v; },
#endif
#ifdef K3K_AVX2
        [](__m256 v, int64_t) { return sigmoid8(v); },
#else
        [](auto v, int64_t) { return v; },
#endif
        [](float v, int64_t) { return sigmoid(v); });
}

// out[i] = act(g[i], u[i]) (common.h `activate`), rounded to bf16 when `rnd`; out may alias g.
inline void activate_n(int64_t act, const float* g, const float* u, float* out, int64_t n, float beta, float lb,
                       bool rnd) {
#ifdef K3K_AVX512
  const __m512 vb = _mm512_set1_ps(beta), vl = _mm512_set1_ps(lb);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 G = _mm512_maskz_loadu_ps(m, g + i), U = _mm512_maskz_loadu_ps(m, u + i);
    __m512 a;
    if (act == 0) {
      a = _mm512_mul_ps(_mm512_mul_ps(G, sigmoid16(G)), U);
    } else {
      const __m512 lin = lb > 0.f ? _mm512_mul_ps(vl, tanh16(_mm512_div_ps(U, vl))) : U;
      a = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(vb, tanh16(_mm512_div_ps(G, vb))), sigmoid16(G)), lin);
    }
    _mm512_mask_storeu_ps(out + i, m, rnd ? round_bf16_16(a) : a);
  }
#elif defined(K3K_AVX2)
  const __m256 vb = _mm256_set1_ps(beta), vl = _mm256_set1_ps(lb);
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t left = std::min<int64_t>(8, n - i);  // a tail is staged through a full vector
    const __m256 G = load8(g + i, left), U = load8(u + i, left);
    __m256 a;
    if (act == 0) {
      a = _mm256_mul_ps(_mm256_mul_ps(G, sigmoid8(G)), U);
    } else {
      const __m256 lin = lb > 0.f ? _mm256_mul_ps(vl, tanh8(_mm256_div_ps(U, vl))) : U;
      a = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(vb, tanh8(_mm256_div_ps(G, vb))), sigmoid8(G)), lin);
    }
    if (rnd) a = round_bf16_8(a);
    if (left == 8) {
      _mm256_storeu_ps(out + i, a);
    } else {
      alignas(32) float v[8];
      _mm256_store_ps(v, a);
      std::copy(v, v + left, out + i);
    }
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    const float a = activate(act, g[i], u[i], beta, lb);
    out[i] = rnd ? round_bf16(a) : a;
  }
#endif
}

}  // namespace k3k
