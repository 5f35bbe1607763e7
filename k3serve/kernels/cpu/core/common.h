// Shared helpers of the CPU kernels (k3serve/kernels): argument checks, FTZ scope, loads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define K3K_HAVE_MXCSR 1
#endif

namespace k3k {

// FTZ/DAZ for one thread's scope: long products of KDA decays produce FP32 denormals that
// make arithmetic 10-50x slower (the torch path scopes torch.set_flush_denormal the same way).
// Set inside each parallel chunk: MXCSR is per thread.
struct FlushDenormals {
#ifdef K3K_HAVE_MXCSR
  unsigned saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

inline void check_f32(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got ", t.dim());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline void check_i64(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(), name,
              " must be a contiguous 1-D int64 tensor");
}

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

inline float round_bf16(float v) { return static_cast<float>(c10::BFloat16(v)); }

// GLU activation in fp32 (layers/activation.py): 0 = SiLU(g) u; 1 = SiTU:
// beta tanh(g/beta) sigmoid(g) * lb tanh(u/lb), with lb <= 0 meaning a plain u
// tanh through expm1 (accurate near 0, unlike 1 - 2 / (e^2x + 1)): about 3x cheaper than
// tanhf here, where the GLU's transcendentals were most of a small MoE layer's time
inline float fast_tanh(float x) {
  if (std::fabs(x) > 9.f) return x > 0.f ? 1.f : -1.f;  // |tanh| rounds to 1 in fp32 beyond ~9
  const float e = std::expm1(2.f * x);
  return e / (e + 2.f);
}

inline float activate(int64_t act, float g, float u, float beta, float lb) {
  if (act == 0) return g * sigmoid(g) * u;
  const float lin = lb > 0.f ? lb * fast_tanh(u / lb) : u;
  return beta * fast_tanh(g / beta) * sigmoid(g) * lin;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// Rows of a float tensor in its stored dtype (fp32, bf16, fp8 e4m3), read as float.
template <typename T>
inline float load(const T* p, int64_t i) { return static_cast<float>(p[i]); }

// bf16 -> fp32 by its bits (the top half of an fp32), written so that loops over it vectorise
inline float bf16_bits(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
template <>
inline float load<at::BFloat16>(const at::BFloat16* p, int64_t i) { return bf16_bits(p[i].x); }

// E8M0 scale byte -> 2^(s - 127) (0xFF = NaN), one table for all kernels
struct E8M0Table {
  float v[256];
  E8M0Table() {
    for (int s = 0; s < 256; ++s) v[s] = s == 0xFF ? NAN : std::ldexp(1.0f, s - 127);
  }
};
inline const E8M0Table& e8m0() {
  static const E8M0Table table;
  return table;
}

#ifdef __AVX512F__
// One group of 32 MXFP4 values: 16 code bytes (low nibble = even column) and its power-of-two
// scale. The 16-entry E2M1 table is one register, so the nibbles decode with two permutes.
// Split by parity: `evens` = columns 0, 2, .., 30 (low nibbles), `odds` = 1, .., 31.
inline void decode_mxfp4_split(const uint8_t* codes, float mult, __m512& evens, __m512& odds) {
  alignas(64) static constexpr float kE2M1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                                  -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  const __m512 lut = _mm512_load_ps(kE2M1);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m512 m = _mm512_set1_ps(mult);
  evens = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), lut), m);
  odds = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut), m);
}
// In column order: columns 0-15 in `first`, 16-31 in `second` (two more permutes interleave).
inline void decode_mxfp4_group(const uint8_t* codes, float mult, __m512& first, __m512& second) {
  const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i odd = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  __m512 lo, hi;
  decode_mxfp4_split(codes, mult, lo, hi);
  first = _mm512_permutex2var_ps(lo, even, hi);
  second = _mm512_permutex2var_ps(lo, odd, hi);
}
#elif defined(__AVX2__) && defined(__FMA__)
// The AVX2 form: one group's 32 values as four 8-lane vectors in split order: evens of code
// bytes 0-7 (e0) and 8-15 (e1), odds likewise (o0, o1). The table's 8 magnitudes, scaled once
// per group (exact: a power of two), are looked up by the code's low 3 bits; its bit 3 is the
// sign. Each value is E2M1 x 2^(s - 127), the bits the scalar form's product gives.
inline void decode_mxfp4_split(const uint8_t* codes, float mult, __m256& e0, __m256& e1, __m256& o0, __m256& o1) {
  const __m256 lut = _mm256_mul_ps(_mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f), _mm256_set1_ps(mult));
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8)));
  const __m256i eight = _mm256_set1_epi32(8);
  auto value = [&](__m256i c) {  // c's low 4 bits: the code (permutevar8x32 reads only bits 0-2)
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, eight), 28);
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, c), _mm256_castsi256_ps(sign));
  };
  e0 = value(b0), e1 = value(b1);
  o0 = value(_mm256_srli_epi32(b0, 4)), o1 = value(_mm256_srli_epi32(b1, 4));
}
#endif

// One packed MXFP4 row (K/2 code bytes, low nibble = even column; K/32 E8M0 scales) -> K floats,
// exact: a power-of-two scale times an E2M1 value (k3-model-spec.md §8). In column order, or
// with `Split` per 32-column group its 16 even columns then its 16 odd ones (simd.h split32).
template <bool Split = false>
inline void decode_mxfp4_row(const uint8_t* packed, const uint8_t* scale, int64_t K, float* out) {
  const float* pow2 = e8m0().v;
#ifdef __AVX512F__
  for (int64_t g = 0; g < K / 32; ++g) {
    __m512 a, b;
    if constexpr (Split)
      decode_mxfp4_split(packed + g * 16, pow2[scale[g]], a, b);
    else
      decode_mxfp4_group(packed + g * 16, pow2[scale[g]], a, b);
    _mm512_storeu_ps(out + g * 32, a);
    _mm512_storeu_ps(out + g * 32 + 16, b);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (int64_t g = 0; g < K / 32; ++g) {
    __m256 e0, e1, o0, o1;
    decode_mxfp4_split(packed + g * 16, pow2[scale[g]], e0, e1, o0, o1);
    float* o = out + g * 32;
    if constexpr (Split) {
      _mm256_storeu_ps(o, e0), _mm256_storeu_ps(o + 8, e1), _mm256_storeu_ps(o + 16, o0), _mm256_storeu_ps(o + 24, o1);
    } else {  // interleave: unpack pairs within 128-bit lanes, then join the lanes in order
      const __m256 l0 = _mm256_unpacklo_ps(e0, o0), h0 = _mm256_unpackhi_ps(e0, o0);
      const __m256 l1 = _mm256_unpacklo_ps(e1, o1), h1 = _mm256_unpackhi_ps(e1, o1);
      _mm256_storeu_ps(o, _mm256_permute2f128_ps(l0, h0, 0x20));
      _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(l0, h0, 0x31));
      _mm256_storeu_ps(o + 16, _mm256_permute2f128_ps(l1, h1, 0x20));
      _mm256_storeu_ps(o + 24, _mm256_permute2f128_ps(l1, h1, 0x31));
    }
  }
#else
  static constexpr float kE2M1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                      -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  for (int64_t g = 0; g < K / 32; ++g) {
    const float mult = pow2[scale[g]];
    const uint8_t* p = packed + g * 16;
    float* o = out + g * 32;
    for (int i = 0; i < 16; ++i) {
      o[Split ? i : 2 * i] = kE2M1[p[i] & 0x0F] * mult;
      o[Split ? 16 + i : 2 * i + 1] = kE2M1[p[i] >> 4] * mult;
    }
  }
#endif
}

// Up to this many rows the blocks' projections run in a GEMV loop (it beats a oneDNN/MKL GEMM
// call there, and a row's result never depends on the other rows); past it, torch's GEMM.
constexpr int64_t kSmallM = 16;

// Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16), as torch detects it
inline bool native_bf16() {
  static const bool native = [] {
    const auto caps = at::cpu::get_cpu_capabilities();
    auto has = [&](const char* k) { auto it = caps.find(k); return it != caps.end() && it->second.toBool(); };
    return has("avx512_bf16") || has("amx_bf16");
  }();
  return native;
}

// A projection weight in any form the blocks take: a matrix [N, K] (float or bf16), the fp32
// panel form [N/16, K, 16] or the bf16 one [N/16, K/2, 16, 2] (panels.h).
constexpr int64_t kPanel = 16;
inline bool is_panels(const at::Tensor& w) { return w.dim() >= 3; }
inline int64_t out_features(const at::Tensor& w) { return is_panels(w) ? w.size(0) * kPanel : w.size(0); }
inline int64_t in_features(const at::Tensor& w) { return w.dim() == 4 ? w.size(1) * 2 : w.size(1); }
// [N, K] of any form (a copy for panels: torch's GEMM for prefill-sized calls, where it costs
// 1/M of the product)
inline at::Tensor as_matrix(const at::Tensor& w) {
  if (!is_panels(w)) return w;
  return (w.dim() == 4 ? w.permute({0, 2, 1, 3}) : w.transpose(1, 2)).reshape({out_features(w), in_features(w)});
}

// x [M, K] @ w [N, K]^T past the GEMV sizes, by k3serve/layers/gemm.py's rule: a bf16 product of
// more than kSmallM rows runs in FP32 (both widened, the output rounded to bf16 once) where the
// CPU has no bf16 dot instructions, ~5x faster than torch's bf16 GEMM there. K3SERVE_BF16_GEMM
// = native | fp32 forces one form, as in Python.
inline at::Tensor gemm(const at::Tensor& x, const at::Tensor& weight) {
  const at::Tensor w = as_matrix(weight);
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16) {
    const char* env = std::getenv("K3SERVE_BF16_GEMM");
    const std::string mode = env ? env : "auto";
    const bool widen = mode == "fp32" || (mode != "native" && x.numel() > kSmallM * x.size(-1) && !native_bf16());
    if (widen) return at::linear(x.to(at::kFloat), w.to(at::kFloat)).to(at::kBFloat16);
  }
  return at::linear(x, w);
}

// Set while a small model's decode stack runs its blocks on the calling thread alone
// (decode_stack.cpp SerialBlocks): grain_for then makes each range one chunk.
inline bool& serial_blocks() {
  static thread_local bool on = false;
  return on;
}
struct SerialBlocks {
  bool prev;
  explicit SerialBlocks(bool on) : prev(serial_blocks()) { serial_blocks() = prev || on; }
  ~SerialBlocks() { serial_blocks() = prev; }
};

// Work items per parallel chunk so that a chunk holds about `work` flops: small models stay on
// one thread (a fork/join costs more than their whole layer), large ones use every core.
inline int64_t grain_for(int64_t flops_per_item, int64_t work = 1 << 18) {
  if (serial_blocks()) return std::numeric_limits<int64_t>::max();
  return std::max<int64_t>(1, work / std::max<int64_t>(1, flops_per_item));
}

// The driver both grouped expert matmuls share (mxfp4_grouped.cpp, nvfp4_grouped.cpp): rows of
// x [N, K] fp32 sorted by expert, offsets [E + 1] int64 delimiting each expert's rows; each
// (active expert, output row) is one work item whose weight row `decode(e, r, row)` writes as K
// floats once, then dotted with each of the expert's rows in a fixed order (batch invariance).
template <class Decode>
at::Tensor grouped_matmul(at::Tensor x, at::Tensor offsets, int64_t E, int64_t O, Decode decode) {
  x = x.contiguous();
  offsets = offsets.contiguous();
  const int64_t K = x.size(1), N = x.size(0);
  TORCH_CHECK(offsets.size(0) == E + 1, "offsets must have E + 1 = ", E + 1, " entries");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == N, "offsets must run from 0 to N = ", N);
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(off[e + 1] >= off[e], "offsets must not decrease");
    if (off[e + 1] > off[e]) active.push_back(e);
  }
  auto y = at::empty({N, O}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, int64_t(active.size()) * O, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = active[i / O], r = i % O;
      decode(e, r, row.data());
      for (int64_t t = off[e]; t < off[e + 1]; ++t) yp[t * O + r] = dot(row.data(), xp + t * K, K);
    }
  });
  return y;
}

}  // namespace k3k
