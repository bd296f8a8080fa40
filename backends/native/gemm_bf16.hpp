// The bfloat16 GEMM of the mixed-precision engine (SPEC.md "Reduced precision"):
//
//     C (float32) = alpha * op(A) op(B) + beta * C
//
// with A, B and C float32 in memory (row-major, transposes as gemm<T> in blas.hpp takes
// them), every element of op(A) and op(B) rounded to bfloat16 (nearest, ties to even, as
// ml_dtypes) while it is packed, the products summed in float32 and the float32 result
// written. Single-threaded: the engine calls it from inside its own thread teams, on
// the same panels as its float32 products (rnn.hpp, Worker::gemm).
//
// Layout. The AVX512-BF16 instruction VDPBF16PS multiplies bfloat16 PAIRS: lane j of the
// float32 accumulator gets a[2j] b[2j] + a[2j+1] b[2j+1], with the pairs packed in one
// 32-bit word (the even element in the low half). So op(A) and op(B) are packed by pairs
// of K (an odd K gets a zero partner): A in MR-row panels [panel][pair][MR words], B in
// NR-column panels [panel][pair][NR words]. The micro-kernel holds an R x NR tile
// (R <= MR) of float32 accumulators, and per pair of K broadcasts one A word per row and
// multiplies it into two 16-lane B vectors. Blocking: KC pairs of K per pass (a B
// micro-panel of KC x NR words, 32 KiB, stays in L1), MC rows of A per block (in L2).
// A C tile is written once per KC block (alpha * sum + beta * C on the first, + C after),
// so a product of K <= 2 KC (512, kFuseDepth in rnn.hpp) rounds into C once.
//
// Kernels. The micro-kernel is written once against four primitives (load a vector of
// pairs, broadcast one pair, the pair dot-product accumulate, store/add float32) and
// instantiated twice: with AVX512-BF16 intrinsics (compiled under a target attribute, not
// -march, so the module builds for any x86-64 CPU) and with a portable emulation of the
// same instruction. Which one runs is decided at run time (bf16.hpp, beside the AMX kernel
// of gemm_amx.hpp): the AVX512-BF16 kernel where the CPU has the instruction
// (__builtin_cpu_supports("avx512bf16")), else the portable one; set_kernel() can force the
// portable kernel (tests compare the two).
//
// The emulation follows the Intel SDM's pseudo-code of VDPBF16PS: per lane,
//     acc = acc + a[2j+1] * b[2j+1]   (one rounding, to nearest even)
//     acc = acc + a[2j]   * b[2j]     (one rounding)
// with bfloat16 inputs widened exactly to float32, denormal inputs (bfloat16 and the
// accumulator) read as zero and denormal results flushed to zero, whatever MXCSR says.
// Products of two bfloat16 numbers are exact in float32 (8 + 8 significant bits) unless
// they fall below float32's normal range, where the emulation's fused multiply-add still
// rounds once; how the hardware rounds there (and whether it rounds the two additions of
// a lane separately, as the pseudo-code says) is not something this machine-independent
// code can check, so the tests compare the two kernels within float32 summation noise,
// and exactly on inputs whose sums are exact.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "packs.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RNN_BF16_X86 1
#endif

// the AVX-512 kernel's templates hold __m512 values; they are only ever inlined into a
// function compiled for AVX-512 (macro_avx512), so the ABI note GCC gives them is moot
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace rnn {
namespace bf16 {

constexpr int MR = 8;    // rows of a micro-tile (and of an A panel)
constexpr int NR = 32;   // columns of a micro-tile: two 16-lane vectors
constexpr int KC = 256;  // pairs of K per pass (512 elements of K)
constexpr int MC = 256;  // rows of A per block
static_assert(MR == 8 && NR % 8 == 0, "the AVX-512 packing (rows_pairs8) writes panels eight rows or columns at a time");

// float32 -> bfloat16 bits, nearest with ties to even (ml_dtypes' rounding): beyond
// bfloat16's largest finite value the result is infinite; a NaN stays a (quiet) NaN.
inline std::uint16_t round(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (std::uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (std::uint16_t)(u >> 16);
}

inline float widen(std::uint16_t h) {
    const std::uint32_t u = (std::uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline std::uint32_t pair(float even, float odd) {
    return (std::uint32_t)round(even) | ((std::uint32_t)round(odd) << 16);
}

// ---- the primitives -------------------------------------------------------------------

// Portable: the instruction's semantics in plain C++ (GCC vectorises the lane loops).
struct Portable {
    struct F {
        float v[16];
    };
    struct P {
        std::uint32_t v[16];
    };

    static inline float daz(float x) {  // a denormal input reads as a zero of its sign
        std::uint32_t u;
        std::memcpy(&u, &x, 4);
        if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
        std::memcpy(&x, &u, 4);
        return x;
    }
    static inline float lo(std::uint32_t w) { return widen((std::uint16_t)(w & 0xffffu)); }
    static inline float hi(std::uint32_t w) { return widen((std::uint16_t)(w >> 16)); }

    static inline F zero() {
        F r;
        for (int j = 0; j < 16; ++j) r.v[j] = 0.0f;
        return r;
    }
    static inline P load(const std::uint32_t* p) {
        P r;
        for (int j = 0; j < 16; ++j) r.v[j] = p[j];
        return r;
    }
    static inline P bcast(std::uint32_t w) {
        P r;
        for (int j = 0; j < 16; ++j) r.v[j] = w;
        return r;
    }
    // acc[j] += a.hi[j] b.hi[j], then += a.lo[j] b.lo[j]: each a fused multiply-add with
    // one rounding, denormals in read as zero, denormals out flushed (daz of the result)
    static inline F dp(F acc, P a, P b) {
        for (int j = 0; j < 16; ++j) {
            float s = daz(acc.v[j]);
            s = daz(std::fma(daz(hi(a.v[j])), daz(hi(b.v[j])), s));
            s = daz(std::fma(daz(lo(a.v[j])), daz(lo(b.v[j])), s));
            acc.v[j] = s;
        }
        return acc;
    }
    // c[0:n] = alpha * acc + beta * c (beta == 0: c is not read), n <= 16
    static inline void store(float* c, F acc, int n, float alpha, float beta) {
        if (beta == 0.0f)
            for (int j = 0; j < n; ++j) c[j] = alpha * acc.v[j];
        else
            for (int j = 0; j < n; ++j) c[j] = std::fma(alpha, acc.v[j], beta * c[j]);
    }
};

#ifdef RNN_BF16_X86
#define RNN_BF16_TARGET __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))

// AVX512-BF16: VDPBF16PS on 16 lanes (only ever executed where the CPU has it).
struct Avx512 {
    using F = __m512;
    using P = __m512i;

    RNN_BF16_TARGET static inline F zero() { return _mm512_setzero_ps(); }
    RNN_BF16_TARGET static inline P load(const std::uint32_t* p) { return _mm512_loadu_si512((const void*)p); }
    RNN_BF16_TARGET static inline P bcast(std::uint32_t w) { return _mm512_set1_epi32((int)w); }
    RNN_BF16_TARGET static inline F dp(F acc, P a, P b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
    RNN_BF16_TARGET static inline void store(float* c, F acc, int n, float alpha, float beta) {
        const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
        const F r = _mm512_mul_ps(_mm512_set1_ps(alpha), acc);
        if (beta == 0.0f) {
            _mm512_mask_storeu_ps(c, m, r);
        } else {
            const F old = _mm512_mul_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(m, c));
            _mm512_mask_storeu_ps(c, m, _mm512_fmadd_ps(_mm512_set1_ps(alpha), acc, old));
        }
    }
};
#endif

// ---- the micro- and macro-kernel, once for both ---------------------------------------

// C[0:R, 0:ncols] (row stride ldc) = alpha * (kp pairs of a x b) + beta * C. `a`: kp x MR
// words (rows past R unused), `b`: kp x NR words (columns past ncols are zero).
// The loops over the R rows are unrolled before anything else sees them (the pragmas): left to
// the vectoriser, GCC's -march=native code for Zen (znver3 tuning) kept the B vectors on the
// stack inside the pair loop, and the kernel ran at three quarters of its speed.
template <class K, int R>
inline void tile(int kp, const std::uint32_t* a, const std::uint32_t* b, float* C, int ldc, int ncols, float alpha,
                 float beta) {
    typename K::F acc0[R], acc1[R];
    // the tile's rows of C, for writing: they are read (beta != 0) and written only after the
    // pair loop, and a large C (an input projection's, a weight gradient's) is out of cache;
    // fetched now, the misses overlap the products (input projection 1536 x 1536 x 512: +2%)
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
        __builtin_prefetch(C + (std::size_t)i * ldc, 1, 3);
        if (ncols > 16) __builtin_prefetch(C + (std::size_t)i * ldc + 16, 1, 3);
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = K::zero();
    for (int p = 0; p < kp; ++p) {
        const typename K::P b0 = K::load(b + (std::size_t)p * NR), b1 = K::load(b + (std::size_t)p * NR + 16);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            const typename K::P ai = K::bcast(a[(std::size_t)p * MR + i]);
            acc0[i] = K::dp(acc0[i], ai, b0);
            acc1[i] = K::dp(acc1[i], ai, b1);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
        float* c = C + (std::size_t)i * ldc;
        K::store(c, acc0[i], ncols < 16 ? ncols : 16, alpha, beta);
        if (ncols > 16) K::store(c + 16, acc1[i], ncols - 16, alpha, beta);
    }
}

// Every tile of one (KC block, MC block): Ap holds the block's MR-row panels (panel
// stride pa words, starting at this KC block's pair), Bp the NR-column panels (stride pb).
template <class K>
inline void macro(int kp, int rows, int N, const std::uint32_t* Ap, std::size_t pa, const std::uint32_t* Bp,
                  std::size_t pb, float* C, int ldc, float alpha, float beta) {
    for (int j = 0; j < N; j += NR) {
        const std::uint32_t* b = Bp + (std::size_t)(j / NR) * pb;
        const int nc = N - j < NR ? N - j : NR;
        for (int i = 0; i < rows; i += MR) {
            const std::uint32_t* a = Ap + (std::size_t)(i / MR) * pa;
            float* c = C + (std::size_t)i * ldc + j;
            switch (rows - i < MR ? rows - i : MR) {
                case 1: tile<K, 1>(kp, a, b, c, ldc, nc, alpha, beta); break;
                case 2: tile<K, 2>(kp, a, b, c, ldc, nc, alpha, beta); break;
                case 3: tile<K, 3>(kp, a, b, c, ldc, nc, alpha, beta); break;
                case 4: tile<K, 4>(kp, a, b, c, ldc, nc, alpha, beta); break;
                case 5: tile<K, 5>(kp, a, b, c, ldc, nc, alpha, beta); break;
                case 6: tile<K, 6>(kp, a, b, c, ldc, nc, alpha, beta); break;
                case 7: tile<K, 7>(kp, a, b, c, ldc, nc, alpha, beta); break;
                default: tile<K, MR>(kp, a, b, c, ldc, nc, alpha, beta); break;
            }
        }
    }
}

using MacroFn = void (*)(int, int, int, const std::uint32_t*, std::size_t, const std::uint32_t*, std::size_t, float*,
                         int, float, float);

inline void macro_portable(int kp, int rows, int N, const std::uint32_t* Ap, std::size_t pa, const std::uint32_t* Bp,
                           std::size_t pb, float* C, int ldc, float alpha, float beta) {
    macro<Portable>(kp, rows, N, Ap, pa, Bp, pb, C, ldc, alpha, beta);
}

#ifdef RNN_BF16_X86
// flatten: the primitives (target functions) inline into this one target function
RNN_BF16_TARGET __attribute__((flatten)) inline void macro_avx512(int kp, int rows, int N, const std::uint32_t* Ap,
                                                                  std::size_t pa, const std::uint32_t* Bp,
                                                                  std::size_t pb, float* C, int ldc, float alpha,
                                                                  float beta) {
    macro<Avx512>(kp, rows, N, Ap, pa, Bp, pb, C, ldc, alpha, beta);
}
#endif

// ---- packing ----------------------------------------------------------------------------

inline std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

// op(A) (M x K; ta: A stored K x M) into ceil(M / MR) panels of kp x MR words: word
// [panel][p][i] = pair(op(A)[panel*MR + i][2p], [2p + 1]); rows past M and the partner of
// an odd K's last element are zero.
inline void pack_a(bool ta, int M, int K, const float* A, int lda, std::uint32_t* out) {
    const int kp = (K + 1) / 2;
    for (int i0 = 0; i0 < M; i0 += MR) {
        std::uint32_t* panel = out + (std::size_t)(i0 / MR) * kp * MR;
        const int rows = M - i0 < MR ? M - i0 : MR;
        for (int i = 0; i < MR; ++i) {
            if (i >= rows) {
                for (int p = 0; p < kp; ++p) panel[(std::size_t)p * MR + i] = 0;
                continue;
            }
            const int r = i0 + i;
            for (int p = 0; p < kp; ++p) {
                const int k = 2 * p;
                const float e = ta ? A[(std::size_t)k * lda + r] : A[(std::size_t)r * lda + k];
                const float o = k + 1 >= K ? 0.0f : ta ? A[(std::size_t)(k + 1) * lda + r] : A[(std::size_t)r * lda + k + 1];
                panel[(std::size_t)p * MR + i] = pair(e, o);
            }
        }
    }
}

// op(B) (K x N; tb: B stored N x K) into ceil(N / NR) panels of kp x NR words: word
// [panel][p][j] = pair(op(B)[2p][panel*NR + j], [2p + 1][...]); columns past N and the
// partner of an odd K's last row are zero.
inline void pack_b(bool tb, int K, int N, const float* B, int ldb, std::uint32_t* out) {
    const int kp = (K + 1) / 2;
    for (int j0 = 0; j0 < N; j0 += NR) {
        std::uint32_t* panel = out + (std::size_t)(j0 / NR) * kp * NR;
        const int cols = N - j0 < NR ? N - j0 : NR;
        for (int p = 0; p < kp; ++p) {
            const int k = 2 * p;
            std::uint32_t* w = panel + (std::size_t)p * NR;
            if (tb) {
                for (int j = 0; j < cols; ++j) {
                    const float* row = B + (std::size_t)(j0 + j) * ldb;
                    w[j] = pair(row[k], k + 1 < K ? row[k + 1] : 0.0f);
                }
            } else {
                const float* e = B + (std::size_t)k * ldb + j0;
                if (k + 1 < K) {
                    const float* o = e + ldb;
                    for (int j = 0; j < cols; ++j) w[j] = pair(e[j], o[j]);
                } else {
                    for (int j = 0; j < cols; ++j) w[j] = pair(e[j], 0.0f);
                }
            }
            for (int j = cols; j < NR; ++j) w[j] = 0;
        }
    }
}

#ifdef RNN_BF16_X86
// The same packings with AVX-512 (they run with the AVX512-BF16 kernel, on CPUs that have it):
// the same words, bit for bit (round() on 16 lanes: integer operations, not VCVTNEPS2BF16,
// which would read float32 denormals as zero), 16 or 32 elements per step. The scalar
// packing cost a fifth of the big products' time (a weight gradient packs its K x N
// operand once per call: two roundings per 2 M multiply-adds).

// 16 floats -> their bfloat16 bits in the low half of each 32-bit lane, as round() gives them
RNN_BF16_TARGET inline __m512i round16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
    const __m512i nearest = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(nearest, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
}

// pair() on 16 lanes
RNN_BF16_TARGET inline __m512i pairs16(__m512 even, __m512 odd) {
    return _mm512_or_si512(round16(even), _mm512_slli_epi32(round16(odd), 16));
}

RNN_BF16_TARGET inline __mmask16 first(int n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

// Pairs p and p + 1 of eight rows, of np in all, to base + p * stride: lanes [a.L, b.L, c.L,
// d.L] of x = [a.L, a.L, c.L, c.L] and y = [b.L, b.L, d.L, d.L]. A function of its own, not a
// lambda inside rows_pairs8: GCC does not give a lambda its enclosing function's target, so on a
// compiler targeting a CPU without AVX-512 a lambda's intrinsics fail to inline.
RNN_BF16_TARGET inline void put_pairs2(std::uint32_t* base, int stride, int np, int p, __m512i x, __m512i y) {
    if (p >= np) return;
    const __m512i w = _mm512_mask_blend_epi64(0xcc, x, y);
    std::uint32_t* o = base + (std::size_t)p * stride;
    if (stride == 8) {
        _mm512_mask_storeu_epi32(o, p + 1 < np ? (__mmask16)0xffff : (__mmask16)0x00ff, w);
        return;
    }
    _mm256_storeu_si256((__m256i*)o, _mm512_castsi512_si256(w));
    if (p + 1 < np) _mm256_storeu_si256((__m256i*)(o + stride), _mm512_extracti64x4_epi64(w, 1));
}

// Eight rows of K contiguous elements (row i at x + i * ldx; rows from `rows` on read as
// zero) as pairs: out[p * stride + i] = pair(row i [2p], [2p + 1]) (an odd K's last partner
// zero); stride is MR (an A panel) or NR (eight columns of a B panel). Per 32 elements of K:
// each row's 16 pairs in one vector, then an 8 x 16 transpose of 32-bit words in registers,
// written as 2 pairs x 8 rows per store. Word by word (16 stores per row, `stride` apart)
// the packing of A took 5% of the backward's carry (64 x 512 x 1536) and a transposed B as
// long as the product itself.
RNN_BF16_TARGET inline void rows_pairs8(const float* x, int ldx, int rows, int K, std::uint32_t* out, int stride) {
    // 16-bit element i of the result: element 2i of (r0, r1), the bfloat16 of x[k + i]
    alignas(64) static const std::uint16_t even[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20,
                                                       22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
                                                       44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
    const __m512i idx = _mm512_load_si512((const void*)even);
    for (int k = 0; k < K; k += 32) {
        const int n = K - k < 32 ? K - k : 32, np = (n + 1) / 2;
        const __mmask16 m0 = first(n), m1 = first(n - 16);
        __m512i r[8];  // r[i]: row i's 16 pairs
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
            if (i < rows) {
                const float* xi = x + (std::size_t)i * ldx + k;
                r[i] = _mm512_permutex2var_epi16(round16(_mm512_maskz_loadu_ps(m0, xi)), idx,
                                                 round16(_mm512_maskz_loadu_ps(m1, xi + 16)));
            } else {
                r[i] = _mm512_setzero_si512();
            }
        }
        // in 128-bit lane L: u[c] holds pair 4L + c of rows 0-3, v[c] of rows 4-7
        __m512i u[4], v[4];
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            const __m512i* q = r + 4 * h;
            const __m512i t0 = _mm512_unpacklo_epi32(q[0], q[1]), t1 = _mm512_unpackhi_epi32(q[0], q[1]);
            const __m512i t2 = _mm512_unpacklo_epi32(q[2], q[3]), t3 = _mm512_unpackhi_epi32(q[2], q[3]);
            __m512i* o = h == 0 ? u : v;
            o[0] = _mm512_unpacklo_epi64(t0, t2);
            o[1] = _mm512_unpackhi_epi64(t0, t2);
            o[2] = _mm512_unpacklo_epi64(t1, t3);
            o[3] = _mm512_unpackhi_epi64(t1, t3);
        }
        std::uint32_t* base = out + (std::size_t)(k / 2) * stride;
#define RNN_BF16_LANE(L, IMM)                                                                                   \
    put_pairs2(base, stride, np, 4 * (L), _mm512_shuffle_i64x2(u[0], u[1], IMM),                              \
               _mm512_shuffle_i64x2(v[0], v[1], IMM));                                                       \
    put_pairs2(base, stride, np, 4 * (L) + 2, _mm512_shuffle_i64x2(u[2], u[3], IMM),                          \
               _mm512_shuffle_i64x2(v[2], v[3], IMM));
        RNN_BF16_LANE(0, 0x00)
        RNN_BF16_LANE(1, 0x55)
        RNN_BF16_LANE(2, 0xaa)
        RNN_BF16_LANE(3, 0xff)
#undef RNN_BF16_LANE
    }
}

RNN_BF16_TARGET __attribute__((flatten)) inline void pack_a_avx512(bool ta, int M, int K, const float* A, int lda,
                                                                   std::uint32_t* out) {
    const int kp = (K + 1) / 2;
    if (ta) {  // A is K x M: two panels' 16 rows are 16 contiguous columns of A, paired in one vector
        // (a whole cache line of each row of A per pass, not half of it twice)
        for (int i0 = 0; i0 < M; i0 += 2 * MR) {
            std::uint32_t* lo = out + (std::size_t)(i0 / MR) * kp * MR;
            std::uint32_t* hi = lo + (std::size_t)kp * MR;  // the second panel, where M has one
            const int rows = M - i0 < 2 * MR ? M - i0 : 2 * MR;
            const __mmask16 m = first(rows);
            for (int p = 0; p < kp; ++p) {
                const float* e = A + (std::size_t)(2 * p) * lda + i0;
                const __m512 o = 2 * p + 1 < K ? _mm512_maskz_loadu_ps(m, e + lda) : _mm512_setzero_ps();
                const __m512i w = pairs16(_mm512_maskz_loadu_ps(m, e), o);
                _mm256_storeu_si256((__m256i*)(lo + (std::size_t)p * MR), _mm512_castsi512_si256(w));
                if (rows > MR) _mm256_storeu_si256((__m256i*)(hi + (std::size_t)p * MR), _mm512_extracti64x4_epi64(w, 1));
            }
        }
        return;
    }
    for (int i0 = 0; i0 < M; i0 += MR) {
        const int rows = M - i0 < MR ? M - i0 : MR;
        rows_pairs8(A + (std::size_t)i0 * lda, lda, rows, K, out + (std::size_t)(i0 / MR) * kp * MR, MR);
    }
}

RNN_BF16_TARGET __attribute__((flatten)) inline void pack_b_avx512(bool tb, int K, int N, const float* B, int ldb,
                                                                   std::uint32_t* out) {
    const int kp = (K + 1) / 2;
    const std::size_t pb = (std::size_t)kp * NR;  // words per panel
    if (tb) {  // B is N x K: each column of a panel is a row of B
        for (int j0 = 0; j0 < N; j0 += NR) {
            std::uint32_t* panel = out + (std::size_t)(j0 / NR) * pb;
            const int cols = N - j0 < NR ? N - j0 : NR;
            for (int j = 0; j < NR; j += 8)
                rows_pairs8(B + (std::size_t)(j0 + j) * ldb, ldb, cols - j < 0 ? 0 : cols - j, K, panel + j, NR);
        }
        return;
    }
    // B is K x N: two rows of B at a time, read once from end to end into every panel's words
    // for that pair (row by row, not panel by panel: a tall B is then read in order, not as
    // N / NR strided passes over all of it)
    for (int p = 0; p < kp; ++p) {
        const float* e = B + (std::size_t)(2 * p) * ldb;
        const bool odd = 2 * p + 1 < K;
        for (int j0 = 0; j0 < N; j0 += NR) {
            const int cols = N - j0 < NR ? N - j0 : NR;
            const __mmask16 m0 = first(cols), m1 = first(cols - 16);  // columns past N are zero
            std::uint32_t* w = out + (std::size_t)(j0 / NR) * pb + (std::size_t)p * NR;
            const __m512 o0 = odd ? _mm512_maskz_loadu_ps(m0, e + ldb + j0) : _mm512_setzero_ps();
            const __m512 o1 = odd ? _mm512_maskz_loadu_ps(m1, e + ldb + j0 + 16) : _mm512_setzero_ps();
            _mm512_storeu_si512((void*)w, pairs16(_mm512_maskz_loadu_ps(m0, e + j0), o0));
            _mm512_storeu_si512((void*)(w + 16), pairs16(_mm512_maskz_loadu_ps(m1, e + j0 + 16), o1));
        }
    }
}
#endif

// This thread's scratch for op(A) packed, by whichever kernel runs the product (the pair
// kernel's panels or gemm_amx.hpp's tiles): one product at a time per thread.
inline std::vector<std::uint32_t>& packed_a_scratch() {
    thread_local std::vector<std::uint32_t> a;
    return a;
}

// ---- the CPU's instruction ---------------------------------------------------------------

// Whether this CPU (and the OS, which must save the AVX-512 state) has VDPBF16PS.
inline bool cpu_has_avx512bf16() {
#if defined(RNN_BF16_X86) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
#else
    return false;
#endif
}

// op(A) into MR-row panels, op(B) into NR-column panels (pack_a / pack_b above)
using PackAFn = void (*)(bool, int, int, const float*, int, std::uint32_t*);
using PackBFn = void (*)(bool, int, int, const float*, int, std::uint32_t*);

}  // namespace bf16
}  // namespace rnn

#pragma GCC diagnostic pop
