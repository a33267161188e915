/* Paged decode attention on the CPU: one query token per request, keys and values read in place from the KV pool
 * through the request table (no gather, no copy), every K/V row read once per step.
 *
 * Layout (all contiguous):
 *   q        [B, H, D]            float32
 *   k_pool   [S, HKV, D]          float32, bfloat16 (raw uint16) or float8 e4m3fn (raw bytes; K = k_scale * stored)
 *   v_pool   [S, HKV, D]          same dtype as k_pool (V = v_scale * stored)
 *   table    [R, C]               int32: request slot -> KV slot of each token
 *   rows     [B]                  int64: request slot of each query
 *   starts   [B], ends [B]        int64: query b attends tokens [starts[b], ends[b]) of its row (a sliding window
 *                                 moves starts; ends = seq_len)
 *   out      [B, H, D]            float32
 * Query heads h = g * G + j (j < G = H / HKV) share KV head g, as in grouped-query attention.
 *
 * Work is split flash-decoding style into (request, chunk of CHUNK tokens) items run in parallel, the KV heads of
 * a chunk in turn; each (item, KV head) keeps its running max, sum of exponentials and weighted sum of values for
 * the G heads of its group, and a second parallel pass merges the chunks of each (request, KV head).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define CHUNK 256

enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2 }; /* the pool's element type */

static inline int kv_size(int kind) { return kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1; }

/* float8 e4m3fn (bias 7, no infinities) -> float32, exactly: the sign-extended byte shifted so that its 7 bits of
 * exponent and mantissa land at the top of float32's, which reads as the value times 2^-120 (subnormals included:
 * they become float32 subnormals), then rescaled. The NaN code (0x7f / 0xff) reads as +-480; a pool never holds it
 * (stores saturate to +-448). */
#define FP8_BITS(x) (((uint32_t)(int32_t)(x) << 20) & 0x87F00000u)
#define FP8_RAW_SCALE 0x1p120f /* value = float(FP8_BITS) * FP8_RAW_SCALE */

static inline float fp8_to_f32(uint8_t x) {
    union { uint32_t u; float f; } c = {FP8_BITS((int8_t)x)};
    return c.f * FP8_RAW_SCALE;
}

static inline float kv_elem(const void *row, int kind, int d) {
    if (kind == KV_F32) return ((const float *)row)[d];
    if (kind == KV_BF16) return bf16_to_f32(((const uint16_t *)row)[d]);
    return fp8_to_f32(((const uint8_t *)row)[d]);
}

/* Software prefetch of the rows ahead: slots are scattered through the pool (a request's tokens interleave with
 * its batch neighbours'), and even consecutive slots are read as one head's part of each token's row, strided,
 * which the hardware prefetchers follow too late. PF_BYTES of rows ahead into L2 (prefetcht1) took one
 * core's read rate (one thread, 30 layers at context 6,000: float32 27.4 -> 16.4 ms, bfloat16 14.6 -> 11.0 ms;
 * 8 rows ahead without keeping them in L2 before). */
#ifndef PF_BYTES
#define PF_BYTES 6144
#endif
#ifndef PF_LOCALITY
#define PF_LOCALITY 2
#endif

static inline void prefetch_row(const char *p, int bytes) {
    for (int off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, PF_LOCALITY);
}

typedef struct { int64_t b, t0, t1; } item_t;


/* One item: scores of G heads against tokens [t0, t1), then their softmax-weighted values (unnormalised), in plain
 * C for CPUs without AVX-512. Always inlined into `attend_chunk`, which calls it with the common head sizes as
 * constants, so that the loops over D compile to straight-line vector code. */
static inline __attribute__((always_inline)) void attend_chunk_impl(
    const float *q, const void *k_pool, const void *v_pool, int kind, const int32_t *slots, int64_t t0, int64_t t1,
    int64_t row_elems, int64_t head_off, int G, int D, float scale, float *m_out, float *l_out, float *acc) {
    const int n = (int)(t1 - t0), esz = kv_size(kind);
    float s[G * CHUNK];
    for (int i = 0; i < n; i++) {
        const char *k = (const char *)k_pool + ((int64_t)slots[t0 + i] * row_elems + head_off) * esz;
        for (int j = 0; j < G; j++) {
            const float *qj = q + (int64_t)j * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) dot += qj[d] * kv_elem(k, kind, d);
            s[j * CHUNK + i] = dot * scale;
        }
    }
    for (int j = 0; j < G; j++) {
        float m = -INFINITY, l = 0.f;
        float *sj = s + j * CHUNK;
        for (int i = 0; i < n; i++) m = sj[i] > m ? sj[i] : m;
        for (int i = 0; i < n; i++) sj[i] = expf(sj[i] - m);
        for (int i = 0; i < n; i++) l += sj[i];
        m_out[j] = m;
        l_out[j] = l;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int i = 0; i < n; i++) {
        const char *v = (const char *)v_pool + ((int64_t)slots[t0 + i] * row_elems + head_off) * esz;
        for (int j = 0; j < G; j++) {
            const float p = s[j * CHUNK + i];
            float *aj = acc + (int64_t)j * D;
#pragma omp simd
            for (int d = 0; d < D; d++) aj[d] += p * kv_elem(v, kind, d);
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 K/V elements as float32 from a float32 or bfloat16 row; from a float8 row, the value times 2^-120 (FP8_BITS;
 * the caller rescales) */
static inline __attribute__((always_inline)) __m512 load16(const char *row, const int kind, int d) {
    if (kind == KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d))), 16));
    if (kind == KV_FP8)
        return _mm512_castsi512_ps(_mm512_and_si512(
            _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d))), 20),
            _mm512_set1_epi32((int)0x87F00000u)));
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

static inline __mmask16 tail_mask(int left) { return (__mmask16)(left >= 16 ? 0xffffu : (1u << left) - 1u); }

/* max of s[0..n) */
static inline __attribute__((always_inline)) float max512(const float *s, int n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < n; i += 16)
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(n - i), s + i));
    return _mm512_reduce_max_ps(m);
}

/* s[i] = e^(s[i] - m) * post for i < n; returns the sum of e^(s[i] - m) */
static inline __attribute__((always_inline)) float exp_sum512(float *s, int n, float m, float post) {
    const __m512 mv = _mm512_set1_ps(m), pv = _mm512_set1_ps(post);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
        _mm512_mask_storeu_ps(s + i, k, _mm512_mul_ps(e, pv));
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
    }
    return _mm512_reduce_add_ps(acc);
}

/* The sums of 16 vectors at once: r[t] = sum of v[t]'s lanes (a transpose-and-add tree, 15 shuffle pairs instead
 * of 16 horizontal reductions). The tree leaves token t in lane 4 (t % 4) + t / 4, so it reads its inputs in that
 * (self-inverse) order. */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 *v) {
    static const int o[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) {
        const __m512 x = v[o[2 * i]], y = v[o[2 * i + 1]];
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

/* The G heads' partial dot products with one K row, as G vectors of 16 partial sums */
static inline __attribute__((always_inline)) void dot_row(__m512 *a, const char *row, const int kind, const int G,
                                                          const int D, __m512 qv[8][MAX_DV]) {
    for (int j = 0; j < G; j++) a[j] = _mm512_setzero_ps();
    for (int c = 0; c < D / 16; c++) {
        const __m512 kv = load16(row, kind, 16 * c);
        for (int j = 0; j < G; j++) a[j] = _mm512_fmadd_ps(qv[j][c], kv, a[j]);
    }
}

/* The same item with explicit AVX-512 (D a multiple of 16, G <= 8): each K/V row is loaded (and widened) once and
 * used by all G heads of its group; the dot products of 16 tokens are reduced together. `pre` multiplies q and
 * `post` the scores (and the probabilities before the values' sum, which the caller divides back out through
 * out_scale): float8 rows read as value x 2^-120, so its factors of 2^60 keep every product a normal float. */
static inline __attribute__((always_inline)) void attend_chunk_avx512(
    const float *q, const void *k_pool, const void *v_pool, const int kind, const int32_t *slots,
    int64_t t0, int64_t t1, int64_t row_elems, int64_t head_off, const int G, const int D, float pre, float post,
    float *m_out, float *l_out, float *acc) {
    const int n = (int)(t1 - t0), nv = D / 16, esz = kv_size(kind), row_bytes = D * esz;
    float s[8 * CHUNK];
    __m512 qv[8][MAX_DV];
    for (int j = 0; j < G; j++)
        for (int c = 0; c < nv; c++)
            qv[j][c] = _mm512_mul_ps(_mm512_loadu_ps(q + (int64_t)j * D + 16 * c), _mm512_set1_ps(pre));
    const __m512 postv = _mm512_set1_ps(post);
    const char *kbase = (const char *)k_pool + head_off * esz, *vbase = (const char *)v_pool + head_off * esz;
    const int64_t row_stride = row_elems * esz;
    const int ahead = PF_BYTES / row_bytes > 8 ? PF_BYTES / row_bytes : 8; /* rows prefetched ahead */
    for (int i = 0; i < ahead && i < n; i++) prefetch_row(kbase + (int64_t)slots[t0 + i] * row_stride, row_bytes);
    __m512 part[8 * 16]; /* [G][16 tokens] partial sums */
    const int nfull = n & ~15;
    for (int i0 = 0; i0 < nfull; i0 += 16) {
        for (int u = 0; u < 16; u++) {
            const int i = i0 + u;
            if (i + ahead < n) prefetch_row(kbase + (int64_t)slots[t0 + i + ahead] * row_stride, row_bytes);
            __m512 a[8];
            dot_row(a, kbase + (int64_t)slots[t0 + i] * row_stride, kind, G, D, qv);
            for (int j = 0; j < G; j++) part[j * 16 + u] = a[j];
        }
        for (int j = 0; j < G; j++)
            _mm512_storeu_ps(s + j * CHUNK + i0, _mm512_mul_ps(reduce16(part + j * 16), postv));
    }
    for (int i = nfull; i < n; i++) {
        __m512 a[8];
        dot_row(a, kbase + (int64_t)slots[t0 + i] * row_stride, kind, G, D, qv);
        for (int j = 0; j < G; j++) s[j * CHUNK + i] = _mm512_reduce_add_ps(a[j]) * post;
    }
    const float pscale = kind == KV_FP8 ? 0x1p60f : 1.f;
    for (int j = 0; j < G; j++) {
        float *sj = s + j * CHUNK;
        m_out[j] = max512(sj, n);
        l_out[j] = exp_sum512(sj, n, m_out[j], pscale);
    }
    __m512 o[8][MAX_DV];
    for (int j = 0; j < G; j++)
        for (int c = 0; c < nv; c++) o[j][c] = _mm512_setzero_ps();
    for (int i = 0; i < ahead && i < n; i++) prefetch_row(vbase + (int64_t)slots[t0 + i] * row_stride, row_bytes);
    for (int i = 0; i < n; i++) {
        const char *row = vbase + (int64_t)slots[t0 + i] * row_stride;
        if (i + ahead < n) prefetch_row(vbase + (int64_t)slots[t0 + i + ahead] * row_stride, row_bytes);
        for (int c = 0; c < nv; c++) {
            const __m512 vv = load16(row, kind, 16 * c);
            for (int j = 0; j < G; j++) o[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[j * CHUNK + i]), vv, o[j][c]);
        }
    }
    const __m512 oscale = _mm512_set1_ps(kind == KV_FP8 ? 0x1p60f : 1.f); /* sum p v, as the plain path */
    for (int j = 0; j < G; j++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(acc + (int64_t)j * D + 16 * c, _mm512_mul_ps(o[j][c], oscale));
}
#endif

static void attend_chunk(const float *q, const void *k_pool, const void *v_pool, int kind, const int32_t *slots,
                         int64_t t0, int64_t t1, int64_t row_elems, int64_t head_off, int G, int D, float scale, float *m_out, float *l_out, float *acc) {
#if defined(__AVX512F__)
    /* float8: q x 2^60 against rows read as value x 2^-120, the scores x 2^60 */
    const float pre = kind == KV_FP8 ? scale * 0x1p60f : scale, post = kind == KV_FP8 ? 0x1p60f : 1.f;
#define CALL512(K, GG, DD) attend_chunk_avx512(q, k_pool, v_pool, K, slots, t0, t1, row_elems, head_off, GG, DD, \
                                               pre, post, m_out, l_out, acc)
#define KINDS(GG, DD)                                                     \
    do {                                                                  \
        if (kind == KV_BF16) CALL512(KV_BF16, GG, DD);                    \
        else if (kind == KV_FP8) CALL512(KV_FP8, GG, DD);                 \
        else CALL512(KV_F32, GG, DD);                                     \
    } while (0)
    if (D == 64 || D == 128) {
        switch (G * 1000 + D) {
        case 1064: KINDS(1, 64); return;
        case 2064: KINDS(2, 64); return;
        case 3064: KINDS(3, 64); return;
        case 4064: KINDS(4, 64); return;
        case 1128: KINDS(1, 128); return;
        case 2128: KINDS(2, 128); return;
        case 4128: KINDS(4, 128); return;
        case 8128: KINDS(8, 128); return;
        default: break;
        }
    }
    if (D % 16 == 0 && D <= 16 * MAX_DV && G <= 8) {
        KINDS(G, D);
        return;
    }
#undef KINDS
#undef CALL512
#endif
#define CALL(DD) attend_chunk_impl(q, k_pool, v_pool, kind, slots, t0, t1, row_elems, head_off, G, DD, scale, m_out, \
                                   l_out, acc)
    if (D == 64) CALL(64);
    else if (D == 128) CALL(128);
    else CALL(D);
#undef CALL
}

/* kind: KV_F32, KV_BF16 or KV_FP8 (K, V = k_scale, v_scale x the stored values; 1 for the others).
 * Returns 0 on success, 1 when out of memory, 2 for a group wider than the kernel supports, 4 for an unknown kind. */
int paged_decode_attention(const float *q, const void *k_pool, const void *v_pool, int kind, const int32_t *table,
                           int64_t table_stride, const int64_t *rows, const int64_t *starts, const int64_t *ends,
                           float *out, int64_t B, int H, int HKV, int D, float scale, float k_scale, float v_scale,
                           int num_threads) {
    const int G = H / HKV;
    if (G < 1 || G > 64) return 2;
    if (kind != KV_F32 && kind != KV_BF16 && kind != KV_FP8) return 4;
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
            items[k].t0 = t;
            items[k].t1 = t + CHUNK < ends[b] ? t + CHUNK : ends[b];
        }
    }
    first[B] = k;
    const int64_t row_elems = (int64_t)HKV * D;
    const int64_t part_sz = (int64_t)G * (D + 2); /* per (item, KV head): [G] max, [G] sum, [G, D] acc */

    /* one item (a short context at batch 1): no team to start and join */
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_items > 1 ? num_threads : 1)
    for (int64_t i = 0; i < n_items; i++) {
        const item_t it = items[i];
        for (int g = 0; g < HKV; g++) {
            float *p = part + (i * HKV + g) * part_sz;
            attend_chunk(q + (it.b * H + g * G) * (int64_t)D, k_pool, v_pool, kind,
                         table + rows[it.b] * table_stride, it.t0, it.t1, row_elems, (int64_t)g * D, G, D,
                         scale * k_scale, p, p + G, p + 2 * G);
        }
    }

    /* the merge is G x D x chunks multiply-adds per (request, KV head): a team only for many of them */
#pragma omp parallel for schedule(static) num_threads(n_items > 16 ? num_threads : 1)
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
            const float inv = v_scale / l;
            for (int d = 0; d < D; d++) oj[d] *= inv;
        }
    }
    free(items);
    free(first);
    free(part);
    return 0;
}
