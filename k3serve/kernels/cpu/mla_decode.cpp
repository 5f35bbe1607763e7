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
#include "simd.h"

#include <c10/util/Float8_e4m3fn.h>

#include <limits>
#include <vector>

namespace {

#ifndef K3K_AVX512
// attend_row, the portable form (the AVX-512 one below): scores for every position, then the softmax, then
// the mix, one latent row at a time (each read twice).
template <typename T>
void attend_row(const float* q_abs, const float* q_pe, int64_t ld, int64_t nh, const T* cache, const int64_t* tab,
                int64_t block, int64_t L, int64_t c, int64_t r, float scale, float* mixed) {
  const int64_t row_dim = c + r;
  std::vector<float> lat(row_dim), scores(nh * L), peak(nh, -INFINITY), total(nh, 0.f);
  for (int64_t l = 0; l < L; ++l) {
    const T* src = cache + (tab[l / block] * block + l % block) * row_dim;
    for (int64_t j = 0; j < row_dim; ++j) lat[j] = k3k::load(src, j);
    for (int64_t g = 0; g < nh; ++g) {
      const float s = (k3k::dot(q_abs + g * c, lat.data(), c) + k3k::dot(q_pe + g * ld, lat.data() + c, r)) * scale;
      scores[g * L + l] = s;
      peak[g] = std::max(peak[g], s);
    }
  }
  for (int64_t g = 0; g < nh; ++g)
    for (int64_t l = 0; l < L; ++l) total[g] += (scores[g * L + l] = std::exp(scores[g * L + l] - peak[g]));
  std::fill(mixed, mixed + nh * c, 0.f);
  for (int64_t l = 0; l < L; ++l) {
    const T* src = cache + (tab[l / block] * block + l % block) * row_dim;
    for (int64_t j = 0; j < c; ++j) lat[j] = k3k::load(src, j);
    for (int64_t g = 0; g < nh; ++g) {
      const float w = scores[g * L + l] / total[g];
      for (int64_t j = 0; j < c; ++j) mixed[g * c + j] += w * lat[j];
    }
  }
}
#else
// sum(v[m]) for 16 vectors, as one vector: lane 4k + j holds sum(v[k + 4j]) (three levels of
// 128-bit-lane shuffles and adds: ~3 instructions a sum, where a reduction apiece takes ~8)
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

// attend_row: one query row's nh heads over its L positions, in one pass over the latent rows with an online
// softmax (a running peak per head; the mix and the total rescaled when it rises): each latent
// row is read and widened once for all heads while it is in cache, and every 16 positions'
// scores come out of one vector pass (sums16) and one vector exp. mixed [nh, c] <- sum_l p_l c_l
// (normalised). q_abs [nh, c]; q_pe: the rope part of head 0's query, heads ld apart.
template <typename T>
void attend_row(const float* q_abs, const float* q_pe, int64_t ld, int64_t nh, const T* cache, const int64_t* tab,
                int64_t block, int64_t L, int64_t c, int64_t r, float scale, float* mixed) {
  const int64_t row_dim = c + r, W = (row_dim + 15) / 16;  // vectors per (padded) latent row
  std::vector<float> qcat(nh * W * 16, 0.f), lat(16 * W * 16, 0.f), peak(nh, -INFINITY), total(nh, 0.f);
  for (int64_t g = 0; g < nh; ++g) {  // [q_abs | q_pe | 0] * scale: the scores' scale taken into the query
    for (int64_t j = 0; j < c; ++j) qcat[g * W * 16 + j] = q_abs[g * c + j] * scale;
    for (int64_t j = 0; j < r; ++j) qcat[g * W * 16 + c + j] = q_pe[g * ld + j] * scale;
  }
  std::fill(mixed, mixed + nh * c, 0.f);
  alignas(64) float e[16];
  for (int64_t l0 = 0; l0 < L; l0 += 16) {
    const int64_t nb = std::min<int64_t>(16, L - l0);
    for (int64_t p = 0; p < nb; ++p) {
      const int64_t l = l0 + p;
      const T* src = cache + (tab[l / block] * block + l % block) * row_dim;
      for (int64_t j = 0; j < row_dim; ++j) lat[p * W * 16 + j] = k3k::load(src, j);
    }
    const __mmask16 live = k3k::tail_mask(nb);
    for (int64_t g = 0; g < nh; ++g) {
      __m512 acc[16];
      for (int m = 0; m < 16; ++m) {  // sums16 puts v[k + 4j] in lane 4k + j: position 4k + j goes to m = k + 4j
        const int64_t p = 4 * (m % 4) + m / 4;
        __m512 a = _mm512_setzero_ps();
        for (int64_t w = 0; w < W; ++w)
          a = _mm512_fmadd_ps(_mm512_loadu_ps(qcat.data() + (g * W + w) * 16), _mm512_loadu_ps(lat.data() + (p * W + w) * 16), a);
        acc[m] = a;
      }
      const __m512 s = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), sums16(acc));
      const float top = std::max(peak[g], _mm512_reduce_max_ps(s)), rescale = std::exp(peak[g] - top);
      _mm512_store_ps(e, k3k::exp16(_mm512_sub_ps(s, _mm512_set1_ps(top))));
      total[g] = total[g] * rescale + _mm512_mask_reduce_add_ps(live, _mm512_load_ps(e));
      peak[g] = top;
      float* mg = mixed + g * c;
      if (rescale != 1.f)
        for (int64_t j = 0; j < c; ++j) mg[j] *= rescale;
      for (int64_t p = 0; p < nb; ++p) {
        const float w = e[p];
        const float* lp = lat.data() + p * W * 16;
#pragma omp simd
        for (int64_t j = 0; j < c; ++j) mg[j] += w * lp[j];
      }
    }
  }
  for (int64_t g = 0; g < nh; ++g)
    for (int64_t j = 0; j < c; ++j) mixed[g * c + j] /= total[g];
}
#endif

// One work item is a query row and a group of its heads: each latent row of the context is
// read (and converted to fp32) once for the whole group instead of once per head, which is what
// makes absorbed MLA decode cheap (every head attends to the same [c | r] rows). Per head the
// arithmetic is unchanged (the same dots in the same order), so the grouping, and with it the
// thread count, never changes a bit of the output.
template <typename T, typename TW>
void attend(const float* qs, const T* cache, const TW* wkvb, const int64_t* table,
            const int64_t* seq, const int64_t* pos, float* out, int64_t R, int64_t H, int64_t n, int64_t r,
            int64_t c, int64_t v, int64_t width, int64_t block, float scale) {
  const int64_t row_dim = c + r, wh = (n + v) * c;
  int64_t longest = 0;
  for (int64_t i = 0; i < R; ++i) longest = std::max(longest, pos[i] + 1);
  // enough items to keep every thread busy: split a row's heads when rows are few
  const int64_t split = std::min<int64_t>(H, std::max<int64_t>(1, (2 * at::get_num_threads() + R - 1) / R));
  const int64_t hg = (H + split - 1) / split, groups = (H + hg - 1) / hg;
  at::parallel_for(0, R * groups, k3k::grain_for(2 * longest * row_dim * hg), [&](int64_t begin, int64_t end) {
    std::vector<float> q_abs(hg * c), mixed(hg * c), wr(c);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / groups, h0 = item % groups * hg, nh = std::min(hg, H - h0), L = pos[i] + 1;
      for (int64_t g = 0; g < nh; ++g) {  // q_abs = W_UK^T q_nope per head: [c]
        const TW* w = wkvb + (h0 + g) * wh;  // [n + v, c]: W_UK rows then W_UV rows
        const float* q = qs + (i * H + h0 + g) * (n + r);  // [nope | rope]
        float* qa_row = q_abs.data() + g * c;
        std::fill(qa_row, qa_row + c, 0.f);
        for (int64_t a = 0; a < n; ++a) {
          const float qa = q[a];
          for (int64_t j = 0; j < c; ++j) wr[j] = k3k::load(w + a * c, j);
#pragma omp simd
          for (int64_t j = 0; j < c; ++j) qa_row[j] += qa * wr[j];
        }
      }
      // mixed [nh, c] = sum_l softmax(s)_l c_l per head
      attend_row(q_abs.data(), qs + (i * H + h0) * (n + r) + n, n + r, nh, cache, table + seq[i] * width, block, L, c,
                 r, scale, mixed.data());
      for (int64_t g = 0; g < nh; ++g) {
        const TW* w = wkvb + (h0 + g) * wh;
        float* o = out + (i * H + h0 + g) * v;
        for (int64_t b = 0; b < v; ++b) {
          for (int64_t j = 0; j < c; ++j) wr[j] = k3k::load(w + (n + b) * c, j);
          o[b] = k3k::dot(mixed.data() + g * c, wr.data(), c);
        }
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
