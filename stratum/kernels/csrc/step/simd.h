// The instruction set the step is compiled for, chosen by the compiler's macros (-march, kernels/native.py):
// exactly one family file is included. Each one defines, in its own instructions:
//   kSimdPath      its name, for `stratum info` and the kernel choices
//   struct Simd    the projections' vector of kLanes output lanes (a part of the 16-lane tile):
//                    dot(acc, w, x)   acc[i] += w[2i] x[0] + w[2i+1] x[1]: w int16 pairs, x one pair (as int32)
//                    nibbles(p, out)  a part's bytes of one 64-byte group of a 4-bit tile-block -> its four
//                                     input pairs (formats.h draws the layout)
//                    high1, high2, nibbles_with  the same with a 5- or 6-bit group's high plane or-ed in
//                    widen8(p)        a part's int8 pairs of one 32-byte pair row -> int16 pairs
//                    and the fp32 operations (fma, mul, add, fp16 and bf16 loads) the scales and sums take
//   kWideMinRows   rows from which the family's `wide_rows` takes a tile (0: it has none; projection.h)
//   scores_kernel, values_kernel   its register-blocked attention for a pass of 1 to 4 query heads, where it
//                                  covers the shape (nullptr: attention.h's plain loops)
//   kScoreRows, rows_scores_kernel the rows whose scores it computes in one pass over a block's keys, and
//                                  that kernel (nullptr: one row at a time)
// The families must agree bit for bit: each lane's integer sums are exact, and its float operations are
// the same ones in the same order in every family (numerics.h).
#pragma once

#include "formats.h"

namespace stratum_step {

// Attention's two inner loops over one block of the pool (attention.h), for T = float or BF16 pools.
template <typename T>
using ScoresFn = void (*)(const float* q, int64_t d, const T* kt, float scale, float* scores);
template <typename T>
using RowsScoresFn = void (*)(const float* q, int64_t q_stride, int64_t d, const T* kt, float scale, float* scores,
                              int64_t scores_stride);
template <typename T>
using ValuesFn = void (*)(const float* p, const T* v, int64_t stride, int64_t n, float* acc, int64_t bs);

}  // namespace stratum_step

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "simd_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd_avx2.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "simd_neon.h"
#else
#include "simd_portable.h"
#endif
