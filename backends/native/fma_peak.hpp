// The core's own multiply-add peak, measured by a tight kernel: 16 independent chains of
// the widest fused multiply-add this CPU has (VFMADD231PS on 16 or 8 float32 lanes;
// VDPBF16PS for bfloat16, which does two multiply-adds per float32 lane), in registers,
// no memory traffic, on each of `threads` OpenMP threads at once. Sixteen chains cover
// an FMA latency of 4 cycles at two issues per cycle (Zen 5, Intel server cores), so the
// rate is the hardware's issue rate times the clock it holds: the roof no product can pass.
// For bfloat16 on a CPU with AMX the unit is the tile multiplier: four TDPBF16PS on four
// accumulator tiles from tiles loaded once (gemm_amx.hpp, peak_loop).
#pragma once

#include <omp.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "bf16.hpp"
#include "gemm_f32.hpp"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace rnn {
namespace peak {

constexpr int kChains = 16;

#ifdef RNN_F32_X86
// Each returns a value that depends on every chain (so that nothing is optimised away).
RNN_F32_AVX512 __attribute__((noinline)) inline float fma_avx512(std::int64_t iters) {
    __m512 acc[kChains];
    const __m512 m = _mm512_set1_ps(0.999999f), a = _mm512_set1_ps(1e-6f);
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps((float)j);
    for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
        for (int j = 0; j < kChains; ++j) acc[j] = _mm512_fmadd_ps(acc[j], m, a);
    }
    __m512 s = acc[0];
    for (int j = 1; j < kChains; ++j) s = _mm512_add_ps(s, acc[j]);
    return _mm512_reduce_add_ps(s);
}

RNN_F32_AVX2 __attribute__((noinline)) inline float fma_avx2(std::int64_t iters) {
    __m256 acc[12];  // 16 registers: 12 chains and the two operands
    const __m256 m = _mm256_set1_ps(0.999999f), a = _mm256_set1_ps(1e-6f);
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_set1_ps((float)j);
    for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; ++j) acc[j] = _mm256_fmadd_ps(acc[j], m, a);
    }
    __m256 s = acc[0];
    for (int j = 1; j < 12; ++j) s = _mm256_add_ps(s, acc[j]);
    alignas(32) float t[8];
    _mm256_store_ps(t, s);
    return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}

RNN_BF16_TARGET __attribute__((noinline)) inline float dp_avx512bf16(std::int64_t iters) {
    __m512 acc[kChains];
    const __m512i a = _mm512_set1_epi32((int)bf16::pair(1e-3f, 1e-3f)), b = _mm512_set1_epi32((int)bf16::pair(1e-3f, -1e-3f));
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps((float)j);
    for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
        for (int j = 0; j < kChains; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)a, (__m512bh)b);
    }
    __m512 s = acc[0];
    for (int j = 1; j < kChains; ++j) s = _mm512_add_ps(s, acc[j]);
    return _mm512_reduce_add_ps(s);
}
#endif

// The kernel a precision's peak is measured with on this CPU ("" where there is none), and
// the floating-point operations one of its iterations does. bfloat16's is the best unit this
// process can run (`unit` "auto"): AMX's TDPBF16PS where the tiles are granted, else
// VDPBF16PS; `unit` "avx512bf16" or "amx" asks for one of them.
inline std::string kernel(const std::string& precision, double* flops_per_iter = nullptr,
                          const std::string& unit = "auto") {
    double f = 0;
    std::string k;
    if (precision == "float32") {
        if (f32::cpu_has("avx512")) k = "avx512 vfmadd231ps", f = 2.0 * 16 * kChains;
        else if (f32::cpu_has("avx2")) k = "avx2 vfmadd231ps", f = 2.0 * 8 * 12;
    } else if (precision == "bfloat16") {
        if (unit != "avx512bf16" && amx::available()) k = "amx tdpbf16ps", f = amx::kPeakFlopsPerIter;
        else if (unit != "amx" && bf16::cpu_has_avx512bf16()) k = "avx512bf16 vdpbf16ps", f = 4.0 * 16 * kChains;
    }
    if (flops_per_iter) *flops_per_iter = f;
    return k;
}

// GFLOP/s of `iters` iterations of the precision's kernel on each of `threads` threads at once
// (their flops summed over the wall time of the slowest); 0 where this CPU has no such kernel.
inline double rate(const std::string& precision, std::int64_t iters, int threads, const std::string& unit = "auto") {
    double per = 0;
    const std::string k = kernel(precision, &per, unit);
    if (k.empty()) return 0.0;
    volatile float sink = 0;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads > 1 ? threads : 1)
    {
        float v = 0;
#ifdef RNN_F32_X86
        if (k.rfind("avx512 ", 0) == 0) v = fma_avx512(iters);
        else if (k.rfind("avx2 ", 0) == 0) v = fma_avx2(iters);
        else if (k.rfind("amx ", 0) == 0) v = amx::peak_loop(iters);
        else v = dp_avx512bf16(iters);
#endif
#pragma omp critical(rnn_peak_sink)
        sink = sink + v;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int n = 1;
#pragma omp parallel num_threads(threads > 1 ? threads : 1)
#pragma omp single
    n = omp_get_num_threads();
    (void)sink;
    return per * (double)iters * n / s / 1e9;
}

}  // namespace peak
}  // namespace rnn

#pragma GCC diagnostic pop
