// The block kernels' weights by name (review 12b item 7: named packs, not positional lists).
// The op schemas (registry.cpp) name each field as an argument; the decode stack, which keeps
// every layer's pack, takes them as lists in that same order, absent weights None (`from_list`,
// the one place the order is written in C++). k3serve/kernels/packs.py builds them in Python, and a test checks
// its field names against the schemas.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace k3k {

inline at::Tensor opt_or_empty(const c10::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

// One KDA attention block. Projections [out, in] in any kernel form (panels.h); g_proj is the
// full-rank gate or the low-rank gate's first half (then g_b_proj its second); the conv taps
// [P, 1, K]; dt_bias [P], a_log [H], o_norm [D].
struct KdaWeights {
  at::Tensor q_proj, k_proj, v_proj, f_a_proj, f_b_proj, b_proj, g_proj, g_b_proj, o_proj;
  at::Tensor q_conv, k_conv, v_conv, dt_bias, a_log, o_norm;
  static constexpr size_t kCount = 15;
  static KdaWeights from_list(const std::vector<c10::optional<at::Tensor>>& w) {
    TORCH_CHECK(w.size() == kCount, "a KDA pack has ", kCount, " weights, got ", w.size());
    KdaWeights k;
    at::Tensor* f[kCount] = {&k.q_proj, &k.k_proj, &k.v_proj, &k.f_a_proj, &k.f_b_proj, &k.b_proj, &k.g_proj, &k.g_b_proj,
                             &k.o_proj, &k.q_conv, &k.k_conv, &k.v_conv, &k.dt_bias, &k.a_log, &k.o_norm};
    for (size_t i = 0; i < kCount; ++i) *f[i] = opt_or_empty(w[i]);
    return k;
  }
  int64_t nbytes() const {
    int64_t n = 0;
    for (const at::Tensor* t : {&q_proj, &k_proj, &v_proj, &f_a_proj, &f_b_proj, &b_proj, &g_proj, &g_b_proj, &o_proj,
                                &q_conv, &k_conv, &v_conv, &dt_bias, &a_log, &o_norm})
      if (t->defined()) n += t->nbytes();
    return n;
  }
};

// One gated-MLA attention block. q_a_proj is q_proj when the model has no q LoRA (then
// q_a_norm and q_b_proj are absent); kv_b_proj [H * (nope + v), c] as the checkpoint holds it;
// g_proj absent without the output gate.
struct MlaWeights {
  at::Tensor q_a_proj, q_a_norm, q_b_proj, kv_a_proj, kv_a_norm, kv_b_proj, g_proj, o_proj;
  static constexpr size_t kCount = 8;
  static MlaWeights from_list(const std::vector<c10::optional<at::Tensor>>& w) {
    TORCH_CHECK(w.size() == kCount, "an MLA pack has ", kCount, " weights, got ", w.size());
    return {opt_or_empty(w[0]), opt_or_empty(w[1]), opt_or_empty(w[2]), opt_or_empty(w[3]),
            opt_or_empty(w[4]), opt_or_empty(w[5]), opt_or_empty(w[6]), opt_or_empty(w[7])};
  }
  int64_t nbytes() const {
    int64_t n = 0;
    for (const at::Tensor* t : {&q_a_proj, &q_a_norm, &q_b_proj, &kv_a_proj, &kv_a_norm, &kv_b_proj, &g_proj, &o_proj})
      if (t->defined()) n += t->nbytes();
    return n;
  }
};

// One MoE block. The router (gate [E, d], score bias [E]); the latent MoE's down / norm / up
// (absent for Kimi-Linear); the routed experts w1 / w3 / w2 with their E8M0 scales when MXFP4
// (absent when dense or in fp32 panels); the shared experts' gate / up / down (absent without).
struct MoeWeights {
  at::Tensor gate, score_bias;
  c10::optional<at::Tensor> latent_down, latent_norm, latent_up;
  at::Tensor w1;
  c10::optional<at::Tensor> w1_scale;
  at::Tensor w3;
  c10::optional<at::Tensor> w3_scale;
  at::Tensor w2;
  c10::optional<at::Tensor> w2_scale, shared_gate, shared_up, shared_down;
  static constexpr size_t kCount = 14;
  static MoeWeights from_list(const std::vector<c10::optional<at::Tensor>>& w) {
    TORCH_CHECK(w.size() == kCount, "a MoE pack has ", kCount, " weights, got ", w.size());
    TORCH_CHECK(w[0] && w[1] && w[5] && w[7] && w[9], "a MoE pack needs its router and routed experts");
    return {*w[0], *w[1], w[2], w[3], w[4], *w[5], w[6], *w[7], w[8], *w[9], w[10], w[11], w[12], w[13]};
  }
  int64_t nbytes() const {
    int64_t n = gate.nbytes() + score_bias.nbytes() + w1.nbytes() + w3.nbytes() + w2.nbytes();
    for (const auto* t : {&latent_down, &latent_norm, &latent_up, &w1_scale, &w3_scale, &w2_scale, &shared_gate,
                          &shared_up, &shared_down})
      if (t->has_value()) n += (*t)->nbytes();
    return n;
  }
};

// One GLU MLP (dense layers, Kimi-Linear's first layer): gate, up, down.
struct GluWeights {
  at::Tensor gate, up, down;
  static constexpr size_t kCount = 3;
  static GluWeights from_list(const std::vector<c10::optional<at::Tensor>>& w) {
    TORCH_CHECK(w.size() == kCount && w[0] && w[1] && w[2], "a GLU pack has gate, up and down");
    return {*w[0], *w[1], *w[2]};
  }
  int64_t nbytes() const { return gate.nbytes() + up.nbytes() + down.nbytes(); }
};

}  // namespace k3k
