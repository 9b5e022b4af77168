// GGUF blocks repacked into the native step's tiles, in one pass over the file's bytes.
//
// Why: a cold start of a new file cannot serve until its projections are in tiles, and the NumPy
// form of the same conversion (kernels/packed.py `decode` + `_data`) took ~50 s for a 1 B Q4_K_M
// file on two cores, most of it strided passes over small axes. Here each tile-block (16 rows x 32
// inputs) is decoded from the blocks and written once, tiles shared out among the threads.
//
// This file reads the GGUF blocks (llama.cpp's, ggml-common.h: block_q4_0 ... block_q6_K; K-quant
// scales as ggml-quants.c get_scale_min_k4 reads them); step/formats.h writes the tiles (`put_row`,
// `put_scales`), as it reads them. The bytes are exactly those of kernels/packed.py `pack_reference`;
// tests/test_repack.py holds the two equal for every format, with padded rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>

#define STRATUM_TORCH 1  // numerics.h as packed_step.cpp includes it
#include "step/formats.h"

namespace {

using stratum_step::Format, stratum_step::kBlock, stratum_step::kSuper, stratum_step::kTile;

// the GGUF types, as kernels/packed.py REPACK_TYPES numbers them
enum QType : int64_t { kQ4_0, kQ4_1, kQ8_0, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K, kF16, kBF16 };

struct TypeInfo {
  int64_t row_block;     // bytes of one GGUF block
  int64_t block_inputs;  // inputs it covers
  Format format;         // the tiles it becomes
};

constexpr TypeInfo info(QType t) {
  using namespace stratum_step;
  switch (t) {
    case kQ4_0: return {18, 32, kQ4};
    case kQ4_1: return {20, 32, kQ4};
    case kQ8_0: return {34, 32, kQ8};
    case kQ5_0: return {22, 32, kQ5};
    case kQ5_1: return {24, 32, kQ5M};
    case kQ4_K: return {144, 256, kQ4K};
    case kQ5_K: return {176, 256, kQ5K};
    case kQ6_K: return {210, 256, kQ6K};
    case kF16: return {2, 1, stratum_step::kF16};
    case kBF16: return {2, 1, stratum_step::kBF16};
  }
  return {0, 0, kQ4};
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

// raw [n, row bytes] -> (data [tiles, blocks, bytes] uint8, scales): kernels/packed.py `pack`
std::tuple<at::Tensor, at::Tensor> packed_repack(const at::Tensor& raw, int64_t qtype, int64_t n, int64_t k) {
  TORCH_CHECK(qtype >= 0 && qtype <= kBF16, "packed_repack: unknown type ", qtype);
  const QType t = static_cast<QType>(qtype);
  const TypeInfo ti = info(t);
  const Format f = ti.format;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous(), "packed_repack: raw must be contiguous uint8");
  TORCH_CHECK(k % ti.block_inputs == 0 && k % kBlock == 0, "packed_repack: ", k, " inputs do not fill whole blocks");
  const int64_t row_bytes = k / ti.block_inputs * ti.row_block;
  TORCH_CHECK(raw.numel() == n * row_bytes, "packed_repack: ", raw.numel(), " bytes are not ", n, " rows of ", row_bytes);
  const int64_t tiles = (n + kTile - 1) / kTile, nb = k / kBlock;
  const int64_t data_bytes = stratum_step::block_bytes(f);
  const int64_t scale_bytes = nb * stratum_step::block_scales(f) * stratum_step::scale_size(f);  // a tile's
  at::Tensor data = at::empty({tiles, nb, data_bytes}, at::kByte);
  at::Tensor scales = stratum_step::super_scales(f) ? at::zeros({tiles, nb / kSuper, stratum_step::super_bytes(f)}, at::kByte)
                                                    : at::zeros({tiles, nb, stratum_step::block_scales(f)}, at::kHalf);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = data.data_ptr<uint8_t>();
  uint8_t* sc = static_cast<uint8_t*>(scales.data_ptr());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    Decoded row;
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t valid = std::min(kTile, n - tile * kTile);
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* wb = dst + (tile * nb + b) * data_bytes;
        std::memset(wb, 0, data_bytes);  // here, not by at::zeros: each tile-block is written once, in cache
        for (int64_t i = 0; i < valid; ++i) {
          decode(t, src + (tile * kTile + i) * row_bytes, b, row);
          if (stratum_step::is_float(f)) {
            stratum_step::put_row_float(i, row.q16, wb);
            continue;
          }
          stratum_step::put_row(f, i, row.q, wb);
          const uint16_t* fp16 = stratum_step::super_scales(f) ? row.sup : row.scale;
          stratum_step::put_scales(f, b, i, row.ints, fp16, sc + tile * scale_bytes);
        }
      }
    }
  });
  return {data, scales};
}

inline float half_at(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

inline float bf16_at(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &wide, 4);
  return v;
}

// One decoded block's 32 values in fp32, operation for operation as gguf-py dequantizes them
// (gguf/quants.py, each product and sum rounded to fp32 on its own: this file is compiled with
// -ffp-contract=off): d * q (+ m) for the 32-input formats, (d * scale) * q - dmin * min for Q4_K and
// Q5_K, (d * scale) * (q - 32) for Q6_K's halves of 16.
void block_values(QType t, const Decoded& o, float* v) {
  if (t == kF16 || t == kBF16) {
    for (int64_t l = 0; l < kBlock; ++l) v[l] = t == kF16 ? half_at(o.q16[l]) : bf16_at(o.q16[l]);
    return;
  }
  if (t == kQ6_K) {
    const float d = half_at(o.sup[0]);
    for (int64_t l = 0; l < kBlock; ++l)
      v[l] = d * static_cast<float>(static_cast<int8_t>(o.ints[l / 16])) * static_cast<float>(o.q[l] - 32);
    return;
  }
  if (t == kQ4_K || t == kQ5_K) {
    const float d = half_at(o.sup[0]) * static_cast<float>(o.ints[0]), m = half_at(o.sup[1]) * static_cast<float>(o.ints[1]);
    for (int64_t l = 0; l < kBlock; ++l) v[l] = d * static_cast<float>(o.q[l]) - m;
    return;
  }
  const float d = half_at(o.scale[0]);
  if (t == kQ4_1 || t == kQ5_1) {
    const float m = half_at(o.scale[1]);
    for (int64_t l = 0; l < kBlock; ++l) v[l] = d * static_cast<float>(o.q[l]) + m;
    return;
  }
  const int offset = t == kQ4_0 ? 8 : t == kQ5_0 ? 16 : 0;
  for (int64_t l = 0; l < kBlock; ++l)
    v[l] = d * static_cast<float>(t == kQ8_0 ? static_cast<int8_t>(o.q[l]) : o.q[l] - offset);
}

// Rows `ids` of raw GGUF rows [n, row bytes] -> fp32 [len(ids), k]: an embedding lookup from the table
// as the file stores it, the values gguf-py's dequantization gives (`block_values`).
at::Tensor dequantize_rows(const at::Tensor& raw, int64_t qtype, int64_t k, const at::Tensor& ids) {
  TORCH_CHECK(qtype >= 0 && qtype <= kBF16, "dequantize_rows: unknown type ", qtype);
  const QType t = static_cast<QType>(qtype);
  const TypeInfo ti = info(t);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(), "dequantize_rows: raw must be [rows, bytes] uint8");
  TORCH_CHECK(k % ti.block_inputs == 0 && k % kBlock == 0 && raw.size(1) == k / ti.block_inputs * ti.row_block,
              "dequantize_rows: rows of ", raw.size(1), " bytes do not hold ", k, " values");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "dequantize_rows: ids must be [m] int64");
  const auto idc = ids.contiguous();
  const int64_t m = idc.size(0), n = raw.size(0), nb = k / kBlock;
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < n, "dequantize_rows: row ", id[i], " of ", n);
  at::Tensor out = at::empty({m, k}, at::kFloat);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, m * nb, 256, [&](int64_t begin, int64_t end) {
    Decoded o;
    for (int64_t j = begin; j < end; ++j) {
      decode(t, src + id[j / nb] * raw.size(1), j % nb, o);
      block_values(t, o, dst + j * kBlock);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stratum, m) {
  m.def("packed_repack(Tensor raw, int qtype, int rows, int cols) -> (Tensor, Tensor)", &packed_repack);
  m.def("dequantize_rows(Tensor raw, int qtype, int cols, Tensor ids) -> Tensor", &dequantize_rows);
}
