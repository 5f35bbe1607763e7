// A decode step's whole decoder stack in one call (issue 15). On a tiny model a decode step is
// mostly Python between the compiled blocks: per layer two norms, two block calls, two residual
// adds, their module calls and argument lists (~0.15-0.2 ms of a ~0.45 ms step). DecodeStack holds
// every layer's block arguments, built once from the modules (KimiModel.decode_stack), and runs
// the same kernels in the same order as the per-layer path: RMSNorm, the KDA / MLA block, the
// residual add, RMSNorm, the MoE block or the GLU MLP, the residual add (or Block AttnRes's
// depth mixes between them), so its result equals that path's bit for bit.
// Reference: KimiModel.forward / _attnres_forward (k3serve/models/kimi.py), compared in
// tests/model/test_block_kernels.py.
#include <torch/extension.h>

#include "core/common.h"
#include "ops.h"

#include <vector>

namespace {

// One decoder layer's arguments. KDA (attn_kind 0): its pack (packs.h), floats {lower_bound,
// eps}; its conv and recurrent state come with each step. MLA (1): its pack (its latent cache
// comes with each step), ints {heads, nope, kv_lora}, floats {scale, norm_eps}. MoE (ffn_kind
// 0): its pack, ints {topk, sigmoid, renorm, groups, keep, act}, floats {scaling, beta,
// linear_beta, eps}. GLU MLP (1): its pack, ints {act}, floats {beta, linear_beta}.
struct Layer {
  int64_t attn_kind, ffn_kind;
  at::Tensor in_norm, post_norm;
  k3k::KdaWeights kda;
  k3k::MlaWeights mla;
  k3k::MoeWeights moe;
  k3k::GluWeights glu;
  std::vector<int64_t> attn_i, ffn_i;
  std::vector<double> attn_f, ffn_f;
};

}  // namespace

class DecodeStack {
 public:
  // final_norm: the model's last RMSNorm, applied to the stack's output here (one call less a step)
  DecodeStack(double norm_eps, int64_t attnres_block, std::vector<at::Tensor> attnres_vectors, at::Tensor final_norm)
      : eps_(norm_eps), block_(attnres_block), vectors_(std::move(attnres_vectors)), final_norm_(std::move(final_norm)) {}

  // attn / ffn: the layer's packs as lists in their schemas' order (packs.h from_list)
  void add_layer(int64_t attn_kind, at::Tensor in_norm, std::vector<c10::optional<at::Tensor>> attn, std::vector<int64_t> attn_i,
                 std::vector<double> attn_f, int64_t ffn_kind, at::Tensor post_norm,
                 std::vector<c10::optional<at::Tensor>> ffn, std::vector<int64_t> ffn_i, std::vector<double> ffn_f) {
    TORCH_CHECK(attn_kind == 0 ? attn_f.size() == 2 : attn_i.size() == 3 && attn_f.size() == 2,
                "decode stack: bad attention arguments for layer ", layers_.size());
    TORCH_CHECK(ffn_kind == 0 ? ffn_i.size() == 6 && ffn_f.size() == 4 : ffn_i.size() == 1 && ffn_f.size() == 2,
                "decode stack: bad feed-forward arguments for layer ", layers_.size());
    Layer l{attn_kind, ffn_kind, in_norm, post_norm};
    if (attn_kind == 0) {
      l.kda = k3k::KdaWeights::from_list(attn);
      weight_bytes_ += l.kda.nbytes();
    } else {
      l.mla = k3k::MlaWeights::from_list(attn);
      weight_bytes_ += l.mla.nbytes();
    }
    if (ffn_kind == 0) {
      l.moe = k3k::MoeWeights::from_list(ffn);
      weight_bytes_ += l.moe.nbytes();
    } else {
      l.glu = k3k::GluWeights::from_list(ffn);
      weight_bytes_ += l.glu.nbytes();
    }
    l.attn_i = std::move(attn_i), l.ffn_i = std::move(ffn_i), l.attn_f = std::move(attn_f), l.ffn_f = std::move(ffn_f);
    layers_.push_back(std::move(l));
  }

  // h [N, d]: the embedded decode / verify rows, in step order (StepRows.identity). states: each
  // layer's cache tensors in layer order (KDA: conv, recurrent; MLA: latent); records: per KDA
  // layer its verify pass's per-position state buffers (recurrent, conv) or two undefined
  // tensors. The step's KDA state slots / row starts and MLA cache rows / block table /
  // sequences / positions, as ForwardBatch carries them. capture: layers whose output hidden
  // states to return too (a DSpark drafter's taps). Returns [the final hidden states (after the
  // model's last norm), the captured layers' outputs in `capture` order].
  //
  // A pure decode step (one row per sequence, no verify records) of at most k3k::kSmallM rows,
  // of a model whose weights fit in cache, runs row-split: each thread takes a contiguous share
  // of the rows through the whole stack, with no join between layers. Up to kSmallM rows every
  // kernel here is batch invariant (a row's result never depends on the other rows of its
  // call), so this changes no bit. At these sizes each block is a few µs, below what a
  // fork/join per block costs, so the per-block path leaves the other cores idle (tiny
  // Kimi-Linear, 16 rows, 2 threads: the same time as 1 thread). Fewer rows than a row split
  // takes (a single user's decode or 5-row verify) run every block on this thread alone
  // (k3k::SerialBlocks): the bundled demo's 5-row verify stack 236 vs 243 us (min) with forks.
  // Large models keep the per-block split: there each thread would read every weight.
  std::vector<at::Tensor> run(at::Tensor h, std::vector<at::Tensor> states, std::vector<at::Tensor> records,
                              at::Tensor slots, at::Tensor starts, at::Tensor cache_rows, at::Tensor table,
                              at::Tensor seq, at::Tensor pos, int64_t block, std::vector<int64_t> capture) const {
    const int64_t N = h.size(0), parts = row_parts(N);
    if (parts < 2 || !records.empty() || starts.size(0) != N + 1) {  // N + 1 starts: one row per sequence
      k3k::SerialBlocks serial(weight_bytes_ <= kRowSplitBytes && N < 2 * kMinRowsPerPart);
      return run_rows(h, states, records, slots, starts, cache_rows, table, seq, pos, block, capture);
    }
    std::vector<std::vector<at::Tensor>> outs(parts);
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t b = N * p / parts, e = N * (p + 1) / parts;
        const auto rows = at::arange(e - b, seq.options());
        outs[p] = run_rows(h.slice(0, b, e), states, records, slots.slice(0, b, e), at::arange(e - b + 1, starts.options()),
                           cache_rows.slice(0, b, e), table.slice(0, b, e), rows, pos.slice(0, b, e), block, capture);
      }
    });
    std::vector<at::Tensor> out(outs[0].size());
    for (size_t j = 0; j < out.size(); ++j) {
      std::vector<at::Tensor> pieces;
      for (const auto& o : outs) pieces.push_back(o[j]);
      out[j] = at::cat(pieces);
    }
    return out;
  }

  // How many row shares a pure decode step of n rows runs in (1: the per-block split).
  int64_t row_parts(int64_t n) const {
    if (weight_bytes_ > kRowSplitBytes || n > k3k::kSmallM || at::in_parallel_region()) return 1;
    return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / kMinRowsPerPart));
  }

  // The stack over these rows (each row's sequence index `seq` points into `table`).
  std::vector<at::Tensor> run_rows(at::Tensor h, const std::vector<at::Tensor>& states,
                                   const std::vector<at::Tensor>& records, const at::Tensor& slots,
                                   const at::Tensor& starts, const at::Tensor& cache_rows, const at::Tensor& table,
                                   const at::Tensor& seq, const at::Tensor& pos, int64_t block,
                                   const std::vector<int64_t>& capture) const {
    std::vector<const at::Tensor*> state(layers_.size()), record(layers_.size(), nullptr);
    size_t next = 0, kda = 0;
    for (size_t i = 0; i < layers_.size(); ++i) {
      state[i] = &states.at(next);
      next += layers_[i].attn_kind == 0 ? 2 : 1;
      if (layers_[i].attn_kind == 0 && !records.empty()) record[i] = &records.at(2 * kda++);
    }
    TORCH_CHECK(next == states.size(), "decode stack: ", states.size(), " cache tensors for ", next, " expected");
    TORCH_CHECK(records.empty() || records.size() == 2 * kda, "decode stack: two record buffers per KDA layer");
    const auto opt = [](const at::Tensor* t) { return t && t->defined() ? c10::optional<at::Tensor>(*t) : c10::nullopt; };
    const auto attn = [&](size_t i, const at::Tensor& x) {
      const Layer& l = layers_[i];
      const at::Tensor a = rms_norm(x.contiguous(), l.in_norm, eps_);
      if (l.attn_kind == 0)
        return kda_block(a, l.kda, state[i][0], state[i][1], slots, starts, l.attn_f[0], l.attn_f[1],
                         opt(record[i]), opt(record[i] ? record[i] + 1 : nullptr));
      return mla_block(a, l.mla, state[i][0], cache_rows, table, seq, pos, block, l.attn_f[0], l.attn_i[0],
                       l.attn_i[1], l.attn_i[2], l.attn_f[1], 1.0);  // a scaled cache runs layer by layer
    };
    std::vector<at::Tensor> out(1 + capture.size());
    const auto tap = [&](int64_t i, const at::Tensor& t) {
      for (size_t j = 0; j < capture.size(); ++j)
        if (capture[j] == i) out[1 + j] = t;
    };
    if (vectors_.empty()) {
      for (size_t i = 0; i < layers_.size(); ++i) {
        h = h + attn(i, h);
        h = h + ffn(layers_[i], h);
        tap(int64_t(i), h);
      }
      out[0] = rms_norm(h.contiguous(), final_norm_, eps_);
      return out;
    }
    TORCH_CHECK(vectors_.size() == 2 * layers_.size() + 1, "decode stack: one AttnRes vector per sublayer and the output");
    std::vector<at::Tensor> bank;
    const auto with = [&bank](const at::Tensor& t) {
      std::vector<at::Tensor> c(bank);
      c.push_back(t);
      return c;
    };
    for (size_t i = 0; i < layers_.size(); ++i) {
      const at::Tensor a_in = bank.empty() ? h : attnres_mix(with(h), vectors_[2 * i], eps_);
      at::Tensor partial;
      if (int64_t(i) % block_ == 0) {
        bank.push_back(h);
        partial = attn(i, a_in);
      } else {
        partial = h + attn(i, a_in);
      }
      h = partial + ffn(layers_[i], attnres_mix(with(partial), vectors_[2 * i + 1], eps_));
      tap(int64_t(i), h);
    }
    out[0] = rms_norm(attnres_mix(with(h), vectors_.back(), eps_), final_norm_, eps_);
    return out;
  }

 private:
  at::Tensor ffn(const Layer& l, const at::Tensor& x) const {
    const at::Tensor m = rms_norm(x.contiguous(), l.post_norm, eps_);
    const auto& i = l.ffn_i;
    const auto& f = l.ffn_f;
    if (l.ffn_kind == 0)
      return moe_block(m, l.moe, i[0], i[1] != 0, i[2] != 0, f[0], i[3], i[4], i[5], f[1], f[2], f[3]);
    return fast_linear(glu_act(fast_linear(m, l.glu.gate), fast_linear(m, l.glu.up), i[0], f[0], f[1]), l.glu.down);
  }

  static constexpr int64_t kMinRowsPerPart = 4;  // fewer rows per thread: not worth a fork/join
  static constexpr int64_t kRowSplitBytes = 8 << 20;  // weights every thread may read from cache
  double eps_;
  int64_t block_;
  int64_t weight_bytes_ = 0;
  std::vector<at::Tensor> vectors_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
};

void bind_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack", "a decode step's decoder stack in one call")
      .def(pybind11::init<double, int64_t, std::vector<at::Tensor>, at::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("run", &DecodeStack::run)
      .def("row_parts", &DecodeStack::row_parts);
}
