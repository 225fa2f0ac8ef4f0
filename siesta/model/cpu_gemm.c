/* A linear layer of a decode step's rows on the CPU (fp32): y = x . w^T (+ bias), with w the
 * plain row-major [n, k] weight that torch holds (nothing packed, so a weight written in place
 * is what is multiplied).
 *
 * A decode step of a few dozen rows reads every weight once from memory and does only a few
 * dozen FMAs per weight: the BLAS libraries' gemm, tuned for products that fit in cache,
 * first waits for the weights, then computes (at 32 rows on a 2-core EPYC, over a model's
 * layers, oneDNN runs at ~107 GFLOP/s, where a prefill's 2,048 rows reach ~195). Here each thread
 * walks its own output features, TILE_N weight rows at a time. While a tile's rows meet every
 * row of x (from L1/L2), the next tile's weights are prefetched, spread over that compute, so
 * memory and the FMA units stay busy together.
 *
 * The inner product runs along k in whole vectors: TILE_M x TILE_N vector accumulators, the
 * TILE_M rows' x vectors and one weight vector fill the register file, so the vector width
 * and TILE_M are the target's (below: 32 registers of 64 bytes under AVX-512, 16 of 32 under
 * AVX2, 32 of 16 on NEON). Each accumulator is summed once at the end, four at a time
 * through a shuffle tree. Every output is one row of x against one row of w, summed in the same
 * order whatever the other rows are, so a row's result does not depend on the batch it is in
 * (builds for different targets sum in different orders).
 */
#include <stdint.h>

#define TILE_N 4 /* weight rows per tile (their accumulators are summed together: sum4) */
/* Per target: VEC floats a vector and TILE_M rows of x a pass, so that TILE_M * TILE_N
 * accumulators, the TILE_M x vectors and one weight vector fit the vector registers (where
 * they do not, the compiler leaves weight vectors in memory, and the loads bound the loop:
 * 0.88x under AVX2), and PIN, the constraint that keeps a vector in one of them. */
#if defined(__AVX512F__)
#define VEC 16   /* one zmm */
#define TILE_M 6 /* 24 + 6 + 1 of 32 registers */
#define PIN "+v"
#elif defined(__AVX2__)
#define VEC 8    /* one ymm */
#define TILE_M 3 /* 12 + 3 + 1 of 16 (2 rows: 8 accumulators cannot hide the FMAs' latency, 0.76x) */
#define PIN "+x"
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define VEC 4    /* one q register */
#define TILE_M 6 /* 24 + 6 + 1 of 32 */
#define PIN "+w"
#else
#define VEC 4    /* 16 bytes: SSE2's on x86-64, or what the compiler makes of it elsewhere */
#define TILE_M 3 /* 12 + 3 + 1 of SSE2's 16 */
#if defined(__x86_64__)
#define PIN "+x"
#endif
#endif
#define LINE_FLOATS 16
/* To L2: the next tile is needed a whole tile's compute from now, and L1's few miss
 * buffers are kept for the loads the current tile waits on. */
#define PREFETCH_LOCALITY 2

/* The build's vector width, for the caller (cpu_linear.py): k must be a multiple of it. */
int gemm_vec(void) { return VEC; }

typedef float vf __attribute__((vector_size(VEC * sizeof(float))));
typedef float vf_unaligned __attribute__((vector_size(VEC * sizeof(float)), aligned(sizeof(float))));

static inline vf load(const float *p) { return *(const vf_unaligned *)p; }

#ifdef PIN
#define PIN_TO_REGISTER(v) __asm__("" : PIN(v))
#else
#define PIN_TO_REGISTER(v) (void)(v)
#endif

/* The sums of a, b, c and d's lanes, in lanes 0, SUM_STRIDE, 2 SUM_STRIDE and 3 SUM_STRIDE of
 * the result: halves added until each vector's partial sums share one vector. */
#define SUM_STRIDE (VEC / 4)
static inline vf sum4(vf a, vf b, vf c, vf d)
{
#if VEC == 16
    const vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    /* lanes 0-3: a, 4-7: b, 8-11: c, 12-15: d (four partial sums each) */
    const vf all = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                   __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const vf two = all + __builtin_shufflevector(all, all, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return two + __builtin_shufflevector(two, two, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#elif VEC == 8
    const vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    const vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
    /* lanes 0-1: a, 2-3: b, 4-5: c, 6-7: d (two partial sums each) */
    const vf all = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                   __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
    return all + __builtin_shufflevector(all, all, 1, 0, 3, 2, 5, 4, 7, 6);
#elif VEC == 4
    const vf ab = __builtin_shufflevector(a, b, 0, 1, 4, 5) + __builtin_shufflevector(a, b, 2, 3, 6, 7);
    const vf cd = __builtin_shufflevector(c, d, 0, 1, 4, 5) + __builtin_shufflevector(c, d, 2, 3, 6, 7);
    /* lanes 0-1: a, 2-3: b in ab (two partial sums each); one lane each below */
    return __builtin_shufflevector(ab, cd, 0, 2, 4, 6) + __builtin_shufflevector(ab, cd, 1, 3, 5, 7);
#else
#error "sum4 has no shuffle tree for this VEC"
#endif
}

/* `rows` (<= TILE_M, a constant where inlined) rows of x against the TILE_N weight rows at w,
 * into y's columns [0, TILE_N); prefetching `*ahead` onward, `per_step` lines a vector step,
 * up to `ahead_end`. */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t x_stride, const int rows, const float *w, int64_t k, const float *bias,
    float *y, int64_t y_stride, const float **ahead, const float *ahead_end, int per_step)
{
    vf acc[TILE_M][TILE_N];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int j = 0; j < TILE_N; j++) acc[r][j] = (vf){0};
    const float *p = *ahead;
    for (int64_t d = 0; d < k; d += VEC) {
        for (int i = 0; i < per_step && p < ahead_end; i++, p += LINE_FLOATS)
            __builtin_prefetch(p, 0, PREFETCH_LOCALITY);
        /* The rows' x vectors and each weight vector in turn, into registers once: left to
         * itself, the compiler folds their loads into the FMAs, and the loads, not the FMAs,
         * then bound the loop. */
        vf xv[TILE_M];
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            xv[r] = load(x + r * x_stride + d);
            PIN_TO_REGISTER(xv[r]);
        }
#pragma GCC unroll 4
        for (int j = 0; j < TILE_N; j++) {
            vf wv = load(w + j * k + d);
            PIN_TO_REGISTER(wv);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) acc[r][j] += xv[r] * wv;
        }
    }
    *ahead = p;
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) {
        const vf s = sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
        float *yr = y + r * y_stride;
        for (int j = 0; j < TILE_N; j++) yr[j] = s[SUM_STRIDE * j] + (bias ? bias[j] : 0.0f);
    }
}

/* One tile of weight rows against every row of x. */
static void weight_tile(const float *x, int64_t x_stride, int64_t rows, const float *w, int64_t k,
                        const float *bias, float *y, int64_t y_stride, const float *next, const float *next_end)
{
    /* The next tile's lines, spread evenly over this tile's vector steps. */
    const int64_t steps = (rows + TILE_M - 1) / TILE_M * (k / VEC);
    const int64_t lines = (next_end - next) / LINE_FLOATS;
    const int per_step = (int)((lines + steps - 1) / steps);
    int64_t r = 0;
    for (; r + TILE_M <= rows; r += TILE_M)
        tile(x + r * x_stride, x_stride, TILE_M, w, k, bias, y + r * y_stride, y_stride, &next, next_end, per_step);
    const float *xr = x + r * x_stride;
    float *yr = y + r * y_stride;
    switch (rows - r) { /* the tail of fewer than TILE_M rows, each count its own unrolled copy */
#if TILE_M > 5
    case 5: tile(xr, x_stride, 5, w, k, bias, yr, y_stride, &next, next_end, per_step); break;
#endif
#if TILE_M > 4
    case 4: tile(xr, x_stride, 4, w, k, bias, yr, y_stride, &next, next_end, per_step); break;
#endif
#if TILE_M > 3
    case 3: tile(xr, x_stride, 3, w, k, bias, yr, y_stride, &next, next_end, per_step); break;
#endif
#if TILE_M > 2
    case 2: tile(xr, x_stride, 2, w, k, bias, yr, y_stride, &next, next_end, per_step); break;
#endif
    case 1: tile(xr, x_stride, 1, w, k, bias, yr, y_stride, &next, next_end, per_step); break;
    default: break;
    }
}

/* y[i, n] = x[i, :] . w[n, :] (+ bias[n]) for i < rows and n < n_out, over OpenMP threads
 * (torch's runtime: the loader reuses its libgomp). 0, or -1 (nothing written) where k is
 * not a whole number of vectors. */
int linear_tiled(const float *x, int64_t x_stride, int64_t rows, const float *w, int64_t k, int64_t n_out,
                 const float *bias, float *y, int64_t y_stride)
{
    if (k % VEC != 0 || k == 0) return -1;
    const int64_t tiles = n_out / TILE_N;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n = t * TILE_N;
        /* The next tile this thread takes under the static schedule is usually t + 1. */
        const float *next = w + (n + TILE_N) * k;
        const float *next_end = t + 1 < tiles ? next + TILE_N * k : next;
        weight_tile(x, x_stride, rows, w + n * k, k, bias ? bias + n : 0, y + n, y_stride, next, next_end);
    }
    for (int64_t n = tiles * TILE_N; n < n_out; n++) { /* the last n_out % TILE_N features */
        const float *wr = w + n * k;
        for (int64_t i = 0; i < rows; i++) {
            vf acc = {0};
            for (int64_t d = 0; d < k; d += VEC) acc += load(x + i * x_stride + d) * load(wr + d);
            float s = 0.0f;
            for (int j = 0; j < VEC; j++) s += acc[j];
            y[i * y_stride + n] = s + (bias ? bias[n] : 0.0f);
        }
    }
    return 0;
}
