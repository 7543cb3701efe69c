/* kvslim CPU kernels: attention scores and weighted value sums on the encoded KV store.
 *
 * Plain C11 (no torch headers: compiles in about a second), built on first use by kvslim/kernels/cpu.py
 * and called through ctypes. Every entry point takes kv_part descriptors (a data pointer and element
 * strides of dims 0..2 = batch, head, token/group; the last dim contiguous) so the encoded tensors can be
 * views narrowed out of the cache's bigger buffers.
 *
 *   K scores:   out[b,h,m,t] = sum_d q[b,h,m,d] * K[b,h,t,d]          q (B,H,M,D) fp32, out (B,H,M,T) fp32
 *   V weighted: out[b,h,m,d] = sum_t p[b,h,m,t] * V[b,h,t,d]          p (B,H,M,T) fp32, out (B,H,M,D) fp32
 *
 * K/V are never written out in fp32: the codes of 16 tokens at a time are read once and decoded into
 * a small fp32 tile that stays in L1 (4 KB for D = 64), used by all M queries, and overwritten by the
 * next 16. Accumulation is fp32. With AVX2 + FMA (x86-64-v3 and later, at -march=native) the tile
 * products are hand-vectorized (4 or 8 K dot products share horizontal-add trees; V sums keep 64- or
 * 32-float slices of the output in registers across the tile), and KIVI int8/int4/int2 and GGML q8_0/q4_0
 * bodies skip the tile altogether: their codes are converted in registers and used there, with the same
 * operations in the same order ("codes in registers" below), so the results are the tile path's bits.
 * Elsewhere the same loops are left to the compiler's vectorizer.
 *
 * Formats:
 *   - KIVI per-channel K (int8/int4/int3/int2, one scale/zero per channel and token group of G): folded into
 *     the query once per group, q'_d = q_d * scale_d and c = sum_d q_d * zero_d, so a token costs
 *     score = sum_d q'_d * code_d + c. Packed codes are read plane by plane (int4: all low nibbles, then
 *     all high nibbles), so q' is stored permuted the same way and every inner loop is contiguous.
 *     A packing unit holds `per` codes in whole bytes: 1, 2 or 4 codes in one byte (int8/4/2), 8 codes in
 *     3 bytes (int3: one little-endian 24-bit word, code i in bits 3i..3i+2; see formats/affine.py).
 *   - KIVI per-token V (scale/zero per token and channel group of g, g a multiple of the codes per
 *     packing unit): the row is decoded in the same plane order, and the sum is un-permuted once at the end.
 *   - GGML q8_0/q4_0/q4_1/q5_0/q5_1 (per token, blocks of QK = 32 along D, byte layout of ggml-common.h,
 *     checked against kvslim's format registry when the library loads),
 *     fp32, fp16, bf16, fp8 e4m3 with a per-token fp32 scale: a row decoder per format.
 *
 * Transformed K scores (OP_K_ROWS_T, OP_K_AFFINE_T): each decoded tile row is turned into the key attention
 * scores against before the dot products, in L1: a per-(head, channel) bias added (mean-centering's zero
 * point), a block-diagonal Hadamard rotation (in-place fast Walsh-Hadamard transform, normalized) or a fitted
 * rotation's dense (D, D) matrix per head taken back (R^T y: D^2 multiply-adds a row, where the Hadamard takes
 * D log D), then RoPE at the token's own angle from cos/sin tables (pre-RoPE keys, rotated on read). The
 * rotation must be undone per key, before its RoPE: RoPE's angle changes with the token and a dense R does not
 * commute with it, so no one rotated query serves every token. KIVI K is decoded with its scales then (the
 * fold into the query does not commute with a per-token rotation).
 *
 * Parallelism: OpenMP over (batch, head, token chunk) tasks, with the caller's thread count (fewer for
 * small calls, see KV_GRAIN). V sums are reduced over the chunks of a (batch, head) at the end, on the
 * calling thread. Without OpenMP everything runs on one thread.
 *
 * Entry points: kv_run (one kernel: K scores or V sums of a body), kv_attend (a layer's decode attention:
 * sinks, body, residual, softmax, value sums), kv_attend_rows (kv_attend for many rows of a ragged batch in
 * one call, each row bit-identical to its own kv_attend; a row's body may be a list of blocks).
 *
 * Return codes: 0 ok, 1 out of memory (scratch), 2 bad arguments. The Python side validates shapes;
 * nothing here can check that a pointer and its strides stay inside a tensor.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define KV_ABI_VERSION 9

#if defined(__GNUC__) || defined(__clang__)
#define KV_INLINE static inline __attribute__((always_inline))
#define KV_NOINLINE __attribute__((noinline))
#else
#define KV_INLINE static inline
#define KV_NOINLINE
#endif

#if defined(_OPENMP)
#define KV_SIMD_SUM _Pragma("omp simd reduction(+:s)")
#define KV_SIMD _Pragma("omp simd")
#else
#define KV_SIMD_SUM
#define KV_SIMD
#endif

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2, DT_F8E4M3 = 3, DT_U8 = 4 };

/* Per-token row formats (the GGML kinds first). Python never hard-codes these numbers: it asks
 * kv_row_format() by name (see ROW_FORMATS below). */
enum { R_Q8_0 = 0, R_Q4_0 = 1, R_Q4_1 = 2, R_Q5_0 = 3, R_Q5_1 = 4, R_F32 = 5, R_F16 = 6, R_BF16 = 7, R_FP8 = 8 };
/* Read in registers for kvslim_paged.c only (not a row format of this file's ops): the vLLM plugin's symmetric
 * 8-bit pages, an fp16 scale then D int8 codes (q8_0's block spanning the whole head). */
enum { R_SYM8 = 9 };

/* GGML block layouts (ggml-common.h): elements per block and bytes per block, as decode_row reads
 * them. kvslim's format registry (kvslim/formats/ggml.py) holds the same facts; the loader compares
 * the two through kv_row_format() and refuses a library that disagrees. */
#define QK 32
#define Q8_0_BYTES 34 /* d, qs[32] */
#define Q4_0_BYTES 18 /* d, qs[16] */
#define Q4_1_BYTES 20 /* d, m, qs[16] */
#define Q5_0_BYTES 22 /* d, qh[4], qs[16] */
#define Q5_1_BYTES 24 /* d, m, qh[4], qs[16] */

typedef struct {
    const void *data;
    int64_t s0, s1, s2; /* element strides of dims 0 (batch), 1 (head), 2 (token or group) */
    int32_t dtype;      /* DT_* */
    int32_t unused;
} kv_part;

typedef struct {
    int32_t B, H, M, T, D;
    int32_t nthreads;
} kv_dims;

enum { KV_OK = 0, KV_ENOMEM = 1, KV_EARG = 2 };

/* --------------------------------------------------------------------------------- scalars */

KV_INLINE float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

KV_INLINE uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* IEEE half -> float, exact for every input (subnormals, inf, NaN with its payload). */
static float half_to_float_portable(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in fp32 */
        float f = (float)m * 0x1p-24f;
        return sign ? -f : f;
    }
    if (e == 31) return f32_from_bits(sign | 0x7f800000u | (m << 13));
    return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

KV_INLINE float h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return half_to_float_portable(h);
#endif
}

KV_INLINE uint16_t ld_u16(const uint8_t *p) { /* little-endian host (checked by the loader) */
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

KV_INLINE uint32_t ld_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Element i of a fp32/fp16/bf16 vector. */
KV_INLINE float ldf(const uint8_t *base, int i, int dt) {
    if (dt == DT_F16) return h2f(((const uint16_t *)base)[i]);
    if (dt == DT_BF16) return f32_from_bits((uint32_t)((const uint16_t *)base)[i] << 16);
    return ((const float *)base)[i];
}

static int dtype_size(int dt) {
    switch (dt) {
    case DT_F32: return 4;
    case DT_F16:
    case DT_BF16: return 2;
    default: return 1;
    }
}

/* Address of element [b, h, i, 0] of a part. */
KV_INLINE const uint8_t *at(const kv_part *p, int b, int h, int64_t i) {
    return (const uint8_t *)p->data + (int64_t)dtype_size(p->dtype) * (b * p->s0 + h * p->s1 + i * p->s2);
}

/* n floats of a fp32/fp16/bf16 vector -> dst. */
static void load_floats(const uint8_t *src, int dt, float *restrict dst, int n) {
    if (dt == DT_F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (dt == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        KV_SIMD
        for (int i = 0; i < n; i++) dst[i] = f32_from_bits((uint32_t)s[i] << 16);
    } else {
        const uint16_t *s = (const uint16_t *)src;
        int i = 0;
#if defined(__F16C__) && defined(__AVX__)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
        for (; i < n; i++) dst[i] = h2f(s[i]);
    }
}

/* --------------------------------------------------------------------------------- small helpers */

KV_INLINE float dot(const float *restrict a, const float *restrict b, int n) {
    float s = 0.0f;
    KV_SIMD_SUM
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

KV_INLINE void axpy(float *restrict y, float a, const float *restrict x, int n) {
    KV_SIMD
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* Work units (a token row times a query, 5-8 ns each with the row's decode) below which a thread is not
 * worth its fork/join: small calls run on the caller's thread, like at::parallel_for's grain size. Measured
 * at 2 threads (python -m kvslim.kernels.bench): 8192 left a 1,024-token int4 step of 3 KV heads x 3 queries
 * on one thread (189 us a layer for K and V); 2048 splits it (136 us), and changes nothing below 512 tokens. */
#define KV_GRAIN 2048

static int threads_of(const kv_dims *dm) {
    const int64_t work = (int64_t)dm->B * dm->H * dm->T * (dm->M + 1);
    int64_t nt = work / KV_GRAIN;
    if (nt > dm->nthreads) nt = dm->nthreads;
    return nt < 1 ? 1 : (int)nt;
}

/* Token chunks per (batch, head): enough tasks to balance the threads, chunks of >= min_chunk tokens, and
 * (where the chunks allow) a task count that is a multiple of the threads, so that no thread is left with a
 * last lone task while the others wait (3 heads x 3 chunks on 2 threads: 5 tasks against 4). */
static int n_chunks(int bh, int T, int nthreads, int min_chunk) {
    int want = (4 * nthreads + bh - 1) / bh;
    const int most = (T + min_chunk - 1) / min_chunk;
    while (want < most && ((int64_t)bh * want) % nthreads) want++;
    if (want > most) want = most;
    return want < 1 ? 1 : want;
}

/* Packed KIVI codes are handled in plane order: k = i * np + j holds element d = per * j + i
 * (i < per codes per packing unit, j < np units). */

/* The affine code widths the kernels read, and the codes of one packing unit (1, 2 or 4 per byte; int3:
 * 8 in 3 bytes). */
KV_INLINE int affine_bits_ok(int bits) { return bits == 8 || bits == 4 || bits == 3 || bits == 2; }
KV_INLINE int codes_per_unit(int bits) { return bits == 3 ? 8 : 8 / bits; }

/* Variance normalization (kvslim/formats/varnorm.py): a stored factor byte e means 2^((e - 128) / 4), exactly:
 * the fp32 table entry of (e - 128) mod 4 times a power of two built from its bits. The table holds the same
 * four floats as varnorm.FACTOR_TABLE (fp32 of 2^(i/4)). */
static const float VN_TABLE[4] = {0x1p+0f, 0x1.306fe0p+0f, 0x1.6a09e6p+0f, 0x1.ae89fap+0f};
KV_INLINE float vn_factor(uint8_t e) {
    const int k = (int)e - 128, q = k >= 0 ? k / 4 : -((3 - k) / 4);
    return VN_TABLE[k - 4 * q] * f32_from_bits((uint32_t)(q + 127) << 23);
}

/* Codes of one token (np bytes) -> floats in plane order, times scale[k / run] plus zero[k / run] when
 * scale is not NULL (run: the plane elements sharing a scale; a multiple of 8 for the AVX2 path). */
KV_INLINE void unpack_planes(const uint8_t *restrict c, float *restrict row, int np, int bits,
                             const float *restrict scale, const float *restrict zero, int run) {
    const int per = codes_per_unit(bits);
    const unsigned mask = (1u << bits) - 1u;
    if (bits == 3) { /* unit j: bytes 3j..3j+2, a little-endian 24-bit word, code i in bits 3i..3i+2 */
        for (int j = 0; j < np; j++) {
            const uint32_t w = (uint32_t)c[3 * j] | (uint32_t)c[3 * j + 1] << 8 | (uint32_t)c[3 * j + 2] << 16;
            for (int i = 0; i < 8; i++) row[i * np + j] = (float)((w >> (3 * i)) & 7u);
        }
        if (scale)
            for (int i = 0; i < 8; i++) {
                float *restrict r = row + i * np;
                for (int j = 0; j < np; j++) r[j] = r[j] * scale[j / run] + zero[j / run];
            }
        return;
    }
#if defined(__AVX2__) && defined(__FMA__)
    if (np % 8 == 0 && (scale == NULL || run % 8 == 0)) {
        const __m256i vmask = _mm256_set1_epi32((int)mask);
        __m256 sv = _mm256_setzero_ps(), zv = sv;
        for (int gg = 0, j = 0; j < np; gg++) {
            if (scale) { /* channel group gg: plane elements [gg * run, (gg + 1) * run) */
                sv = _mm256_set1_ps(scale[gg]);
                zv = _mm256_set1_ps(zero[gg]);
            }
            const int stop = scale ? j + run : np;
            for (; j < stop; j += 8) {
                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + j)));
                for (int i = 0; i < per; i++) {
                    const __m256i x = per == 1 ? v : _mm256_and_si256(_mm256_srli_epi32(v, bits * i), vmask);
                    __m256 f = _mm256_cvtepi32_ps(x);
                    if (scale) f = _mm256_fmadd_ps(f, sv, zv);
                    _mm256_storeu_ps(row + i * np + j, f);
                }
            }
        }
        return;
    }
#endif
    for (int i = 0; i < per; i++) {
        float *restrict r = row + i * np;
        const int sh = bits * i;
        KV_SIMD
        for (int j = 0; j < np; j++) r[j] = (float)((c[j] >> sh) & mask);
        if (scale)
            for (int j = 0; j < np; j++) r[j] = r[j] * scale[j / run] + zero[j / run];
    }
}

/* --------------------------------------------------------------------------------- per-token rows */

/* One token's vector, decoded to fp32 in natural order. src: its bytes; scale: fp8's fp32 scale. */
KV_INLINE void decode_row(int fmt, const uint8_t *restrict src, float xscale, float *restrict row, int D) {
    const int nb = D / QK;
    switch (fmt) {
    case R_Q8_0:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = src + Q8_0_BYTES * b;
            const float d = h2f(ld_u16(blk));
            const int8_t *qs = (const int8_t *)(blk + 2);
            float *r = row + QK * b;
            KV_SIMD
            for (int i = 0; i < QK; i++) r[i] = d * (float)qs[i];
        }
        break;
    case R_Q4_0:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = src + Q4_0_BYTES * b;
            const float d = h2f(ld_u16(blk));
            const uint8_t *qs = blk + 2;
            float *r = row + QK * b;
            KV_SIMD
            for (int j = 0; j < QK / 2; j++) {
                r[j] = d * (float)((int)(qs[j] & 15) - 8);
                r[j + QK / 2] = d * (float)((int)(qs[j] >> 4) - 8);
            }
        }
        break;
    case R_Q4_1:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = src + Q4_1_BYTES * b;
            const float d = h2f(ld_u16(blk)), m = h2f(ld_u16(blk + 2));
            const uint8_t *qs = blk + 4;
            float *r = row + QK * b;
            KV_SIMD
            for (int j = 0; j < QK / 2; j++) {
                r[j] = d * (float)(qs[j] & 15) + m;
                r[j + QK / 2] = d * (float)(qs[j] >> 4) + m;
            }
        }
        break;
    case R_Q5_0:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = src + Q5_0_BYTES * b;
            const float d = h2f(ld_u16(blk));
            const uint32_t qh = ld_u32(blk + 2);
            const uint8_t *qs = blk + 6;
            float *r = row + QK * b;
            KV_SIMD
            for (int j = 0; j < QK / 2; j++) {
                const int lo = (qs[j] & 15) | (int)(((qh >> j) & 1u) << 4);
                const int hi = (qs[j] >> 4) | (int)(((qh >> (j + QK / 2)) & 1u) << 4);
                r[j] = d * (float)(lo - 16);
                r[j + QK / 2] = d * (float)(hi - 16);
            }
        }
        break;
    case R_Q5_1:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = src + Q5_1_BYTES * b;
            const float d = h2f(ld_u16(blk)), m = h2f(ld_u16(blk + 2));
            const uint32_t qh = ld_u32(blk + 4);
            const uint8_t *qs = blk + 8;
            float *r = row + QK * b;
            KV_SIMD
            for (int j = 0; j < QK / 2; j++) {
                const int lo = (qs[j] & 15) | (int)(((qh >> j) & 1u) << 4);
                const int hi = (qs[j] >> 4) | (int)(((qh >> (j + QK / 2)) & 1u) << 4);
                r[j] = d * (float)lo + m;
                r[j + QK / 2] = d * (float)hi + m;
            }
        }
        break;
    case R_F32: memcpy(row, src, (size_t)D * 4); break;
    case R_F16: load_floats(src, DT_F16, row, D); break;
    case R_BF16: load_floats(src, DT_BF16, row, D); break;
    case R_FP8: {
        /* e4m3fn: exponent field e > 0 moves into fp32's (bias 7 -> 127); e == 0 is m * 2^-9; 0x7f is NaN. */
        int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256i m7f = _mm256_set1_epi32(0x7f), m80 = _mm256_set1_epi32(0x80), bias = _mm256_set1_epi32(120 << 23);
        const __m256 sub = _mm256_set1_ps(0x1p-9f), nan = _mm256_set1_ps(f32_from_bits(0x7fc00000u));
        const __m256 xs = _mm256_set1_ps(xscale);
        for (; i + 8 <= D; i += 8) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
            const __m256i mag = _mm256_and_si256(v, m7f);
            const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), bias));
            const __m256 small = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), sub);
            __m256 f = _mm256_blendv_ps(normal, small, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
            f = _mm256_blendv_ps(f, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, m7f)));
            f = _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(v, m80), 24)));
            _mm256_storeu_ps(row + i, _mm256_mul_ps(f, xs));
        }
#endif
        for (; i < D; i++) {
            const uint32_t v = src[i], mag = v & 0x7fu;
            float f = mag < 8 ? (float)mag * 0x1p-9f : f32_from_bits((mag << 20) + (120u << 23));
            f = mag == 0x7fu ? f32_from_bits(0x7fc00000u) : f;
            row[i] = f32_from_bits(f32_bits(f) | (v & 0x80u) << 24) * xscale;
        }
        break;
    }
    default: break;
    }
}

/* --------------------------------------------------------------------------------- tiles
 *
 * The drivers decode TILE tokens at a time into rows[TILE][D] (L1-resident), then:
 *   K: out[m, t + j] = qq[m] . rows[j] + cst[m]   for j < n, every m
 *   V: acc[m] += sum_j p[m, t + j] * rows[j]      for every m
 * With AVX2 + FMA the K dots run 4 tokens at a time with one horizontal-add tree for the 4 sums,
 * and the V sums keep a 32-float slice of acc[m] in registers across the tile. The portable
 * versions are the same loops without intrinsics.
 */

#define TILE 16

/* The 4 dot products a0..a3 (8 lanes each) summed: lane pairs (hadd), the pairs' pairs (hadd), the two 128-bit
 * halves; plus c. One order for every token, whichever group of 4 or 8 it is reduced in. */
#if defined(__AVX2__) && defined(__FMA__)
KV_INLINE __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m128 c) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), c);
}

/* The 4 scores sv at dst, only the first left of them where fewer than 4 are left. */
KV_INLINE void store4(float *dst, __m128 sv, int left) {
    if (left >= 4) {
        _mm_storeu_ps(dst, sv);
    } else if (left > 0) {
        float tmp[4];
        _mm_storeu_ps(tmp, sv);
        for (int i = 0; i < left; i++) dst[i] = tmp[i];
    }
}
#endif

/* K: rows (n <= TILE, rows beyond n are readable garbage), qq (M, D) with row stride qs; cst may be NULL. */
static void k_tile(const float *restrict qq, int64_t qs, const float *restrict cst, int M, int D,
                   const float *restrict rows, int n, float *restrict ob, int64_t os, int t) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        for (int m = 0; m < M; m++) {
            const float *qm = qq + m * qs;
            const __m128 c = _mm_set1_ps(cst ? cst[m] : 0.0f);
            float *o = ob + m * os + t;
            int j = 0;
            /* 8 tokens at a time: 8 independent FMA chains keep both FMA pipes busy (4 chains wait on the
             * FMA latency) */
            for (; j + 8 <= n; j += 8) {
                const float *r0 = rows + (int64_t)j * D;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                for (int k = 0; k < D; k += 8) {
                    const __m256 qv = _mm256_loadu_ps(qm + k);
                    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r0 + k), a0);
                    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r0 + D + k), a1);
                    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r0 + 2 * D + k), a2);
                    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r0 + 3 * D + k), a3);
                    a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r0 + 4 * D + k), a4);
                    a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r0 + 5 * D + k), a5);
                    a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r0 + 6 * D + k), a6);
                    a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r0 + 7 * D + k), a7);
                }
                _mm_storeu_ps(o + j, hsum4(a0, a1, a2, a3, c));
                _mm_storeu_ps(o + j + 4, hsum4(a4, a5, a6, a7, c));
            }
            for (; j < n; j += 4) {
                const float *r0 = rows + (int64_t)j * D, *r1 = r0 + D, *r2 = r1 + D, *r3 = r2 + D;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int k = 0; k < D; k += 8) {
                    const __m256 qv = _mm256_loadu_ps(qm + k);
                    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r0 + k), a0);
                    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r1 + k), a1);
                    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r2 + k), a2);
                    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r3 + k), a3);
                }
                const __m128 s = hsum4(a0, a1, a2, a3, c);
                if (j + 4 <= n) {
                    _mm_storeu_ps(o + j, s);
                } else {
                    float tmp[4];
                    _mm_storeu_ps(tmp, s);
                    for (int i = 0; i < n - j; i++) o[j + i] = tmp[i];
                }
            }
        }
        return;
    }
#endif
    for (int m = 0; m < M; m++) {
        const float c = cst ? cst[m] : 0.0f;
        for (int j = 0; j < n; j++) ob[m * os + t + j] = dot(qq + m * qs, rows + (int64_t)j * D, D) + c;
    }
}

/* V: acc[m, :] += sum_{j < n} p[m, j] * rows[j, :]; p rows have stride ps. Every channel sums its tokens in
 * token order, one FMA each, whatever the tile: the AVX2 loops keep 64 (or 32) channels of acc[m] in registers
 * across the tile (8 independent FMA chains for 64). */
static void v_tile(const float *restrict p, int64_t ps, int M, int D, const float *restrict rows, int n,
                   float *restrict acc) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 32 == 0) {
        for (int m = 0; m < M; m++) {
            const float *pm = p + m * ps;
            int k = 0;
            for (; k + 64 <= D; k += 64) {
                float *a = acc + m * D + k;
                __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8), a2 = _mm256_loadu_ps(a + 16),
                       a3 = _mm256_loadu_ps(a + 24), a4 = _mm256_loadu_ps(a + 32), a5 = _mm256_loadu_ps(a + 40),
                       a6 = _mm256_loadu_ps(a + 48), a7 = _mm256_loadu_ps(a + 56);
                for (int j = 0; j < n; j++) {
                    const __m256 w = _mm256_broadcast_ss(pm + j);
                    const float *r = rows + (int64_t)j * D + k;
                    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r), a0);
                    a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8), a1);
                    a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 16), a2);
                    a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 24), a3);
                    a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 32), a4);
                    a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 40), a5);
                    a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 48), a6);
                    a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 56), a7);
                }
                _mm256_storeu_ps(a, a0);
                _mm256_storeu_ps(a + 8, a1);
                _mm256_storeu_ps(a + 16, a2);
                _mm256_storeu_ps(a + 24, a3);
                _mm256_storeu_ps(a + 32, a4);
                _mm256_storeu_ps(a + 40, a5);
                _mm256_storeu_ps(a + 48, a6);
                _mm256_storeu_ps(a + 56, a7);
            }
            for (; k < D; k += 32) {
                float *a = acc + m * D + k;
                __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8), a2 = _mm256_loadu_ps(a + 16),
                       a3 = _mm256_loadu_ps(a + 24);
                for (int j = 0; j < n; j++) {
                    const __m256 w = _mm256_broadcast_ss(pm + j);
                    const float *r = rows + (int64_t)j * D + k;
                    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r), a0);
                    a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8), a1);
                    a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 16), a2);
                    a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 24), a3);
                }
                _mm256_storeu_ps(a, a0);
                _mm256_storeu_ps(a + 8, a1);
                _mm256_storeu_ps(a + 16, a2);
                _mm256_storeu_ps(a + 24, a3);
            }
        }
        return;
    }
#endif
    for (int m = 0; m < M; m++)
        for (int j = 0; j < n; j++) axpy(acc + m * D, p[m * ps + j], rows + (int64_t)j * D, D);
}

/* --------------------------------------------------------------------------------- key transform */

/* What turns a decoded stored key into the key attention scores against (see kvslim.kernels.KeyTransform):
 * bias (H, D) fp32 added when has_bias (only to tokens whose uint8 flag (B, H, T) is set, when has_flags);
 * Hadamard blocks of hblock (0: none), or a fitted rotation's matrix taken back, x = R^T y with mat
 * (1, H, D, D) fp32, rows contiguous, y = R x (NULL: none; never both); RoPE on channel pairs
 * (roff + i, roff + rhalf + i), i < rhalf (0: none), at angles cos/sin (B or broadcast, T, rhalf) fp32. */
typedef struct {
    int hblock, rhalf, roff, has_bias, has_flags;
    const kv_part *bias, *cos, *sin, *flags, *mat;
} kv_tr;

/* In-place unnormalized Walsh-Hadamard transform of n (a power of two) floats: Sylvester order, the
 * butterflies of H_2 = [[1, 1], [1, -1]] applied per bit, which is H_n = H_2 (x) ... (x) H_2. */
KV_INLINE void fwht(float *restrict x, int n) {
    /* the first three butterflies within each run of 8 (one AVX register: each stage is a lane permute and
     * a multiply-add with a sign pattern, p + s * v), then runs of h >= 8 that vectorize as they are */
#if defined(__AVX2__) && defined(__FMA__)
    if (n >= 8) {
        const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1), s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
        const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
        for (int i = 0; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            v = _mm256_fmadd_ps(v, s1, _mm256_permute_ps(v, 0xB1)); /* swap neighbours */
            v = _mm256_fmadd_ps(v, s2, _mm256_permute_ps(v, 0x4E)); /* swap pairs */
            v = _mm256_fmadd_ps(v, s4, _mm256_permute2f128_ps(v, v, 1)); /* swap halves */
            _mm256_storeu_ps(x + i, v);
        }
    } else
#endif
    for (int i = 0; i + 8 <= n; i += 8) {
        float *v = x + i;
        const float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
        const float a4 = v[4] + v[5], a5 = v[4] - v[5], a6 = v[6] + v[7], a7 = v[6] - v[7];
        const float b0 = a0 + a2, b1 = a1 + a3, b2 = a0 - a2, b3 = a1 - a3;
        const float b4 = a4 + a6, b5 = a5 + a7, b6 = a4 - a6, b7 = a5 - a7;
        v[0] = b0 + b4, v[1] = b1 + b5, v[2] = b2 + b6, v[3] = b3 + b7;
        v[4] = b0 - b4, v[5] = b1 - b5, v[6] = b2 - b6, v[7] = b3 - b7;
    }
    for (int h = n < 8 ? 1 : 8; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h) {
            float *restrict u = x + i, *restrict w = x + i + h;
            KV_SIMD
            for (int j = 0; j < h; j++) {
                const float a = u[j], b = w[j];
                u[j] = a + b;
                w[j] = a - b;
            }
        }
}

/* rows[j] (natural channel order) for tokens t .. t + n - 1 of (b, h), transformed in place. tmp: D floats
 * (a row's copy, for a fitted rotation). */
static void transform_rows(const kv_tr *tr, float *restrict rows, int n, int D, int b, int h, int t,
                           float *restrict tmp) {
    const float *bias = tr->has_bias ? (const float *)at(tr->bias, 0, h, 0) : NULL;
    const float *rot = tr->mat ? (const float *)at(tr->mat, 0, h, 0) : NULL; /* R of head h, (D, D) */
    const float norm = tr->hblock ? 1.0f / sqrtf((float)tr->hblock) : 1.0f;
    for (int j = 0; j < n; j++) {
        float *restrict r = rows + (int64_t)j * D;
        if (bias && (!tr->has_flags || *at(tr->flags, b, h, t + j))) {
            KV_SIMD
            for (int d = 0; d < D; d++) r[d] += bias[d];
        }
        if (tr->hblock) {
            for (int blk = 0; blk < D; blk += tr->hblock) fwht(r + blk, tr->hblock);
            KV_SIMD
            for (int d = 0; d < D; d++) r[d] *= norm;
        }
        if (rot) { /* r = R^T y: row e of R scaled by y_e, summed in e order (the reference's y @ R) */
            memcpy(tmp, r, (size_t)D * sizeof(float));
            for (int d = 0; d < D; d++) r[d] = 0.0f;
            for (int e = 0; e < D; e++) {
                const float ye = tmp[e];
                const float *restrict re = rot + (int64_t)e * D;
                KV_SIMD
                for (int d = 0; d < D; d++) r[d] += ye * re[d];
            }
        }
        if (tr->rhalf) {
            const float *restrict c = (const float *)at(tr->cos, b, 0, t + j);
            const float *restrict s = (const float *)at(tr->sin, b, 0, t + j);
            float *restrict x = r + tr->roff, *restrict y = r + tr->roff + tr->rhalf;
            KV_SIMD
            for (int i = 0; i < tr->rhalf; i++) {
                const float a = x[i], e = y[i];
                x[i] = a * c[i] - e * s[i];
                y[i] = e * c[i] + a * s[i];
            }
        }
    }
}

/* --------------------------------------------------------------------------------- codes in registers
 *
 * With AVX2 + FMA, KIVI bodies of whole-byte packing (int8/int4/int2, np % 8 == 0) and GGML q8_0/q4_0 rows skip the
 * tile: each 8 codes are widened, masked and converted (GGML: times the block's scale) in a register and used there,
 * by up to 3 queries at once (K: 4 tokens x 3 queries, or 8 tokens x 1 query, in 12 or 8 accumulators; V: 32
 * channels x 3 queries in 12 accumulators), so nothing is written to memory between the codes and the products. The
 * arithmetic is the tile path's, operation for operation (the same conversions, the same FMAs in the same order for
 * every output): results are bit for bit the tile path's (kv_run's test switch compares them). More than 3 queries
 * take several passes over the codes. Built for AVX-512 (-march=native on such a CPU), the same loops run 16 lanes
 * wide (v_direct16, k_direct16, v_ggml16, k_ggml16 below), lane for lane the same arithmetic, with the codes of
 * the tokens ahead prefetched: 1.26-1.51x the 8-lane loops' rows call at 16 rows x 4,096 tokens (Sapphire Rapids,
 * docs/performance.md, "16 lanes"). */

#if defined(__AVX2__) && defined(__FMA__)
/* Units u .. u + 7 of a token's packed codes c, the plane of shift sh: 8 codes as floats. */
KV_INLINE __m256 codes8(const uint8_t *restrict c, int u, int sh, int bits) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + u)));
    if (bits == 8) return _mm256_cvtepi32_ps(v);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(sh)),
                                               _mm256_set1_epi32((1 << bits) - 1)));
}

/* K scores o[m * os + j] = qq[m] . codes(j) + cst[m] (cst NULL: 0) for NM queries qq (plane order, rows of D) and
 * the n tokens at c0 (byte stride cs), TB tokens at a time (4 or 8); the last group's missing tokens re-read token
 * n - 1 and are not written. k_tile's sums: lanes over k in order, then hsum4. */
KV_INLINE void k_direct(int bits, int NM, int TB, const float *restrict qq, int D, const float *restrict cst,
                        const uint8_t *c0, int64_t cs, int np, int n, float *restrict o, int64_t os) {
    const int per = codes_per_unit(bits);
    for (int j = 0; j < n; j += TB) {
        const uint8_t *cp[8];
        for (int x = 0; x < TB; x++) cp[x] = c0 + cs * (j + x < n ? j + x : n - 1);
        __m256 a[3][8];
        for (int m = 0; m < NM; m++)
            for (int x = 0; x < TB; x++) a[m][x] = _mm256_setzero_ps();
        for (int i = 0; i < per; i++)
            for (int u = 0; u < np; u += 8) {
                const float *qk = qq + i * np + u;
                for (int x = 0; x < TB; x++) {
                    const __m256 f = codes8(cp[x], u, bits * i, bits);
                    for (int m = 0; m < NM; m++) a[m][x] = _mm256_fmadd_ps(_mm256_loadu_ps(qk + m * D), f, a[m][x]);
                }
            }
        for (int m = 0; m < NM; m++)
            for (int x = 0; x < TB; x += 4) {
                const __m128 sv = hsum4(a[m][x], a[m][x + 1], a[m][x + 2], a[m][x + 3], _mm_set1_ps(cst ? cst[m] : 0.0f));
                store4(o + m * os + j + x, sv, n - j - x);
            }
    }
}

#if defined(__AVX512F__)
/* With AVX-512 the same loops run 16 lanes wide, and every lane's arithmetic stays the 8-lane loops': V's channels
 * are independent lanes (v_direct16: 64 channels of a token a register row, the same conversions and FMAs in token
 * order), and K's 8-lane dot products ride two to a register (k_direct16: the lower half one token's, the upper
 * half the next token's, the queries broadcast to both halves), summed by the same hsum4. The results are bit for
 * bit the 8-lane loops' (and so the tiles'): kv_run's test switch and tests/test_kernels.py compare them. */

/* 16 packed units (bytes, widened) -> the codes of the plane of shift sh, as floats (codes8's arithmetic). */
KV_INLINE __m512 plane16(__m128i units, int sh, int bits) {
    const __m512i v = _mm512_cvtepu8_epi32(units);
    if (bits == 8) return _mm512_cvtepi32_ps(v);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(sh)),
                                               _mm512_set1_epi32((1 << bits) - 1)));
}

/* Units u .. u + 15 of a token's packed codes c, the plane of shift sh: 16 codes as floats. */
KV_INLINE __m512 codes16(const uint8_t *restrict c, int u, int sh, int bits) {
    return plane16(_mm_loadu_si128((const __m128i *)(c + u)), sh, bits);
}

/* Units u .. u + 7 of two tokens' packed codes (c: lanes 0-7, c2: lanes 8-15), the plane of shift sh, as floats. */
KV_INLINE __m512 codes8x2(const uint8_t *restrict c, const uint8_t *restrict c2, int u, int sh, int bits) {
    return plane16(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(c + u)), _mm_loadl_epi64((const __m128i *)(c2 + u))),
                   sh, bits);
}

/* v_direct, 64 channels (4 registers of 16) at a time: np % 16 == 0, run % 16 == 0, D % 64 == 0. */
KV_INLINE void v_direct16(int bits, int NM, const float *restrict pb, int64_t ps, const uint8_t *c0, int64_t cs,
                          const kv_part *sc, const kv_part *zr, int b, int h, int t0, int t1, int np, int run, int D,
                          float *restrict acc) {
    const int sdt = sc->dtype, zdt = zr->dtype;
    const uint8_t *s0 = at(sc, b, h, 0), *z0 = at(zr, b, h, 0);
    const int64_t ss = sc->s2 * dtype_size(sdt), zs = zr->s2 * dtype_size(zdt);
    for (int kb = 0; kb < D; kb += 64) {
        int sh[4], uu[4], gg[4];
        for (int x = 0; x < 4; x++) {
            const int k = kb + 16 * x, i = k / np;
            sh[x] = bits * i, uu[x] = k - i * np, gg[x] = uu[x] / run;
        }
        __m512 a[3][4];
        for (int m = 0; m < NM; m++)
            for (int x = 0; x < 4; x++) a[m][x] = _mm512_loadu_ps(acc + (int64_t)m * D + kb + 16 * x);
        if (gg[0] == gg[1] && gg[1] == gg[2] && gg[2] == gg[3]) {
            const int g0 = gg[0];
            for (int t = t0; t < t1; t++) {
                const uint8_t *c = c0 + cs * t;
                _mm_prefetch((const char *)(c + 48 * cs), _MM_HINT_T0);
                _mm_prefetch((const char *)(s0 + ss * (t + 64)), _MM_HINT_T0);
                _mm_prefetch((const char *)(z0 + zs * (t + 64)), _MM_HINT_T0);
                const __m512 sv = _mm512_set1_ps(ldf(s0 + ss * t, g0, sdt)), zv = _mm512_set1_ps(ldf(z0 + zs * t, g0, zdt));
                __m512 w[3];
                for (int m = 0; m < NM; m++) w[m] = _mm512_set1_ps(pb[m * ps + t]);
                for (int x = 0; x < 4; x++) {
                    const __m512 f = _mm512_fmadd_ps(codes16(c, uu[x], sh[x], bits), sv, zv);
                    for (int m = 0; m < NM; m++) a[m][x] = _mm512_fmadd_ps(w[m], f, a[m][x]);
                }
            }
        } else {
            for (int t = t0; t < t1; t++) {
                const uint8_t *c = c0 + cs * t;
                __m512 w[3];
                for (int m = 0; m < NM; m++) w[m] = _mm512_set1_ps(pb[m * ps + t]);
                for (int x = 0; x < 4; x++) {
                    const __m512 f = _mm512_fmadd_ps(codes16(c, uu[x], sh[x], bits),
                                                     _mm512_set1_ps(ldf(s0 + ss * t, gg[x], sdt)),
                                                     _mm512_set1_ps(ldf(z0 + zs * t, gg[x], zdt)));
                    for (int m = 0; m < NM; m++) a[m][x] = _mm512_fmadd_ps(w[m], f, a[m][x]);
                }
            }
        }
        for (int m = 0; m < NM; m++)
            for (int x = 0; x < 4; x++) _mm512_storeu_ps(acc + (int64_t)m * D + kb + 16 * x, a[m][x]);
    }
}

/* lo in lanes 0-7, hi in lanes 8-15 (AVX512F only: the f32x8 forms would need AVX512DQ). */
KV_INLINE __m512 join8x2(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* v in both 8-lane halves. */
KV_INLINE __m512 bcast8x2(__m256 v) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v))); }

/* The upper 8 lanes of a. */
KV_INLINE __m256 hi8(__m512 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }

/* hsum4 of the four 8-lane halves of a and b (tokens j, j + 1 in a; j + 2, j + 3 in b), plus c. */
KV_INLINE __m128 hsum2x2(__m512 a, __m512 b, float c) {
    return hsum4(_mm512_castps512_ps256(a), hi8(a), _mm512_castps512_ps256(b), hi8(b), _mm_set1_ps(c));
}

/* k_direct with two tokens a register: TB tokens (4 or 8) in TB / 2 registers per query. */
KV_INLINE void k_direct16(int bits, int NM, int TB, const float *restrict qq, int D, const float *restrict cst,
                          const uint8_t *c0, int64_t cs, int np, int n, float *restrict o, int64_t os) {
    const int per = codes_per_unit(bits);
    for (int j = 0; j < n; j += TB) {
        const uint8_t *cp[8];
        for (int x = 0; x < TB; x++) {
            cp[x] = c0 + cs * (j + x < n ? j + x : n - 1);
            _mm_prefetch((const char *)(cp[x] + 64 * cs), _MM_HINT_T0); /* the codes 64 tokens on */
        }
        __m512 a[3][4];
        for (int m = 0; m < NM; m++)
            for (int y = 0; y < TB / 2; y++) a[m][y] = _mm512_setzero_ps();
        for (int i = 0; i < per; i++)
            for (int u = 0; u < np; u += 8) {
                const float *qk = qq + i * np + u;
                __m512 qv[3];
                for (int m = 0; m < NM; m++) qv[m] = bcast8x2(_mm256_loadu_ps(qk + m * D));
                for (int y = 0; y < TB / 2; y++) {
                    const __m512 f = codes8x2(cp[2 * y], cp[2 * y + 1], u, bits * i, bits);
                    for (int m = 0; m < NM; m++) a[m][y] = _mm512_fmadd_ps(qv[m], f, a[m][y]);
                }
            }
        for (int m = 0; m < NM; m++)
            for (int y = 0; y < TB / 2; y += 2) {
                const __m128 sv = hsum2x2(a[m][y], a[m][y + 1], cst ? cst[m] : 0.0f);
                store4(o + m * os + j + 2 * y, sv, n - j - 2 * y);
            }
    }
}
#endif

/* k_direct for M queries: 3 at a time (1 query: 8 tokens at a time, enough FMA chains for both pipes). */
KV_INLINE void k_direct_all(int bits, int M, const float *restrict qq, int D, const float *restrict cst,
                            const uint8_t *c0, int64_t cs, int np, int n, float *restrict o, int64_t os) {
    for (int m = 0; m < M; m += 3) {
        const float *c = cst ? cst + m : NULL;
#if defined(__AVX512F__)
        switch (M - m) {
        case 1: k_direct16(bits, 1, 8, qq + (int64_t)m * D, D, c, c0, cs, np, n, o + m * os, os); break;
        case 2: k_direct16(bits, 2, 8, qq + (int64_t)m * D, D, c, c0, cs, np, n, o + m * os, os); break;
        default: k_direct16(bits, 3, 8, qq + (int64_t)m * D, D, c, c0, cs, np, n, o + m * os, os); break;
        }
#else
        switch (M - m) {
        case 1: k_direct(bits, 1, 8, qq + (int64_t)m * D, D, c, c0, cs, np, n, o + m * os, os); break;
        case 2: k_direct(bits, 2, 4, qq + (int64_t)m * D, D, c, c0, cs, np, n, o + m * os, os); break;
        default: k_direct(bits, 3, 4, qq + (int64_t)m * D, D, c, c0, cs, np, n, o + m * os, os); break;
        }
#endif
    }
}

/* V sums acc[m] (plane order) += p[m, t] * (code * scale + zero) for NM queries (p rows pb, stride ps) over tokens
 * t0 .. t1 (codes at c0 + cs * t), 32 channels at a time in registers, channel groups of run plane elements (a
 * multiple of 8). v_affine_task's arithmetic: each code converted, fma(code, scale, zero), then one FMA per query,
 * token by token. */
KV_INLINE void v_direct(int bits, int NM, const float *restrict pb, int64_t ps, const uint8_t *c0, int64_t cs,
                        const kv_part *sc, const kv_part *zr, int b, int h, int t0, int t1, int np, int run, int D,
                        float *restrict acc) {
#if defined(__AVX512F__)
    if (np % 16 == 0 && run % 16 == 0 && D % 64 == 0) {
        v_direct16(bits, NM, pb, ps, c0, cs, sc, zr, b, h, t0, t1, np, run, D, acc);
        return;
    }
#endif
    const int sdt = sc->dtype, zdt = zr->dtype;
    const uint8_t *s0 = at(sc, b, h, 0), *z0 = at(zr, b, h, 0);
    const int64_t ss = sc->s2 * dtype_size(sdt), zs = zr->s2 * dtype_size(zdt);
    for (int kb = 0; kb < D; kb += 32) {
        int sh[4], uu[4], gg[4];
        for (int x = 0; x < 4; x++) {
            const int k = kb + 8 * x, i = k / np;
            sh[x] = bits * i, uu[x] = k - i * np, gg[x] = uu[x] / run;
        }
        __m256 a[3][4];
        for (int m = 0; m < NM; m++)
            for (int x = 0; x < 4; x++) a[m][x] = _mm256_loadu_ps(acc + (int64_t)m * D + kb + 8 * x);
        if (gg[0] == gg[1] && gg[1] == gg[2] && gg[2] == gg[3]) { /* one scale and zero for the 32 channels */
            const int g0 = gg[0];
            for (int t = t0; t < t1; t++) {
                const uint8_t *c = c0 + cs * t;
                const __m256 sv = _mm256_set1_ps(ldf(s0 + ss * t, g0, sdt)), zv = _mm256_set1_ps(ldf(z0 + zs * t, g0, zdt));
                __m256 w[3];
                for (int m = 0; m < NM; m++) w[m] = _mm256_broadcast_ss(pb + m * ps + t);
                for (int x = 0; x < 4; x++) {
                    const __m256 f = _mm256_fmadd_ps(codes8(c, uu[x], sh[x], bits), sv, zv);
                    for (int m = 0; m < NM; m++) a[m][x] = _mm256_fmadd_ps(w[m], f, a[m][x]);
                }
            }
        } else {
            for (int t = t0; t < t1; t++) {
                const uint8_t *c = c0 + cs * t;
                __m256 w[3];
                for (int m = 0; m < NM; m++) w[m] = _mm256_broadcast_ss(pb + m * ps + t);
                for (int x = 0; x < 4; x++) {
                    const __m256 f = _mm256_fmadd_ps(codes8(c, uu[x], sh[x], bits), _mm256_set1_ps(ldf(s0 + ss * t, gg[x], sdt)),
                                                     _mm256_set1_ps(ldf(z0 + zs * t, gg[x], zdt)));
                    for (int m = 0; m < NM; m++) a[m][x] = _mm256_fmadd_ps(w[m], f, a[m][x]);
                }
            }
        }
        for (int m = 0; m < NM; m++)
            for (int x = 0; x < 4; x++) _mm256_storeu_ps(acc + (int64_t)m * D + kb + 8 * x, a[m][x]);
    }
}

/* Elements 8e .. 8e + 7 of a q8_0 / q4_0 token row (natural order), as decode_row gives them: d * (code [- 8]);
 * of a sym8 row (R_SYM8), d * code with the row's one scale. */
KV_INLINE __m256 ggml8(int fmt, const uint8_t *restrict src, int e) {
    if (fmt == R_SYM8) {
        const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + 2 + 8 * e)));
        return _mm256_mul_ps(_mm256_set1_ps(h2f(ld_u16(src))), _mm256_cvtepi32_ps(v));
    }
    const int blk = e >> 2, w = e & 3; /* a block of QK = 32 elements: 4 runs of 8 */
    if (fmt == R_Q8_0) {
        const uint8_t *p = src + Q8_0_BYTES * blk;
        const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 2 + 8 * w)));
        return _mm256_mul_ps(_mm256_set1_ps(h2f(ld_u16(p))), _mm256_cvtepi32_ps(v));
    }
    const uint8_t *p = src + Q4_0_BYTES * blk; /* elements j < 16: low nibbles of qs[j]; 16 + j: high nibbles */
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 2 + 8 * (w & 1))));
    const __m256i c = w < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(15)) : _mm256_srli_epi32(v, 4);
    return _mm256_mul_ps(_mm256_set1_ps(h2f(ld_u16(p))), _mm256_cvtepi32_ps(_mm256_sub_epi32(c, _mm256_set1_epi32(8))));
}

#if defined(__AVX512F__)
/* Elements 16e .. 16e + 15 of a q8_0 / q4_0 / sym8 row: ggml8's lanes of e2 = 2e and 2e + 1, lane for lane. */
KV_INLINE __m512 ggml16(int fmt, const uint8_t *restrict src, int e) {
    if (fmt == R_SYM8) {
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 2 + 16 * e)));
        return _mm512_mul_ps(_mm512_set1_ps(h2f(ld_u16(src))), _mm512_cvtepi32_ps(v));
    }
    const int blk = e >> 1, half = e & 1;
    if (fmt == R_Q8_0) {
        const uint8_t *p = src + Q8_0_BYTES * blk;
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2 + 16 * half)));
        return _mm512_mul_ps(_mm512_set1_ps(h2f(ld_u16(p))), _mm512_cvtepi32_ps(v));
    }
    const uint8_t *p = src + Q4_0_BYTES * blk; /* elements j < 16: low nibbles of qs[j]; 16 + j: high nibbles */
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 2)));
    const __m512i c = half ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
    return _mm512_mul_ps(_mm512_set1_ps(h2f(ld_u16(p))), _mm512_cvtepi32_ps(_mm512_sub_epi32(c, _mm512_set1_epi32(8))));
}

/* ggml8(fmt, a, e) in lanes 0-7 and ggml8(fmt, b, e) in lanes 8-15, lane for lane. */
KV_INLINE __m512 ggml8x2(int fmt, const uint8_t *restrict a, const uint8_t *restrict b, int e) {
    const uint8_t *pa, *pb;
    if (fmt == R_SYM8) {
        pa = a, pb = b;
    } else {
        const int blk = e >> 2, bytes = fmt == R_Q8_0 ? Q8_0_BYTES : Q4_0_BYTES;
        pa = a + bytes * blk, pb = b + bytes * blk;
    }
    const int off = fmt == R_SYM8 ? 2 + 8 * e : fmt == R_Q8_0 ? 2 + 8 * (e & 3) : 2 + 8 * (e & 1);
    const __m128i x = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(pa + off)),
                                         _mm_loadl_epi64((const __m128i *)(pb + off)));
    const __m512 d = join8x2(_mm256_set1_ps(h2f(ld_u16(pa))), _mm256_set1_ps(h2f(ld_u16(pb))));
    if (fmt != R_Q4_0) return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x)));
    const __m512i v = _mm512_cvtepu8_epi32(x);
    const __m512i c = (e & 3) < 2 ? _mm512_and_si512(v, _mm512_set1_epi32(15)) : _mm512_srli_epi32(v, 4);
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(c, _mm512_set1_epi32(8))));
}

/* k_ggml with two tokens a register (k_direct16's scheme). */
KV_INLINE void k_ggml16(int fmt, int NM, int TB, const float *restrict qq, int64_t qs, int D, const uint8_t *x0,
                        int64_t xs, int n, float *restrict o, int64_t os) {
    for (int j = 0; j < n; j += TB) {
        const uint8_t *cp[8];
        for (int x = 0; x < TB; x++) {
            cp[x] = x0 + xs * (j + x < n ? j + x : n - 1);
            _mm_prefetch((const char *)(cp[x] + 32 * xs), _MM_HINT_T0);
        }
        __m512 a[3][4];
        for (int m = 0; m < NM; m++)
            for (int y = 0; y < TB / 2; y++) a[m][y] = _mm512_setzero_ps();
        for (int e = 0; e < D / 8; e++) {
            __m512 qv[3];
            for (int m = 0; m < NM; m++) qv[m] = bcast8x2(_mm256_loadu_ps(qq + m * qs + 8 * e));
            for (int y = 0; y < TB / 2; y++) {
                const __m512 f = ggml8x2(fmt, cp[2 * y], cp[2 * y + 1], e);
                for (int m = 0; m < NM; m++) a[m][y] = _mm512_fmadd_ps(qv[m], f, a[m][y]);
            }
        }
        for (int m = 0; m < NM; m++)
            for (int y = 0; y < TB / 2; y += 2) {
                const __m128 sv = hsum2x2(a[m][y], a[m][y + 1], 0.0f);
                store4(o + m * os + j + 2 * y, sv, n - j - 2 * y);
            }
    }
}

/* v_ggml, 64 channels (4 registers of 16) at a time: D % 64 == 0. */
KV_INLINE void v_ggml16(int fmt, int NM, const float *restrict pb, int64_t ps, const uint8_t *x0, int64_t xs, int t0,
                        int t1, int D, float *restrict acc) {
    for (int kb = 0; kb < D; kb += 64) {
        __m512 a[3][4];
        for (int m = 0; m < NM; m++)
            for (int x = 0; x < 4; x++) a[m][x] = _mm512_loadu_ps(acc + (int64_t)m * D + kb + 16 * x);
        for (int t = t0; t < t1; t++) {
            const uint8_t *c = x0 + xs * t;
            _mm_prefetch((const char *)(c + 24 * xs), _MM_HINT_T0);
            __m512 w[3];
            for (int m = 0; m < NM; m++) w[m] = _mm512_set1_ps(pb[m * ps + t]);
            for (int x = 0; x < 4; x++) {
                const __m512 f = ggml16(fmt, c, kb / 16 + x);
                for (int m = 0; m < NM; m++) a[m][x] = _mm512_fmadd_ps(w[m], f, a[m][x]);
            }
        }
        for (int m = 0; m < NM; m++)
            for (int x = 0; x < 4; x++) _mm512_storeu_ps(acc + (int64_t)m * D + kb + 16 * x, a[m][x]);
    }
}
#endif

/* k_direct for q8_0 / q4_0 rows: scores o[m * os + j] = q[m] . row(j) for NM queries (rows of stride qs, natural
 * order) and the n tokens at x0 (byte stride xs). */
KV_INLINE void k_ggml(int fmt, int NM, int TB, const float *restrict qq, int64_t qs, int D, const uint8_t *x0,
                      int64_t xs, int n, float *restrict o, int64_t os) {
#if defined(__AVX512F__)
    (void)TB; /* 8 tokens at a time, two a register */
    k_ggml16(fmt, NM, 8, qq, qs, D, x0, xs, n, o, os);
#else
    for (int j = 0; j < n; j += TB) {
        const uint8_t *cp[8];
        for (int x = 0; x < TB; x++) cp[x] = x0 + xs * (j + x < n ? j + x : n - 1);
        __m256 a[3][8];
        for (int m = 0; m < NM; m++)
            for (int x = 0; x < TB; x++) a[m][x] = _mm256_setzero_ps();
        for (int e = 0; e < D / 8; e++)
            for (int x = 0; x < TB; x++) {
                const __m256 f = ggml8(fmt, cp[x], e);
                for (int m = 0; m < NM; m++) a[m][x] = _mm256_fmadd_ps(_mm256_loadu_ps(qq + m * qs + 8 * e), f, a[m][x]);
            }
        for (int m = 0; m < NM; m++)
            for (int x = 0; x < TB; x += 4) {
                const __m128 sv = hsum4(a[m][x], a[m][x + 1], a[m][x + 2], a[m][x + 3], _mm_set1_ps(0.0f));
                store4(o + m * os + j + x, sv, n - j - x);
            }
    }
#endif
}

/* v_direct for q8_0 / q4_0 rows: acc[m] += p[m, t] * row(t) for NM queries over tokens t0 .. t1 (rows at x0 + xs * t),
 * 32 channels (a block) at a time in registers; v_tile's FMAs in its order. */
KV_INLINE void v_ggml(int fmt, int NM, const float *restrict pb, int64_t ps, const uint8_t *x0, int64_t xs, int t0,
                      int t1, int D, float *restrict acc) {
#if defined(__AVX512F__)
    if (D % 64 == 0) {
        v_ggml16(fmt, NM, pb, ps, x0, xs, t0, t1, D, acc);
        return;
    }
#endif
    for (int kb = 0; kb < D; kb += 32) {
        __m256 a[3][4];
        for (int m = 0; m < NM; m++)
            for (int x = 0; x < 4; x++) a[m][x] = _mm256_loadu_ps(acc + (int64_t)m * D + kb + 8 * x);
        for (int t = t0; t < t1; t++) {
            const uint8_t *c = x0 + xs * t;
            __m256 w[3];
            for (int m = 0; m < NM; m++) w[m] = _mm256_broadcast_ss(pb + m * ps + t);
            for (int x = 0; x < 4; x++) {
                const __m256 f = ggml8(fmt, c, kb / 8 + x);
                for (int m = 0; m < NM; m++) a[m][x] = _mm256_fmadd_ps(w[m], f, a[m][x]);
            }
        }
        for (int m = 0; m < NM; m++)
            for (int x = 0; x < 4; x++) _mm256_storeu_ps(acc + (int64_t)m * D + kb + 8 * x, a[m][x]);
    }
}
#endif

/* --------------------------------------------------------------------------------- per-token tasks */

KV_INLINE void decode_tile(int fmt, const kv_part *x, const kv_part *xs, int D, int b, int h, int t, int n,
                           float *restrict rows) {
    for (int j = 0; j < n; j++) {
        const float sc = fmt == R_FP8 ? *(const float *)at(xs, b, h, t + j) : 1.0f;
        decode_row(fmt, at(x, b, h, t + j), sc, rows + (int64_t)j * D, D);
    }
}

KV_INLINE void k_rows_task(int fmt, const kv_part *q, const kv_part *x, const kv_part *xs, const kv_part *out,
                           int M, int D, int b, int h, int t0, int t1, float *restrict rows, const kv_tr *tr, int tiles) {
    (void)tiles; /* read with AVX2 only */
    const float *qb = (const float *)at(q, b, h, 0);
    float *ob = (float *)at(out, b, h, 0);
#if defined(__AVX2__) && defined(__FMA__)
    if ((fmt == R_Q8_0 || fmt == R_Q4_0) && !tr && !tiles && D % 32 == 0 && t1 > t0) { /* in registers, same bits */
        const uint8_t *x0 = at(x, b, h, t0);
        for (int m = 0; m < M; m += 3) {
            const float *qm = qb + m * q->s2;
            float *om = ob + m * out->s2 + t0;
            switch (M - m) {
            case 1: k_ggml(fmt, 1, 8, qm, q->s2, D, x0, x->s2, t1 - t0, om, out->s2); break;
            case 2: k_ggml(fmt, 2, 4, qm, q->s2, D, x0, x->s2, t1 - t0, om, out->s2); break;
            default: k_ggml(fmt, 3, 4, qm, q->s2, D, x0, x->s2, t1 - t0, om, out->s2); break;
            }
        }
        return;
    }
#endif
    for (int t = t0; t < t1; t += TILE) {
        const int n = t1 - t < TILE ? t1 - t : TILE;
        decode_tile(fmt, x, xs, D, b, h, t, n, rows);
        if (tr) transform_rows(tr, rows, n, D, b, h, t, rows + (int64_t)TILE * D);
        k_tile(qb, q->s2, NULL, M, D, rows, n, ob, out->s2, t);
    }
}

/* acc (M, D) += p[:, t0:t1] @ rows over one token chunk. */
KV_INLINE void v_rows_task(int fmt, const kv_part *p, const kv_part *x, const kv_part *xs, int M, int D, int b,
                           int h, int t0, int t1, float *restrict rows, float *restrict acc, int tiles) {
    (void)tiles; /* read with AVX2 only */
    const float *pb = (const float *)at(p, b, h, 0);
#if defined(__AVX2__) && defined(__FMA__)
    if ((fmt == R_Q8_0 || fmt == R_Q4_0) && !tiles && D % 32 == 0) { /* in registers, same bits */
        const uint8_t *x0 = at(x, b, h, 0);
        for (int m = 0; m < M; m += 3) {
            const float *pm = pb + (int64_t)m * p->s2;
            float *am = acc + (int64_t)m * D;
            switch (M - m) {
            case 1: v_ggml(fmt, 1, pm, p->s2, x0, x->s2, t0, t1, D, am); break;
            case 2: v_ggml(fmt, 2, pm, p->s2, x0, x->s2, t0, t1, D, am); break;
            default: v_ggml(fmt, 3, pm, p->s2, x0, x->s2, t0, t1, D, am); break;
            }
        }
        return;
    }
#endif
    for (int t = t0; t < t1; t += TILE) {
        const int n = t1 - t < TILE ? t1 - t : TILE;
        decode_tile(fmt, x, xs, D, b, h, t, n, rows);
        v_tile(pb + t, p->s2, M, D, rows, n, acc);
    }
}

/* --------------------------------------------------------------------------------- KIVI K */

/* The queries of (b, h) in plane order, once per task: qp[m, i * np + j] = q[m, per * j + i]. */
KV_INLINE void plane_queries(const kv_part *q, int M, int D, int per, int b, int h, float *restrict qp) {
    const int np = D / per;
    const float *qb = (const float *)at(q, b, h, 0);
    for (int m = 0; m < M; m++) {
        const float *qm = qb + m * q->s2;
        float *o = qp + m * D;
        for (int i = 0; i < per; i++)
            for (int j = 0; j < np; j++) o[i * np + j] = qm[per * j + i];
    }
}

/* Fold the scale/zero of group g into the queries: qq[m, i * np + j] = q[m, d] * scale[d] for
 * d = per * j + i (plane order; qp: the queries already in it), cst[m] = sum_d q[m, d] * zero[d]. tmp: 3 * D
 * floats. */
KV_INLINE void fold_group(const kv_part *q, const kv_part *sc, const kv_part *zr, int M, int D, int per, int b, int h,
                       int g, const float *restrict qp, float *restrict qq, float *restrict cst, float *restrict tmp) {
    float *s = tmp, *z = tmp + D, *sp = tmp + 2 * D;
    const int np = D / per;
    load_floats(at(sc, b, h, g), sc->dtype, s, D);
    load_floats(at(zr, b, h, g), zr->dtype, z, D);
    int j0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (per == 2) /* int4: evens to plane 0, odds to plane 1, 16 at a time */
        for (; j0 + 8 <= np; j0 += 8) {
            const __m256 a = _mm256_loadu_ps(s + 2 * j0), c = _mm256_loadu_ps(s + 2 * j0 + 8);
            const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
            _mm256_storeu_ps(sp + j0, _mm256_permutevar8x32_ps(_mm256_shuffle_ps(a, c, 0x88), order));
            _mm256_storeu_ps(sp + np + j0, _mm256_permutevar8x32_ps(_mm256_shuffle_ps(a, c, 0xDD), order));
        }
#endif
    for (int i = 0; i < per; i++)
        for (int j = j0; j < np; j++) sp[i * np + j] = s[per * j + i];
    const float *qb = (const float *)at(q, b, h, 0);
    for (int m = 0; m < M; m++) {
        const float *restrict a = qp + m * D;
        float *restrict o = qq + m * D;
        KV_SIMD
        for (int k = 0; k < D; k++) o[k] = a[k] * sp[k];
        cst[m] = dot(qb + m * q->s2, z, D);
    }
}

KV_INLINE void k_affine_task(int bits, const kv_part *q, const kv_part *codes, const kv_part *sc, const kv_part *zr,
                             const kv_part *out, int M, int D, int G, int offset, int b, int h, int t0, int t1,
                             float *restrict scratch, const kv_part *vn, int tiles) {
    (void)tiles; /* read with AVX2 only */
    const int per = codes_per_unit(bits), np = D / per;
    float *rows = scratch, *qq = rows + TILE * D, *tmp = qq + M * D, *cst = tmp + 3 * D, *hs = cst + M, *qp = hs + M;
    const float half = 0.5f * (float)((1 << bits) - 1);
    float *ob = (float *)at(out, b, h, 0);
    plane_queries(q, M, D, per, b, h, qp);
    for (int t = t0; t < t1;) {
        const int g = (offset + t) / G;
        const int gend = (g + 1) * G - offset; /* first token of the next group */
        fold_group(q, sc, zr, M, D, per, b, h, g, qp, qq, cst, tmp);
        if (vn) /* x = zero + r_t * scale * (code - half): score = cst + r_t * (qq . code - half * sum(qq)) */
            for (int m = 0; m < M; m++) {
                float acc = 0.0f;
                for (int k = 0; k < D; k++) acc += qq[(int64_t)m * D + k];
                hs[m] = half * acc;
            }
        const int stop = t1 < gend ? t1 : gend;
#if defined(__AVX2__) && defined(__FMA__)
        if (bits != 3 && np % 8 == 0 && !tiles) { /* codes in registers; the same scores as the tiles below */
            k_direct_all(bits, M, qq, D, vn ? NULL : cst, at(codes, b, h, t), codes->s2, np, stop - t, ob + t, out->s2);
            if (vn)
                for (int j = t; j < stop; j++) {
                    const float r = vn_factor(*at(vn, b, h, j));
                    for (int m = 0; m < M; m++) {
                        float *o = ob + m * out->s2 + j;
                        *o = cst[m] + r * (*o - hs[m]);
                    }
                }
            t = stop;
            continue;
        }
#endif
        for (; t < stop; t += TILE) {
            const int n = stop - t < TILE ? stop - t : TILE;
            for (int j = 0; j < n; j++)
                unpack_planes(at(codes, b, h, t + j), rows + (int64_t)j * D, np, bits, NULL, NULL, 1);
            k_tile(qq, D, vn ? NULL : cst, M, D, rows, n, ob, out->s2, t);
            if (vn)
                for (int j = 0; j < n; j++) {
                    const float r = vn_factor(*at(vn, b, h, t + j));
                    for (int m = 0; m < M; m++) {
                        float *o = ob + m * out->s2 + t + j;
                        *o = cst[m] + r * (*o - hs[m]);
                    }
                }
        }
        t = stop;
    }
}

/* KIVI K decoded with its scales (natural channel order), transformed, dotted with the unfolded queries.
 * The group's scales and zeros are permuted into plane order once per group, so a token's decode is an
 * unpack, a vectorized multiply-add, and one un-permuting copy. scratch: rows (TILE * D), plane-order
 * codes (D), scale and zero (2 * D), their plane-order copies (2 * D), a row for the transform (D). */
KV_INLINE void k_affine_t_task(int bits, const kv_part *q, const kv_part *codes, const kv_part *sc, const kv_part *zr,
                               const kv_part *out, int M, int D, int G, int offset, int b, int h, int t0, int t1,
                               float *restrict scratch, const kv_tr *tr, const kv_part *vn) {
    const int per = codes_per_unit(bits), np = D / per;
    const float half = 0.5f * (float)((1 << bits) - 1);
    float *rows = scratch, *tmp = rows + TILE * D, *s = tmp + D, *z = s + D, *sp = z + D, *zp = sp + D;
    float *row = zp + D;
    const float *qb = (const float *)at(q, b, h, 0);
    float *ob = (float *)at(out, b, h, 0);
    for (int t = t0; t < t1;) {
        const int g = (offset + t) / G;
        const int gend = (g + 1) * G - offset;
        load_floats(at(sc, b, h, g), sc->dtype, s, D);
        load_floats(at(zr, b, h, g), zr->dtype, z, D);
        for (int i = 0; i < per; i++)
            for (int jj = 0; jj < np; jj++) {
                sp[i * np + jj] = s[per * jj + i];
                zp[i * np + jj] = z[per * jj + i];
            }
        const int stop = t1 < gend ? t1 : gend;
        for (; t < stop; t += TILE) {
            const int n = stop - t < TILE ? stop - t : TILE;
            for (int j = 0; j < n; j++) {
                float *restrict r = rows + (int64_t)j * D;
                unpack_planes(at(codes, b, h, t + j), tmp, np, bits, NULL, NULL, 1);
                if (vn) { /* x = zero + r_t * scale * (code - half) */
                    const float rt = vn_factor(*at(vn, b, h, t + j));
                    for (int k = 0; k < D; k++) tmp[k] = zp[k] + rt * (sp[k] * (tmp[k] - half));
                } else {
                    KV_SIMD
                    for (int k = 0; k < D; k++) tmp[k] = tmp[k] * sp[k] + zp[k];
                }
                for (int i = 0; i < per; i++)
                    for (int jj = 0; jj < np; jj++) r[per * jj + i] = tmp[i * np + jj];
            }
            transform_rows(tr, rows, n, D, b, h, t, row);
            k_tile(qb, q->s2, NULL, M, D, rows, n, ob, out->s2, t);
        }
        t = stop;
    }
}

/* --------------------------------------------------------------------------------- KIVI V */

/* acc (plane order) += p[m, t] * (code * scale + zero) over a chunk; channel groups of g (g % per == 0). */
KV_INLINE void v_affine_task(int bits, const kv_part *p, const kv_part *codes, const kv_part *sc, const kv_part *zr,
                             int M, int D, int g, int b, int h, int t0, int t1, float *restrict scratch,
                             float *restrict acc, const kv_part *vn, int G, int offset, int tiles) {
    (void)tiles; /* read with AVX2 only */
    const int per = codes_per_unit(bits), np = D / per, ng = D / g, run = g / per;
    float *rows = scratch, *s = rows + TILE * D, *z = s + ng, *cf = z + ng;
    int cg = -1; /* the token group whose channel factors cf holds (plane order) */
    const float *pb = (const float *)at(p, b, h, 0);
#if defined(__AVX2__) && defined(__FMA__)
    if (bits != 3 && np % 8 == 0 && run % 8 == 0 && D % 32 == 0 && !vn && !tiles) { /* codes in registers, same sums */
        const uint8_t *c0 = at(codes, b, h, 0);
        for (int m = 0; m < M; m += 3) {
            const float *pm = pb + (int64_t)m * p->s2;
            float *am = acc + (int64_t)m * D;
            switch (M - m) {
            case 1: v_direct(bits, 1, pm, p->s2, c0, codes->s2, sc, zr, b, h, t0, t1, np, run, D, am); break;
            case 2: v_direct(bits, 2, pm, p->s2, c0, codes->s2, sc, zr, b, h, t0, t1, np, run, D, am); break;
            default: v_direct(bits, 3, pm, p->s2, c0, codes->s2, sc, zr, b, h, t0, t1, np, run, D, am); break;
            }
        }
        return;
    }
#endif
    for (int t = t0; t < t1; t += TILE) {
        const int n = t1 - t < TILE ? t1 - t : TILE;
        for (int jt = 0; jt < n; jt++) {
            float *row = rows + (int64_t)jt * D;
            const uint8_t *sp = at(sc, b, h, t + jt), *zp = at(zr, b, h, t + jt);
            for (int gg = 0; gg < ng; gg++) {
                s[gg] = ldf(sp, gg, sc->dtype);
                z[gg] = ldf(zp, gg, zr->dtype);
            }
            unpack_planes(at(codes, b, h, t + jt), row, np, bits, s, z, run);
            if (vn) { /* x = c_d * (code * scale + zero), c per group of G tokens */
                const int gi = (offset + t + jt) / G;
                if (gi != cg) {
                    const uint8_t *c = at(vn, b, h, gi);
                    for (int i = 0; i < per; i++)
                        for (int j = 0; j < np; j++) cf[i * np + j] = vn_factor(c[per * j + i]);
                    cg = gi;
                }
                KV_SIMD
                for (int k = 0; k < D; k++) row[k] *= cf[k];
            }
        }
        v_tile(pb + t, p->s2, M, D, rows, n, acc);
    }
}

/* --------------------------------------------------------------------------------- drivers */

/* One call's work: B * H * nc tasks, task = (b, h, token chunk c); V tasks sum into part[task] (M, D). */
typedef struct {
    int op, fmt, bits, group, offset, nc;
    const kv_part *x, *p1, *p2, *p3, *out; /* q or p; codes/rows; scale or fp8 scale; zero; output */
    const kv_dims *dm;
    float *part;
    const kv_tr *tr; /* transformed K ops only, else NULL */
    const kv_part *vn; /* variance-normalized affine bodies: K token factors (B,H,T,1) / V channel factors
                          (B,H,n,D) uint8, else NULL (formats/varnorm.py) */
    int vgroup, voffset; /* V with vn: tokens per channel-factor row, tokens evicted from the first group */
    int tiles;           /* decode through the tiles, never in registers (kv_run's test switch) */
} kv_call;

static void run_task(const kv_call *k, int64_t task, float *scratch);

/* Runs every task on nt threads (the caller's alone when nt == 1: no OpenMP region, no fork/join),
 * each thread with its own zeroed scratch of scratch_floats. */
static int run_tasks(const kv_call *k, int64_t ntasks, int nt, size_t scratch_floats) {
    int err = KV_OK;
    if (nt <= 1) {
        float *scratch = (float *)calloc(scratch_floats, sizeof(float));
        if (!scratch) return KV_ENOMEM;
        for (int64_t task = 0; task < ntasks; task++) run_task(k, task, scratch);
        free(scratch);
        return KV_OK;
    }
#pragma omp parallel num_threads(nt)
    {
        float *scratch = (float *)calloc(scratch_floats, sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            err = KV_ENOMEM;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntasks; task++)
            if (scratch) run_task(k, task, scratch);
        free(scratch);
    }
    return err;
}

enum { OP_K_ROWS = 0, OP_V_ROWS = 1, OP_K_AFFINE = 2, OP_V_AFFINE = 3, OP_K_ROWS_T = 4, OP_K_AFFINE_T = 5 };

/* Tokens t0 .. t1 of (b, h): the always-inline task bodies, instantiated per format (fmt / bits are constants
 * in each case). V sums go into acc (M, D), in token order. Not inlined: kv_run, kv_attend and kv_attend_rows
 * run these same instructions (see the fused decode attention below). */
static KV_NOINLINE void run_range(const kv_call *k, int b, int h, int t0, int t1, float *scratch, float *acc) {
    const int M = k->dm->M, D = k->dm->D;
#define KV_ROWS(FMT)                                                                                            \
    case FMT:                                                                                                   \
        if (k->op == OP_K_ROWS || k->op == OP_K_ROWS_T)                                                         \
            k_rows_task(FMT, k->x, k->p1, k->p2, k->out, M, D, b, h, t0, t1, scratch, k->tr, k->tiles);         \
        else                                                                                                    \
            v_rows_task(FMT, k->x, k->p1, k->p2, M, D, b, h, t0, t1, scratch, acc, k->tiles);                   \
        return;
#define KV_AFFINE(BITS)                                                                                         \
    case BITS:                                                                                                  \
        if (k->op == OP_K_AFFINE_T)                                                                             \
            k_affine_t_task(BITS, k->x, k->p1, k->p2, k->p3, k->out, M, D, k->group, k->offset, b, h, t0, t1,   \
                            scratch, k->tr, k->vn);                                                             \
        else if (k->op == OP_K_AFFINE)                                                                          \
            k_affine_task(BITS, k->x, k->p1, k->p2, k->p3, k->out, M, D, k->group, k->offset, b, h, t0, t1,       \
                          scratch, k->vn, k->tiles);                                                            \
        else                                                                                                    \
            v_affine_task(BITS, k->x, k->p1, k->p2, k->p3, M, D, k->group, b, h, t0, t1, scratch, acc, k->vn,   \
                          k->vgroup, k->voffset, k->tiles);                                                     \
        return;
    if (k->op == OP_K_ROWS || k->op == OP_V_ROWS || k->op == OP_K_ROWS_T) {
        switch (k->fmt) {
            KV_ROWS(R_Q8_0)
            KV_ROWS(R_Q4_0)
            KV_ROWS(R_Q4_1)
            KV_ROWS(R_Q5_0)
            KV_ROWS(R_Q5_1)
            KV_ROWS(R_F32)
            KV_ROWS(R_F16)
            KV_ROWS(R_BF16)
            KV_ROWS(R_FP8)
        default: return;
        }
    }
    switch (k->bits) {
        KV_AFFINE(8)
        KV_AFFINE(4)
        KV_AFFINE(3)
        KV_AFFINE(2)
    default: return;
    }
#undef KV_ROWS
#undef KV_AFFINE
}

/* Task (b, h, token chunk c) of a call: chunk c of nc splits T at c * T / nc. */
static void run_task(const kv_call *k, int64_t task, float *scratch) {
    const kv_dims *dm = k->dm;
    const int M = dm->M, D = dm->D, H = dm->H, T = dm->T, nc = k->nc;
    const int b = (int)(task / ((int64_t)H * nc)), h = (int)((task / nc) % H), c = (int)(task % nc);
    const int t0 = (int)((int64_t)c * T / nc), t1 = (int)((int64_t)(c + 1) * T / nc);
    run_range(k, b, h, t0, t1, scratch, k->part ? k->part + task * M * D : NULL);
}

/* Sum the per-chunk partial sums of each (b, h) into out, un-permuting plane order (per = 1: natural). */
static void reduce_chunks(float *part, const kv_part *out, const kv_dims *dm, int nc, int per) {
    const int M = dm->M, D = dm->D, H = dm->H, np = D / per;
    const int64_t nbh = (int64_t)dm->B * H;
    for (int64_t bh = 0; bh < nbh; bh++) {
        const int b = (int)(bh / H), h = (int)(bh % H);
        float *ob = (float *)at(out, b, h, 0);
        for (int m = 0; m < M; m++) {
            float *restrict o = ob + m * out->s2;
            float *restrict sum = part + (bh * nc) * M * D + m * D; /* chunk 0's, summed in place */
            for (int c = 1; c < nc; c++) {
                const float *restrict pc = part + (bh * nc + c) * M * D + m * D;
                KV_SIMD
                for (int k = 0; k < D; k++) sum[k] += pc[k];
            }
            for (int i = 0; i < per; i++)
                for (int j = 0; j < np; j++) o[per * j + i] = sum[i * np + j];
        }
    }
}

/* Validate, split into tasks, run, reduce (V). */
static int run_call(kv_call *k) {
    const kv_dims *dm = k->dm;
    const int M = dm->M, D = dm->D, nt = threads_of(dm);
    const int is_v = k->op == OP_V_ROWS || k->op == OP_V_AFFINE;
    size_t scratch;
    int per = 1;
    if (k->tr) {
        const kv_tr *tr = k->tr;
        if (tr->hblock && (tr->hblock & (tr->hblock - 1) || D % tr->hblock)) return KV_EARG;
        if (tr->rhalf < 0 || tr->roff < 0 || tr->roff + 2 * tr->rhalf > D) return KV_EARG;
        if (tr->mat && tr->hblock) return KV_EARG; /* one basis: a Hadamard or a fitted matrix */
    }
    if (k->op == OP_K_AFFINE_T) {
        if (!affine_bits_ok(k->bits)) return KV_EARG;
        if (D % codes_per_unit(k->bits) || k->group < 1 || k->offset < 0 || k->offset >= k->group) return KV_EARG;
        scratch = (size_t)(TILE + 6) * D; /* rows, plane-order codes, scale, zero, plane-order copies, a row */
    } else if (k->op == OP_K_ROWS || k->op == OP_V_ROWS || k->op == OP_K_ROWS_T) {
        if (k->fmt < R_Q8_0 || k->fmt > R_FP8 || (D % QK != 0 && k->fmt <= R_Q5_1)) return KV_EARG;
        scratch = (size_t)(TILE + (k->op == OP_K_ROWS_T)) * D; /* rows (+ a row for the transform) */
    } else {
        if (!affine_bits_ok(k->bits)) return KV_EARG;
        per = codes_per_unit(k->bits);
        if (D % per || k->group < 1) return KV_EARG;
        if (k->op == OP_K_AFFINE) {
            if (k->offset < 0 || k->offset >= k->group) return KV_EARG;
            /* rows, folded queries, scale/zero/permuted scale, consts, plane-order queries */
            scratch = (size_t)(TILE + 2 * M + 3) * D + 2 * (size_t)M;
        } else {
            if (D % k->group || k->group % per) return KV_EARG;
            if (k->vn && (k->vgroup < 1 || k->voffset < 0 || k->voffset >= k->vgroup)) return KV_EARG;
            /* rows, one token's scales/zeros, a group's channel factors */
            scratch = (size_t)(TILE + 1) * D + 2 * (size_t)(D / k->group);
        }
    }
    k->nc = n_chunks(dm->B * dm->H, dm->T, nt, 128);
    const int64_t ntasks = (int64_t)dm->B * dm->H * k->nc;
    k->part = NULL;
    if (is_v) {
        k->part = (float *)calloc((size_t)ntasks * M * D, sizeof(float));
        if (!k->part) return KV_ENOMEM;
    }
    int err = run_tasks(k, ntasks, nt, scratch);
    if (is_v) {
        if (err == KV_OK) reduce_chunks(k->part, k->out, dm, k->nc, per); /* on this thread: a few us */
        free(k->part);
    }
    return err;
}

/* --------------------------------------------------------------------------------- fused decode attention
 *
 * One layer's attention for a decode step in one call, what kvslim.attention.compressed_attention computes
 * with a dozen torch ops and two kernel calls:
 *   scores = [q . k_sink | (H_k q) . body keys | q . k_res]   (q already scaled; T = S + NK + RK tokens)
 *   p      = softmax(scores)
 *   out    = p_sink @ v_sink + H_v (p_body @ body values) + p_res @ v_res   (T = S + NV + RV)
 * K and V bodies may hold different token counts (per-channel K encodes whole groups, per-token V may
 * not); the token axis is shared. H_k, H_v: the body's Hadamard basis (block 0: none), normalized. The body
 * tasks are kv_run's (run_range: same code, same chunks), so the codes are read exactly as kv_run reads them.
 * The phases run in one OpenMP region: K chunks and the fp scores, softmax rows, V chunks, then per
 * (b, h) the V chunks reduced, rotated back and the fp values added.
 *
 * Each phase's work for one (b, h) is a function of its own below, not inlined (KV_NOINLINE), and so is
 * run_range: kv_attend and kv_attend_rows run the same instructions on a row, which is what makes their results
 * bit-identical (the compiler may vectorize or contract a loop differently where it is inlined). */

typedef struct {
    int kind, code, group, offset, n; /* kind 0: rows (code = format), 1: affine (code = bits) */
    const kv_part *x, *s, *z;
} kv_body;

/* Normalized Walsh-Hadamard transform of each hb-block of x (D floats); hb 0: nothing. */
static void hadamard_blocks(float *restrict x, int D, int hb) {
    if (!hb) return;
    const float norm = 1.0f / sqrtf((float)hb);
    for (int blk = 0; blk < D; blk += hb) fwht(x + blk, hb);
    KV_SIMD
    for (int d = 0; d < D; d++) x[d] *= norm;
}

static int body_ok(const kv_body *kb, int is_v, int D) {
    if (kb->n < 0) return 0;
    if (kb->kind == 0) return kb->code >= R_Q8_0 && kb->code <= R_FP8 && (D % QK == 0 || kb->code > R_Q5_1);
    if (kb->kind != 1 || !affine_bits_ok(kb->code) || D % codes_per_unit(kb->code)) return 0;
    if (is_v) return kb->group >= 1 && D % kb->group == 0 && kb->group % codes_per_unit(kb->code) == 0;
    return kb->group >= 1 && kb->offset >= 0 && kb->offset < kb->group;
}

static int hblock_ok(int hb, int D) { return hb == 0 || (hb > 0 && !(hb & (hb - 1)) && D % hb == 0); }

/* The body's queries of (b, h): dst (M, D) contiguous = H_k q. */
static KV_NOINLINE void rotate_queries(const kv_part *q, int b, int h, int M, int D, int hb, float *restrict dst) {
    for (int m = 0; m < M; m++) {
        float *r = dst + (int64_t)m * D;
        memcpy(r, (const float *)at(q, b, h, 0) + (int64_t)m * q->s2, (size_t)D * 4);
        hadamard_blocks(r, D, hb);
    }
}

/* The body's queries of (b, h) in a fitted basis: dst (M, D) contiguous = R q, rot R of head h (D, D) rows
 * contiguous (y = R x): channel e is row e of R dotted with the query. */
static KV_NOINLINE void fit_queries(const kv_part *q, int b, int h, int M, int D, const float *restrict rot,
                                    float *restrict dst) {
    for (int m = 0; m < M; m++) {
        const float *qm = (const float *)at(q, b, h, 0) + (int64_t)m * q->s2;
        float *restrict r = dst + (int64_t)m * D;
        for (int e = 0; e < D; e++) r[e] = dot(rot + (int64_t)e * D, qm, D);
    }
}

/* o (D) = R^T o in place, rot R (D, D) rows contiguous: row e of R scaled by o_e, summed in e order (as
 * transform_rows takes a key back). tmp: D floats. */
static void unfit_row(float *restrict o, const float *restrict rot, int D, float *restrict tmp) {
    memcpy(tmp, o, (size_t)D * sizeof(float));
    for (int d = 0; d < D; d++) o[d] = 0.0f;
    for (int e = 0; e < D; e++) axpy(o, tmp[e], rot + (int64_t)e * D, D);
}

#if defined(__AVX512F__)
/* Channels 8e .. 8e + 7 of the fp rows a (lanes 0-7) and b (lanes 8-15) of dtype dt, as load_floats reads them. */
KV_INLINE __m512 fp8x2(const uint8_t *a, const uint8_t *b, int e, int dt) {
    if (dt == DT_F32) return join8x2(_mm256_loadu_ps((const float *)a + 8 * e), _mm256_loadu_ps((const float *)b + 8 * e));
    const __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + 16 * e))),
                                              _mm_loadu_si128((const __m128i *)(b + 16 * e)), 1);
    if (dt == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
    return _mm512_cvtph_ps(x);
}

/* Channels 16e .. 16e + 15 of the fp row a of dtype dt, as load_floats reads them. */
KV_INLINE __m512 fp16x1(const uint8_t *a, int e, int dt) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float *)a + 16 * e);
    const __m256i x = _mm256_loadu_si256((const __m256i *)(a + 32 * e));
    if (dt == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
    return _mm512_cvtph_ps(x);
}

/* The scores of n fp key rows (tokens 0 .. n of part x at (b, h)) for NM queries (rows qs apart), into columns
 * col .. col + n of the score rows sb (T apart): k_direct16's scheme (two tokens a register, 8 at a time, hsum4). */
KV_INLINE void fp_direct16(int NM, const float *restrict qm, int64_t qs, int D, const kv_part *x, int b, int h, int n,
                           float *restrict sb, int64_t T, int col) {
    for (int j = 0; j < n; j += 8) {
        const uint8_t *cp[8];
        for (int t = 0; t < 8; t++) cp[t] = at(x, b, h, j + t < n ? j + t : n - 1);
        __m512 a[3][4];
        for (int m = 0; m < NM; m++)
            for (int y = 0; y < 4; y++) a[m][y] = _mm512_setzero_ps();
        for (int e = 0; e < D / 8; e++) {
            __m512 qv[3];
            for (int m = 0; m < NM; m++) qv[m] = bcast8x2(_mm256_loadu_ps(qm + m * qs + 8 * e));
            for (int y = 0; y < 4; y++) {
                const __m512 f = fp8x2(cp[2 * y], cp[2 * y + 1], e, x->dtype);
                for (int m = 0; m < NM; m++) a[m][y] = _mm512_fmadd_ps(qv[m], f, a[m][y]);
            }
        }
        for (int m = 0; m < NM; m++)
            for (int y = 0; y < 4; y += 2) {
                const __m128 sv = hsum2x2(a[m][y], a[m][y + 1], 0.0f);
                store4(sb + m * T + col + j + 2 * y, sv, n - j - 2 * y);
            }
    }
}

/* fp_direct16 for M queries, 3 at a time. */
static void fp_direct(const float *restrict qbh, int64_t qs, int M, int D, const kv_part *x, int b, int h, int n,
                      float *restrict sb, int64_t T, int col) {
    for (int m = 0; m < M && n > 0; m += 3) {
        const float *qm = qbh + (int64_t)m * qs;
        float *sm = sb + (int64_t)m * T;
        switch (M - m) {
        case 1: fp_direct16(1, qm, qs, D, x, b, h, n, sm, T, col); break;
        case 2: fp_direct16(2, qm, qs, D, x, b, h, n, sm, T, col); break;
        default: fp_direct16(3, qm, qs, D, x, b, h, n, sm, T, col); break;
        }
    }
}
#endif

/* Scores of (b, h)'s sink and residual keys: columns 0 .. S and S + NK .. T of its M score rows sb (M, T). */
static KV_NOINLINE void fp_scores(const kv_part *q, const kv_part *ksk, const kv_part *kres, int b, int h, int M,
                                  int D, int S, int NK, int RK, int T, float *restrict sb, float *restrict row) {
    const float *qbh = (const float *)at(q, b, h, 0);
#if defined(__AVX512F__)
    if (D % 8 == 0) { /* in registers (fp_direct16); otherwise a row converted at a time, M dots */
        (void)row;
        fp_direct(qbh, q->s2, M, D, ksk, b, h, S, sb, T, 0);
        fp_direct(qbh, q->s2, M, D, kres, b, h, RK, sb, T, S + NK);
        return;
    }
#endif
    for (int j = 0; j < S + RK; j++) {
        const int col = j < S ? j : S + NK + (j - S);
        load_floats(j < S ? at(ksk, b, h, j) : at(kres, b, h, j - S), j < S ? ksk->dtype : kres->dtype, row, D);
        for (int m = 0; m < M; m++) sb[(int64_t)m * T + col] = dot(qbh + (int64_t)m * q->s2, row, D);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* e^r's Taylor coefficients, highest degree first (Horner), for exp_pd and exp_pd8. */
static const double EXP_TAYLOR[12] = {1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0,
                                      1.0 / 720.0,      1.0 / 120.0,     1.0 / 24.0,     1.0 / 6.0,     0.5, 1.0, 1.0};

/* e^x in double for 4 floats x (widened): x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), e^r by its Taylor
 * polynomial to degree 11 (truncation below 1e-14 relative), times 2^n built in the exponent bits; x below -104
 * (where expf is 0) is taken as -104. Rounded to float by the caller, this is expf's value but for inputs whose
 * e^x lies within a hair of a rounding tie (0.06% of 2e7 random inputs in [-110, 0], each 1 ulp off glibc's expf:
 * glibc's own error bound is 0.502 ulp). Only what such a ulp can move moves: the fused path's results stay what
 * they were with libm's expf to within a ulp of a probability. */
KV_INLINE __m256d exp_pd(__m256d x) {
    x = _mm256_max_pd(_mm256_set1_pd(-104.0), x); /* max(-104, NaN) is NaN */
    const __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(0x1.62e42fefa39efp-1), x);
    r = _mm256_fnmadd_pd(n, _mm256_set1_pd(0x1.abc9e3b39803fp-56), r);
    __m256d y = _mm256_set1_pd(EXP_TAYLOR[0]);
    for (int i = 1; i < 12; i++) y = _mm256_fmadd_pd(y, r, _mm256_set1_pd(EXP_TAYLOR[i]));
    const __m256i e = _mm256_slli_epi64(
        _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n)), _mm256_set1_epi64x(1023)), 52);
    return _mm256_mul_pd(y, _mm256_castsi256_pd(e));
}
#endif

#if defined(__AVX512F__)
/* exp_pd for 8 doubles: the same operations, lane for lane. */
KV_INLINE __m512d exp_pd8(__m512d x) {
    x = _mm512_max_pd(_mm512_set1_pd(-104.0), x); /* max(-104, NaN) is NaN */
    const __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(1.4426950408889634)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(0x1.62e42fefa39efp-1), x);
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(0x1.abc9e3b39803fp-56), r);
    __m512d y = _mm512_set1_pd(EXP_TAYLOR[0]);
    for (int i = 1; i < 12; i++) y = _mm512_fmadd_pd(y, r, _mm512_set1_pd(EXP_TAYLOR[i]));
    const __m512i e = _mm512_slli_epi64(
        _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(n)), _mm512_set1_epi64(1023)), 52);
    return _mm512_mul_pd(y, _mm512_castsi512_pd(e));
}
#endif

/* x[t] = e^(x[t] - mx) for t < T: exp_pd's 16 at a time with AVX-512 (lane for lane the AVX2 loop's), 8 at a time
 * with AVX2, libm's expf for the tail and elsewhere. */
static void exp_from(float *restrict x, int T, float mx) {
    int t = 0;
#if defined(__AVX512F__)
    for (; t + 16 <= T; t += 16) { /* x - mx rounded to float first, as expf(x[t] - mx) takes it */
        const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + t), _mm512_set1_ps(mx));
        _mm256_storeu_ps(x + t, _mm512_cvtpd_ps(exp_pd8(_mm512_cvtps_pd(_mm512_castps512_ps256(d)))));
        _mm256_storeu_ps(x + t + 8, _mm512_cvtpd_ps(exp_pd8(_mm512_cvtps_pd(hi8(d)))));
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    for (; t + 8 <= T; t += 8) {
        const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + t), _mm256_set1_ps(mx));
        _mm_storeu_ps(x + t, _mm256_cvtpd_ps(exp_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(d)))));
        _mm_storeu_ps(x + t + 4, _mm256_cvtpd_ps(exp_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(d, 1)))));
    }
#endif
    for (; t < T; t++) x[t] = expf(x[t] - mx);
}

/* x[t] = e^(x[t] - max) in place; the maximum 8 lanes at a time with AVX2 (the same value: max is exact), the
 * exponentials exp_pd's (16 at a time with AVX-512: the same lanes' arithmetic), libm's expf for the tail. */
static KV_NOINLINE void exp_row(float *restrict x, int T) {
    float mx = x[0];
    int t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (T >= 8) {
        __m256 vm = _mm256_set1_ps(mx);
        for (; t + 8 <= T; t += 8) vm = _mm256_max_ps(_mm256_loadu_ps(x + t), vm); /* x > m ? x : m, as below */
        float lanes[8];
        _mm256_storeu_ps(lanes, vm);
        for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
    }
#endif
    for (; t < T; t++) mx = x[t] > mx ? x[t] : mx;
    exp_from(x, T, mx);
}

/* R rows of T scores (T apart) -> probabilities, in place: each row's e^(x - max) (exp_row) summed in token order,
 * then scaled. The sum stays one running sum per row: summed in lanes, the probabilities move by a few ulps, and
 * tests/test_attention.py's fused-against-op-by-op check at int4 with residual 0 (every token quantized as it
 * arrives, so an ulp can flip a code downstream) then fails its 2e-4 tolerance. Up to 4 rows' sums run
 * interleaved, so their chains of dependent adds overlap; each row's sum is the same as alone. */
static KV_NOINLINE void softmax_rows(float *restrict x, int R, int T) {
    for (int r0 = 0; r0 < R; r0 += 4) {
        const int nr = R - r0 < 4 ? R - r0 : 4;
        float *y = x + (int64_t)r0 * T;
        for (int r = 0; r < nr; r++) exp_row(y + (int64_t)r * T, T);
        /* four chains always: a missing row's chain re-reads the first row and is not used */
        const float *y0 = y, *y1 = y + (nr > 1) * (int64_t)T, *y2 = y + (nr > 2) * 2 * (int64_t)T;
        const float *y3 = y + (nr > 3) * 3 * (int64_t)T;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        for (int t = 0; t < T; t++) s0 += y0[t], s1 += y1[t], s2 += y2[t], s3 += y3[t];
        const float sum[4] = {s0, s1, s2, s3};
        for (int r = 0; r < nr; r++) {
            float *restrict z = y + (int64_t)r * T;
            const float inv = 1.0f / sum[r];
            KV_SIMD
            for (int i = 0; i < T; i++) z[i] *= inv;
        }
    }
}

/* (b, h)'s output rows: its ncv V chunks' partial sums (part: (ncv, M, D), plane order of vper) summed in chunk
 * order, un-permuted, rotated back (vhb, or vrot: a fitted rotation R of head h, taken back with R^T; NULL: none),
 * then the sink and residual values weighted by pbh (M, T) added. */
static KV_NOINLINE void finish_head(const float *restrict part, int ncv, const kv_part *out, const kv_part *vsk,
                                    const kv_part *vres, int b, int h, int M, int D, int vper, int vhb,
                                    const float *restrict vrot, int S, int NV, int RV, int T,
                                    const float *restrict pbh, float *restrict scratch) {
    const int np = D / vper;
    float *row = scratch, *acc = scratch + D;
    for (int m = 0; m < M; m++) {
        float *o = (float *)at(out, b, h, 0) + (int64_t)m * out->s2;
        memset(acc, 0, (size_t)D * 4);
        for (int c = 0; c < ncv; c++) {
            const float *pc = part + (int64_t)c * M * D + (int64_t)m * D;
            KV_SIMD
            for (int k = 0; k < D; k++) acc[k] += pc[k];
        }
        for (int i = 0; i < vper; i++)
            for (int j = 0; j < np; j++) o[vper * j + i] = acc[i * np + j];
        hadamard_blocks(o, D, vhb);
        if (vrot && ncv) unfit_row(o, vrot, D, acc);
        const float *pm = pbh + (int64_t)m * T;
#if defined(__AVX512F__)
        if (D % 16 == 0 && D <= 256) { /* axpy's FMAs, token by token, with o's 16-lane rows held in registers */
            __m512 acc16[16];
            const int nv = D / 16;
            for (int x = 0; x < nv; x++) acc16[x] = _mm512_loadu_ps(o + 16 * x);
            for (int j = 0; j < S + RV; j++) {
                const int col = j < S ? j : S + NV + (j - S);
                const kv_part *src = j < S ? vsk : vres;
                const uint8_t *r = at(src, b, h, j < S ? j : j - S);
                const __m512 pv = _mm512_set1_ps(pm[col]);
                for (int x = 0; x < nv; x++) acc16[x] = _mm512_fmadd_ps(pv, fp16x1(r, x, src->dtype), acc16[x]);
            }
            for (int x = 0; x < nv; x++) _mm512_storeu_ps(o + 16 * x, acc16[x]);
            continue;
        }
#endif
        for (int j = 0; j < S + RV; j++) {
            const int col = j < S ? j : S + NV + (j - S);
            load_floats(j < S ? at(vsk, b, h, j) : at(vres, b, h, j - S), j < S ? vsk->dtype : vres->dtype, row, D);
            axpy(o, pm[col], row, D);
        }
    }
}

/* Body chunks of a call for T body tokens of bh heads on nt threads: kv_attend's split (and kv_run's). */
static int body_chunks(int bh, int T, int nt) { return T ? n_chunks(bh, T, nt, 128) : 0; }

/* Per-thread scratch of the fused calls, in floats: a tile, the folded and plane-order queries, scales and zeros. */
static size_t attend_scratch(int M, int D) { return (size_t)(TILE + 2 * M + 8) * D + 2 * (size_t)M + 64; }

/* args: B, H, M, D, nthreads, S, RK, RV, K body (kind, code, group, offset, n), V body (kind, code, group, n),
 * K hadamard block, V hadamard block; then 12 parts of 5 int64 (data, s0, s1, s2, dtype): q (B, H, M, D) fp32,
 * k_sink, v_sink (B, H, S, D), k_res (B, H, RK, D), v_res (B, H, RV, D) fp32/fp16/bf16, K body x, s, z,
 * V body x, s, z (as kv_run's parts; unused ones may repeat q), out (B, H, M, D) fp32; then 2 parts more, the K
 * and V bodies' variance-normalization factors (kv_call.vn; data 0: none), and 2 int64: the V factors' token
 * group and offset. */
int kv_attend(const int64_t *a) {
    const int B = (int)a[0], H = (int)a[1], M = (int)a[2], D = (int)a[3], S = (int)a[5], RK = (int)a[6], RV = (int)a[7];
    kv_part pt[14];
    for (int i = 0; i < 14; i++) {
        const int64_t *e = a + 19 + 5 * i;
        pt[i] = (kv_part){(const void *)(intptr_t)e[0], e[1], e[2], e[3], (int32_t)e[4], 0};
    }
    const kv_part *q = &pt[0], *ksk = &pt[1], *vsk = &pt[2], *kres = &pt[3], *vres = &pt[4], *out = &pt[11];
    const kv_body kb = {(int)a[8], (int)a[9], (int)a[10], (int)a[11], (int)a[12], &pt[5], &pt[6], &pt[7]};
    const kv_body vb = {(int)a[13], (int)a[14], (int)a[15], 0, (int)a[16], &pt[8], &pt[9], &pt[10]};
    const int khb = (int)a[17], vhb = (int)a[18];
    const kv_part *kvn = pt[12].data ? &pt[12] : NULL, *vvn = pt[13].data ? &pt[13] : NULL;
    const int vgroup = (int)a[19 + 5 * 14], voffset = (int)a[20 + 5 * 14];
    if ((kvn && kb.kind != 1) || (vvn && (vb.kind != 1 || vgroup < 1 || voffset < 0 || voffset >= vgroup)))
        return KV_EARG;
    if (B < 1 || H < 1 || M < 1 || D < 1 || S < 0 || RK < 0 || RV < 0) return KV_EARG;
    if (!body_ok(&kb, 0, D) || !body_ok(&vb, 1, D) || S + kb.n + RK != S + vb.n + RV || S + kb.n + RK < 1) return KV_EARG;
    if (!hblock_ok(khb, D) || !hblock_ok(vhb, D)) return KV_EARG;
    const int T = S + kb.n + RK, NK = kb.n, NV = vb.n, BH = B * H;
    const int vper = vb.kind == 1 ? codes_per_unit(vb.code) : 1;
    const kv_dims dm = {B, H, M, NK > NV ? NK : NV, D, (int32_t)a[4]};
    const int nt = threads_of(&dm);
    const int nck = body_chunks(BH, NK, nt), ncv = body_chunks(BH, NV, nt);
    const size_t scratch_floats = attend_scratch(M, D);

    float *scores = (float *)malloc((size_t)BH * M * T * sizeof(float));
    float *qrot = khb && NK ? (float *)malloc((size_t)BH * M * D * sizeof(float)) : NULL;
    float *part = ncv ? (float *)calloc((size_t)BH * ncv * M * D, sizeof(float)) : NULL;
    if (!scores || (khb && NK && !qrot) || (ncv && !part)) {
        free(scores), free(qrot), free(part);
        return KV_ENOMEM;
    }
    /* the body's queries: H_k q (contiguous), or q itself */
    kv_part qb = *q;
    if (qrot) {
        for (int bh = 0; bh < BH; bh++) rotate_queries(q, bh / H, bh % H, M, D, khb, qrot + (int64_t)bh * M * D);
        qb = (kv_part){qrot, (int64_t)H * M * D, (int64_t)M * D, D, DT_F32, 0};
    }
    /* body scores and probabilities: columns S .. S + NK of each (b, h, m) row of T */
    const kv_part sc = {scores + S, (int64_t)H * M * T, (int64_t)M * T, T, DT_F32, 0};
    /* each body's chunks as kv_run's calls: run_task splits, dispatches per format and sums V into part */
    const kv_dims dk = {B, H, M, NK, D, dm.nthreads}, dv = {B, H, M, NV, D, dm.nthreads};
    const kv_call kc = {.op = kb.kind ? OP_K_AFFINE : OP_K_ROWS, .fmt = kb.code, .bits = kb.code, .group = kb.group,
                        .offset = kb.offset, .nc = nck, .x = &qb, .p1 = kb.x, .p2 = kb.s, .p3 = kb.z, .out = &sc,
                        .dm = &dk, .part = NULL, .tr = NULL, .vn = kvn};
    const kv_call vc = {.op = vb.kind ? OP_V_AFFINE : OP_V_ROWS, .fmt = vb.code, .bits = vb.code, .group = vb.group,
                        .offset = 0, .nc = ncv, .x = &sc, .p1 = vb.x, .p2 = vb.s, .p3 = vb.z, .out = NULL,
                        .dm = &dv, .part = part, .tr = NULL, .vn = vvn, .vgroup = vgroup, .voffset = voffset};
    int err = KV_OK;
#pragma omp parallel num_threads(nt)
    {
        float *scratch = (float *)calloc(scratch_floats, sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            err = KV_ENOMEM;
        }
        /* 1. K: the body's chunks, then each (b, h)'s sink and residual scores */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < (int64_t)BH * nck + BH; task++) {
            if (!scratch) continue;
            if (task < (int64_t)BH * nck) {
                run_task(&kc, task, scratch);
                continue;
            }
            const int bh = (int)(task - (int64_t)BH * nck);
            fp_scores(q, ksk, kres, bh / H, bh % H, M, D, S, NK, RK, T, scores + (int64_t)bh * M * T, scratch);
        }
        /* 2. softmax of every row */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < (int64_t)BH; r++) softmax_rows(scores + r * M * T, M, T);
        /* 3. V: the body's chunks, each into its own partial sum */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < (int64_t)BH * ncv; task++)
            if (scratch) run_task(&vc, task, scratch);
        /* 4. per (b, h): the partials summed, un-permuted, rotated back; the fp values added */
#pragma omp for schedule(static)
        for (int bh = 0; bh < BH; bh++) {
            if (!scratch) continue;
            finish_head(part + (int64_t)bh * ncv * M * D, ncv, out, vsk, vres, bh / H, bh % H, M, D, vper, vhb, NULL, S,
                        NV, RV, T, scores + (int64_t)bh * M * T, scratch);
        }
        free(scratch);
    }
    free(scores), free(qrot), free(part);
    return err;
}

/* --------------------------------------------------------------------------------- many rows in one call
 *
 * kv_attend_rows: the decode attention of R rows in one call and one OpenMP region. A row is a batch-1
 * kv_attend of its own: its own length, formats, sinks, residual and bases (kvslim's batch engine keeps a
 * SlimCache per row), and its encoded K and V bodies are each a list of pieces, concatenated in order (one
 * piece: a cache's body view; many: the blocks of a paged pool, anywhere in memory, as vLLM keeps them).
 *
 * Row r's arithmetic is kv_attend's for that row alone, in the same order, so the output is bit-identical to R
 * kv_attend calls with the same nthreads: the same body chunks (the count kv_attend picks for the row alone,
 * whatever else is in the call: a V chunk is summed on its own and the chunks are added in order), the same
 * instructions (the per-head phases above and run_range are not inlined), a piece boundary inside a chunk
 * changing nothing (K scores are per token; V sums run token by token into the chunk's accumulator). Only the
 * schedule differs: one task list per phase over rows x heads x chunks, the costliest first, on threads_of the
 * whole call's work.
 *
 * The row table, one int64 array (kvslim.kernels.cpu builds it; kv_rows_layout() reports its widths):
 *   header (RT_HEAD): R, NQ, H, M, D, nthreads, npieces, 0, q part, out part
 *       q (NQ, H, M, D) fp32 already scaled; out (NQ, H, M, D) fp32, of which row r writes out[qrow] only
 *   R row records (RT_ROW): qrow, S, RK, RV, K hadamard block, V hadamard block, K first piece, K piece count,
 *       V first piece, V piece count, then the parts k_sink, v_sink (1, H, S, D), k_res (1, H, RK, D),
 *       v_res (1, H, RV, D) fp32/fp16/bf16 (unused ones may repeat q), then the parts k_rot, v_rot: a fitted
 *       rotation of the K / V body (1, H, D, D) fp32, rows contiguous, y = R x (data 0: none; a row's K or V has
 *       a Hadamard block or a fitted rotation, never both): the row's body queries are R_k q (fit_queries), the
 *       V body's sum is taken back with R_v^T before the sink and residual values are added (finish_head), then
 *       the part k_bias: a mean-centering bias (1, H, 1, D) fp32 of the K body, in the body's basis (data 0: none):
 *       each K body token stored centered (a piece's flags, below) scores qb . bias more, qb the query it was
 *       scored with (the key as stored plus its zero point: qb . (y + bias)), then status (RT_STATUS: the caller
 *       writes KV_EARG; this call writes KV_OK for each row it computes), 0
 *   npieces piece records (RT_PIECE): kind, code, group, offset, n, vgroup, then the parts x, s, z, f: kv_attend's
 *       body arguments for n tokens (K: offset = the piece's first token's place in its token group; V: offset =
 *       that place in its group of vgroup tokens, read only with factors, else 0) and a variance-normalized affine
 *       piece's factors f (kv_attend's K / V factor parts; data 0: none, vgroup unused then), then the part qk:
 *       a K piece's own queries (1, H, M, D) fp32, already scaled and in the piece's basis (data 0: the row's,
 *       Hadamard-rotated by the row's K block as kv_attend rotates them), then the part fl: a K piece's
 *       per-token centering flags (1, H, n, 1) uint8, read with the row's k_bias or the piece's transform (data
 *       0: every token centered), then a K piece's key transform (kv_tr: what kv_run's transformed K ops take,
 *       for keys stored before RoPE): hblock, rhalf, roff, has_bias, has_flags and the parts bias (1, H, 1, D),
 *       cos, sin (1, 1, n, rhalf), mat (1, H, D, D) fp32 (all 0: none; flags: fl). A transformed piece's keys
 *       are decoded, transformed (kv_tr) and scored with the row's own queries (q, never qb: the transform
 *       takes the key to the model's basis). A row whose keys sit in several RoPE
 *       frames (kvslim's runs after a re-base of the position ids) scores each run's piece with the query moved
 *       into that run's frame: R(-d)q . k = q . R(d)k, the codes read as stored. A row's V pieces share kind
 *       and code (their sum is un-permuted once). Rows may share pieces.
 *   part = data, s0, s1, s2, dtype; a row's parts are batch 1 (dim 0 is never indexed).
 *
 * Returns KV_OK (every row done); KV_EARG: the rows whose status says so were refused and their output left
 * untouched, the others done (a bad header refuses every row); KV_ENOMEM: no output is reliable. */

enum { RT_HEAD = 18, RT_ROW = 47, RT_PIECE = 61, RT_STATUS = 45 };

typedef struct {
    kv_body b;
    kv_part x, s, z, f; /* f: variance-normalization factors (data NULL: none) */
    kv_part qk;         /* a K piece's own queries (data NULL: the row's body queries) */
    kv_part fl;         /* a K piece's centering flags (1, H, n, 1) uint8 (data NULL: all centered) */
    kv_part tb, tc, ts, tm; /* a K piece's transform parts: bias, cos, sin, matrix (data NULL: none) */
    kv_tr tr;           /* a K piece's key transform (pointing at the parts above) */
    int has_tr;         /* the piece is scored through tr */
    int vgroup;         /* V with factors: tokens per factor row (b.offset: the first token's place in it) */
} rt_piece;

typedef struct {
    kv_part q, qb, out, ksk, vsk, kres, vres; /* q, out: this row's (1, H, M, D); qb: the body's queries */
    kv_part krot, vrot;                       /* fitted rotations (1, H, D, D) fp32 (data NULL: none) */
    kv_part kbias;                            /* the K body's centering bias (1, H, 1, D) fp32 (data NULL: none) */
    int S, RK, RV, NK, NV, T, khb, vhb, vper, nck, ncv, nkp, nvp;
    const rt_piece *kp, *vp;
    float *scores, *qrot, *part; /* (H, M, T); (H, M, D) or NULL; (H, ncv, M, D) or NULL */
} rt_row;

typedef struct {
    int32_t row, h, c, cost; /* c: a body chunk, or -1: the row's sink and residual keys */
} rt_task;

static kv_part part_of(const int64_t *e) {
    return (kv_part){(const void *)(intptr_t)e[0], e[1], e[2], e[3], (int32_t)e[4], 0};
}

static int fp_ok(const kv_part *p, int n) {
    return n == 0 || (p->data && (p->dtype == DT_F32 || p->dtype == DT_F16 || p->dtype == DT_BF16));
}

/* Row record e of the table -> w (its arena pointers not yet set); KV_OK or KV_EARG. used: NQ flags (qrow
 * taken). Token counts stay below 2^30, so every int product below fits where it is computed in int64. */
static int rt_setup(const int64_t *e, const rt_piece *pieces, int64_t np, int64_t nq, int H, int M, int D,
                    int nthreads, const kv_part *q, const kv_part *out, unsigned char *used, rt_row *w) {
    const int64_t lim = (int64_t)1 << 30;
    const int64_t qrow = e[0], S = e[1], RK = e[2], RV = e[3], kf = e[6], kn = e[7], vf = e[8], vn = e[9];
    if (qrow < 0 || qrow >= nq || used[qrow]) return KV_EARG;
    if (S < 0 || S >= lim || RK < 0 || RK >= lim || RV < 0 || RV >= lim) return KV_EARG;
    if (e[4] < 0 || e[4] > D || e[5] < 0 || e[5] > D || !hblock_ok((int)e[4], D) || !hblock_ok((int)e[5], D))
        return KV_EARG;
    if (kf < 0 || kn < 0 || kf > np - kn || vf < 0 || vn < 0 || vf > np - vn) return KV_EARG;
    int64_t nk = 0, nv = 0;
    for (int64_t i = kf; i < kf + kn; i++) {
        if (!body_ok(&pieces[i].b, 0, D) || (pieces[i].f.data && pieces[i].b.kind != 1)) return KV_EARG;
        if (pieces[i].qk.data && pieces[i].qk.dtype != DT_F32) return KV_EARG;
        if (pieces[i].fl.data && pieces[i].fl.dtype != DT_U8) return KV_EARG;
        if (pieces[i].has_tr) {
            const rt_piece *pc = &pieces[i];
            const kv_tr *tr = &pc->tr;
            if (!hblock_ok(tr->hblock, D) || (tr->mat && tr->hblock) || tr->rhalf < 0 || tr->roff < 0 ||
                tr->roff + 2 * tr->rhalf > D || (tr->mat && pc->tm.dtype != DT_F32) ||
                (tr->has_bias && (!pc->tb.data || pc->tb.dtype != DT_F32)) || (tr->has_flags && !pc->fl.data) ||
                (tr->rhalf && (!pc->tc.data || !pc->ts.data || pc->tc.dtype != DT_F32 || pc->ts.dtype != DT_F32)))
                return KV_EARG;
        }
        if ((nk += pieces[i].b.n) >= lim) return KV_EARG;
    }
    for (int64_t i = vf; i < vf + vn; i++) {
        if (!body_ok(&pieces[i].b, 1, D) || pieces[i].b.kind != pieces[vf].b.kind || pieces[i].b.code != pieces[vf].b.code)
            return KV_EARG;
        if (pieces[i].has_tr) return KV_EARG; /* a key transform is K's */
        const rt_piece *v = &pieces[i];
        if (v->f.data ? v->b.kind != 1 || v->vgroup < 1 || v->b.offset < 0 || v->b.offset >= v->vgroup : v->b.offset != 0)
            return KV_EARG;
        if ((nv += pieces[i].b.n) >= lim) return KV_EARG;
    }
    if (S + nk + RK != S + nv + RV || S + nk + RK < 1 || S + nk + RK >= lim) return KV_EARG;
    *w = (rt_row){.ksk = part_of(e + 10), .vsk = part_of(e + 15), .kres = part_of(e + 20), .vres = part_of(e + 25),
                  .krot = part_of(e + 30), .vrot = part_of(e + 35), .kbias = part_of(e + 40)};
    if (!fp_ok(&w->ksk, (int)S) || !fp_ok(&w->vsk, (int)S) || !fp_ok(&w->kres, (int)RK) || !fp_ok(&w->vres, (int)RV))
        return KV_EARG;
    if ((w->krot.data && (w->krot.dtype != DT_F32 || e[4])) || (w->vrot.data && (w->vrot.dtype != DT_F32 || e[5])))
        return KV_EARG; /* one basis per stream: a Hadamard block or a fitted matrix */
    if (w->kbias.data && w->kbias.dtype != DT_F32) return KV_EARG;
    for (int64_t i = kf; i < kf + kn; i++) /* a transformed piece's basis and bias are its transform's */
        if (pieces[i].has_tr && (e[4] || w->krot.data || w->kbias.data)) return KV_EARG;
    w->q = *q, w->out = *out;
    w->q.data = (const float *)q->data + qrow * q->s0;
    w->out.data = (const float *)out->data + qrow * out->s0;
    w->qb = w->q;
    w->S = (int)S, w->RK = (int)RK, w->RV = (int)RV, w->NK = (int)nk, w->NV = (int)nv, w->T = (int)(S + nk + RK);
    w->khb = (int)e[4], w->vhb = (int)e[5];
    w->kp = pieces + kf, w->vp = pieces + vf, w->nkp = (int)kn, w->nvp = (int)vn;
    w->vper = vn && pieces[vf].b.kind == 1 ? codes_per_unit(pieces[vf].b.code) : 1;
    /* the chunks kv_attend takes for this row alone (B = 1) */
    const kv_dims alone = {1, H, M, w->NK > w->NV ? w->NK : w->NV, D, nthreads};
    const int nt = threads_of(&alone);
    w->nck = body_chunks(H, w->NK, nt), w->ncv = body_chunks(H, w->NV, nt);
    used[qrow] = 1;
    return KV_OK;
}

/* Body chunk c of row w's K (is_v 0) or V stream for head h: each piece's part of the chunk, in token order. */
static void rt_body(const rt_row *w, int is_v, int h, int c, int H, int M, int D, float *scratch) {
    const int n = is_v ? w->NV : w->NK, nc = is_v ? w->ncv : w->nck, npc = is_v ? w->nvp : w->nkp;
    const int t0 = (int)((int64_t)c * n / nc), t1 = (int)((int64_t)(c + 1) * n / nc);
    const rt_piece *pc = is_v ? w->vp : w->kp;
    float *acc = is_v ? w->part + ((int64_t)h * nc + c) * M * D : NULL;
    const kv_dims dm = {1, H, M, n, D, 1};
    int start = 0; /* the piece's first token in the row's body */
    for (int i = 0; i < npc && start < t1; start += pc[i].b.n, i++) {
        const int lo = t0 > start ? t0 : start, hi = t1 < start + pc[i].b.n ? t1 : start + pc[i].b.n;
        if (lo >= hi) continue;
        /* the piece's columns of the row's scores (K out, V in) */
        const kv_part sc = {w->scores + w->S + start, (int64_t)H * M * w->T, (int64_t)M * w->T, w->T, DT_F32, 0};
        const kv_body *b = &pc[i].b;
        const int tr = !is_v && pc[i].has_tr; /* keys taken to the model's basis: the row's own queries */
        const int kop = tr ? (b->kind ? OP_K_AFFINE_T : OP_K_ROWS_T) : (b->kind ? OP_K_AFFINE : OP_K_ROWS);
        const kv_call k = {.op = is_v ? (b->kind ? OP_V_AFFINE : OP_V_ROWS) : kop,
                           .fmt = b->code, .bits = b->code, .group = b->group, .offset = is_v ? 0 : b->offset, .nc = nc,
                           .x = is_v ? &sc : pc[i].qk.data ? &pc[i].qk : tr ? &w->q : &w->qb, .p1 = &pc[i].x,
                           .p2 = &pc[i].s, .p3 = &pc[i].z, .out = is_v ? NULL : &sc, .dm = &dm, .part = NULL,
                           .tr = tr ? &pc[i].tr : NULL,
                           .vn = pc[i].f.data ? &pc[i].f : NULL, .vgroup = pc[i].vgroup, .voffset = b->offset};
        run_range(&k, 0, h, lo - start, hi - start, scratch, acc);
        if (!is_v && !tr && w->kbias.data) { /* the centered tokens' zero point: + qb . bias, qb the piece's queries */
            const float *bias = (const float *)at(&w->kbias, 0, h, 0);
            const kv_part *qs = k.x;
            for (int m = 0; m < M; m++) {
                const float qbias = dot((const float *)at(qs, 0, h, 0) + (int64_t)m * qs->s2, bias, D);
                float *restrict srow = (float *)at(&sc, 0, h, m);
                for (int t = lo - start; t < hi - start; t++)
                    if (!pc[i].fl.data || *at(&pc[i].fl, 0, h, t)) srow[t] += qbias;
            }
        }
    }
}

static int rt_costlier(const void *x, const void *y) {
    const rt_task *a = (const rt_task *)x, *b = (const rt_task *)y;
    if (a->cost != b->cost) return a->cost > b->cost ? -1 : 1;
    if (a->row != b->row) return a->row < b->row ? -1 : 1; /* a fixed order: the schedule never depends on qsort */
    if (a->h != b->h) return a->h < b->h ? -1 : 1;
    return (a->c > b->c) - (a->c < b->c);
}

#if defined(KV_PHASE_TIMERS) && defined(_OPENMP)
/* A measuring build only (-DKV_PHASE_TIMERS, scripts/rows_phases.py; never the library's own): the seconds
 * kv_attend_rows spends in each of its phases, summed over calls: [0] the queries' rotation and the threads' start,
 * [1] K scores, [2] softmax, [3] V sums, [4] finishing the heads; [5] the last mark. Each mark is a barrier. */
double kv_phase[6];
#define KV_PHASE_START() (kv_phase[5] = omp_get_wtime())
#define KV_PHASE(i)                                                                                                    \
    _Pragma("omp barrier") _Pragma("omp master") {                                                                     \
        const double now_ = omp_get_wtime();                                                                           \
        kv_phase[i] += now_ - kv_phase[5];                                                                             \
        kv_phase[5] = now_;                                                                                            \
    }                                                                                                                  \
    _Pragma("omp barrier")
#else
#define KV_PHASE_START() ((void)0)
#define KV_PHASE(i)
#endif

int kv_attend_rows(int64_t *a) {
    const int64_t R = a[0], NQ = a[1], NP = a[6];
    const int H = (int)a[2], M = (int)a[3], D = (int)a[4], nthreads = (int)a[5];
    int64_t *rec = a + RT_HEAD;
    if (R < 0 || R > (1 << 24)) return KV_EARG;
    const kv_part q = part_of(a + 8), out = part_of(a + 13);
    int bad = NQ < 1 || NQ > ((int64_t)1 << 30) || NP < 0 || NP > ((int64_t)1 << 30) || H < 1 || M < 1 || D < 1 ||
              a[2] > 65536 || a[3] > 65536 || a[4] > 65536 || q.dtype != DT_F32 || out.dtype != DT_F32;
    for (int64_t r = 0; r < R; r++) rec[r * RT_ROW + RT_STATUS] = KV_EARG; /* until set up */
    if (bad) return KV_EARG;
    if (R == 0) return KV_OK;
    const int64_t *pr = rec + R * RT_ROW;
    rt_piece *pieces = (rt_piece *)malloc((size_t)(NP ? NP : 1) * sizeof(rt_piece));
    rt_row *rows = (rt_row *)malloc((size_t)R * sizeof(rt_row));
    unsigned char *used = (unsigned char *)calloc((size_t)NQ, 1);
    if (!pieces || !rows || !used) {
        free(pieces), free(rows), free(used);
        return KV_ENOMEM;
    }
    for (int64_t i = 0; i < NP; i++) {
        const int64_t *e = pr + i * RT_PIECE;
        int v[6];
        for (int j = 0; j < 6; j++) v[j] = e[j] < INT32_MIN || e[j] > INT32_MAX ? -1 : (int)e[j];
        pieces[i] = (rt_piece){.x = part_of(e + 6), .s = part_of(e + 11), .z = part_of(e + 16), .f = part_of(e + 21),
                               .qk = part_of(e + 26), .fl = part_of(e + 31), .tb = part_of(e + 41),
                               .tc = part_of(e + 46), .ts = part_of(e + 51), .tm = part_of(e + 56), .vgroup = v[5]};
        pieces[i].b = (kv_body){v[0], v[1], v[2], v[3], v[4], &pieces[i].x, &pieces[i].s, &pieces[i].z};
        rt_piece *pc = &pieces[i];
        int t[5];
        for (int j = 0; j < 5; j++) t[j] = e[36 + j] < INT32_MIN || e[36 + j] > INT32_MAX ? -1 : (int)e[36 + j];
        pc->tr = (kv_tr){.hblock = t[0], .rhalf = t[1], .roff = t[2], .has_bias = t[3], .has_flags = t[4],
                         .bias = &pc->tb, .cos = &pc->tc, .sin = &pc->ts, .flags = &pc->fl,
                         .mat = pc->tm.data ? &pc->tm : NULL};
        pc->has_tr = t[0] || t[1] || t[3] || t[4] || pc->tm.data;
    }
    /* set up the rows; sizes of the scores, rotated queries and V partial sums; task counts; the call's work */
    int64_t n = 0, nscores = 0, nqrot = 0, npart = 0, nktask = 0, nvtask = 0, work = 0;
    for (int64_t r = 0; r < R; r++) {
        rt_row *w = &rows[n];
        if (rt_setup(rec + r * RT_ROW, pieces, NP, NQ, H, M, D, nthreads, &q, &out, used, w) != KV_OK) continue;
        rec[r * RT_ROW + RT_STATUS] = KV_OK;
        n++;
        nscores += (int64_t)H * M * w->T;
        nqrot += (w->khb || w->krot.data) && w->NK ? (int64_t)H * M * D : 0;
        npart += (int64_t)H * w->ncv * M * D;
        nktask += (int64_t)H * (w->nck + 1);
        nvtask += (int64_t)H * w->ncv;
        work += (int64_t)H * (w->NK > w->NV ? w->NK : w->NV) * (M + 1);
    }
    float *scores = (float *)malloc((size_t)(nscores ? nscores : 1) * sizeof(float));
    float *qrot = (float *)malloc((size_t)(nqrot ? nqrot : 1) * sizeof(float));
    float *part = (float *)calloc((size_t)(npart ? npart : 1), sizeof(float));
    rt_task *kt = (rt_task *)malloc((size_t)(nktask ? nktask : 1) * sizeof(rt_task));
    rt_task *vt = (rt_task *)malloc((size_t)(nvtask ? nvtask : 1) * sizeof(rt_task));
    int err = !scores || !qrot || !part || !kt || !vt ? KV_ENOMEM : KV_OK;
    if (err == KV_OK && n) {
        int64_t os = 0, oq = 0, op = 0, ik = 0, iv = 0;
        for (int32_t i = 0; i < (int32_t)n; i++) {
            rt_row *w = &rows[i];
            w->scores = scores + os, os += (int64_t)H * M * w->T;
            w->qrot = (w->khb || w->krot.data) && w->NK ? qrot + oq : NULL, oq += w->qrot ? (int64_t)H * M * D : 0;
            if (w->qrot) w->qb = (kv_part){w->qrot, (int64_t)H * M * D, (int64_t)M * D, D, DT_F32, 0};
            w->part = part + op, op += (int64_t)H * w->ncv * M * D;
            for (int h = 0; h < H; h++) {
                for (int c = 0; c < w->nck; c++)
                    kt[ik++] = (rt_task){i, h, c, (int32_t)(((int64_t)(c + 1) * w->NK / w->nck) - ((int64_t)c * w->NK / w->nck))};
                kt[ik++] = (rt_task){i, h, -1, w->S + w->RK};
                for (int c = 0; c < w->ncv; c++)
                    vt[iv++] = (rt_task){i, h, c, (int32_t)(((int64_t)(c + 1) * w->NV / w->ncv) - ((int64_t)c * w->NV / w->ncv))};
            }
        }
        qsort(kt, (size_t)nktask, sizeof(rt_task), rt_costlier);
        qsort(vt, (size_t)nvtask, sizeof(rt_task), rt_costlier);
        /* threads_of the whole call's work */
        const int64_t nt64 = work / KV_GRAIN;
        const int nt = nt64 < 1 || nthreads < 1 ? 1 : nt64 > nthreads ? nthreads : (int)nt64;
        const int64_t nheads = n * H;
        const size_t scratch_floats = attend_scratch(M, D);
        KV_PHASE_START();
#pragma omp parallel num_threads(nt)
        {
            float *scratch = (float *)calloc(scratch_floats, sizeof(float));
            if (!scratch) {
#pragma omp atomic write
                err = KV_ENOMEM;
            }
            /* 0. the body queries of rows in a Hadamard or a fitted basis */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < nheads; i++) {
                const rt_row *w = &rows[i / H];
                const int h = (int)(i % H);
                if (!w->qrot) continue;
                if (w->krot.data)
                    fit_queries(&w->q, 0, h, M, D, (const float *)at(&w->krot, 0, h, 0), w->qrot + (int64_t)h * M * D);
                else
                    rotate_queries(&w->q, 0, h, M, D, w->khb, w->qrot + (int64_t)h * M * D);
            }
            KV_PHASE(0)
            /* 1. K: body chunks and each head's sink and residual scores, costliest first */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < nktask; i++) {
                if (!scratch) continue;
                const rt_task *t = &kt[i];
                const rt_row *w = &rows[t->row];
                if (t->c >= 0)
                    rt_body(w, 0, t->h, t->c, H, M, D, scratch);
                else
                    fp_scores(&w->q, &w->ksk, &w->kres, 0, t->h, M, D, w->S, w->NK, w->RK, w->T,
                              w->scores + (int64_t)t->h * M * w->T, scratch);
            }
            KV_PHASE(1)
            /* 2. softmax of every row of scores */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < nheads; i++) {
                const rt_row *w = &rows[i / H];
                float *sb = w->scores + (i % H) * M * w->T;
                softmax_rows(sb, M, w->T);
            }
            KV_PHASE(2)
            /* 3. V: body chunks, each into its own partial sum */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < nvtask; i++)
                if (scratch) rt_body(&rows[vt[i].row], 1, vt[i].h, vt[i].c, H, M, D, scratch);
            KV_PHASE(3)
            /* 4. per (row, head): the partials summed in chunk order, un-permuted, rotated back; fp values added */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < nheads; i++) {
                if (!scratch) continue;
                const rt_row *w = &rows[i / H];
                const int h = (int)(i % H);
                const float *vrot = w->vrot.data ? (const float *)at(&w->vrot, 0, h, 0) : NULL;
                finish_head(w->part + (int64_t)h * w->ncv * M * D, w->ncv, &w->out, &w->vsk, &w->vres, 0, h, M, D,
                            w->vper, w->vhb, vrot, w->S, w->NV, w->RV, w->T, w->scores + (int64_t)h * M * w->T, scratch);
            }
            KV_PHASE(4)
            free(scratch);
        }
    }
    free(pieces), free(rows), free(used), free(scores), free(qrot), free(part), free(kt), free(vt);
    return err != KV_OK ? err : n < R ? KV_EARG : KV_OK;
}

/* The row table's widths, for the loader to compare with its own: RT_HEAD, RT_ROW, RT_PIECE, RT_STATUS. */
void kv_rows_layout(int64_t *dst) {
    dst[0] = RT_HEAD, dst[1] = RT_ROW, dst[2] = RT_PIECE, dst[3] = RT_STATUS;
}

int kv_abi_version(void) { return KV_ABI_VERSION; }

int kv_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Row formats by name: GGML kinds by their kvslim/ggml names, "fp8" (e4m3 + a per-token fp32 scale), and
 * the plain dtypes "f32", "f16", "bf16". elements/bytes: one block's layout (1 element for the others). */
static const struct {
    const char *name;
    int fmt, elements, bytes;
} ROW_FORMATS[] = {
    {"q8_0", R_Q8_0, QK, Q8_0_BYTES}, {"q4_0", R_Q4_0, QK, Q4_0_BYTES}, {"q4_1", R_Q4_1, QK, Q4_1_BYTES},
    {"q5_0", R_Q5_0, QK, Q5_0_BYTES}, {"q5_1", R_Q5_1, QK, Q5_1_BYTES}, {"f32", R_F32, 1, 4},
    {"f16", R_F16, 1, 2},             {"bf16", R_BF16, 1, 2},           {"fp8", R_FP8, 1, 1},
};

/* The row format code of name (for kv_run's fmt parameter) and its block layout; -1 if there is no decoder. */
int kv_row_format(const char *name, int32_t *elements, int32_t *bytes) {
    for (size_t i = 0; i < sizeof ROW_FORMATS / sizeof ROW_FORMATS[0]; i++) {
        if (strcmp(name, ROW_FORMATS[i].name) == 0) {
            *elements = ROW_FORMATS[i].elements;
            *bytes = ROW_FORMATS[i].bytes;
            return ROW_FORMATS[i].fmt;
        }
    }
    return -1;
}

/* Casts to float16 with one finiteness answer, for a decode token entering float16 residuals (one call where
 * torch dispatches a cast, an isfinite and an all per tensor). args: count, then per tensor: src (fp32,
 * contiguous), dst (float16, contiguous), n. Rounds to nearest even, as torch's cast does. Returns 1 when
 * every result is finite, 0 when one is not (an inf or NaN input, or a finite value beyond float16's
 * range), -1 when built without F16C (the caller casts with torch). */
int kv_to_half_finite(const int64_t *args) {
#if defined(__F16C__) && defined(__AVX__)
    int ok = 1;
    for (int64_t t = 0; t < args[0]; t++) {
        const float *src = (const float *)(intptr_t)args[1 + 3 * t];
        uint16_t *dst = (uint16_t *)(intptr_t)args[2 + 3 * t];
        const int64_t n = args[3 + 3 * t];
        int64_t i = 0;
        __m128i bad = _mm_setzero_si128();
        const __m128i expo = _mm_set1_epi16(0x7c00);
        for (; i + 8 <= n; i += 8) {
            const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i *)(dst + i), h);
            bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(h, expo), expo)); /* exponent all ones */
        }
        if (!_mm_testz_si128(bad, bad)) ok = 0;
        for (; i < n; i++) {
            dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            if ((dst[i] & 0x7c00) == 0x7c00) ok = 0;
        }
    }
    return ok;
#else
    (void)args;
    return -1;
#endif
}

/* For the tests: n halves -> floats with the conversion the kernels use (portable = 0) or the portable one. */
void kv_test_half_to_float(const uint16_t *src, float *dst, int64_t n, int portable) {
    for (int64_t i = 0; i < n; i++) dst[i] = portable ? half_to_float_portable(src[i]) : h2f(src[i]);
}

/* --------------------------------------------------------------------------------- the entry point */

#define KV_NPARAM 8 /* kernel parameters after the 6 dims */

/* One call for every kernel (ctypes marshals one int64 array much faster than several structs):
 *   args = B, H, M, T, D, nthreads, param[4], then per tensor part: data, s0, s1, s2, dtype.
 *   OP_K_ROWS:   param fmt;                 parts q, x, xs (fp8 scale, else = x), out
 *   OP_V_ROWS:   param fmt;                 parts p, x, xs, out
 *   OP_K_AFFINE: params bits, G, offset;    parts q, codes, scale, zero, out
 *   OP_V_AFFINE: params bits, g;            parts p, codes, scale, zero, out
 *   OP_K_ROWS_T:   params fmt, -, -, hblock, rhalf, roff, has_bias, has_flags;  parts q, x, xs, out, bias,
 *                  cos, sin, flags, mat
 *   OP_K_AFFINE_T: params bits, G, offset, hblock, rhalf, roff, has_bias, has_flags;  parts q, codes, scale,
 *                  zero, out, bias, cos, sin, flags, mat, vn
 * (bias: (1, H, 1, D) fp32; cos/sin: (B or stride 0, 1, T, rhalf) fp32; flags (B, H, T, 1) uint8; mat: a fitted
 * rotation (1, H, D, D) fp32, data 0: none; unused parts may repeat q.) OP_K_ROWS, OP_V_ROWS, OP_K_AFFINE and
 * OP_V_AFFINE read param 7: nonzero decodes through the tiles where the codes would be read in registers (the
 * tests' check that both give the same bits; 0 otherwise). */
int kv_run(int op, const int64_t *args) {
    if (op < OP_K_ROWS || op > OP_K_AFFINE_T) return KV_EARG;
    kv_dims dm = {(int32_t)args[0], (int32_t)args[1], (int32_t)args[2], (int32_t)args[3], (int32_t)args[4],
                  (int32_t)args[5]};
    if (dm.B < 1 || dm.H < 1 || dm.M < 1 || dm.T < 1 || dm.D < 1) return KV_EARG;
    const int64_t *prm = args + 6;
    kv_part pt[11];
    static const int NPARTS[] = {4, 4, 6, 6, 9, 11}; /* the affine ops end with the vn part (data 0: none) */
    const int nparts = NPARTS[op];
    for (int i = 0; i < nparts; i++) {
        const int64_t *a = args + 6 + KV_NPARAM + 5 * i;
        pt[i].data = (const void *)(intptr_t)a[0];
        pt[i].s0 = a[1];
        pt[i].s1 = a[2];
        pt[i].s2 = a[3];
        pt[i].dtype = (int32_t)a[4];
        pt[i].unused = 0;
    }
    kv_call k = {.op = op, .x = &pt[0], .p1 = &pt[1], .p2 = &pt[2], .dm = &dm, .tr = NULL};
    kv_tr tr;
    if (op == OP_K_ROWS_T || op == OP_K_AFFINE_T) {
        const int first = op == OP_K_ROWS_T ? 4 : 5; /* the bias part */
        tr = (kv_tr){.hblock = (int)prm[3], .rhalf = (int)prm[4], .roff = (int)prm[5], .has_bias = (int)prm[6],
                     .has_flags = (int)prm[7], .bias = &pt[first], .cos = &pt[first + 1], .sin = &pt[first + 2],
                     .flags = &pt[first + 3], .mat = pt[first + 4].data ? &pt[first + 4] : NULL};
        if (tr.mat && pt[first + 4].dtype != DT_F32) return KV_EARG;
        k.tr = &tr;
    }
    if (op == OP_K_ROWS || op == OP_V_ROWS || op == OP_K_ROWS_T) {
        k.fmt = (int)prm[0];
        k.out = &pt[3];
        if (op != OP_K_ROWS_T) k.tiles = prm[7] != 0;
    } else {
        k.bits = (int)prm[0];
        k.group = (int)prm[1];
        k.offset = op == OP_K_AFFINE || op == OP_K_AFFINE_T ? (int)prm[2] : 0;
        k.p3 = &pt[3];
        k.out = &pt[4];
        const kv_part *vn = &pt[nparts - 1];
        k.vn = vn->data ? vn : NULL;
        if (op == OP_V_AFFINE) { /* params: bits, channel group, token group, offset */
            k.vgroup = (int)prm[2];
            k.voffset = (int)prm[3];
        }
        if (op != OP_K_AFFINE_T) k.tiles = prm[7] != 0;
    }
    return run_call(&k);
}

/* --------------------------------------------------------------------------------- shared with kvslim_paged.c
 *
 * kvp_attend (csrc/kvslim_paged.c, linked into the same library) runs its pages through these loops rather than
 * a second copy of them: the tiles' K dots and V sums (AVX2 + FMA where built), q8_0 / q4_0 rows read in
 * registers (k_ggml / v_ggml), and e^x eight lanes at a time. Not part of the ctypes ABI (Python never calls
 * them); the declarations are repeated in kvslim_paged.c. */

/* Whether kvs_k_ggml / kvs_v_ggml read codes in registers in this build (AVX2 + FMA); if not, the caller decodes
 * a tile and calls kvs_k_tile / kvs_v_tile. Their kind: 0 q8_0, 1 q4_0, 2 sym8 (kvslim_paged.c's KVP_ names). */
int kvs_ggml_direct(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* o[m * os + j] = qq[m] . rows[j] for m < M, j < n: rows (n, D) fp32, at least 4 * ceil(n / 4) of them readable. */
void kvs_k_tile(const float *qq, int64_t qs, int M, int D, const float *rows, int n, float *o, int64_t os) {
    k_tile(qq, qs, NULL, M, D, rows, n, o, os, 0);
}

/* acc[m, :] += sum_{j < n} p[m * ps + j] * rows[j, :] for m < M; acc rows D apart. */
void kvs_v_tile(const float *p, int64_t ps, int M, int D, const float *rows, int n, float *acc) {
    v_tile(p, ps, M, D, rows, n, acc);
}

static const int KVS_KINDS[3] = {R_Q8_0, R_Q4_0, R_SYM8};

/* K scores of q8_0 / q4_0 / sym8 rows (kind) in registers: o[m * os + j] = qq[m] . row(x0 + xs * j), m < M,
 * j < n; D % 32 == 0. Only where kvs_ggml_direct() says so. */
void kvs_k_ggml(int kind, int M, const float *qq, int64_t qs, int D, const uint8_t *x0, int64_t xs, int n, float *o,
                int64_t os) {
#if defined(__AVX2__) && defined(__FMA__)
    const int fmt = KVS_KINDS[kind];
    for (int m = 0; m < M; m += 3) {
        const float *qm = qq + m * qs;
        float *om = o + m * os;
        switch (M - m) {
        case 1: k_ggml(fmt, 1, 8, qm, qs, D, x0, xs, n, om, os); break;
        case 2: k_ggml(fmt, 2, 4, qm, qs, D, x0, xs, n, om, os); break;
        default: k_ggml(fmt, 3, 4, qm, qs, D, x0, xs, n, om, os); break;
        }
    }
#else
    (void)kind, (void)M, (void)qq, (void)qs, (void)D, (void)x0, (void)xs, (void)n, (void)o, (void)os;
#endif
}

/* V sums of q8_0 / q4_0 / sym8 rows (kind) in registers: acc[m, :] += p[m * ps + t] * row(x0 + xs * t), m < M,
 * t0 <= t < t1; acc rows D apart; D % 32 == 0. Only where kvs_ggml_direct() says so. */
void kvs_v_ggml(int kind, int M, const float *p, int64_t ps, const uint8_t *x0, int64_t xs, int t0, int t1, int D,
                float *acc) {
#if defined(__AVX2__) && defined(__FMA__)
    const int fmt = KVS_KINDS[kind];
    for (int m = 0; m < M; m += 3) {
        const float *pm = p + (int64_t)m * ps;
        float *am = acc + (int64_t)m * D;
        switch (M - m) {
        case 1: v_ggml(fmt, 1, pm, ps, x0, xs, t0, t1, D, am); break;
        case 2: v_ggml(fmt, 2, pm, ps, x0, xs, t0, t1, D, am); break;
        default: v_ggml(fmt, 3, pm, ps, x0, xs, t0, t1, D, am); break;
        }
    }
#else
    (void)kind, (void)M, (void)p, (void)ps, (void)x0, (void)xs, (void)t0, (void)t1, (void)D, (void)acc;
#endif
}

/* x[i] = e^(x[i] - mx) for i < n (softmax_rows' exponentials, exp_from), and their sum added in index order.
 * Returns the sum. */
float kvs_exp_sum(float *x, int n, float mx) {
    exp_from(x, n, mx);
    float sum = 0.0f;
    for (int t = 0; t < n; t++) sum += x[t];
    return sum;
}

/* K dots of per-token affine rows (int8 / int4 / int2 codes packed as formats/affine.py) in registers, before their
 * scale and zero: o[m * os + j] = qp[m] . codes(c0 + cs * j), m < M, j < n, the queries in plane order (rows D apart,
 * as plane_queries lays them out); the caller applies each token's scale and zero. D / (codes per byte) % 8 == 0.
 * Only where kvs_ggml_direct() says so. */
void kvs_k_affine(int bits, int M, const float *qp, int D, const uint8_t *c0, int64_t cs, int n, float *o,
                  int64_t os) {
#if defined(__AVX2__) && defined(__FMA__)
    k_direct_all(bits, M, qp, D, NULL, c0, cs, D / codes_per_unit(bits), n, o, os);
#else
    (void)bits, (void)M, (void)qp, (void)D, (void)c0, (void)cs, (void)n, (void)o, (void)os;
#endif
}

/* V sums of per-token affine rows in registers, in plane order: acc[m, :] += p[m * ps + t] * (code * scale + zero),
 * m < M, t0 <= t < t1, each row's fp16 scale and zero right after its codes (the vLLM plugin's affine pages); cs even,
 * D / (codes per byte) % 8 == 0. Only where kvs_ggml_direct() says so. */
void kvs_v_affine(int bits, int M, const float *p, int64_t ps, const uint8_t *c0, int64_t cs, int t0, int t1, int D,
                  float *acc) {
#if defined(__AVX2__) && defined(__FMA__)
    const int np = D / codes_per_unit(bits); /* bytes of codes: one unit per byte at 8, 4 and 2 bits */
    const kv_part sc = {c0 + np, 0, 0, cs / 2, DT_F16, 0}, zr = {c0 + np + 2, 0, 0, cs / 2, DT_F16, 0};
    for (int m = 0; m < M; m += 3) {
        const float *pm = p + (int64_t)m * ps;
        float *am = acc + (int64_t)m * D;
        switch (M - m) {
        case 1: v_direct(bits, 1, pm, ps, c0, cs, &sc, &zr, 0, 0, t0, t1, np, np, D, am); break;
        case 2: v_direct(bits, 2, pm, ps, c0, cs, &sc, &zr, 0, 0, t0, t1, np, np, D, am); break;
        default: v_direct(bits, 3, pm, ps, c0, cs, &sc, &zr, 0, 0, t0, t1, np, np, D, am); break;
        }
    }
#else
    (void)bits, (void)M, (void)p, (void)ps, (void)c0, (void)cs, (void)t0, (void)t1, (void)D, (void)acc;
#endif
}
