// The kernels as torch.library ops with schemas (namespace: the module's name, K3K_NS, so two
// ISA builds can load in one process). A schema names every argument, says which tensors an op
// writes (`(a!)`), and lets torch.compile and FakeTensorMode treat each op as one node
// (k3serve/kernels/fakes.py registers their fake implementations). The block kernels take their
// weights by name (packs.h); k3serve/kernels/packs.py builds the packs in this order.
#include <torch/library.h>

#include "ops.h"
#include "packs.h"

#ifndef K3K_NS
#define K3K_NS k3serve_cpu_kernels
#endif
// one level of indirection, so K3K_NS expands before TORCH_LIBRARY pastes it
#define K3K_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define K3K_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

namespace {

using OptT = c10::optional<at::Tensor>;
using k3k::opt_or_empty;

at::Tensor kda_block_op(at::Tensor x, at::Tensor q_proj, at::Tensor k_proj, at::Tensor v_proj, at::Tensor f_a_proj,
                        at::Tensor f_b_proj, at::Tensor b_proj, at::Tensor g_proj, OptT g_b_proj, at::Tensor o_proj,
                        at::Tensor q_conv, at::Tensor k_conv, at::Tensor v_conv, at::Tensor dt_bias, at::Tensor a_log,
                        at::Tensor o_norm, at::Tensor conv_state, at::Tensor rec_state, at::Tensor slots,
                        at::Tensor starts, double lower_bound, double eps, OptT rec_buf, OptT conv_buf) {
  const k3k::KdaWeights w{q_proj, k_proj, v_proj, f_a_proj, f_b_proj, b_proj, g_proj, opt_or_empty(g_b_proj),
                          o_proj, q_conv, k_conv, v_conv, dt_bias, a_log, o_norm};
  return kda_block(x, w, conv_state, rec_state, slots, starts, lower_bound, eps, rec_buf, conv_buf);
}

at::Tensor mla_block_op(at::Tensor x, at::Tensor q_a_proj, OptT q_a_norm, OptT q_b_proj, at::Tensor kv_a_proj,
                        at::Tensor kv_a_norm, at::Tensor kv_b_proj, OptT g_proj, at::Tensor o_proj, at::Tensor cache,
                        at::Tensor cache_rows, at::Tensor table, at::Tensor seq, at::Tensor pos, int64_t block,
                        double scale, int64_t heads, int64_t nope, int64_t kv_lora, double norm_eps, double kv_scale) {
  const k3k::MlaWeights w{q_a_proj,  opt_or_empty(q_a_norm), opt_or_empty(q_b_proj), kv_a_proj,
                          kv_a_norm, kv_b_proj,              opt_or_empty(g_proj),   o_proj};
  return mla_block(x, w, cache, cache_rows, table, seq, pos, block, scale, heads, nope, kv_lora, norm_eps, kv_scale);
}

at::Tensor moe_block_op(at::Tensor x, at::Tensor gate, at::Tensor score_bias, OptT latent_down, OptT latent_norm,
                        OptT latent_up, at::Tensor w1, OptT w1_scale, at::Tensor w3, OptT w3_scale, at::Tensor w2,
                        OptT w2_scale, OptT shared_gate, OptT shared_up, OptT shared_down, int64_t topk,
                        bool use_sigmoid, bool renorm, double scaling, int64_t groups, int64_t keep, int64_t act,
                        double beta, double linear_beta, double eps) {
  const k3k::MoeWeights w{gate, score_bias, latent_down, latent_norm, latent_up, w1,        w1_scale,
                          w3,   w3_scale,   w2,          w2_scale,    shared_gate, shared_up, shared_down};
  return moe_block(x, w, topk, use_sigmoid, renorm, scaling, groups, keep, act, beta, linear_beta, eps);
}

}  // namespace

K3K_LIBRARY(K3K_NS, m) {
  // ---- core: one computation each
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("linear(Tensor x, Tensor w) -> Tensor");  // x [M, K] @ W^T, W [N, K] or its panel form
  m.def("glu(Tensor gate, Tensor up, int act, float beta, float linear_beta) -> Tensor");
  m.def("attnres_mix(Tensor[] candidates, Tensor w, float eps) -> Tensor");
  m.def("mxfp4_grouped_matmul(Tensor x, Tensor offsets, Tensor packed, Tensor scale) -> Tensor");
  m.def("nvfp4_grouped_matmul(Tensor x, Tensor offsets, Tensor packed, Tensor scale, Tensor table) -> Tensor");
  m.def(
      "kda_decode(Tensor u, Tensor conv_w, Tensor z, Tensor b, Tensor gate, Tensor dt_bias, Tensor a_log, "
      "Tensor o_norm_w, Tensor(a!) conv_state, Tensor(b!) rec_state, Tensor slots, Tensor starts, float lower_bound, "
      "float eps, Tensor(c!)? rec_buf=None, Tensor(d!)? conv_buf=None) -> Tensor");
  m.def(
      "kda_rollback(Tensor(a!)[] live_rec, Tensor(b!)[] live_conv, Tensor[] rec_bufs, Tensor[] conv_bufs, "
      "int[] slots, int[] accepted) -> ()");
  m.def(
      "mla_decode(Tensor q, int nope, Tensor cache, Tensor w_kv_b, Tensor table, Tensor seq, Tensor pos, int block, "
      "float scale) -> Tensor");
  m.def(
      "moe_route(Tensor x, Tensor weight, Tensor bias, int topk, bool use_sigmoid, bool renorm, float scaling, "
      "int groups, int keep) -> (Tensor, Tensor)");
  m.def(
      "moe_experts(Tensor z, Tensor ids, Tensor weights, Tensor w1, Tensor? w1_scale, Tensor w3, Tensor? w3_scale, "
      "Tensor w2, Tensor? w2_scale, int act, float beta, float linear_beta, bool round_bf16_steps) -> Tensor");
  // ---- fused: whole blocks of decode / verify rows, weights by name (packs.h)
  m.def(
      "kda_block(Tensor x, Tensor q_proj, Tensor k_proj, Tensor v_proj, Tensor f_a_proj, Tensor f_b_proj, "
      "Tensor b_proj, Tensor g_proj, Tensor? g_b_proj, Tensor o_proj, Tensor q_conv, Tensor k_conv, Tensor v_conv, "
      "Tensor dt_bias, Tensor a_log, Tensor o_norm, Tensor(a!) conv_state, Tensor(b!) rec_state, Tensor slots, "
      "Tensor starts, float lower_bound, float eps, Tensor(c!)? rec_buf=None, Tensor(d!)? conv_buf=None) -> Tensor");
  m.def(
      "mla_block(Tensor x, Tensor q_a_proj, Tensor? q_a_norm, Tensor? q_b_proj, Tensor kv_a_proj, Tensor kv_a_norm, "
      "Tensor kv_b_proj, Tensor? g_proj, Tensor o_proj, Tensor(a!) cache, Tensor cache_rows, Tensor table, "
      "Tensor seq, Tensor pos, int block, float scale, int heads, int nope, int kv_lora, float norm_eps, "
      "float kv_scale) -> Tensor");
  m.def(
      "moe_block(Tensor x, Tensor gate, Tensor score_bias, Tensor? latent_down, Tensor? latent_norm, "
      "Tensor? latent_up, Tensor w1, Tensor? w1_scale, Tensor w3, Tensor? w3_scale, Tensor w2, Tensor? w2_scale, "
      "Tensor? shared_gate, Tensor? shared_up, Tensor? shared_down, int topk, bool use_sigmoid, bool renorm, "
      "float scaling, int groups, int keep, int act, float beta, float linear_beta, float eps) -> Tensor");
  // ---- the DSpark drafter (spec_decode/dspark.py): its weights as spec_decode/dspark.py lists them
  m.def("dspark_forward(Tensor taps, Tensor last, Tensor[] w, int heads, int mask_id, float eps) -> Tensor");
  m.def("dspark_greedy(Tensor block, Tensor last, Tensor u, Tensor wt, int[] k) -> Tensor");
  m.def(
      "dspark_draft(Tensor taps, int[] last, Tensor[] w, int heads, int mask_id, float eps, Tensor u, Tensor wt, "
      "int[] k) -> Tensor");
}

K3K_LIBRARY_IMPL(K3K_NS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("linear", &fast_linear);
  m.impl("glu", &glu_act);
  m.impl("attnres_mix", &attnres_mix);
  m.impl("mxfp4_grouped_matmul", &mxfp4_grouped_matmul);
  m.impl("nvfp4_grouped_matmul", &nvfp4_grouped_matmul);
  m.impl("kda_decode", &kda_decode);
  m.impl("kda_rollback", &kda_rollback);
  m.impl("mla_decode", &mla_decode);
  m.impl("moe_route", &moe_route);
  m.impl("moe_experts", &moe_experts);
  m.impl("kda_block", &kda_block_op);
  m.impl("mla_block", &mla_block_op);
  m.impl("moe_block", &moe_block_op);
  m.impl("dspark_forward", &dspark_forward);
  m.impl("dspark_greedy", &dspark_greedy);
  m.impl("dspark_draft", &dspark_draft);
}
