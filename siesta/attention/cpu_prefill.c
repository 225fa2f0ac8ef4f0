/* Paged prefill attention on the CPU: a step's prompt chunks attend causally to their context
 * where it lies in the block-first cache (the chunk's own K/V are written there first).
 *
 * torch's flash SDPA for the CPU reaches 95-140 GFLOP/s at SmolLM2's heads (9 query heads of
 * 64 over 3 KV heads, 500-2,000 tokens, 2-core Xeon), and a chunk after a cached prefix first
 * gathers its context and builds a mask. Here a task is ROWS query rows that share a KV head
 * (a tile of tokens times the group's query heads), with the queries packed transposed once,
 * Qt [head_dim][ROWS]. Per chunk of KEYS keys, read where they lie:
 *   S [key][row] = K Qt in KT x ROW_VECS register tiles (a broadcast key element times the
 *     rows' vectors), so the online softmax then runs across rows in vectors too: a row's
 *     max, rescale and sum never need a reduction across lanes;
 *   O = alpha O + P V in MR x DIM_VECS register tiles (a broadcast weight times DIM_VECS value
 *     vectors). The chunk's P V is summed apart and then added to the rescaled O: summed into
 *     O itself, each of a long context's keys would be rounded against the sum of all before
 *     it, and the error would grow with the context (measured: 10x torch's at 4,096 keys).
 * The vectors are gcc's vector extension, their width and the tiles the target's (below), so
 * that the tiles fill its vector registers without spilling. fp32 throughout; the sums run in
 * another order than torch's (a few ulp).
 *
 * Tasks (a request's tile of tokens and one KV head) are split over OpenMP threads, a
 * prompt's last tokens (which see the most keys) first, so the threads finish together.
 * The caller keeps head_dim a multiple of DIM_TILE and group at most ROWS (cpu_attention.py's
 * _takes_prefill, from prefill_dim_tile() and prefill_max_group()). Returns 0, or -1 where a
 * thread's buffers could not be allocated (the caller then takes the torch path).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_nonpositive.h"

/* Per target: VL floats a vector; KT x ROW_VECS score accumulators + ROW_VECS query vectors
 * + a broadcast key element, and MR x DIM_VECS value accumulators + DIM_VECS value vectors +
 * a broadcast weight, each within the vector registers. (The AVX-512 tiles built for AVX2,
 * each 64-byte vector two ymm, are twice its 16 registers: 7 GFLOP/s against 150.) */
#if defined(__AVX512F__)
#define VL 16      /* one zmm, 32 registers */
#define ROW_VECS 3 /* 48 rows */
#define KT 8       /* 24 + 3 + 1 */
#define MR 6
#define DIM_VECS 4 /* 24 + 4 + 1; 64 columns */
#elif defined(__AVX2__)
#define VL 8       /* one ymm, 16 registers */
#define ROW_VECS 3 /* 24 rows */
#define KT 4       /* 12 + 3 + 1 */
#define MR 6
#define DIM_VECS 2 /* 12 + 2 + 1; 16 columns */
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define VL 4       /* one q register, 32 registers */
#define ROW_VECS 4 /* 16 rows */
#define KT 6       /* 24 + 4 + 1 */
#define MR 4
#define DIM_VECS 4 /* 16 + 4 + 1; 16 columns */
#define KEYS 48    /* whole score tiles */
#else
#define VL 4       /* 16 bytes: SSE2's 16 registers on x86-64 */
#define ROW_VECS 3 /* 12 rows */
#define KT 4       /* 12 + 3 + 1 */
#define MR 6
#define DIM_VECS 2 /* 12 + 2 + 1; 8 columns */
#endif
#define ROWS (ROW_VECS * VL)     /* query rows of a task (its tokens x the group, padded) */
#define DIM_TILE (DIM_VECS * VL) /* head_dim columns of a P V register tile */
#ifndef KEYS
#define KEYS 64 /* keys per chunk */
#endif
#define BUFFER_ALIGN 64
_Static_assert(ROWS % MR == 0, "the P V tiles cover a task's rows");
_Static_assert(KEYS % KT == 0, "a chunk's keys are whole score tiles");

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef float vf_unaligned __attribute__((vector_size(VL * sizeof(float)), aligned(sizeof(float))));

/* The build's limits, for the caller (cpu_attention.py): a group of query heads a KV head at
 * most, and what head_dim must be a multiple of. */
int prefill_max_group(void) { return ROWS; }
int prefill_dim_tile(void) { return DIM_TILE; }

static inline vf load(const float *p) { return *(const vf_unaligned *)p; }
static inline void store(float *p, vf x) { *(vf_unaligned *)p = x; }

/* S[j][0:ROWS] = K[j] . Qt[:, 0:ROWS] for KT keys (rows of the cache, read in place). */
static inline __attribute__((always_inline)) void scores_tile(const float *const *krows, const float *qt, float *s,
                                                             const int head_dim)
{
    vf acc[KT][ROW_VECS] = {{0}};
    for (int d = 0; d < head_dim; d++) {
        vf b[ROW_VECS];
#pragma GCC unroll 8
        for (int x = 0; x < ROW_VECS; x++) b[x] = load(qt + d * ROWS + x * VL);
#pragma GCC unroll 8
        for (int j = 0; j < KT; j++) {
            const float a = krows[j][d];
#pragma GCC unroll 8
            for (int x = 0; x < ROW_VECS; x++) acc[j][x] += a * b[x];
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < KT; j++)
#pragma GCC unroll 8
        for (int x = 0; x < ROW_VECS; x++) store(s + j * ROWS + x * VL, acc[j][x]);
}

/* O[r][dc:dc+DIM_TILE] = alpha[r] O[r][dc:dc+DIM_TILE] + sum_j P[j][r] V[j][dc:dc+DIM_TILE] for MR rows. */
static inline __attribute__((always_inline)) void values_tile(const float *p, const float *const *vrows, int keys,
                                                             const float *alpha, float *o, int dc,
                                                             const int head_dim)
{
    vf acc[MR][DIM_VECS] = {{0}};
    for (int j = 0; j < keys; j++) {
        const float *v = vrows[j] + dc;
        vf vv[DIM_VECS];
#pragma GCC unroll 8
        for (int x = 0; x < DIM_VECS; x++) vv[x] = load(v + x * VL);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const float w = p[j * ROWS + r];
#pragma GCC unroll 8
            for (int x = 0; x < DIM_VECS; x++) acc[r][x] += w * vv[x];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        float *orow = o + r * head_dim + dc;
#pragma GCC unroll 8
        for (int x = 0; x < DIM_VECS; x++) store(orow + x * VL, load(orow + x * VL) * alpha[r] + acc[r][x]);
    }
}

/* The online-softmax step of a chunk of `keys` scores S[j][r], all rows at once (the loops
 * over rows vectorize): key c0 + j counts for row r only at or before its position. The
 * scores become weights (0 where not counted); alpha[r] is the factor row r's accumulator is
 * rescaled by. Every row counts key 0, so m is finite after the first chunk and a row that
 * counts none of a later chunk keeps its max (alpha 1, weights 0). */
static inline void softmax_chunk(float *s, int keys, int64_t c0, const int64_t *pos, int masked, float *m,
                                 float *l, float *alpha)
{
    float mx[ROWS], sum[ROWS];
    for (int r = 0; r < ROWS; r++) mx[r] = -INFINITY, sum[r] = 0.0f;
    for (int j = 0; j < keys; j++) {
        float *sj = s + j * ROWS;
        if (masked)
            for (int r = 0; r < ROWS; r++) sj[r] = c0 + j <= pos[r] ? sj[r] : -INFINITY;
        for (int r = 0; r < ROWS; r++) mx[r] = sj[r] > mx[r] ? sj[r] : mx[r];
    }
    for (int r = 0; r < ROWS; r++) {
        mx[r] = mx[r] > m[r] ? mx[r] : m[r];
        alpha[r] = exp_nonpositive(m[r] - mx[r]); /* 0 on the first chunk: m = -inf */
        m[r] = mx[r];
    }
    for (int j = 0; j < keys; j++) {
        float *sj = s + j * ROWS;
        for (int r = 0; r < ROWS; r++) {
            sj[r] = exp_nonpositive(sj[r] - mx[r]);
            sum[r] += sj[r];
        }
    }
    for (int r = 0; r < ROWS; r++) l[r] = l[r] * alpha[r] + sum[r];
}

typedef struct {
    float *qt, *o, *s, *m, *l, *alpha;
    int64_t *pos;
    const float **krows, **vrows;
} Buffers;

static int alloc_buffers(Buffers *b, int head_dim)
{
    const size_t fl = sizeof(float), ptr = sizeof(float *);
    const size_t sizes[9] = {ROWS * head_dim * fl, ROWS * head_dim * fl, ROWS * KEYS * fl, ROWS * fl, ROWS * fl,
                             ROWS * fl, ROWS * sizeof(int64_t), KEYS * ptr, KEYS * ptr};
    void *p[9];
    int ok = 1;
    for (int i = 0; i < 9; i++) {
        p[i] = aligned_alloc(BUFFER_ALIGN, (sizes[i] + BUFFER_ALIGN - 1) / BUFFER_ALIGN * BUFFER_ALIGN);
        ok = ok && p[i] != NULL;
    }
    if (!ok) {
        for (int i = 0; i < 9; i++) free(p[i]);
        return -1;
    }
    b->qt = p[0], b->o = p[1], b->s = p[2], b->m = p[3], b->l = p[4], b->alpha = p[5], b->pos = p[6];
    b->krows = p[7], b->vrows = p[8];
    return 0;
}

static void free_buffers(Buffers *b)
{
    free(b->qt), free(b->o), free(b->s), free(b->m), free(b->l), free(b->alpha), free(b->pos);
    free((void *)b->krows), free((void *)b->vrows);
}

typedef struct {
    const float *q;
    int64_t q_token_stride, q_head_stride;
    const float *k_cache, *v_cache;
    int64_t block_stride, slot_stride, head_stride;
    int group, block_size;
    float scale;
    float *out;
    int64_t out_token_stride, out_head_stride;
} Args;

/* Query rows [t0, t0 + tokens) of one request (its queries start at row q0 of q and sit at
 * positions first_pos...) against KV head h. Rows are token-major, row = token * group + g;
 * rows past tokens * group repeat the last one, and are not written out. */
static inline __attribute__((always_inline)) void tile(const Args *a, Buffers *b, const int32_t *table, int64_t q0,
                                                      int64_t first_pos, int64_t t0, int tokens, int h,
                                                      const int head_dim)
{
    const int rows = tokens * a->group;
    for (int r = 0; r < ROWS; r++) {
        const int t = r < rows ? r / a->group : tokens - 1;
        const int hq = h * a->group + (r < rows ? r % a->group : a->group - 1);
        const float *qr = a->q + (q0 + t0 + t) * a->q_token_stride + hq * a->q_head_stride;
        for (int d = 0; d < head_dim; d++) b->qt[d * ROWS + r] = qr[d] * a->scale;
        memset(b->o + r * head_dim, 0, head_dim * sizeof(float));
        b->m[r] = -INFINITY;
        b->l[r] = 0.0f;
        b->pos[r] = first_pos + t0 + t;
    }
    const int64_t keys_total = first_pos + t0 + tokens; /* the last token sees keys [0, its position] */
    for (int64_t c0 = 0; c0 < keys_total; c0 += KEYS) {
        const int keys = (int)(keys_total - c0 < KEYS ? keys_total - c0 : KEYS);
        for (int j = 0; j < KEYS; j++) { /* past `keys`: key 0 again, scored but never counted */
            const int64_t key = j < keys ? c0 + j : 0;
            const int64_t at = table[key / a->block_size] * a->block_stride + key % a->block_size * a->slot_stride +
                               h * a->head_stride;
            b->krows[j] = a->k_cache + at;
            b->vrows[j] = a->v_cache + at;
        }
        for (int j0 = 0; j0 < keys; j0 += KT) scores_tile(b->krows + j0, b->qt, b->s + j0 * ROWS, head_dim);
        const int masked = c0 + keys - 1 > first_pos + t0; /* some key is after the first row's token */
        softmax_chunk(b->s, keys, c0, b->pos, masked, b->m, b->l, b->alpha);
        for (int r0 = 0; r0 < ROWS; r0 += MR)
            for (int dc = 0; dc < head_dim; dc += DIM_TILE)
                values_tile(b->s + r0, b->vrows, keys, b->alpha + r0, b->o + r0 * head_dim, dc, head_dim);
    }
    for (int r = 0; r < rows; r++) {
        const int t = r / a->group, hq = h * a->group + r % a->group;
        float *orow = a->out + (q0 + t0 + t) * a->out_token_stride + hq * a->out_head_stride;
        const float inv = 1.0f / b->l[r]; /* > 0: every row counts key 0 */
        for (int d = 0; d < head_dim; d++) orow[d] = b->o[r * head_dim + d] * inv;
    }
}

int paged_prefill(
    const float *q, int64_t q_token_stride, int64_t q_head_stride,
    const float *k_cache, const float *v_cache,
    int64_t block_stride, int64_t slot_stride, int64_t head_stride,
    const int32_t *block_tables, int64_t table_stride,
    const int64_t *req_index, const int64_t *q_start, const int64_t *q_len, const int64_t *ctx_len,
    int64_t num_reqs, int kv_heads, int group, int head_dim, int block_size, float scale,
    float *out, int64_t out_token_stride, int64_t out_head_stride)
{
    const Args a = {q, q_token_stride, q_head_stride, k_cache, v_cache, block_stride, slot_stride, head_stride,
                    group, block_size, scale, out, out_token_stride, out_head_stride};
    const int tile_tokens = ROWS / group; /* the caller keeps group <= ROWS */
    /* Task i of request r: tiles[r] <= i < tiles[r + 1], its tiles counted from the last. */
    int64_t *first = malloc((num_reqs + 1) * sizeof(int64_t));
    if (first == NULL) return -1;
    first[0] = 0;
    for (int64_t r = 0; r < num_reqs; r++) first[r + 1] = first[r] + (q_len[r] + tile_tokens - 1) / tile_tokens * kv_heads;
    int failed = 0;
#pragma omp parallel
    {
        Buffers b;
        const int mine = alloc_buffers(&b, head_dim);
        if (mine != 0) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < first[num_reqs]; i++) {
                int64_t r = 0;
                while (first[r + 1] <= i) r++;
                const int64_t local = i - first[r], tiles = (q_len[r] + tile_tokens - 1) / tile_tokens;
                const int h = (int)(local % kv_heads);
                const int64_t t0 = (tiles - 1 - local / kv_heads) * tile_tokens;
                const int tokens = (int)(q_len[r] - t0 < tile_tokens ? q_len[r] - t0 : tile_tokens);
                const int32_t *table = block_tables + req_index[r] * table_stride;
                const int64_t first_pos = ctx_len[r] - q_len[r];
#define TILE(dim) tile(&a, &b, table, q_start[r], first_pos, t0, tokens, h, dim)
                switch (head_dim) { /* the common head sizes get their own unrolled copies */
                case 64: TILE(64); break;
                case 128: TILE(128); break;
                default: TILE(head_dim);
                }
#undef TILE
            }
        }
        if (mine == 0) free_buffers(&b);
    }
    free(first);
    return failed ? -1 : 0;
}
