/* Plain Fortran BLAS names forwarding to a prefixed OpenBLAS build.
 *
 * Theano's and PyTensor's generated C calls sgemm_, dgemv_, ... while the
 * scipy-openblas wheels export the same routines as scipy_sgemm_, ... .
 * Built with -DBLAS_PREFIX=scipy_ against that library; 32-bit integers (LP64).
 */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define TARGET(name) CAT(BLAS_PREFIX, name)

typedef int blasint;

#define REAL_ROUTINES(T, p)                                                                     \
    void TARGET(p##gemm_)(const char *, const char *, const blasint *, const blasint *,         \
                          const blasint *, const T *, const T *, const blasint *, const T *,    \
                          const blasint *, const T *, T *, const blasint *);                    \
    void p##gemm_(const char *ta, const char *tb, const blasint *m, const blasint *n,           \
                  const blasint *k, const T *alpha, const T *a, const blasint *lda, const T *b, \
                  const blasint *ldb, const T *beta, T *c, const blasint *ldc)                  \
    {                                                                                           \
        TARGET(p##gemm_)(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);                 \
    }                                                                                           \
    void TARGET(p##gemv_)(const char *, const blasint *, const blasint *, const T *, const T *, \
                          const blasint *, const T *, const blasint *, const T *, T *,          \
                          const blasint *);                                                     \
    void p##gemv_(const char *tr, const blasint *m, const blasint *n, const T *alpha,           \
                  const T *a, const blasint *lda, const T *x, const blasint *incx,              \
                  const T *beta, T *y, const blasint *incy)                                     \
    {                                                                                           \
        TARGET(p##gemv_)(tr, m, n, alpha, a, lda, x, incx, beta, y, incy);                      \
    }                                                                                           \
    void TARGET(p##ger_)(const blasint *, const blasint *, const T *, const T *,                \
                         const blasint *, const T *, const blasint *, T *, const blasint *);    \
    void p##ger_(const blasint *m, const blasint *n, const T *alpha, const T *x,                \
                 const blasint *incx, const T *y, const blasint *incy, T *a,                    \
                 const blasint *lda)                                                            \
    {                                                                                           \
        TARGET(p##ger_)(m, n, alpha, x, incx, y, incy, a, lda);                                 \
    }                                                                                           \
    T TARGET(p##dot_)(const blasint *, const T *, const blasint *, const T *,                   \
                      const blasint *);                                                         \
    T p##dot_(const blasint *n, const T *x, const blasint *incx, const T *y,                    \
              const blasint *incy)                                                              \
    {                                                                                           \
        return TARGET(p##dot_)(n, x, incx, y, incy);                                            \
    }                                                                                           \
    void TARGET(p##axpy_)(const blasint *, const T *, const T *, const blasint *, T *,          \
                          const blasint *);                                                     \
    void p##axpy_(const blasint *n, const T *alpha, const T *x, const blasint *incx, T *y,      \
                  const blasint *incy)                                                          \
    {                                                                                           \
        TARGET(p##axpy_)(n, alpha, x, incx, y, incy);                                           \
    }                                                                                           \
    void TARGET(p##scal_)(const blasint *, const T *, T *, const blasint *);                    \
    void p##scal_(const blasint *n, const T *alpha, T *x, const blasint *incx)                  \
    {                                                                                           \
        TARGET(p##scal_)(n, alpha, x, incx);                                                    \
    }                                                                                           \
    void TARGET(p##copy_)(const blasint *, const T *, const blasint *, T *, const blasint *);   \
    void p##copy_(const blasint *n, const T *x, const blasint *incx, T *y, const blasint *incy) \
    {                                                                                           \
        TARGET(p##copy_)(n, x, incx, y, incy);                                                  \
    }                                                                                           \
    void TARGET(p##swap_)(const blasint *, T *, const blasint *, T *, const blasint *);         \
    void p##swap_(const blasint *n, T *x, const blasint *incx, T *y, const blasint *incy)       \
    {                                                                                           \
        TARGET(p##swap_)(n, x, incx, y, incy);                                                  \
    }                                                                                           \
    void TARGET(p##symv_)(const char *, const blasint *, const T *, const T *, const blasint *, \
                          const T *, const blasint *, const T *, T *, const blasint *);         \
    void p##symv_(const char *uplo, const blasint *n, const T *alpha, const T *a,               \
                  const blasint *lda, const T *x, const blasint *incx, const T *beta, T *y,     \
                  const blasint *incy)                                                          \
    {                                                                                           \
        TARGET(p##symv_)(uplo, n, alpha, a, lda, x, incx, beta, y, incy);                       \
    }                                                                                           \
    void TARGET(p##syrk_)(const char *, const char *, const blasint *, const blasint *,         \
                          const T *, const T *, const blasint *, const T *, T *,                \
                          const blasint *);                                                     \
    void p##syrk_(const char *uplo, const char *tr, const blasint *n, const blasint *k,         \
                  const T *alpha, const T *a, const blasint *lda, const T *beta, T *c,          \
                  const blasint *ldc)                                                           \
    {                                                                                           \
        TARGET(p##syrk_)(uplo, tr, n, k, alpha, a, lda, beta, c, ldc);                          \
    }                                                                                           \
    void TARGET(p##trsm_)(const char *, const char *, const char *, const char *,               \
                          const blasint *, const blasint *, const T *, const T *,               \
                          const blasint *, T *, const blasint *);                               \
    void p##trsm_(const char *side, const char *uplo, const char *ta, const char *diag,         \
                  const blasint *m, const blasint *n, const T *alpha, const T *a,               \
                  const blasint *lda, T *b, const blasint *ldb)                                 \
    {                                                                                           \
        TARGET(p##trsm_)(side, uplo, ta, diag, m, n, alpha, a, lda, b, ldb);                    \
    }

REAL_ROUTINES(float, s)
REAL_ROUTINES(double, d)

/* Thread control, so openblas_set_num_threads reaches the library doing the work. */
void TARGET(openblas_set_num_threads)(int);
int TARGET(openblas_get_num_threads)(void);
void openblas_set_num_threads(int n) { TARGET(openblas_set_num_threads)(n); }
int openblas_get_num_threads(void) { return TARGET(openblas_get_num_threads)(); }
