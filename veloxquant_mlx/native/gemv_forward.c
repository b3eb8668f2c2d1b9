/* Preloaded in front of an optimized BLAS: float32 matrix products with few rows, the ones a decode
 * step makes, are computed here; every other product goes to the library's cblas_sgemm unchanged.
 *
 * MLX's CPU backend computes every float32 matmul with cblas_sgemm. A decode step of B sequences
 * is all (B x K) @ (K x N) products against the weights, and OpenBLAS's sgemm packs the weight
 * matrix before it multiplies, reading it about twice. Here:
 *   - one row or one column: cblas_sgemv, which streams the matrix once;
 *   - 2..8 rows times a transposed matrix (x @ W.T, MLX's layout for a Linear layer): a kernel
 *     that streams W once for all rows, split by output columns over one thread per core.
 * A 105M-parameter model's decode step: 52 -> 31 ms for one sequence, 72 -> 61 ms for eight
 * (BENCHMARKS.md). Built and probed by veloxquant_mlx/gemv_forward.py; VQ_GEMV_THREADS overrides
 * the thread count (default: the online cores, at most 16).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <unistd.h>

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

/* Products this library computed itself (sgemv or the few-rows kernel), for the probe. */
static unsigned long forwarded;
unsigned long vq_gemv_forwarded(void) { return __atomic_load_n(&forwarded, __ATOMIC_RELAXED); }

#define MAX_ROWS 8
#define MAX_THREADS 16
#define SHARED_MIN_ELEMENTS (1u << 18) /* 1 MiB of float32 weights */
typedef float v8 __attribute__((vector_size(32), aligned(4))); /* unaligned loads are fine */

/* C (m x n, ldc) = alpha * A (m x k, lda) @ B^T, B stored n x k (ldb), + beta * C. */
struct job {
    int m, n, k, lda, ldb, ldc;
    float alpha, beta;
    const float *a, *b;
    float *c;
};

static inline float hsum(v8 v) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

#define A_ROW(j, r) ((j)->a + (size_t)(r) * (j)->lda)
#define STORE(j, r, n, s)                                                                    \
    do {                                                                                     \
        float *out = (j)->c + (size_t)(r) * (j)->ldc + (n);                                  \
        *out = (j)->beta == 0.0f ? (j)->alpha * (s) : (j)->alpha * (s) + (j)->beta * *out;   \
    } while (0)
/* Columns of C (rows of B) per pass P: rows x P accumulators (<= 8) hide the FMA latency. */
#define KERNEL(M, P)                                                                         \
    static void rows_##M(const struct job *j, int n0, int n1) {                              \
        int n = n0;                                                                          \
        for (; n + P <= n1; n += P) {                                                        \
            const float *w[P];                                                               \
            for (int p = 0; p < P; p++) w[p] = j->b + (size_t)(n + p) * j->ldb;              \
            v8 acc[M][P];                                                                    \
            for (int r = 0; r < M; r++) for (int p = 0; p < P; p++) acc[r][p] = (v8){0};     \
            int k = 0;                                                                       \
            for (; k + 8 <= j->k; k += 8) {                                                  \
                v8 wv[P];                                                                    \
                for (int p = 0; p < P; p++) wv[p] = *(const v8 *)(w[p] + k);                 \
                for (int r = 0; r < M; r++) {                                                \
                    v8 av = *(const v8 *)(A_ROW(j, r) + k);                                  \
                    for (int p = 0; p < P; p++) acc[r][p] += av * wv[p];                     \
                }                                                                            \
            }                                                                                \
            for (int r = 0; r < M; r++) for (int p = 0; p < P; p++) {                        \
                float s = hsum(acc[r][p]);                                                   \
                for (int kk = k; kk < j->k; kk++) s += A_ROW(j, r)[kk] * w[p][kk];           \
                STORE(j, r, n + p, s);                                                       \
            }                                                                                \
        }                                                                                    \
        for (; n < n1; n++) {                                                                \
            const float *w = j->b + (size_t)n * j->ldb;                                      \
            for (int r = 0; r < M; r++) {                                                    \
                float s = 0.0f;                                                              \
                for (int kk = 0; kk < j->k; kk++) s += A_ROW(j, r)[kk] * w[kk];              \
                STORE(j, r, n, s);                                                           \
            }                                                                                \
        }                                                                                    \
    }
KERNEL(2, 4) KERNEL(3, 2) KERNEL(4, 2) KERNEL(5, 1) KERNEL(6, 1) KERNEL(7, 1) KERNEL(8, 1)
static void (*const kernels[MAX_ROWS + 1])(const struct job *, int, int) = {
    NULL, NULL, rows_2, rows_3, rows_4, rows_5, rows_6, rows_7, rows_8};

/* The worker threads: each takes its share of the columns of the current job. */
static struct job job;
static int n_threads = 1;
static pid_t workers_pid; /* after a fork the child has no workers: it starts its own */
static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_start = PTHREAD_COND_INITIALIZER, cv_done = PTHREAD_COND_INITIALIZER;
static unsigned long generation, born_at;
static int pending;

static int job_threads; /* threads sharing the current job */

static void run_share(int t) {
    int per = ((job.n + job_threads - 1) / job_threads + 7) & ~7;
    int n0 = t * per, n1 = n0 + per < job.n ? n0 + per : job.n;
    if (n0 < n1) kernels[job.m](&job, n0, n1);
}

static void *worker(void *arg) {
    int t = (int)(size_t)arg;
    unsigned long seen = born_at; /* a job posted while this thread was starting is its own */
    for (;;) {
        pthread_mutex_lock(&mu);
        while (generation == seen) pthread_cond_wait(&cv_start, &mu);
        seen = generation;
        pthread_mutex_unlock(&mu);
        run_share(t);
        pthread_mutex_lock(&mu);
        if (--pending == 0) pthread_cond_signal(&cv_done);
        pthread_mutex_unlock(&mu);
    }
    return NULL;
}

static void start_workers(void) { /* under job_lock, no job running */
    if (workers_pid != 0) { /* a forked child: the parent's threads and their locks are gone */
        pthread_mutex_init(&mu, NULL);
        pthread_cond_init(&cv_start, NULL);
        pthread_cond_init(&cv_done, NULL);
    }
    born_at = generation;
    long want = sysconf(_SC_NPROCESSORS_ONLN);
    const char *env = getenv("VQ_GEMV_THREADS");
    if (env != NULL && atol(env) > 0) want = atol(env);
    want = want < 1 ? 1 : want > MAX_THREADS ? MAX_THREADS : want;
    n_threads = 1;
    for (int t = 1; t < want; t++) {
        pthread_t id;
        if (pthread_create(&id, NULL, worker, (void *)(size_t)t) != 0) break;
        pthread_detach(id);
        n_threads = t + 1;
    }
    workers_pid = getpid();
}

/* 1 if computed; 0 if another thread's job is running (the caller uses sgemm). */
static int few_rows(struct job j) {
    if (pthread_mutex_trylock(&job_lock) != 0) return 0;
    if (workers_pid != getpid()) start_workers();
    job = j;
    /* A matrix that fits in cache is done sooner by this thread alone than by waking others. */
    job_threads = (size_t)j.n * (size_t)j.k >= SHARED_MIN_ELEMENTS ? n_threads : 1;
    if (job_threads == 1) {
        run_share(0);
        pthread_mutex_unlock(&job_lock);
        return 1;
    }
    pthread_mutex_lock(&mu);
    pending = n_threads - 1;
    generation++;
    pthread_cond_broadcast(&cv_start);
    pthread_mutex_unlock(&mu);
    run_share(0);
    pthread_mutex_lock(&mu);
    while (pending > 0) pthread_cond_wait(&cv_done, &mu);
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&job_lock);
    return 1;
}

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
    if (k > 0 && rm >= 2 && rm <= MAX_ROWS && rn >= 64 && ra == NO_TRANS && rb != NO_TRANS &&
        few_rows((struct job){rm, rn, k, rlda, rldb, ldc, alpha, beta, pa, pb, c})) {
        __atomic_add_fetch(&forwarded, 1, __ATOMIC_RELAXED);
        return;
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
