// Grouped MXFP4 matmul for routed experts, reading the packed bytes and E8M0 scales directly.
//
//   y[t, r] = sum_k fp4(code[e, r, k]) * 2^(scale[e, r, k / 32] - 127) * x[t, k]
//   for every token t in [offsets[e], offsets[e + 1]) of expert e (tokens sorted by expert).
//
// Layout (compressed-tensors, k3-model-spec.md §8): packed [E, O, K/2] uint8, the low nibble is
// the even column; scale [E, O, K/32] uint8 (E8M0, 0xFF = NaN). x [N, K] float32, y [N, O] float32.
// Each (expert, output row) is one work item: its row is decoded once into a float buffer
// (exact: a power-of-two scale times an E2M1 value) and dotted with each of the expert's tokens,
// so a 4-bit expert costs its 0.53 B/param of traffic and is never materialised whole. Every
// dot runs in a fixed order, so a token's result does not depend on which other tokens share
// the step (batch invariance). The plain reference is `dequantize_mxfp4` + matmul
// (k3serve/weights/mxfp4.py), compared in tests/model/test_kernels.py.
#include "core/common.h"
#include "core/simd.h"

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int kGroup = 32;

}  // namespace

at::Tensor mxfp4_grouped_matmul(at::Tensor x, at::Tensor offsets, at::Tensor packed, at::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [N, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte, "packed must be [E, O, K/2] uint8");
  TORCH_CHECK(scale.dim() == 3 && scale.scalar_type() == at::kByte, "scale must be [E, O, K/32] uint8");
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong, "offsets must be [E + 1] int64");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "this kernel runs on the CPU");
  const int64_t E = packed.size(0), O = packed.size(1), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "K = ", K, " is not a multiple of ", kGroup);
  TORCH_CHECK(packed.size(2) * 2 == K && scale.size(2) * kGroup == K && scale.size(1) == O &&
                  scale.size(0) == E, "packed/scale do not match x's K = ", K);
  packed = packed.contiguous();
  scale = scale.contiguous();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint8_t* sp = scale.data_ptr<uint8_t>();
  return k3k::grouped_matmul(x, offsets, E, O, [&](int64_t e, int64_t r, float* row) {
    k3k::decode_mxfp4_row(pp + (e * O + r) * (K / 2), sp + (e * O + r) * (K / kGroup), K, row);
  });
}

// The bf16 decode of simd.h (decode_mxfp4_row_bf16) row by row, for its test against
// decode_mxfp4: packed [O, K/2], scale [O, K/32] -> (bf16 [O, K] in nib64 order, folded [O]:
// false where a row's scales do not fold into bf16 and its values are left zero).
std::tuple<at::Tensor, at::Tensor> mxfp4_rows_bf16(at::Tensor packed, at::Tensor scale) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed must be contiguous [O, K/2] uint8");
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kByte && scale.is_contiguous(),
              "scale must be contiguous [O, K/32] uint8");
  const int64_t O = packed.size(0), K = 2 * packed.size(1);
  TORCH_CHECK(K % kGroup == 0 && scale.size(0) == O && scale.size(1) * kGroup == K, "K = ", K,
              " must be a multiple of 32 with scales [O, K/32]");
  auto out = at::zeros({O, K}, packed.options().dtype(at::kBFloat16));
  auto folded = at::zeros({O}, packed.options().dtype(at::kBool));
#ifdef K3K_DPBF16
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  std::vector<uint16_t> row(K);
  for (int64_t o = 0; o < O; ++o) {
    const bool ok = k3k::decode_mxfp4_row_bf16(packed.data_ptr<uint8_t>() + o * K / 2,
                                               scale.data_ptr<uint8_t>() + o * K / kGroup, K, row.data());
    folded.data_ptr<bool>()[o] = ok;
    if (ok) std::copy(row.begin(), row.end(), op + o * K);
  }
#else
  TORCH_CHECK(false, "mxfp4_rows_bf16 needs AVX512-BF16 (this build has no bf16 route)");
#endif
  return {out, folded};
}
