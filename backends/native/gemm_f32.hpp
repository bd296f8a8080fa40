// The engine's own float32 product for the per-step recurrent products:
//
//     C (M x N) = alpha * A op(B) + beta * C,   A: M x K row-major (few rows), op(B): K x N
//
// with op(B) packed once per pass into NR-column panels and reused by every step. The
// per-step products of a recurrence are few-row products (the batch, 1-64 rows) against
// the same W_hh (forward) or W_hh^T (the backward's carry) at every step; a library GEMM
// packs that operand again at every call, for little reuse (16 rows: each packed element
// is used 16 times), and at W_hh sizes past L2 the repacking costs as much as the
// product. Here W_hh is rounded to nothing, only laid out: panel p holds columns
// [p*NR, p*NR + NR) of op(B), row after row ([panel][k][NR] floats, zero past N), so a
// product streams it in one contiguous pass.
//
// Kernels. The micro-kernel is written once against a handful of primitives (load,
// broadcast, fused multiply-add, masked store) and instantiated for AVX-512 (NR = 32: two
// 16-lane vectors, tiles of up to MR = 8 rows: 16 accumulators) and for AVX2 + FMA (NR = 16,
// MR = 6: 12 accumulators), each compiled under a target attribute, not -march, so the
// module builds for any x86-64 CPU. Which one runs is decided at run time from CPUID
// (__builtin_cpu_supports), not from any library's CPU table or OPENBLAS_CORETYPE;
// set_kernel() forces one, or "blas" (none: every product goes to the BLAS) for tests and
// measurements. A tile of R rows holds 2R accumulator chains; where that is fewer than
// eight (R = 1..3) the sum over K is also split S ways (even and odd k, ...) so that the
// FMA latency (4 cycles) does not bound a few-row product, and the S partial sums are
// added at the end.
//
// Blocking: for each column panel, KC rows of it at a time (16 KiB: KC = 128 at NR = 32,
// 256 at NR = 16; in L1), every row tile of A against that block, so the panel streams from
// memory once whatever M is; the M x NR block of C stays in L1 across the KC blocks (written
// with alpha * sum + beta * C by the first, added to by the others). On AVX2 the first row
// tile of a block also prefetches the next block (one cache line per k, the panel's next
// KC rows or the next panel's first) while it computes, so that W_hh's stream from L3 or
// memory overlaps the products instead of stalling the next block's first tile. Measured on
// an AMD EPYC Zen 3 (family 25 model 1, AVX2 only), the micro-kernels alone in alternating
// rounds: 1.02-1.26x the previous blocking (KC 128, no prefetch) at 16-64 rows against
// 256-4096-wide weights, most where W_hh is past L2 (16 x 1760 x 1760: 1.17-1.22x).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "packs.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RNN_F32_X86 1
#endif

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace rnn {
namespace f32 {

// ---- the primitives ---------------------------------------------------------------------

#ifdef RNN_F32_X86
#define RNN_F32_AVX512 __attribute__((target("avx512f")))
#define RNN_F32_AVX2 __attribute__((target("avx2,fma")))

struct Avx512 {
    using F = __m512;
    static constexpr int W = 16, MR = 8;
    static constexpr int KC = 128;  // rows of a packed panel per block: 16 KiB
    static constexpr bool kPrefetchNext = false;  // the next block's prefetch is measured on AVX2 only
    RNN_F32_AVX512 static inline F zero() { return _mm512_setzero_ps(); }
    RNN_F32_AVX512 static inline F load(const float* p) { return _mm512_loadu_ps(p); }
    RNN_F32_AVX512 static inline F bcast(const float* p) { return _mm512_set1_ps(*p); }
    RNN_F32_AVX512 static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    RNN_F32_AVX512 static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
    // c[0:n] = alpha * acc + beta * c (beta == 0: c is not read), n <= 16
    RNN_F32_AVX512 static inline void store(float* c, F acc, int n, float alpha, float beta) {
        const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
        if (beta == 0.0f) {
            _mm512_mask_storeu_ps(c, m, _mm512_mul_ps(_mm512_set1_ps(alpha), acc));
        } else {
            const F old = _mm512_mul_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(m, c));
            _mm512_mask_storeu_ps(c, m, _mm512_fmadd_ps(_mm512_set1_ps(alpha), acc, old));
        }
    }
};

struct Avx2 {
    using F = __m256;
    static constexpr int W = 8, MR = 6;
    static constexpr int KC = 256;  // rows of a packed panel per block: 16 KiB
    static constexpr bool kPrefetchNext = true;  // the first row tile fetches the next block (above)
    RNN_F32_AVX2 static inline F zero() { return _mm256_setzero_ps(); }
    RNN_F32_AVX2 static inline F load(const float* p) { return _mm256_loadu_ps(p); }
    RNN_F32_AVX2 static inline F bcast(const float* p) { return _mm256_broadcast_ss(p); }
    RNN_F32_AVX2 static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    RNN_F32_AVX2 static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
    RNN_F32_AVX2 static inline void store(float* c, F acc, int n, float alpha, float beta) {
        const F r = _mm256_mul_ps(_mm256_set1_ps(alpha), acc);
        if (n >= 8) {
            _mm256_storeu_ps(c, beta == 0.0f ? r : _mm256_fmadd_ps(_mm256_set1_ps(beta), _mm256_loadu_ps(c), r));
            return;
        }
        alignas(32) float t[8];
        _mm256_store_ps(t, r);
        for (int j = 0; j < n; ++j) c[j] = beta == 0.0f ? t[j] : t[j] + beta * c[j];
    }
};
#endif

// ---- the micro- and macro-kernel, once for both ----------------------------------------

// C[0:R, 0:ncols] = alpha * A[0:R, 0:kc] b + beta * C, `b` the kc x NR block of a packed
// panel (columns past ncols zero), A's rows lda apart. S: ways the sum over k is split.
// `next` (or null): a block of at least kc rows to prefetch into L1, one row of it per k.
template <class K, int R, int S>
inline void tile(int kc, const float* A, int lda, const float* b, float* C, int ldc, int ncols, float alpha,
                 float beta, const float* next) {
    constexpr int NR = 2 * K::W;
    typename K::F acc[S][R][2];
#pragma GCC unroll 64
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) acc[s][i][0] = acc[s][i][1] = K::zero();
    int k = 0;
    for (; k + S <= kc; k += S) {
#pragma GCC unroll 8
        for (int s = 0; s < S; ++s) {
            if (next) {
#pragma GCC unroll 2
                for (int l = 0; l < NR; l += 16) __builtin_prefetch(next + (std::size_t)(k + s) * NR + l, 0, 3);
            }
            const typename K::F b0 = K::load(b + (std::size_t)(k + s) * NR), b1 = K::load(b + (std::size_t)(k + s) * NR + K::W);
#pragma GCC unroll 16
            for (int i = 0; i < R; ++i) {
                const typename K::F a = K::bcast(A + (std::size_t)i * lda + k + s);
                acc[s][i][0] = K::fma(a, b0, acc[s][i][0]);
                acc[s][i][1] = K::fma(a, b1, acc[s][i][1]);
            }
        }
    }
    for (; k < kc; ++k) {
        const typename K::F b0 = K::load(b + (std::size_t)k * NR), b1 = K::load(b + (std::size_t)k * NR + K::W);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            const typename K::F a = K::bcast(A + (std::size_t)i * lda + k);
            acc[0][i][0] = K::fma(a, b0, acc[0][i][0]);
            acc[0][i][1] = K::fma(a, b1, acc[0][i][1]);
        }
    }
#pragma GCC unroll 8
    for (int s = 1; s < S; ++s)
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            acc[0][i][0] = K::add(acc[0][i][0], acc[s][i][0]);
            acc[0][i][1] = K::add(acc[0][i][1], acc[s][i][1]);
        }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
        float* c = C + (std::size_t)i * ldc;
        K::store(c, acc[0][i][0], ncols < K::W ? ncols : K::W, alpha, beta);
        if (ncols > K::W) K::store(c + K::W, acc[0][i][1], ncols - K::W, alpha, beta);
    }
}

// ways to split the sum over k so that a tile of R rows keeps eight or more FMA chains
constexpr int splits(int R) { return R == 1 ? 4 : R <= 3 ? 2 : 1; }

template <class K, int R>
inline void tile_r(int kc, const float* A, int lda, const float* b, float* C, int ldc, int ncols, float alpha,
                   float beta, const float* next) {
    tile<K, R, splits(R)>(kc, A, lda, b, C, ldc, ncols, alpha, beta, next);
}

// All of C (M x N) from A (M x K) and op(B) packed (Bp: ceil(N / NR) panels of K x NR).
template <class K>
inline void macro(int M, int N, int Kd, float alpha, const float* A, int lda, const float* Bp, float beta, float* C,
                  int ldc) {
    constexpr int NR = 2 * K::W, MR = K::MR, KC = K::KC;
    for (int j = 0; j < N; j += NR) {
        const float* panel = Bp + (std::size_t)(j / NR) * Kd * NR;
        const int nc = N - j < NR ? N - j : NR;
        for (int k0 = 0; k0 < Kd; k0 += KC) {
            const int kc = Kd - k0 < KC ? Kd - k0 : KC;
            const float bt = k0 == 0 ? beta : 1.0f;
            const float* b = panel + (std::size_t)k0 * NR;
            // the block after this one: the panel's next KC rows, or the next panel's first (none after
            // the last); prefetched only when it has as many rows as this one, so no row past it is read
            // (the next panel's first block always has: min(Kd, KC) rows, at least this last one's kc)
            const float* next = nullptr;
            if (K::kPrefetchNext) {
                if (k0 + KC < Kd) {
                    if (Kd - k0 - KC >= kc) next = b + (std::size_t)KC * NR;
                } else if (j + NR < N) {
                    next = panel + (std::size_t)Kd * NR;
                }
            }
            for (int i = 0; i < M; i += MR) {
                const float* pf = i == 0 ? next : nullptr;
                const float* a = A + (std::size_t)i * lda + k0;
                float* c = C + (std::size_t)i * ldc + j;
                switch (M - i < MR ? M - i : MR) {
                    case 1: tile_r<K, 1>(kc, a, lda, b, c, ldc, nc, alpha, bt, pf); break;
                    case 2: tile_r<K, 2>(kc, a, lda, b, c, ldc, nc, alpha, bt, pf); break;
                    case 3: tile_r<K, 3>(kc, a, lda, b, c, ldc, nc, alpha, bt, pf); break;
                    case 4: tile_r<K, 4>(kc, a, lda, b, c, ldc, nc, alpha, bt, pf); break;
                    case 5: tile_r<K, 5>(kc, a, lda, b, c, ldc, nc, alpha, bt, pf); break;
                    case 6: tile_r<K, 6>(kc, a, lda, b, c, ldc, nc, alpha, bt, pf); break;
                    case 7: if constexpr (MR >= 7) tile_r<K, 7>(kc, a, lda, b, c, ldc, nc, alpha, bt, pf); break;
                    default: if constexpr (MR >= 8) tile_r<K, 8>(kc, a, lda, b, c, ldc, nc, alpha, bt, pf); break;
                }
            }
        }
    }
}

using MacroFn = void (*)(int, int, int, float, const float*, int, const float*, float, float*, int);

#ifdef RNN_F32_X86
RNN_F32_AVX512 __attribute__((flatten)) inline void macro_avx512(int M, int N, int K, float alpha, const float* A,
                                                                 int lda, const float* Bp, float beta, float* C,
                                                                 int ldc) {
    macro<Avx512>(M, N, K, alpha, A, lda, Bp, beta, C, ldc);
}
RNN_F32_AVX2 __attribute__((flatten)) inline void macro_avx2(int M, int N, int K, float alpha, const float* A, int lda,
                                                             const float* Bp, float beta, float* C, int ldc) {
    macro<Avx2>(M, N, K, alpha, A, lda, Bp, beta, C, ldc);
}
#endif

// ---- packing ----------------------------------------------------------------------------

// op(B) (K x N; tb: B stored N x K) into ceil(N / nr) panels of K x nr floats, columns past N zero.
inline void pack_b(bool tb, int K, int N, const float* B, int ldb, int nr, float* out) {
    for (int j0 = 0; j0 < N; j0 += nr) {
        float* panel = out + (std::size_t)(j0 / nr) * K * nr;
        const int cols = N - j0 < nr ? N - j0 : nr;
        if (!tb) {
            for (int k = 0; k < K; ++k) {
                float* w = panel + (std::size_t)k * nr;
                std::memcpy(w, B + (std::size_t)k * ldb + j0, sizeof(float) * cols);
                for (int j = cols; j < nr; ++j) w[j] = 0.0f;
            }
            continue;
        }
        // B is N x K: column j of the panel is row j0 + j of B; 64 k at a time, so that the
        // panel rows being written (64 x nr floats) stay in L1 while each row of B is read in order
        constexpr int KB = 64;
        for (int k0 = 0; k0 < K; k0 += KB) {
            const int k1 = K - k0 < KB ? K : k0 + KB;
            for (int j = 0; j < nr; ++j) {
                if (j < cols) {
                    const float* row = B + (std::size_t)(j0 + j) * ldb;
                    for (int k = k0; k < k1; ++k) panel[(std::size_t)k * nr + j] = row[k];
                } else {
                    for (int k = k0; k < k1; ++k) panel[(std::size_t)k * nr + j] = 0.0f;
                }
            }
        }
    }
}

// ---- which kernel runs ------------------------------------------------------------------

inline bool cpu_has(const char* what) {
#if defined(RNN_F32_X86) && defined(__GNUC__)
    __builtin_cpu_init();
    if (std::string(what) == "avx512") return __builtin_cpu_supports("avx512f");
    if (std::string(what) == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    (void)what;
    return false;
}

struct Dispatch {
    MacroFn fn = nullptr;  // none: the BLAS
    const char* name = "blas";
    int nr = 0;
};

inline Dispatch kernel_for(const std::string& name) {
#ifdef RNN_F32_X86
    if (name == "avx512" && cpu_has("avx512")) return {macro_avx512, "avx512", 2 * Avx512::W};
    if (name == "avx2" && cpu_has("avx2")) return {macro_avx2, "avx2", 2 * Avx2::W};
#endif
    (void)name;
    return {};
}

inline Dispatch auto_dispatch() {
    if (cpu_has("avx512")) return kernel_for("avx512");
    if (cpu_has("avx2")) return kernel_for("avx2");
    return {};
}

inline Dispatch& dispatch() {
    static Dispatch d = auto_dispatch();
    return d;
}

inline const char* kernel_name() { return dispatch().name; }
inline bool active() { return dispatch().fn != nullptr; }

// "auto" (AVX-512 where the CPU has it, else AVX2 + FMA, else the BLAS), "avx512", "avx2"
// or "blas"; false (nothing changed) for a kernel this CPU cannot run or an unknown name.
// Set it outside parallel regions: every thread reads it.
inline bool set_kernel(const std::string& name) {
    if (name == "auto") {
        dispatch() = auto_dispatch();
        return true;
    }
    if (name == "blas") {
        dispatch() = Dispatch{};
        return true;
    }
    const Dispatch d = kernel_for(name);
    if (!d.fn) return false;
    dispatch() = d;
    return true;
}

// ---- packed operands reused across a recurrence (packs.hpp) -----------------------------

using ReuseScope = rnn::ReuseScope<float>;

// Whether a product on this thread would find its packed operand kept (a ReuseScope is open).
inline bool reusing() { return thread_packs<float>().scopes > 0; }

inline const float* packed_b(bool tb, int K, int N, const float* B, int ldb, int nr) {
    const std::size_t words = (std::size_t)(N + nr - 1) / nr * nr * (std::size_t)K;
    return thread_packs<float>().get(tb, K, N, B, ldb, nr, words,
                                     [&](float* out) { pack_b(tb, K, N, B, ldb, nr, out); });
}

// C (M x N, row stride ldc) = alpha * A op(B) + beta * C, A (M x K) row-major with row
// stride lda; tb: B stored N x K. Needs an active kernel (active()).
inline void gemm(bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                 float beta, float* C, int ldc) {
    if (M <= 0 || N <= 0) return;
    const Dispatch& d = dispatch();
    if (K <= 0) {
        for (int i = 0; i < M; ++i)
            for (int j = 0; j < N; ++j) C[(std::size_t)i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[(std::size_t)i * ldc + j];
        return;
    }
    d.fn(M, N, K, alpha, A, lda, packed_b(tb, K, N, B, ldb, d.nr), beta, C, ldc);
}

}  // namespace f32
}  // namespace rnn

#pragma GCC diagnostic pop
