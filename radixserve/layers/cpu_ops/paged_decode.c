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

#include "bf16.h"

#define CHUNK 256

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
        for (int i = 0; i < n; i++) sj[i] = expf(sj[i] - m);
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

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 K/V elements as float32, from a float32 or bfloat16 row */
static inline __attribute__((always_inline)) __m512 load16(const void *row, int bf16, int d) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d))), 16));
    return _mm512_loadu_ps((const float *)row + d);
}

#define MAX_DV 16 /* D up to 256 */

/* e^x for 16 floats (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n by
 * scalef), within 2 ulp of expf over the range softmax uses (x <= 0). glibc's scalar expf (its vector variant is
 * only declared under -ffast-math) made the softmax the larger half of a long-context step. */
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f)); /* below: e^x under the smallest normal float, taken as ~0 */
    x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* s[i] = e^(s[i] - m) for i < n; returns their sum */
static inline __attribute__((always_inline)) float exp_sum512(float *s, int n, float m) {
    const __m512 mv = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
        _mm512_storeu_ps(s + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
        _mm512_mask_storeu_ps(s + i, k, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
    }
    return _mm512_reduce_add_ps(acc);
}

/* The same item with explicit AVX-512 (D a multiple of 16, G <= 8): each K/V row is loaded (and widened from
 * bf16) once and used by all G heads of its group, and the G dot products of a token are reduced together. */
static inline __attribute__((always_inline)) void attend_chunk_avx512(
    const float *q, const void *k_pool, const void *v_pool, int bf16, const int32_t *slots, int64_t t0, int64_t t1,
    int64_t row_elems, int64_t head_off, const int G, const int D, float scale, float *m_out, float *l_out,
    float *acc) {
    const int n = (int)(t1 - t0), nv = D / 16, esz = bf16 ? 2 : 4;
    float s[8 * CHUNK];
    __m512 qv[8][MAX_DV];
    for (int j = 0; j < G; j++)
        for (int c = 0; c < nv; c++) qv[j][c] = _mm512_mul_ps(_mm512_loadu_ps(q + (int64_t)j * D + 16 * c),
                                                              _mm512_set1_ps(scale));
    for (int i = 0; i < n; i++) {
        const char *row = (const char *)k_pool + ((int64_t)slots[t0 + i] * row_elems + head_off) * esz;
        if (i + PREFETCH < n) prefetch_row(k_pool, bf16, (int64_t)slots[t0 + i + PREFETCH] * row_elems + head_off, D);
        __m512 a[8];
        for (int j = 0; j < G; j++) a[j] = _mm512_setzero_ps();
        for (int c = 0; c < nv; c++) {
            const __m512 kv = load16(row, bf16, 16 * c);
            for (int j = 0; j < G; j++) a[j] = _mm512_fmadd_ps(qv[j][c], kv, a[j]);
        }
        for (int j = 0; j < G; j++) s[j * CHUNK + i] = _mm512_reduce_add_ps(a[j]);
    }
    for (int j = 0; j < G; j++) {
        float m = -INFINITY;
        float *sj = s + j * CHUNK;
        for (int i = 0; i < n; i++) m = sj[i] > m ? sj[i] : m;
        m_out[j] = m;
        l_out[j] = exp_sum512(sj, n, m);
    }
    __m512 o[8][MAX_DV];
    for (int j = 0; j < G; j++)
        for (int c = 0; c < nv; c++) o[j][c] = _mm512_setzero_ps();
    for (int i = 0; i < n; i++) {
        const char *row = (const char *)v_pool + ((int64_t)slots[t0 + i] * row_elems + head_off) * esz;
        if (i + PREFETCH < n) prefetch_row(v_pool, bf16, (int64_t)slots[t0 + i + PREFETCH] * row_elems + head_off, D);
        for (int c = 0; c < nv; c++) {
            const __m512 vv = load16(row, bf16, 16 * c);
            for (int j = 0; j < G; j++) o[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[j * CHUNK + i]), vv, o[j][c]);
        }
    }
    for (int j = 0; j < G; j++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(acc + (int64_t)j * D + 16 * c, o[j][c]);
}
#endif

static void attend_chunk(const float *q, const void *k_pool, const void *v_pool, int bf16, const int32_t *slots,
                         int64_t t0, int64_t t1, int64_t row_elems, int64_t head_off, int G, int D, float scale,
                         float *m_out, float *l_out, float *acc) {
#if defined(__AVX512F__)
#define CALL512(GG, DD) attend_chunk_avx512(q, k_pool, v_pool, bf16, slots, t0, t1, row_elems, head_off, GG, DD, \
                                            scale, m_out, l_out, acc)
    if (D == 64 || D == 128) {
        switch (G * 1000 + D) {
        case 1064: CALL512(1, 64); return;
        case 2064: CALL512(2, 64); return;
        case 3064: CALL512(3, 64); return;
        case 4064: CALL512(4, 64); return;
        case 1128: CALL512(1, 128); return;
        case 2128: CALL512(2, 128); return;
        case 4128: CALL512(4, 128); return;
        case 8128: CALL512(8, 128); return;
        default: break;
        }
    }
    if (D % 16 == 0 && D <= 16 * MAX_DV && G <= 8) {
        CALL512(G, D);
        return;
    }
#undef CALL512
#endif
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
    /* items: (request, chunk of tokens), every KV head of the chunk in turn, so that a chunk's K/V rows (all heads
     * of a token are adjacent in the pool) stream from memory once and the later heads read them from cache */
    int64_t n_items = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = ends[b] - starts[b];
        n_items += len > 0 ? (len + CHUNK - 1) / CHUNK : 0;
    }
    item_t *items = malloc(sizeof(item_t) * (size_t)(n_items > 0 ? n_items : 1));
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(B + 1)); /* first item of each request */
    float *part = malloc(sizeof(float) * (size_t)(n_items > 0 ? n_items : 1) * HKV * G * (D + 2));
    if (!items || !first || !part) {
        free(items); free(first); free(part);
        return 1;
    }
    int64_t k = 0;
    for (int64_t b = 0; b < B; b++) {
        first[b] = k;
        for (int64_t t = starts[b]; t < ends[b]; t += CHUNK, k++) {
            items[k].b = b;
            items[k].g = 0;
            items[k].t0 = t;
            items[k].t1 = t + CHUNK < ends[b] ? t + CHUNK : ends[b];
        }
    }
    first[B] = k;
    const int64_t row_elems = (int64_t)HKV * D;
    const int64_t part_sz = (int64_t)G * (D + 2); /* per (item, KV head): [G] max, [G] sum, [G, D] acc */

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < n_items; i++) {
        const item_t it = items[i];
        for (int g = 0; g < HKV; g++) {
            float *p = part + (i * HKV + g) * part_sz;
            attend_chunk(q + (it.b * H + g * G) * (int64_t)D, k_pool, v_pool, bf16, table + rows[it.b] * table_stride,
                         it.t0, it.t1, row_elems, (int64_t)g * D, G, D, scale, p, p + G, p + 2 * G);
        }
    }

#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t bg = 0; bg < B * HKV; bg++) {
        const int64_t b = bg / HKV, g = bg % HKV, lo = first[b], hi = first[b + 1];
        float *o = out + bg * (int64_t)G * D; /* heads g*G .. g*G+G-1 of request b are contiguous */
        for (int j = 0; j < G; j++) {
            float *oj = o + (int64_t)j * D;
            if (lo == hi) { /* nothing to attend to */
                memset(oj, 0, sizeof(float) * (size_t)D);
                continue;
            }
            float m = -INFINITY;
            for (int64_t c = lo; c < hi; c++) {
                const float mc = part[(c * HKV + g) * part_sz + j];
                m = mc > m ? mc : m;
            }
            float l = 0.f;
            memset(oj, 0, sizeof(float) * (size_t)D);
            for (int64_t c = lo; c < hi; c++) {
                const float *p = part + (c * HKV + g) * part_sz;
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
