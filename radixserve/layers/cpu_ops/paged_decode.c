/* Paged decode attention on the CPU: one query token per request, keys and values read in place from the KV pool
 * through the request table (no gather, no copy), every K/V row read once per step.
 *
 * Layout (all contiguous):
 *   q        [B, H, D]            float32
 *   k_pool   [S, HKV, D]          float32 or bfloat16 (raw uint16)
 *   v_pool   [S, HKV, D]          same dtype as k_pool
 *   table    [R, C]               int32: request slot -> KV slot of each token
 *   rows     [B]                  int64: request slot of each query
 *   starts   [B], ends [B]        int64: query b attends tokens [starts[b], ends[b]) of its row (a sliding window
 *                                 moves starts; ends = seq_len)
 *   out      [B, H, D]            float32
 * Query heads h = g * G + j (j < G = H / HKV) share KV head g, as in grouped-query attention.
 *
 * Work is split flash-decoding style into (request, KV head, chunk of CHUNK tokens) items run in parallel; each
 * item keeps its running max, sum of exponentials and weighted sum of values for the G heads of its group, and a
 * second parallel pass merges the chunks of each (request, KV head).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 256

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

/* Slots are scattered through the pool (a request's tokens interleave with its batch neighbours'), which the
 * hardware prefetcher cannot follow: ask for the row PREFETCH tokens ahead while this one is being used. */
#define PREFETCH 8

static inline void prefetch_row(const void *pool, int bf16, int64_t elem, int D) {
    const char *p = (const char *)pool + elem * (bf16 ? 2 : 4);
    const int bytes = D * (bf16 ? 2 : 4);
    for (int off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 0);
}

typedef struct { int64_t b, g, t0, t1; } item_t;

/* One item: scores of G heads against tokens [t0, t1), then their softmax-weighted values (unnormalised).
 * Always inlined into `attend_chunk`, which calls it with the common head sizes as constants, so that the loops
 * over D compile to straight-line vector code. */
static inline __attribute__((always_inline)) void attend_chunk_impl(const float *q, const void *k_pool, const void *v_pool, int bf16, const int32_t *slots,
                         int64_t t0, int64_t t1, int64_t row_elems, int64_t head_off, int G, int D, float scale,
                         float *m_out, float *l_out, float *acc) {
    const int n = (int)(t1 - t0);
    float s[G * CHUNK];
    for (int i = 0; i < n; i++) {
        const int64_t base = (int64_t)slots[t0 + i] * row_elems + head_off;
        if (i + PREFETCH < n) prefetch_row(k_pool, bf16, (int64_t)slots[t0 + i + PREFETCH] * row_elems + head_off, D);
        for (int j = 0; j < G; j++) {
            const float *qj = q + (int64_t)j * D;
            float dot = 0.f;
            if (bf16) {
                const uint16_t *k = (const uint16_t *)k_pool + base;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; d++) dot += qj[d] * bf16_to_f32(k[d]);
            } else {
                const float *k = (const float *)k_pool + base;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; d++) dot += qj[d] * k[d];
            }
            s[j * CHUNK + i] = dot * scale;
        }
    }
    for (int j = 0; j < G; j++) {
        float m = -INFINITY, l = 0.f;
        float *sj = s + j * CHUNK;
#pragma omp simd reduction(max : m)
        for (int i = 0; i < n; i++) m = sj[i] > m ? sj[i] : m;
#pragma omp simd
        for (int i = 0; i < n; i++) sj[i] = expf(sj[i] - m); /* vector expf (libmvec) */
#pragma omp simd reduction(+ : l)
        for (int i = 0; i < n; i++) l += sj[i];
        m_out[j] = m;
        l_out[j] = l;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int i = 0; i < n; i++) {
        const int64_t base = (int64_t)slots[t0 + i] * row_elems + head_off;
        if (i + PREFETCH < n) prefetch_row(v_pool, bf16, (int64_t)slots[t0 + i + PREFETCH] * row_elems + head_off, D);
        for (int j = 0; j < G; j++) {
            const float p = s[j * CHUNK + i];
            float *aj = acc + (int64_t)j * D;
            if (bf16) {
                const uint16_t *v = (const uint16_t *)v_pool + base;
#pragma omp simd
                for (int d = 0; d < D; d++) aj[d] += p * bf16_to_f32(v[d]);
            } else {
                const float *v = (const float *)v_pool + base;
#pragma omp simd
                for (int d = 0; d < D; d++) aj[d] += p * v[d];
            }
        }
    }
}

static void attend_chunk(const float *q, const void *k_pool, const void *v_pool, int bf16, const int32_t *slots,
                         int64_t t0, int64_t t1, int64_t row_elems, int64_t head_off, int G, int D, float scale,
                         float *m_out, float *l_out, float *acc) {
#define CALL(DD) attend_chunk_impl(q, k_pool, v_pool, bf16, slots, t0, t1, row_elems, head_off, G, DD, scale, m_out, \
                                   l_out, acc)
    if (D == 64) CALL(64);
    else if (D == 128) CALL(128);
    else CALL(D);
#undef CALL
}

/* Returns 0 on success, 1 when out of memory, 2 for a group wider than the kernel supports. */
int paged_decode_attention(const float *q, const void *k_pool, const void *v_pool, int bf16, const int32_t *table,
                           int64_t table_stride, const int64_t *rows, const int64_t *starts, const int64_t *ends,
                           float *out, int64_t B, int H, int HKV, int D, float scale, int num_threads) {
    const int G = H / HKV;
    if (G < 1 || G > 64) return 2;
    int64_t n_items = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = ends[b] - starts[b];
        n_items += HKV * (len > 0 ? (len + CHUNK - 1) / CHUNK : 0);
    }
    item_t *items = malloc(sizeof(item_t) * (size_t)(n_items > 0 ? n_items : 1));
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(B * HKV + 1)); /* first item of each (b, g) */
    float *part = malloc(sizeof(float) * (size_t)(n_items > 0 ? n_items : 1) * G * (D + 2));
    if (!items || !first || !part) {
        free(items); free(first); free(part);
        return 1;
    }
    int64_t k = 0;
    for (int64_t b = 0; b < B; b++)
        for (int g = 0; g < HKV; g++) {
            first[b * HKV + g] = k;
            for (int64_t t = starts[b]; t < ends[b]; t += CHUNK, k++) {
                items[k].b = b;
                items[k].g = g;
                items[k].t0 = t;
                items[k].t1 = t + CHUNK < ends[b] ? t + CHUNK : ends[b];
            }
        }
    first[B * HKV] = k;
    const int64_t row_elems = (int64_t)HKV * D;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < n_items; i++) {
        const item_t it = items[i];
        float *p = part + i * G * (D + 2); /* [G] max, [G] sum, [G, D] acc */
        attend_chunk(q + (it.b * H + it.g * G) * (int64_t)D, k_pool, v_pool, bf16, table + rows[it.b] * table_stride,
                     it.t0, it.t1, row_elems, (int64_t)it.g * D, G, D, scale, p, p + G, p + 2 * G);
    }

#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t bg = 0; bg < B * HKV; bg++) {
        const int64_t lo = first[bg], hi = first[bg + 1];
        float *o = out + bg * (int64_t)G * D; /* heads g*G .. g*G+G-1 of request b are contiguous */
        for (int j = 0; j < G; j++) {
            float *oj = o + (int64_t)j * D;
            if (lo == hi) { /* nothing to attend to */
                memset(oj, 0, sizeof(float) * (size_t)D);
                continue;
            }
            float m = -INFINITY;
            for (int64_t c = lo; c < hi; c++) {
                const float mc = part[c * G * (D + 2) + j];
                m = mc > m ? mc : m;
            }
            float l = 0.f;
            memset(oj, 0, sizeof(float) * (size_t)D);
            for (int64_t c = lo; c < hi; c++) {
                const float *p = part + c * G * (D + 2);
                const float w = expf(p[j] - m);
                l += w * p[G + j];
                const float *a = p + 2 * G + (int64_t)j * D;
#pragma omp simd
                for (int d = 0; d < D; d++) oj[d] += w * a[d];
            }
            const float inv = 1.f / l;
            for (int d = 0; d < D; d++) oj[d] *= inv;
        }
    }
    free(items);
    free(first);
    free(part);
    return 0;
}
