// Grouped NVFP4 matmul for routed experts, reading the packed bytes and E4M3 scale bytes directly.
//
//   y[t, r] = sum_k e2m1(code[e, r, k]) * table[e, scale[e, r, k / 16]] * x[t, k]
//   for every token t in [offsets[e], offsets[e + 1]) of expert e (tokens sorted by expert),
//   table[e, b] = e4m3(b) / global_scale[e] (float32, built once at load: weights/nvfp4.py).
//
// Layout (compressed-tensors nvfp4-pack-quantized): packed [E, O, K/2] uint8, the low nibble is
// the even column; scale [E, O, K/16] uint8 (the E4M3 bytes); table [E, 256] float32. x [N, K]
// float32, y [N, O] float32. As mxfp4_grouped.cpp: each (expert, output row) is one work item,
// its row decoded once (each value the float32 product e2m1 x factor, the reference's rounding)
// and dotted with each of the expert's tokens in a fixed order (batch invariance). The plain
// reference is `dequantize_nvfp4` + matmul (k3serve/weights/nvfp4.py), compared in
// tests/unit/test_nvfp4.py.
#include "core/common.h"

#include <cstdint>
#include <vector>

namespace {

constexpr int kGroup = 16;
constexpr float kE2M1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// One row: K/2 code bytes and K/16 scale bytes -> K floats in column order. With AVX-512 two
// groups (16 code bytes, 32 columns) at a time: the E2M1 table is one register, the nibbles
// decode with two permutes, each lane multiplied by its group's factor (lanes 0-7 the first
// group's bytes, 8-15 the second's) and two more permutes interleave evens and odds. Each value
// is the one float32 product e2m1 x factor either way.
inline void decode_nvfp4_row(const uint8_t* packed, const uint8_t* scale, const float* table, int64_t K, float* out) {
  int64_t g = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  alignas(64) static constexpr float kLut[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                                 -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  const __m512 lut = _mm512_load_ps(kLut);
  const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i odd = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (; g + 2 <= K / kGroup; g += 2) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + g * 8)));
    const __m512 m = _mm512_insertf32x8(_mm512_set1_ps(table[scale[g]]), _mm256_set1_ps(table[scale[g + 1]]), 1);
    const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), lut), m);
    const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut), m);
    _mm512_storeu_ps(out + g * kGroup, _mm512_permutex2var_ps(lo, even, hi));
    _mm512_storeu_ps(out + g * kGroup + 16, _mm512_permutex2var_ps(lo, odd, hi));
  }
#endif
  for (; g < K / kGroup; ++g) {
    const float f = table[scale[g]];
    const uint8_t* b = packed + g * (kGroup / 2);
    float* o = out + g * kGroup;
    for (int j = 0; j < kGroup / 2; ++j) {
      o[2 * j] = kE2M1[b[j] & 15] * f;
      o[2 * j + 1] = kE2M1[b[j] >> 4] * f;
    }
  }
}

}  // namespace

at::Tensor nvfp4_grouped_matmul(at::Tensor x, at::Tensor offsets, at::Tensor packed, at::Tensor scale,
                                at::Tensor table) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [N, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte, "packed must be [E, O, K/2] uint8");
  TORCH_CHECK(scale.dim() == 3 && scale.scalar_type() == at::kByte, "scale must be [E, O, K/16] uint8 (E4M3 bytes)");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kFloat && table.size(1) == 256,
              "table must be [E, 256] float32");
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong, "offsets must be [E + 1] int64");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "this kernel runs on the CPU");
  const int64_t E = packed.size(0), O = packed.size(1), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "K = ", K, " is not a multiple of ", kGroup);
  TORCH_CHECK(packed.size(2) * 2 == K && scale.size(2) * kGroup == K && scale.size(1) == O && scale.size(0) == E &&
                  table.size(0) == E,
              "packed/scale/table do not match x's K = ", K);
  packed = packed.contiguous();
  scale = scale.contiguous();
  table = table.contiguous();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint8_t* sp = scale.data_ptr<uint8_t>();
  const float* tp = table.data_ptr<float>();
  return k3k::grouped_matmul(x, offsets, E, O, [&](int64_t e, int64_t r, float* row) {
    decode_nvfp4_row(pp + (e * O + r) * (K / 2), sp + (e * O + r) * (K / kGroup), tp + e * 256, K, row);
  });
}
