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
#include "core/common.h"
#include "core/simd.h"

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#ifndef K3K_AVX512
// attend_row, the portable form (AVX-512 builds run attend_rows below): scores for every position, then the softmax, then
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

// attend_rows: `rows` query rows of one sequence, row k over its first Ls[k] positions; each
// row's nh heads as attend_row (q_pe of row k at q_pe + k * row_stride; mixed [rows * nh, c]).
template <typename T>
void attend_rows(const float* q_abs, const float* q_pe, int64_t row_stride, int64_t ld, int64_t nh, int64_t rows,
                 const int64_t* Ls, const T* cache, const int64_t* tab, int64_t block, int64_t c, int64_t r,
                 float scale, float* mixed) {
  for (int64_t k = 0; k < rows; ++k)
    attend_row(q_abs + k * nh * c, q_pe + k * row_stride, ld, nh, cache, tab, block, Ls[k], c, r, scale,
               mixed + k * nh * c);
}
#else
// attend_rows: `rows` query rows of one sequence (a verify pass, a short prefill: row k over
// its first Ls[k] positions), nh heads each, in one pass over the latent rows with an online
// softmax per (row, head) query (a running peak; the mix and the total rescaled when it rises):
// each latent row is read and widened once for every query while it is in cache, and every 16
// positions' scores of a query come out of one vector pass (sums_rows) and one vector exp.
// mixed [rows * nh, c] <- sum_l p_l c_l (normalised). q_abs [rows * nh, c]; q_pe: the rope part
// of row 0 head 0's query, heads ld and rows row_stride apart. A query's arithmetic never
// depends on the others (positions past its own are masked), so grouping changes no bit.
template <typename T>
void attend_rows(const float* q_abs, const float* q_pe, int64_t row_stride, int64_t ld, int64_t nh, int64_t rows,
                 const int64_t* Ls, const T* cache, const int64_t* tab, int64_t block, int64_t c, int64_t r,
                 float scale, float* mixed) {
  const int64_t row_dim = c + r, W = (row_dim + 15) / 16, nq = rows * nh;  // W: vectors per (padded) latent row
  int64_t longest = 0;
  for (int64_t k = 0; k < rows; ++k) longest = std::max(longest, Ls[k]);
  std::vector<float> qcat(nq * W * 16, 0.f), lat(16 * W * 16, 0.f), peak(nq, -INFINITY), total(nq, 0.f);
  for (int64_t q = 0; q < nq; ++q) {  // [q_abs | q_pe | 0] * scale: the scores' scale taken into the query
    const float* pe = q_pe + q / nh * row_stride + q % nh * ld;
    for (int64_t j = 0; j < c; ++j) qcat[q * W * 16 + j] = q_abs[q * c + j] * scale;
    for (int64_t j = 0; j < r; ++j) qcat[q * W * 16 + c + j] = pe[j] * scale;
  }
  std::fill(mixed, mixed + nq * c, 0.f);
  alignas(64) float e[16];
  for (int64_t l0 = 0; l0 < longest; l0 += 16) {
    const int64_t nb = std::min<int64_t>(16, longest - l0);
    for (int64_t p = 0; p < nb; ++p) {
      const int64_t l = l0 + p;
      const T* src = cache + (tab[l / block] * block + l % block) * row_dim;
      for (int64_t j = 0; j < row_dim; ++j) lat[p * W * 16 + j] = k3k::load(src, j);
    }
    for (int64_t q = 0; q < nq; ++q) {
      const int64_t nbq = std::min<int64_t>(16, Ls[q / nh] - l0);  // this query's positions in the tile
      if (nbq <= 0) continue;
      const __mmask16 live = k3k::tail_mask(nbq);
      __m512 acc[16];
      for (int64_t p = 0; p < 16; ++p) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t w = 0; w < W; ++w)
          a = _mm512_fmadd_ps(_mm512_loadu_ps(qcat.data() + (q * W + w) * 16), _mm512_loadu_ps(lat.data() + (p * W + w) * 16), a);
        acc[p] = a;
      }
      const __m512 s = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), k3k::sums_rows(acc, 16));
      const float top = std::max(peak[q], _mm512_reduce_max_ps(s)), rescale = std::exp(peak[q] - top);
      _mm512_store_ps(e, k3k::exp16(_mm512_sub_ps(s, _mm512_set1_ps(top))));
      total[q] = total[q] * rescale + _mm512_mask_reduce_add_ps(live, _mm512_load_ps(e));
      peak[q] = top;
      float* mq = mixed + q * c;
      if (c % 64 == 0) {  // 64 mix values at a time held in registers over the tile's positions
        const __m512 rs = _mm512_set1_ps(rescale);
        for (int64_t j0 = 0; j0 < c; j0 += 64) {
          __m512 acc[4];
          for (int t = 0; t < 4; ++t) acc[t] = _mm512_mul_ps(_mm512_loadu_ps(mq + j0 + 16 * t), rs);
          for (int64_t p = 0; p < nbq; ++p) {
            const __m512 w = _mm512_set1_ps(e[p]);
            const float* lp = lat.data() + p * W * 16 + j0;
            for (int t = 0; t < 4; ++t) acc[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(lp + 16 * t), acc[t]);
          }
          for (int t = 0; t < 4; ++t) _mm512_storeu_ps(mq + j0 + 16 * t, acc[t]);
        }
        continue;
      }
      if (rescale != 1.f)
        for (int64_t j = 0; j < c; ++j) mq[j] *= rescale;
      for (int64_t p = 0; p < nbq; ++p) {
        const float w = e[p];
        const float* lp = lat.data() + p * W * 16;
#pragma omp simd
        for (int64_t j = 0; j < c; ++j) mq[j] += w * lp[j];
      }
    }
  }
  for (int64_t q = 0; q < nq; ++q)
    for (int64_t j = 0; j < c; ++j) mixed[q * c + j] /= total[q];
}
#endif

template <typename TW>
const std::conditional_t<std::is_same_v<TW, float>, float, uint16_t>* bits(const TW* w) {
  return reinterpret_cast<const std::conditional_t<std::is_same_v<TW, float>, float, uint16_t>*>(w);
}

// q_abs [nr * nh, c] = W_UK^T q_nope per row and head: row k's head g query at q + k * ldr + g *
// ldh ([nope | rope]), head g's W_UK [n, c] at w + g * wh. Each value is one chain over a in order.
// AVX-512: 64 values a row held in registers over a; else the axpy form, each weight row widened
// once (into wr) for the run's rows.
template <typename TW>
void absorb(const float* q, int64_t ldr, int64_t ldh, const TW* w, int64_t wh, int64_t nr, int64_t nh, int64_t n,
            int64_t c, float* q_abs, std::vector<float>& wr) {
  for (int64_t g = 0; g < nh; ++g) {
    const TW* wg = w + g * wh;
#ifdef K3K_AVX512
    for (int64_t k = 0; k < nr; ++k) {
      const float* qk = q + k * ldr + g * ldh;
      float* qa_row = q_abs + (k * nh + g) * c;
      for (int64_t j0 = 0; j0 < c; j0 += 64) {
        __m512 acc[4];
        const int parts = int(std::min<int64_t>(4, (c - j0 + 15) / 16));
        for (int t = 0; t < 4; ++t) acc[t] = _mm512_setzero_ps();
        for (int64_t a = 0; a < n; ++a) {
          const __m512 qa = _mm512_set1_ps(qk[a]);
          const auto* wa = bits(wg + a * c + j0);
          for (int t = 0; t < parts; ++t)
            acc[t] = _mm512_fmadd_ps(qa, k3k::load16(wa + 16 * t, k3k::tail_mask(c - j0 - 16 * t)), acc[t]);
        }
        for (int t = 0; t < parts; ++t) _mm512_mask_storeu_ps(qa_row + j0 + 16 * t, k3k::tail_mask(c - j0 - 16 * t), acc[t]);
      }
    }
#else
    for (int64_t k = 0; k < nr; ++k) std::fill(q_abs + (k * nh + g) * c, q_abs + (k * nh + g + 1) * c, 0.f);
    for (int64_t a = 0; a < n; ++a) {
      for (int64_t j = 0; j < c; ++j) wr[j] = k3k::load(wg + a * c, j);
      for (int64_t k = 0; k < nr; ++k) {
        const float qa = q[k * ldr + g * ldh + a];
        float* qa_row = q_abs + (k * nh + g) * c;
#pragma omp simd
        for (int64_t j = 0; j < c; ++j) qa_row[j] += qa * wr[j];
      }
    }
#endif
  }
}

// out[k * ldr + g * v + b] = W_UV mixed per row k and head g ([v]), head g's W_UV [v, c] at w +
// g * wh. AVX-512: 16 outputs at a time, each dot kept as its vector and the 16 summed across
// at once (simd.h sums_rows: a horizontal sum apiece cost more than a small head's dot); else
// one dot at a time on widened rows. A value never depends on the run's other rows.
template <typename TW>
void unabsorb(const float* mixed, const TW* w, int64_t wh, int64_t nr, int64_t nh, int64_t v, int64_t c, float* out,
              int64_t ldr, int64_t ldh, std::vector<float>& wr) {
  for (int64_t g = 0; g < nh; ++g) {
    const TW* wg = w + g * wh;
#ifdef K3K_AVX512
    __m512 part[16];
    for (int64_t b0 = 0; b0 < v; b0 += 16) {
      const int nb = int(std::min<int64_t>(16, v - b0));
      for (int64_t k = 0; k < nr; ++k) {
        const float* m = mixed + (k * nh + g) * c;
        for (int i = 0; i < nb; ++i) part[i] = k3k::row_dot_vec(m, bits(wg + (b0 + i) * c), c);
        _mm512_mask_storeu_ps(out + k * ldr + g * ldh + b0, k3k::tail_mask(nb), k3k::sums_rows(part, nb));
      }
    }
#else
    for (int64_t b = 0; b < v; ++b) {
      for (int64_t j = 0; j < c; ++j) wr[j] = k3k::load(wg + b * c, j);
      for (int64_t k = 0; k < nr; ++k) out[k * ldr + g * ldh + b] = k3k::dot(mixed + (k * nh + g) * c, wr.data(), c);
    }
#endif
  }
}

// One work item is a run of query rows of one sequence (a verify pass's 1 + k rows, a short
// prefill; a decode row alone) and a group of their heads: each latent row of the context is
// read (and converted to fp32) once for the whole item instead of once per row and head, which
// is what makes absorbed MLA decode cheap (every head attends to the same [c | r] rows). Per
// head the arithmetic is unchanged (the same dots in the same order), so the grouping, and with
// it the thread count, never changes a bit of the output.
template <typename T, typename TW>
void attend(const float* qs, const T* cache, const TW* wkvb, const int64_t* table,
            const int64_t* seq, const int64_t* pos, float* out, int64_t R, int64_t H, int64_t n, int64_t r,
            int64_t c, int64_t v, int64_t width, int64_t block, float scale) {
  const int64_t row_dim = c + r, wh = (n + v) * c;
  int64_t longest = 0;
  std::vector<int64_t> first{0};  // runs: rows first[u]..first[u + 1] share one sequence
  for (int64_t i = 0; i < R; ++i) {
    longest = std::max(longest, pos[i] + 1);
    if (i > 0 && seq[i] != seq[i - 1]) first.push_back(i);
  }
  first.push_back(R);
  const int64_t runs = int64_t(first.size()) - 1;
  // enough items for every thread: split the heads when runs are fewer than threads
  const int64_t split = std::min<int64_t>(H, std::max<int64_t>(1, (at::get_num_threads() + runs - 1) / runs));
  const int64_t hg = (H + split - 1) / split, groups = (H + hg - 1) / hg;
  at::parallel_for(0, runs * groups, k3k::grain_for(2 * longest * row_dim * hg * R / runs), [&](int64_t begin, int64_t end) {
    std::vector<float> q_abs, mixed, wr(c);
    std::vector<int64_t> Ls;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t u = item / groups, h0 = item % groups * hg, nh = std::min(hg, H - h0);
      const int64_t i0 = first[u], nr = first[u + 1] - i0;
      q_abs.resize(nr * nh * c);  // absorb writes every value
      mixed.resize(nr * nh * c);
      Ls.resize(nr);
      for (int64_t k = 0; k < nr; ++k) Ls[k] = pos[i0 + k] + 1;
      absorb(qs + (i0 * H + h0) * (n + r), H * (n + r), n + r, wkvb + h0 * wh, wh, nr, nh, n, c, q_abs.data(), wr);
      // mixed [nr * nh, c] = sum_l softmax(s)_l c_l per row and head
      attend_rows(q_abs.data(), qs + (i0 * H + h0) * (n + r) + n, H * (n + r), n + r, nh, nr, Ls.data(), cache,
                  table + seq[i0] * width, block, c, r, scale, mixed.data());
      unabsorb(mixed.data(), wkvb + h0 * wh + n * c, wh, nr, nh, v, c, out + (i0 * H + h0) * v, H * v, v, wr);
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
