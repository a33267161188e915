/* Greedy decoding's argmax over the rows of float32 logits [B, V], rows split between the threads: torch.argmax
 * took 0.66 ms for 32 x 49,152 on two threads, one pass over 6 MB.
 *
 * Same answer as torch.argmax: the first index of the largest value; a row holding a NaN answers its first NaN.
 *   logits rows `stride` elements apart; out [B] int64.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static int64_t row_argmax_scalar(const float *x, int64_t V) {
    int64_t best = 0;
    for (int64_t i = 0; i < V; i++) {
        if (isnan(x[i])) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

static int64_t row_argmax(const float *x, int64_t V) {
#if defined(__AVX512F__)
    if (V < 16 || isnan(x[0])) return row_argmax_scalar(x, V);
    __m512 best = _mm512_loadu_ps(x);
    __m512i best_i = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i idx = best_i;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t i = 16;
    for (; i + 16 <= V; i += 16) {
        idx = _mm512_add_epi32(idx, step);
        const __m512 v = _mm512_loadu_ps(x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ); /* strictly greater: a lane keeps its first */
        best = _mm512_mask_mov_ps(best, gt, v);
        best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
    }
    if (nan || V > INT32_MAX) return row_argmax_scalar(x, V);
    const float m = _mm512_reduce_max_ps(best);
    const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
    int64_t arg = _mm512_mask_reduce_min_epi32(at, best_i);
    for (; i < V; i++) { /* the tail, after every vector lane: a later index wins only if strictly larger */
        if (isnan(x[i])) return row_argmax_scalar(x, V);
        if (x[i] > x[arg]) arg = i;
    }
    return arg;
#else
    return row_argmax_scalar(x, V);
#endif
}

int argmax_rows(const float *logits, int64_t stride, int64_t B, int64_t V, int64_t *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(B > 1 ? num_threads : 1)
    for (int64_t b = 0; b < B; b++) out[b] = row_argmax(logits + b * stride, V);
    return 0;
}
