// q4 x q8 dot products with AVX-512 VNNI (or AVX2, built with other flags): the int4 engine's
// decode and verification kernel.
//
// Weights: 4-bit q in [0, 15] per group of 32 inputs, w = (q - 8) * scale + zero (bf16 scale
// and zero per group and output channel: the int4 engine's grid, a GGUF Q4_K sub-block as it
// is). Activations: each row quantized to int8 per group of 32 (scale = max|x| / 127, round to
// nearest), as llama.cpp's q8 activations. One output channel's value is
//   sum_g  scale_g * dx_g * (sum_k q_k xq_k - 8 sum_k xq_k)  +  zero_g * sum_k x_k
// accumulated in float32 over the groups in order. Every row is computed from its own input
// row alone, by the same instructions in the same order whatever the other rows of the call:
// row-invariant by construction (the engine's row plan still probes it at load).
//
// Packed layout (pack_q4q8): for each block of 16 output channels, for each group of 32
// inputs, 320 bytes: 4 x 64 bytes of nibbles, then the 16 scales and the 16 zeros (bf16).
// In the 64 bytes of inputs k0..k0+7, byte 4*j + b holds q[n0 + j][k0 + b] in its low nibble
// and q[n0 + j][k0 + 4 + b] in its high nibble, so that one VPDPBUSD multiplies four inputs
// of 16 channels at once (lane j = channel n0 + j) and no horizontal sum is ever needed.
//
// The AMX build (-mamx-tile -mamx-int8 on top of the VNNI flags): calls of kAmxMinRows rows or
// more take the integer dot products sum_k q_k xq_k from TDPBSUD (int8 activations x uint8 q,
// exact int32 sums), up to 8 rows per row tile and two groups per product: A = the row tile's
// activations of groups 2p and 2p + 1 laid block-diagonally (amx_rows), B = the two groups'
// nibbles unpacked to bytes, which is already AMX's VNNI layout (row w of a group's 8 rows of
// 64 bytes is the VNNI path's nibbles[w]: inputs 4w..4w+3 of the 16 channels). Then the VNNI
// path's float epilogue, the same function (group_epilogue) over the same int32 sums, group by
// group in order: every row gets the VNNI build's bits. Linux must grant the process the tile
// state first (arch_prctl, once); where it refuses, the VNNI path runs.

#include <immintrin.h>
#include <cerrno>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kLanes = 16;
constexpr int64_t kGroupBytes = 4 * 64 + 2 * kLanes * 2;  // nibbles + bf16 scales + bf16 zeros
constexpr int64_t kRowTile = 8;                           // rows sharing one pass over the weights
// Groups ahead of the one multiplied whose weights are prefetched: a one-token forward of the
// 1.5B target read its 0.97 GB of int4 weights in 48 ms with 2 (51.8 without; 1 and 3 between;
// AMX Xeon, 2 threads). After rows' products were split over independent sums (Zen 4, one
// thread, one row over 85 MB): 0 4.15-4.32 ms, 2 4.29-4.71, 4 3.91-3.93, 8 4.18-5.21.
constexpr int64_t kPrefetchGroups = 4;
// Groups of activations quantized per thread at least (~7 us): a call's rows of 1536 inputs
// stay on one thread, rows of 8960 (the MLP's down projection: ~8 us a row) are split.
constexpr int64_t kQuantizeGrain = 256;
// Block x group x row products per thread at least (~10 us on one Zen 4 core): below it the
// intra-op pool's fork and join (~4-8 us) cost more than a second thread saves. Two threads against
// one (Zen 4, wall, best of 30, three runs; the host was noisy): 128x896 at 1 row 9.4-12.7 / 5.5-8.5 us,
// 256x1536 at 1 row 12.9-18.2 / 9.2-13.6; 896x896 at 1 row (1568 products) about even: still split.
constexpr int64_t kMinThreadWork = 1500;
#if defined(__AMX_INT8__)
constexpr int64_t kAmxTileRows = 8;  // rows of one AMX row tile: a pair of groups fills 16 tile rows
constexpr int64_t kAmxPassTiles = 2; // row tiles sharing one pass over a block's weights
#ifndef DISCO_Q4Q8_AMX_MIN_ROWS
#define DISCO_Q4Q8_AMX_MIN_ROWS 2
#endif
// Calls of this many rows or more take the AMX path (docs/engines.md measures the threshold).
constexpr int64_t kAmxMinRows = DISCO_Q4Q8_AMX_MIN_ROWS;
// Pairs of groups between the three steps of a pair's product (block_rows_amx_of): 1 and 2
// measured alike, 4 slower (8960x1536 at 16 rows: 0.48 ms, 0.60 at 4).
constexpr int64_t kAmxDistance = 2;
constexpr int64_t kAmxRing = 2 * kAmxDistance;
#endif

inline float bf16_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16(float value) {  // round to nearest even, as torch does
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40);  // NaN
  word += 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>(word >> 16);
}

#if defined(__AVX512VNNI__)
inline __m512 load_bf16x16(const uint8_t* bytes) {
  __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#else
inline __m256 load_bf16x8(const uint8_t* bytes) {
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
#endif

// One row's activations, quantized per group: int8 values, the scale and the two sums.
struct QuantizedRows {
  std::vector<int8_t> values;   // [rows, in_features]
  std::vector<float> scales;    // [rows, groups]: dx_g
  std::vector<int32_t> offsets; // [rows, groups]: 8 * sum_k xq_k
  std::vector<float> sums;      // [rows, groups]: sum_k x_k (float32, from the bf16 inputs)
};

QuantizedRows quantize_rows(const uint16_t* x, int64_t rows, int64_t in_features) {
  const int64_t groups = in_features / kGroup;
  QuantizedRows out{std::vector<int8_t>(rows * in_features), std::vector<float>(rows * groups),
                    std::vector<int32_t>(rows * groups), std::vector<float>(rows * groups)};
  // Each group on its own (the same bits however the groups are split among threads).
  at::parallel_for(0, rows * groups, kQuantizeGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / groups, g = i % groups;
      const uint16_t* src = x + r * in_features + g * kGroup;
      float values[kGroup];
      float amax = 0.f, sum = 0.f;
      for (int64_t k = 0; k < kGroup; ++k) {
        values[k] = bf16_to_float(src[k]);
        amax = std::max(amax, std::fabs(values[k]));
        sum += values[k];
      }
      const float scale = amax / 127.f;
      const float inverse = amax > 0.f ? 127.f / amax : 0.f;
      int32_t qsum = 0;
      int8_t* dst = out.values.data() + r * in_features + g * kGroup;
      for (int64_t k = 0; k < kGroup; ++k) {
        int32_t q = static_cast<int32_t>(std::nearbyint(values[k] * inverse));
        q = std::min(127, std::max(-127, q));
        dst[k] = static_cast<int8_t>(q);
        qsum += q;
      }
      out.scales[r * groups + g] = scale;
      out.offsets[r * groups + g] = 8 * qsum;
      out.sums[r * groups + g] = sum;
    }
  });
  return out;
}

#if defined(__AVX512VNNI__)
// One group of a block: its 256 bytes of nibbles as 8 x 64 bytes of u4 in bytes. nibbles[w]
// holds inputs 4w..4w+3 of the group for the 16 channels (byte 4j + i: channel j, input 4w + i).
inline void unpack_group(const uint8_t* group, __m512i nibbles[8]) {
  const __m512i low_mask = _mm512_set1_epi8(0x0f);
  for (int b = 0; b < 4; ++b) {
    __m512i packed = _mm512_loadu_si512(group + 64 * b);
    nibbles[2 * b] = _mm512_and_si512(packed, low_mask);
    nibbles[2 * b + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_mask);
  }
}

// One row's float32 step for one group, given its 16 exact int32 dot products sum_k q_k xq_k:
// the only float arithmetic of the product, shared by the VNNI and AMX paths (the same bits).
inline __m512 group_epilogue(__m512 acc, __m512i dot, int32_t offset, float dx, float sum, __m512 scale,
                             __m512 zero) {
  dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offset));
  const __m512 partial = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(dx));
  acc = _mm512_fmadd_ps(partial, scale, acc);
  return _mm512_fmadd_ps(zero, _mm512_set1_ps(sum), acc);
}

// Rows [row0, row0 + Tile) x output block `block`: float32 results into out_block[Tile][16].
// The rows' integer dot products advance together, one VPDPBUSD per row and 4 inputs, so Tile
// independent chains are in flight (a row's 8 products one after the other would wait on each
// other's latency); the integer sums are exact, so the order changes no bit.
template <int Tile>
inline void block_rows_of(const uint8_t* weights, const QuantizedRows& xq, int64_t row0, int64_t groups,
                          int64_t in_features, float* out_block) {
  __m512 acc[Tile];
  for (int t = 0; t < Tile; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = weights + g * kGroupBytes;
    for (int64_t line = 0; line < kGroupBytes; line += 64)  // past the end is harmless: a hint never faults
      _mm_prefetch(reinterpret_cast<const char*>(group + kPrefetchGroups * kGroupBytes + line), _MM_HINT_T0);
    __m512i nibbles[8];
    unpack_group(group, nibbles);
    const __m512 scale = load_bf16x16(group + 256);
    const __m512 zero = load_bf16x16(group + 256 + 32);
    const int8_t* xr = xq.values.data() + row0 * in_features + g * kGroup;
    // Split: few rows split each row's 8 products over independent partial sums as well.
    constexpr int kSplit = Tile == 1 ? 4 : Tile < 4 ? 2 : 1;
    __m512i dot[Tile * kSplit];
    for (int c = 0; c < Tile * kSplit; ++c) dot[c] = _mm512_setzero_si512();
    for (int w = 0; w < 8; ++w)
      for (int t = 0; t < Tile; ++t) {
        int32_t word;
        std::memcpy(&word, xr + t * in_features + 4 * w, sizeof(word));
        __m512i& chain = dot[t * kSplit + w % kSplit];
        chain = _mm512_dpbusd_epi32(chain, nibbles[w], _mm512_set1_epi32(word));
      }
    for (int t = 0; t < Tile; ++t)
      for (int c = 1; c < kSplit; ++c) dot[t * kSplit] = _mm512_add_epi32(dot[t * kSplit], dot[t * kSplit + c]);
    for (int t = 0; t < Tile; ++t) {
      const int64_t i = (row0 + t) * groups + g;
      acc[t] = group_epilogue(acc[t], dot[t * kSplit], xq.offsets[i], xq.scales[i], xq.sums[i], scale, zero);
    }
  }
  for (int t = 0; t < Tile; ++t) _mm512_storeu_ps(out_block + t * kLanes, acc[t]);
}

inline void block_rows(const uint8_t* weights, const QuantizedRows& xq, int64_t row0, int64_t tile,
                       int64_t groups, int64_t in_features, float* out_block) {
  switch (tile) {
    case 1: return block_rows_of<1>(weights, xq, row0, groups, in_features, out_block);
    case 2: return block_rows_of<2>(weights, xq, row0, groups, in_features, out_block);
    case 3: return block_rows_of<3>(weights, xq, row0, groups, in_features, out_block);
    case 4: return block_rows_of<4>(weights, xq, row0, groups, in_features, out_block);
    case 5: return block_rows_of<5>(weights, xq, row0, groups, in_features, out_block);
    case 6: return block_rows_of<6>(weights, xq, row0, groups, in_features, out_block);
    case 7: return block_rows_of<7>(weights, xq, row0, groups, in_features, out_block);
    default: return block_rows_of<kRowTile>(weights, xq, row0, groups, in_features, out_block);
  }
}

#if defined(__AMX_INT8__)
// Whether this process may use the AMX tile data (asked once: Linux grants it per process).
// Empty when granted, else why not.
const std::string& amx_refusal() {
  static const std::string refusal = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
      return std::string("arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: ") + std::strerror(errno);
    return std::string();
  }();
  return refusal;
}

struct alignas(64) TileConfig {  // LDTILECFG's 64 bytes, palette 1
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tile instructions as statements the compiler keeps in order with the memory they read
// and write (GCC 12's _tile_loadd and _tile_loadconfig declare no memory read).
#define DISCO_TILE_LOAD(tile, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tile ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define DISCO_TILE_STORE(tile, base, stride) \
  __asm__ volatile("tilestored %%tmm" #tile ", (%0,%1,1)" ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define DISCO_TILE_ZERO(tile) __asm__ volatile("tilezero %%tmm" #tile ::)
#define DISCO_TILE_DPBSUD(c, a, b) __asm__ volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

// The A tiles of a call on the AMX path: for each row tile of M rows and each pair of groups
// (2p, 2p + 1), 2M rows of 64 bytes, block-diagonal: row t holds row t's activations of group 2p
// then 32 zeros, row M + t 32 zeros then its activations of group 2p + 1. One TDPBSUD of it with
// the pair's two B tiles stacked (16 rows of 64 bytes: K = 64) gives in C row t group 2p's sums
// and in row M + t group 2p + 1's, each over its own 32 inputs only: two groups per product and
// per C tile stored (TILESTORED costs about as much for 2 rows as for 16).
struct AmxRows {
  int64_t tile_rows;  // M
  int64_t tiles;      // row tiles: M * tiles >= rows, the rows past the call's are zeros
  int64_t pairs;
  std::vector<int8_t> a;  // [tiles][pairs][2M][64]
};

AmxRows amx_rows(const QuantizedRows& xq, int64_t rows, int64_t groups, int64_t in_features) {
  const int64_t tiles = (rows + kAmxTileRows - 1) / kAmxTileRows;
  const int64_t tile_rows = (rows + tiles - 1) / tiles, pairs = (groups + 1) / 2;
  AmxRows out{tile_rows, tiles, pairs, std::vector<int8_t>(tiles * pairs * 2 * tile_rows * 64)};
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tile = r / tile_rows, t = r % tile_rows;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t row = (g % 2) * tile_rows + t;
      int8_t* dst = out.a.data() + ((tile * pairs + g / 2) * 2 * tile_rows + row) * 64 + (g % 2) * kGroup;
      std::memcpy(dst, xq.values.data() + r * in_features + g * kGroup, kGroup);
    }
  }
  return out;
}

// Tiles: A in 4 and 5, B (a pair's 16 x 64 bytes) in 6 and 7, C in 0..3, A and C of 2M rows.
inline void configure_tiles(int64_t tile_rows) {
  TileConfig config;
  for (int c = 0; c < 4; ++c) config.rows[c] = 2 * tile_rows, config.colsb[c] = 64;
  for (int a = 4; a < 6; ++a) config.rows[a] = 2 * tile_rows, config.colsb[a] = 64;
  for (int b = 6; b < 8; ++b) config.rows[b] = 16, config.colsb[b] = 64;
  __asm__ volatile("ldtilecfg %0" ::"m"(config) : "memory");
}

inline void release_tiles() { __asm__ volatile("tilerelease" ::: "memory"); }

#define DISCO_AMX_PRODUCT(a_tile, b_tile, c_tile, a, c)                     \
  DISCO_TILE_LOAD(a_tile, a, 64);                                           \
  DISCO_TILE_ZERO(c_tile);                                                  \
  DISCO_TILE_DPBSUD(c_tile, a_tile, b_tile);                                \
  DISCO_TILE_STORE(c_tile, c, 64)

// One pair's exact int32 sums for kTiles row tiles: c[i] = a[i] . b (tiles alternate with the
// pair's parity, so that a pair's loads need not wait for the previous pair's products).
template <int64_t kTiles>
inline void amx_pair_dot(int64_t pair, const int8_t* a, int64_t a_stride, const uint8_t* b, int32_t* c,
                         int64_t c_stride) {
  if (pair % 2 == 0) {
    DISCO_TILE_LOAD(6, b, 64);
    DISCO_AMX_PRODUCT(4, 6, 0, a, c);
    if constexpr (kTiles == 2) { DISCO_AMX_PRODUCT(5, 6, 1, a + a_stride, c + c_stride); }
  } else {
    DISCO_TILE_LOAD(7, b, 64);
    if constexpr (kTiles == 2) {
      DISCO_AMX_PRODUCT(4, 7, 2, a, c);
      DISCO_AMX_PRODUCT(5, 7, 3, a + a_stride, c + c_stride);
    } else {
      DISCO_AMX_PRODUCT(5, 7, 2, a, c);
    }
  }
}

// block_rows with AMX's integer products: kTiles row tiles of kM rows from row tile `tile0` (the
// first `rows` of them the call's). Each pair of groups takes three steps, a pipeline's stages
// kAmxDistance pairs apart, so that no step waits on the one before it: its nibbles unpacked to
// B tiles in memory, its products (C tiles stored to memory), then the float epilogue of each
// row, group 2p then 2p + 1, as on the VNNI path. The accumulators are registers (kM, kTiles
// constants).
template <int64_t kM, int64_t kTiles>
void block_rows_amx_of(const uint8_t* weights, const QuantizedRows& xq, const AmxRows& amx, int64_t tile0,
                       int64_t rows, int64_t groups, float* out_block) {
  constexpr int64_t kRows = kM * kTiles, kTileBytes = 2 * kM * 64;
  alignas(64) uint8_t b_tiles[kAmxRing][2][8 * 64];
  alignas(64) int32_t c_tiles[kAmxRing][kTiles][2 * kM][kLanes];
  __m512 acc[kRows];
#pragma GCC unroll 16
  for (int64_t t = 0; t < kRows; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t row0 = tile0 * kM, pairs = amx.pairs;
  const int8_t* a_tiles = amx.a.data() + tile0 * pairs * kTileBytes;
  for (int64_t step = 0; step < pairs + 2 * kAmxDistance; ++step) {
    if (step < pairs) {  // unpack pair `step`
      for (int64_t h = 0; h < 2 && 2 * step + h < groups; ++h) {
        const uint8_t* group = weights + (2 * step + h) * kGroupBytes;
        for (int64_t line = 0; line < kGroupBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(group + kPrefetchGroups * kGroupBytes + line), _MM_HINT_T0);
        __m512i nibbles[8];
        unpack_group(group, nibbles);
        uint8_t* b = b_tiles[step % kAmxRing][h];
        for (int w = 0; w < 8; ++w) _mm512_store_si512(b + 64 * w, nibbles[w]);
      }
      if (2 * step + 1 == groups)  // an odd count's last pair: its A columns are zeros, B too
        std::memset(b_tiles[step % kAmxRing][1], 0, sizeof(b_tiles[0][1]));
    }
    if (const int64_t pair = step - kAmxDistance; pair >= 0 && pair < pairs)  // its products
      amx_pair_dot<kTiles>(pair, a_tiles + pair * kTileBytes, pairs * kTileBytes, &b_tiles[pair % kAmxRing][0][0],
                           &c_tiles[pair % kAmxRing][0][0][0], 2 * kM * kLanes);
    if (const int64_t pair = step - 2 * kAmxDistance; pair >= 0) {  // its epilogues
      for (int64_t h = 0; h < 2 && 2 * pair + h < groups; ++h) {
        const int64_t g = 2 * pair + h;
        const uint8_t* group = weights + g * kGroupBytes;
        const __m512 scale = load_bf16x16(group + 256);
        const __m512 zero = load_bf16x16(group + 256 + 32);
#pragma GCC unroll 16
        for (int64_t row = 0; row < kRows; ++row) {  // constant indices: acc stays in registers
          const int64_t i = row / kM, t = row % kM, r = row0 + row;
          if (row < rows)
            acc[row] = group_epilogue(acc[row], _mm512_load_si512(c_tiles[pair % kAmxRing][i][h * kM + t]),
                                      xq.offsets[r * groups + g], xq.scales[r * groups + g], xq.sums[r * groups + g],
                                      scale, zero);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int64_t t = 0; t < kRows; ++t)
    if (t < rows) _mm512_storeu_ps(out_block + t * kLanes, acc[t]);
}

template <int64_t... kMs>
inline void block_rows_amx_dispatch(std::integer_sequence<int64_t, kMs...>, const uint8_t* weights,
                                    const QuantizedRows& xq, const AmxRows& amx, int64_t tile0, int64_t tiles,
                                    int64_t rows, int64_t groups, float* out_block) {
  ((amx.tile_rows == kMs + 1
        ? (tiles == 2 ? block_rows_amx_of<kMs + 1, 2>(weights, xq, amx, tile0, rows, groups, out_block)
                      : block_rows_amx_of<kMs + 1, 1>(weights, xq, amx, tile0, rows, groups, out_block))
        : void()),
   ...);
}

// Row tiles [tile0, tile0 + tiles) (at most kAmxPassTiles), `rows` of them the call's, x one block.
inline void block_rows_amx(const uint8_t* weights, const QuantizedRows& xq, const AmxRows& amx, int64_t tile0,
                           int64_t tiles, int64_t rows, int64_t groups, float* out_block) {
  block_rows_amx_dispatch(std::make_integer_sequence<int64_t, kAmxTileRows>(), weights, xq, amx, tile0, tiles,
                          rows, groups, out_block);
}
#endif

#else
// The AVX2 build: the same arithmetic in 8-lane halves of the 16-channel block. VPMADDUBSW
// multiplies the u4 weights by the s8 activations and adds pairs (at most 2 * 15 * 127, no
// saturation), VPMADDWD adds the pairs to the four products VPDPBUSD sums: the same int32,
// then the same float32 operations in the same order, so the same bits as the VNNI build.
inline void block_rows(const uint8_t* weights, const QuantizedRows& xq, int64_t row0, int64_t tile,
                       int64_t groups, int64_t in_features, float* out_block) {
  const __m256i low_mask = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kRowTile][2];
  for (int64_t t = 0; t < tile; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = weights + g * kGroupBytes;
    for (int64_t line = 0; line < kGroupBytes; line += 64)  // past the end is harmless: a hint never faults
      _mm_prefetch(reinterpret_cast<const char*>(group + kPrefetchGroups * kGroupBytes + line), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {  // channels 8h .. 8h + 7
      __m256i nibbles[8];
      for (int b = 0; b < 4; ++b) {
        __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 64 * b + 32 * h));
        nibbles[2 * b] = _mm256_and_si256(packed, low_mask);
        nibbles[2 * b + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask);
      }
      const __m256 scale = load_bf16x8(group + 256 + 16 * h);
      const __m256 zero = load_bf16x8(group + 256 + 32 + 16 * h);
      for (int64_t t = 0; t < tile; ++t) {
        const int64_t r = row0 + t;
        const int8_t* xr = xq.values.data() + r * in_features + g * kGroup;
        int32_t words[8];
        std::memcpy(words, xr, sizeof(words));
        __m256i dot = _mm256_setzero_si256();
        for (int w = 0; w < 8; ++w)
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles[w], _mm256_set1_epi32(words[w])), ones));
        dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(xq.offsets[r * groups + g]));
        const __m256 partial = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xq.scales[r * groups + g]));
        acc[t][h] = _mm256_fmadd_ps(partial, scale, acc[t][h]);
        acc[t][h] = _mm256_fmadd_ps(zero, _mm256_set1_ps(xq.sums[r * groups + g]), acc[t][h]);
      }
    }
  }
  for (int64_t t = 0; t < tile; ++t) {
    _mm256_storeu_ps(out_block + t * kLanes, acc[t][0]);
    _mm256_storeu_ps(out_block + t * kLanes + 8, acc[t][1]);
  }
}
#endif

}  // namespace

// Outside the anonymous namespace: decode_loop.cpp calls it directly.
at::Tensor q4q8_mm(const at::Tensor& x, const at::Tensor& weights, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "q4q8_mm: x must be a contiguous bf16 [rows, in_features] tensor");
  TORCH_CHECK(weights.scalar_type() == at::kByte && weights.is_contiguous(), "q4q8_mm: weights must be packed uint8");
  const int64_t rows = x.size(0), in_features = x.size(1);
  TORCH_CHECK(in_features % kGroup == 0 && out_features % kLanes == 0, "q4q8_mm: shape not a multiple of 32 x 16");
  const int64_t groups = in_features / kGroup, blocks = out_features / kLanes;
  TORCH_CHECK(weights.numel() == blocks * groups * kGroupBytes, "q4q8_mm: packed weights do not fit the shape");
  auto out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const QuantizedRows xq = quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, in_features);
  const uint8_t* packed = weights.data_ptr<uint8_t>();
  uint16_t* result = reinterpret_cast<uint16_t*>(out.data_ptr());
  auto store_rows = [&](int64_t block, int64_t row0, int64_t tile, const float* tile_out) {
    for (int64_t t = 0; t < tile; ++t)
      for (int64_t j = 0; j < kLanes; ++j)
        result[(row0 + t) * out_features + block * kLanes + j] = float_to_bf16(tile_out[t * kLanes + j]);
  };
#if defined(__AMX_INT8__)
  if (rows >= kAmxMinRows && amx_refusal().empty()) {
    const AmxRows amx = amx_rows(xq, rows, groups, in_features);
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      configure_tiles(amx.tile_rows);  // per thread: the chunks run on OpenMP's threads
      float tile_out[kAmxPassTiles * kAmxTileRows * kLanes];
      for (int64_t block = begin; block < end; ++block)
        for (int64_t tile0 = 0; tile0 < amx.tiles; tile0 += kAmxPassTiles) {
          const int64_t tiles = std::min(kAmxPassTiles, amx.tiles - tile0), row0 = tile0 * amx.tile_rows;
          const int64_t tile = std::min(tiles * amx.tile_rows, rows - row0);
          block_rows_amx(packed + block * groups * kGroupBytes, xq, amx, tile0, tiles, tile, groups, tile_out);
          store_rows(block, row0, tile, tile_out);
        }
      release_tiles();  // other code on this thread (oneDNN's AMX GEMMs) configures its own
    });
    return out;
  }
#endif
  // Each thread gets at least kMinThreadWork block x group x row products: a call too small to
  // split runs on the calling thread (the blocks are independent: the same bits either way).
  const int64_t grain = std::max<int64_t>(1, kMinThreadWork / (groups * rows));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    float tile_out[kRowTile * kLanes];
    for (int64_t block = begin; block < end; ++block) {
      const uint8_t* block_weights = packed + block * groups * kGroupBytes;
      for (int64_t row0 = 0; row0 < rows; row0 += kRowTile) {
        const int64_t tile = std::min(kRowTile, rows - row0);
        block_rows(block_weights, xq, row0, tile, groups, in_features, tile_out);
        store_rows(block, row0, tile, tile_out);
      }
    }
  });
  return out;
}

namespace {

// q uint8 [out, in] in [0, 15]; scales, zeros bf16 [out, in / 32] -> the packed layout above.
at::Tensor pack_q4q8(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "pack_q4q8: q must be uint8 [out, in]");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && zeros.scalar_type() == at::kBFloat16,
              "pack_q4q8: scales and zeros must be bf16");
  const int64_t out_features = q.size(0), in_features = q.size(1);
  TORCH_CHECK(in_features % kGroup == 0 && out_features % kLanes == 0, "pack_q4q8: shape not a multiple of 32 x 16");
  const int64_t groups = in_features / kGroup, blocks = out_features / kLanes;
  TORCH_CHECK(scales.size(0) == out_features && scales.size(1) == groups && zeros.sizes() == scales.sizes(),
              "pack_q4q8: scales/zeros must be [out, in / 32]");
  auto qc = q.contiguous();
  auto sc = scales.contiguous();
  auto zc = zeros.contiguous();
  auto packed = at::empty({blocks * groups * kGroupBytes}, q.options());
  const uint8_t* qv = qc.data_ptr<uint8_t>();
  const uint16_t* sv = reinterpret_cast<const uint16_t*>(sc.data_ptr());
  const uint16_t* zv = reinterpret_cast<const uint16_t*>(zc.data_ptr());
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* group = dst + (block * groups + g) * kGroupBytes;
        for (int b = 0; b < 4; ++b)
          for (int64_t j = 0; j < kLanes; ++j)
            for (int i = 0; i < 4; ++i) {
              const int64_t n = block * kLanes + j, k = g * kGroup + 8 * b + i;
              group[64 * b + 4 * j + i] = static_cast<uint8_t>((qv[n * in_features + k] & 0x0f) |
                                                               ((qv[n * in_features + k + 4] & 0x0f) << 4));
            }
        uint16_t* scale_out = reinterpret_cast<uint16_t*>(group + 256);
        for (int64_t j = 0; j < kLanes; ++j) {
          scale_out[j] = sv[(block * kLanes + j) * groups + g];
          scale_out[kLanes + j] = zv[(block * kLanes + j) * groups + g];
        }
      }
    }
  });
  return packed;
}

// Output channels [start, end) (multiples of 16) of the packed weights as float32 or bf16
// [end - start, in_features] into `out`: (q - 8) * scale + zero, multiplied then added in
// float32 (two roundings, no FMA: the bits of torch's `copy_(q - 8).mul_(scale).add_(zero)`),
// then rounded to nearest even for bf16. The dense GEMMs of prefill blocks multiply by it.
void dequantize_q4q8(const at::Tensor& weights, int64_t out_features, int64_t in_features, int64_t start,
                     int64_t end, at::Tensor& out) {
  TORCH_CHECK(weights.scalar_type() == at::kByte && weights.is_contiguous(), "dequantize: weights must be packed uint8");
  TORCH_CHECK(in_features % kGroup == 0 && out_features % kLanes == 0 && start % kLanes == 0 && end % kLanes == 0 &&
                  0 <= start && start <= end && end <= out_features,
              "dequantize: channels must be a range of whole blocks of 16");
  const int64_t groups = in_features / kGroup;
  TORCH_CHECK(weights.numel() == (out_features / kLanes) * groups * kGroupBytes, "dequantize: packed weights do not fit the shape");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == end - start && out.size(1) == in_features &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "dequantize: out must be a contiguous float32 or bf16 [end - start, in_features] tensor");
  const bool to_bf16 = out.scalar_type() == at::kBFloat16;
  const uint8_t* packed = weights.data_ptr<uint8_t>();
  at::parallel_for(start / kLanes, end / kLanes, 1, [&](int64_t begin, int64_t finish) {
    alignas(64) uint8_t q[kLanes][kGroup];
    alignas(64) float values[kGroup];
#if defined(__AVX512VNNI__)
    const __m512 eight = _mm512_set1_ps(8.f);
#else
    const __m256 eight = _mm256_set1_ps(8.f);
#endif
    for (int64_t block = begin; block < finish; ++block) {
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* group = packed + (block * groups + g) * kGroupBytes;
        for (int b = 0; b < 4; ++b)
          for (int64_t j = 0; j < kLanes; ++j) {
            uint32_t word;
            std::memcpy(&word, group + 64 * b + 4 * j, sizeof(word));
            const uint32_t low = word & 0x0f0f0f0fu, high = (word >> 4) & 0x0f0f0f0fu;
            std::memcpy(&q[j][8 * b], &low, sizeof(low));
            std::memcpy(&q[j][8 * b + 4], &high, sizeof(high));
          }
        const uint16_t* scales = reinterpret_cast<const uint16_t*>(group + 256);
        for (int64_t j = 0; j < kLanes; ++j) {
#if defined(__AVX512VNNI__)
          const __m512 scale = _mm512_set1_ps(bf16_to_float(scales[j]));
          const __m512 zero = _mm512_set1_ps(bf16_to_float(scales[kLanes + j]));
#else
          const __m256 scale = _mm256_set1_ps(bf16_to_float(scales[j]));
          const __m256 zero = _mm256_set1_ps(bf16_to_float(scales[kLanes + j]));
#endif
          const int64_t row = block * kLanes + j - start;
          float* dst = to_bf16 ? values : out.data_ptr<float>() + row * in_features + g * kGroup;
#if defined(__AVX512VNNI__)
          for (int part = 0; part < 2; ++part) {
            const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&q[j][16 * part]));
            __m512 value = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), eight);
            _mm512_storeu_ps(dst + 16 * part, _mm512_add_ps(_mm512_mul_ps(value, scale), zero));
          }
#else
          for (int part = 0; part < 4; ++part) {
            const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(&q[j][8 * part]));
            __m256 value = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), eight);
            _mm256_storeu_ps(dst + 8 * part, _mm256_add_ps(_mm256_mul_ps(value, scale), zero));
          }
#endif
          if (to_bf16) {
            uint16_t* rounded = reinterpret_cast<uint16_t*>(out.data_ptr()) + row * in_features + g * kGroup;
            for (int64_t k = 0; k < kGroup; ++k) rounded[k] = float_to_bf16(values[k]);
          }
        }
      }
    }
  });
}

}  // namespace

std::string variant() { return DISCO_Q4Q8_VARIANT; }

// Why this build's AMX path does not run in this process ("" where it does; other builds: why not).
std::string amx_refused() {
#if defined(__AMX_INT8__)
  return amx_refusal();
#else
  return "not an AMX build";
#endif
}

TORCH_LIBRARY(disco_q4q8, m) {
  m.def("variant() -> str", &variant);  // which build this is: no tensor to dispatch on
  m.def("amx_refused() -> str", &amx_refused);
  m.def("mm(Tensor x, Tensor weights, int out_features) -> Tensor");
  m.def("pack(Tensor q, Tensor scales, Tensor zeros) -> Tensor");
  m.def("dequantize(Tensor weights, int out_features, int in_features, int start, int end, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(disco_q4q8, CPU, m) {
  m.impl("mm", &q4q8_mm);
  m.impl("pack", &pack_q4q8);
  m.impl("dequantize", &dequantize_q4q8);
}
