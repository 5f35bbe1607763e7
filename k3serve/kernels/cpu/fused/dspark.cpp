// The DSpark drafter's forward in one call (issue 15): a speculative step's proposal went
// through ~40 small torch ops (~0.26 ms on the bundled demo's 64-wide draft, half of what a
// decode step costs), here a few tens of microseconds. Plain fp32 loops, parallel over the
// vocabulary for the LM head (a K3-sized draft's largest matrix).
//   ctx = RMSNorm(fc(taps)) [B, h];  x_j = embed(tok_j) + ctx + pos_j, tok = [last, mask x k]
//   per layer: x += o(SDPA(qkv(RMSNorm(x))))  (bidirectional over the k + 1 positions)
//              x += down(SiLU(g) u), [g | u] = gate_up(RMSNorm(x))
//   logits = lm_head(RMSNorm(x))[:, 1:]  -> [B, k, V]
// Reference: DSparkModel.forward (k3serve/spec/dspark.py), compared in tests/spec/test_dspark_kernel.py.
#include "core/common.h"
#include "core/panels.h"
#include "core/simd.h"

#include <vector>

namespace {

// y [M, N] = x [M, K] @ w [N, K]^T: small matrices in one thread's loop of row dots (the demo's
// whole draft ~35 us so, ~45 with its larger products through torch's GEMM, ~90 split over two
// threads), from 2^20 products (a K3-sized draft's LM head) torch's multithreaded GEMM. A
// weight in panel form (panels.h) runs panel_rows, over every thread from 2^20 products.
void matmul(const float* x, int64_t M, int64_t K, const at::Tensor& w, float* y) {
  const int64_t N = k3k::out_features(w);
  if (k3k::is_panels(w)) {
    const int64_t grain = M * N * K >= (1 << 20) ? k3k::grain_for(2 * M * K * k3k::kPanel) : w.size(0);
    at::parallel_for(0, w.size(0), grain, [&](int64_t q0, int64_t q1) {
      k3k::panel_rows(x, M, K, w.data_ptr<float>(), q0, q1, y, N);
    });
    return;
  }
  if (M * N * K >= (1 << 20)) {
    at::Tensor out = at::from_blob(y, {M, N}, w.options());
    at::linear_out(out, at::from_blob(const_cast<float*>(x), {M, K}, w.options()), w);
    return;
  }
  const float* wp = w.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = k3k::row_dot(x + m * K, wp + n * K, K);
}

// torch.nn.RMSNorm in fp32: x / sqrt(mean(x^2) + eps) * w, each of M rows of n
void rms(const float* x, int64_t M, int64_t n, const float* w, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * n;
    const float inv = 1.f / std::sqrt(k3k::dot(r, r, n) / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[m * n + i] = r[i] * inv * w[i];
  }
}

const float* f32(const at::Tensor& t) { return t.data_ptr<float>(); }

// argmax_t x[t] + sum_i u[i] wt[i, t] (the first maximum; r = 0: no bias), the bias of each
// vocabulary entry one FMA chain over i in order. AVX-512: 16 entries at a time, the bias never
// stored, each lane keeping its first maximum; the lowest index among the lanes that hold the
// overall maximum is the sequential loop's first one.
int64_t biased_argmax(const float* x, int64_t V, const float* u, const float* wt, int64_t r) {
  const auto value = [&](int64_t t) {
    float bias = 0.f;
    for (int64_t i = 0; i < r; ++i) bias = std::fma(u[i], wt[i * V + t], bias);
    return x[t] + bias;
  };
  int64_t best = 0, t = 0;
  float top = -INFINITY;
#ifdef K3K_AVX512
  if (V >= 16) {
    __m512 vtop = _mm512_set1_ps(-INFINITY);
    __m512i vbest = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; t + 16 <= V; t += 16) {
      __m512 bias = _mm512_setzero_ps();
      for (int64_t i = 0; i < r; ++i) bias = _mm512_fmadd_ps(_mm512_set1_ps(u[i]), _mm512_loadu_ps(wt + i * V + t), bias);
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(x + t), bias);
      const __mmask16 up = _mm512_cmp_ps_mask(v, vtop, _CMP_GT_OQ);
      vtop = _mm512_mask_mov_ps(vtop, up, v);
      vbest = _mm512_mask_mov_epi32(vbest, up, idx);
      idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
    }
    top = _mm512_reduce_max_ps(vtop);
    const __mmask16 at_top = _mm512_cmp_ps_mask(vtop, _mm512_set1_ps(top), _CMP_EQ_OQ);
    best = at_top ? _mm512_mask_reduce_min_epi32(at_top, vbest) : 0;
  }
#endif
  for (; t < V; ++t) {
    const float v = value(t);
    if (t == 0 || v > top) top = v, best = t;
  }
  return best;
}

}  // namespace

// taps [B, n_taps * d_t], last [B] int64; w = fc, ctx_norm, embed, pos, then per layer attn_norm,
// qkv, o, mlp_norm, gate_up, down, then norm, lm_head (DSparkModel's parameters)
at::Tensor dspark_forward(at::Tensor taps, at::Tensor last, std::vector<at::Tensor> w, int64_t heads,
                          int64_t mask_id, double eps_) {
  TORCH_CHECK(w.size() >= 6 && (w.size() - 6) % 6 == 0, "dspark_forward: 6 + 6 per layer weights, got ", w.size());
  TORCH_CHECK(taps.dim() == 2 && last.dim() == 1 && last.scalar_type() == at::kLong && last.size(0) == taps.size(0),
              "dspark_forward: taps [B, n], last [B] int64");
  for (size_t i = 0; i < w.size(); ++i)
    TORCH_CHECK(w[i].scalar_type() == at::kFloat && w[i].is_contiguous() && w[i].device().is_cpu(),
                "dspark_forward: weight ", i, " must be a contiguous float32 CPU tensor");
  using k3k::out_features;
  const int64_t B = taps.size(0), h = out_features(w[0]), V = w[2].size(0), T = w[3].size(0), L = (w.size() - 6) / 6;
  const int64_t inter = L ? out_features(w[4 + 4]) / 2 : 0, hd = h / heads;
  TORCH_CHECK(k3k::in_features(w[0]) == taps.size(1) && h % heads == 0 && mask_id >= 0 && mask_id < V && T >= 2,
              "dspark_forward: shapes disagree");
  const float eps = float(eps_), scale = 1.f / std::sqrt(float(hd));
  const int64_t R = B * T;  // every block position of every request
  std::vector<float> ctx(B * h), ctxn(B * h), x(R * h), xn(R * h), qkv(R * 3 * h), att(R * h), proj(R * h),
      gu(R * 2 * inter), act(R * inter), s(T);
  const at::Tensor t = taps.to(at::kFloat).contiguous();
  matmul(f32(t), B, taps.size(1), w[0], ctx.data());
  rms(ctx.data(), B, h, f32(w[1]), eps, ctxn.data());
  const float *emb = f32(w[2]), *pos = f32(w[3]);
  const int64_t* lp = last.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] < V, "dspark_forward: token ", lp[b], " outside the vocabulary");
    for (int64_t j = 0; j < T; ++j) {
      const float* e = emb + (j == 0 ? lp[b] : mask_id) * h;
      for (int64_t i = 0; i < h; ++i) x[(b * T + j) * h + i] = e[i] + ctxn[b * h + i] + pos[j * h + i];
    }
  }
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* lw = w.data() + 4 + 6 * l;
    rms(x.data(), R, h, f32(lw[0]), eps, xn.data());
    matmul(xn.data(), R, h, lw[1], qkv.data());  // [R, 3h]: q | k | v, each heads x hd
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hh = 0; hh < heads; ++hh)
        for (int64_t i = 0; i < T; ++i) {
          const float* q = qkv.data() + (b * T + i) * 3 * h + hh * hd;
          float peak = -INFINITY, total = 0.f;
          for (int64_t j = 0; j < T; ++j) {
            s[j] = k3k::dot(q, qkv.data() + (b * T + j) * 3 * h + h + hh * hd, hd) * scale;
            peak = std::max(peak, s[j]);
          }
          for (int64_t j = 0; j < T; ++j) total += (s[j] = std::exp(s[j] - peak));
          float* o = att.data() + (b * T + i) * h + hh * hd;
          std::fill(o, o + hd, 0.f);
          for (int64_t j = 0; j < T; ++j) {
            const float* v = qkv.data() + (b * T + j) * 3 * h + 2 * h + hh * hd;
            for (int64_t d = 0; d < hd; ++d) o[d] += s[j] / total * v[d];
          }
        }
    matmul(att.data(), R, h, lw[2], proj.data());
    for (int64_t i = 0; i < R * h; ++i) x[i] += proj[i];
    rms(x.data(), R, h, f32(lw[3]), eps, xn.data());
    matmul(xn.data(), R, h, lw[4], gu.data());  // [R, 2 inter]: gate | up
    for (int64_t r = 0; r < R; ++r)  // SiLU(g) u, the vector form (simd.h)
      k3k::activate_n(0, gu.data() + r * 2 * inter, gu.data() + r * 2 * inter + inter, act.data() + r * inter, inter,
                      0.f, 0.f, false);
    matmul(act.data(), R, inter, lw[5], proj.data());
    for (int64_t i = 0; i < R * h; ++i) x[i] += proj[i];
  }
  rms(x.data(), R, h, f32(w[4 + 6 * L]), eps, xn.data());
  std::vector<float> rows((R - B) * h);  // positions 1..k of each request
  for (int64_t b = 0; b < B; ++b)
    std::copy(xn.begin() + (b * T + 1) * h, xn.begin() + (b + 1) * T * h, rows.begin() + b * (T - 1) * h);
  auto out = at::empty({B, T - 1, V}, taps.options().dtype(at::kFloat));
  matmul(rows.data(), R - B, h, w[5 + 6 * L], out.data_ptr<float>());
  return out;
}

// Greedy drafts with the Markov head, for requests whose rows need no processing: token j is
// argmax(block[b, j] + W U[prev]) (first maximum), prev the token before it; block [B, k, V]
// fp32, U [V, r], W^T [r, V] (the head's weight transposed, so the bias is r axpy passes over
// the vocabulary rows instead of V short dots; r = 0: no head), last [B], k[b] drafts of
// request b -> [B, max k] (-1 past k[b]); the bias in fp32, as markov_bias computes it up to
// summation order.
at::Tensor dspark_greedy(at::Tensor block, at::Tensor last, at::Tensor u, at::Tensor wt, std::vector<int64_t> k) {
  TORCH_CHECK(block.dim() == 3 && block.scalar_type() == at::kFloat && block.is_contiguous(),
              "dspark_greedy: block must be contiguous float32 [B, k, V]");
  const int64_t B = block.size(0), K = block.size(1), V = block.size(2), r = u.numel() ? u.size(1) : 0;
  TORCH_CHECK(int64_t(k.size()) == B && last.numel() == B, "dspark_greedy: one draft count and token per request");
  TORCH_CHECK(!r || (u.scalar_type() == at::kFloat && wt.scalar_type() == at::kFloat && u.is_contiguous() &&
                     wt.is_contiguous() && u.size(0) == V && wt.size(0) == r && wt.size(1) == V),
              "dspark_greedy: Markov U must be contiguous float32 [V, r] and W^T [r, V]");
  auto out = at::full({B, K}, -1, last.options().dtype(at::kLong));
  const float* bp = block.data_ptr<float>();
  const int64_t* lp = last.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    int64_t prev = lp[b];
    for (int64_t j = 0; j < std::min(k[b], K); ++j) {
      TORCH_CHECK(!r || (prev >= 0 && prev < V), "dspark_greedy: token ", prev, " outside the vocabulary");
      op[b * K + j] = prev = biased_argmax(bp + (b * K + j) * V, V, r ? u.data_ptr<float>() + prev * r : nullptr,
                                           r ? wt.data_ptr<float>() : nullptr, r);
    }
  }
  return out;
}

// A plain greedy proposal in one call: dspark_forward's block logits, then dspark_greedy's
// chain (the proposer's Python between the two cost as much as the greedy kernel itself).
// `last` as a list: a one-token tensor built in Python cost a single user's step ~4 us.
at::Tensor dspark_draft(at::Tensor taps, std::vector<int64_t> last, std::vector<at::Tensor> w, int64_t heads,
                        int64_t mask_id, double eps, at::Tensor u, at::Tensor wt, std::vector<int64_t> k) {
  const at::Tensor lt = at::from_blob(last.data(), {int64_t(last.size())}, at::kLong);  // valid for this call
  return dspark_greedy(dspark_forward(taps, lt, std::move(w), heads, mask_id, eps), lt, u, wt, std::move(k));
}
