// GGUF blocks repacked into the native step's tiles, in one pass over the file's bytes.
//
// Why: a cold start of a new file cannot serve until its projections are in tiles, and the NumPy
// form of the same conversion (kernels/packed.py `decode` + `_data`) took ~50 s for a 1 B Q4_K_M
// file on two cores, most of it strided passes over small axes. Here each tile-block (16 rows x 32
// inputs) is decoded from the blocks and written once, tiles shared out among the threads.
//
// The bytes are exactly those of kernels/packed.py (`pack`), whose module docstring draws the
// layouts; tests/test_repack.py holds the two equal for every format, with padded rows. The block
// formats are llama.cpp's (ggml-common.h: block_q4_0 ... block_q6_K); K-quant scales as
// ggml-quants.c get_scale_min_k4 reads them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

constexpr int64_t kTile = 16, kBlock = 32, kSuper = 8;  // rows per tile, inputs per block, blocks per super-block

// the GGUF types, as kernels/packed.py REPACK_TYPES numbers them
enum QType : int64_t { kQ4_0, kQ4_1, kQ8_0, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K, kF16, kBF16 };

struct TypeInfo {
  int64_t row_block;  // bytes of one GGUF block
  int64_t block_inputs;  // inputs it covers
  int64_t data_bytes;  // bytes of one tile-block in the tiles
  int64_t high_bits;  // 0, 1 (5-bit), 2 (6-bit): a plane after the nibbles
  int64_t scales;  // fp16 scales per block (not super-block formats), or integer scales per block (super)
  int64_t super_fp16;  // fp16 values per super-block (K-quants), else 0
};

constexpr TypeInfo info(QType t) {
  switch (t) {
    case kQ4_0: return {18, 32, 256, 0, 2, 0};
    case kQ4_1: return {20, 32, 256, 0, 2, 0};
    case kQ8_0: return {34, 32, 512, 0, 1, 0};
    case kQ5_0: return {22, 32, 320, 1, 1, 0};
    case kQ5_1: return {24, 32, 320, 1, 2, 0};
    case kQ4_K: return {144, 256, 256, 0, 2, 2};
    case kQ5_K: return {176, 256, 320, 1, 2, 2};
    case kQ6_K: return {210, 256, 384, 2, 2, 1};
    case kF16:
    case kBF16: return {2, 1, 1024, 0, 0, 0};
  }
  return {0, 0, 0, 0, 0, 0};
}

inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint16_t fp16_bits(float x) { return c10::Half(x).x; }

// One row's block b decoded: q[32] as the tiles keep it (uint8: 0..15 / 0..31 / 0..63; Q8_0: the int8
// bits; F16 / BF16: the 16-bit values in q16), and its scales in the tiles' order (fp16 bits for the
// plain formats; for the K-quants the two integer scales in ints and the super-block's fp16 in sup).
struct Decoded {
  uint8_t q[kBlock];
  uint16_t q16[kBlock];
  uint16_t scale[2];
  uint8_t ints[2];
  uint16_t sup[2];
};

void decode_k(QType t, const uint8_t* row, int64_t b, Decoded& o) {
  const int64_t j = b % kSuper;
  const uint8_t* blk = row + (b / kSuper) * info(t).row_block;
  if (t == kQ6_K) {
    const uint8_t *ql = blk + 64 * (j / 4), *qh = blk + 128 + 32 * (j / 4);
    const int64_t jj = j % 4;
    for (int64_t l = 0; l < kBlock; ++l) {
      const uint8_t low = (ql[l + 32 * (jj & 1)] >> (4 * (jj >> 1))) & 15;
      o.q[l] = low | (((qh[l] >> (2 * jj)) & 3) << 4);
    }
    o.ints[0] = blk[192 + 2 * j];  // int8 scales of inputs 0-15 and 16-31, their bits
    o.ints[1] = blk[192 + 2 * j + 1];
    o.sup[0] = u16(blk + 208);
    return;
  }
  const uint8_t* s = blk + 4;
  o.ints[0] = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
  o.ints[1] = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  o.sup[0] = u16(blk);
  o.sup[1] = u16(blk + 2);
  const uint8_t* qs = blk + (t == kQ5_K ? 48 : 16) + 32 * (j / 2);
  for (int64_t l = 0; l < kBlock; ++l) {
    o.q[l] = (qs[l] >> (4 * (j % 2))) & 15;
    if (t == kQ5_K) o.q[l] |= ((blk[16 + l] >> j) & 1) << 4;
  }
}

void decode(QType t, const uint8_t* row, int64_t b, Decoded& o) {
  if (t == kQ4_K || t == kQ5_K || t == kQ6_K) return decode_k(t, row, b, o);
  if (t == kF16 || t == kBF16) {
    std::memcpy(o.q16, row + b * kBlock * 2, kBlock * 2);
    return;
  }
  const uint8_t* blk = row + b * info(t).row_block;
  o.scale[0] = u16(blk);
  if (t == kQ8_0) {
    std::memcpy(o.q, blk + 2, kBlock);
    return;
  }
  const bool has_m = t == kQ4_1 || t == kQ5_1;
  const bool five = t == kQ5_0 || t == kQ5_1;
  // Q4_0's offset is -8 d, computed in fp32 and stored as fp16, as packed.decode does
  o.scale[1] = has_m ? u16(blk + 2) : fp16_bits(c10::Half(o.scale[0], c10::Half::from_bits()) * -8.f);
  uint32_t qh = 0;
  if (five) std::memcpy(&qh, blk + (has_m ? 4 : 2), 4);
  const uint8_t* qs = blk + (has_m ? 4 : 2) + (five ? 4 : 0);
  for (int64_t l = 0; l < 16; ++l) {
    o.q[l] = (qs[l] & 15) | (five ? ((qh >> l) & 1) << 4 : 0);
    o.q[l + 16] = (qs[l] >> 4) | (five ? ((qh >> (l + 16)) & 1) << 4 : 0);
  }
}

// tile-block `d` (data_bytes of it) from its 16 rows' decoded blocks (rows past `valid` are zero)
void write_data(QType t, const Decoded* rows, int64_t valid, uint8_t* d) {
  const TypeInfo ti = info(t);
  std::memset(d, 0, ti.data_bytes);
  if (t == kF16 || t == kBF16) {
    uint16_t* d16 = reinterpret_cast<uint16_t*>(d);
    for (int64_t i = 0; i < valid; ++i)
      for (int64_t j = 0; j < kBlock; ++j) d16[j * kTile + i] = rows[i].q16[j];
    return;
  }
  if (t == kQ8_0) {  // [pair p][row i][e < 2]
    for (int64_t i = 0; i < valid; ++i)
      for (int64_t j = 0; j < kBlock; ++j) d[((j / 2) * kTile + i) * 2 + j % 2] = rows[i].q[j];
    return;
  }
  uint8_t* high = d + 256;
  for (int64_t i = 0; i < valid; ++i) {
    const uint8_t* q = rows[i].q;
    const int64_t L = i / 4, k = i % 4;
    for (int64_t g = 0; g < 4; ++g)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t e = 0; e < 2; ++e) {
          const uint8_t lo = q[8 * g + 2 * h + e], hi = q[8 * g + 4 + 2 * h + e];
          d[((g * 4 + L) * 2 + h) * 8 + k * 2 + e] = (lo & 15) | ((hi & 15) << 4);
          const int64_t r = h * 8 + k * 2 + e;
          if (ti.high_bits == 1) {
            high[g * 16 + r] |= ((lo >> 4) << L) | ((hi >> 4) << (4 + L));
          } else if (ti.high_bits == 2) {
            high[g * 32 + r] |= (lo >> 4) << (2 * L);
            high[g * 32 + 16 + r] |= (hi >> 4) << (2 * L);
          }
        }
  }
}

// raw [n, row bytes] -> (data [tiles, blocks, bytes] uint8, scales): kernels/packed.py `pack`
std::tuple<at::Tensor, at::Tensor> packed_repack(const at::Tensor& raw, int64_t qtype, int64_t n, int64_t k) {
  const QType t = static_cast<QType>(qtype);
  const TypeInfo ti = info(t);
  TORCH_CHECK(ti.row_block > 0 && qtype >= 0 && qtype <= kBF16, "packed_repack: unknown type ", qtype);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous(), "packed_repack: raw must be contiguous uint8");
  TORCH_CHECK(k % ti.block_inputs == 0 && k % kBlock == 0, "packed_repack: ", k, " inputs do not fill whole blocks");
  const int64_t row_bytes = k / ti.block_inputs * ti.row_block;
  TORCH_CHECK(raw.numel() == n * row_bytes, "packed_repack: ", raw.numel(), " bytes are not ", n, " rows of ", row_bytes);
  const int64_t tiles = (n + kTile - 1) / kTile, nb = k / kBlock;
  const bool super = ti.super_fp16 > 0;
  const int64_t super_bytes = kSuper * 2 * kTile + ti.super_fp16 * kTile * 2;
  at::Tensor data = at::empty({tiles, nb, ti.data_bytes}, at::kByte);
  at::Tensor scales = super ? at::zeros({tiles, nb / kSuper, super_bytes}, at::kByte)
                            : at::zeros({tiles, nb, kTile * ti.scales}, at::kHalf);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = data.data_ptr<uint8_t>();
  uint8_t* sc8 = super ? scales.data_ptr<uint8_t>() : nullptr;
  uint16_t* sc16 = super ? nullptr : reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    Decoded rows[kTile];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t valid = std::min(kTile, n - tile * kTile);
      for (int64_t b = 0; b < nb; ++b) {
        for (int64_t i = 0; i < valid; ++i) decode(t, src + (tile * kTile + i) * row_bytes, b, rows[i]);
        write_data(t, rows, valid, dst + (tile * nb + b) * ti.data_bytes);
        for (int64_t i = 0; i < valid; ++i) {
          if (!super) {
            for (int64_t s = 0; s < ti.scales; ++s) sc16[(tile * nb + b) * kTile * ti.scales + s * kTile + i] = rows[i].scale[s];
            continue;
          }
          uint8_t* base = sc8 + (tile * (nb / kSuper) + b / kSuper) * super_bytes;
          base[(b % kSuper) * 2 * kTile + i] = rows[i].ints[0];
          base[(b % kSuper) * 2 * kTile + kTile + i] = rows[i].ints[1];
          for (int64_t s = 0; s < ti.super_fp16; ++s) std::memcpy(base + kSuper * 2 * kTile + s * kTile * 2 + i * 2, &rows[i].sup[s], 2);
        }
      }
    }
  });
  return {data, scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stratum, m) {
  m.def("packed_repack(Tensor raw, int qtype, int rows, int cols) -> (Tensor, Tensor)", &packed_repack);
}
