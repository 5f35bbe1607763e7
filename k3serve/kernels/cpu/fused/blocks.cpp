// Whole decode blocks in one call each (issue 15): a KDA attention block, a gated-MLA attention
// block and a MoE block, for steps whose rows all run one position at a time (decodes and
// verify passes). A tiny model's decode step is dispatch overhead, not math: the torch forms of
// these blocks are 20-40 small ops each; these run the same arithmetic in one call on plain
// float buffers, rounding to the model dtype exactly where torch's form materialises a
// bf16 tensor (every linear's output, norms, the GLU), the KDA/MLA cores in fp32.
// References: KimiDeltaAttention / GatedMLA / SparseMoE / GluMLP forward (k3serve/layers),
// compared in tests/model/test_block_kernels.py.
#include "core/common.h"
#include "ops.h"
#include "packs.h"
#include "core/panels.h"
#include "core/simd.h"

#include <c10/util/Float8_e4m3fn.h>

#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using k3k::kSmallM;

using Buf = std::vector<float>;

using k3k::round_bf16;

using k3k::row_dot;

// y[m, n] (row stride ldy) = sum_k x[m, k] W[n, k], fp32 accumulation; W float or bf16 bits.
// About 2^18 flops per chunk (128 KB of bf16 weights): a 1 MB expert or shared-expert matrix
// splits over both cores (at 2^20 it ran on one, 30 vs 37-45 GB/s cold on 2 cores).
// With vdpbf16ps (K3K_DPBF16), bf16 weights take the activations as bf16 bits `xb` [M, K]
// (converted once per call, before the parallel region); otherwise xb is unused.
// `bytes`: the weights the whole call reads (the tile's choice: simd.h tile_rows_bf16).
template <typename W>
void gemv_rows(const float* x, const uint16_t* xb, int64_t M, int64_t K, const W* w, int64_t begin, int64_t end,
               float* y, int64_t ldy, bool rnd, int64_t bytes) {
#ifdef K3K_DPBF16
  if constexpr (std::is_same_v<W, uint16_t>) {
    const int tile = k3k::tile_rows_bf16(M, bytes);
    for (int64_t n = begin; n < end; n += tile) {
      const int R = int(std::min<int64_t>(tile, end - n));
      const uint16_t* rows[3] = {w + n * K, w + std::min(n + 1, end - 1) * K, w + std::min(n + 2, end - 1) * K};
      k3k::dot_rows_bf16(xb, K, M, rows, R, K, y + n, ldy, tile * K);  // prefetching the next tile
      if (rnd)
        for (int64_t m = 0; m < M; ++m)
          for (int r = 0; r < R; ++r) y[m * ldy + n + r] = round_bf16(y[m * ldy + n + r]);
    }
    return;
  }
#endif
  (void)xb, (void)bytes;
  std::vector<const float*> xr(M);
  for (int64_t m = 0; m < M; ++m) xr[m] = x + m * K;
  for (int64_t n = begin; n < end; ++n) {
    k3k::row_dot_rows(xr.data(), M, w + n * K, K, y + n, ldy);
    if (rnd)
      for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = round_bf16(y[m * ldy + n]);
  }
}

// x [M, K] as bf16 bits for bf16 weights' dots, or empty where they are not used
std::vector<uint16_t> bf16_input(const float* x, int64_t M, int64_t K, bool bf16_weights) {
#ifdef K3K_DPBF16
  if (bf16_weights) {
    std::vector<uint16_t> xb(M * K);
    k3k::to_bf16_bits(x, M * K, xb.data());
    return xb;
  }
#endif
  (void)x, (void)M, (void)K, (void)bf16_weights;
  return {};
}

// One projection of a shared input: W [N, K] (float or bf16), output y with row stride ldy.
struct Target {
  const at::Tensor* w;
  float* y;
  int64_t ldy;
};

void check_weight(const at::Tensor& w) {
  const bool f32 = w.scalar_type() == at::kFloat, bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(f32 || bf16, "block weight dtype ", w.scalar_type(), " is not supported");
  TORCH_CHECK(w.is_contiguous() && (w.dim() == 2 || (f32 && w.dim() == 3 && w.size(2) == k3k::kPanel) ||
                                    (bf16 && w.dim() == 4 && w.size(2) == k3k::kPanel && w.size(3) == 2)),
              "block weight must be a contiguous 2-D tensor, fp32 panels [N/16, K, 16] or bf16 panels "
              "[N/16, K/2, 16, 2], got ", w.sizes(), " ", w.scalar_type());
#ifndef K3K_DPBF16
  TORCH_CHECK(!(bf16 && w.dim() == 4), "bf16 panels need a build with AVX512-BF16 (kernels.panel_form makes none here)");
#endif
}

// Several projections of the same x [M, K] (q, k, v, f_a, b, g of a KDA block, ...) in one
// parallel region over all their output rows: one fork/join instead of one per matrix, and the
// small ones no longer leave a core idle; one projection alone (Proj) is the same call with one
// target (chunking: gemv_rows, or panel_rows for a weight in panel form). The region counts
// blocks of 16 output rows, a panel each, so no chunk splits a panel.
void gemv_many(const float* x, int64_t M, int64_t K, const std::vector<Target>& targets, bool rnd) {
  using k3k::kPanel;
  std::vector<int64_t> first{0};
  bool any_bf16 = false;
  int64_t bytes = 0;
  for (const Target& t : targets) {
    check_weight(*t.w);
    TORCH_CHECK(k3k::in_features(*t.w) == K, "block weight has ", k3k::in_features(*t.w), " columns, the input ", K);
    first.push_back(first.back() + (k3k::out_features(*t.w) + kPanel - 1) / kPanel);
    any_bf16 |= t.w->scalar_type() == at::kBFloat16;  // rows or panels: both read x as bf16 bits
    bytes += t.w->numel() * t.w->element_size();
  }
  const std::vector<uint16_t> xb = bf16_input(x, M, K, any_bf16);
  at::parallel_for(0, first.back(), k3k::grain_for(2 * K * M * kPanel, 1 << 18), [&](int64_t begin, int64_t end) {
    for (size_t j = 0; j < targets.size(); ++j) {
      const int64_t lo = std::max(begin, first[j]) - first[j], hi = std::min(end, first[j + 1]) - first[j];
      if (lo >= hi) continue;
      const Target& t = targets[j];
      const int64_t N = k3k::out_features(*t.w), n0 = lo * kPanel, n1 = std::min(hi * kPanel, N);
      if (k3k::is_panels(*t.w)) {
#ifdef K3K_DPBF16
        if (t.w->dim() == 4)
          k3k::panel_rows_bf16(xb.data(), M, K, reinterpret_cast<const uint16_t*>(t.w->data_ptr<at::BFloat16>()), lo,
                               hi, t.y, t.ldy);
        else
#endif
          k3k::panel_rows(x, M, K, t.w->data_ptr<float>(), lo, hi, t.y, t.ldy);
        if (rnd)
          for (int64_t m = 0; m < M; ++m)
            for (int64_t n = n0; n < n1; ++n) t.y[m * t.ldy + n] = round_bf16(t.y[m * t.ldy + n]);
      } else if (t.w->scalar_type() == at::kFloat) {
        gemv_rows(x, xb.data(), M, K, t.w->data_ptr<float>(), n0, n1, t.y, t.ldy, rnd, bytes);
      } else {
        gemv_rows(x, xb.data(), M, K, reinterpret_cast<const uint16_t*>(t.w->data_ptr<at::BFloat16>()), n0, n1, t.y,
                  t.ldy, rnd, bytes);
      }
    }
  });
}

Buf floats(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "block tensors must be float32 or bfloat16");
  at::Tensor c = x.contiguous();
  Buf out(c.numel());
  if (c.scalar_type() == at::kFloat) {
    std::memcpy(out.data(), c.data_ptr<float>(), sizeof(float) * out.size());
  } else {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(c.data_ptr<at::BFloat16>());
    for (size_t i = 0; i < out.size(); ++i) out[i] = k3k::bf16_bits(p[i]);
  }
  return out;
}

// One projection of the block: y = x @ W^T rounded to the model dtype (bf16 when `rnd`).
struct Proj {
  bool rnd;
  void operator()(const float* x, int64_t M, const at::Tensor& w, float* y, int64_t ldy) const {
    gemv_many(x, M, k3k::in_features(w), {{&w, y, ldy}}, rnd);
  }
  void many(const float* x, int64_t M, int64_t K, const std::vector<Target>& targets) const {
    gemv_many(x, M, K, targets, rnd);
  }
  float r(float v) const { return rnd ? round_bf16(v) : v; }
  // RMSNorm over n values in place with HF's rounding points (layers/norm.py rms_norm)
  void norm(float* x, int64_t n, const Buf& wp, float eps) const {
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) x[i] = r(r(wp[i]) * r(x[i] * inv));
  }
};

// an absent weight is passed from Python as an empty tensor
inline bool has(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

at::Tensor as_tensor(const Buf& y, int64_t R, int64_t d, const at::Tensor& like) {
  auto out = at::empty({R, d}, like.options());
  if (like.scalar_type() == at::kFloat) {
    std::memcpy(out.data_ptr<float>(), y.data(), sizeof(float) * R * d);
  } else {
    at::BFloat16* p = out.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < R * d; ++i) p[i] = at::BFloat16(y[i]);  // exact: values are already bf16
  }
  return out;
}

template <typename T>
void write_rows(const Buf& lat, int64_t R, int64_t width, const int64_t* rows, T* cache, bool fp8, float kv_scale) {
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < width; ++j) {
      float v = lat[i * width + j];
      if (fp8) v = std::min(448.f, std::max(-448.f, v / kv_scale));  // scaled, saturating (layers/mla.py to_cache)
      cache[rows[i] * width + j] = T(v);
    }
}

}  // namespace

at::Tensor fast_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && (w.dim() == 2 || k3k::is_panels(w)) && x.size(1) == k3k::in_features(w),
              "linear: x [M, K] and W [N, K] (or its panels [N/16, K, 16]) disagree");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear: x and W dtypes differ");
  if (x.size(0) > kSmallM || !(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16))
    return k3k::gemm(x, w);
  const int64_t M = x.size(0), N = k3k::out_features(w);
  Buf xf = floats(x), y(M * N);
  Proj{x.scalar_type() == at::kBFloat16}(xf.data(), M, w.contiguous(), y.data(), N);
  return as_tensor(y, M, N, x);
}

// act(gate, up) computed in fp32 and rounded to the inputs' dtype (layers/activation.py).
at::Tensor glu_act(at::Tensor gate, at::Tensor up, int64_t act, double beta, double linear_beta) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type() && gate.dim() == 2,
              "glu: gate and up must be [rows, n] of one dtype");
  Buf g = floats(gate), u = floats(up);
  const Proj p{gate.scalar_type() == at::kBFloat16};
  k3k::activate_n(act, g.data(), u.data(), g.data(), int64_t(g.size()), float(beta), float(linear_beta), p.rnd);
  return as_tensor(g, gate.size(0), gate.size(1), gate);
}

// w: the layer's weights (packs.h KdaWeights). x [R, d] are the normed rows in step order.
at::Tensor kda_block(at::Tensor x, const k3k::KdaWeights& w, at::Tensor conv_state, at::Tensor rec_state,
                     at::Tensor slots, at::Tensor starts, double lower_bound, double eps,
                     c10::optional<at::Tensor> rec_buf, c10::optional<at::Tensor> conv_buf) {
  using namespace k3k;
  check_f32(conv_state, "conv_state", 3);
  check_f32(rec_state, "rec_state", 4);
  check_i64(slots, "slots");
  check_i64(starts, "starts");
  const int64_t R = x.size(0), d = x.size(1), H = rec_state.size(1), D = rec_state.size(2), P = H * D;
  const int64_t K = conv_state.size(1) + 1, S = slots.size(0), Da = out_features(w.f_a_proj);
  TORCH_CHECK(out_features(w.q_proj) == P && in_features(w.o_proj) == P && starts.size(0) == S + 1, "kda_block shapes disagree");
  const int64_t* st = starts.data_ptr<int64_t>();
  TORCH_CHECK(st[0] == 0 && st[S] == R, "starts must run from 0 to the rows given");
  int64_t longest = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(st[s + 1] >= st[s], "starts must not decrease");
    const int64_t slot = slots.data_ptr<int64_t>()[s];
    TORCH_CHECK(slot >= 0 && slot < rec_state.size(0) && slot < conv_state.size(0), "state slot ", slot,
                " out of range");
    longest = std::max(longest, st[s + 1] - st[s]);
  }
  const Proj proj{x.scalar_type() == at::kBFloat16};
  Buf xf = floats(x), u(R * 3 * P), fa(R * Da), z(R * P), b(R * H), gate(R * P), y(R * P), out(R * d);
  // every projection of x in one region, then the low-rank second halves
  const bool low_rank_gate = has(w.g_b_proj);
  Buf ga(low_rank_gate ? R * out_features(w.g_proj) : 0);
  proj.many(xf.data(), R, d, {{&w.q_proj, u.data(), 3 * P}, {&w.k_proj, u.data() + P, 3 * P}, {&w.v_proj, u.data() + 2 * P, 3 * P},
                             {&w.f_a_proj, fa.data(), Da}, {&w.b_proj, b.data(), H},
                             low_rank_gate ? Target{&w.g_proj, ga.data(), out_features(w.g_proj)} : Target{&w.g_proj, gate.data(), P}});
  proj(fa.data(), R, w.f_b_proj, z.data(), P);
  if (low_rank_gate) proj(ga.data(), R, w.g_b_proj, gate.data(), P);
  at::Tensor taps[3], fp32[3];
  const at::Tensor* conv[3] = {&w.q_conv, &w.k_conv, &w.v_conv};
  const at::Tensor* fp32_in[3] = {&w.dt_bias, &w.a_log, &w.o_norm};
  for (int part = 0; part < 3; ++part) {
    taps[part] = conv[part]->to(at::kFloat).contiguous();
    TORCH_CHECK(taps[part].numel() == P * K, "conv taps must be [P, 1, K]");
  }
  for (int j = 0; j < 3; ++j) fp32[j] = fp32_in[j]->to(at::kFloat).contiguous();
  TORCH_CHECK(fp32[0].numel() == P && fp32[1].numel() == H && fp32[2].numel() == D, "dt_bias [P], A_log [H], o_norm [D]");
  KdaRows a{};
  a.u = u.data(), a.ldu = 3 * P, a.z = z.data(), a.ldz = P, a.b = b.data(), a.ldb = H, a.gate = gate.data(), a.ldg = P;
  for (int part = 0; part < 3; ++part) a.conv_w[part] = taps[part].data_ptr<float>();
  a.dt_bias = fp32[0].data_ptr<float>(), a.a_log = fp32[1].data_ptr<float>(), a.o_norm = fp32[2].data_ptr<float>();
  a.conv_state = conv_state.data_ptr<float>(), a.rec_state = rec_state.data_ptr<float>();
  a.slots = slots.data_ptr<int64_t>(), a.starts = st, a.S = S, a.H = H, a.D = D, a.K = K, a.longest = longest;
  a.lower_bound = float(lower_bound), a.eps = float(eps), a.y = y.data();
  if (rec_buf.has_value()) {
    check_f32(*rec_buf, "rec_buf", 5);
    check_f32(*conv_buf, "conv_buf", 4);
    TORCH_CHECK(rec_buf->size(0) == S && rec_buf->size(1) >= longest && conv_buf->size(1) == rec_buf->size(1),
                "record buffers must be [S, T, ...] with T >= the longest sequence");
    a.rec_buf = rec_buf->data_ptr<float>(), a.conv_buf = conv_buf->data_ptr<float>(), a.record_len = rec_buf->size(1);
  }
  kda_rows(a);
  for (auto& v : y) v = proj.r(v);  // o.to(x.dtype) before o_proj
  proj(y.data(), R, w.o_proj, out.data(), d);
  return as_tensor(out, R, d, x);
}

// w: the layer's weights (packs.h MlaWeights). Writes the rows' latents at cache_rows, then attends. An fp8
// cache with a scale (forward/cache.py) holds latent / kv_scale: attention is linear in the rows,
// so the softmax scale and the mixed output take kv_scale (1.0: unit scale, every other dtype).
at::Tensor mla_block(at::Tensor x, const k3k::MlaWeights& w, at::Tensor cache, at::Tensor cache_rows,
                     at::Tensor table, at::Tensor seq, at::Tensor pos, int64_t block, double scale, int64_t heads,
                     int64_t nope, int64_t kv_lora, double norm_eps, double kv_scale) {
  using namespace k3k;
  check_i64(cache_rows, "cache_rows");
  TORCH_CHECK(cache.dim() == 2 && cache.is_contiguous(), "cache must be [rows, c + r]");
  const int64_t R = x.size(0), d = x.size(1), width = out_features(w.kv_a_proj);
  const int64_t qdim = out_features(has(w.q_a_norm) ? w.q_b_proj : w.q_a_proj);
  TORCH_CHECK(cache.size(1) == width && cache_rows.size(0) == R, "latent rows and cache disagree");
  const Proj proj{x.scalar_type() == at::kBFloat16};
  const int64_t ql = out_features(w.q_a_proj), gdim = has(w.g_proj) ? out_features(w.g_proj) : 0;
  Buf xf = floats(x), q(R * qdim), lat(R * width), qa(has(w.q_a_norm) ? R * ql : 0), g(R * gdim);
  // q (or q_a), the latent and the output gate are projections of x: one region
  std::vector<Target> of_x{{&w.q_a_proj, has(w.q_a_norm) ? qa.data() : q.data(), ql}, {&w.kv_a_proj, lat.data(), width}};
  if (gdim) of_x.push_back({&w.g_proj, g.data(), gdim});
  proj.many(xf.data(), R, d, of_x);
  if (has(w.q_a_norm)) {
    const Buf nw = floats(w.q_a_norm);
    for (int64_t i = 0; i < R; ++i) proj.norm(qa.data() + i * ql, ql, nw, float(norm_eps));
    proj(qa.data(), R, w.q_b_proj, q.data(), qdim);
  }
  const Buf kvw = floats(w.kv_a_norm);
  for (int64_t i = 0; i < R; ++i) proj.norm(lat.data() + i * width, kv_lora, kvw, float(norm_eps));
  const int64_t* rows = cache_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(rows[i] >= 0 && rows[i] < cache.size(0), "cache row ", rows[i], " outside the cache");
  switch (cache.scalar_type()) {
    case at::kFloat: write_rows(lat, R, width, rows, cache.data_ptr<float>(), false, 1.f); break;
    case at::kBFloat16: write_rows(lat, R, width, rows, cache.data_ptr<at::BFloat16>(), false, 1.f); break;
    case at::kFloat8_e4m3fn:
      write_rows(lat, R, width, rows, cache.data_ptr<c10::Float8_e4m3fn>(), true, float(kv_scale));
      break;
    default: TORCH_CHECK(false, "latent cache dtype ", cache.scalar_type(), " is not supported");
  }
  at::Tensor qt = at::from_blob(q.data(), {R, heads, qdim / heads}, x.options().dtype(at::kFloat));
  at::Tensor att =
      mla_decode(qt, nope, cache, w.kv_b_proj.view({heads, -1, kv_lora}), table, seq, pos, block, scale * kv_scale);
  const int64_t hv = att.size(1) * att.size(2);
  Buf o(att.data_ptr<float>(), att.data_ptr<float>() + R * hv), out(R * d);
  if (kv_scale != 1.0)
    for (auto& v : o) v *= float(kv_scale);
  if (gdim) {
    TORCH_CHECK(gdim == hv, "g_proj has ", gdim, " rows, the heads' output ", hv);
    for (int64_t i = 0; i < R * hv; ++i) o[i] *= sigmoid(g[i]);
  }
  for (auto& v : o) v = proj.r(v);  // out.to(x.dtype) before o_proj
  proj(o.data(), R, w.o_proj, out.data(), d);
  return as_tensor(out, R, d, x);
}

// w: the layer's weights (packs.h MoeWeights). x [N, d], any number of rows (torch's GEMM past kSmallM).
at::Tensor moe_block(at::Tensor x, const k3k::MoeWeights& w, int64_t topk, bool use_sigmoid,
                     bool renorm, double scaling, int64_t groups, int64_t keep, int64_t act, double beta,
                     double linear_beta, double eps) {
  x = x.contiguous();
  const int64_t R = x.size(0), d = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto [ids, weights] = moe_route(x, w.gate, w.score_bias, topk, use_sigmoid, renorm, scaling, groups, keep);
  if (R > kSmallM) {  // prefill-sized: torch's GEMMs for the dense projections
    at::Tensor z = w.latent_down.has_value() ? k3k::gemm(x, *w.latent_down) : x;
    at::Tensor y = moe_experts(z.to(at::kFloat).contiguous(), ids, weights, w.w1, w.w1_scale, w.w3, w.w3_scale, w.w2, w.w2_scale,
                               act, beta, linear_beta, bf16).to(x.scalar_type());
    if (w.latent_down.has_value()) y = k3k::gemm(w.latent_norm.has_value() ? rms_norm(y, *w.latent_norm, eps) : y, *w.latent_up);
    if (w.shared_gate.has_value())
      y = y + k3k::gemm(glu_act(k3k::gemm(x, *w.shared_gate), k3k::gemm(x, *w.shared_up), act, beta, linear_beta), *w.shared_down);
    return y;
  }
  const Proj proj{bf16};
  Buf xf = floats(x);
  Buf z;
  const int64_t L = w.latent_down.has_value() ? k3k::out_features(*w.latent_down) : d, I = w.shared_gate.has_value() ? k3k::out_features(*w.shared_gate) : 0;
  Buf g(R * I), u(R * I);
  // the latent down projection and the shared experts' gate and up are projections of x: one region
  std::vector<Target> of_x;
  if (w.latent_down.has_value()) {
    z.resize(R * L);
    of_x.push_back({&*w.latent_down, z.data(), L});
  } else {
    z = xf;
  }
  if (I) of_x.insert(of_x.end(), {{&*w.shared_gate, g.data(), I}, {&*w.shared_up, u.data(), I}});
  if (!of_x.empty()) proj.many(xf.data(), R, d, of_x);
  at::Tensor zt = at::from_blob(z.data(), {R, L}, x.options().dtype(at::kFloat));
  at::Tensor routed = moe_experts(zt, ids, weights, w.w1, w.w1_scale, w.w3, w.w3_scale, w.w2, w.w2_scale, act, beta, linear_beta,
                                  bf16);
  Buf y(routed.data_ptr<float>(), routed.data_ptr<float>() + R * L), out(R * d);
  for (auto& v : y) v = proj.r(v);  // y.to(x.dtype)
  if (w.latent_down.has_value()) {
    if (w.latent_norm.has_value()) {
      const Buf nw = floats(*w.latent_norm);
      for (int64_t i = 0; i < R; ++i) proj.norm(y.data() + i * L, L, nw, float(eps));
    }
    proj(y.data(), R, *w.latent_up, out.data(), d);
  } else {
    out = y;
  }
  if (I) {
    Buf s(R * d);
    k3k::activate_n(act, g.data(), u.data(), g.data(), R * I, float(beta), float(linear_beta), proj.rnd);
    proj(g.data(), R, *w.shared_down, s.data(), d);
    for (int64_t i = 0; i < R * d; ++i) out[i] = proj.r(out[i] + s[i]);
  }
  return as_tensor(out, R, d, x);
}
