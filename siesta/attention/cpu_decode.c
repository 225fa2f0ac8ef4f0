/* Paged decode attention on the CPU, reading K/V where they lie in the block-first cache.
 *
 * The torch path gathers every row's K/V into a fresh tensor before SDPA reads them
 * again: three passes over the bytes that decode is bound by. Here each row walks its
 * block table once, a block at a time: every query head scores the block's keys, its
 * online softmax rescales once per block, and the block's values are accumulated. One
 * block's K (and V) for all KV heads is one contiguous region, read while it is in L1;
 * the block after next is prefetched meanwhile. fp32 throughout.
 *
 * Rows [row_begin, row_end) of the arrays are done by this call, which holds no lock and
 * writes only its rows' outputs; paged_decode_parts splits a step's rows over OpenMP
 * threads this way. The caller
 * keeps the shapes within the limits below (cpu_attention.py's _takes).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_Q_HEADS 128 /* query heads of a row */
#define MAX_STATE 8192  /* query heads x head_dim: a row's queries and accumulators live on the stack */
#define MAX_BLOCK 128
#define LINE_FLOATS 16  /* floats in a 64-byte cache line */
/* How many blocks ahead to prefetch, and to which level. Blocks lie anywhere in the pool,
 * so the hardware prefetcher cannot see the next one coming. Two blocks ahead measured
 * better than one or three; to L2 (_MM_HINT_T1) rather than L1, whose few miss buffers
 * would hold up the loads the compute needs now. */
#define PREFETCH_BLOCKS 2
#define PREFETCH_LOCALITY 2
#define PV_KEYS 4 /* values accumulated per pass over a head's accumulator (written out below) */

#include "exp_nonpositive.h"

/* For the tests: exp_nonpositive over an array. */
void decode_exp(const float *x, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) y[i] = exp_nonpositive(x[i]);
}

/* Requests lines [from, to) of a range of `floats` floats, clipped to it. */
static inline void prefetch_lines(const float *p, int64_t floats, int64_t from, int64_t to)
{
    for (int64_t i = from * LINE_FLOATS; i < to * LINE_FLOATS && i < floats; i += LINE_FLOATS)
        __builtin_prefetch(p + i, 0, PREFETCH_LOCALITY);
}

/* The block PREFETCH_BLOCKS after block `i` of this row, continuing into the next row
 * (next_len 0: none); -1 past both. *tokens: how many of its slots are filled. */
static inline int64_t block_ahead(const int32_t *table, int64_t len, const int32_t *next_table, int64_t next_len,
                                  int64_t i, int block_size, int64_t *tokens)
{
    int64_t pos = (i + PREFETCH_BLOCKS) * block_size;
    if (pos >= len) {
        pos -= (len + block_size - 1) / block_size * block_size;
        table = next_table;
        len = next_len;
        if (pos >= len) return -1;
    }
    *tokens = len - pos < block_size ? len - pos : block_size;
    return table[pos / block_size];
}

/* One row. Inlined with head_dim a constant for the common sizes (see paged_decode), so
 * the loops over it unroll and a query stays in registers across the block's keys. */
static inline __attribute__((always_inline)) void decode_row(
    const float *q, int64_t q_head_stride,
    const float *k_cache, const float *v_cache,
    int64_t block_stride, int64_t slot_stride, int64_t head_stride,
    const int32_t *table, int64_t len, const int32_t *next_table, int64_t next_len,
    int kv_heads, int group, const int head_dim, int block_size, float scale,
    float *out, int64_t out_head_stride)
{
    const int q_heads = kv_heads * group;
    float qs[MAX_STATE], acc[MAX_STATE]; /* [q_heads][head_dim] */
    float m[MAX_Q_HEADS], l[MAX_Q_HEADS];
    float s[MAX_BLOCK], pv[MAX_STATE]; /* a block's weights, its weighted values (head_dim) */

    for (int hq = 0; hq < q_heads; hq++) {
        for (int d = 0; d < head_dim; d++) {
            qs[hq * head_dim + d] = q[(int64_t)hq * q_head_stride + d] * scale;
            acc[hq * head_dim + d] = 0.0f;
        }
        m[hq] = -INFINITY;
        l[hq] = 0.0f;
    }
    for (int64_t i = 0; i * block_size < len; i++) {
        const int64_t block = table[i];
        const int n = (int)(len - i * block_size < block_size ? len - i * block_size : block_size);
        const float *kb = k_cache + block * block_stride;
        const float *vb = v_cache + block * block_stride;
        /* The block ahead is asked for a slice per query head, spread over this block's
         * compute: memory stays busy without the compute stalling behind a burst. */
        int64_t ahead_tokens = 0;
        const int64_t ahead = block_ahead(table, len, next_table, next_len, i, block_size, &ahead_tokens);
        const int64_t ahead_floats = ahead < 0 ? 0 : ahead_tokens * slot_stride;
        const int64_t ahead_lines = (ahead_floats + LINE_FLOATS - 1) / LINE_FLOATS;
        const float *kn = k_cache + (ahead < 0 ? 0 : ahead) * block_stride;
        const float *vn = v_cache + (ahead < 0 ? 0 : ahead) * block_stride;

        for (int hq = 0; hq < q_heads; hq++) {
            const int h = hq / group;
            const float *kh = kb + (int64_t)h * head_stride;
            const float *vh = vb + (int64_t)h * head_stride;
            const float *qh = qs + hq * head_dim;
            float *a = acc + hq * head_dim;
            const int64_t from = ahead_lines * hq / q_heads, to = ahead_lines * (hq + 1) / q_heads;

            prefetch_lines(kn, ahead_floats, from, to);
            float block_max = -INFINITY;
            for (int t = 0; t < n; t++) {
                const float *krow = kh + t * slot_stride;
                float dot = 0.0f;
                for (int d = 0; d < head_dim; d++) dot += qh[d] * krow[d];
                s[t] = dot;
                block_max = dot > block_max ? dot : block_max;
            }
            const float m_new = block_max > m[hq] ? block_max : m[hq];
            const float alpha = exp_nonpositive(m[hq] - m_new); /* 0 on the first block: m = -inf */
            float sum = 0.0f;
            for (int t = 0; t < n; t++) {
                s[t] = exp_nonpositive(s[t] - m_new);
                sum += s[t];
            }
            l[hq] = l[hq] * alpha + sum;
            m[hq] = m_new;

            /* The block's values are summed apart, PV_KEYS keys at a time (pv[] is loaded and
             * stored once per PV_KEYS keys, not once per key: a chain through memory that
             * bounded this loop), and added to the rescaled accumulator once: summed into it
             * directly, each key would be rounded against the sum of the whole context before
             * it, an error that grows with the context (5x torch's at 4,096 keys). */
            prefetch_lines(vn, ahead_floats, from, to);
            for (int d = 0; d < head_dim; d++) pv[d] = 0.0f;
            int t = 0;
            for (; t + PV_KEYS <= n; t += PV_KEYS) {
                const float *v0 = vh + t * slot_stride, *v1 = v0 + slot_stride;
                const float *v2 = v1 + slot_stride, *v3 = v2 + slot_stride;
                const float w0 = s[t], w1 = s[t + 1], w2 = s[t + 2], w3 = s[t + 3];
                for (int d = 0; d < head_dim; d++) pv[d] += (w0 * v0[d] + w1 * v1[d]) + (w2 * v2[d] + w3 * v3[d]);
            }
            for (; t < n; t++) {
                const float *vrow = vh + t * slot_stride;
                const float w = s[t];
                for (int d = 0; d < head_dim; d++) pv[d] += w * vrow[d];
            }
            for (int d = 0; d < head_dim; d++) a[d] = a[d] * alpha + pv[d];
        }
    }
    for (int hq = 0; hq < q_heads; hq++) {
        const float inv = l[hq] > 0.0f ? 1.0f / l[hq] : 0.0f;
        for (int d = 0; d < head_dim; d++) out[(int64_t)hq * out_head_stride + d] = acc[hq * head_dim + d] * inv;
    }
}

void paged_decode(
    const float *q, int64_t q_token_stride, int64_t q_head_stride,
    const float *k_cache, const float *v_cache,
    int64_t block_stride, int64_t slot_stride, int64_t head_stride,
    const int32_t *block_tables, int64_t table_stride,
    const int64_t *row_req, const int64_t *row_token, const int64_t *row_len,
    int64_t row_begin, int64_t row_end,
    int kv_heads, int group, int head_dim, int block_size, float scale,
    float *out, int64_t out_token_stride, int64_t out_head_stride)
{
    for (int64_t r = row_begin; r < row_end; r++) {
        const int32_t *table = block_tables + row_req[r] * table_stride;
        const int last = r + 1 == row_end;
        const int32_t *next_table = last ? table : block_tables + row_req[r + 1] * table_stride;
        const int64_t next_len = last ? 0 : row_len[r + 1];
        const float *qr = q + row_token[r] * q_token_stride;
        float *orow = out + row_token[r] * out_token_stride;
#define ROW(dim) decode_row(qr, q_head_stride, k_cache, v_cache, block_stride, slot_stride, head_stride, table, \
                            row_len[r], next_table, next_len, kv_heads, group, dim, block_size, scale, orow, \
                            out_head_stride)
        switch (head_dim) { /* the common head sizes get their own unrolled copies */
        case 64: ROW(64); break;
        case 128: ROW(128); break;
        default: ROW(head_dim);
        }
#undef ROW
    }
}

/* paged_decode over `parts` ranges of rows, [bounds[i], bounds[i + 1]), one an OpenMP thread.
 * The threads are torch's own (the loader reuses its libgomp): the team that ran the last
 * matmul is still spinning for work, so Python threads would have to share the cores with it. */
void paged_decode_parts(
    const float *q, int64_t q_token_stride, int64_t q_head_stride,
    const float *k_cache, const float *v_cache,
    int64_t block_stride, int64_t slot_stride, int64_t head_stride,
    const int32_t *block_tables, int64_t table_stride,
    const int64_t *row_req, const int64_t *row_token, const int64_t *row_len,
    const int64_t *bounds, int parts,
    int kv_heads, int group, int head_dim, int block_size, float scale,
    float *out, int64_t out_token_stride, int64_t out_head_stride)
{
#pragma omp parallel for schedule(static, 1) num_threads(parts)
    for (int i = 0; i < parts; i++)
        paged_decode(q, q_token_stride, q_head_stride, k_cache, v_cache, block_stride, slot_stride, head_stride,
                     block_tables, table_stride, row_req, row_token, row_len, bounds[i], bounds[i + 1], kv_heads,
                     group, head_dim, block_size, scale, out, out_token_stride, out_head_stride);
}

/* The K and V rows of `tokens` new tokens into their cache slots: token t's row (kv_heads x
 * head_dim floats, contiguous in the source and in a slot) goes to slot slots[t] = block *
 * block_size + offset. torch's two-index assignment does this at ~0.5 ms a layer for a
 * 2,000-token prefill; a copy per row is ~20x less. Tokens are split over OpenMP threads;
 * the slots of one step are distinct, so no two threads write one row. */
void write_kv_rows(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t tokens,
                   const int64_t *slots, float *k_cache, float *v_cache, int64_t block_stride,
                   int64_t slot_stride, int block_size, int64_t row)
{
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t at = slots[t] / block_size * block_stride + slots[t] % block_size * slot_stride;
        memcpy(k_cache + at, k + t * k_stride, row * sizeof(float));
        memcpy(v_cache + at, v + t * v_stride, row * sizeof(float));
    }
}
