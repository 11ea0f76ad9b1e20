/* gpullama's CPU kernels: quantized matmul, RMSNorm, rotary + KV write, paged attention, SwiGLU.

Built at first use by `cpu_native.py` with the machine's C compiler (-O3 -march=native -fopenmp) and called
through ctypes on float32 torch tensors. Every kernel computes each output row on its own, in an order that does
not depend on the other rows of the batch, how many there are, or how the work is split between threads: a row
gives bit-identical results alone or batched (what keeps greedy decoding the same alone and batched).

Vectors are 16 float lanes (`vf`): AVX-512, AVX2 (two halves) or plain C, picked at compile time; the lane
arithmetic and the reduction tree are the same on all three.

Matmul, y[m, n] = sum_k x[m, k] * w[n, k]: a weight row is dequantized 32 values at a time, exactly as gguf's
dequantizers do it (w = q * scale + zero, one rounding), into two vectors (k = 32g + lane and 32g + 16 + lane);
lane j of one accumulator per (m, n) sums k = j (mod 16) in increasing k with FMAs; the 16 lanes are then
summed by a fixed tree (i + 8, i + 4, i + 2, i + 1). Small batches dequantize in registers, larger ones
dequantize 4 rows into a scratch buffer once and run a register-tiled loop over the rows of x: the same values
in the same order.

Weight formats (K a multiple of 32): rows in quads of 4 (N padded with rows of zeros); a quad is one contiguous
stream of blocks, one per 32 values along K, so the weights are read front to back: a block holds the quad's
values (Q4: 16 bytes a row, value k in the low nibble of byte k, value k + 16 in its high nibble; Q8: 32 int8 a
row; F16: 32 float16; F32: 32 float), then (Q4, Q8) the 4 rows' scales, 32 / group float each, then their zeros
in the same shape when the format has them. A value is q * scale + zero.
*/

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* IEEE half -> float, exactly */
static inline float half_bits_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 1023;
    float f = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 1024), (int)e - 25);
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits |= sign;
    memcpy(&f, &bits, 4);
    return f;
}

/* ------------------------------------------------------------------------------------------------------------
   16-lane float vectors
   ------------------------------------------------------------------------------------------------------------ */

#if defined(__AVX512F__)
#define GL_ISA "avx512"
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vf_load_n(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline void vf_store_n(float *p, vf a, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), a); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_ldexp(vf a, vf n) { return _mm512_scalef_ps(a, n); } /* a * 2^n, n integral */
static inline vf vf_i8(const int8_t *q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))); }
static inline vf vf_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* 32 4-bit values: every value of the group is one of 16, q * s + z, looked up from a table */
static inline void vf_q4(const uint8_t *q, float s, float z, vf *lo, vf *hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                   _mm512_set1_ps(s), _mm512_set1_ps(z));
    *lo = _mm512_permutexvar_ps(b, table); /* vpermps reads the low 4 bits of each index */
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
/* the lane sums of a, b, c, d by the tree (i + 8), (i + 4), (i + 2), (i + 1) */
static inline void vf_reduce4(vf a, vf b, vf c, vf d, float *out) {
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
    __m512 r = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), s);
    _mm_storeu_ps(out, _mm512_castps512_ps128(r));
}
static inline float vf_hmax(vf a) { return _mm512_reduce_max_ps(a); }

#elif defined(__AVX2__) && defined(__FMA__)
#define GL_ISA "avx2"
typedef struct { __m256 a, b; } vf;
static inline vf mk(__m256 a, __m256 b) { vf r = {a, b}; return r; }
static inline vf vf_zero(void) { return mk(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf vf_set1(float a) { return mk(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
static inline vf vf_load(const float *p) { return mk(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void vf_store(float *p, vf a) { _mm256_storeu_ps(p, a.a); _mm256_storeu_ps(p + 8, a.b); }
static inline vf vf_load_n(const float *p, int n) {
    float t[16] = {0};
    memcpy(t, p, sizeof(float) * n);
    return vf_load(t);
}
static inline void vf_store_n(float *p, vf a, int n) {
    float t[16];
    vf_store(t, a);
    memcpy(p, t, sizeof(float) * n);
}
#define GL_BIN(name, op) static inline vf name(vf x, vf y) { return mk(op(x.a, y.a), op(x.b, y.b)); }
GL_BIN(vf_add, _mm256_add_ps)
GL_BIN(vf_sub, _mm256_sub_ps)
GL_BIN(vf_mul, _mm256_mul_ps)
GL_BIN(vf_div, _mm256_div_ps)
GL_BIN(vf_max, _mm256_max_ps)
GL_BIN(vf_min, _mm256_min_ps)
static inline vf vf_fma(vf x, vf y, vf z) { return mk(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)); }
static inline vf vf_round(vf x) {
    return mk(_mm256_round_ps(x.a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
              _mm256_round_ps(x.b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline __m256 ldexp8(__m256 a, __m256 n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(a, _mm256_castsi256_ps(e)); /* n in [-126, 127] here */
}
static inline vf vf_ldexp(vf a, vf n) { return mk(ldexp8(a.a, n.a), ldexp8(a.b, n.b)); }
static inline vf vf_i8(const int8_t *q) {
    __m128i b = _mm_loadu_si128((const __m128i *)q);
    return mk(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
}
static inline vf vf_f16(const uint16_t *p) {
    return mk(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
}
static inline void vf_q4(const uint8_t *q, float s, float z, vf *lo, vf *hi) {
    __m128i b = _mm_loadu_si128((const __m128i *)q);
    __m256i b0 = _mm256_cvtepu8_epi32(b), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    __m256i m = _mm256_set1_epi32(15);
    __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
    *lo = mk(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, m)), sv, zv),
             _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, m)), sv, zv));
    *hi = mk(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), sv, zv),
             _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), sv, zv));
}
static inline float hsum1(vf v) {
    __m256 s = _mm256_add_ps(v.a, v.b);                                     /* i + 8 */
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)); /* i + 4 */
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));                                 /* i + 2 */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));                /* i + 1 */
}
static inline void vf_reduce4(vf a, vf b, vf c, vf d, float *out) {
    out[0] = hsum1(a), out[1] = hsum1(b), out[2] = hsum1(c), out[3] = hsum1(d);
}
static inline float vf_hmax(vf v) {
    __m256 s = _mm256_max_ps(v.a, v.b);
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

#else
#define GL_ISA "generic"
typedef struct { float v[16]; } vf;
#define GL_LANES(expr) { vf r; for (int i = 0; i < 16; i++) r.v[i] = (expr); return r; }
static inline vf vf_zero(void) GL_LANES(0.0f)
static inline vf vf_set1(float a) GL_LANES(a)
static inline vf vf_load(const float *p) GL_LANES(p[i])
static inline void vf_store(float *p, vf a) { memcpy(p, a.v, sizeof(a.v)); }
static inline vf vf_load_n(const float *p, int n) GL_LANES(i < n ? p[i] : 0.0f)
static inline void vf_store_n(float *p, vf a, int n) { memcpy(p, a.v, sizeof(float) * n); }
static inline vf vf_add(vf a, vf b) GL_LANES(a.v[i] + b.v[i])
static inline vf vf_sub(vf a, vf b) GL_LANES(a.v[i] - b.v[i])
static inline vf vf_mul(vf a, vf b) GL_LANES(a.v[i] * b.v[i])
static inline vf vf_div(vf a, vf b) GL_LANES(a.v[i] / b.v[i])
static inline vf vf_max(vf a, vf b) GL_LANES(a.v[i] > b.v[i] ? a.v[i] : b.v[i])
static inline vf vf_min(vf a, vf b) GL_LANES(a.v[i] < b.v[i] ? a.v[i] : b.v[i])
static inline vf vf_fma(vf a, vf b, vf c) GL_LANES(fmaf(a.v[i], b.v[i], c.v[i]))
static inline vf vf_round(vf a) GL_LANES(nearbyintf(a.v[i]))
static inline vf vf_ldexp(vf a, vf n) GL_LANES(ldexpf(a.v[i], (int)n.v[i]))
static inline vf vf_i8(const int8_t *q) GL_LANES((float)q[i])
static inline vf vf_f16(const uint16_t *p) GL_LANES(half_bits_to_float(p[i]))
static inline void vf_q4(const uint8_t *q, float s, float z, vf *lo, vf *hi) {
    for (int i = 0; i < 16; i++) {
        lo->v[i] = fmaf((float)(q[i] & 15), s, z);
        hi->v[i] = fmaf((float)(q[i] >> 4), s, z);
    }
}
static inline float hsum1(vf a) {
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = a.v[i] + a.v[i + 8];
    for (int i = 0; i < 4; i++) t[i] = t[i] + t[i + 4];
    for (int i = 0; i < 2; i++) t[i] = t[i] + t[i + 2];
    return t[0] + t[1];
}
static inline void vf_reduce4(vf a, vf b, vf c, vf d, float *out) {
    out[0] = hsum1(a), out[1] = hsum1(b), out[2] = hsum1(c), out[3] = hsum1(d);
}
static inline float vf_hmax(vf a) {
    float m = a.v[0];
    for (int i = 1; i < 16; i++) m = a.v[i] > m ? a.v[i] : m;
    return m;
}
#endif

static inline float vf_hsum(vf a) {
    float out[4];
    vf z = vf_zero();
    vf_reduce4(a, z, z, z, out);
    return out[0];
}

/* e^x, within 2 ulp on [-87, 88] (Cephes' polynomial); clamped outside */
static inline vf vf_exp(vf x) {
    x = vf_min(vf_max(x, vf_set1(-87.0f)), vf_set1(88.0f));
    vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fma(n, vf_set1(-0.693359375f), x);
    r = vf_fma(n, vf_set1(2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fma(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fma(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fma(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fma(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fma(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fma(p, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    return vf_ldexp(p, n);
}

const char *gl_isa(void) { return GL_ISA; }

/* ------------------------------------------------------------------------------------------------------------
   matmul
   ------------------------------------------------------------------------------------------------------------ */

#define GL_MAX_HEAD_DIM 256 /* attention: D a multiple of 16, at most this */

enum { FMT_Q4 = 0, FMT_Q8 = 1, FMT_F16 = 2, FMT_F32 = 3 };

typedef struct {
    int group, has_zero, half_scales; /* group: values per scale (Q4: 32; Q8: 16 or 32); scales float16 or float */
    int64_t K, block_bytes;           /* block_bytes: one block of 4 rows x 32 values */
    const uint8_t *data;
} weight_t;

/* bytes of one block (4 rows x 32 values) of a format; see the layout at the top of the file */
int64_t gl_block_bytes(int fmt, int group, int has_zero, int half_scales) {
    int64_t values = fmt == FMT_Q4 ? 16 : fmt == FMT_Q8 ? 32 : fmt == FMT_F16 ? 64 : 128;
    int64_t scales = fmt == FMT_Q4 || fmt == FMT_Q8 ? 32 / group : 0;
    return 4 * values + 4 * scales * (half_scales ? 2 : 4) * (1 + has_zero);
}

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return half_bits_to_float(h);
#endif
}

/* the i-th scale of a block's scale array at p (float16 or float) */
static inline float scale_at(const weight_t *w, const uint8_t *p, int i) {
    return w->half_scales ? f16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* values 32g .. 32g + 31 of row r (0..3) of the block at b */
static inline __attribute__((always_inline)) void deq32(int fmt, const weight_t *w, const uint8_t *b, int r, vf *lo,
                                                        vf *hi) {
    switch (fmt) {
    case FMT_Q4: {
        const uint8_t *s = b + 64, *z = s + 4 * (w->half_scales ? 2 : 4);
        vf_q4(b + 16 * r, scale_at(w, s, r), w->has_zero ? scale_at(w, z, r) : 0.0f, lo, hi);
        break;
    }
    case FMT_Q8: {
        int ns = 32 / w->group;
        const uint8_t *s = b + 128, *z = s + 4 * ns * (w->half_scales ? 2 : 4);
        const int8_t *q = (const int8_t *)(b + 32 * r);
        int i = r * ns, j = r * ns + ns - 1;
        *lo = vf_fma(vf_i8(q), vf_set1(scale_at(w, s, i)), vf_set1(w->has_zero ? scale_at(w, z, i) : 0.0f));
        *hi = vf_fma(vf_i8(q + 16), vf_set1(scale_at(w, s, j)), vf_set1(w->has_zero ? scale_at(w, z, j) : 0.0f));
        break;
    }
    case FMT_F16: {
        const uint16_t *p = (const uint16_t *)(b + 64 * r);
        *lo = vf_f16(p), *hi = vf_f16(p + 16);
        break;
    }
    default: {
        const float *p = (const float *)(b + 128 * r);
        *lo = vf_load(p), *hi = vf_load(p + 16);
    }
    }
}

#define PREFETCH_BYTES 1024 /* how far ahead of the weight stream to prefetch */

/* the 4 rows of quad `quad` against mt <= 4 rows of x, dequantizing in registers */
static inline __attribute__((always_inline)) void mm_regs(int fmt, const weight_t *w, const float *x, int64_t ldx,
                                                          int mt, int64_t quad, float *y, int64_t ldy) {
    int64_t G = w->K / 32;
    const uint8_t *b = w->data + quad * G * w->block_bytes;
    vf acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int r = 0; r < 4; r++) acc[i][r] = vf_zero();
    for (int64_t g = 0; g < G; g++, b += w->block_bytes) {
        __builtin_prefetch(b + PREFETCH_BYTES);
        vf lo[4], hi[4];
        for (int r = 0; r < 4; r++) deq32(fmt, w, b, r, &lo[r], &hi[r]);
        for (int i = 0; i < mt; i++) {
            vf xl = vf_load(x + i * ldx + 32 * g), xh = vf_load(x + i * ldx + 32 * g + 16);
            for (int r = 0; r < 4; r++) {
                acc[i][r] = vf_fma(lo[r], xl, acc[i][r]);
                acc[i][r] = vf_fma(hi[r], xh, acc[i][r]);
            }
        }
    }
    for (int i = 0; i < mt; i++) vf_reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], y + i * ldy + 4 * quad);
}

#define MT 5 /* rows of x per tile of the scratch loop */
#define SB 8 /* quads dequantized into the scratch at a time */

/* the 4 rows of quad `quad`, dequantized into scr [4][K], against mt <= MT rows of x */
static inline __attribute__((always_inline)) void mm_tile(const float *scr, int64_t K, const float *x, int64_t ldx,
                                                          int mt, int64_t quad, float *y, int64_t ldy) {
    vf acc[MT][4];
    for (int i = 0; i < MT; i++)
        for (int r = 0; r < 4; r++) acc[i][r] = vf_zero();
    for (int64_t k = 0; k < K; k += 16) {
        vf wv[4];
        for (int r = 0; r < 4; r++) wv[r] = vf_load(scr + r * K + k);
        for (int i = 0; i < mt; i++) {
            vf xv = vf_load(x + i * ldx + k);
            for (int r = 0; r < 4; r++) acc[i][r] = vf_fma(wv[r], xv, acc[i][r]);
        }
    }
    for (int i = 0; i < mt; i++) vf_reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], y + i * ldy + 4 * quad);
}

static inline __attribute__((always_inline)) void mm_small(int fmt, const weight_t *w, const float *x, int64_t ldx,
                                                           int64_t M, int64_t quad, float *y, int64_t ldy) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) mm_regs(fmt, w, x + m * ldx, ldx, 4, quad, y + m * ldy, ldy);
    switch (M - m) {
    case 1: mm_regs(fmt, w, x + m * ldx, ldx, 1, quad, y + m * ldy, ldy); break;
    case 2: mm_regs(fmt, w, x + m * ldx, ldx, 2, quad, y + m * ldy, ldy); break;
    case 3: mm_regs(fmt, w, x + m * ldx, ldx, 3, quad, y + m * ldy, ldy); break;
    }
}

/* quads quad .. quad + nq - 1 through the scratch buffer scr [4 * nq][K] */
static inline __attribute__((always_inline)) void mm_scratch(int fmt, const weight_t *w, const float *x,
                                                             int64_t ldx, int64_t M, int64_t quad, int64_t nq,
                                                             float *scr, float *y, int64_t ldy) {
    int64_t K = w->K, G = K / 32;
    for (int64_t j = 0; j < nq; j++) {
        const uint8_t *b = w->data + (quad + j) * G * w->block_bytes;
        for (int64_t g = 0; g < G; g++, b += w->block_bytes)
            for (int r = 0; r < 4; r++) {
                vf lo, hi;
                deq32(fmt, w, b, r, &lo, &hi);
                vf_store(scr + (4 * j + r) * K + 32 * g, lo);
                vf_store(scr + (4 * j + r) * K + 32 * g + 16, hi);
            }
    }
    for (int64_t m = 0; m < M; m += MT) {
        int64_t mt = M - m < MT ? M - m : MT;
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        for (int64_t j = 0; j < nq; j++) {
            const float *s = scr + 4 * j * K;
            switch (mt) {
            case 1: mm_tile(s, K, xm, ldx, 1, quad + j, ym, ldy); break;
            case 2: mm_tile(s, K, xm, ldx, 2, quad + j, ym, ldy); break;
            case 3: mm_tile(s, K, xm, ldx, 3, quad + j, ym, ldy); break;
            case 4: mm_tile(s, K, xm, ldx, 4, quad + j, ym, ldy); break;
            default: mm_tile(s, K, xm, ldx, MT, quad + j, ym, ldy); break;
            }
        }
    }
}

/* quads q0 .. q1 - 1 of one format: small batches in registers, larger ones through a scratch buffer */
static inline __attribute__((always_inline)) void mm_quads(int fmt, const weight_t *w, const float *x, int64_t ldx,
                                                           int64_t M, int64_t q0, int64_t q1, int scratch, float *y,
                                                           int64_t ldy) {
    if (scratch) {
        float *scr = aligned_alloc(64, sizeof(float) * 4 * SB * w->K);
        for (int64_t q = q0; q < q1; q += SB) mm_scratch(fmt, w, x, ldx, M, q, q1 - q < SB ? q1 - q : SB, scr, y, ldy);
        free(scr);
    } else {
        for (int64_t q = q0; q < q1; q++) mm_small(fmt, w, x, ldx, M, q, y, ldy);
    }
}

static void mm_quads_q4(const weight_t *w, const float *x, int64_t ldx, int64_t M, int64_t q0, int64_t q1,
                        int scratch, float *y, int64_t ldy) { mm_quads(FMT_Q4, w, x, ldx, M, q0, q1, scratch, y, ldy); }
static void mm_quads_q8(const weight_t *w, const float *x, int64_t ldx, int64_t M, int64_t q0, int64_t q1,
                        int scratch, float *y, int64_t ldy) { mm_quads(FMT_Q8, w, x, ldx, M, q0, q1, scratch, y, ldy); }
static void mm_quads_f16(const weight_t *w, const float *x, int64_t ldx, int64_t M, int64_t q0, int64_t q1,
                         int scratch, float *y, int64_t ldy) { mm_quads(FMT_F16, w, x, ldx, M, q0, q1, scratch, y, ldy); }
static void mm_quads_f32(const weight_t *w, const float *x, int64_t ldx, int64_t M, int64_t q0, int64_t q1,
                         int scratch, float *y, int64_t ldy) { mm_quads(FMT_F32, w, x, ldx, M, q0, q1, scratch, y, ldy); }

/* y [M, ldy] (its first N columns) = x [M, ldx] @ W.T for W [N, K] (N a multiple of 4) in format `fmt` laid out
   in blocks (see the top of the file); batches of at least `scratch_min_m` rows go through the scratch loop. */
void gl_matmul(int fmt, int group, int has_zero, int half_scales, const float *x, int64_t M, int64_t K, int64_t ldx,
               const uint8_t *data, int64_t N, float *y, int64_t ldy, int threads, int64_t scratch_min_m) {
    weight_t w = {group, has_zero, half_scales, K, gl_block_bytes(fmt, group, has_zero, half_scales), data};
    void (*run)(const weight_t *, const float *, int64_t, int64_t, int64_t, int64_t, int, float *, int64_t) =
        fmt == FMT_Q4 ? mm_quads_q4 : fmt == FMT_Q8 ? mm_quads_q8 : fmt == FMT_F16 ? mm_quads_f16 : mm_quads_f32;
    int64_t quads = N / 4;
    int scratch = M >= scratch_min_m;
    if (quads < 2 * threads && !scratch) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        run(&w, x, ldx, M, quads * t / nt, quads * (t + 1) / nt, scratch, y, ldy);
    }
}

/* ------------------------------------------------------------------------------------------------------------
   RMSNorm (with the residual add), rotary + KV write, SwiGLU
   ------------------------------------------------------------------------------------------------------------ */

/* h [T, H] += residual (when not NULL), in place; out [T, H] = h * rsqrt(mean(h^2) + eps) * weight */
void gl_rms_norm(float *h, const float *residual, const float *weight, float eps, int64_t T, int64_t H, float *out,
                 int threads) {
#pragma omp parallel for num_threads(threads) if (T * H >= 32768)
    for (int64_t t = 0; t < T; t++) {
        float *row = h + t * H;
        const float *res = residual ? residual + t * H : NULL;
        vf ss = vf_zero();
        int64_t k = 0;
        for (; k + 16 <= H; k += 16) {
            vf v = vf_load(row + k);
            if (res) v = vf_add(v, vf_load(res + k)), vf_store(row + k, v);
            ss = vf_fma(v, v, ss);
        }
        if (k < H) {
            int n = (int)(H - k);
            vf v = vf_load_n(row + k, n);
            if (res) v = vf_add(v, vf_load_n(res + k, n)), vf_store_n(row + k, v, n);
            ss = vf_fma(v, v, ss);
        }
        vf scale = vf_set1(1.0f / sqrtf(vf_hsum(ss) / (float)H + eps));
        for (k = 0; k + 16 <= H; k += 16) vf_store(out + t * H + k, vf_mul(vf_mul(vf_load(row + k), scale), vf_load(weight + k)));
        if (k < H) {
            int n = (int)(H - k);
            vf_store_n(out + t * H + k, vf_mul(vf_mul(vf_load_n(row + k, n), scale), vf_load_n(weight + k, n)), n);
        }
    }
}

/* NeoX rotary of half-dimension `half` on one head, in place: (a, b) -> (a cos - b sin, b cos + a sin) */
static inline void rotate(float *x, const float *cs, int64_t half) {
    const float *c = cs, *s = cs + half;
    for (int64_t i = 0; i < half; i += 16) {
        int n = half - i < 16 ? (int)(half - i) : 16;
        vf a = vf_load_n(x + i, n), b = vf_load_n(x + half + i, n), cv = vf_load_n(c + i, n), sv = vf_load_n(s + i, n);
        vf_store_n(x + i, vf_sub(vf_mul(a, cv), vf_mul(b, sv)), n);
        vf_store_n(x + half + i, vf_add(vf_mul(b, cv), vf_mul(a, sv)), n);
    }
}

/* rotate q [T, Hq, D] and k [T, Hk, D] in place (row strides ldq, ldk; `cos_sin` [max_pos, D] is cos | sin of
   each half), then write k and v (row stride ldv) to the pool rows `slots` of k_cache / v_cache [rows, Hk, D] */
void gl_rope_and_cache(float *q, int64_t ldq, float *k, int64_t ldk, const float *v, int64_t ldv, int64_t T,
                       int64_t Hq, int64_t Hk, int64_t D, const float *cos_sin, const int64_t *positions,
                       const int64_t *slots, float *k_cache, float *v_cache, int threads) {
#pragma omp parallel for num_threads(threads) if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const float *cs = cos_sin + positions[t] * D;
        for (int64_t h = 0; h < Hq; h++) rotate(q + t * ldq + h * D, cs, D / 2);
        for (int64_t h = 0; h < Hk; h++) rotate(k + t * ldk + h * D, cs, D / 2);
        memcpy(k_cache + slots[t] * Hk * D, k + t * ldk, sizeof(float) * Hk * D);
        memcpy(v_cache + slots[t] * Hk * D, v + t * ldv, sizeof(float) * Hk * D);
    }
}

/* out [T, I] = silu(gate) * up for gate_up [T, 2I] (gate first) */
void gl_silu_mul(const float *gate_up, int64_t T, int64_t I, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (T * I >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i += 16) {
            int n = I - i < 16 ? (int)(I - i) : 16;
            vf gv = vf_load_n(g + i, n);
            vf s = vf_div(gv, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), gv))));
            vf_store_n(out + t * I + i, vf_mul(s, vf_load_n(u + i, n)), n);
        }
    }
}

/* ------------------------------------------------------------------------------------------------------------
   paged attention
   ------------------------------------------------------------------------------------------------------------ */

/* One query row of one head over keys 0 .. n - 1 of its sequence: scores by 16-lane dot products (D a multiple of
   16) summed by the reduction tree, an exact max, exponentials, their sum over 16 lanes in key order, then the
   weighted sum of values in key order. `rows` gives each key's pool row. */
static void attend_row(const float *q, const float *k_cache, const float *v_cache, const int64_t *rows, int64_t n,
                       int64_t Hk, int64_t hk, int64_t D, float scale, float *scores, float *out) {
    int64_t stride = Hk * D;
    for (int64_t j = 0; j < n; j += 4) {
        vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
        for (int r = 0; r < 4 && j + r < n; r++) {
            const float *kr = k_cache + rows[j + r] * stride + hk * D;
            for (int64_t d = 0; d < D; d += 16) acc[r] = vf_fma(vf_load(q + d), vf_load(kr + d), acc[r]);
        }
        float s[4];
        vf_reduce4(acc[0], acc[1], acc[2], acc[3], s);
        for (int r = 0; r < 4 && j + r < n; r++) scores[j + r] = s[r] * scale;
    }
    vf mx = vf_set1(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) mx = vf_max(mx, vf_load(scores + j));
    float m = vf_hmax(mx);
    for (; j < n; j++) m = scores[j] > m ? scores[j] : m;
    vf sum = vf_zero(), mv = vf_set1(m);
    for (j = 0; j < n; j += 16) {
        int c = n - j < 16 ? (int)(n - j) : 16;
        vf p = vf_exp(vf_sub(vf_load_n(scores + j, c), mv));
        if (c < 16) p = vf_mul(p, vf_load_n((const float[16]){1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, c));
        vf_store_n(scores + j, p, c);
        sum = vf_add(sum, p);
    }
    float inv = 1.0f / vf_hsum(sum);
    vf o[GL_MAX_HEAD_DIM / 16];
    for (int64_t d = 0; d < D; d += 16) o[d / 16] = vf_zero();
    for (j = 0; j < n; j++) {
        const float *vr = v_cache + rows[j] * stride + hk * D;
        vf p = vf_set1(scores[j]);
        for (int64_t d = 0; d < D; d += 16) o[d / 16] = vf_fma(p, vf_load(vr + d), o[d / 16]);
    }
    for (int64_t d = 0; d < D; d += 16) vf_store(out + d, vf_mul(o[d / 16], vf_set1(inv)));
}

/* Causal attention of every query row over its sequence's context in the paged pool.
   q [T, Hq, D] (row stride ldq), out [T, Hq, D]; k_cache / v_cache [blocks * block_size, Hk, D];
   sequence b owns rows query_start[b] .. query_start[b + 1] - 1, its context is seq_lens[b] tokens whose pool
   blocks are block_tables[b, :] (row stride ldb); its last query row sits at position seq_lens[b] - 1. */
void gl_attention(const float *q, int64_t ldq, const float *k_cache, const float *v_cache, int64_t block_size,
                  int64_t T, int64_t Hq, int64_t Hk, int64_t D, int64_t B, const int32_t *query_start,
                  const int32_t *seq_lens, const int32_t *block_tables, int64_t ldb, float scale, float *out,
                  int threads) {
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int64_t *rows = malloc(sizeof(int64_t) * B * max_len);
    int32_t *seq_of = malloc(sizeof(int32_t) * (T > 0 ? T : 1));
    for (int64_t b = 0; b < B; b++) {
        for (int64_t j = 0; j < seq_lens[b]; j++)
            rows[b * max_len + j] = (int64_t)block_tables[b * ldb + j / block_size] * block_size + j % block_size;
        for (int64_t t = query_start[b]; t < query_start[b + 1]; t++) seq_of[t] = (int32_t)b;
    }
    int64_t units = T * Hq;
    if (units * max_len < 4096) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (max_len + 16));
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            int64_t t = u / Hq, h = u % Hq, b = seq_of[t];
            int64_t q_len = query_start[b + 1] - query_start[b];
            int64_t n = seq_lens[b] - q_len + (t - query_start[b]) + 1; /* keys this row sees */
            attend_row(q + t * ldq + h * D, k_cache, v_cache, rows + b * max_len, n, Hk, h / (Hq / Hk), D, scale,
                       scores, out + (t * Hq + h) * D);
        }
        free(scores);
    }
    free(rows);
    free(seq_of);
}
