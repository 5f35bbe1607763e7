// The panel form of an fp32 projection (issue 15): W [N, K], N a multiple of 16, stored as
// panels [N/16, K, 16], panel p holding rows 16p..16p+15 column by column. A row-major GEMV
// ends every (row, token) dot in a 16-lane horizontal sum; at the small K of the decode blocks
// (a tiny model's 64-256) that sum costs as much as the dot. In panel order one vector load
// serves 16 output rows, each token's x[k] is broadcast against it, and up to 32 (row, token)
// sums build in registers with no horizontal step: 2.5-6x the row form at K = 64-256, 1-6
// tokens (a decode and a 5-row verify of the bundled demo), 2.5-3x at 1024 x 1024 for 5-16.
// Each output is one FMA chain over k in order, whatever tile or batch it sits in (batch
// invariance), and the scalar form (std::fma in the same order) gives the same bits.
// The blocks take a weight in either form (common.h out_features / as_matrix); the model packs
// its fp32 projections once (layers/common.py kernel_matrix -> panel_form here).
// Reference: x @ W^T (torch), compared in tests/model/test_block_kernels.py.
#pragma once

#include "common.h"

#include <cmath>

namespace k3k {

#ifdef __AVX512F__
// T tokens x G panels: acc[t][g] holds outputs 16g..16g+15 of token t
template <int T, int G>
inline void panel_tile(const float* x, int64_t ldx, const float* p, int64_t K, float* y, int64_t ldy) {
  __m512 acc[T][G];
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) acc[t][g] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm512_loadu_ps(p + (g * K + k) * kPanel);
    for (int t = 0; t < T; ++t) {
      const __m512 xv = _mm512_set1_ps(x[t * ldx + k]);
      for (int g = 0; g < G; ++g) acc[t][g] = _mm512_fmadd_ps(xv, w[g], acc[t][g]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(y + t * ldy + g * kPanel, acc[t][g]);
}

// panels [q0, q1) for T tokens: 8 panels a tile for 1-2 tokens (8-16 chains hide the FMA
// latency), 4 for 3-6 (24 accumulators), then 4 / 2 / 1 for what is left
template <int T>
inline void panel_tokens(const float* x, int64_t K, const float* p, int64_t q0, int64_t q1, float* y, int64_t ldy) {
  constexpr int G = T <= 2 ? 8 : 4;
  const int64_t step = K * kPanel;
  int64_t q = q0;
  for (; q + G <= q1; q += G) panel_tile<T, G>(x, K, p + q * step, K, y + q * kPanel, ldy);
  if (G > 4 && q + 4 <= q1) panel_tile<T, 4>(x, K, p + q * step, K, y + q * kPanel, ldy), q += 4;
  if (q + 2 <= q1) panel_tile<T, 2>(x, K, p + q * step, K, y + q * kPanel, ldy), q += 2;
  if (q < q1) panel_tile<T, 1>(x, K, p + q * step, K, y + q * kPanel, ldy);
}
#endif

// y[m * ldy + n] = sum_k x[m * K + k] W[n, k] for the rows n of panels [q0, q1), all M tokens
inline void panel_rows(const float* x, int64_t M, int64_t K, const float* p, int64_t q0, int64_t q1, float* y,
                       int64_t ldy) {
#ifdef __AVX512F__
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) panel_tokens<6>(x + m * K, K, p, q0, q1, y + m * ldy, ldy);
  x += m * K, y += m * ldy;
  switch (M - m) {
    case 1: return panel_tokens<1>(x, K, p, q0, q1, y, ldy);
    case 2: return panel_tokens<2>(x, K, p, q0, q1, y, ldy);
    case 3: return panel_tokens<3>(x, K, p, q0, q1, y, ldy);
    case 4: return panel_tokens<4>(x, K, p, q0, q1, y, ldy);
    case 5: return panel_tokens<5>(x, K, p, q0, q1, y, ldy);
    default: return;
  }
#else
  for (int64_t q = q0; q < q1; ++q)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t lane = 0; lane < kPanel; ++lane) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc = std::fma(x[m * K + k], p[(q * K + k) * kPanel + lane], acc);
        y[m * ldy + q * kPanel + lane] = acc;
      }
#endif
}

}  // namespace k3k
