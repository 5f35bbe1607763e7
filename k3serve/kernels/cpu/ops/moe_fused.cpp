// The routed half of a MoE layer in two calls (issue 15): `moe_route` (router scores, noaux_tc
// selection, renormalised weights) and `moe_experts` (every selected expert on its tokens and the
// weighted sum), for packed MXFP4 experts (K3) and dense fp32/bf16 ones (Kimi-Linear).
//
// moe_experts groups (token, expert) pairs by expert; each (expert, output row) decodes its row
// once and dots it with that expert's tokens, so a 4-bit expert costs its packed bytes of
// traffic. In a bf16 model (activations hold bf16 values) the rows decode to bf16 and every
// matrix runs in vdpbf16ps tiles, rounding to bf16 where torch's path does (each matmul's
// output, the GLU); otherwise in FP32. Every pair's result is summed into its token in expert
// order, independent of which other tokens share the step (batch invariance).
// References: k3serve/layers/router.py `route`, k3serve/layers/experts.py `experts_forward`
// (and `experts_reference`), compared in tests/model/test_kernels.py.
#include "core/common.h"
#include "core/panels.h"
#include "core/simd.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace {

constexpr int kGroup = 32;
// MXFP4 rows decode prefetching the rows this many rows further on (in registers: the next two
// 4-row tiles; staged for more than 4 tokens: 8 rows on): 400 M Kimi-Linear's experts, one
// token, two cores: 22 GB/s of codes without, 30-31 with 4-16.
constexpr int64_t kPrefetchRows = 8;
using k3k::round_bf16;

// One expert matrix [E, O, I]: dense (fp32 / bf16), packed MXFP4 (codes [E, O, I/2], E8M0
// [E, O, I/32]) or fp32 panels ([E, O/16, I, 16], panels.h expert_panel_form: `panels`).
struct Matrix {
  at::ScalarType dtype;
  const void* data;
  const uint8_t* scale = nullptr;
  int64_t E, O, I;
  bool panels = false;

  // The FP32 route (activations that are not bf16 values): a packed row read by several tokens
  // is decoded into `buf` once per (expert, row) and reused (one token: decoded inside its dot,
  // never written out); a bf16 row is read in place by every token's dot, widened in registers.
  // Returns the row to dot with, or null: read in place.
  const float* prepare(int64_t e, int64_t o, float* buf, int64_t tokens) const {
    if (scale) {
      if (tokens == 1) return nullptr;  // decoded inside the dot (mxfp4_row_dot)
      k3k::decode_mxfp4_row<true>(codes(e, o), scales(e, o), I, buf);
      return buf;
    }
    if (dtype == at::kFloat) return static_cast<const float*>(data) + (e * O + o) * I;
    return nullptr;
  }
  // A packed matrix takes its vectors in split order (simd.h split32: no interleaving on decode).
  bool split() const { return scale != nullptr; }
#ifdef K3K_AVX512
  // sum_i row(e, o)[i] x[i] in FP32 as a vector before its horizontal sum, `row` from prepare()
  // (the same for a staged or an in-dot decoded row), x in split32 order when split()
  __m512 dot_vec(int64_t e, int64_t o, const float* row, const float* x) const {
    if (row) return k3k::row_dot_vec(x, row, I);
    if (scale) return k3k::mxfp4_row_dot_vec(x, codes(e, o), scales(e, o), I);
    return k3k::row_dot_vec(x, static_cast<const uint16_t*>(data) + (e * O + o) * I, I);
  }
#else
  // sum_i row(e, o)[i] x[i] in FP32, `row` from prepare(), x in split32 order when split()
  float dot(int64_t e, int64_t o, const float* row, const float* x) const {
    if (row) return k3k::row_dot(x, row, I);
    if (scale) return k3k::mxfp4_row_dot(x, codes(e, o), scales(e, o), I);
    return k3k::row_dot(x, static_cast<const uint16_t*>(data) + (e * O + o) * I, I);
  }
  // out[j * ldo] = dot(e, o, row, x[j]) for T token rows, the weight row read once per three
  // tokens (simd.h row_dot_rows: the same bits as one dot at a time)
  void dot_tokens(int64_t e, int64_t o, const float* row, const float* const* x, int64_t T, float* out,
                  int64_t ldo) const {
    if (row) return k3k::row_dot_rows(x, T, row, I, out, ldo);
    if (!scale) return k3k::row_dot_rows(x, T, static_cast<const uint16_t*>(data) + (e * O + o) * I, I, out, ldo);
    for (int64_t j = 0; j < T; ++j) out[j * ldo] = dot(e, o, row, x[j]);
  }
#endif
#ifdef K3K_DPBF16
  // Weight rows per tile of the bf16 route for T activation rows: packed rows meeting up to 4
  // tokens decode in registers several at a time (simd.h mxfp4_tile_rows), the rest as simd.h's
  // bf16 tiles take them (tile_rows_bf16, at most 3).
  int tile_rows(int64_t T) const {
    // the whole [E, O, I] tensor's bytes: a step reads many experts (400 M: 1 MB each, 32 MB all)
    return scale && T <= 4 ? k3k::mxfp4_tile_rows(T) : k3k::tile_rows_bf16(T, E * O * I * (scale ? 1 : 4) / 2);
  }

  // The bf16 route: out[j * ldo + r] = row (e, o + r) . xs[j] for R <= tile_rows(T) rows and T
  // activation rows xs [T, I] of bf16 bits (nib64 order when packed), in simd.h's tiles. Packed
  // rows meet up to 4 tokens as they decode (mxfp4_dot_tile_bf16), more from a bf16 copy in
  // wb [3 * I]. A row whose scales do not fold into bf16 goes to FP32 in column order (wf
  // scratch, xf(j): row j as floats). Every choice is made by the row and T alone, and the
  // staged and in-register forms give the same bits whatever R, so no result depends on the batch.
  template <typename XF>
  void dot_rows(int64_t e, int64_t o, int R, const uint16_t* xs, int64_t T, float* out, int64_t ldo, uint16_t* wb,
                float* wf, XF xf) const {
    const uint16_t* rows[3];
    if (!scale) {
      for (int r = 0; r < R; ++r) rows[r] = static_cast<const uint16_t*>(data) + (e * O + o + r) * I;
      return k3k::dot_rows_bf16(xs, I, T, rows, R, I, out, ldo, R * I);
    }
    if (T <= 4 && in_registers(e, o, R, xs, T, out, ldo)) return;
    bool folded[4], all = true;
    for (int r = 0; r < R; ++r) {  // one row at a time: a row of the tile did not fold
      rows[r] = wb + r * I;
      folded[r] = T <= 4 ? in_registers(e, o + r, 1, xs, T, out + r, ldo)
                         : k3k::decode_mxfp4_row_bf16(codes(e, o + r), scales(e, o + r), I, wb + r * I, kPrefetchRows * I / 2);
      all &= folded[r];
    }
    if (T > 4 && all) return k3k::dot_rows_bf16(xs, I, T, rows, R, I, out, ldo);
    for (int r = 0; r < R; ++r) {
      if (T > 4 && folded[r]) {
        k3k::dot_rows_bf16(xs, I, T, rows[r], I, out + r, ldo);
      } else if (!folded[r]) {  // FP32, column order
        k3k::decode_mxfp4_row(codes(e, o + r), scales(e, o + r), I, wf);
        for (int64_t j = 0; j < T; ++j) out[j * ldo + r] = k3k::row_dot(xf(j), wf, I);
      }
    }
  }
  // rows o .. o + R - 1 against T <= 4 tokens, decoded in registers; false if one did not fold
  bool in_registers(int64_t e, int64_t o, int R, const uint16_t* xs, int64_t T, float* out, int64_t ldo) const {
    switch (R) {
      case 1: return in_registers<1>(e, o, xs, T, out, ldo);
      case 2: return in_registers<2>(e, o, xs, T, out, ldo);
      case 3: return in_registers<3>(e, o, xs, T, out, ldo);
      default: return in_registers<4>(e, o, xs, T, out, ldo);
    }
  }
  template <int R>
  bool in_registers(int64_t e, int64_t o, const uint16_t* xs, int64_t T, float* out, int64_t ldo) const {
    const uint8_t *c[R], *s[R];
    for (int r = 0; r < R; ++r) c[r] = codes(e, o + r), s[r] = scales(e, o + r);
    const int64_t pf = kPrefetchRows * I / 2;  // code bytes on (rows of an expert are contiguous)
    switch (T) {
      case 1: return k3k::mxfp4_dot_tile_bf16<R, 1>(xs, I, c, s, I, out, ldo, pf);
      case 2: return k3k::mxfp4_dot_tile_bf16<R, 2>(xs, I, c, s, I, out, ldo, pf);
      case 3: return k3k::mxfp4_dot_tile_bf16<R, 3>(xs, I, c, s, I, out, ldo, pf);
      default: return k3k::mxfp4_dot_tile_bf16<R, 4>(xs, I, c, s, I, out, ldo, pf);
    }
  }
#endif
  bool bf16() const { return !scale && dtype == at::kBFloat16; }
  const float* panel(int64_t e) const { return static_cast<const float*>(data) + e * O * I; }
  const uint8_t* codes(int64_t e, int64_t o) const { return static_cast<const uint8_t*>(data) + (e * O + o) * (I / 2); }
  const uint8_t* scales(int64_t e, int64_t o) const { return scale + (e * O + o) * (I / kGroup); }
};

Matrix matrix(const at::Tensor& w, const c10::optional<at::Tensor>& scale, const char* name) {
  if (w.dim() == 4) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.size(3) == k3k::kPanel && w.is_contiguous() && w.device().is_cpu() &&
                    !scale.has_value(), name, ": expert panels must be a contiguous fp32 [E, O/16, I, 16] tensor");
    return {at::kFloat, w.data_ptr(), nullptr, w.size(0), w.size(1) * k3k::kPanel, w.size(2), true};
  }
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.device().is_cpu(), name, " must be a contiguous [E, O, I] tensor");
  if (scale.has_value()) {
    TORCH_CHECK(w.scalar_type() == at::kByte && scale->scalar_type() == at::kByte && scale->is_contiguous(),
                name, ": packed MXFP4 needs uint8 codes and uint8 E8M0 scales");
    TORCH_CHECK(scale->size(0) == w.size(0) && scale->size(1) == w.size(1) && scale->size(2) * kGroup == 2 * w.size(2),
                name, ": scales must be [E, O, I/32]");
    return {at::kByte, w.data_ptr(), scale->data_ptr<uint8_t>(), w.size(0), w.size(1), 2 * w.size(2)};
  }
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, name,
              " must be float32, bfloat16 or packed MXFP4, got ", w.scalar_type());
  return {w.scalar_type(), w.data_ptr(), nullptr, w.size(0), w.size(1), w.size(2)};
}

// at::parallel_for over the (expert, row) items [0, A * width) (`width` items an expert), in at
// most one chunk a thread, the chunks of equal estimated cost rather than equal item counts: an
// item of an expert with T pairs costs row_cost + T (getting its row, then a dot per pair). A
// split by count leaves one core waiting whenever the experts that meet most of a batch's tokens
// fall in one half. Measured on 400 M Kimi-Linear's experts (16 tokens, top-4 of 32, routing
// skewed as p(e) ~ 1/e^s, 7 layers alternated in one process, median of 24-30): packed MXFP4
// (row_cost 2: a decoded row costs about two dots) 0.88-0.94x the time at s = 1, 0.77-0.87x at
// s = 2; bf16 (16: a row streamed from memory outweighs its few dots; 2 lost 3-4%) 0.99x at
// s = 1, 0.91-0.92x at s = 2; uniform routing 0.99-1.02x. `grain`: the
// fewest items worth a chunk (grain_for), so a small layer stays on one thread. f(begin, end)
// takes any range (a row's sums never depend on its tile: the split changes no bit).
template <typename F>
void for_expert_items(const std::vector<int64_t>& active, const std::vector<int64_t>& offset, int64_t width,
                      int64_t row_cost, int64_t grain, const F& f) {
  const int64_t A = int64_t(active.size()), n = A * width;
  grain = std::max<int64_t>(grain, 1);  // grain_for's serial_blocks() value is INT64_MAX: no n + grain
  const int64_t parts = n <= grain ? 1 : std::min<int64_t>(at::get_num_threads(), (n - 1) / grain + 1);
  if (parts <= 1 || at::in_parallel_region()) {
    if (n) f(int64_t(0), n);
    return;
  }
  const auto cost = [&](int64_t a) { return row_cost + offset[active[a] + 1] - offset[active[a]]; };
  int64_t total = 0;
  for (int64_t a = 0; a < A; ++a) total += cost(a) * width;
  std::vector<int64_t> cut{0};
  int64_t a = 0, before = 0;  // the cost of experts [0, a)
  for (int64_t p = 1; p < parts; ++p) {  // cut p: where the cost reaches p / parts of the total
    const int64_t target = total * p / parts;
    while (a < A && before + cost(a) * width <= target) before += cost(a++) * width;
    cut.push_back(std::max(cut.back(), a < A ? a * width + (target - before) / cost(a) : n));
  }
  cut.push_back(n);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      if (cut[p] < cut[p + 1]) f(cut[p], cut[p + 1]);
  });
}

// for_expert_items' row cost of a matrix: packed MXFP4 rows decode and fp32 panels (cache-resident
// experts) multiply, both compute; dense rows stream from memory
int64_t row_cost(const Matrix& m) { return m.scale || m.panels ? 2 : 16; }

// The FP32 route over (expert, row) items [begin, end) of m, `width` rows an expert: out[q *
// width + o] = row (e, o) . x[q] for every pair q of expert e = active[item / width], rounded to
// bf16 with `rnd`. AVX-512: up to 16 rows of one expert at a time, each (row, token) dot kept as
// its vector and the 16 summed across at once (simd.h sums_rows: a third of the instructions of
// a horizontal sum apiece, which cost more than a small expert's dot itself); a row's sum never
// depends on its group. Else one dot at a time.
void fp32_rows(const Matrix& m, int64_t width, const std::vector<int64_t>& active, const std::vector<int64_t>& offset,
               const float* const* x, int64_t begin, int64_t end, float* out, bool rnd) {
#ifdef K3K_AVX512
  std::vector<float> staged(16 * m.I);
  __m512 part[16];
  for (int64_t item = begin; item < end;) {
    const int64_t e = active[item / width], o0 = item % width, q0 = offset[e], T = offset[e + 1] - q0;
    const int n = int(std::min<int64_t>({16, end - item, width - o0}));
    const float* rows[16];
    for (int r = 0; r < n; ++r) rows[r] = m.prepare(e, o0 + r, staged.data() + r * m.I, T);
    for (int64_t j = 0; j < T; ++j) {
      for (int r = 0; r < n; ++r) part[r] = m.dot_vec(e, o0 + r, rows[r], x[q0 + j]);
      _mm512_mask_storeu_ps(out + (q0 + j) * width + o0, k3k::tail_mask(n), k3k::sums_rows(part, n));
    }
    if (rnd)
      for (int64_t q = q0; q < q0 + T; ++q)
        for (int r = 0; r < n; ++r) out[q * width + o0 + r] = round_bf16(out[q * width + o0 + r]);
    item += n;
  }
#else
  std::vector<float> buf(m.I);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t e = active[item / width], o = item % width, q0 = offset[e], T = offset[e + 1] - q0;
    m.dot_tokens(e, o, m.prepare(e, o, buf.data(), T), x + q0, T, out + q0 * width + o, width);
    if (rnd)
      for (int64_t q = q0; q < q0 + T; ++q) out[q * width + o] = round_bf16(out[q * width + o]);
  }
#endif
}

// The panel route (experts in fp32 panels): out[q * O + o] = row (e, o) . xs[q] for every pair q
// of each active expert e, its T pairs' rows contiguous in xs [pairs, I] (expert order), in
// panels.h tiles; rounded to bf16 with `rnd`. Each matrix of `mats` (same E, O, I) writes its own
// output. A row's sum is one FMA chain in column order, whatever its tile (batch invariance).
void panel_experts(std::initializer_list<std::pair<const Matrix*, float*>> mats, const std::vector<int64_t>& active,
                   const std::vector<int64_t>& offset, const float* xs, int64_t pairs, bool rnd) {
  const Matrix& m = *mats.begin()->first;
  const int64_t P = m.O / k3k::kPanel, A = int64_t(active.size()), I = m.I, O = m.O;
  const int64_t per = std::max<int64_t>(1, pairs / std::max<int64_t>(A, 1));
  for_expert_items(active, offset, P, row_cost(m), k3k::grain_for(2 * I * k3k::kPanel * per * int64_t(mats.size())),
                   [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end;) {
      const int64_t e = active[item / P], p0 = item % P, p1 = std::min(P, p0 + end - item);
      const int64_t q0 = offset[e], T = offset[e + 1] - q0;
      for (const auto& [mat, out] : mats) {
        k3k::panel_rows(xs + q0 * I, T, I, mat->panel(e), p0, p1, out + q0 * O, O);
        if (rnd)
          for (int64_t q = q0; q < q0 + T; ++q)
            for (int64_t o = p0 * k3k::kPanel; o < p1 * k3k::kPanel; ++o) out[q * O + o] = round_bf16(out[q * O + o]);
      }
      item += p1 - p0;
    }
  });
}

#ifdef K3K_DPBF16
// n rows (row q at src(q), K floats holding bf16 values) as bf16 bits [n, K], in nib64 order
// for packed matrices (split)
template <typename Src>
std::vector<uint16_t> bf16_rows(int64_t n, int64_t K, bool split, Src src) {
  std::vector<uint16_t> out(n * K), tmp(split ? K : 0);
  for (int64_t q = 0; q < n; ++q) {
    k3k::to_bf16_bits(src(q), K, split ? tmp.data() : out.data() + q * K);
    if (split) k3k::mxfp4_order_bf16(tmp.data(), K, out.data() + q * K);
  }
  return out;
}

// w1 and w3 can take the bf16 route: both packed MXFP4 (K a multiple of 32, one split order) or
// both bf16, and every value of z [n] representable in bf16 (then the route is exact up to
// summation order, whatever the batch)
bool gate_up_bf16(const Matrix& m1, const Matrix& m3, const float* z, int64_t n) {
  if (!((m1.scale && m3.scale) || (m1.bf16() && m3.bf16()))) return false;
  for (int64_t i = 0; i < n; ++i)
    if (k3k::round_bf16(z[i]) != z[i] && !std::isnan(z[i])) return false;
  return true;
}
#endif

}  // namespace

at::Tensor moe_experts(at::Tensor z, at::Tensor ids, at::Tensor weights, at::Tensor w1,
                       c10::optional<at::Tensor> w1_scale, at::Tensor w3, c10::optional<at::Tensor> w3_scale,
                       at::Tensor w2, c10::optional<at::Tensor> w2_scale, int64_t act, double beta,
                       double linear_beta, bool round_bf16_steps) {
  using namespace k3k;
  check_f32(z, "z", 2);
  check_f32(weights, "weights", 2);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.is_contiguous(), "ids must be [N, k] int64");
  const Matrix m1 = matrix(w1, w1_scale, "w1"), m3 = matrix(w3, w3_scale, "w3"), m2 = matrix(w2, w2_scale, "w2");
  const int64_t N = z.size(0), Kin = z.size(1), topk = ids.size(1), E = m1.E, inter = m1.O, out_dim = m2.O;
  TORCH_CHECK(m1.I == Kin && m3.I == Kin && m3.O == inter && m2.I == inter && m3.E == E && m2.E == E,
              "expert shapes disagree: w1/w3 [E, inter, ", Kin, "], w2 [E, out, inter]");
  TORCH_CHECK(!m1.scale || Kin % kGroup == 0, "K = ", Kin, " is not a multiple of ", kGroup);
  TORCH_CHECK(weights.size(0) == N && weights.size(1) == topk && ids.size(0) == N, "ids and weights must be [N, k]");
  const int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t p = 0; p < N * topk; ++p) {
    TORCH_CHECK(ip[p] >= 0 && ip[p] < E, "expert id ", ip[p], " out of range [0, ", E, ")");
    ++count[ip[p] + 1];
  }
  std::vector<int64_t> offset(E + 1, 0), order(N * topk), rank(N * topk);
  std::partial_sum(count.begin(), count.end(), offset.begin());
  {
    std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
    for (int64_t p = 0; p < N * topk; ++p) rank[p] = fill[ip[p]]++, order[rank[p]] = p;  // stable by expert
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (offset[e + 1] > offset[e]) active.push_back(e);
  const int64_t A = int64_t(active.size()), pairs = N * topk;
  const int64_t grain1 = grain_for(4 * Kin * std::max<int64_t>(1, pairs / std::max<int64_t>(A, 1)));  // w1 and w3
  const float *zp = z.data_ptr<float>(), *wp = weights.data_ptr<float>();
  const float fb = float(beta), flb = float(linear_beta);
  const bool rnd = round_bf16_steps;
  std::vector<float> h(pairs * inter), u(pairs * inter), y(pairs * out_dim), zs, hs;
#ifdef K3K_DPBF16
  // Where z holds bf16 values (a bf16 model: z is x or a bf16 projection of it), w1 and w3 meet it
  // in vdpbf16ps, each (expert, row) against all its tokens at once, eight per weight load: the
  // pairs' z rows gathered in expert order as bf16 bits (nib64 order for packed experts, whose
  // rows are decoded to bf16 once per (expert, row): decode_mxfp4_row_bf16).
  if (gate_up_bf16(m1, m3, zp, N * Kin)) {
    const std::vector<uint16_t> zg =
        bf16_rows(pairs, Kin, m1.split(), [&](int64_t q) { return zp + (order[q] / topk) * Kin; });
    for_expert_items(active, offset, inter, row_cost(m1), grain1,
                     [&](int64_t begin, int64_t end) {
      std::vector<uint16_t> wb(3 * Kin);
      std::vector<float> wf(Kin);
      for (int64_t item = begin; item < end;) {
        const int64_t e = active[item / inter], o = item % inter, q0 = offset[e], T = offset[e + 1] - q0;
        const int R = int(std::min<int64_t>({m1.tile_rows(T), end - item, inter - o}));
        const auto zrow = [&](int64_t j) { return zp + (order[q0 + j] / topk) * Kin; };
        for (const auto& [mat, dst] : {std::pair{&m1, &h}, std::pair{&m3, &u}}) {
          float* out = dst->data() + q0 * inter + o;
          mat->dot_rows(e, o, R, zg.data() + q0 * Kin, T, out, inter, wb.data(), wf.data(), zrow);
          if (rnd)
            for (int64_t j = 0; j < T; ++j)
              for (int r = 0; r < R; ++r) out[j * inter + r] = round_bf16(out[j * inter + r]);
        }
        item += R;
      }
    });
  } else
#endif
  if (m1.panels && m3.panels) {  // each pair's z row, in expert order
    zs.resize(pairs * Kin);
    for (int64_t q = 0; q < pairs; ++q)
      std::memcpy(zs.data() + q * Kin, zp + (order[q] / topk) * Kin, Kin * sizeof(float));
    panel_experts({{&m1, h.data()}, {&m3, u.data()}}, active, offset, zs.data(), pairs, rnd);
  } else {
    TORCH_CHECK(!m1.panels && !m3.panels, "w1 and w3 must both be expert panels or neither");
    if (m1.split() || m3.split()) {  // each token's row in split order, once
      zs.resize(N * Kin);
      for (int64_t t = 0; t < N; ++t) split32(zp + t * Kin, Kin, zs.data() + t * Kin);
    }
    // each pair's z row (in expert order), as each matrix reads it
    std::vector<const float*> z1(pairs), z3(pairs);
    for (int64_t q = 0; q < pairs; ++q) {
      const int64_t t = order[q] / topk;
      z1[q] = (m1.split() ? zs.data() : zp) + t * Kin, z3[q] = (m3.split() ? zs.data() : zp) + t * Kin;
    }
    // here z is not all bf16 values (else the route above): FP32 dots
    for_expert_items(active, offset, inter, row_cost(m1), grain1,
                     [&](int64_t begin, int64_t end) {
      fp32_rows(m1, inter, active, offset, z1.data(), begin, end, h.data(), rnd);
      fp32_rows(m3, inter, active, offset, z3.data(), begin, end, u.data(), rnd);
    });
  }
  // the GLU over every pair at once: vector transcendentals instead of one call per element
  at::parallel_for(0, pairs, grain_for(32 * inter), [&](int64_t begin, int64_t end) {
    activate_n(act, h.data() + begin * inter, u.data() + begin * inter, h.data() + begin * inter,
               (end - begin) * inter, fb, flb, rnd);
  });
  TORCH_CHECK(!m2.split() || inter % kGroup == 0, "intermediate size ", inter, " is not a multiple of ", kGroup);
  const int64_t grain2 = grain_for(2 * inter * std::max<int64_t>(1, pairs / std::max<int64_t>(A, 1)));
#ifdef K3K_DPBF16
  if (rnd && (m2.bf16() || m2.split())) {  // h holds bf16 values: w2 meets it in vdpbf16ps
    const std::vector<uint16_t> hb =
        bf16_rows(pairs, inter, m2.split(), [&](int64_t q) { return h.data() + q * inter; });
    for_expert_items(active, offset, out_dim, row_cost(m2), grain2, [&](int64_t begin, int64_t end) {
      std::vector<uint16_t> wb(3 * inter);
      std::vector<float> wf(inter);
      for (int64_t item = begin; item < end;) {
        const int64_t e = active[item / out_dim], o = item % out_dim, q0 = offset[e], T = offset[e + 1] - q0;
        const int R = int(std::min<int64_t>({m2.tile_rows(T), end - item, out_dim - o}));
        float* out = y.data() + q0 * out_dim + o;
        m2.dot_rows(e, o, R, hb.data() + q0 * inter, T, out, out_dim, wb.data(), wf.data(),
                    [&](int64_t j) { return h.data() + (q0 + j) * inter; });
        for (int64_t j = 0; j < T; ++j)
          for (int r = 0; r < R; ++r) out[j * out_dim + r] = round_bf16(out[j * out_dim + r]);
        item += R;
      }
    });
  } else
#endif
  if (m2.panels) {
    panel_experts({{&m2, y.data()}}, active, offset, h.data(), pairs, rnd);
  } else {
    if (m2.split()) {
      hs.resize(pairs * inter);
      for (int64_t q = 0; q < pairs; ++q) split32(h.data() + q * inter, inter, hs.data() + q * inter);
    }
    const float* hx = m2.split() ? hs.data() : h.data();
    std::vector<const float*> hr(pairs);
    for (int64_t q = 0; q < pairs; ++q) hr[q] = hx + q * inter;
    for_expert_items(active, offset, out_dim, row_cost(m2), grain2, [&](int64_t begin, int64_t end) {
      fp32_rows(m2, out_dim, active, offset, hr.data(), begin, end, y.data(), rnd);
    });
  }
  auto out = at::zeros({N, out_dim}, z.options());
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < N; ++t) {  // each token's pairs in expert order (the sorted order)
    std::vector<int64_t> mine(rank.begin() + t * topk, rank.begin() + (t + 1) * topk);
    std::sort(mine.begin(), mine.end());
    for (int64_t q : mine) {
      const float wq = wp[order[q]];
      for (int64_t o = 0; o < out_dim; ++o) op[t * out_dim + o] += y[q * out_dim + o] * wq;
    }
  }
  return out;
}

namespace {

template <typename T>
void route_rows(const T* x, const at::Tensor& wt, const float* bias, int64_t N, int64_t d, int64_t E, int64_t topk,
                bool use_sigmoid, bool renorm, float scaling, int64_t groups, int64_t keep, int64_t* ids, float* out) {
  const T* w = wt.data_ptr<T>();
  at::parallel_for(0, N, k3k::grain_for(2 * d * E), [&](int64_t begin, int64_t end) {
    std::vector<float> xr(d), wr(d), scores(E), choice(E);
    std::vector<int64_t> idx(E);
    const T *__restrict xv = x, *__restrict wv = w;  // locals: through the lambda's references GCC gathers
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < d; ++i) xr[i] = static_cast<float>(xv[t * d + i]);
      float peak = -std::numeric_limits<float>::infinity();
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t i = 0; i < d; ++i) wr[i] = static_cast<float>(wv[e * d + i]);
        scores[e] = k3k::dot(xr.data(), wr.data(), d);
        peak = std::max(peak, scores[e]);
      }
      if (use_sigmoid) {
        for (auto& s : scores) s = k3k::sigmoid(s);
      } else {
        float total = 0.f;
        for (auto& s : scores) total += (s = std::exp(s - peak));
        for (auto& s : scores) s /= total;
      }
      for (int64_t e = 0; e < E; ++e) choice[e] = scores[e] + bias[e];
      if (groups > 1) {  // DeepSeek rule: a group's score is the sum of its top two
        const int64_t size = E / groups, top = std::min<int64_t>(2, size);
        std::vector<std::pair<float, int64_t>> gs(groups);
        for (int64_t gi = 0; gi < groups; ++gi) {
          std::vector<float> members(choice.begin() + gi * size, choice.begin() + (gi + 1) * size);
          std::partial_sort(members.begin(), members.begin() + top, members.end(), std::greater<float>());
          float sum = 0.f;
          for (int64_t j = 0; j < top; ++j) sum += members[j];
          gs[gi] = {sum, gi};
        }
        std::stable_sort(gs.begin(), gs.end(), [](auto& a, auto& b) { return a.first > b.first; });
        std::vector<bool> kept(groups, false);
        for (int64_t j = 0; j < keep; ++j) kept[gs[j].second] = true;
        for (int64_t e = 0; e < E; ++e)
          if (!kept[e / size]) choice[e] = -std::numeric_limits<float>::infinity();
      }
      std::iota(idx.begin(), idx.end(), 0);
      std::partial_sort(idx.begin(), idx.begin() + topk, idx.end(), [&](int64_t a, int64_t b) {
        return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
      });
      float total = 0.f;
      for (int64_t j = 0; j < topk; ++j) total += scores[idx[j]];
      for (int64_t j = 0; j < topk; ++j) {
        ids[t * topk + j] = idx[j];
        out[t * topk + j] = (renorm ? scores[idx[j]] / (total + 1e-20f) : scores[idx[j]]) * scaling;
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_route(at::Tensor x, at::Tensor weight, at::Tensor bias, int64_t topk,
                                             bool use_sigmoid, bool renorm, double scaling, int64_t groups,
                                             int64_t keep) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 2 && weight.is_contiguous() &&
                  x.scalar_type() == weight.scalar_type(), "x [N, d] and gate weight [E, d] must share a dtype");
  const int64_t N = x.size(0), d = x.size(1), E = weight.size(0);
  TORCH_CHECK(weight.size(1) == d, "gate weight must be [E, ", d, "]");
  TORCH_CHECK(topk >= 1 && topk <= E, "top_k = ", topk, " must be in [1, ", E, "]");
  TORCH_CHECK(groups >= 1 && E % groups == 0 && keep >= 1 && keep <= groups, "expert groups do not divide E");
  at::Tensor b = bias.to(at::kFloat).contiguous();
  TORCH_CHECK(b.numel() == E, "score correction bias must have E = ", E, " entries");
  auto ids = at::empty({N, topk}, x.options().dtype(at::kLong));
  auto w = at::empty({N, topk}, x.options().dtype(at::kFloat));
  const float* bp = b.data_ptr<float>();
  if (x.scalar_type() == at::kFloat)
    route_rows(x.data_ptr<float>(), weight, bp, N, d, E, topk, use_sigmoid, renorm, float(scaling), groups, keep,
               ids.data_ptr<int64_t>(), w.data_ptr<float>());
  else if (x.scalar_type() == at::kBFloat16)
    route_rows(x.data_ptr<at::BFloat16>(), weight, bp, N, d, E, topk, use_sigmoid, renorm, float(scaling), groups,
               keep, ids.data_ptr<int64_t>(), w.data_ptr<float>());
  else
    TORCH_CHECK(false, "router input dtype ", x.scalar_type(), " is not supported");
  return {ids, w};
}
