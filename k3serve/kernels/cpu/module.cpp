// Python bindings of the CPU kernels (k3serve/kernels/__init__.py builds this directory).
#include <torch/extension.h>

#include "ops.h"
#include "panels.h"
#include "simd.h"

void bind_decode_stack(pybind11::module& m);  // decode_stack.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode_stack(m);
  m.def("mxfp4_grouped_matmul", &mxfp4_grouped_matmul,
        "y[N, O] = x[N, K] @ W_e^T per expert group, W packed MXFP4 [E, O, K/2] + E8M0 [E, O, K/32]");
  m.def("nvfp4_grouped_matmul", &nvfp4_grouped_matmul,
        "y[N, O] = x[N, K] @ W_e^T per expert group, W packed NVFP4 [E, O, K/2] + E4M3 bytes [E, O, K/16] "
        "read through the group-factor tables [E, 256]");
  m.def("mxfp4_rows_bf16", &mxfp4_rows_bf16,
        "packed MXFP4 rows -> (bf16 in nib64 order, rows whose scales fold into bf16): the test hook of the bf16 decode");
  m.def("has_bf16_dot", []() {
#ifdef K3K_DPBF16
    return true;
#else
    return false;
#endif
  }, "whether this build runs bf16 dots in vdpbf16ps (AVX512-BF16)");
  m.def("panel_form", &k3k::panel_form, "a projection [N, K] (N a multiple of 16) as panels where this build reads them faster (panels.h: fp32 "
     "[N/16, K, 16] with AVX-512, up to 64 MB; bf16 [N/16, K/2, 16, 2] with AVX512-BF16, up to 64 MB), else w itself");
  m.def("expert_panel_form", &k3k::expert_panel_form, "routed experts [E, O, I] fp32 as panels [E, O/16, I, 16] where "
        "this build reads fp32 panels (AVX-512, O a multiple of 16), else w itself");
  m.def("simd", []() {
#if defined(K3K_DPBF16)
    return "avx512-bf16";
#elif defined(K3K_AVX512)
    return "avx512";
#elif defined(K3K_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
  }, "the vector route this build's dot products, MXFP4 decode and GLU take (simd.h)");
  m.def("kda_decode", &kda_decode, "stepwise KDA rows (decode / verify) with in-place states -> y [N, P]",
        py::arg("u"), py::arg("conv_w"), py::arg("z"), py::arg("b"), py::arg("gate"), py::arg("dt_bias"),
        py::arg("a_log"), py::arg("o_norm_w"), py::arg("conv_state"), py::arg("rec_state"), py::arg("slots"),
        py::arg("starts"), py::arg("lower_bound"), py::arg("eps"), py::arg("rec_buf") = py::none(),
        py::arg("conv_buf") = py::none());
  m.def("kda_rollback", &kda_rollback, "after a verify pass: each live KDA slot takes its recorded state at the "
        "accepted position, every layer in one call");
  m.def("mla_decode", &mla_decode, "absorbed MLA attention of decode / verify rows over the paged latent cache");
  m.def("moe_experts", &moe_experts, "routed experts (MXFP4 or dense) and their weighted sum -> [N, out] fp32");
  m.def("moe_route", &moe_route, "router: (expert ids [N, k], weights [N, k])");
  m.def("rms_norm", &rms_norm, "RMSNorm with HF's rounding points");
  m.def("dspark_forward", &dspark_forward, "the DSpark drafter's block logits [B, k, V] (no Markov bias)");
  m.def("dspark_greedy", &dspark_greedy, "greedy drafts [B, k] from block logits with the Markov head");
  m.def("dspark_draft", &dspark_draft, "greedy drafts [B, k] from tap states: dspark_forward then dspark_greedy");
  m.def("attnres_mix", &attnres_mix, "Block AttnRes depth mix of candidates [N, d]");
  m.def("linear", &fast_linear, "x [M, K] @ W [N, K]^T; a GEMV loop for small M, torch's GEMM beyond");
  m.def("glu", &glu_act, "act(gate, up) in fp32, rounded to the inputs' dtype");
  m.def("kda_block", &kda_block, "a whole KDA attention block for decode / verify rows",
        py::arg("x"), py::arg("w"), py::arg("conv_state"), py::arg("rec_state"), py::arg("slots"), py::arg("starts"),
        py::arg("lower_bound"), py::arg("eps"), py::arg("rec_buf") = py::none(), py::arg("conv_buf") = py::none());
  m.def("mla_block", &mla_block, "a whole gated-MLA attention block for decode / verify rows");
  m.def("shm_attach", &shm_attach, "write this rank's pid into the segment (peers check it is alive)");
  // the GIL is released while a rank waits for its peers: the server's event loop keeps running
  m.def("shm_all_reduce", &shm_all_reduce, "sum over the ranks of x (in place), via the shared segment",
        py::call_guard<py::gil_scoped_release>());
  m.def("shm_all_gather", &shm_all_gather, "[world, ...x]: every rank's x, via the shared segment",
        py::call_guard<py::gil_scoped_release>());
  m.def("shm_reduce_scatter", &shm_reduce_scatter, "chunk `rank` of the sum over the ranks of x [world * n, ...]",
        py::call_guard<py::gil_scoped_release>());
  m.def("shm_all_to_all", &shm_all_to_all, "the rows every rank sends this one, by a [src][dst] count matrix",
        py::call_guard<py::gil_scoped_release>());
  m.def("moe_block", &moe_block, "a whole MoE block: router, routed experts, latent norm/up, shared experts");
}
