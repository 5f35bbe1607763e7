// Python bindings of what is not a kernel op: the decode stack (a stateful object), weight
// layout helpers, the build's ISA, a test hook and the shared-memory collectives (which release
// the GIL while a rank waits). The kernels themselves are torch.library ops (registry.cpp);
// k3serve/kernels/__init__.py builds this directory.
#include <torch/extension.h>

#include "ops.h"
#include "core/panels.h"
#include "core/simd.h"

void bind_decode_stack(pybind11::module& m);  // decode_stack.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode_stack(m);
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
}
