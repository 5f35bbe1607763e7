// Stepwise Kimi Delta Attention for decode and verify rows, one call per layer (issue 15).
//
// Rows are grouped by sequence (rows starts[s] .. starts[s+1] of sequence s, in order); each
// sequence's rows run one after another from its state slot: short conv step + SiLU, per-head
// l2norm (q scaled by D^-1/2), decay g from z = f_b(f_a x) (K3: lb * sigmoid(exp(A_log) (z + dt_bias));
// Kimi-Linear: -exp(A_log) softplus(z + dt_bias)), beta = sigmoid(b), the gated delta rule
//   S <- Diag(exp(g)) S;  S <- S + beta k (v - S^T k)^T;  o = S^T q
// then y = RMSNorm_D(o) * sigmoid(gate). States are updated in place; with record buffers the
// state after every row is kept for speculative rollback.
// References (plain torch, compared in tests/model/test_kernels.py): short_conv_step, kda_step
// and KimiDeltaAttention._output (k3serve/layers), k3-model-spec.md §3.
#include "core/common.h"
#include "ops.h"
#include "core/simd.h"

#include <vector>

namespace {

// The gated delta rule on one head's state S [D, D] (rows: keys) in place, writing o = S^T q
// and v - S^T k (into v): decay the key rows and form S^T k in one pass, then the rank-1 write
// and S^T q in a second. Each output column's sum runs over the key rows in order in both
// forms, so they give the same bits; the AVX-512 one holds the two [D] sums in registers
// (D = 16, 32, 64 or 128): accumulating them in memory chained every row on a
// store-to-load forward (the demo model's 5-row verify: a third of kda_rows' time).
#ifdef K3K_AVX512
template <int n>  // D = 16 n: the sums' registers indexed by constants, so they stay registers
void delta_rule_512(float* state, const float* g, const float* k, float* v, const float* q, float beta, float* o) {
  constexpr int64_t D = 16 * n;
  __m512 acc[n], vv[n];
  for (int c = 0; c < n; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < D; ++kk) {
    float* row = state + kk * D;
    const __m512 gk = _mm512_set1_ps(g[kk]), kv = _mm512_set1_ps(k[kk]);
    for (int c = 0; c < n; ++c) {
      const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * c), gk);
      _mm512_storeu_ps(row + 16 * c, r);
      acc[c] = _mm512_fmadd_ps(kv, r, acc[c]);
    }
  }
  for (int c = 0; c < n; ++c) {
    vv[c] = _mm512_sub_ps(_mm512_loadu_ps(v + 16 * c), acc[c]);
    _mm512_storeu_ps(v + 16 * c, vv[c]);
    acc[c] = _mm512_setzero_ps();
  }
  for (int64_t kk = 0; kk < D; ++kk) {
    float* row = state + kk * D;
    const __m512 bk = _mm512_set1_ps(beta * k[kk]), qk = _mm512_set1_ps(q[kk]);
    for (int c = 0; c < n; ++c) {
      const __m512 r = _mm512_fmadd_ps(bk, vv[c], _mm512_loadu_ps(row + 16 * c));
      _mm512_storeu_ps(row + 16 * c, r);
      acc[c] = _mm512_fmadd_ps(qk, r, acc[c]);
    }
  }
  for (int c = 0; c < n; ++c) _mm512_storeu_ps(o + 16 * c, acc[c]);
}
#endif

// The short conv step of D channels (c0 .. c0 + D - 1 of the [K - 1, C3] window `cst`, their
// weights w [D, K], the new inputs cur [D]): out[i] = sum_j window[j][i] w[i][j] + cur[i]
// w[i][K - 1], then the window shifts by one. For K = 4 and D a multiple of 16 (AVX-512), 16
// channels at a time in tap order, one FMA per tap; the scalar loop lets the compiler order its
// sums, so the two differ in the last bits.
void conv_step(float* cst, int64_t C3, int64_t c0, const float* w, const float* cur, int64_t D, int64_t K,
               float* out) {
#ifdef K3K_AVX512
  if (K == 4 && D % 16 == 0) {
    // tap j of 16 channels' [channel, 4] weight rows (64 floats, 4 registers): lanes 0-7 from
    // the first two registers, 8-15 from the last two
    const __m512i tap0 = _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
    for (int64_t i = 0; i < D; i += 16) {
      const float* wi = w + i * 4;
      const __m512 w0 = _mm512_loadu_ps(wi), w1 = _mm512_loadu_ps(wi + 16), w2 = _mm512_loadu_ps(wi + 32),
                   w3 = _mm512_loadu_ps(wi + 48);
      const __m512 x[4] = {_mm512_loadu_ps(cst + c0 + i), _mm512_loadu_ps(cst + C3 + c0 + i),
                           _mm512_loadu_ps(cst + 2 * C3 + c0 + i), _mm512_loadu_ps(cur + i)};
      __m512 acc = _mm512_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        const __m512i idx = _mm512_add_epi32(tap0, _mm512_set1_epi32(j));
        const __m512 lo = _mm512_permutex2var_ps(w0, idx, w1), hi = _mm512_permutex2var_ps(w2, idx, w3);
        acc = _mm512_fmadd_ps(x[j], _mm512_shuffle_f32x4(lo, hi, 0x44), acc);
      }
      _mm512_storeu_ps(out + i, acc);
      for (int j = 0; j < 3; ++j) _mm512_storeu_ps(cst + j * C3 + c0 + i, x[j + 1]);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < D; ++i) {
    const int64_t c = c0 + i;
    float acc = 0.f;
    for (int64_t j = 0; j < K - 1; ++j) acc += cst[j * C3 + c] * w[i * K + j];
    acc += cur[i] * w[i * K + K - 1];
    for (int64_t j = 0; j + 1 < K - 1; ++j) cst[j * C3 + c] = cst[(j + 1) * C3 + c];
    if (K > 1) cst[(K - 2) * C3 + c] = cur[i];
    out[i] = acc;
  }
}

void delta_rule(float* state, const float* g, const float* k, float* v, const float* q, float beta, int64_t D,
                float* pred, float* o) {
#ifdef K3K_AVX512
  switch (D) {
    case 16: return delta_rule_512<1>(state, g, k, v, q, beta, o);
    case 32: return delta_rule_512<2>(state, g, k, v, q, beta, o);
    case 64: return delta_rule_512<4>(state, g, k, v, q, beta, o);
    case 128: return delta_rule_512<8>(state, g, k, v, q, beta, o);
    default: break;
  }
#endif
  std::fill(pred, pred + D, 0.f);
  for (int64_t kk = 0; kk < D; ++kk) {
    float* row = state + kk * D;
    const float gk = g[kk], kv = k[kk];
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) {
      row[j] *= gk;
      pred[j] += kv * row[j];
    }
  }
  for (int64_t j = 0; j < D; ++j) v[j] -= pred[j];
  std::fill(o, o + D, 0.f);
  for (int64_t kk = 0; kk < D; ++kk) {
    float* row = state + kk * D;
    const float bk = beta * k[kk], qk = q[kk];
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) {
      row[j] += bk * v[j];
      o[j] += qk * row[j];
    }
  }
}

}  // namespace

void kda_rows(const KdaRows& a) {
  using namespace k3k;
  const int64_t S = a.S, H = a.H, D = a.D, K = a.K, P = H * D, C3 = 3 * P, T = a.longest, TB = a.record_len;
  const int64_t *st = a.starts, *sl = a.slots;
  const float *zp = a.z, *bp = a.b, *gp = a.gate, *dp = a.dt_bias, *ap = a.a_log, *np = a.o_norm;
  float *cs = a.conv_state, *rs = a.rec_state, *yp = a.y, *rb = a.rec_buf, *cb = a.conv_buf;
  const bool k3_gate = !std::isnan(a.lower_bound);
  const float lb = a.lower_bound, qscale = 1.f / std::sqrt(float(D)), eps = a.eps;
  // one work item = (sequence, head): every channel a head reads (its q/k/v conv channels, its
  // D x D state, its gate and norm) belongs to it alone, so items run in parallel without locks
  at::parallel_for(0, S * H, grain_for(4 * D * D * std::max<int64_t>(T, 1)), [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    std::vector<float> q(D), k(D), v(D), g(D), pred(D), o(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / H, h = item % H, slot = sl[s];
      float* state = rs + ((slot * H + h) * D) * D;  // [Dk, Dv]
      float* cst = cs + slot * (K - 1) * C3;          // [K-1, 3P]
      const float decay_rate = std::exp(ap[h]);
      for (int64_t r = st[s]; r < st[s + 1]; ++r) {
        // short conv over the window [state rows..., u_r] for this head's q, k, v channels
        float* outs[3] = {q.data(), k.data(), v.data()};
        for (int part = 0; part < 3; ++part) {
          conv_step(cst, C3, part * P + h * D, a.conv_w[part] + h * D * K, a.u + r * a.ldu + part * P + h * D, D, K,
                    outs[part]);
          silu_n(outs[part], outs[part], D);
        }
        const float rq = qscale / std::sqrt(dot(q.data(), q.data(), D) + 1e-6f);
        const float rk = 1.f / std::sqrt(dot(k.data(), k.data(), D) + 1e-6f);
        for (int64_t i = 0; i < D; ++i) q[i] *= rq, k[i] *= rk;
        kda_decay_n(zp + r * a.ldz + h * D, dp + h * D, D, k3_gate, lb, decay_rate, g.data());
        const float beta = sigmoid(bp[r * a.ldb + h]);
        delta_rule(state, g.data(), k.data(), v.data(), q.data(), beta, D, pred.data(), o.data());
        const float rms = 1.f / std::sqrt(dot(o.data(), o.data(), D) / float(D) + eps);
        sigmoid_n(gp + r * a.ldg + h * D, pred.data(), D);  // pred is free again: the output gate
        for (int64_t j = 0; j < D; ++j) yp[r * P + h * D + j] = np[j] * (o[j] * rms) * pred[j];
        if (rb) {  // per-position state for rollback: [S, TB, H, D, D] and [S, TB, K-1, 3P]
          const int64_t t = r - st[s];
          std::memcpy(rb + (((s * TB + t) * H + h) * D) * D, state, sizeof(float) * D * D);
          for (int64_t j = 0; j < K - 1; ++j)
            for (int part = 0; part < 3; ++part)
              std::memcpy(cb + ((s * TB + t) * (K - 1) + j) * C3 + part * P + h * D,
                          cst + j * C3 + part * P + h * D, sizeof(float) * D);
        }
      }
    }
  });
}

at::Tensor kda_decode(at::Tensor u, at::Tensor conv_w, at::Tensor z, at::Tensor b, at::Tensor gate,
                      at::Tensor dt_bias, at::Tensor a_log, at::Tensor o_norm_w, at::Tensor conv_state,
                      at::Tensor rec_state, at::Tensor slots, at::Tensor starts, double lower_bound,
                      double eps, c10::optional<at::Tensor> rec_buf, c10::optional<at::Tensor> conv_buf) {
  using namespace k3k;
  check_f32(u, "u", 2);
  check_f32(conv_w, "conv_w", 2);
  check_f32(z, "z", 2);
  check_f32(b, "b", 2);
  check_f32(gate, "gate", 2);
  check_f32(conv_state, "conv_state", 3);
  check_f32(rec_state, "rec_state", 4);
  check_i64(slots, "slots");
  check_i64(starts, "starts");
  const int64_t N = u.size(0), C3 = u.size(1), P = C3 / 3, H = rec_state.size(1), D = rec_state.size(2);
  const int64_t K = conv_w.size(1), S = slots.size(0);
  TORCH_CHECK(C3 == 3 * P && P == H * D && rec_state.size(3) == D, "u [N, 3P] with P = H * D = ", H * D);
  TORCH_CHECK(conv_w.size(0) == C3 && conv_state.size(1) == K - 1 && conv_state.size(2) == C3,
              "conv weight [3P, K] and conv state [slots, K-1, 3P] disagree");
  TORCH_CHECK(z.size(0) == N && z.size(1) == P && gate.size(0) == N && gate.size(1) == P && b.size(0) == N &&
                  b.size(1) == H, "z/gate [N, P] and b [N, H] must match u's rows");
  TORCH_CHECK(starts.size(0) == S + 1, "starts must have one entry more than slots");
  at::Tensor dtb = dt_bias.contiguous().to(at::kFloat), alog = a_log.contiguous().to(at::kFloat);
  at::Tensor onw = o_norm_w.contiguous().to(at::kFloat);
  TORCH_CHECK(dtb.numel() == P && alog.numel() == H && onw.numel() == D, "dt_bias [P], A_log [H], o_norm [D]");
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  TORCH_CHECK(st[0] == 0 && st[S] == N, "starts must run from 0 to N = ", N);
  int64_t T = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(st[s + 1] >= st[s], "starts must not decrease");
    TORCH_CHECK(sl[s] >= 0 && sl[s] < rec_state.size(0), "state slot ", sl[s], " out of range");
    T = std::max(T, st[s + 1] - st[s]);
  }
  float* rb = nullptr;
  float* cb = nullptr;
  if (rec_buf.has_value()) {
    check_f32(*rec_buf, "rec_buf", 5);
    check_f32(*conv_buf, "conv_buf", 4);
    TORCH_CHECK(rec_buf->size(0) == S && rec_buf->size(1) >= T && conv_buf->size(1) == rec_buf->size(1),
                "record buffers must be [S, T, ...] with T >= the longest sequence");
    rb = rec_buf->data_ptr<float>();
    cb = conv_buf->data_ptr<float>();
  }
  const int64_t TB = rb ? rec_buf->size(1) : 0;
  auto y = at::empty({N, P}, u.options());
  const float *up = u.data_ptr<float>(), *wp = conv_w.data_ptr<float>(), *zp = z.data_ptr<float>();
  const float *bp = b.data_ptr<float>(), *gp = gate.data_ptr<float>(), *dp = dtb.data_ptr<float>();
  const float *ap = alog.data_ptr<float>(), *np = onw.data_ptr<float>();
  float *cs = conv_state.data_ptr<float>(), *rs = rec_state.data_ptr<float>(), *yp = y.data_ptr<float>();
  KdaRows a{};
  a.u = up, a.ldu = C3, a.z = zp, a.ldz = P, a.b = bp, a.ldb = H, a.gate = gp, a.ldg = P;
  a.conv_w[0] = wp, a.conv_w[1] = wp + P * K, a.conv_w[2] = wp + 2 * P * K;
  a.dt_bias = dp, a.a_log = ap, a.o_norm = np, a.conv_state = cs, a.rec_state = rs, a.slots = sl, a.starts = st;
  a.S = S, a.H = H, a.D = D, a.K = K, a.longest = T, a.record_len = TB, a.lower_bound = float(lower_bound);
  a.eps = float(eps), a.rec_buf = rb, a.conv_buf = cb, a.y = yp;
  kda_rows(a);
  return y;
}

// After a verify pass (k3serve/spec/rollback.py): for every KDA layer l and sequence j with
// accepted[j] >= 0, live slot slots[j] of live_rec[l] / live_conv[l] takes the state recorded
// at that position, rec_bufs[l][j, accepted[j]] / conv_bufs[l][j, accepted[j]]. One call for
// every layer's copies (two dozen torch indexing ops and copies cost ~25 us of a single user's
// speculative step). Reference: rollback_states' torch copies, compared in tests/spec/test_rollback.py.
void kda_rollback(std::vector<at::Tensor> live_rec, std::vector<at::Tensor> live_conv, std::vector<at::Tensor> rec_bufs,
                  std::vector<at::Tensor> conv_bufs, std::vector<int64_t> slots, std::vector<int64_t> accepted) {
  TORCH_CHECK(live_conv.size() == live_rec.size() && rec_bufs.size() == live_rec.size() &&
                  conv_bufs.size() == live_rec.size() && accepted.size() == slots.size(),
              "kda_rollback: one live state and record pair per layer, one position per slot");
  const auto copy = [&](const at::Tensor& live, const at::Tensor& buf, const char* what) {
    k3k::check_f32(live, what, live.dim());
    k3k::check_f32(buf, what, live.dim() + 1);
    // one slot's values, and one record's (sizes only: a select view apiece cost this per-step call ~1 us)
    const int64_t n = live.size(0) ? live.numel() / live.size(0) : 0;
    const int64_t per = buf.size(0) * buf.size(1) ? buf.numel() / (buf.size(0) * buf.size(1)) : 0;
    TORCH_CHECK(buf.size(0) >= int64_t(slots.size()) && per == n, "kda_rollback: ", what,
                " records [S, T, ...] do not match the live state's rows");
    for (size_t j = 0; j < slots.size(); ++j) {
      if (accepted[j] < 0) continue;
      TORCH_CHECK(slots[j] >= 0 && slots[j] < live.size(0) && accepted[j] < buf.size(1), "kda_rollback: slot ",
                  slots[j], " or position ", accepted[j], " out of range");
      std::memcpy(live.data_ptr<float>() + slots[j] * n, buf.data_ptr<float>() + (j * buf.size(1) + accepted[j]) * n,
                  n * sizeof(float));
    }
  };
  for (size_t l = 0; l < live_rec.size(); ++l) {
    copy(live_rec[l], rec_bufs[l], "recurrent state");
    copy(live_conv[l], conv_bufs[l], "conv state");
  }
}
