/* kvslim affine encoders: KIVI's int8/int4/int3/int2 codes with fp16 scale and zero, per channel over token groups
 * (K) or per token over channel groups (V), the very bytes kvslim/formats/affine.py's quantize_per_channel /
 * quantize_per_token give (tested equal, tests/test_encode_c.py); int3 too (8 codes in 3 bytes).
 *
 * Why. A decode step's rows leave their residuals a group at a time; torch's encoder spends ~0.2 ms of op
 * dispatch a stream and layer on a few thousand values (a row's flush: ~13 ms over the embedded model's 30
 * layers, a 16-row flush step ~95 ms). Here it is a loop over the values.
 *
 * The arithmetic is the reference's, operation for operation, in fp32 (no contraction is possible: a subtraction
 * then a division):
 *   zero  = fp16(min + 0) rounded toward -inf   (a zero min is +0; round to nearest even, then one fp16 step down
 *           if it landed above)
 *   scale = fp16(max((max - zero) / levels, 1e-5f)) rounded toward +inf
 *   code  = clamp(nearbyint((x - zero) / scale), 0, levels)   (round half to even, as torch.round)
 * packed low bits first along the channels (int4: two codes a byte, int2: four, int3: eight in a 24-bit word). A non-finite input, or a scale or
 * zero beyond fp16, returns 1 and writes nothing meaningful: the caller runs the reference, which raises its own
 * error. Without F16C (the fp16 conversions) it returns -1 and the caller runs the reference.
 *
 * args (int64): role (0: K per channel, 1: V per token), bits (8, 4, 3, 2), rows (B * H), T, D, group (K: tokens
 * per group, T a multiple of it; V: channels per group, dividing D), then the pointers x (rows, T, D) fp32,
 * codes (rows, T, D * bits / 8) uint8, scale and zero fp16 (K: (rows, T / group, D); V: (rows, T, D / group)),
 * all contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>

static inline uint16_t enc_f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline float enc_h2f(uint16_t h) { return _cvtsh_ss(h); }

/* the next fp16 toward +inf (up) or -inf, as torch.nextafter on halves (a zero of either sign steps to the
 * smallest subnormal of the direction) */
static inline uint16_t enc_next(uint16_t h, int up) {
    if ((h & 0x7fff) == 0) return up ? 0x0001 : 0x8001;
    return (up != (h >> 15)) ? (uint16_t)(h + 1) : (uint16_t)(h - 1);
}

static inline int enc_finite_h(uint16_t h) { return (h & 0x7c00) != 0x7c00; }

/* scale and zero (fp16 bits) of a slice's min and max; 0 where either is not finite */
static inline int enc_params(float mn, float mx, float levels, uint16_t *scale, uint16_t *zero) {
    mn = mn + 0.0f; /* a zero min stored as +0.0 whichever sign came first, as the reference does */
    uint16_t z = enc_f2h(mn);
    if (enc_h2f(z) > mn) z = enc_next(z, 0);
    float s = (mx - enc_h2f(z)) / levels;
    if (s < 1e-5f) s = 1e-5f;
    uint16_t sh = enc_f2h(s);
    if (enc_h2f(sh) < s) sh = enc_next(sh, 1);
    *scale = sh;
    *zero = z;
    return enc_finite_h(sh) && enc_finite_h(z);
}

static inline uint8_t enc_code(float x, float zero, float scale, float levels) {
    float q = nearbyintf((x - zero) / scale);
    if (q < 0.0f) q = 0.0f;
    if (q > levels) q = levels;
    return (uint8_t)q;
}

/* min and max of n finite values (in any order: a zero's sign is made +0 after, enc_params) */
static inline void enc_minmax(const float *x, int64_t n, float *lo, float *hi) {
    int64_t c = 1;
    float l = x[0], h = x[0];
#if defined(__AVX__)
    if (n >= 8) {
        __m256 vl = _mm256_loadu_ps(x), vh = vl;
        for (c = 8; c + 8 <= n; c += 8) {
            const __m256 v = _mm256_loadu_ps(x + c);
            vl = _mm256_min_ps(vl, v);
            vh = _mm256_max_ps(vh, v);
        }
        float a[8], b[8];
        _mm256_storeu_ps(a, vl);
        _mm256_storeu_ps(b, vh);
        l = a[0], h = b[0];
        for (int j = 1; j < 8; j++) {
            l = a[j] < l ? a[j] : l;
            h = b[j] > h ? b[j] : h;
        }
    }
#endif
    for (; c < n; c++) {
        l = x[c] < l ? x[c] : l;
        h = x[c] > h ? x[c] : h;
    }
    *lo = l;
    *hi = h;
}

/* the codes of n values x with per-value zeros zf and scales sf (floats): enc_code for each, 8 at a time in AVX
 * (the same operations: a subtraction, a division, round to nearest even, a clamp) */
static inline void enc_codes(const float *x, const float *zf, const float *sf, float levels, int64_t n, uint8_t *out) {
    int64_t c = 0;
#if defined(__AVX__)
    const __m256 lo = _mm256_setzero_ps(), hi = _mm256_set1_ps(levels);
    int32_t q8[8];
    for (; c + 8 <= n; c += 8) {
        __m256 q = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + c), _mm256_loadu_ps(zf + c)), _mm256_loadu_ps(sf + c));
        q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
        _mm256_storeu_si256((__m256i *)q8, _mm256_cvtps_epi32(q));
        for (int j = 0; j < 8; j++) out[c + j] = (uint8_t)q8[j];
    }
#endif
    for (; c < n; c++) out[c] = enc_code(x[c], zf[c], sf[c], levels);
}

/* codes (n of them, n a multiple of 8 / bits) packed low bits first into out */
static inline void enc_pack(const uint8_t *codes, int64_t n, int bits, uint8_t *out) {
    if (bits == 8) {
        for (int64_t i = 0; i < n; i++) out[i] = codes[i];
    } else if (bits == 4) {
        for (int64_t i = 0; i < n / 2; i++) out[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
    } else if (bits == 3) { /* each unit of 8 codes one 24-bit word, written as its 3 little-endian bytes */
        for (int64_t i = 0; i < n / 8; i++) {
            uint32_t word = 0;
            for (int j = 0; j < 8; j++) word |= (uint32_t)codes[8 * i + j] << (3 * j);
            out[3 * i] = (uint8_t)(word & 0xff);
            out[3 * i + 1] = (uint8_t)((word >> 8) & 0xff);
            out[3 * i + 2] = (uint8_t)(word >> 16);
        }
    } else {
        for (int64_t i = 0; i < n / 4; i++)
            out[i] = (uint8_t)(codes[4 * i] | (codes[4 * i + 1] << 2) | (codes[4 * i + 2] << 4) | (codes[4 * i + 3] << 6));
    }
}

/* One token's D finite values xt, per token over groups of `group` channels (D a multiple of it, at most 4096): the
 * packed codes at codes, each group's fp16 scale and zero at scale[ci], zero[ci]. Returns 0, or 1 where a scale or
 * zero is beyond fp16 (the reference raises). */
static int enc_token(const float *xt, int64_t D, int64_t group, int bits, uint8_t *codes, uint16_t *scale,
                     uint16_t *zero) {
    const float levels = (float)((1 << bits) - 1);
    float zf[4096], sf[4096];
    uint8_t line[4096];
    for (int64_t ci = 0; ci < D / group; ci++) {
        const float *xc = xt + ci * group;
        float lo, hi;
        enc_minmax(xc, group, &lo, &hi);
        uint16_t s, z;
        if (!enc_params(lo, hi, levels, &s, &z)) return 1;
        scale[ci] = s;
        zero[ci] = z;
        const float zv = enc_h2f(z), sv = enc_h2f(s);
        for (int64_t c = 0; c < group; c++) {
            zf[ci * group + c] = zv;
            sf[ci * group + c] = sv;
        }
    }
    enc_codes(xt, zf, sf, levels, D, line);
    enc_pack(line, D, bits, codes);
    return 0;
}
#endif

/* One token's D fp32 values x as the vLLM plugin's affine page row (kvslim/vllm/pages.py: quantize_per_token with
 * one group over the whole head): the packed codes, then the fp16 scale, then the fp16 zero, at dst. The bytes of
 * kv_encode_affine's V path with group D. Returns 0; 1 (a value not finite, or a scale or zero beyond fp16: nothing
 * meaningful written, the reference raises); -1 (no F16C, or bits / D it does not take). */
int kvs_encode_token_affine(int bits, const float *x, int64_t D, uint8_t *dst) {
#if defined(__F16C__)
    if ((bits != 8 && bits != 4 && bits != 3 && bits != 2) || D < 1 || D > 4096 || (D * bits) % 8) return -1;
    for (int64_t i = 0; i < D; i++)
        if (!((x[i] - x[i]) == 0.0f)) return 1; /* an inf or a NaN */
    uint16_t s, z; /* copied after: the row's bytes need not be 2-aligned */
    if (enc_token(x, D, D, bits, dst, &s, &z)) return 1;
    const int64_t packed = D * bits / 8;
    memcpy(dst + packed, &s, 2);
    memcpy(dst + packed + 2, &z, 2);
    return 0;
#else
    (void)bits, (void)x, (void)D, (void)dst;
    return -1;
#endif
}

int kv_encode_affine(const int64_t *args) {
#if defined(__F16C__)
    const int64_t role = args[0], bits = args[1], rows = args[2], T = args[3], D = args[4], group = args[5];
    const float *x = (const float *)(intptr_t)args[6];
    uint8_t *codes = (uint8_t *)(intptr_t)args[7];
    uint16_t *scale = (uint16_t *)(intptr_t)args[8];
    uint16_t *zero = (uint16_t *)(intptr_t)args[9];
    if ((bits != 8 && bits != 4 && bits != 3 && bits != 2) || group < 1 || D < 1 || D > 4096 || (D * bits) % 8) return -1;
    if (role == 0 ? T % group : D % group) return -1;
    const float levels = (float)((1 << bits) - 1);
    const int64_t packed = D * bits / 8;
    uint8_t line[4096];
    float zf[4096], sf[4096]; /* K: each channel's min and max, then its zero and scale as floats */
    int bad = 0;
    for (int64_t i = 0; i < rows * T * D; i++) bad |= !((x[i] - x[i]) == 0.0f); /* an inf or a NaN */
    if (bad) return 1;
    if (role == 0) { /* K: per channel, over groups of `group` tokens */
        const int64_t ng = T / group;
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t gi = 0; gi < ng; gi++) {
                const float *xg = x + (r * T + gi * group) * D;
                uint16_t *sg = scale + (r * ng + gi) * D, *zg = zero + (r * ng + gi) * D;
                for (int64_t c = 0; c < D; c++) zf[c] = sf[c] = xg[c];
                for (int64_t t = 1; t < group; t++) {
                    const float *xt = xg + t * D;
                    for (int64_t c = 0; c < D; c++) {
                        zf[c] = xt[c] < zf[c] ? xt[c] : zf[c];
                        sf[c] = xt[c] > sf[c] ? xt[c] : sf[c];
                    }
                }
                for (int64_t c = 0; c < D; c++) {
                    if (!enc_params(zf[c], sf[c], levels, sg + c, zg + c)) return 1;
                    zf[c] = enc_h2f(zg[c]);
                    sf[c] = enc_h2f(sg[c]);
                }
                for (int64_t t = 0; t < group; t++) {
                    enc_codes(xg + t * D, zf, sf, levels, D, line);
                    enc_pack(line, D, (int)bits, codes + (r * T + gi * group + t) * packed);
                }
            }
        }
    } else { /* V: per token, over groups of `group` channels */
        const int64_t nc = D / group;
        for (int64_t r = 0; r < rows * T; r++)
            if (enc_token(x + r * D, D, group, (int)bits, codes + r * packed, scale + r * nc, zero + r * nc)) return 1;
    }
    return 0;
#else
    (void)args;
    return -1;
#endif
}
