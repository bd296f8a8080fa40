// Branch-free exp, tanh and sigmoid that GCC vectorises inside `omp simd` loops.
//
// libm's tanh/exp only vectorise under -ffast-math (through glibc's libmvec), and
// -ffast-math in a shared library is unsafe: GCC 12 links crtfastmath.o, which turns
// on flush-to-zero for the whole Python process. These are written so that every
// lane computes both branches and selects, which the vectoriser turns into blends.
// Accuracy: float within ~2 ulp, double within ~4 ulp (float64 conformance needs
// 1e-9 relative, so a float-grade approximation would not do for double).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// Every function here is forced inline: a call GCC leaves out of line inside an `omp simd`
// loop makes the loop scalar. GCC's own inlining heuristics dropped vexp out of line once
// rnn.hpp grew (the GRU and bidirectional layers), which doubled the Elman forward
// recurrence's time (the tanh of every unit, one scalar call each).
#define RNN_INLINE inline __attribute__((always_inline))

namespace rnn {

template <class T>
struct ExpConst;

template <>
struct ExpConst<float> {
    using U = std::uint32_t;
    static constexpr int kMantissa = 23;
    // 1.5 * 2^23 + bias: adding it rounds x*log2(e) to an integer held in the low bits,
    // already offset by the exponent bias, so a shift gives the bits of 2^n.
    static constexpr float kShifter = 12582912.0f + 127.0f;
    static constexpr float kLo = -87.0f, kHi = 88.0f;
    static constexpr float kLog2e = 1.44269504088896341f;
    static constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
};

template <>
struct ExpConst<double> {
    using U = std::uint64_t;
    static constexpr int kMantissa = 52;
    static constexpr double kShifter = 6755399441055744.0 + 1023.0;
    static constexpr double kLo = -708.0, kHi = 709.0;
    static constexpr double kLog2e = 1.4426950408889634074;
    static constexpr double kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;
};

template <class To, class From>
RNN_INLINE To bits_as(From v) {
    To out;
    std::memcpy(&out, &v, sizeof(To));
    return out;
}

// e^r on |r| <= ln(2)/2: Taylor to degree 7 (float, error < 3e-9) or 13 (double, < 5e-18).
RNN_INLINE float exp_poly(float r) {
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    return p * r + 1.0f;
}

RNN_INLINE double exp_poly(double r) {
    double p = 1.0 / 6227020800.0;
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    return p * r + 1.0;
}

// exp(x), with x clamped to the range where the result is a normal number.
template <class T>
RNN_INLINE T vexp(T x) {
    using C = ExpConst<T>;
    using U = typename C::U;
    x = x < C::kLo ? C::kLo : x;
    x = x > C::kHi ? C::kHi : x;
    T t = x * C::kLog2e + C::kShifter;
    T n = t - C::kShifter;
    T r = x - n * C::kLn2Hi;
    r = r - n * C::kLn2Lo;
    U scale = bits_as<U>(t) << C::kMantissa;
    return exp_poly(r) * bits_as<T>(scale);
}

// tanh on |x| < 0.625 (the Cephes rational forms; no cancellation near 0).
RNN_INLINE float tanh_small(float x) {
    float z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    return p * z * x + x;
}

RNN_INLINE double tanh_small(double x) {
    double z = x * x;
    double p = -9.64399179425052238628e-1;
    p = p * z - 9.92877231001918586564e1;
    p = p * z - 1.61468768441708447952e3;
    double q = z + 1.12811678491632931402e2;
    q = q * z + 2.23548839060100448583e3;
    q = q * z + 4.84406305325125486048e3;
    return x + x * (z * p / q);
}

template <class T>
RNN_INLINE T vtanh(T x) {
    T ax = std::fabs(x);
    T e = vexp(T(-2) * ax);
    T large = std::copysign((T(1) - e) / (T(1) + e), x);
    return ax < T(0.625) ? tanh_small(x) : large;
}

template <class T>
RNN_INLINE T vsigmoid(T x) {
    return T(1) / (T(1) + vexp(-x));
}

// max of z[0..n): lane-wise partial maxima, because GCC vectorises a float max
// reduction only under -ffinite-math-only.
template <class T>
RNN_INLINE T row_max(const T* z, int n) {
    constexpr int L = 16;
    T part[L];
    for (int l = 0; l < L; ++l) part[l] = -INFINITY;
    int k = 0;
    for (; k + L <= n; k += L) {
#pragma omp simd
        for (int l = 0; l < L; ++l) part[l] = z[k + l] > part[l] ? z[k + l] : part[l];
    }
    T m = -INFINITY;
    for (; k < n; ++k) m = z[k] > m ? z[k] : m;
    for (int l = 0; l < L; ++l) m = part[l] > m ? part[l] : m;
    return m;
}

}  // namespace rnn
