// The bfloat16 product the engine calls (SPEC.md "Reduced precision"): which kernel runs
// it, the packed W_hh kept across a recurrence, and the GEMM itself.
//
// Kernels, all computing gemm_bf16.hpp's product (both operands rounded to bfloat16 while
// packed, float32 sums):
//   "amx"        AMX tiles, TDPBF16PS (gemm_amx.hpp), where the CPU has AMX-BF16 and Linux
//                grants this process the tile data: Intel's server cores from Sapphire Rapids on,
//                whose VDPBF16PS runs at half their float32 FMA rate;
//   "avx512bf16" VDPBF16PS on 16 lanes (gemm_bf16.hpp): AMD Zen 4 and 5, where it doubles
//                the float32 rate;
//   "portable"   the VDPBF16PS emulated in C++: any CPU, for tests (no speed claim).
// "auto" picks the first of them this process can run. Measured on an Intel Xeon (family 6
// model 207, one core), AMX against VDPBF16PS on the engine's products, B packed each call:
// 6.0-7.1x on projections and weight gradients (512 x 2048 x 3200: 651 against 92 GFLOP/s),
// 2.9-3.0x on a batch-64 recurrent product (64 x 2048 x 512), 2.1x at 16 rows and 1.2x
// at one row, where a tile of A is 16 rows of which one is used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gemm_amx.hpp"
#include "gemm_bf16.hpp"
#include "packs.hpp"

namespace rnn {
namespace bf16 {

// Fewer rows than this go to the pair kernel on an AMX CPU as well: a tile multiplies 16 rows
// of A, so one or two rows use a sixteenth or an eighth of it. Measured on an Intel Xeon (family
// 6 model 207), per-step products of a recurrence (W_hh kept packed), one thread: AMX over
// VDPBF16PS 1.1-1.7x at one row, 1.3-2.0x at two, 1.8-3.4x at four, 2.9-5.1x at eight; but the
// whole LSTM H 256 batch-1 train step on two threads (each thread four gate blocks of 128
// columns a step) ran 0.89x with AMX. With the one- to three-row products on the pair kernel
// (and the projections and weight gradients on AMX) the LSTM's step, against VDPBF16PS alone,
// is 1.27x at batch 1 and 1.49x at batch 2 on one thread, 1.07x and 1.24x on two (one row or
// two on AMX: 1.05x and 1.75x on one thread, 0.89x and 1.14x on two).
constexpr int kAmxMinRows = 4;

// The pair kernels' micro-kernel and packings, or (amx) the tile kernel for the whole product
// of kAmxMinRows rows or more.
struct Dispatch {
    MacroFn fn = macro_portable;
    const char* name = "portable";
    PackAFn pack_a = rnn::bf16::pack_a;
    PackBFn pack_b = rnn::bf16::pack_b;
    bool amx = false;
};

inline Dispatch portable_dispatch() { return {macro_portable, "portable", pack_a, pack_b, false}; }

#ifdef RNN_BF16_X86
inline Dispatch avx512_dispatch() { return {macro_avx512, "avx512bf16", pack_a_avx512, pack_b_avx512, false}; }
inline Dispatch amx_dispatch() { return {macro_avx512, "amx", pack_a_avx512, pack_b_avx512, true}; }
#endif

inline Dispatch auto_dispatch() {
#ifdef RNN_BF16_X86
    if (amx::available() && cpu_has_avx512bf16()) return amx_dispatch();
    if (cpu_has_avx512bf16()) return avx512_dispatch();
#endif
    return portable_dispatch();
}

inline Dispatch& dispatch() {
    static Dispatch d = auto_dispatch();
    return d;
}

inline const char* kernel_name() { return dispatch().name; }

// "auto" (above), "amx", "avx512bf16" or "portable"; false (nothing changed) for a kernel
// this process cannot run or an unknown name. Set it outside parallel regions: every thread
// reads it.
inline bool set_kernel(const std::string& name) {
    if (name == "auto") {
        dispatch() = auto_dispatch();
        return true;
    }
    if (name == "portable") {
        dispatch() = portable_dispatch();
        return true;
    }
#ifdef RNN_BF16_X86
    if (name == "avx512bf16" && cpu_has_avx512bf16()) {
        dispatch() = avx512_dispatch();
        return true;
    }
    if (name == "amx" && amx::available() && cpu_has_avx512bf16()) {
        dispatch() = amx_dispatch();
        return true;
    }
#endif
    return false;
}

inline std::size_t packed_a_words(int M, int K) { return round_up((std::size_t)M, MR) * (std::size_t)((K + 1) / 2); }
inline std::size_t packed_b_words(int K, int N) { return round_up((std::size_t)N, NR) * (std::size_t)((K + 1) / 2); }

// Packed B operands reused across a recurrence (packs.hpp): W_hh is rounded and packed once
// per pass, not once per step.
using ReuseScope = rnn::ReuseScope<std::uint32_t>;

inline const std::uint32_t* packed_b(bool tb, int K, int N, const float* B, int ldb) {
    return thread_packs<std::uint32_t>().get(tb, K, N, B, ldb, NR, packed_b_words(K, N),
                                             [&](std::uint32_t* out) { dispatch().pack_b(tb, K, N, B, ldb, out); });
}

// ---- the GEMM ----------------------------------------------------------------------------

// C (M x N, row stride ldc) = alpha * bf16(op(A)) bf16(op(B)) + beta * C in float32; op as
// in gemm<T>: ta means A is stored K x M (lda its row stride), tb that B is N x K.
inline void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                 float beta, float* C, int ldc) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {  // the product is empty: C = beta * C
        for (int i = 0; i < M; ++i)
            for (int j = 0; j < N; ++j) C[(std::size_t)i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[(std::size_t)i * ldc + j];
        return;
    }
    const Dispatch& d = dispatch();
    if (d.amx && M >= kAmxMinRows) {
        amx::gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    const MacroFn fn = d.fn;
    const int kp = (K + 1) / 2;
    const std::uint32_t* Bp = packed_b(tb, K, N, B, ldb);
    std::vector<std::uint32_t>& a = packed_a_scratch();
    const std::size_t awords = packed_a_words(M, K);
    if (a.size() < awords) a.resize(awords);
    d.pack_a(ta, M, K, A, lda, a.data());
    const std::size_t pa = (std::size_t)kp * MR, pb = (std::size_t)kp * NR;
    for (int p0 = 0; p0 < kp; p0 += KC) {
        const int kc = kp - p0 < KC ? kp - p0 : KC;
        const float b = p0 == 0 ? beta : 1.0f;
        for (int i0 = 0; i0 < M; i0 += MC) {
            const int rows = M - i0 < MC ? M - i0 : MC;
            fn(kc, rows, N, a.data() + (std::size_t)(i0 / MR) * pa + (std::size_t)p0 * MR, pa,
               Bp + (std::size_t)p0 * NR, pb, C + (std::size_t)i0 * ldc, ldc, alpha, b);
        }
    }
}

}  // namespace bf16
}  // namespace rnn
