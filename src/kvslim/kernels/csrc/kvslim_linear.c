/* kvslim's linear layer for a decode step's few rows: y (R, O) = x (R, I) @ W^T + b, W an nn.Linear weight (O, I).
 *
 * Why. A decode step multiplies a handful of rows by every weight of the model: the weights are read once a step
 * and each is used R times, so at R = 1 the product is a stream over the weights and at R = 16 little more. On an
 * AMD EPYC (Zen 4) torch's linear (MKL) streams them at 8-10 GB/s and oneDNN at 10-15 GB/s, where the machine
 * sums a float32 tensor at ~30 GB/s a step's size (docs/performance.md, "kvslim's linear layers"). Here each
 * weight row is dotted with the rows of x in registers, read once for every row of a tile.
 *
 * Bits. Every output y[r, o] is one dot product in one fixed order, whatever else is computed beside it: LANES
 * partial sums (16 with AVX-512, 8 with AVX2), lane j summing x[r, i] * W[o, i] over i = j, j + LANES, ... in
 * increasing i with fused multiply-adds (a tail of I % LANES reads zeros in the lanes past I), the lanes then
 * summed in a fixed tree, then + b[o]. The tile a product falls in (how many rows and outputs share its loads),
 * the number of rows in the call and the thread that runs it change which registers hold it, never its
 * arithmetic: a row's result is bit-identical whatever rows share the call (tests/test_linear_c.py), so the engine's
 * filler rows are not needed for it. The order differs from a BLAS' and between AVX-512 and AVX2 (a few units in
 * the last place against torch's linear; the bits follow the machine's instruction set, as with any BLAS).
 *
 * args (int64): x, R, I, x's row stride, W, O, W's row stride, b (0: none), y, y's row stride, threads; x, W, b, y
 * float32 with contiguous rows. Returns 0, or -1 where built without AVX2 and FMA (the caller uses torch's linear).
 */
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* Outputs per tile, rows per tile, and rows per chunk (a chunk of x stays in L2 while the weights pass by). */
#define LIN_OT 6
#define LIN_RT 4
#define LIN_RC 64
/* Below this many multiply-adds a call runs on the calling thread alone (no fork/join for a tiny product). */
#define LIN_MIN_PARALLEL 65536

typedef struct {
    const float *x, *w, *b;
    float *y;
    int64_t R, I, xs, O, ws, ys;
} lin_args;

#if defined(__AVX512F__)
#define LIN_LANES 16
typedef __m512 lin_vec;
#define LIN_ZERO() _mm512_setzero_ps()
#define LIN_LOAD(p) _mm512_loadu_ps(p)
#define LIN_LOAD_TAIL(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1u), (p))
#define LIN_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
/* The 16 lanes summed: halves, then halves of those (a fixed tree). */
static inline float lin_sum(__m512 v) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define LIN_LANES 8
typedef __m256 lin_vec;
#define LIN_ZERO() _mm256_setzero_ps()
#define LIN_LOAD(p) _mm256_loadu_ps(p)
static inline __m256 lin_load_tail(const float *p, int n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
}
#define LIN_LOAD_TAIL(p, n) lin_load_tail((p), (n))
#define LIN_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
static inline float lin_sum(__m256 v) {
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}
#endif

#ifdef LIN_LANES
#if LIN_LANES == 8
/* AVX2 has 16 vector registers: tiles of 2 rows x 4 outputs (8 sums, 4 weights, 1 row of x). */
#undef LIN_OT
#define LIN_OT 4
#undef LIN_RT
#define LIN_RT 2
#endif

/* Rows r0 .. r0 + RT of x against outputs o0 .. o0 + OT of W, over all of I (the fixed order above). pf: the next
 * weight rows to fetch while these are used (NULL: none). */
#define LIN_TILE(RT, OT)                                                                                              \
    static inline void lin_tile_##RT##_##OT(const lin_args *a, int64_t r0, int64_t o0, const float *pf) {           \
        lin_vec acc[RT][OT];                                                                                        \
        const float *w = a->w + o0 * a->ws, *x = a->x + r0 * a->xs;                                                 \
        for (int r = 0; r < RT; r++)                                                                                \
            for (int o = 0; o < OT; o++) acc[r][o] = LIN_ZERO();                                                    \
        int64_t i = 0;                                                                                              \
        for (; i + LIN_LANES <= a->I; i += LIN_LANES) {                                                             \
            lin_vec wv[OT];                                                                                         \
            for (int o = 0; o < OT; o++) wv[o] = LIN_LOAD(w + o * a->ws + i);                                       \
            if (pf)                                                                                                 \
                for (int o = 0; o < OT; o++) _mm_prefetch((const char *)(pf + o * a->ws + i), _MM_HINT_T0);         \
            for (int r = 0; r < RT; r++) {                                                                          \
                const lin_vec xv = LIN_LOAD(x + r * a->xs + i);                                                     \
                for (int o = 0; o < OT; o++) acc[r][o] = LIN_FMA(xv, wv[o], acc[r][o]);                             \
            }                                                                                                       \
        }                                                                                                           \
        if (i < a->I) {                                                                                             \
            const int n = (int)(a->I - i);                                                                          \
            lin_vec wv[OT];                                                                                         \
            for (int o = 0; o < OT; o++) wv[o] = LIN_LOAD_TAIL(w + o * a->ws + i, n);                               \
            for (int r = 0; r < RT; r++) {                                                                          \
                const lin_vec xv = LIN_LOAD_TAIL(x + r * a->xs + i, n);                                             \
                for (int o = 0; o < OT; o++) acc[r][o] = LIN_FMA(xv, wv[o], acc[r][o]);                             \
            }                                                                                                       \
        }                                                                                                           \
        for (int r = 0; r < RT; r++)                                                                                \
            for (int o = 0; o < OT; o++) {                                                                          \
                const float s = lin_sum(acc[r][o]);                                                                 \
                a->y[(r0 + r) * a->ys + o0 + o] = a->b ? s + a->b[o0 + o] : s;                                      \
            }                                                                                                       \
    }

#define LIN_TILE_OF(RT, OT) LIN_TILE(RT, OT) /* (expands LIN_RT and LIN_OT first) */
LIN_TILE_OF(LIN_RT, LIN_OT)
LIN_TILE_OF(1, LIN_OT)
LIN_TILE_OF(LIN_RT, 1)
LIN_TILE(1, 1)

#define LIN_CAT(a, b, c) a##b##_##c
#define LIN_NAME(RT, OT) LIN_CAT(lin_tile_, RT, OT)

/* Output blocks ob0 .. ob1 (of LIN_OT outputs; the last may be shorter) for every row, a chunk of rows at a time. */
static void lin_range(const lin_args *a, int64_t ob0, int64_t ob1) {
    for (int64_t r0 = 0; r0 < a->R; r0 += LIN_RC) {
        const int64_t r1 = r0 + LIN_RC < a->R ? r0 + LIN_RC : a->R;
        for (int64_t ob = ob0; ob < ob1; ob++) {
            const int64_t o = ob * LIN_OT;
            if (o + LIN_OT <= a->O) {
                /* the next block's weights are fetched while the chunk's first rows use these */
                const float *pf = ob + 1 < ob1 && o + 2 * LIN_OT <= a->O ? a->w + (o + LIN_OT) * a->ws : 0;
                int64_t r = r0;
                for (; r + LIN_RT <= r1; r += LIN_RT) LIN_NAME(LIN_RT, LIN_OT)(a, r, o, r == r0 ? pf : 0);
                for (; r < r1; r++) LIN_NAME(1, LIN_OT)(a, r, o, r == r0 ? pf : 0);
            } else {
                for (int64_t oo = o; oo < a->O; oo++) {
                    int64_t r = r0;
                    for (; r + LIN_RT <= r1; r += LIN_RT) LIN_NAME(LIN_RT, 1)(a, r, oo, 0);
                    for (; r < r1; r++) lin_tile_1_1(a, r, oo, 0);
                }
            }
        }
    }
}
#endif

int kv_linear(const int64_t *args) {
#ifdef LIN_LANES
    const lin_args a = {
        .x = (const float *)(intptr_t)args[0], .R = args[1], .I = args[2], .xs = args[3],
        .w = (const float *)(intptr_t)args[4], .O = args[5], .ws = args[6],
        .b = (const float *)(intptr_t)args[7], .y = (float *)(intptr_t)args[8], .ys = args[9],
    };
    const int64_t nob = (a.O + LIN_OT - 1) / LIN_OT;
    int nt = (int)args[10];
    if (nt < 1 || a.R * a.O * a.I < LIN_MIN_PARALLEL) nt = 1;
    if ((int64_t)nt > nob) nt = (int)nob;
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
            const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
            lin_range(&a, nob * t / n, nob * (t + 1) / n);
        }
        return 0;
    }
#endif
    lin_range(&a, 0, nob);
    return 0;
#else
    (void)args;
    return -1;
#endif
}
