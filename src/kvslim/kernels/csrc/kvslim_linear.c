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
 * Threads. A step makes ~200 of these calls, a few hundred microseconds each at one row, with Python between them.
 * An OpenMP region under OMP_WAIT_POLICY=PASSIVE (kvslim's CLI default: it keeps torch's threads from spinning on a
 * shared machine) wakes its sleeping threads at every call: measured, that cost the whole gain of a second thread
 * at one row. So the call's other threads are this file's own workers, each spinning a bounded while for the next
 * call before it sleeps (kv_pool_spin; 50 us by default): short enough that an idle process leaves the CPU at
 * once, long enough to span the gap between a layer's products. A decode step at one row found the workers asleep
 * at ~75 of its ~270 calls, after 50-200 us of Python; a longer spin wins a few percent on a quiet machine and
 * loses more beside other work, so a caller that knows a call is coming restarts the spin instead (kv_pool_renew:
 * the direct paged step, three times a layer; docs/performance.md, "How long the workers spin"). The threads take a
 * call's output blocks a chunk at a time from a shared counter, and the caller does not wait for a worker that has
 * not joined the call by the time the caller's own part has taken the last chunk: on a machine shared with other
 * work, a worker still asleep or waking does not hold a call up (one descheduled after it joined still does, while
 * it is off its CPU; kv_pool_balance; docs/performance.md, "Work to whichever thread runs"). A call made while
 * another holds the workers (two Python threads at once) runs on its own thread alone. All give the same bits
 * (above). A fork's child starts its own workers.
 * kvslim_paged.c's attention runs its tasks on the same workers (kv_pool_run, at the end of this file), so a step's
 * products and attention calls keep the same threads awake.
 *
 * bfloat16 (kv_linear_bf16). x, W, b and y in bfloat16, on a CPU with AVX512-BF16 (Zen 4, Cooper Lake and
 * later): each lane's partial sum takes two products a step with VDPBF16PS (the pairs i, i + 1 of 32 elements), in
 * float32; the 16 lanes are summed in the same fixed tree, b[o] added in float32, and the sum rounded once to
 * bfloat16 (to nearest, ties to even), as torch's bfloat16 linear rounds its float32 accumulator. Half the bytes of
 * the weights to read and two multiply-adds an instruction where float32 has one. The same tiles, threads and
 * order rules: a row's bits are its own whatever rows share the call.
 *
 * args (int64): x, R, I, x's row stride, W, O, W's row stride, b (0: none), y, y's row stride, threads; x, W, b, y
 * float32 (bfloat16 for kv_linear_bf16) with contiguous rows, strides in elements. Returns 0, or -1 where built
 * without AVX2 and FMA (without AVX512-BF16 and AVX512-BW for kv_linear_bf16): kvslim.kernels.linear.ready() is
 * then False for that dtype, the route is refused by name and left out by auto.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* Outputs per tile, rows per tile, and rows per chunk (a chunk of x stays in L2 while the weights pass by). */
#define LIN_OT 6
#define LIN_RT 4
#define LIN_RC 64
/* The next block's weights are fetched into L2, not L1: asked into L1 a pass over the model's products took 22-27 ms
 * at one row against 18-20, 40-42 at 16 rows against 36 (docs/performance.md, "Prefetching into L2"). */
#define LIN_PFH _MM_HINT_T1
/* Below this many multiply-adds a call runs on the calling thread alone (no hand-off for a tiny product). */
#define LIN_MIN_PARALLEL 65536
/* How long a worker spins for the next call before it sleeps, by default (kv_pool_spin sets it), and the most
 * workers (threads beyond the caller's). A longer spin pays only on cores of the process' own: beside other work a
 * spinning worker is one more runnable thread, and it takes a core from the caller or the neighbour (a step at one
 * row 1.5-2.5x slower with 400 us than with 50 beside busy loops; docs/performance.md, "How long the workers
 * spin"). So a gap of LIN_PREEMPTED_NS between two turns of a spin longer than LIN_SPIN_SHARED_NS, which says the
 * worker was descheduled (another thread wanted its core), makes every worker spin at most LIN_SPIN_SHARED_NS for
 * LIN_SHARED_HOLD_NS; the longer spin is tried again after that. */
#define LIN_SPIN_NS 50000
#define LIN_SPIN_SHARED_NS 50000
#define LIN_PREEMPTED_NS 300000
#define LIN_SHARED_HOLD_NS 1000000000
#define LIN_MAX_WORKERS 63
/* A call's join word (lin_pool.join): the call's number in the bits above 8, closed, and the workers that joined. */
#define LIN_GEN_MASK ((UINT64_C(1) << 56) - 1)
#define LIN_CLOSED UINT64_C(0x80)
#define LIN_JOINED UINT64_C(0x7f)
/* A product's output blocks are taken about this many chunks a thread (a chunk at a time from a shared counter): the
 * threads that run share the work whatever their number, and a few hundred atomic adds a step cost nothing. */
#define LIN_CLAIMS 8
#define LIN_WAIT_PAUSES 400

typedef struct {
    const void *x, *w, *b; /* float32, or bfloat16 (uint16_t) where bf */
    void *y;
    int64_t R, I, xs, O, ws, ys;
    int bf;
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
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), /* (AVX512F alone: no DQ extract) */
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}
/* lin_sum of v[0] .. v[n - 1] into s[0] .. s[n - 1]: four at a time in one register (the same pairs added at each
 * level of the tree, so the same bits: lanes j + 8, then j + 4, then j + 2, then j + 1), the rest one by one. A
 * 4 x 6 tile's 24 sums one by one were ~170 of its ~1,400 instructions (counted from the source at I = 576). */
static inline __attribute__((always_inline)) void lin_sums(const __m512 *v, int n, float *s) {
    int k = 0;
    for (; k + 4 <= n; k += 4) {
        const __m512 a01 = _mm512_add_ps(_mm512_shuffle_f32x4(v[k], v[k + 1], 0x44),
                                         _mm512_shuffle_f32x4(v[k], v[k + 1], 0xEE));
        const __m512 a23 = _mm512_add_ps(_mm512_shuffle_f32x4(v[k + 2], v[k + 3], 0x44),
                                         _mm512_shuffle_f32x4(v[k + 2], v[k + 3], 0xEE));
        const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(a01, a23, 0x88), _mm512_shuffle_f32x4(a01, a23, 0xDD));
        const __m512 c = _mm512_add_ps(b, _mm512_permute_ps(b, 0x4E));
        const __m512 d = _mm512_add_ps(c, _mm512_permute_ps(c, 0xB1));
        const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm_storeu_ps(s + k, _mm512_castps512_ps128(_mm512_permutexvar_ps(first, d)));
    }
    for (; k < n; k++) s[k] = lin_sum(v[k]);
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
static inline void lin_sums(const __m256 *v, int n, float *s) {
    for (int k = 0; k < n; k++) s[k] = lin_sum(v[k]);
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

/* Rows r0 .. r0 + RT of x against outputs o0 .. o0 + OT of W, over all of I (the fixed order above), for elements of
 * type T: sums of type AV, loads (LD, LDT: a tail of n) of type WV, STEP elements a step, MAC(x, w, sum), OUT(a,
 * where in y, which output, the lanes' sum). pf: the next weight rows to fetch while these are used (NULL: none). */
#define LIN_TILE_T(P, T, AV, WV, STEP, ZERO, LD, LDT, MAC, OUT, RT, OT)                                              \
    static inline void P##_tile_##RT##_##OT(const lin_args *a, int64_t r0, int64_t o0, const void *pfv) {          \
        AV acc[RT][OT];                                                                                             \
        const T *pf = (const T *)pfv, *w = (const T *)a->w + o0 * a->ws, *x = (const T *)a->x + r0 * a->xs;         \
        for (int r = 0; r < RT; r++)                                                                                \
            for (int o = 0; o < OT; o++) acc[r][o] = ZERO();                                                        \
        int64_t i = 0;                                                                                              \
        for (; i + STEP <= a->I; i += STEP) {                                                                       \
            WV wv[OT];                                                                                              \
            for (int o = 0; o < OT; o++) wv[o] = LD(w + o * a->ws + i);                                             \
            if (pf)                                                                                                 \
                for (int o = 0; o < OT; o++) _mm_prefetch((const char *)(pf + o * a->ws + i), LIN_PFH);            \
            for (int r = 0; r < RT; r++) {                                                                          \
                const WV xv = LD(x + r * a->xs + i);                                                                \
                for (int o = 0; o < OT; o++) acc[r][o] = MAC(xv, wv[o], acc[r][o]);                                 \
            }                                                                                                       \
        }                                                                                                           \
        if (i < a->I) {                                                                                             \
            const int n = (int)(a->I - i);                                                                          \
            WV wv[OT];                                                                                              \
            for (int o = 0; o < OT; o++) wv[o] = LDT(w + o * a->ws + i, n);                                         \
            for (int r = 0; r < RT; r++) {                                                                          \
                const WV xv = LDT(x + r * a->xs + i, n);                                                            \
                for (int o = 0; o < OT; o++) acc[r][o] = MAC(xv, wv[o], acc[r][o]);                                 \
            }                                                                                                       \
        }                                                                                                           \
        float sums[RT * OT];                                                                                        \
        lin_sums(&acc[0][0], RT * OT, sums);                                                                        \
        for (int r = 0; r < RT; r++)                                                                                \
            for (int o = 0; o < OT; o++) OUT(a, (r0 + r) * a->ys + o0 + o, o0 + o, sums[r * OT + o]);              \
    }

#define LIN_T3_(P, RT, OT) P##_tile_##RT##_##OT
#define LIN_T3(P, RT, OT) LIN_T3_(P, RT, OT) /* (expands RT and OT first) */

/* P##_range: output blocks ob0 .. ob1 (of OT outputs; the last may be shorter) for every row, a chunk of rows at a
 * time, through P's tiles of RT rows x OT outputs (and their 1-row and 1-output edges). */
#define LIN_RANGE_T(P, T, RT, OT)                                                                                     \
    static void P##_range(const lin_args *a, int64_t ob0, int64_t ob1) {                                            \
        for (int64_t r0 = 0; r0 < a->R; r0 += LIN_RC) {                                                             \
            const int64_t r1 = r0 + LIN_RC < a->R ? r0 + LIN_RC : a->R;                                             \
            for (int64_t ob = ob0; ob < ob1; ob++) {                                                                \
                const int64_t o = ob * OT;                                                                          \
                if (o + OT <= a->O) {                                                                               \
                    /* the next block's weights are fetched while the chunk's first rows use these */              \
                    const T *pf = ob + 1 < ob1 && o + 2 * OT <= a->O ? (const T *)a->w + (o + OT) * a->ws : 0;      \
                    int64_t r = r0;                                                                                 \
                    for (; r + RT <= r1; r += RT) LIN_T3(P, RT, OT)(a, r, o, r == r0 ? pf : 0);                     \
                    for (; r < r1; r++) LIN_T3(P, 1, OT)(a, r, o, r == r0 ? pf : 0);                                \
                } else {                                                                                            \
                    for (int64_t oo = o; oo < a->O; oo++) {                                                         \
                        int64_t r = r0;                                                                             \
                        for (; r + RT <= r1; r += RT) LIN_T3(P, RT, 1)(a, r, oo, 0);                                \
                        for (; r < r1; r++) LIN_T3(P, 1, 1)(a, r, oo, 0);                                           \
                    }                                                                                               \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
    }
#define LIN_RANGE(P, T, RT, OT) LIN_RANGE_T(P, T, RT, OT) /* (expands RT and OT first) */

/* float32: one product a lane a step */
static inline void linf_out(const lin_args *a, int64_t at, int64_t o, float s) {
    ((float *)a->y)[at] = a->b ? s + ((const float *)a->b)[o] : s;
}
#define LINF_TILE(RT, OT) \
    LIN_TILE_T(linf, float, lin_vec, lin_vec, LIN_LANES, LIN_ZERO, LIN_LOAD, LIN_LOAD_TAIL, LIN_FMA, linf_out, RT, OT)
#define LINF_TILE_OF(RT, OT) LINF_TILE(RT, OT) /* (expands LIN_RT and LIN_OT first) */
LINF_TILE_OF(LIN_RT, LIN_OT)
LINF_TILE_OF(1, LIN_OT)
LINF_TILE_OF(LIN_RT, 1)
LINF_TILE(1, 1)
LIN_RANGE(linf, float, LIN_RT, LIN_OT)

#if LIN_LANES == 16 && defined(__AVX512BF16__) && defined(__AVX512BW__)
/* bfloat16: two products a lane a step (VDPBF16PS), 32 elements; the same 16-lane sums and tree as float32 */
#define LINB 1
static inline __m512bh linb_load(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
static inline __m512bh linb_load_tail(const uint16_t *p, int n) {
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), p); /* (n < 32) */
}
#define LINB_MAC(x, w, acc) _mm512_dpbf16_ps((acc), (x), (w))
static inline float linb_float(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}
/* float32 to bfloat16, to nearest with ties to even (a NaN stays a quiet NaN), as torch rounds */
static inline uint16_t linb_round(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}
static inline void linb_out(const lin_args *a, int64_t at, int64_t o, float s) {
    ((uint16_t *)a->y)[at] = linb_round(a->b ? s + linb_float(((const uint16_t *)a->b)[o]) : s);
}
#define LINB_TILE(RT, OT) \
    LIN_TILE_T(linb, uint16_t, __m512, __m512bh, 32, LIN_ZERO, linb_load, linb_load_tail, LINB_MAC, linb_out, RT, OT)
#define LINB_TILE_OF(RT, OT) LINB_TILE(RT, OT)
LINB_TILE_OF(LIN_RT, LIN_OT)
LINB_TILE_OF(1, LIN_OT)
LINB_TILE_OF(LIN_RT, 1)
LINB_TILE(1, 1)
LIN_RANGE(linb, uint16_t, LIN_RT, LIN_OT)
#endif

static void lin_range(const lin_args *a, int64_t ob0, int64_t ob1) {
#ifdef LINB
    if (a->bf) {
        linb_range(a, ob0, ob1);
        return;
    }
#endif
    linf_range(a, ob0, ob1);
}
#endif

/* A job the workers run: fn(arg, id, nt) on threads id = 0 .. nt - 1 (0: the caller). */
typedef void (*kv_job_fn)(void *arg, int id, int nt);

#ifdef LIN_LANES
/* ------------------------------------------------------------------------------------------------ the workers */

static struct {
    pthread_mutex_t call; /* held by the call using the workers (trylock: a busy pool, the caller runs alone) */
    pthread_mutex_t mu;   /* with cv: a worker's sleep */
    pthread_cond_t cv;
    int started;               /* workers running in this process */
    pid_t pid;                 /* the process that started them */
    _Atomic uint64_t gen;      /* calls posted */
    _Atomic uint64_t join;     /* the current call: its number (gen) above bit 8, LIN_CLOSED, the workers joined */
    _Atomic int done;          /* joined workers done with the current call */
    kv_job_fn fn;              /* the current call: fn(arg, id, nt) on each thread that joins it (id 0: the caller) */
    void *arg;
    _Atomic int nt;            /* the most threads the current call takes, the caller's included */
    unsigned csr;              /* the caller's MXCSR (denormals, rounding): every thread of a call rounds alike */
} lin_pool = {.call = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static int64_t lin_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

typedef struct {
    uint64_t seen;
} lin_worker_arg;

static _Atomic int64_t lin_spin_ns = LIN_SPIN_NS;
static _Atomic int64_t lin_shared_until = 0; /* lin_now_ns() before which the workers spin the short while */
static _Atomic int64_t lin_preempted = 0;    /* how many spins saw their worker descheduled (kv_pool_preempted) */
static _Atomic int64_t lin_sleeps = 0;       /* how many times a worker went to sleep (kv_pool_sleeps) */
static _Atomic uint64_t lin_renewed = 0;     /* kv_pool_renew's count: a spinning worker restarts its spin */

/* A caller that will post a call soon, after Python that may outlast the spin, restarts the spinning workers' spin
 * now (one relaxed add; a worker asleep stays asleep, a worker working is not disturbed). The direct paged step calls
 * it inside each of a layer's three long stretches of Python (kvslim.cache.paged_direct): a worker then sleeps ~9
 * times a decode step at one row instead of ~73, with no longer spin between steps. */
void kv_pool_renew(void) { atomic_fetch_add_explicit(&lin_renewed, 1, memory_order_relaxed); }

/* How many times a worker went to sleep after its spin, since the process started. */
int64_t kv_pool_sleeps(void) { return atomic_load_explicit(&lin_sleeps, memory_order_relaxed); }

/* The workers' spin before they sleep, in ns: set to ns where ns >= 0 (a worker spinning now keeps the spin it
 * started with); returns the spin in force. Any spin gives the same bits: it only decides who waits how. */
int64_t kv_pool_spin(int64_t ns) {
    if (ns >= 0) atomic_store_explicit(&lin_spin_ns, ns, memory_order_relaxed);
    return atomic_load_explicit(&lin_spin_ns, memory_order_relaxed);
}

/* How many times a worker found itself descheduled mid-spin (and the workers took the short spin), since the
 * process started. */
int64_t kv_pool_preempted(void) { return atomic_load_explicit(&lin_preempted, memory_order_relaxed); }

/* Whether a call's work goes to the threads that are running (1, the default: a job takes its work from a shared
 * counter and the caller does not wait for a worker that has not joined) or in fixed shares to every thread, each
 * waited for (0: the rule before, kept to measure the two in one process). Set where on >= 0; returns the rule in
 * force. Any rule gives the same bits: it only decides who computes what. */
static _Atomic int lin_balance = 1;
static _Atomic int64_t lin_joins = 0; /* how many times a worker joined a call (kv_pool_joins) */
int64_t kv_pool_joins(void) { return atomic_load_explicit(&lin_joins, memory_order_relaxed); }
int kv_pool_balance(int on) {
    if (on >= 0) atomic_store_explicit(&lin_balance, on ? 1 : 0, memory_order_relaxed);
    return atomic_load_explicit(&lin_balance, memory_order_relaxed);
}

static void *lin_worker(void *p) {
    const lin_worker_arg w = *(lin_worker_arg *)p;
    free(p);
    uint64_t seen = w.seen;
    for (;;) {
        uint64_t g = atomic_load_explicit(&lin_pool.gen, memory_order_acquire);
        const int64_t t0 = lin_now_ns();
        int64_t spin = atomic_load_explicit(&lin_spin_ns, memory_order_relaxed), last = t0, from = t0;
        uint64_t renewed = atomic_load_explicit(&lin_renewed, memory_order_relaxed);
        const int watch = spin > LIN_SPIN_SHARED_NS;
        if (watch && t0 < atomic_load_explicit(&lin_shared_until, memory_order_relaxed)) spin = LIN_SPIN_SHARED_NS;
        while (g == seen) { /* the bounded spin, then sleep until the next call */
            const int64_t t = lin_now_ns();
            if (watch && t - last > LIN_PREEMPTED_NS) { /* descheduled mid-spin: the cores are shared; sleep now */
                atomic_store_explicit(&lin_shared_until, t + LIN_SHARED_HOLD_NS, memory_order_relaxed);
                atomic_fetch_add_explicit(&lin_preempted, 1, memory_order_relaxed);
                spin = 0;
            }
            last = t;
            const uint64_t r = atomic_load_explicit(&lin_renewed, memory_order_relaxed);
            if (r != renewed) renewed = r, from = t; /* kv_pool_renew: the spin starts again */
            if (t - from > spin) {
                atomic_fetch_add_explicit(&lin_sleeps, 1, memory_order_relaxed);
                pthread_mutex_lock(&lin_pool.mu);
                while ((g = atomic_load_explicit(&lin_pool.gen, memory_order_acquire)) == seen)
                    pthread_cond_wait(&lin_pool.cv, &lin_pool.mu);
                pthread_mutex_unlock(&lin_pool.mu);
                break;
            }
            _mm_pause();
            g = atomic_load_explicit(&lin_pool.gen, memory_order_acquire);
        }
        seen = g;
        /* Join call g while it is open and short of its threads; a call already closed (its caller took the rest of
         * its work) or already followed by the next is left alone, its arguments maybe gone. */
        uint64_t s = atomic_load_explicit(&lin_pool.join, memory_order_acquire);
        int id = 0;
        while (s >> 8 == (g & LIN_GEN_MASK) && !(s & LIN_CLOSED)) {
            const int nt = atomic_load_explicit(&lin_pool.nt, memory_order_relaxed); /* (checked by the exchange) */
            if ((int)(s & LIN_JOINED) + 1 >= nt) break;
            if (atomic_compare_exchange_weak_explicit(&lin_pool.join, &s, s + 1, memory_order_acq_rel,
                                                      memory_order_acquire)) {
                id = (int)(s & LIN_JOINED) + 1;
                break;
            }
        }
        if (!id) continue;
        atomic_fetch_add_explicit(&lin_joins, 1, memory_order_relaxed);
        /* joined: the caller waits for this worker, so the call's fn and arg stay valid until done counts it */
        if (_mm_getcsr() != lin_pool.csr) _mm_setcsr(lin_pool.csr);
        lin_pool.fn(lin_pool.arg, id, atomic_load_explicit(&lin_pool.nt, memory_order_relaxed));
        atomic_fetch_add_explicit(&lin_pool.done, 1, memory_order_release);
    }
    return 0;
}

/* A fork waits for the call in flight (if any) and for a worker's hand-over of mu: the child's copies are unlocked. */
static void lin_fork_prepare(void) {
    pthread_mutex_lock(&lin_pool.call);
    pthread_mutex_lock(&lin_pool.mu);
}
static void lin_fork_done(void) {
    pthread_mutex_unlock(&lin_pool.mu);
    pthread_mutex_unlock(&lin_pool.call);
}
static pthread_once_t lin_fork_once = PTHREAD_ONCE_INIT;
static void lin_fork_register(void) { pthread_atfork(lin_fork_prepare, lin_fork_done, lin_fork_done); }

/* Workers 1 .. want - 1 running (called holding lin_pool.call, no call posted); returns the threads a call can use. */
static int lin_workers(int want) {
    pthread_once(&lin_fork_once, lin_fork_register);
    if (lin_pool.pid != getpid()) { /* first use, or a fork's child: none of the parent's workers exist here */
        pthread_cond_init(&lin_pool.cv, 0); /* (no waiter here: the parent's workers are not in this process) */
        lin_pool.started = 0;
        lin_pool.pid = getpid();
        atomic_store(&lin_pool.join, LIN_CLOSED);
        atomic_store(&lin_pool.done, 0);
    }
    if (want > LIN_MAX_WORKERS + 1) want = LIN_MAX_WORKERS + 1;
    if (lin_pool.started + 1 < want) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old); /* signals stay with the process' own threads */
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        while (lin_pool.started + 1 < want) {
            lin_worker_arg *arg = malloc(sizeof *arg);
            pthread_t t;
            if (!arg) break;
            arg->seen = atomic_load(&lin_pool.gen);
            if (pthread_create(&t, &attr, lin_worker, arg) != 0) {
                free(arg);
                break;
            }
            lin_pool.started++;
        }
        pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, 0);
    }
    return lin_pool.started + 1 < want ? lin_pool.started + 1 : want;
}

/* A caller's i-th turn waiting for its workers: a pause, then, past LIN_WAIT_PAUSES turns (~20 us), the CPU given up
 * where it may yield (with balance: a worker it waits for may want the CPU, on a machine shared with other work or
 * with fewer CPUs than threads; without, the caller spins as it did before). */
static inline void lin_wait_turn(int i, int may_yield) {
    if (i < LIN_WAIT_PAUSES || !may_yield)
        _mm_pause();
    else
        sched_yield();
}

/* fn on up to nt threads: the caller and the workers that join before it closes the call (the caller alone where
 * another call holds the workers or none start); returns the most threads it could have run on. With balance
 * (kv_pool_balance) the caller closes the call when its own fn returns, which a job that takes its work from a
 * shared counter does only when no work is left, and waits for the workers that joined to finish theirs; a worker
 * that wakes late (asleep, or descheduled by another process on a shared machine) no longer holds the call up.
 * Without balance the caller waits until nt - 1 workers have joined (each thread its fixed share: the rule before). */
static int lin_pool_run(kv_job_fn fn, void *arg, int nt, int balance) {
    if (nt > 1 && pthread_mutex_trylock(&lin_pool.call) == 0) {
        nt = lin_workers(nt);
        if (nt > 1) {
            lin_pool.fn = fn;
            lin_pool.arg = arg;
            lin_pool.csr = _mm_getcsr();
            atomic_store_explicit(&lin_pool.nt, nt, memory_order_relaxed);
            atomic_store_explicit(&lin_pool.done, 0, memory_order_relaxed);
            const uint64_t g = atomic_load_explicit(&lin_pool.gen, memory_order_relaxed) + 1;
            atomic_store_explicit(&lin_pool.join, (g & LIN_GEN_MASK) << 8, memory_order_release);
            pthread_mutex_lock(&lin_pool.mu);
            atomic_store_explicit(&lin_pool.gen, g, memory_order_release);
            pthread_cond_broadcast(&lin_pool.cv);
            pthread_mutex_unlock(&lin_pool.mu);
            fn(arg, 0, nt);
            if (!balance) /* every worker joins: each thread runs its fixed share */
                for (int i = 0; (atomic_load_explicit(&lin_pool.join, memory_order_acquire) & LIN_JOINED) + 1 <
                                (uint64_t)nt;
                     i++)
                    lin_wait_turn(i, 0);
            const int joined =
                (int)(atomic_fetch_or_explicit(&lin_pool.join, LIN_CLOSED, memory_order_acq_rel) & LIN_JOINED);
            for (int i = 0; atomic_load_explicit(&lin_pool.done, memory_order_acquire) < joined; i++)
                lin_wait_turn(i, balance);
            pthread_mutex_unlock(&lin_pool.call);
            return nt;
        }
        pthread_mutex_unlock(&lin_pool.call);
    }
    fn(arg, 0, 1);
    return 1;
}

typedef struct {
    const lin_args *a;
    int64_t nob, chunk;
    _Atomic int64_t next; /* the next output block to take (balance) */
    int fixed;            /* each thread its fixed share (no balance) */
} lin_job;

/* A thread's output blocks: chunks taken from the shared counter until none is left, or its fixed share. */
static void lin_job_run(void *p, int id, int nt) {
    lin_job *j = p;
    if (j->fixed) {
        lin_range(j->a, j->nob * id / nt, j->nob * (id + 1) / nt);
        return;
    }
    for (;;) {
        const int64_t b = atomic_fetch_add_explicit(&j->next, j->chunk, memory_order_relaxed);
        if (b >= j->nob) break;
        lin_range(j->a, b, b + j->chunk < j->nob ? b + j->chunk : j->nob);
    }
}

static void lin_run(const lin_args *a, int64_t nob, int nt) {
    const int balance = atomic_load_explicit(&lin_balance, memory_order_relaxed);
    int64_t chunk = nob / ((int64_t)LIN_CLAIMS * nt);
    lin_job j = {.a = a, .nob = nob, .chunk = chunk < 1 ? 1 : chunk, .fixed = !balance};
    atomic_init(&j.next, 0);
    lin_pool_run(lin_job_run, &j, nt, balance);
}
#endif

/* The call's arguments (the file's header) for elements of kind bf (0: float32, 1: bfloat16). */
static int lin_call(const int64_t *args, int bf) {
#ifdef LIN_LANES
    const lin_args a = {
        .x = (const void *)(intptr_t)args[0], .R = args[1], .I = args[2], .xs = args[3],
        .w = (const void *)(intptr_t)args[4], .O = args[5], .ws = args[6],
        .b = (const void *)(intptr_t)args[7], .y = (void *)(intptr_t)args[8], .ys = args[9], .bf = bf,
    };
    const int64_t nob = (a.O + LIN_OT - 1) / LIN_OT;
    if (nob <= 0 || a.R <= 0) return 0; /* no outputs */
    int64_t nt = args[10];
    if (nt < 1 || a.R * a.O * a.I < LIN_MIN_PARALLEL) nt = 1;
    if (nt > nob) nt = nob;
    lin_run(&a, nob, (int)nt);
    return 0;
#else
    (void)args;
    (void)bf;
    return -1;
#endif
}

int kv_linear(const int64_t *args) { return lin_call(args, 0); }

int kv_linear_bf16(const int64_t *args) {
#ifdef LINB
    return lin_call(args, 1);
#else
    (void)args;
    return -1;
#endif
}

/* fn(arg, id, nt) on up to nt threads of this file's workers (kvslim_paged.c's attention uses them too: the same
 * bounded spin between calls, no OpenMP region to wake); the caller alone in a build without AVX2. Returns the
 * most threads it could have run on: fn must take its work from a counter it shares with the other threads (any
 * number of them may join, the caller's own call does all that is left) and give the same results whoever runs
 * what. */
int kv_pool_run(kv_job_fn fn, void *arg, int nt) {
#ifdef LIN_LANES
    return lin_pool_run(fn, arg, nt, atomic_load_explicit(&lin_balance, memory_order_relaxed));
#else
    (void)nt;
    fn(arg, 0, 1);
    return 1;
#endif
}
