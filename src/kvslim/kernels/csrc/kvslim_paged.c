/* kvslim paged attention: attention on kvslim-encoded pages, many rows in one call, each row with its own
 * block table (the vLLM plugin, kvslim/vllm; meant to be shared with kvslim's engine, whose ragged step is the
 * same "many rows, one call" shape).
 *
 * Storage: pages of T tokens per (block, KV head); token t of page b, head h is a row of bytes at
 *   pages + b * page_stride + h * head_stride + t * token_stride
 * holding K at k_offset and V at v_offset, each in a row format (kvp_format): f32/f16/bf16 values, GGML
 * q8_0/q4_0/q4_1/q5_0/q5_1 blocks of 32 (ggml-common.h's byte layout, checked against kvslim's format
 * registry by the Python side), or kvslim's per-token affine int8/int4/int3/int2 (packed codes as
 * formats/affine.py, then fp16 scale and fp16 zero; value = code * scale + zero), or sym8 (the plugin's 8-bit
 * pages: an fp16 scale, then D int8 codes; value = code * scale: q8_0's block spanning the whole head), or fp8
 * (kvslim's fp8: D float8 e4m3fn codes, then the token's fp32 scale; value = code * scale).
 *
 * A row r (a request in vLLM, a conversation in kvslim's engine) has q_len queries at q[q_start ..] and
 * kv_len keys, the last q_len of which are its queries' own tokens: query i sits at position
 * kv_len - q_len + i. With causal, query position p sees keys 0..p (and with a window W > 0 only
 * p - W + 1..p); without, every key (and the window still applies). That covers decode (q_len 1), prefill,
 * prefill continuing a cached prefix (chunked prefill, prefix caching), and mixed batches in one call.
 * GQA: the Hq / Hkv query heads of a KV head share its decoded pages.
 *
 * Where a key comes from. Given the step's raw K/V (H_KNEW, H_VNEW: fp32, packed like the queries, so the
 * row's new token i is at index q_start + i), a row's keys below its cached length kv_len - q_len are read
 * from pages (the codes: key j is token j % T of page table[j / T]) and its q_len new keys from the raw K/V,
 * exactly: a step's tokens attend on each other at full precision and on the history's codes (q4_0 through
 * vLLM: KL 0.119 -> 0.061, docs/vllm.md). A prefill over no cached prefix
 * then reads no page at all. Without them (H_KNEW 0) every key is read from pages: the step's tokens must
 * have been written first.
 *
 * Staged pages. With a staging pool (H_STAGE), a page whose id maps to a staging slot (H_SMAP[page] >= 0) is
 * read from that slot instead of its codes: the partly filled last page of a sequence kept at full precision
 * (the model's dtype, rows in the cast layout: K values then V values) until its 32nd token arrives, as
 * kvslim's own cache keeps a partly filled group unencoded. The slot is laid out like a page (slot stride, head
 * stride, token stride) and holds the page's tokens from offset 0 up to the last one written; the caller keeps
 * the map exact (a slot is dropped when its page fills or its page id is reused; kvslim/vllm/staging.py).
 *
 * Per (row, KV head, chunk of up to QC queries) task, page by page: the scores of all the chunk's query-heads (QC
 * queries x the GQA group) against the page's tokens, each query-head's online softmax update (Milakov &
 * Gimelshein 2018; FlashAttention's rescaling), then the weighted V rows summed into every query-head's
 * accumulator at once, all in fp32. The loops are kvslim_kernels.c's (kvs_*: its tiles' AVX2 dots and sums, q8_0 /
 * q4_0 / sym8 rows and KIVI-style affine codes read 8 at a time in registers, exp in lanes), not a second copy: at
 * up to KVP_DIRECT_MAX query-heads (a decode step) codes are used in registers and never written out; more (a
 * prefill chunk) decode each page once into an fp32 tile in L1, as the step's raw K/V and staged pages are. Built
 * for AVX-512, a decode task's affine pages and every task's softmax take this file's own loops instead ("AVX-512
 * decode loops" below: fp32-accurate, not the rows kernels' operation order), and the queries and outputs are
 * rotated into and out of the pages' Hadamard basis here (H_QROT, H_OROT) rather than by two more torch calls.
 * Tasks run in parallel (OpenMP, the caller's thread count), costliest first; when there are fewer than ~4 a
 * thread (a few long decodes), each task's pages are split over the threads and the parts merged in page order
 * (split-K; the split depends on the shapes and the thread count only). No full fp32 copy of the history is made.
 *
 * Writes (kvp_write): the step's fp32 K/V encoded and stored through vLLM's slot mapping in one call, for the
 * formats whose bytes it reproduces exactly (f32 / f16 / bf16 values as torch casts them, every GGML block as
 * formats/ggml.py and gguf-py, sym8, affine int4 / int3 / int2 and fp8 rows as kvslim/vllm/pages.py); a GGML part
 * holding a value so small that a block's 1 / d could overflow is left to the torch encoders (return code 4).
 *
 * Entry points: kvp_attend (the kernel), kvp_write, kvp_format (a format name -> its code and block),
 * kvp_abi_version, kvp_layout.
 * Return codes: 0 ok, 1 out of memory, 2 bad arguments (unknown format, a page index outside the table or
 * the pool). The Python side checks shapes and dtypes; nothing here can check a pointer's extent.
 */

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* The AVX-512 loops below ("AVX-512 decode loops") where the build has them (-march=native on such a CPU). */
#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__F16C__)
#define KVP_FAST 1
#else
#define KVP_FAST 0
#endif

#define KVP_ABI_VERSION 6
/* Queries per task (a prefill row is split into chunks of QC queries). */
#define KVP_QC 16
/* The fewest pages a part of a split row reads (kvp_attend): 4,096 tokens of 32-token pages in 2 parts */
#define KVP_SPLIT_PAGES 64
/* Largest page (tokens) and head dim the scratch is sized for. */
#define KVP_MAX_T 256
#define KVP_MAX_D 1024

enum {
    KVP_F32 = 0,
    KVP_F16,
    KVP_BF16,
    KVP_Q8_0,
    KVP_Q4_0,
    KVP_Q4_1,
    KVP_Q5_0,
    KVP_Q5_1,
    KVP_A8,
    KVP_A4,
    KVP_A3,
    KVP_A2,
    KVP_S8,
    KVP_F8,
};

/* name -> code, and the (elements, bytes) of one block (GGML) or packing unit (affine); values: (1, size). */
static const struct {
    const char *name;
    int code, elements, bytes;
} KVP_FORMATS[] = {
    {"f32", KVP_F32, 1, 4},    {"f16", KVP_F16, 1, 2},    {"bf16", KVP_BF16, 1, 2},  {"q8_0", KVP_Q8_0, 32, 34},
    {"q4_0", KVP_Q4_0, 32, 18}, {"q4_1", KVP_Q4_1, 32, 20}, {"q5_0", KVP_Q5_0, 32, 22}, {"q5_1", KVP_Q5_1, 32, 24},
    {"int8", KVP_A8, 1, 1},    {"int4", KVP_A4, 2, 1},    {"int3", KVP_A3, 8, 3},    {"int2", KVP_A2, 4, 1},
    {"sym8", KVP_S8, 1, 1},    {"fp8", KVP_F8, 1, 1},
};
#define KVP_NFORMATS ((int)(sizeof(KVP_FORMATS) / sizeof(KVP_FORMATS[0])))

int kvp_abi_version(void) { return KVP_ABI_VERSION; }

/* Whether kvp_attend takes the AVX-512 decode loops where built (1, the default) or the loops of kvslim_kernels.c
 * an AVX2 build takes (0): the tests hold both paths to the reference on one machine, and scripts/paged_attend_time.py
 * times both in one process. Set it between calls, never during one. Returns whether the loops are built. */
static int kvp_fast = KVP_FAST;

int kvp_set_fast(int on) {
    kvp_fast = KVP_FAST && on;
    return KVP_FAST;
}

/* --------------------------------------------------------------------------------------- a step's K/V rotated */

int kv_linear(const int64_t *args); /* csrc/kvslim_linear.c, the same library */

/* A step's K and V as the pages store them, in one call (kvslim.vllm.basis): each role's rows (N, H, D) fp32 at
 * token stride ts and head stride hs (floats; a row's D values contiguous) into a new (N, H, D) contiguous fp32
 * tensor, times its block-diagonal rotation where it has one (mat: the B x B block, symmetric; 0: copied), and the
 * largest |value| of each role's result (NaN if any). The product is kv_linear's over rows of B values: bit for bit
 * what kvslim.cache.hadamard.Hadamard.apply computes on the CPU (a row's bits do not depend on the rows beside it or
 * the threads). Fields (int64): key, value, N, H, D, key ts, key hs, value ts, value hs, out key, out value, K's block
 * matrix, its B, V's block matrix, its B, the two maxima (float32 out[2]), kv_linear's threads. Returns 0, 2 (a
 * block that is not a divisor of D) or -1 (kv_linear not built: no AVX2 and FMA; nothing written). */
int kvp_rotate(const int64_t *a) {
    const int64_t N = a[2], H = a[3], D = a[4];
    float *amax = (float *)(intptr_t)a[15];
    for (int role = 0; role < 2; role++) {
        const float *x = (const float *)(intptr_t)a[role];
        const int64_t ts = a[5 + 2 * role], hs = a[6 + 2 * role], B = a[12 + 2 * role];
        const float *mat = (const float *)(intptr_t)a[11 + 2 * role];
        float *y = (float *)(intptr_t)a[9 + role];
        if (mat && (B <= 0 || D % B)) return 2;
        for (int64_t h = 0; h < H; h++) {
            if (!mat) {
                for (int64_t i = 0; i < N; i++) memcpy(y + (i * H + h) * D, x + i * ts + h * hs, sizeof(float) * (size_t)D);
                continue;
            }
            for (int64_t b = 0; b < D; b += B) {
                const int64_t args[11] = {(int64_t)(intptr_t)(x + h * hs + b), N, B, ts, (int64_t)(intptr_t)mat, B, B, 0,
                                          (int64_t)(intptr_t)(y + h * D + b), H * D, a[16]};
                if (kv_linear(args)) return -1;
            }
        }
        float m = 0.0f;
        int nan = 0;
        for (int64_t i = 0; i < N * H * D; i++) {
            const float v = fabsf(y[i]);
            nan |= v != v;
            m = v > m ? v : m;
        }
        amax[role] = nan ? NAN : m;
    }
    return 0;
}

int kvp_format(const char *name, int32_t *elements, int32_t *bytes) {
    for (int i = 0; i < KVP_NFORMATS; i++)
        if (!strcmp(name, KVP_FORMATS[i].name)) {
            *elements = KVP_FORMATS[i].elements;
            *bytes = KVP_FORMATS[i].bytes;
            return KVP_FORMATS[i].code;
        }
    *elements = *bytes = 0;
    return -1;
}

/* ------------------------------------------------------------------------------------------ row decoders */

static inline float kvp_h2f(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8)); /* little-endian fp16 */
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, f;
    if (e == 0) {
        if (m == 0) {
            f = sign;
        } else { /* subnormal: normalize */
            e = 113;
            while (!(m & 0x400)) {
                m <<= 1;
                e--;
            }
            f = sign | (e << 23) | ((m & 0x3ff) << 13);
        }
    } else if (e == 31) {
        f = sign | 0x7f800000u | (m << 13);
    } else {
        f = sign | ((e + 112) << 23) | (m << 13);
    }
    float out;
    memcpy(&out, &f, 4);
    return out;
#endif
}

/* A float8 e4m3fn byte's value: exponent field e > 0 moves into fp32's (bias 7 -> 127); e == 0 is m * 2^-9; 0x7f
 * (either sign) is NaN. */
static inline float kvp_e4m3(uint8_t b) {
    const uint32_t mag = b & 0x7fu;
    float f;
    if (mag == 0x7fu) {
        f = NAN;
    } else if (mag < 8) {
        f = (float)mag * 0x1p-9f;
    } else {
        const uint32_t bits = (mag << 20) + (120u << 23);
        memcpy(&f, &bits, 4);
    }
    return b & 0x80u ? -f : f;
}

/* Every e4m3 byte's value, filled once when the library loads (a constructor: before any call, on one thread), so
 * that an fp8 row decodes with one table load a value instead of kvp_e4m3's branches (a 16 x 2,048 decode step of
 * fp8 pages in vLLM took 751 ms with them, against 128 for int8 pages). */
static float kvp_e4m3_lut[256];

__attribute__((constructor)) static void kvp_e4m3_fill(void) {
    for (int b = 0; b < 256; b++) kvp_e4m3_lut[b] = kvp_e4m3((uint8_t)b);
}

/* One token's D values in format fmt at src -> dst fp32. */
static void kvp_decode_row(int fmt, const uint8_t *restrict src, int D, float *restrict dst) {
    switch (fmt) {
    case KVP_F32:
        memcpy(dst, src, (size_t)D * 4);
        return;
    case KVP_F16:
#if defined(__AVX512F__) && defined(__F16C__)
        if (D % 16 == 0) { /* the same conversion, 16 at a time */
            for (int i = 0; i < D; i += 16)
                _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * i))));
            return;
        }
#endif
        for (int i = 0; i < D; i++) dst[i] = kvp_h2f(src + 2 * i);
        return;
    case KVP_BF16:
        for (int i = 0; i < D; i++) {
            uint32_t f = (uint32_t)(src[2 * i] | (src[2 * i + 1] << 8)) << 16;
            memcpy(dst + i, &f, 4);
        }
        return;
    case KVP_Q8_0:
        for (int b = 0; b < D / 32; b++, src += 34, dst += 32) {
            float d = kvp_h2f(src);
            const int8_t *q = (const int8_t *)(src + 2);
            for (int j = 0; j < 32; j++) dst[j] = d * (float)q[j];
        }
        return;
    case KVP_Q4_0:
        for (int b = 0; b < D / 32; b++, src += 18, dst += 32) {
            float d = kvp_h2f(src);
            const uint8_t *qs = src + 2;
            for (int j = 0; j < 16; j++) {
                dst[j] = d * (float)((qs[j] & 15) - 8);
                dst[j + 16] = d * (float)((qs[j] >> 4) - 8);
            }
        }
        return;
    case KVP_Q4_1:
        for (int b = 0; b < D / 32; b++, src += 20, dst += 32) {
            float d = kvp_h2f(src), m = kvp_h2f(src + 2);
            const uint8_t *qs = src + 4;
            for (int j = 0; j < 16; j++) {
                dst[j] = d * (float)(qs[j] & 15) + m;
                dst[j + 16] = d * (float)(qs[j] >> 4) + m;
            }
        }
        return;
    case KVP_Q5_0:
    case KVP_Q5_1: {
        int q51 = fmt == KVP_Q5_1, nb = q51 ? 24 : 22, hq = q51 ? 4 : 2;
        for (int b = 0; b < D / 32; b++, src += nb, dst += 32) {
            float d = kvp_h2f(src), m = q51 ? kvp_h2f(src + 2) : 0.0f;
            uint32_t qh = (uint32_t)src[hq] | ((uint32_t)src[hq + 1] << 8) | ((uint32_t)src[hq + 2] << 16) |
                          ((uint32_t)src[hq + 3] << 24);
            const uint8_t *qs = src + hq + 4;
            for (int j = 0; j < 16; j++) {
                int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4), hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
                /* q5_0: d * (q - 16), written as formats/ggml.py computes it */
                dst[j] = q51 ? d * (float)lo + m : d * (float)(lo - 16);
                dst[j + 16] = q51 ? d * (float)hi + m : d * (float)(hi - 16);
            }
        }
        return;
    }
    case KVP_A8:
    case KVP_A4:
    case KVP_A3:
    case KVP_A2: {
        int bits = fmt == KVP_A8 ? 8 : fmt == KVP_A4 ? 4 : fmt == KVP_A3 ? 3 : 2;
        int nb = D * bits / 8;
        float s = kvp_h2f(src + nb), z = kvp_h2f(src + nb + 2);
#if KVP_FAST
        if (kvp_fast && (bits == 8 || bits == 4) && D % 32 == 0) { /* 16 codes a register: code * s + z, as below */
            const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z);
            for (int i = 0; i < D; i += 32) {
                __m128i lo, hi; /* channels i .. i + 15 and i + 16 .. i + 31, a byte each */
                if (bits == 8) {
                    lo = _mm_loadu_si128((const __m128i *)(src + i));
                    hi = _mm_loadu_si128((const __m128i *)(src + i + 16));
                } else { /* byte j: channel 2j in its low nibble, 2j + 1 in its high one */
                    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + i / 2)));
                    const __m256i c = _mm256_or_si256(_mm256_and_si256(w, _mm256_set1_epi16(0x0f)),
                                                      _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0xf0)), 4));
                    lo = _mm256_castsi256_si128(c);
                    hi = _mm256_extracti128_si256(c, 1);
                }
                _mm512_storeu_ps(dst + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vs, vz));
                _mm512_storeu_ps(dst + i + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vs, vz));
            }
            return;
        }
#endif
        if (bits == 8) {
            for (int i = 0; i < D; i++) dst[i] = (float)src[i] * s + z;
        } else if (bits == 3) { /* 8 codes in a little-endian 24-bit word */
            for (int u = 0; u < D / 8; u++) {
                uint32_t w = (uint32_t)src[3 * u] | ((uint32_t)src[3 * u + 1] << 8) | ((uint32_t)src[3 * u + 2] << 16);
                for (int i = 0; i < 8; i++) dst[8 * u + i] = (float)((w >> (3 * i)) & 7) * s + z;
            }
        } else { /* 8 / bits codes per byte, low bits first */
            int per = 8 / bits, mask = (1 << bits) - 1;
            for (int j = 0; j < nb; j++)
                for (int i = 0; i < per; i++) dst[per * j + i] = (float)((src[j] >> (bits * i)) & mask) * s + z;
        }
        return;
    }
    case KVP_S8: {
        float d = kvp_h2f(src);
        const int8_t *q = (const int8_t *)(src + 2);
        for (int i = 0; i < D; i++) dst[i] = d * (float)q[i];
        return;
    }
    case KVP_F8: { /* codes.float() * scale, as formats/floats.py decodes */
        float sc;
        memcpy(&sc, src + D, 4);
        for (int i = 0; i < D; i++) dst[i] = kvp_e4m3_lut[src[i]] * sc;
        return;
    }
    default:
        return;
    }
}

/* ------------------------------------------------------------------------------------------ the kernel */

/* kvp_attend's header: int64 fields (a double's bits for scale). */
enum {
    H_ABI = 0,
    H_NROWS,
    H_ROWS,      /* int64 rows[n_rows][R_FIELDS] */
    H_HQ,
    H_HKV,
    H_D,
    H_T,         /* tokens per page */
    H_Q,         /* fp32 queries (N, Hq, D): token stride H_QS floats, heads contiguous */
    H_QS,
    H_OUT,       /* fp32 output, same shape */
    H_OUTS,
    H_PAGES,     /* uint8 pool */
    H_NPAGES,    /* pages in the pool (bounds check) */
    H_PAGE_STRIDE,
    H_HEAD_STRIDE,
    H_TOKEN_STRIDE,
    H_KFMT,
    H_KOFF,
    H_VFMT,
    H_VOFF,
    H_SCALE,     /* double bits */
    H_WINDOW,    /* <= 0: none */
    H_CAUSAL,
    H_THREADS,   /* <= 0: OpenMP's default */
    H_KNEW,      /* fp32 raw K of the step's tokens (N, Hkv, D), packed like the queries; 0: keys from pages */
    H_VNEW,      /* fp32 raw V, same shape and strides */
    H_NEWS,      /* their token stride in floats (heads D apart, values contiguous) */
    H_STAGE,     /* uint8 staging pool (slots laid out like pages); 0: none */
    H_SNSLOTS,   /* slots in the pool (bounds check) */
    H_SSLOT_STRIDE,
    H_SHEAD_STRIDE,
    H_STOKEN_STRIDE,
    H_SFMT,      /* a cast format: f32 / f16 / bf16 */
    H_SVOFF,     /* V's byte offset in a staged token row (K at 0) */
    H_SMAP,      /* int32 page id -> staging slot or -1 */
    H_SMAP_LEN,  /* entries of H_SMAP (a page beyond it has no slot) */
    H_SINK,      /* with a window: keys [0, H_SINK) stay visible to every query (StreamingLLM's sinks) */
    H_QROT,      /* 0, or the block of the normalized Sylvester Hadamard rotation applied to each query head first */
    H_OROT,      /* 0, or the block of the one applied to each output head last (pages in a rotated basis) */
    H_FIELDS
};
/* A row: its first query, its number of queries, its number of keys, its block table (int32 page ids) and
 * that table's length. */
enum { R_QSTART = 0, R_QLEN, R_KVLEN, R_TABLE, R_TABLE_LEN, R_FIELDS };

/* kvp_write's header: int64 fields. */
enum {
    W_ABI = 0,
    W_N,        /* tokens */
    W_KEY,      /* fp32 (N, H, D): heads D apart, values contiguous */
    W_VALUE,
    W_KS,       /* token strides of key and value, in floats */
    W_VS,
    W_SLOTS,    /* int64 (N,): page * T + offset; negative: skipped */
    W_H,
    W_D,
    W_T,
    W_CACHE,    /* uint8 pages */
    W_NPAGES,
    W_PAGE_STRIDE,
    W_HEAD_STRIDE,
    W_TOKEN_STRIDE,
    W_KFMT,
    W_KOFF,
    W_VFMT,
    W_VOFF,
    W_FIELDS
};

void kvp_layout(int64_t *dst) {
    dst[0] = H_FIELDS;
    dst[1] = R_FIELDS;
    dst[2] = W_FIELDS;
}

typedef struct {
    const int64_t *a;
    const int64_t *rows;
    int Hq, Hkv, D, T, G;
    float scale;
} kvp_call;

/* Shared with kvslim_kernels.c (the same library): its tile loops, q8_0 / q4_0 rows in registers, e^x in lanes. */
int kvs_ggml_direct(void);
void kvs_k_tile(const float *qq, int64_t qs, int M, int D, const float *rows, int n, float *o, int64_t os);
void kvs_v_tile(const float *p, int64_t ps, int M, int D, const float *rows, int n, float *acc);
void kvs_k_ggml(int kind, int M, const float *qq, int64_t qs, int D, const uint8_t *x0, int64_t xs, int n, float *o,
                int64_t os);
void kvs_v_ggml(int kind, int M, const float *p, int64_t ps, const uint8_t *x0, int64_t xs, int t0, int t1, int D,
                float *acc);
float kvs_exp_sum(float *x, int n, float mx);
void kvs_k_affine(int bits, int M, const float *qp, int D, const uint8_t *c0, int64_t cs, int n, float *o,
                  int64_t os);
void kvs_v_affine(int bits, int M, const float *p, int64_t ps, const uint8_t *c0, int64_t cs, int t0, int t1, int D,
                  float *acc);

/* Query-heads of a task up to which q8_0 / q4_0 / sym8 / affine codes are read in registers (each 3 query-heads
 * re-read the page's codes); more (a prefill chunk: 16 queries x the GQA group) decode the page into a tile once. */
#define KVP_DIRECT_MAX 6

/* kvs_k_ggml's kind of rows of format fmt if they are read in registers for MG query-heads, else -1. */
static int kvp_direct(int fmt, int MG, int D) {
    const int kind = fmt == KVP_Q8_0 ? 0 : fmt == KVP_Q4_0 ? 1 : fmt == KVP_S8 ? 2 : -1;
    return kind >= 0 && MG <= KVP_DIRECT_MAX && D % 32 == 0 && kvs_ggml_direct() ? kind : -1;
}

/* The code width of per-token affine rows of format fmt if they are read in registers for MG query-heads (rows ts
 * bytes apart: their fp16 scales read in place), else 0. */
static int kvp_affine(int fmt, int MG, int D, int64_t ts) {
    const int bits = fmt == KVP_A8 ? 8 : fmt == KVP_A4 ? 4 : fmt == KVP_A2 ? 2 : 0;
    return bits && (D * bits / 8) % 8 == 0 && D % 32 == 0 && ts % 2 == 0 && MG <= KVP_DIRECT_MAX &&
                   kvs_ggml_direct()
               ? bits
               : 0;
}

/* ------------------------------------------------------------------------------------------ AVX-512 decode loops
 *
 * Built for AVX-512 (F + VL, -march=native on such a CPU), a decode task's affine pages (int8 / int4 / int2 codes,
 * D % 64 == 0) and every task's softmax take these loops instead of kvslim_kernels.c's, which keep the rows
 * kernels' operation order (lane for lane the tiles' arithmetic, exp to expf's last bit). Here only fp32 accuracy
 * is kept, not that order (tests/test_paged_kernel.py holds the kernel to the torch reference at 2e-5):
 * - a unit of packed codes is widened once and every plane of it is taken from that register; an int4 / int2 code
 *   becomes its float by a 16-entry table lookup of the low bits (vpermps), not a mask and a conversion;
 * - the tokens' fp16 scales and zeros of a page are converted 16 at a time into floats;
 * - K: a query's dot with the codes, then times the token's scale plus its zero times the query's sum, 8 tokens at
 *   once; V: each weight times the token's scale multiplies the codes, and the weights times the zeros, summed
 *   over the page, are added to every channel once;
 * - the softmax's maxima, exponentials (Cephes' expf polynomial, about 1 ulp) and sums 16 tokens a register, the
 *   query's visible tokens a lane mask.
 * kvp_set_fast(0) takes the AVX2 loops instead (tests hold both to the reference; scripts/paged_attend_time.py
 * times both: docs/performance.md, "The pages kernel on AVX-512"). */
#if KVP_FAST

/* e^x in 16 lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial, times 2^n by scalef); x below
 * -104 is taken as -104 (e^x then rounds to 0), NaN stays NaN. */
static inline __m512 kvp_exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
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
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Lanes t .. t + 15 that lie in [a, b) or [c, d). */
static inline __mmask16 kvp_lanes(int t, int a, int b, int c, int d) {
    const __m512i i = _mm512_add_epi32(_mm512_set1_epi32(t),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __mmask16 x = _mm512_cmpge_epi32_mask(i, _mm512_set1_epi32(a)) & _mm512_cmplt_epi32_mask(i, _mm512_set1_epi32(b));
    const __mmask16 y = _mm512_cmpge_epi32_mask(i, _mm512_set1_epi32(c)) & _mm512_cmplt_epi32_mask(i, _mm512_set1_epi32(d));
    return x | y;
}

/* The largest score of w[t] over t in [ta, s1) and [u0, u1) (-inf if none). */
static float kvp_vmax(const float *w, int ta, int s1, int u0, int u1, int tb) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int t = ta; t < tb; t += 16)
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, kvp_lanes(t, ta, s1, u0, u1), w + t));
    return _mm512_reduce_max_ps(m);
}

/* w[t] = e^(w[t] - mx) for t in [ta, s1) and [u0, u1), 0 for the other t in [ta, tb). Returns their sum. */
static float kvp_vexp(float *w, int ta, int s1, int u0, int u1, int tb, float mx) {
    __m512 s = _mm512_setzero_ps();
    for (int t = ta; t < tb; t += 16) {
        const __mmask16 in = kvp_lanes(t, ta, tb, 0, 0), vis = kvp_lanes(t, ta, s1, u0, u1);
        const __m512 e = _mm512_maskz_mov_ps(
            vis, kvp_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(vis, w + t), _mm512_set1_ps(mx))));
        _mm512_mask_storeu_ps(w + t, in, e);
        s = _mm512_add_ps(s, e);
    }
    return _mm512_reduce_add_ps(s);
}

/* The unaligned dword at p. */
static inline int32_t kvp_dword(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The fp16 scale and zero of tokens [ta, tc) (each a dword at sz + t * ts: scale, then zero) -> sc[t], z[t],
 * converted 16 at a time. Sixteen dwords are put in a register as they are loaded (a gather is slower on Zen 4:
 * microcoded); a shorter tail is copied to a buffer first. */
static void kvp_scales(const uint8_t *sz, int64_t ts, int ta, int tc, float *sc, float *z) {
    uint32_t buf[16];
    for (int t = ta; t < tc; t += 16) {
        const int n = tc - t < 16 ? tc - t : 16;
        if (n == 16) { /* not through the buffer: a vector load of dwords just stored one by one waits for the
                        * stores (no forwarding) */
            const uint8_t *s = sz + t * ts;
            const __m512i d = _mm512_setr_epi32(
                kvp_dword(s), kvp_dword(s + ts), kvp_dword(s + 2 * ts), kvp_dword(s + 3 * ts), kvp_dword(s + 4 * ts),
                kvp_dword(s + 5 * ts), kvp_dword(s + 6 * ts), kvp_dword(s + 7 * ts), kvp_dword(s + 8 * ts),
                kvp_dword(s + 9 * ts), kvp_dword(s + 10 * ts), kvp_dword(s + 11 * ts), kvp_dword(s + 12 * ts),
                kvp_dword(s + 13 * ts), kvp_dword(s + 14 * ts), kvp_dword(s + 15 * ts));
            _mm512_storeu_ps(sc + t, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d)));
            _mm512_storeu_ps(z + t, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(d, 16))));
            continue;
        }
        for (int j = 0; j < n; j++) memcpy(buf + j, sz + (t + j) * ts, 4);
        const __mmask16 in = (__mmask16)((1u << n) - 1);
        const __m512i d = _mm512_maskz_loadu_epi32(in, buf);
        _mm512_mask_storeu_ps(sc + t, in, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d)));
        _mm512_mask_storeu_ps(z + t, in, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(d, 16))));
    }
}

/* 16 widened code units (dwords) -> the plane of shift sh as floats: bits 8 a conversion, 4 and 2 a lookup of the
 * low 4 bits in tab (tab[j] = j & (2^bits - 1)). */
static inline __m512 kvp_plane(__m512i v, int sh, int bits, __m512 tab) {
    if (bits == 8) return _mm512_cvtepi32_ps(v);
    return _mm512_permutexvar_ps(sh ? _mm512_srli_epi32(v, (unsigned)sh) : v, tab);
}

static inline __m512 kvp_tab(int bits) {
    const __m512 t = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return bits == 2 ? _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3) : t;
}

/* The sums of the 8-lane halves of a0 .. a3 (tokens 0, 1 in a0; 2, 3 in a1; ...): 8 token sums in order. */
static inline __m256 kvp_sum8x2(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x88), _mm512_shuffle_f32x4(a0, a1, 0xDD));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x88), _mm512_shuffle_f32x4(a2, a3, 0xDD));
    const __m512 p = _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
    const __m512 q = _mm512_add_ps(_mm512_shuffle_ps(p, p, 0x88), _mm512_shuffle_ps(p, p, 0xDD));
    return _mm512_castps512_ps256(
        _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), q));
}

/* K scores of NM query-heads (plane-order queries qp, rows D apart, their sums qs) against n tokens of affine codes
 * (c0 + ts * j): o[m * os + j] = (qp[m] . codes(j)) * sc[j] + z[j] * qs[m]. Two tokens a register (8 units each),
 * 8 tokens at a time; the last group's missing tokens re-read token n - 1 and are not written. */
static inline __attribute__((always_inline)) void kvp_k_aff_n(int bits, int NM, const float *qp, const float *qs,
                                                             int D, const uint8_t *c0, int64_t ts, int n,
                                                             const float *sc, const float *z, float *o, int64_t os) {
    const int per = 8 / bits, np = D / per;
    const __m512 tab = kvp_tab(bits);
    for (int j = 0; j < n; j += 8) {
        const uint8_t *cp[8];
        for (int x = 0; x < 8; x++) cp[x] = c0 + ts * (j + x < n ? j + x : n - 1);
        __m512 a[3][4];
        for (int m = 0; m < NM; m++)
            for (int y = 0; y < 4; y++) a[m][y] = _mm512_setzero_ps();
        for (int u = 0; u < np; u += 8) {
            __m512i v[4];
            for (int y = 0; y < 4; y++)
                v[y] = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(cp[2 * y] + u)),
                                                               _mm_loadl_epi64((const __m128i *)(cp[2 * y + 1] + u))));
            for (int i = 0; i < per; i++) {
                __m512 q[3];
                for (int m = 0; m < NM; m++) {
                    const __m256 h = _mm256_loadu_ps(qp + (int64_t)m * D + i * np + u);
                    q[m] = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(h)));
                }
                for (int y = 0; y < 4; y++) {
                    const __m512 f = kvp_plane(v[y], bits * i, bits, tab);
                    for (int m = 0; m < NM; m++) a[m][y] = _mm512_fmadd_ps(q[m], f, a[m][y]);
                }
            }
        }
        const __mmask8 keep = (__mmask8)(n - j >= 8 ? 0xff : (1u << (n - j)) - 1);
        const __m256 s = _mm256_maskz_loadu_ps(keep, sc + j), zz = _mm256_maskz_loadu_ps(keep, z + j);
        for (int m = 0; m < NM; m++) {
            const __m256 d = kvp_sum8x2(a[m][0], a[m][1], a[m][2], a[m][3]);
            _mm256_mask_storeu_ps(o + m * os + j, keep, _mm256_fmadd_ps(zz, _mm256_set1_ps(qs[m]), _mm256_mul_ps(d, s)));
        }
    }
}

static void kvp_k_aff(int bits, int MG, const float *qp, const float *qs, int D, const uint8_t *c0, int64_t ts,
                      int n, const float *sc, const float *z, float *o, int64_t os) {
    for (int m = 0; m < MG; m += 3) {
        const float *q = qp + (int64_t)m * D, *s = qs + m;
        float *om = o + m * os;
        const int nm = MG - m < 3 ? MG - m : 3; /* bits and queries as constants: the loops unrolled in registers */
#define KVP_K(B, N) kvp_k_aff_n(B, N, q, s, D, c0, ts, n, sc, z, om, os)
        switch (bits * 4 + nm) {
        case 33: KVP_K(8, 1); break;
        case 34: KVP_K(8, 2); break;
        case 35: KVP_K(8, 3); break;
        case 17: KVP_K(4, 1); break;
        case 18: KVP_K(4, 2); break;
        case 19: KVP_K(4, 3); break;
        case 9: KVP_K(2, 1); break;
        case 10: KVP_K(2, 2); break;
        default: KVP_K(2, 3); break;
        }
#undef KVP_K
    }
}

/* V sums of NM query-heads: acc[m, :] (plane order) += p[m * ps + t] * codes(t) over tokens t in [ta, tc) (c0 + ts *
 * t), then + zs[m] (p the weights times the token's scale, zs[m] the weights times the zeros summed over the page:
 * added to each channel as it is stored, not read back after a wider store, which a load does not forward from).
 * 64 channels of acc a block in registers: 64 / per units, each 16 widened once and all per planes taken from them. */
static inline __attribute__((always_inline)) void kvp_v_aff_n(int bits, int NM, const float *p, int64_t ps,
                                                             const uint8_t *c0, int64_t ts, int ta, int tc, int D,
                                                             const float *zs, float *acc) {
    const int per = 8 / bits, np = D / per, chunks = 4 / per; /* 16-unit chunks a block (int2: 1, 4 planes) */
    const __m512 tab = kvp_tab(bits);
    for (int ub = 0; ub < np; ub += 16 * chunks) {
        __m512 a[3][4];
        for (int m = 0; m < NM; m++)
            for (int ch = 0; ch < chunks; ch++)
                for (int i = 0; i < per; i++)
                    a[m][ch * per + i] = _mm512_loadu_ps(acc + (int64_t)m * D + i * np + ub + 16 * ch);
        for (int t = ta; t < tc; t++) {
            const uint8_t *c = c0 + ts * t;
            _mm_prefetch((const char *)(c + 8 * ts), _MM_HINT_T0);
            __m512 w[3];
            for (int m = 0; m < NM; m++) w[m] = _mm512_set1_ps(p[m * ps + t]);
            for (int ch = 0; ch < chunks; ch++) {
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + ub + 16 * ch)));
                for (int i = 0; i < per; i++) {
                    const __m512 f = kvp_plane(v, bits * i, bits, tab);
                    for (int m = 0; m < NM; m++) a[m][ch * per + i] = _mm512_fmadd_ps(w[m], f, a[m][ch * per + i]);
                }
            }
        }
        for (int m = 0; m < NM; m++) {
            const __m512 z = _mm512_set1_ps(zs[m]);
            for (int ch = 0; ch < chunks; ch++)
                for (int i = 0; i < per; i++)
                    _mm512_storeu_ps(acc + (int64_t)m * D + i * np + ub + 16 * ch,
                                     _mm512_add_ps(a[m][ch * per + i], z));
        }
    }
}

static void kvp_v_aff(int bits, int MG, const float *p, int64_t ps, const uint8_t *c0, int64_t ts, int ta, int tc,
                      int D, const float *zs, float *acc) {
    for (int m = 0; m < MG; m += 3) {
        const float *pm = p + (int64_t)m * ps, *zm = zs + m;
        float *am = acc + (int64_t)m * D;
        const int nm = MG - m < 3 ? MG - m : 3;
#define KVP_V(B, N) kvp_v_aff_n(B, N, pm, ps, c0, ts, ta, tc, D, zm, am)
        switch (bits * 4 + nm) {
        case 33: KVP_V(8, 1); break;
        case 34: KVP_V(8, 2); break;
        case 35: KVP_V(8, 3); break;
        case 17: KVP_V(4, 1); break;
        case 18: KVP_V(4, 2); break;
        case 19: KVP_V(4, 3); break;
        case 9: KVP_V(2, 1); break;
        case 10: KVP_V(2, 2); break;
        default: KVP_V(2, 3); break;
        }
#undef KVP_V
    }
}
#endif

/* x (D values) in place, natural order -> plane order of per codes per byte: x'[i * np + j] = x[per * j + i]. */
static void kvp_to_planes(float *x, int D, int per, float *tmp) {
    const int np = D / per;
    if (per == 1) return;
#if defined(__AVX512F__) && defined(__F16C__) /* (immintrin.h comes with __F16C__) */
    if (per == 2 && D % 32 == 0) { /* 32 values a time: the even ones to plane 0, the odd ones to plane 1 */
        const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        for (int j = 0; j < np; j += 16) {
            const __m512 lo = _mm512_loadu_ps(x + 2 * j), hi = _mm512_loadu_ps(x + 2 * j + 16);
            _mm512_storeu_ps(tmp + j, _mm512_permutex2var_ps(lo, ev, hi));
            _mm512_storeu_ps(tmp + np + j, _mm512_permutex2var_ps(lo, od, hi));
        }
        memcpy(x, tmp, sizeof(float) * (size_t)D);
        return;
    }
#endif
    for (int j = 0; j < np; j++)
        for (int i = 0; i < per; i++) tmp[i * np + j] = x[per * j + i];
    memcpy(x, tmp, sizeof(float) * (size_t)D);
}

/* Tile rows [ta, tb) of one role (K or V) of the page starting at key position t0: [ta, tc) decoded from the
 * page or its staging slot (format fmt at byte offset off of each token row at base, rows ts bytes apart),
 * [tc, tb) copied from the step's raw fp32 rows, tile row t's at raw[raw0 + (t0 + t) * H_NEWS]. */
static void kvp_fill(const int64_t *a, int fmt, int64_t off, const uint8_t *base, int64_t ts, const float *raw,
                     int64_t raw0, int64_t t0, int ta, int tc, int tb, int D, float *tile) {
    for (int t = ta; t < tc; t++) kvp_decode_row(fmt, base + t * ts + off, D, tile + (size_t)t * D);
    for (int t = tc; t < tb; t++)
        memcpy(tile + (size_t)t * D, raw + raw0 + (t0 + t) * a[H_NEWS], sizeof(float) * (size_t)D);
}

/* Scratch floats of one thread: the K and V tiles (T rows and 4 readable spare: kvs_k_tile reads rows in fours),
 * the scaled queries (and in plane order), the accumulators, the running maxima and sums, the queries' sums, the
 * scores of a page, a row. */
static size_t kvp_scratch(int T, int D, int MG) {
    return 2 * (size_t)(T + 4) * D + 3 * (size_t)MG * D + 3 * (size_t)MG + (size_t)MG * T + D + 16 +
           (size_t)MG * T + 4 * (size_t)T + (size_t)MG + 64; /* KVP_FAST: weights x scales, scales, zeros, sums */
}

#if KVP_FAST
/* One butterfly stage of span h (1, 2, 4 or 8) inside 16 lanes: lane j, h's bit clear, gets x[j] + x[j + h]; lane
 * j + h gets x[j] - x[j + h]: the scalar loop's two results, the same additions. */
static inline __m512 kvp_fwht16(__m512 v, int h) {
    const __m512 p = h == 1   ? _mm512_permute_ps(v, 0xB1)
                     : h == 2 ? _mm512_permute_ps(v, 0x4E)
                     : h == 4 ? _mm512_shuffle_f32x4(v, v, 0xB1)
                              : _mm512_shuffle_f32x4(v, v, 0x4E);
    const __mmask16 hi = h == 1 ? 0xAAAA : h == 2 ? 0xCCCC : h == 4 ? 0xF0F0 : 0xFF00;
    return _mm512_mask_sub_ps(_mm512_add_ps(v, p), hi, p, v);
}
#endif

/* x (D values) times the normalized Sylvester Hadamard matrix of order hb, block by block (hb a power of two dividing
 * D): the basis the pages are stored in (kvslim.cache.hadamard; H is symmetric and its own inverse). */
static void kvp_fwht(float *restrict x, int D, int hb) {
    const float norm = 1.0f / sqrtf((float)hb);
#if KVP_FAST
    if (kvp_fast && hb >= 16) { /* the same butterflies 16 lanes at a time (the same bits: each sum is the scalar's) */
        for (int b0 = 0; b0 < D; b0 += hb) {
            float *restrict y = x + b0;
            for (int j = 0; j < hb; j += 16)
                _mm512_storeu_ps(y + j, kvp_fwht16(kvp_fwht16(kvp_fwht16(kvp_fwht16(_mm512_loadu_ps(y + j), 1), 2), 4),
                                                   8));
            for (int h = 16; h < hb; h *= 2)
                for (int i = 0; i < hb; i += 2 * h)
                    for (int j = i; j < i + h; j += 16) {
                        const __m512 u = _mm512_loadu_ps(y + j), v = _mm512_loadu_ps(y + j + h);
                        _mm512_storeu_ps(y + j, _mm512_add_ps(u, v));
                        _mm512_storeu_ps(y + j + h, _mm512_sub_ps(u, v));
                    }
        }
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(x + d, _mm512_mul_ps(_mm512_loadu_ps(x + d), _mm512_set1_ps(norm)));
        return;
    }
#endif
    for (int b0 = 0; b0 < D; b0 += hb) {
        float *restrict y = x + b0;
        for (int h = 1; h < hb; h *= 2)
            for (int i = 0; i < hb; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    const float u = y[j], v = y[j + h];
                    y[j] = u + v;
                    y[j + h] = u - v;
                }
    }
    for (int d = 0; d < D; d++) x[d] *= norm;
}

static void kvp_finish(const kvp_call *c, int r, int h, int q0, int M, const float *sum, const float *acc, int vper);

#if defined(__F16C__)
/* The lines of p from *done up to byte upto fetched into L2 (*done moves on). */
static inline void kvp_pf(const char *p, int64_t *done, int64_t upto) {
    for (; *done < upto; *done += 64) _mm_prefetch(p + *done, _MM_HINT_T1);
}
#endif

/* One task: row r, KV head h, queries q0 .. q0 + M - 1 of the row, over its pages [pa, pb) (of those it may see).
 * part NULL: the output rows written; else the running maxima, sums and accumulators left there (MG, MG, MG x D:
 * one split of the row's pages, merged by kvp_merge). Returns 0 or 2 (bad page index).
 *
 * Per page: the scores of all M x G query-heads against the page's visible tokens (S, MG x T: K codes read in
 * registers for q8_0 / q4_0 / sym8 / affine at few query-heads, else decoded once into a tile), then per query-head
 * the online
 * softmax update (the running sum and the accumulator rescaled by e^(old max - new max), the page's weights e^(s -
 * new max), 0 where a query may not see a token), then the weighted V rows summed into every query-head's
 * accumulator at once (V codes in registers, or a tile). Affine V codes are summed in their plane order (the
 * accumulators and every V tile row in that order, put back at the end); affine K scores are the plane-order
 * queries' dots with the codes, times the token's scale, plus its zero times the query's sum. */
static int kvp_task(const kvp_call *c, int r, int h, int q0, int64_t pa, int64_t pb, float *part, float *scratch) {
    const int64_t *a = c->a, *row = c->rows + (int64_t)r * R_FIELDS;
    const int D = c->D, T = c->T, G = c->G;
    const int64_t qlen = row[R_QLEN], kvlen = row[R_KVLEN], tlen = row[R_TABLE_LEN];
    const int32_t *table = (const int32_t *)(intptr_t)row[R_TABLE];
    const int M = (int)(qlen - q0 < KVP_QC ? qlen - q0 : KVP_QC), MG = M * G;
    const int64_t window = a[H_WINDOW], causal = a[H_CAUSAL], sink = window > 0 && a[H_SINK] > 0 ? a[H_SINK] : 0;
    const int64_t pos0 = kvlen - qlen + q0; /* position of the task's first query */
    const float *q = (const float *)(intptr_t)a[H_Q];
    const uint8_t *pool = (const uint8_t *)(intptr_t)a[H_PAGES];
    const float *knew = (const float *)(intptr_t)a[H_KNEW], *vnew = (const float *)(intptr_t)a[H_VNEW];
    const uint8_t *stage = (const uint8_t *)(intptr_t)a[H_STAGE];
    const int32_t *smap = (const int32_t *)(intptr_t)a[H_SMAP];
    /* keys [0, cached) from pages, [cached, kvlen) from the raw K/V: new token pos - cached */
    const int64_t cached = knew ? kvlen - qlen : kvlen;
    /* the raw row of key position k (>= cached): (row[R_QSTART] + k - cached) * H_NEWS + h * D */
    const int64_t raw0 = (row[R_QSTART] - cached) * a[H_NEWS] + (int64_t)h * D;

    float *kt = scratch, *vt = kt + (size_t)(T + 4) * D, *qq = vt + (size_t)(T + 4) * D, *acc = qq + (size_t)MG * D;
    float *mx = acc + (size_t)MG * D, *sum = mx + MG, *S = sum + MG; /* S: (MG, T) scores, then weights */
    if (part) { /* a split: its state kept where kvp_merge reads it */
        mx = part;
        sum = mx + MG;
        acc = sum + MG;
    }
    float *qp = S + (size_t)MG * T, *qsum = qp + (size_t)MG * D, *tmp = qsum + MG;
#if KVP_FAST /* after tmp's D + 16: the V weights times scales (MG x T), the pages' K and V scales and zeros */
    float *ws = tmp + D + 16, *ksc = ws + (size_t)MG * T, *kz = ksc + T, *vsc = kz + T, *vz = vsc + T, *zsum = vz + T;
#endif
    const int kaff = kvp_affine((int)a[H_KFMT], MG, D, a[H_TOKEN_STRIDE]);
    const int vaff = kvp_affine((int)a[H_VFMT], MG, D, a[H_TOKEN_STRIDE]), vper = vaff ? 8 / vaff : 1;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            const float *src = q + (row[R_QSTART] + q0 + m) * a[H_QS] + (int64_t)(h * G + g) * D;
            float *dst = qq + (size_t)(m * G + g) * D;
            for (int d = 0; d < D; d++) dst[d] = src[d] * c->scale;
            if (a[H_QROT]) kvp_fwht(dst, D, (int)a[H_QROT]); /* into the keys' basis */
        }
    if (kaff) /* plane-order queries and their sums */
        for (int i = 0; i < MG; i++) {
            const float *x = qq + (size_t)i * D;
            float sq = 0.0f;
            for (int d = 0; d < D; d++) sq += x[d];
            qsum[i] = sq;
            memcpy(qp + (size_t)i * D, x, sizeof(float) * (size_t)D);
            kvp_to_planes(qp + (size_t)i * D, D, 8 / kaff, tmp);
        }
    memset(acc, 0, sizeof(float) * (size_t)MG * D);
    for (int i = 0; i < MG; i++) {
        mx[i] = -INFINITY;
        sum[i] = 0.0f;
    }
    /* keys any query of the task may see: [0, sink) and [lo, hi); the pages between the sink pages [0, sp) and the
     * window's first page are never read (a pool may have freed them) */
    int64_t hi = causal ? pos0 + M : kvlen, lo = window > 0 ? pos0 - window + 1 : 0;
    if (hi > kvlen) hi = kvlen;
    if (lo < 0) lo = 0;
    const int64_t sp = (sink + T - 1) / T, pw = lo / T;
    for (int64_t p = pa; p * T < hi && p < pb; p++) {
        if (p >= sp && p < pw) p = pw < pb ? pw : pb - 1; /* jump to the window's first page */
        if (p >= sp && p < pw) break;
        int64_t t0 = p * T;
        int ta = (int)(p < sp || lo <= t0 ? 0 : lo - t0), tb = (int)(hi - t0 < T ? hi - t0 : T);
        /* tile tokens [ta, tc) from the page, [tc, tb) from the raw K/V */
        int tc = (int)(cached - t0 < ta ? ta : cached - t0 < tb ? cached - t0 : tb);
        const uint8_t *base = NULL;
        const char *pf_next = NULL, *pf2_next = NULL; /* the next page's lines (and a staged page's two ahead), a */
        int64_t pf_span = 0, pf_done = 0, pf2_span = 0, pf2_done = 0; /* third fetched before each stage of this one */
        int kfmt = (int)a[H_KFMT], vfmt = (int)a[H_VFMT], staged = 0;
        int64_t koff = a[H_KOFF], voff = a[H_VOFF], ts = a[H_TOKEN_STRIDE];
        if (tc > ta) {
            if (p >= tlen) return 2;
            int64_t blk = table[p];
            if (blk < 0 || blk >= a[H_NPAGES]) return 2;
            base = pool + blk * a[H_PAGE_STRIDE] + (int64_t)h * a[H_HEAD_STRIDE];
#if defined(__F16C__)
            /* the next page's rows of this head (past the pages a window skips), or its staging slot's, fetched
             * into L2 while this one is read (pages are not adjacent). Into L2, not L1: a page of a head is 36 lines
             * (int4), more than L1 has fill buffers; asked into L1 the step's attention took 82.7 ms against 69.3
             * (docs/performance.md, "Prefetching into L2"). A third of the lines here, a third before the softmax,
             * a third before the V sums: all 36 at once stalled the task on its fill buffers (with the other changes
             * of that commit, the calls 6-12% faster: docs/performance.md, "Spreading the prefetch") */
            const int64_t pn = p + 1 >= sp && p + 1 < pw ? pw : p + 1;
            if (pn < pb && pn < tlen && pn * T < hi && table[pn] >= 0 && table[pn] < a[H_NPAGES]) {
                const int64_t ns = stage && table[pn] < a[H_SMAP_LEN] ? smap[table[pn]] : -1;
                const char *next = ns >= 0 && ns < a[H_SNSLOTS]
                                       ? (const char *)stage + ns * a[H_SSLOT_STRIDE] + (int64_t)h * a[H_SHEAD_STRIDE]
                                       : (const char *)pool + table[pn] * a[H_PAGE_STRIDE] + (int64_t)h * a[H_HEAD_STRIDE];
                const int64_t span =
                    (int64_t)T * (ns >= 0 && ns < a[H_SNSLOTS] ? a[H_STOKEN_STRIDE] : a[H_TOKEN_STRIDE]);
                pf_next = next, pf_span = span;
                kvp_pf(next, &pf_done, span / 3);
                /* a staged page (128 lines of float16 K and V at D 64) two pages ahead as well: one page of lead
                 * was not enough for it (docs/performance.md, "Prefetching into L2"); a third at each of the same
                 * three places (all 128 lines at once stalled the task: "Fewer stalls a page") */
                const int64_t p2 = pn + 1;
                if (p2 < pb && p2 < tlen && p2 * T < hi && table[p2] >= 0 && table[p2] < a[H_NPAGES] && stage &&
                    table[p2] < a[H_SMAP_LEN] && smap[table[p2]] >= 0 && smap[table[p2]] < a[H_SNSLOTS]) {
                    pf2_next =
                        (const char *)stage + smap[table[p2]] * a[H_SSLOT_STRIDE] + (int64_t)h * a[H_SHEAD_STRIDE];
                    pf2_span = (int64_t)T * a[H_STOKEN_STRIDE];
                    kvp_pf(pf2_next, &pf2_done, pf2_span / 3);
                }
            }
#endif
            int64_t slot = stage && blk < a[H_SMAP_LEN] ? smap[blk] : -1;
            if (slot >= a[H_SNSLOTS]) return 2;
            if (slot >= 0) { /* a partly filled page, staged at full precision */
                base = stage + slot * a[H_SSLOT_STRIDE] + (int64_t)h * a[H_SHEAD_STRIDE];
                kfmt = vfmt = (int)a[H_SFMT];
                staged = 1;
                koff = 0;
                voff = a[H_SVOFF];
                ts = a[H_STOKEN_STRIDE];
            }
        }
        /* scores S[i * T + t], t in [ta, tb) */
        const int kk = tc > ta ? kvp_direct(kfmt, MG, D) : -1, ka = tc > ta && !staged ? kaff : 0;
        const int k0 = kk >= 0 || ka ? tc : ta;
        if (kk >= 0) kvs_k_ggml(kk, MG, qq, D, D, base + koff + ta * ts, ts, tc - ta, S + ta, T);
#if KVP_FAST
        if (kvp_fast && ka && D % 64 == 0) {
            kvp_scales(base + koff + D * ka / 8, ts, ta, tc, ksc, kz);
            kvp_k_aff(ka, MG, qp, qsum, D, base + koff + ta * ts, ts, tc - ta, ksc + ta, kz + ta, S + ta, T);
        } else
#endif
        if (ka) {
            kvs_k_affine(ka, MG, qp, D, base + koff + ta * ts, ts, tc - ta, S + ta, T);
            for (int t = ta; t < tc; t++) { /* the token's fp16 scale and zero follow its codes */
                const uint8_t *sz = base + koff + t * ts + D * ka / 8;
                const float sc = kvp_h2f(sz), z = kvp_h2f(sz + 2);
                for (int i = 0; i < MG; i++) S[(size_t)i * T + t] = S[(size_t)i * T + t] * sc + z * qsum[i];
            }
        }
        kvp_fill(a, kfmt, koff, base, ts, knew, raw0, t0, k0, tc, tb, D, kt);
        if (tb > k0) kvs_k_tile(qq, D, MG, D, kt + (size_t)k0 * D, tb - k0, S + k0, T);
#if defined(__F16C__)
        if (pf_next) /* the middle third of the next page's lines */
            kvp_pf(pf_next, &pf_done, 2 * pf_span / 3);
        if (pf2_next) kvp_pf(pf2_next, &pf2_done, 2 * pf2_span / 3);
#endif
        /* the online softmax: per query-head, weights in S, accumulator rescaled */
        int seen = 0;
        for (int m = 0; m < M; m++) {
            const int64_t qpos = pos0 + m; /* the query sees keys [first, last) */
            const int64_t first = window > 0 ? qpos - window + 1 : 0, last = causal ? qpos + 1 : kvlen;
            int u0 = (int)(first > t0 + ta ? first - t0 : ta), u1 = (int)(last < t0 + tb ? last - t0 : tb);
            if (u0 > tb) u0 = tb; /* a sink page wholly before the query's window */
            if (u1 < u0) u1 = u0;
            /* sinks: tokens [ta, s1) of the page, as far as the query sees (its causal end); joined to [u0, u1)
             * where they meet it, else a second range */
            int s1 = (int)(sink - t0 < ta ? ta : sink - t0 < tb ? sink - t0 : tb);
            if (s1 > (int)(last - t0)) s1 = (int)(last - t0) > ta ? (int)(last - t0) : ta;
            if (s1 > ta && s1 >= u0) {
                if (u1 < s1) u1 = s1;
                u0 = ta;
                s1 = ta;
            }
            for (int g = 0; g < G; g++) {
                int i = m * G + g;
                float *w = S + (size_t)i * T;
#if KVP_FAST
                if (kvp_fast) {
                    if (u0 == u1 && s1 == ta) {
                        memset(w + ta, 0, sizeof(float) * (size_t)(tb - ta));
                        continue;
                    }
                    seen = 1;
                    const float vm = kvp_vmax(w, ta, s1, u0, u1, tb), vn = vm > mx[i] ? vm : mx[i];
                    if (vn != mx[i] && mx[i] != -INFINITY) {
                        const float corr = expf(mx[i] - vn);
                        float *ac = acc + (size_t)i * D;
                        sum[i] *= corr;
                        for (int d = 0; d < D; d++) ac[d] *= corr;
                    }
                    sum[i] += kvp_vexp(w, ta, s1, u0, u1, tb, vn);
                    mx[i] = vn;
                    continue;
                }
#endif
                for (int t = s1; t < u0; t++) w[t] = 0.0f;
                for (int t = u1; t < tb; t++) w[t] = 0.0f;
                if (u0 == u1 && s1 == ta) continue;
                seen = 1;
                float pm = -INFINITY;
                for (int t = ta; t < s1; t++) pm = w[t] > pm ? w[t] : pm;
                for (int t = u0; t < u1; t++) pm = w[t] > pm ? w[t] : pm;
                float nm = pm > mx[i] ? pm : mx[i];
                if (nm != mx[i] && mx[i] != -INFINITY) {
                    float corr = expf(mx[i] - nm), *ac = acc + (size_t)i * D;
                    sum[i] *= corr;
                    for (int d = 0; d < D; d++) ac[d] *= corr;
                }
                if (s1 > ta) sum[i] += kvs_exp_sum(w + ta, s1 - ta, nm);
                sum[i] += kvs_exp_sum(w + u0, u1 - u0, nm);
                mx[i] = nm;
            }
        }
#if defined(__F16C__)
        if (pf_next) /* and the last third */
            kvp_pf(pf_next, &pf_done, pf_span);
        if (pf2_next) kvp_pf(pf2_next, &pf2_done, pf2_span);
#endif
        if (!seen) continue;
        /* V: acc[i] += sum_t S[i, t] * V[t] */
        const int vk = tc > ta ? kvp_direct(vfmt, MG, D) : -1, va = tc > ta && !staged ? vaff : 0;
        const int v0 = vk >= 0 || va ? tc : ta;
        if (vk >= 0) kvs_v_ggml(vk, MG, S, T, base + voff, ts, ta, tc, D, acc);
#if KVP_FAST
        if (kvp_fast && va && D % 64 == 0) { /* sum_t w (c s + z) = sum_t (w s) c + sum_t w z */
            kvp_scales(base + voff + D * va / 8, ts, ta, tc, vsc, vz);
            for (int i = 0; i < MG; i++) {
                const float *w = S + (size_t)i * T;
                float *p = ws + (size_t)i * T;
                __m512 zs = _mm512_setzero_ps();
                for (int t = ta; t < tc; t += 16) {
                    const __mmask16 in = kvp_lanes(t, ta, tc, 0, 0);
                    const __m512 wt = _mm512_maskz_loadu_ps(in, w + t);
                    _mm512_mask_storeu_ps(p + t, in, _mm512_mul_ps(wt, _mm512_maskz_loadu_ps(in, vsc + t)));
                    zs = _mm512_fmadd_ps(wt, _mm512_maskz_loadu_ps(in, vz + t), zs);
                }
                zsum[i] = _mm512_reduce_add_ps(zs);
            }
            kvp_v_aff(va, MG, ws, T, base + voff, ts, ta, tc, D, zsum, acc);
        } else
#endif
        if (va) kvs_v_affine(va, MG, S, T, base + voff, ts, ta, tc, D, acc);
        kvp_fill(a, vfmt, voff, base, ts, vnew, raw0, t0, v0, tc, tb, D, vt);
        if (vaff) /* the accumulators are in plane order: so is every V tile row */
            for (int t = v0; t < tb; t++) kvp_to_planes(vt + (size_t)t * D, D, vper, tmp);
        if (tb > v0) kvs_v_tile(S + v0, T, MG, D, vt + (size_t)v0 * D, tb - v0, acc);
    }
    if (!part) kvp_finish(c, r, h, q0, M, sum, acc, vper);
    return 0;
}

/* The output rows of task (r, h, q0): acc / sum per query-head, from plane order (vper codes a byte) if vper > 1. */
static void kvp_finish(const kvp_call *c, int r, int h, int q0, int M, const float *sum, const float *acc, int vper) {
    const int64_t *a = c->a, *row = c->rows + (int64_t)r * R_FIELDS;
    const int D = c->D, G = c->G;
    float *out = (float *)(intptr_t)a[H_OUT];
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            int i = m * G + g;
            float inv = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
            float *dst = out + (row[R_QSTART] + q0 + m) * a[H_OUTS] + (int64_t)(h * G + g) * D;
            const float *ac = acc + (size_t)i * D;
            if (vper > 1) { /* plane order back to natural: element per * j + k sits at k * np + j */
                const int np = D / vper;
                for (int j = 0; j < np; j++)
                    for (int k = 0; k < vper; k++) dst[vper * j + k] = ac[k * np + j] * inv;
            } else {
                for (int d = 0; d < D; d++) dst[d] = ac[d] * inv;
            }
            if (a[H_OROT]) kvp_fwht(dst, D, (int)a[H_OROT]); /* back from the values' basis */
        }
}

/* Task (r, h, q0)'s ns splits (parts of MG x (D + 2) floats, in page order) merged, in order, and finished. */
static void kvp_merge(const kvp_call *c, int r, int h, int q0, int M, const float *parts, int ns, float *scratch) {
    const int D = c->D, MG = M * c->G;
    const size_t stride = (size_t)MG * (D + 2);
    float *sum = scratch, *acc = sum + MG;
    for (int i = 0; i < MG; i++) {
        float m = -INFINITY;
        for (int k = 0; k < ns; k++) m = parts[k * stride + i] > m ? parts[k * stride + i] : m;
        float s = 0.0f, *ac = acc + (size_t)i * D;
        memset(ac, 0, sizeof(float) * (size_t)D);
        for (int k = 0; k < ns; k++) {
            const float *pk = parts + k * stride, pm = pk[i];
            if (pm == -INFINITY) continue; /* a split no query of this head saw */
            const float w = expf(pm - m), *pa = pk + 2 * MG + (size_t)i * D;
            s += pk[MG + i] * w;
            for (int d = 0; d < D; d++) ac[d] += pa[d] * w;
        }
        sum[i] = s;
    }
    const int vaff = kvp_affine((int)c->a[H_VFMT], MG, D, c->a[H_TOKEN_STRIDE]);
    kvp_finish(c, r, h, q0, M, sum, acc, vaff ? 8 / vaff : 1);
}

/* A task of kvp_attend: (row, KV head, first query), its cost estimate and its index (the order of equals). */
typedef struct {
    int64_t cost, index, row, q0;
    int head;
    int64_t pa, pb; /* its pages (all: 0, INT64_MAX) */
    int64_t part;   /* its split's floats in the parts buffer, or -1 (not split) */
} kvp_work;

/* A task split over its pages: its parts (ns of them from part) merged when every split is done. */
typedef struct {
    int64_t row, q0, part;
    int head, ns;
} kvp_split;

static int kvp_costlier(const void *x, const void *y) {
    const kvp_work *a = x, *b = y;
    if (a->cost != b->cost) return a->cost > b->cost ? -1 : 1;
    return a->index < b->index ? -1 : a->index > b->index;
}

static int kvp_run(const kvp_call *cp, const kvp_work *task, int64_t ntasks, const kvp_split *split, int64_t nsplit,
                   float *parts, int nt);

int kvp_attend(const int64_t *a) {
    if (a[H_ABI] != KVP_ABI_VERSION) return 2;
    kvp_call c;
    c.a = a;
    c.rows = (const int64_t *)(intptr_t)a[H_ROWS];
    c.Hq = (int)a[H_HQ];
    c.Hkv = (int)a[H_HKV];
    c.D = (int)a[H_D];
    c.T = (int)a[H_T];
    double sc;
    memcpy(&sc, &a[H_SCALE], 8);
    c.scale = (float)sc;
    if (c.Hkv <= 0 || c.Hq % c.Hkv || c.D <= 0 || c.D > KVP_MAX_D || c.T <= 0 || c.T > KVP_MAX_T) return 2;
    if (a[H_KFMT] < 0 || a[H_KFMT] >= KVP_NFORMATS || a[H_VFMT] < 0 || a[H_VFMT] >= KVP_NFORMATS) return 2;
    if (!a[H_KNEW] != !a[H_VNEW] || (a[H_KNEW] && a[H_NEWS] < (int64_t)c.Hkv * c.D)) return 2;
    if (a[H_STAGE] && (!a[H_SMAP] || a[H_SFMT] < KVP_F32 || a[H_SFMT] > KVP_BF16)) return 2;
    for (int f = H_QROT; f <= H_OROT; f++) /* a rotation's block: a power of two dividing D */
        if (a[f] < 0 || a[f] > c.D || (a[f] && (a[f] & (a[f] - 1) || c.D % a[f]))) return 2;
    c.G = c.Hq / c.Hkv;
    const int64_t nrows = a[H_NROWS];
    int64_t ntasks = 0;
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t *row = c.rows + r * R_FIELDS;
        if (row[R_QLEN] < 0 || row[R_KVLEN] < row[R_QLEN]) return 2;
        ntasks += (row[R_QLEN] + KVP_QC - 1) / KVP_QC * c.Hkv;
    }
    if (ntasks == 0) return 0;
#ifdef _OPENMP
    int nt = a[H_THREADS] > 0 ? (int)a[H_THREADS] : omp_get_max_threads();
#else
    int nt = a[H_THREADS] > 0 ? (int)a[H_THREADS] : 1;
#endif
    /* A decoding row's pages (one chunk of queries) split into parts of KVP_SPLIT_PAGES or more, merged after
     * (flash-decoding's split-K): threads for a few long rows. The parts depend on the row alone (its queries and
     * the pages they see), never on the other rows or the threads, so a row's bits are the same alone as in any
     * step (an earlier rule split by the step's task count: a long row alone was summed in other parts). */
    int64_t nwork = 0, nsplit = 0, nparts = 0;
    for (int pass = 0; pass < 2; pass++) { /* count, then fill */
        kvp_work *task = pass ? malloc(sizeof(kvp_work) * (size_t)nwork) : NULL;
        kvp_split *split = pass && nsplit ? malloc(sizeof(kvp_split) * (size_t)nsplit) : NULL;
        float *parts = pass && nparts ? malloc(sizeof(float) * (size_t)nparts) : NULL;
        if (pass && (!task || (nsplit && !split) || (nparts && !parts))) {
            free(task), free(split), free(parts);
            return 1;
        }
        int64_t n = 0, ns = 0, np = 0;
        for (int64_t r = 0; r < nrows; r++) {
            const int64_t *row = c.rows + r * R_FIELDS;
            const int64_t qlen = row[R_QLEN], kvlen = row[R_KVLEN];
            for (int64_t q0 = 0; q0 < qlen; q0 += KVP_QC) {
                /* keys times queries, as kvp_task bounds them */
                const int64_t m = qlen - q0 < KVP_QC ? qlen - q0 : KVP_QC, pos0 = kvlen - qlen + q0;
                int64_t hi = a[H_CAUSAL] ? pos0 + m : kvlen, lo = a[H_WINDOW] > 0 ? pos0 - a[H_WINDOW] + 1 : 0;
                hi = hi > kvlen ? kvlen : hi;
                lo = lo < 0 ? 0 : lo;
                const int64_t p0 = lo / c.T, pages = hi > lo ? (hi - 1) / c.T + 1 - p0 : 0;
                /* with sinks beside a window, the first part also reads the sink pages (kvp_task jumps from them to
                 * the window's first page) */
                const int64_t sinks = a[H_WINDOW] > 0 && a[H_SINK] > 0 && lo > 0 ? a[H_SINK] : 0;
                int64_t k = qlen <= KVP_QC ? pages / KVP_SPLIT_PAGES : 1;
                k = k < 1 ? 1 : k;
                const int64_t floats = m * c.G * (c.D + 2);
                for (int h = 0; h < c.Hkv; h++) {
                    if (k > 1 && pass) split[ns] = (kvp_split){r, q0, np, h, (int)k};
                    for (int64_t j = 0; j < k; j++, n++) {
                        if (pass)
                            task[n] = (kvp_work){(hi - lo + sinks + c.T) * m / k, n, r, q0, h,
                                                 k > 1 && (j || !sinks) ? p0 + pages * j / k : 0,
                                                 k > 1 ? p0 + pages * (j + 1) / k : INT64_MAX,
                                                 k > 1 ? np + j * floats : -1};
                    }
                    if (k > 1) {
                        ns++;
                        np += k * floats;
                    }
                }
            }
        }
        if (!pass) {
            nwork = n, nsplit = ns, nparts = np;
            continue;
        }
        /* the costliest first (a prefill's last chunks see the most keys), so no thread is left with one at the end */
        qsort(task, (size_t)nwork, sizeof(kvp_work), kvp_costlier);
        int rc = kvp_run(&c, task, nwork, split, nsplit, parts, nt);
        free(task), free(split), free(parts);
        return rc;
    }
    return 0;
}

/* kvp_attend's tasks on nt threads, then the splits merged: on kvslim_linear.c's workers (kv_pool_run), each thread
 * taking the next task as it finishes one (a counter), the merges after every task is done. A task writes only its
 * own output rows or part, so the results do not depend on the threads or on which runs what. Not an OpenMP region:
 * under OMP_WAIT_POLICY=PASSIVE (kvslim's CLI default) each call had to wake a sleeping thread; the workers spin a
 * bounded while between calls, and the linear layers' calls between a step's attention calls keep them awake. */
typedef void (*kv_job_fn)(void *arg, int id, int nt);
int kv_pool_run(kv_job_fn fn, void *arg, int nt); /* csrc/kvslim_linear.c, the same library */

typedef struct {
    const kvp_call *c;
    const kvp_work *task;
    const kvp_split *split;
    float *parts;
    int64_t ntasks, nsplit;
    size_t scratch_floats;
    _Atomic int64_t next; /* the next task (merge) to take */
    _Atomic int err;
    int merging;
} kvp_job;

static void kvp_job_run(void *p, int id, int nt) {
    kvp_job *j = p;
    const kvp_call *c = j->c;
    (void)id, (void)nt;
    /* zeroed: the tiles' spare rows are read (never used) by kvs_k_tile */
    float *scratch = calloc(j->scratch_floats, sizeof(float));
    int err = 0;
    for (;;) {
        const int64_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= (j->merging ? j->nsplit : j->ntasks)) break;
        if (!scratch) {
            err |= 1;
            continue;
        }
        if (!j->merging) {
            const kvp_work *w = j->task + i;
            err |= kvp_task(c, (int)w->row, w->head, (int)w->q0, w->pa, w->pb, w->part >= 0 ? j->parts + w->part : NULL,
                            scratch);
        } else {
            const kvp_split *sp = j->split + i;
            const int64_t qlen = c->rows[sp->row * R_FIELDS + R_QLEN];
            const int M = (int)(qlen - sp->q0 < KVP_QC ? qlen - sp->q0 : KVP_QC);
            kvp_merge(c, (int)sp->row, sp->head, (int)sp->q0, M, j->parts + sp->part, sp->ns, scratch);
        }
    }
    free(scratch);
    if (err) atomic_fetch_or_explicit(&j->err, err, memory_order_relaxed);
}

static int kvp_run(const kvp_call *cp, const kvp_work *task, int64_t ntasks, const kvp_split *split, int64_t nsplit,
                   float *parts, int nt) {
    kvp_job j = {.c = cp, .task = task, .split = split, .parts = parts, .ntasks = ntasks, .nsplit = nsplit,
                 .scratch_floats = kvp_scratch(cp->T, cp->D, KVP_QC * cp->G), .merging = 0};
    atomic_init(&j.next, 0);
    atomic_init(&j.err, 0);
    kv_pool_run(kvp_job_run, &j, nt > ntasks ? (int)ntasks : nt);
    if (nsplit > 0) {
        j.merging = 1;
        atomic_store(&j.next, 0);
        kv_pool_run(kvp_job_run, &j, nt > nsplit ? (int)nsplit : nt);
    }
    const int err = atomic_load(&j.err);
    return err & 1 ? 1 : err ? 2 : 0;
}

/* ------------------------------------------------------------------------------------------ writes */

/* The affine page row encoder (kvslim_encode.c, the same library): codes, fp16 scale, fp16 zero. */
int kvs_encode_token_affine(int bits, const float *x, int64_t D, uint8_t *dst);

/* Whether kvp_write encodes format fmt here: f32 and bf16 values, fp8 and, with F16C (its fp16 rounding), f16
 * values, every GGML block (q8_0, q4_0, q4_1, q5_0, q5_1), sym8 and the per-token affine int4 / int3 / int2 rows. */
static int kvp_writes(int fmt) {
    if (fmt == KVP_F32 || fmt == KVP_BF16 || fmt == KVP_F8) return 1;
#if defined(__F16C__)
    return fmt == KVP_F16 || fmt == KVP_Q8_0 || fmt == KVP_Q4_0 || fmt == KVP_Q4_1 || fmt == KVP_Q5_0 ||
           fmt == KVP_Q5_1 || fmt == KVP_S8 || fmt == KVP_A4 || fmt == KVP_A3 || fmt == KVP_A2;
#else
    return 0;
#endif
}

/* Bytes of one token's D values in a kvp_writes format. */
static int64_t kvp_row_bytes(int fmt, int64_t D) {
    switch (fmt) {
    case KVP_F32: return 4 * D;
    case KVP_F16:
    case KVP_BF16: return 2 * D;
    case KVP_Q8_0: return D / 32 * 34;
    case KVP_Q4_0: return D / 32 * 18;
    case KVP_Q4_1: return D / 32 * 20;
    case KVP_Q5_0: return D / 32 * 22;
    case KVP_Q5_1: return D / 32 * 24;
    case KVP_S8: return D + 2;
    case KVP_A4: return D / 2 + 4;
    case KVP_A3: return D * 3 / 8 + 4;
    case KVP_A2: return D / 4 + 4;
    case KVP_F8: return D + 4;
    default: return 0;
    }
}

/* fp32 -> float8 e4m3fn, round to nearest even, as torch's .to(torch.float8_e4m3fn) (c10's
 * fp8e4m3fn_from_fp32_value): magnitudes from 480 up are NaN (0x7f; callers clamp to +-448 first), below 2^-6 the
 * subnormals, rounded by adding 2^14 in fp32 and keeping the low bits. */
static inline uint8_t kvp_to_e4m3(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t sign = bits & 0x80000000u, denorm = 141u << 23;
    uint8_t out;
    bits ^= sign;
    if (bits >= 1087u << 20) {
        out = 0x7f;
    } else if (bits < 121u << 23) {
        float m, dm;
        memcpy(&m, &bits, 4);
        memcpy(&dm, &denorm, 4);
        volatile float sum = m + dm; /* one fp32 rounding, as c10's */
        float s2 = sum;
        uint32_t sb;
        memcpy(&sb, &s2, 4);
        out = (uint8_t)(sb - denorm);
    } else {
        const uint32_t odd = (bits >> 20) & 1u;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + odd;
        out = (uint8_t)(bits >> 20);
    }
    return (uint8_t)(out | (sign >> 24));
}

#if defined(__F16C__)
/* fp32 -> fp16 bits, round to nearest even (torch's .to(torch.float16)). */
static inline uint16_t kvp_f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

/* A product rounded to fp32 on its own: the encoders below add to it, and a fused multiply-add (the library is
 * built with -ffp-contract=fast) would round once where torch and gguf-py round twice. */
static inline float kvp_mul(float a, float b) {
    volatile float p = a * b;
    return p;
}

/* A GGML block's 32 codes (each below 32) packed: low nibbles of elements j and j + 16 in qs[j]; with qh (q5_x),
 * bit j of the little-endian uint32 at qh the fifth bit of element j (gguf-py's np.packbits, bitorder little). */
static void kvp_pack_block(const uint8_t *restrict q, uint8_t *restrict qh, uint8_t *restrict qs) {
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)((q[j] & 15) | ((q[j + 16] & 15) << 4));
    if (qh) {
        uint32_t bits = 0;
        for (int j = 0; j < 32; j++) bits |= (uint32_t)((q[j] >> 4) & 1) << j;
        for (int j = 0; j < 4; j++) qh[j] = (uint8_t)(bits >> (8 * j));
    }
}

/* q4_1 / q5_1 (top 15 / 31) of one block v at blk: d = (max - min) / top + 0.0 (a block of zeros gets +0), stored
 * m = fp16(min) with a zero min signed as the block's last zero (quantize_ggml's _zero_min_signs), codes
 * floor((x - min) * (1 / d) + 0.5) clamped, the product rounded on its own. Returns 1 where d or m overflows fp16
 * (quantize_ggml raises there), else 0. */
static int kvp_block_min(const float *restrict v, int top, uint8_t *restrict blk) {
    float mn = v[0], mx = v[0];
    for (int j = 1; j < 32; j++) {
        mn = v[j] < mn ? v[j] : mn;
        mx = v[j] > mx ? v[j] : mx;
    }
    const float d = (mx - mn) / (float)top + 0.0f, id = d == 0.0f ? 0.0f : 1.0f / d;
    uint16_t hd = kvp_f2h(d), hm = kvp_f2h(mn);
    if ((hd & 0x7c00) == 0x7c00 || (hm & 0x7c00) == 0x7c00) return 1;
    if (mn == 0.0f) { /* the sign of the block's last zero */
        int last = 31;
        while (v[last] != 0.0f) last--;
        hm = signbit(v[last]) ? 0x8000 : 0;
    }
    memcpy(blk, &hd, 2);
    memcpy(blk + 2, &hm, 2);
    uint8_t q[32];
    for (int j = 0; j < 32; j++) {
        const float c = floorf(kvp_mul(v[j] - mn, id) + 0.5f);
        q[j] = (uint8_t)(c < 0.0f ? 0.0f : c > (float)top ? (float)top : c);
    }
    kvp_pack_block(q, top == 31 ? blk + 4 : NULL, blk + (top == 31 ? 8 : 4));
    return 0;
}
#endif

/* One token's D fp32 values x -> format fmt at dst (a kvp_writes format; finite input). The bytes of
 * formats/ggml.py's _q8_0 / _q4_0 / _q4_1 / _q5_0 / _q5_1 (gguf-py's), of kvslim/vllm/pages.py's sym8, affine and fp8
 * rows and of torch's casts, quirk for quirk. Returns 0, or 1 where the format cannot hold the token (an affine scale
 * or zero beyond fp16, a q4_1 / q5_1 block's d or min beyond fp16): the caller writes nothing, and the torch
 * encoders raise their own error. */
static int kvp_encode_row(int fmt, const float *restrict x, int D, uint8_t *restrict dst) {
    if (fmt == KVP_F32) {
        memcpy(dst, x, sizeof(float) * (size_t)D);
        return 0;
    }
    if (fmt == KVP_BF16) { /* round to nearest even (c10's round_to_nearest_even; finite input) */
        for (int i = 0; i < D; i++) {
            uint32_t u;
            memcpy(&u, x + i, 4);
            const uint16_t h = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
            memcpy(dst + 2 * i, &h, 2);
        }
        return 0;
    }
    if (fmt == KVP_F8) { /* formats/floats.py: scale = max(max |x| / 448, 1e-12); codes = e4m3(clamp(x / scale)) */
        float amax = 0.0f;
        for (int i = 0; i < D; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        float sc = amax / 448.0f;
        sc = sc < 1e-12f ? 1e-12f : sc;
        for (int i = 0; i < D; i++) {
            float v = x[i] / sc;
            v = v < -448.0f ? -448.0f : v > 448.0f ? 448.0f : v;
            dst[i] = kvp_to_e4m3(v);
        }
        memcpy(dst + D, &sc, 4);
        return 0;
    }
#if defined(__F16C__)
    if (fmt == KVP_F16) {
        for (int i = 0; i < D; i++) {
            const uint16_t h = kvp_f2h(x[i]);
            memcpy(dst + 2 * i, &h, 2);
        }
        return 0;
    }
    if (fmt == KVP_A4 || fmt == KVP_A3 || fmt == KVP_A2)
        return kvs_encode_token_affine(fmt == KVP_A4 ? 4 : fmt == KVP_A3 ? 3 : 2, x, D, dst) ? 1 : 0;
    if (fmt == KVP_S8) { /* scale = fp16(max |x| / 127); code = round-half-even(x / scale), 0 when scale is 0 */
        float amax = 0.0f;
        for (int i = 0; i < D; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const uint16_t h = kvp_f2h(amax / 127.0f);
        const float sc = _cvtsh_ss(h);
        memcpy(dst, &h, 2);
        for (int i = 0; i < D; i++) {
            float q = sc > 0.0f ? nearbyintf(x[i] / sc) : 0.0f;
            q = q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q;
            dst[2 + i] = (uint8_t)(int8_t)q;
        }
        return 0;
    }
    for (int b = 0; b < D / 32; b++) {
        const float *v = x + 32 * b;
        if (fmt == KVP_Q4_1 || fmt == KVP_Q5_1) {
            if (kvp_block_min(v, fmt == KVP_Q5_1 ? 31 : 15, dst + (fmt == KVP_Q5_1 ? 24 : 20) * b)) return 1;
        } else if (fmt == KVP_Q8_0) { /* d = max |x| / 127; codes: np_roundf (half away from zero) of x * (1 / d) */
            uint8_t *blk = dst + 34 * b;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
            const float d = amax / 127.0f, id = d == 0.0f ? 0.0f : 1.0f / d;
            const uint16_t h = kvp_f2h(d);
            memcpy(blk, &h, 2);
#if defined(__AVX2__)
            /* 8 lanes, the scalar loop's operations: the product is rounded on its own (nothing adds to it), a - fl
             * and 2 x are exact, and the sign is copied from w (w = -0 gives -0, stored 0) */
            const __m256 sign = _mm256_set1_ps(-0.0f), vid = _mm256_set1_ps(id);
            for (int j = 0; j < 32; j += 8) {
                const __m256 w = _mm256_mul_ps(_mm256_loadu_ps(v + j), vid), a = _mm256_andnot_ps(sign, w);
                const __m256 fl = _mm256_floor_ps(a);
                const __m256 frac = _mm256_sub_ps(a, fl);
                const __m256 r = _mm256_add_ps(fl, _mm256_floor_ps(_mm256_add_ps(frac, frac)));
                const __m256i q = _mm256_cvttps_epi32(_mm256_or_ps(r, _mm256_and_ps(sign, w)));
                int32_t t[8];
                _mm256_storeu_si256((__m256i *)t, q);
                for (int l = 0; l < 8; l++) blk[2 + j + l] = (uint8_t)(int8_t)t[l];
            }
#else
            for (int j = 0; j < 32; j++) {
                const float w = kvp_mul(v[j], id), a = fabsf(w), fl = floorf(a);
                const float r = fl + floorf(2.0f * (a - fl));
                blk[2 + j] = (uint8_t)(int8_t)(w > 0.0f ? r : w < 0.0f ? -r : 0.0f);
            }
#endif
        } else { /* q4_0 / q5_0: d = (the element of largest magnitude, its sign, the first on ties) / -8 or -16 */
            const int five = fmt == KVP_Q5_0, top = five ? 31 : 15;
            uint8_t *blk = dst + (five ? 22 : 18) * b;
            float amax = -1.0f, mx = 0.0f;
            for (int j = 0; j < 32; j++)
                if (fabsf(v[j]) > amax) {
                    amax = fabsf(v[j]);
                    mx = v[j];
                }
            const float d = mx / (five ? -16.0f : -8.0f), id = d == 0.0f ? 0.0f : 1.0f / d;
            const uint16_t h = kvp_f2h(d);
            memcpy(blk, &h, 2);
            uint8_t q[32];
            for (int j = 0; j < 32; j++) { /* floor(x * id + 8.5 or 16.5) clamped to 0..15 or 0..31 */
                float c = floorf(kvp_mul(v[j], id) + (five ? 16.5f : 8.5f));
                q[j] = (uint8_t)(c < 0.0f ? 0.0f : c > (float)top ? (float)top : c);
            }
            kvp_pack_block(q, five ? blk + 2 : NULL, blk + (five ? 6 : 2));
        }
    }
    return 0;
#else
    return 1;
#endif
}

/* Whether fmt is a GGML block (q8_0, q4_0, q4_1, q5_0, q5_1). */
static int kvp_ggml(int fmt) {
    return fmt == KVP_Q8_0 || fmt == KVP_Q4_0 || fmt == KVP_Q4_1 || fmt == KVP_Q5_0 || fmt == KVP_Q5_1;
}

/* Below this magnitude a non-zero value in a GGML part sends the write to the torch encoders: a block's d is then
 * possibly so small that 1 / d overflows (d under ~2.9e-39). Blocks whose non-zero values all reach it keep a finite
 * 1 / d (a q4_1 / q5_1 range of two such floats is at least ~9e-38, / 31). */
#define KVP_TINY 1e-30f

/* Whether format fmt's encoder can refuse a finite token within kvp_write's range check (an affine scale or zero
 * beyond fp16, a q4_1 / q5_1 block's d or min beyond fp16): then every token is encoded before the first page byte
 * is written. */
static int kvp_may_refuse(int fmt) {
    return fmt == KVP_A4 || fmt == KVP_A3 || fmt == KVP_A2 || fmt == KVP_Q4_1 || fmt == KVP_Q5_1;
}

/* The step's tokens encoded and stored in their slots. Returns 0, 1 (out of memory: nothing written), 2 (bad
 * arguments: a slot outside the pool), 3 (a format it does not encode: nothing written), 4 (a non-finite value, an
 * fp16 scale overflowing, a token its format cannot hold, a GGML value below KVP_TINY: nothing written; the torch
 * encoders say which, or write it). Where a part's encoder can refuse a token the range check lets through (the
 * affine rows, q4_1 / q5_1), every token is encoded into a scratch buffer first and only then are the pages written;
 * the other formats encode straight into the pages. */
int kvp_write(const int64_t *a) {
    if (a[W_ABI] != KVP_ABI_VERSION) return 2;
    const int kfmt = (int)a[W_KFMT], vfmt = (int)a[W_VFMT], H = (int)a[W_H], D = (int)a[W_D];
    const int64_t n = a[W_N], T = a[W_T];
    if (!kvp_writes(kfmt) || !kvp_writes(vfmt) || D % 32) return 3;
    if (T <= 0 || H <= 0) return 2;
    const float *key = (const float *)(intptr_t)a[W_KEY], *value = (const float *)(intptr_t)a[W_VALUE];
    const int64_t *slots = (const int64_t *)(intptr_t)a[W_SLOTS];
    uint8_t *cache = (uint8_t *)(intptr_t)a[W_CACHE];
    const int64_t kb = kvp_row_bytes(kfmt, D), vb = kvp_row_bytes(vfmt, D);
    /* validate everything before the first byte is written */
    const float kmin = kvp_ggml(kfmt) ? KVP_TINY : 0.0f, vmin = kvp_ggml(vfmt) ? KVP_TINY : 0.0f;
    int64_t live = 0;
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0) continue;
        if (slots[i] / T >= a[W_NPAGES]) return 2;
        live++;
        for (int h = 0; h < H; h++) {
            const float *k = key + i * a[W_KS] + (int64_t)h * D, *v = value + i * a[W_VS] + (int64_t)h * D;
            for (int d = 0; d < D; d++) {
                /* finite, and max |x| / 127 or / 8 within fp16 (65504): torch's encoders raise */
                const float ak = fabsf(k[d]), av = fabsf(v[d]);
                if (!(ak <= 65504.0f * 8.0f) || !(av <= 65504.0f * 8.0f)) return 4;
                /* a GGML block of values this small may have 1 / d overflow to inf, where the codes are NaN and
                 * torch packs them its own way: its encoders write those */
                if ((ak < kmin && ak != 0.0f) || (av < vmin && av != 0.0f)) return 4;
            }
        }
    }
    uint8_t *buf = NULL;
    if (kvp_may_refuse(kfmt) || kvp_may_refuse(vfmt)) {
        buf = malloc((size_t)(live > 0 ? live : 1) * (size_t)H * (size_t)(kb + vb));
        if (!buf) return 1;
        int bad = 0;
        for (int64_t i = 0, j = 0; i < n && !bad; i++) {
            if (slots[i] < 0) continue;
            for (int h = 0; h < H; h++, j++) {
                uint8_t *row = buf + j * (kb + vb);
                bad |= kvp_encode_row(kfmt, key + i * a[W_KS] + (int64_t)h * D, D, row);
                bad |= kvp_encode_row(vfmt, value + i * a[W_VS] + (int64_t)h * D, D, row + kb);
            }
        }
        if (bad) {
            free(buf);
            return 4;
        }
    }
    for (int64_t i = 0, j = 0; i < n; i++) {
        if (slots[i] < 0) continue;
        const int64_t page = slots[i] / T, off = slots[i] % T;
        for (int h = 0; h < H; h++, j++) {
            uint8_t *row = cache + page * a[W_PAGE_STRIDE] + (int64_t)h * a[W_HEAD_STRIDE] + off * a[W_TOKEN_STRIDE];
            if (buf) {
                memcpy(row + a[W_KOFF], buf + j * (kb + vb), (size_t)kb);
                memcpy(row + a[W_VOFF], buf + j * (kb + vb) + kb, (size_t)vb);
            } else { /* these encoders never refuse a token the check above let through */
                kvp_encode_row(kfmt, key + i * a[W_KS] + (int64_t)h * D, D, row + a[W_KOFF]);
                kvp_encode_row(vfmt, value + i * a[W_VS] + (int64_t)h * D, D, row + a[W_VOFF]);
            }
        }
    }
    free(buf);
    return 0;
}
