// The int8 dot-product peak of this build's instruction, for the roofline
// (disco/engines/roofline.py): how many u8 x s8 multiply-adds per second the cores can issue
// when nothing else limits them (operands in registers, no memory traffic, enough independent
// accumulators to hide the instruction's latency).
//
// The instruction is the q4 x q8 kernel's own: VPDPBUSD on 512-bit registers in the VNNI and
// AMX builds (64 multiply-adds each; the AMX tile path is not measured here), VPMADDUBSW +
// VPMADDWD + VPADDD on 256-bit registers in the AVX2 build (32 multiply-adds per triple).
// Compiled into the same library as kernels/q4q8.cpp, with the same flags.

#include <immintrin.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <cstdint>

namespace {

#if defined(__AVX512VNNI__)
constexpr int64_t kChains = 12;            // independent accumulators per thread
constexpr int64_t kMacsPerInstruction = 64;  // 16 lanes x 4 bytes
#else
constexpr int64_t kChains = 6;
constexpr int64_t kMacsPerInstruction = 32;  // 8 lanes x 4 bytes, over three instructions
#endif

// ``iterations`` rounds of kChains dot products on every thread of the intra-op pool; returns
// the multiply-adds issued (the caller times the call).
int64_t int8_peak(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "int8_peak: iterations must be > 0");
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t thread = begin; thread < end; ++thread) {
#if defined(__AVX512VNNI__)
      __m512i acc[kChains];
      for (int64_t c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(static_cast<int>(c + thread));
      const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
      for (int64_t i = 0; i < iterations; ++i)
        for (int64_t c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
      int64_t total = 0;
      for (int64_t c = 0; c < kChains; ++c) total += _mm512_reduce_add_epi32(acc[c]);
#else
      __m256i acc[kChains], a[kChains];
      for (int64_t c = 0; c < kChains; ++c) {
        acc[c] = _mm256_set1_epi32(static_cast<int>(c + thread));
        a[c] = _mm256_set1_epi8(static_cast<char>(3 + c));
      }
      const __m256i b = _mm256_set1_epi8(-5), ones = _mm256_set1_epi16(1);
      for (int64_t i = 0; i < iterations; ++i)
        for (int64_t c = 0; c < kChains; ++c) {
          __asm__ volatile("" : "+x"(a[c]));  // the compiler may not hoist the products out of the loop
          acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a[c], b), ones));
        }
      alignas(32) int32_t lanes[8];
      int64_t total = 0;
      for (int64_t c = 0; c < kChains; ++c) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[c]);
        for (int32_t lane : lanes) total += lane;
      }
#endif
      sink.fetch_add(total, std::memory_order_relaxed);  // the sums are used: nothing is optimized away
    }
  });
  TORCH_CHECK(sink.load() != INT64_MIN, "int8_peak: unreachable");
  return threads * iterations * kChains * kMacsPerInstruction;
}

// The same, with the q4 x q8 kernel's per-group float step after every 32 inputs of a row (the
// VNNI build's instruction mix, operands in registers): 8 rows x 16 channels per round, each row's
// 8 products then `sub, cvt, mul, fma, fma` (kernels/q4q8.cpp, group_epilogue). The ceiling the
// kernel's extra rows can reach on this CPU, whatever its memory access. VNNI builds only (-1 elsewhere).
int64_t int8_group_peak(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "int8_group_peak: iterations must be > 0");
#if defined(__AVX512VNNI__)
  constexpr int kRows = 8;
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t thread = begin; thread < end; ++thread) {
      __m512i nibbles[8];
      for (int w = 0; w < 8; ++w) nibbles[w] = _mm512_set1_epi8(static_cast<char>(w + 1));
      __m512 acc[kRows];
      for (int t = 0; t < kRows; ++t) acc[t] = _mm512_set1_ps(static_cast<float>(t + thread));
      const __m512 scale = _mm512_set1_ps(1e-3f), zero = _mm512_set1_ps(-1e-3f);
      for (int64_t i = 0; i < iterations; ++i) {
        for (int w = 0; w < 8; ++w) __asm__ volatile("" : "+v"(nibbles[w]));  // a new group's weights
        __m512i dot[kRows];
        for (int t = 0; t < kRows; ++t) dot[t] = _mm512_setzero_si512();
        for (int w = 0; w < 8; ++w)
          for (int t = 0; t < kRows; ++t) dot[t] = _mm512_dpbusd_epi32(dot[t], nibbles[w], _mm512_set1_epi32(t + w));
        for (int t = 0; t < kRows; ++t) {
          dot[t] = _mm512_sub_epi32(dot[t], _mm512_set1_epi32(8 * t));
          const __m512 partial = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_set1_ps(0.5f + t));
          acc[t] = _mm512_fmadd_ps(partial, scale, acc[t]);
          acc[t] = _mm512_fmadd_ps(zero, _mm512_set1_ps(0.25f * t), acc[t]);
        }
      }
      float lanes[16];
      int64_t total = 0;
      for (int t = 0; t < kRows; ++t) {
        _mm512_storeu_ps(lanes, acc[t]);
        total += static_cast<int64_t>(lanes[0]);
      }
      sink.fetch_add(total, std::memory_order_relaxed);
    }
  });
  TORCH_CHECK(sink.load() != INT64_MIN, "int8_group_peak: unreachable");
  return threads * iterations * kRows * 8 * kMacsPerInstruction;
#else
  return -1;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(disco_q4q8, m) {
  m.def("int8_peak(int iterations) -> int", &int8_peak);
  m.def("int8_group_peak(int iterations) -> int", &int8_group_peak);
}
