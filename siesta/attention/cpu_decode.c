/* Paged decode attention on the CPU, reading K/V where they lie in the block-first cache.
 *
 * The torch path gathers every row's K/V into a fresh tensor before SDPA reads them
 * again: three passes over the bytes that decode is bound by. Here each (row, KV head)
 * walks its block table once, a block at a time: the GROUP query heads that share the
 * KV head score the block's keys, the online softmax rescales once per block, and the
 * block's values are accumulated. fp32 throughout.
 *
 * Rows [row_begin, row_end) of the arrays are done by this call; callers split the rows
 * over threads (the call holds no lock and writes only its rows' outputs).
 */
#include <math.h>
#include <stdint.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 128

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
    float qs[MAX_GROUP][MAX_HEAD_DIM];
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float scores[MAX_GROUP][MAX_BLOCK];
    float m[MAX_GROUP], l[MAX_GROUP];

    for (int64_t r = row_begin; r < row_end; r++) {
        const int32_t *table = block_tables + row_req[r] * table_stride;
        const int64_t token = row_token[r], len = row_len[r];
        for (int h = 0; h < kv_heads; h++) {
            for (int g = 0; g < group; g++) {
                const float *qrow = q + token * q_token_stride + (int64_t)(h * group + g) * q_head_stride;
                for (int d = 0; d < head_dim; d++) {
                    qs[g][d] = qrow[d] * scale;
                    acc[g][d] = 0.0f;
                }
                m[g] = -INFINITY;
                l[g] = 0.0f;
            }
            for (int64_t start = 0; start < len; start += block_size) {
                const int64_t block = table[start / block_size];
                const int n = (int)(len - start < block_size ? len - start : block_size);
                const float *kb = k_cache + block * block_stride + (int64_t)h * head_stride;
                const float *vb = v_cache + block * block_stride + (int64_t)h * head_stride;
                for (int g = 0; g < group; g++) {
                    float block_max = -INFINITY;
                    for (int t = 0; t < n; t++) {
                        const float *krow = kb + t * slot_stride;
                        float s = 0.0f;
                        for (int d = 0; d < head_dim; d++) s += qs[g][d] * krow[d];
                        scores[g][t] = s;
                        block_max = s > block_max ? s : block_max;
                    }
                    const float m_new = block_max > m[g] ? block_max : m[g];
                    const float alpha = expf(m[g] - m_new); /* 0 on the first block: m = -inf */
                    float sum = 0.0f;
                    for (int t = 0; t < n; t++) {
                        scores[g][t] = expf(scores[g][t] - m_new);
                        sum += scores[g][t];
                    }
                    l[g] = l[g] * alpha + sum;
                    m[g] = m_new;
                    for (int d = 0; d < head_dim; d++) acc[g][d] *= alpha;
                    for (int t = 0; t < n; t++) {
                        const float *vrow = vb + t * slot_stride;
                        const float p = scores[g][t];
                        for (int d = 0; d < head_dim; d++) acc[g][d] += p * vrow[d];
                    }
                }
            }
            for (int g = 0; g < group; g++) {
                float *orow = out + token * out_token_stride + (int64_t)(h * group + g) * out_head_stride;
                const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
                for (int d = 0; d < head_dim; d++) orow[d] = acc[g][d] * inv;
            }
        }
    }
}
