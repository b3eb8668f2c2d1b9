/* Preloaded in front of an optimized BLAS: matrix products with one row or one column go to
 * cblas_sgemv, every other product to the library's cblas_sgemm unchanged.
 *
 * MLX's CPU backend computes every float32 matmul with cblas_sgemm. A decode step of one sequence
 * is all (1 x K) @ (K x N) products, and OpenBLAS's sgemm packs the weight matrix before it
 * multiplies, reading it about twice; sgemv streams it once (2.3x faster on a 105M-parameter
 * model's weights, BENCHMARKS.md). Built and probed by veloxquant_mlx/gemv_forward.py.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

enum { ROW_MAJOR = 101, COL_MAJOR = 102, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;

__attribute__((constructor)) static void resolve(void) {
    next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    next_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
}

/* Calls into this library that went to sgemv, for the probe. */
static unsigned long forwarded;
unsigned long vq_gemv_forwarded(void) { return __atomic_load_n(&forwarded, __ATOMIC_RELAXED); }

static void zero(float *y, int n, int inc) {
    for (int i = 0; i < n; i++) y[(size_t)i * inc] = 0.0f;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    if (next_sgemm == NULL) resolve();
    int ra = trans_a, rb = trans_b, rm = m, rn = n, rlda = lda, rldb = ldb;
    const float *pa = a, *pb = b;
    if (order == COL_MAJOR) { /* column-major C = op(A) op(B) is row-major C^T = op(B)^T op(A)^T */
        ra = trans_b, rb = trans_a, rm = n, rn = m, rlda = ldb, rldb = lda, pa = b, pb = a;
    } else if (order != ROW_MAJOR) {
        rm = 0; /* not ours to judge: the library reports it */
    }
    if (next_sgemv == NULL || k <= 0 || rm <= 0 || rn <= 0 || (rm != 1 && rn != 1)) {
        next_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    __atomic_add_fetch(&forwarded, 1, __ATOMIC_RELAXED);
    if (rm == 1) {
        /* row-major y(1 x N) = x(1 x K) op(B)(K x N): y = op(B)^T x, y contiguous */
        int incx = ra == NO_TRANS ? 1 : rlda;
        if (beta == 0.0f) zero(c, rn, 1);
        if (rb == NO_TRANS) /* B stored K x N */
            next_sgemv(ROW_MAJOR, TRANS, k, rn, alpha, pb, rldb, pa, incx, beta, c, 1);
        else /* B stored N x K */
            next_sgemv(ROW_MAJOR, NO_TRANS, rn, k, alpha, pb, rldb, pa, incx, beta, c, 1);
    } else {
        /* row-major y(M x 1) = op(A)(M x K) x(K x 1), y strided by ldc */
        int incx = rb == NO_TRANS ? rldb : 1;
        if (beta == 0.0f) zero(c, rm, ldc);
        if (ra == NO_TRANS) /* A stored M x K */
            next_sgemv(ROW_MAJOR, NO_TRANS, rm, k, alpha, pa, rlda, pb, incx, beta, c, ldc);
        else /* A stored K x M */
            next_sgemv(ROW_MAJOR, TRANS, k, rm, alpha, pa, rlda, pb, incx, beta, c, ldc);
    }
}
