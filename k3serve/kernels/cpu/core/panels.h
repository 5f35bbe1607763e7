// The panel forms of a projection (issue 15). fp32: W [N, K], N a multiple of 16, stored as
// panels [N/16, K, 16], panel p holding rows 16p..16p+15 column by column. A row-major GEMV
// ends every (row, token) dot in a 16-lane horizontal sum; at the small K of the decode blocks
// (a tiny model's 64-256) that sum costs as much as the dot. In panel order one vector load
// serves 16 output rows, each token's x[k] is broadcast against it, and up to 32 (row, token)
// sums build in registers with no horizontal step: 2.5-6x the row form at K = 64-256, 1-6
// tokens (a decode and a 5-row verify of the bundled demo), 2.5-3x at 1024 x 1024 for 5-16.
// Each output is one FMA chain over k in order, whatever tile or batch it sits in (batch
// invariance), and the scalar form (std::fma in the same order) gives the same bits. bf16 (with
// AVX512-BF16): the same shape in vdpbf16ps column pairs, below.
// The blocks take a weight in any form (common.h out_features / as_matrix); the model packs
// its projections once (kernels/packs.py kernel_matrix -> module.cpp panel_form).
// Reference: x @ W^T (torch), compared in tests/model/test_block_kernels.py.
#pragma once

#include "core/common.h"
#include "core/simd.h"

#include <cmath>
#include <cstring>

namespace k3k {

#ifdef __AVX512F__
// A T tokens x G panels accumulator tile (acc[t][g]: outputs 16g..16g+15 of token t), zeroed and
// stored to y [T, ldy] the same way for both panel forms
template <int T, int G>
inline void zero_tile(__m512 (&acc)[T][G]) {
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) acc[t][g] = _mm512_setzero_ps();
}
template <int T, int G>
inline void store_tile(const __m512 (&acc)[T][G], float* y, int64_t ldy) {
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(y + t * ldy + g * kPanel, acc[t][g]);
}

// fp32 panels: one column a step, 6-token tiles; 8 panels a tile for 1-2 tokens (8-16 chains
// hide the FMA latency), 4 for 3-6 (24 accumulators)
struct PanelF32 {
  using E = float;
  static constexpr int kPack = 1, kTokens = 6;
  static constexpr int panels(int T) { return T <= 2 ? 8 : 4; }
  // T tokens x G panels: acc[t][g] holds outputs 16g..16g+15 of token t
  template <int T, int G>
  static void tile(const float* x, int64_t ldx, const float* p, int64_t K, float* y, int64_t ldy) {
    __m512 acc[T][G];
    zero_tile(acc);
    for (int64_t k = 0; k < K; ++k) {
      __m512 w[G];
      for (int g = 0; g < G; ++g) w[g] = _mm512_loadu_ps(p + (g * K + k) * kPanel);
      for (int t = 0; t < T; ++t) {
        const __m512 xv = _mm512_set1_ps(x[t * ldx + k]);
        for (int g = 0; g < G; ++g) acc[t][g] = _mm512_fmadd_ps(xv, w[g], acc[t][g]);
      }
    }
    store_tile(acc, y, ldy);
  }
};
#endif

#ifdef K3K_DPBF16
// The bf16 panel form: W [N, K] bf16 (K even) as [N/16, K/2, 16, 2], panel p's pair j holding
// rows 16p..16p+15's columns 2j, 2j+1 side by side, the operand order of vdpbf16ps: one load
// serves 16 rows, each token's column pair is broadcast as one 32-bit value. Each output is one
// vdpbf16ps chain over the pairs in order. 8-token tiles, as many panels as the 32 registers
// hold beside T x G accumulators. Cache-resident matrices (tiny Kimi-Linear / K3): decode
// 1.05-1.13x the 3 x 4 row tiles (dot_tile_bf16). Matrices streaming from memory (the 400 M
// model's 2-8 MB ones, cold): one row as fast as the row tiles (0.98-1.05x), but 8-16 rows, a
// continuous batch's decode, 1.1-1.6x: 16 rows of 1024 x 1024 to 4096 x 1024 read at 17-19 GB/s
// against the row tiles' 11-13 (no horizontal sums, 11 loads per 24 vdpbf16ps against 14).
// Each tile prefetches every panel 16 lines (1 KB) ahead: G panels are G streams K * 64 bytes
// apart, more than the hardware prefetcher follows well at one row. Measured in one process,
// alternating, 400 M Kimi-Linear decode: 1 row 1.07-1.10x (bf16 and MXFP4 experts), 16 rows
// 1.09-1.10x; 4 lines ahead gained nothing, 8-32 the same, NTA lost (0.5x); tiny models 1.0x.
// Past a panel's end the prefetch touches the next panel or unmapped memory: harmless (no fault).
constexpr int64_t kPanelAhead = 16;
struct PanelBf16 {
  using E = uint16_t;
  static constexpr int kPack = 2, kTokens = 8;
  static constexpr int panels(int T) { return T <= 2 ? 8 : T <= 4 ? 6 : T <= 6 ? 4 : 3; }
  template <int T, int G>
  static void tile(const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t K2, float* y, int64_t ldy) {
    __m512 acc[T][G];
    zero_tile(acc);
    for (int64_t j = 0; j < K2; ++j) {
      __m512bh w[G];
      for (int g = 0; g < G; ++g)  // kPanelAhead lines on in each panel (the comment above)
        _mm_prefetch(reinterpret_cast<const char*>(p + (g * K2 + j + kPanelAhead) * 2 * kPanel), _MM_HINT_T0);
      for (int g = 0; g < G; ++g) w[g] = as_bh(_mm512_loadu_si512(p + (g * K2 + j) * 2 * kPanel));
      for (int t = 0; t < T; ++t) {
        int32_t pair;
        std::memcpy(&pair, x + t * ldx + 2 * j, sizeof pair);
        const __m512bh xv = as_bh(_mm512_set1_epi32(pair));
        for (int g = 0; g < G; ++g) acc[t][g] = _mm512_dpbf16_ps(acc[t][g], xv, w[g]);
      }
    }
    store_tile(acc, y, ldy);
  }
};
#endif

// panels [q0, q1) for T tokens (rows K apart): Ops::panels(T) a tile, then 4 / 2 / 1 for the rest
template <typename Ops, int T>
inline void panel_tokens(const typename Ops::E* x, int64_t K, const typename Ops::E* p, int64_t q0, int64_t q1,
                         float* y, int64_t ldy) {
  constexpr int G = Ops::panels(T);
  const int64_t step = K * kPanel, steps = K / Ops::kPack;
  int64_t q = q0;
  for (; q + G <= q1; q += G) Ops::template tile<T, G>(x, K, p + q * step, steps, y + q * kPanel, ldy);
  if (G > 4 && q + 4 <= q1) Ops::template tile<T, 4>(x, K, p + q * step, steps, y + q * kPanel, ldy), q += 4;
  if (q + 2 <= q1) Ops::template tile<T, 2>(x, K, p + q * step, steps, y + q * kPanel, ldy), q += 2;
  if (q < q1) Ops::template tile<T, 1>(x, K, p + q * step, steps, y + q * kPanel, ldy);
}

// the last `left` (< Ops::kTokens) tokens, in one tile of exactly that many
template <typename Ops, int T>
inline void panel_rest(int64_t left, const typename Ops::E* x, int64_t K, const typename Ops::E* p, int64_t q0,
                       int64_t q1, float* y, int64_t ldy) {
  if constexpr (T > 0) {
    if (left == T) return panel_tokens<Ops, T>(x, K, p, q0, q1, y, ldy);
    panel_rest<Ops, T - 1>(left, x, K, p, q0, q1, y, ldy);
  }
}

// y[m * ldy + n] = sum_k x[m * K + k] W[n, k] for the rows n of panels [q0, q1), all M tokens
template <typename Ops>
inline void panel_rows_of(const typename Ops::E* x, int64_t M, int64_t K, const typename Ops::E* p, int64_t q0,
                          int64_t q1, float* y, int64_t ldy) {
  constexpr int T = Ops::kTokens;
  int64_t m = 0;
  for (; m + T <= M; m += T) panel_tokens<Ops, T>(x + m * K, K, p, q0, q1, y + m * ldy, ldy);
  panel_rest<Ops, T - 1>(M - m, x + m * K, K, p, q0, q1, y + m * ldy, ldy);
}

// fp32 panels (x fp32 [M, K]); without AVX-512 the scalar chain, the same bits
inline void panel_rows(const float* x, int64_t M, int64_t K, const float* p, int64_t q0, int64_t q1, float* y,
                       int64_t ldy) {
#ifdef __AVX512F__
  panel_rows_of<PanelF32>(x, M, K, p, q0, q1, y, ldy);
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

// [..., N, K] fp32 -> [..., N/16, K, 16]: each matrix of the leading dims in the fp32 panel order
inline at::Tensor f32_panels(const at::Tensor& w) {
  return w.detach().unflatten(-2, {w.size(-2) / kPanel, kPanel}).transpose(-2, -1).contiguous();
}

// w [N, K] in the panel form this build reads faster, else w itself. A copy, so bounded: a
// vocabulary-sized head or a large model's projections past 64 MB stay single (the copy would
// double them, for the decode rows' gain alone). bf16 took panels up to 1 MB before 2026-12-04,
// where one decode row gains; larger ones gain at a batch's 8-16 rows (PanelBf16 above: the
// 400 M Kimi-Linear, 16 streams, 1.10-1.15x a step), and the copy costs its dense weights twice
// in memory (~80 MB of that model's 822).
inline at::Tensor panel_form(at::Tensor w) {
  if (w.dim() != 2 || !w.device().is_cpu() || w.size(0) % kPanel || w.nbytes() > (int64_t(64) << 20)) return w;
#ifdef __AVX512F__
  if (w.scalar_type() == at::kFloat) return f32_panels(w);
#endif
#ifdef K3K_DPBF16
  const int64_t P = w.size(0) / kPanel, K = w.size(1);
  if (w.scalar_type() == at::kBFloat16 && K % 2 == 0)
    return w.detach().reshape({P, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
#endif
  return w;
}

// Routed experts [E, O, I] fp32 as panels [E, O/16, I, 16] (each expert's matrix in panel_form's
// fp32 order; moe_fused.cpp's panel route) where this build reads fp32 panels and O is a multiple
// of 16, else w itself. A copy: the caller bounds it (kernels/packs.py kernel_experts).
inline at::Tensor expert_panel_form(at::Tensor w) {
#ifdef __AVX512F__
  if (w.dim() == 3 && w.device().is_cpu() && w.scalar_type() == at::kFloat && w.size(1) % kPanel == 0)
    return f32_panels(w);
#endif
  return w;
}

#ifdef K3K_DPBF16
// bf16 panels (x as bf16 bits [M, K])
inline void panel_rows_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* p, int64_t q0, int64_t q1,
                            float* y, int64_t ldy) {
  panel_rows_of<PanelBf16>(x, M, K, p, q0, q1, y, ldy);
}
#endif

}  // namespace k3k
