// Absorbed gated-MLA attention for decode and verify rows over the paged latent cache (issue 15).
//
// Query row r sits at absolute position pos[r] of sequence seq[r] and attends to that
// sequence's positions 0..pos[r], whose cache rows come from its block table:
//   row(p) = table[seq, p / block] * block + p % block,   cache row = [c_n (c) | k_pe (r)]
//   q_abs = W_UK^T q_nope;  s_l = (q_abs . c_l + q_pe . k_pe_l) * scale;  p = softmax(s)
//   out = W_UV (sum_l p_l c_l)                                     (per head; [R, H, v])
// The new rows must already be written (the caller writes them with `to_cache` first), so a
// verify pass of 1 + k rows sees its own drafts causally. The cache may be fp32, bf16 or fp8
// e4m3 (read as float). Reference: attend_absorbed / attend_absorbed_batched (k3serve/layers/mla.py).
#include "common.h"

#include <c10/util/Float8_e4m3fn.h>

#include <limits>
#include <vector>

namespace {

template <typename T, typename TW>
void attend(const float* qs, const T* cache, const TW* wkvb, const int64_t* table,
            const int64_t* seq, const int64_t* pos, float* out, int64_t R, int64_t H, int64_t n, int64_t r,
            int64_t c, int64_t v, int64_t width, int64_t block, float scale) {
  const int64_t row_dim = c + r, wh = (n + v) * c;
  int64_t longest = 0;
  for (int64_t i = 0; i < R; ++i) longest = std::max(longest, pos[i] + 1);
  at::parallel_for(0, R * H, k3k::grain_for(2 * longest * row_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> q_abs(c), mixed(c), lat(row_dim), scores(longest), wr(c);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / H, h = item % H, L = pos[i] + 1;
      const TW* w = wkvb + h * wh;  // [n + v, c]: W_UK rows then W_UV rows
      const float* q = qs + (i * H + h) * (n + r);  // [nope | rope]
      std::fill(q_abs.begin(), q_abs.end(), 0.f);
      for (int64_t a = 0; a < n; ++a) {
        const float qa = q[a];
        for (int64_t j = 0; j < c; ++j) wr[j] = k3k::load(w + a * c, j);
#pragma omp simd
        for (int64_t j = 0; j < c; ++j) q_abs[j] += qa * wr[j];
      }
      const float* qr = q + n;
      const int64_t* tab = table + seq[i] * width;
      float peak = -std::numeric_limits<float>::infinity();
      for (int64_t l = 0; l < L; ++l) {
        const T* src = cache + (tab[l / block] * block + l % block) * row_dim;
        for (int64_t j = 0; j < row_dim; ++j) lat[j] = k3k::load(src, j);
        scores[l] = (k3k::dot(q_abs.data(), lat.data(), c) + k3k::dot(qr, lat.data() + c, r)) * scale;
        peak = std::max(peak, scores[l]);
      }
      float total = 0.f;
      for (int64_t l = 0; l < L; ++l) total += (scores[l] = std::exp(scores[l] - peak));
      std::fill(mixed.begin(), mixed.end(), 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const T* src = cache + (tab[l / block] * block + l % block) * row_dim;
        const float p = scores[l] / total;
        for (int64_t j = 0; j < c; ++j) mixed[j] += p * k3k::load(src, j);
      }
      float* o = out + (i * H + h) * v;
      for (int64_t b = 0; b < v; ++b) {
        for (int64_t j = 0; j < c; ++j) wr[j] = k3k::load(w + (n + b) * c, j);
        o[b] = k3k::dot(mixed.data(), wr.data(), c);
      }
    }
  });
}

}  // namespace

template <typename TW>
void attend_any(const at::Tensor& cache, const float* q, const TW* w, const int64_t* tp, const int64_t* sp,
                const int64_t* pp, float* o, int64_t R, int64_t H, int64_t n, int64_t r, int64_t c, int64_t v,
                int64_t width, int64_t block, float sc) {
  switch (cache.scalar_type()) {
    case at::kFloat:
      return attend(q, cache.data_ptr<float>(), w, tp, sp, pp, o, R, H, n, r, c, v, width, block, sc);
    case at::kBFloat16:
      return attend(q, cache.data_ptr<at::BFloat16>(), w, tp, sp, pp, o, R, H, n, r, c, v, width, block, sc);
    case at::kFloat8_e4m3fn:
      return attend(q, cache.data_ptr<c10::Float8_e4m3fn>(), w, tp, sp, pp, o, R, H, n, r, c, v, width, block, sc);
    default:
      TORCH_CHECK(false, "latent cache dtype ", cache.scalar_type(), " is not supported");
  }
}

at::Tensor mla_decode(at::Tensor q, int64_t nope, at::Tensor cache, at::Tensor w_kv_b, at::Tensor table,
                      at::Tensor seq, at::Tensor pos, int64_t block, double scale) {
  using namespace k3k;
  check_f32(q, "q", 3);
  TORCH_CHECK(w_kv_b.dim() == 3 && w_kv_b.is_contiguous() &&
                  (w_kv_b.scalar_type() == at::kFloat || w_kv_b.scalar_type() == at::kBFloat16),
              "w_kv_b must be a contiguous [H, n + v, c] float32 or bfloat16 tensor");
  check_i64(seq, "seq");
  check_i64(pos, "pos");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.is_contiguous(),
              "table must be a contiguous [S, W] int64 block table");
  TORCH_CHECK(cache.dim() == 2 && cache.is_contiguous() && cache.device().is_cpu(), "cache must be [rows, c + r]");
  const int64_t R = q.size(0), H = q.size(1), n = nope, r = q.size(2) - nope;
  const int64_t c = w_kv_b.size(2), v = w_kv_b.size(1) - n, width = table.size(1);
  TORCH_CHECK(n > 0 && r >= 0 && w_kv_b.size(0) == H && v > 0, "q [R, H, n + r] and w_kv_b [H, n + v, c] disagree");
  TORCH_CHECK(cache.size(1) == c + r, "cache rows have ", cache.size(1), " values, expected c + r = ", c + r);
  TORCH_CHECK(seq.size(0) == R && pos.size(0) == R, "seq and pos need one entry per query row");
  const int64_t* sp = seq.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < table.size(0), "row ", i, ": sequence ", sp[i], " has no block table");
    TORCH_CHECK(pp[i] >= 0 && pp[i] / block < width, "row ", i, ": position ", pp[i], " beyond its block table");
    for (int64_t b = 0; b <= pp[i] / block; ++b)
      TORCH_CHECK(tp[sp[i] * width + b] >= 0 && (tp[sp[i] * width + b] + 1) * block <= cache.size(0),
                  "row ", i, ": block ", tp[sp[i] * width + b], " outside the cache");
  }
  auto out = at::empty({R, H, v}, q.options());
  const float* qp = q.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float sc = float(scale);
  if (w_kv_b.scalar_type() == at::kFloat)
    attend_any(cache, qp, w_kv_b.data_ptr<float>(), tp, sp, pp, o, R, H, n, r, c, v, width, block, sc);
  else
    attend_any(cache, qp, w_kv_b.data_ptr<at::BFloat16>(), tp, sp, pp, o, R, H, n, r, c, v, width, block, sc);
  return out;
}
