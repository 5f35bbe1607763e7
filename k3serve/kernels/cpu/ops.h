// The kernels' at::Tensor entry points, shared by module.cpp (bindings) and blocks.cpp (whole
// decode blocks built from them).
#pragma once

#include <ATen/ATen.h>

#include "packs.h"

#include <tuple>
#include <vector>

// Stepwise KDA on raw rows (kda_decode.cpp): row r of u/z/b/gate at r * ld*, y [N, H * D].
struct KdaRows {
  const float *u, *z, *b, *gate;
  int64_t ldu, ldz, ldb, ldg;
  const float* conv_w[3];  // q, k, v taps, each [P, K]
  const float *dt_bias, *a_log, *o_norm;
  float *conv_state, *rec_state;
  const int64_t *slots, *starts;
  int64_t S, H, D, K, longest, record_len;
  float lower_bound, eps;  // lower_bound NaN: Kimi-Linear's softplus decay
  float *rec_buf, *conv_buf;  // per-position records [S, record_len, ...] or null
  float* y;
};
void kda_rows(const KdaRows& a);

at::Tensor mxfp4_grouped_matmul(at::Tensor x, at::Tensor offsets, at::Tensor packed, at::Tensor scale);
std::tuple<at::Tensor, at::Tensor> mxfp4_rows_bf16(at::Tensor packed, at::Tensor scale);
at::Tensor nvfp4_grouped_matmul(at::Tensor x, at::Tensor offsets, at::Tensor packed, at::Tensor scale,
                                at::Tensor table);
void kda_rollback(std::vector<at::Tensor> live_rec, std::vector<at::Tensor> live_conv, std::vector<at::Tensor> rec_bufs,
                  std::vector<at::Tensor> conv_bufs, std::vector<int64_t> slots, std::vector<int64_t> accepted);
at::Tensor kda_decode(at::Tensor u, at::Tensor conv_w, at::Tensor z, at::Tensor b, at::Tensor gate,
                      at::Tensor dt_bias, at::Tensor a_log, at::Tensor o_norm_w, at::Tensor conv_state,
                      at::Tensor rec_state, at::Tensor slots, at::Tensor starts, double lower_bound,
                      double eps, c10::optional<at::Tensor> rec_buf, c10::optional<at::Tensor> conv_buf);
at::Tensor mla_decode(at::Tensor q, int64_t nope, at::Tensor cache, at::Tensor w_kv_b, at::Tensor table,
                      at::Tensor seq, at::Tensor pos, int64_t block, double scale);
at::Tensor moe_experts(at::Tensor z, at::Tensor ids, at::Tensor weights, at::Tensor w1,
                       c10::optional<at::Tensor> w1_scale, at::Tensor w3, c10::optional<at::Tensor> w3_scale,
                       at::Tensor w2, c10::optional<at::Tensor> w2_scale, int64_t act, double beta,
                       double linear_beta, bool round_bf16_steps);
std::tuple<at::Tensor, at::Tensor> moe_route(at::Tensor x, at::Tensor weight, at::Tensor bias, int64_t topk,
                                             bool use_sigmoid, bool renorm, double scaling, int64_t groups,
                                             int64_t keep);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor dspark_forward(at::Tensor taps, at::Tensor last, std::vector<at::Tensor> w, int64_t heads,
                          int64_t mask_id, double eps);
at::Tensor dspark_greedy(at::Tensor block, at::Tensor last, at::Tensor u, at::Tensor wt, std::vector<int64_t> k);
at::Tensor dspark_draft(at::Tensor taps, std::vector<int64_t> last, std::vector<at::Tensor> w, int64_t heads,
                        int64_t mask_id, double eps, at::Tensor u, at::Tensor wt, std::vector<int64_t> k);
at::Tensor attnres_mix(std::vector<at::Tensor> candidates, at::Tensor w, double eps);
at::Tensor fast_linear(at::Tensor x, at::Tensor w);
at::Tensor glu_act(at::Tensor gate, at::Tensor up, int64_t act, double beta, double linear_beta);
at::Tensor kda_block(at::Tensor x, const k3k::KdaWeights& w, at::Tensor conv_state, at::Tensor rec_state,
                     at::Tensor slots, at::Tensor starts, double lower_bound, double eps,
                     c10::optional<at::Tensor> rec_buf, c10::optional<at::Tensor> conv_buf);
at::Tensor mla_block(at::Tensor x, const k3k::MlaWeights& w, at::Tensor cache, at::Tensor cache_rows,
                     at::Tensor table, at::Tensor seq, at::Tensor pos, int64_t block, double scale, int64_t heads,
                     int64_t nope, int64_t kv_lora, double norm_eps, double kv_scale);
at::Tensor moe_block(at::Tensor x, const k3k::MoeWeights& w, int64_t topk, bool use_sigmoid,
                     bool renorm, double scaling, int64_t groups, int64_t keep, int64_t act, double beta,
                     double linear_beta, double eps);

// shm_comm.cpp: collectives of tensor-parallel ranks on one host, over a shared segment
void shm_attach(at::Tensor seg, int64_t rank);
at::Tensor shm_all_reduce(at::Tensor x, at::Tensor seg, int64_t rank, int64_t world, int64_t seq,
                          int64_t slot_bytes, double timeout_s);
at::Tensor shm_all_gather(at::Tensor x, at::Tensor seg, int64_t rank, int64_t world, int64_t seq,
                          int64_t slot_bytes, double timeout_s);
at::Tensor shm_reduce_scatter(at::Tensor x, at::Tensor seg, int64_t rank, int64_t world, int64_t seq,
                              int64_t slot_bytes, double timeout_s);
at::Tensor shm_all_to_all(at::Tensor x, at::Tensor seg, int64_t rank, int64_t world, int64_t seq,
                          int64_t slot_bytes, double timeout_s, std::vector<int64_t> counts);
