// Row-major GEMM on top of a Fortran-convention BLAS whose entry points are handed
// in at import time (SciPy's cython_blas capsules), plus control of that BLAS's own
// thread pool: the engine parallelises with OpenMP and wants single-threaded calls.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace rnn {

using sgemm_t = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                         const float*, const int*, const float*, const int*, const float*, float*,
                         const int*);
using dgemm_t = void (*)(const char*, const char*, const int*, const int*, const int*, const double*,
                         const double*, const int*, const double*, const int*, const double*, double*,
                         const int*);

using sgemv_t = void (*)(const char*, const int*, const int*, const float*, const float*, const int*,
                         const float*, const int*, const float*, float*, const int*);
using dgemv_t = void (*)(const char*, const int*, const int*, const double*, const double*, const int*,
                         const double*, const int*, const double*, double*, const int*);

struct BlasApi {
    sgemm_t sgemm = nullptr;
    dgemm_t dgemm = nullptr;
    sgemv_t sgemv = nullptr;  // optional: single-row products go to GEMV when present
    dgemv_t dgemv = nullptr;
    void (*set_num_threads)(int) = nullptr;
    int (*get_num_threads)() = nullptr;
    std::string library;  // path of the shared library that holds the thread controls
    std::string config;   // the library's own description, e.g. "OpenBLAS 0.3.30 ... SkylakeX"
    // OpenBLAS running its SkylakeX-family kernels: the configuration the few-row routes
    // in gemm() were measured on (elsewhere every product is one plain call)
    bool few_row_routes = false;
};

BlasApi& blas();

inline void fortran_gemm(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc) {
    blas().sgemm(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

inline void fortran_gemm(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda,
                         const double* b, int ldb, double beta, double* c, int ldc) {
    blas().dgemm(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

inline bool has_gemv(float) { return blas().sgemv != nullptr; }
inline bool has_gemv(double) { return blas().dgemv != nullptr; }

inline void fortran_gemv(char t, int m, int n, float alpha, const float* a, int lda, const float* x, int incx,
                         float beta, float* y) {
    const int one = 1;
    blas().sgemv(&t, &m, &n, &alpha, a, &lda, x, &incx, &beta, y, &one);
}

inline void fortran_gemv(char t, int m, int n, double alpha, const double* a, int lda, const double* x, int incx,
                         double beta, double* y) {
    const int one = 1;
    blas().dgemv(&t, &m, &n, &alpha, a, &lda, x, &incx, &beta, y, &one);
}

// Column-block width that sends a few-row product to OpenBLAS's small-matrix kernels
// (SkylakeX family), which skip packing and accept up to 1e6 multiply-adds per call.
inline int small_block(int M, int K) {
    for (int nb : {256, 128, 64, 32, 16})
        if ((double)M * nb * K <= 1e6) return nb;
    return 0;
}

// C (M x N, row stride ldc) = alpha * op(A) op(B) + beta * C, all row-major.
// Row-major C = A B is column-major C^T = B^T A^T, hence the swapped operands.
// `resident`: op(B) stays in cache across calls (a recurrent matrix reused every step).
//
// Few-row products (2 <= M <= 64 rows: the per-step recurrence, the output layer at
// small T*B) are where OpenBLAS loses most, packing a large operand for little reuse.
// Measured on SkylakeX kernels (OpenBLAS 0.3.30), against the plain call:
//  - A B^T: computing C^T and folding it back is 12-25% faster (20 x 100 x 8000:
//    449 vs 574 us; 32 x 2048 x 512: 700 vs 815 us), and no worse elsewhere;
//  - A B with B in cache: C^T in column blocks small enough for the small-matrix
//    kernels (no packing) is 1.3-2x faster (32 x 512 x 512: 147 vs 192 us), but with B
//    out of cache the blocks are several times slower, hence `resident`;
//  - A B with a wide B (N >> K): plain column blocks, about 1.7x (20 x 8000 x 100).
template <class T>
void gemm(bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb, T beta,
          T* C, int ldc, bool resident = false) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {  // the product is empty: C = beta * C
        for (int i = 0; i < M; ++i)
            for (int j = 0; j < N; ++j) C[(std::size_t)i * ldc + j] = beta == T(0) ? T(0) : beta * C[(std::size_t)i * ldc + j];
        return;
    }
    lda = std::max(lda, 1);
    ldb = std::max(ldb, 1);
    ldc = std::max(ldc, 1);
    if (M == 1 && !ta && has_gemv(alpha)) {
        // One row of activations (batch 1): a matrix-vector product. OpenBLAS's GEMM would
        // pack all of B for it; at 1 x 1024 x 1024 the forward pass ran 3x slower than
        // NumPy's GEMV. Not for op(A) = A^T: there M = 1 is a weight gradient over all T*B
        // rows (input size 1), a reduction too long for GEMV's float32 accumulation (the
        // Sobel task's dW_xh at T*B = 4096 missed the conformance bound 1.3-3.5x).
        // Row-major B (K x N) is a column-major N x K matrix, so c = a B is gemv('N') on
        // it; op(B) = B^T (B row-major N x K, column-major K x N) is gemv('T').
        if (tb)
            fortran_gemv('T', K, N, alpha, B, ldb, A, 1, beta, C);
        else
            fortran_gemv('N', N, K, alpha, B, ldb, A, 1, beta, C);
        return;
    }
    const double work = (double)M * N * K;
    if (blas().few_row_routes && !ta && M >= 2 && M <= 64 && work >= 1e5) {
        const int nb = small_block(M, K);
        if (!tb && nb >= 256 && N > 2 * nb && !resident) {  // wide B: plain column blocks
            for (int j = 0; j < N; j += nb)
                fortran_gemm('N', 'N', std::min(nb, N - j), M, K, alpha, B + j, ldb, A, lda, beta, C + j, ldc);
            return;
        }
        if (tb || (resident && nb > 0)) {
            thread_local std::vector<T> scratch;
            if (scratch.size() < (std::size_t)M * N) scratch.resize((std::size_t)M * N);
            T* Ct = scratch.data();  // column-major M x N, i.e. C^T row-major
            if (tb) {
                fortran_gemm('T', 'N', M, N, K, alpha, A, lda, B, ldb, T(0), Ct, M);
            } else {
                for (int j = 0; j < N; j += nb)
                    fortran_gemm('T', 'T', M, std::min(nb, N - j), K, alpha, A, lda, B + j, ldb, T(0),
                                 Ct + (std::size_t)j * M, M);
            }
            for (int i = 0; i < M; ++i) {
                T* c = C + (std::size_t)i * ldc;
                if (beta == T(0))
                    for (int j = 0; j < N; ++j) c[j] = Ct[(std::size_t)j * M + i];
                else
                    for (int j = 0; j < N; ++j) c[j] = Ct[(std::size_t)j * M + i] + beta * c[j];
            }
            return;
        }
    }
    fortran_gemm(tb ? 'T' : 'N', ta ? 'T' : 'N', N, M, K, alpha, B, ldb, A, lda, beta, C, ldc);
}

}  // namespace rnn
