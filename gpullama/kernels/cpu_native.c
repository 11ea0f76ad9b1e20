/* gpullama's CPU kernels: quantized matmul, embedding rows, RMSNorm, rotary + KV write, paged attention (sliding
   windows, soft caps, sinks), SwiGLU, GeGLU, the final soft cap, greedy argmax, mixture-of-experts blocks, the
   recurrent layers' scans (short convolution, gated delta rule, Mamba2's selective scan), and the repacking of GGUF
   blocks into the weight formats at load.

Built at first use by `cpu_native.py` with the machine's C compiler (-O3 -march=native -fopenmp -Wall -Wextra; it
builds without a warning under each of the flag sets `cpu_native.FLAG_SETS` tries) and called through ctypes on
float32 torch tensors. Every kernel computes each output row on its own, in an order that does not depend on the
other rows of the batch, how many there are, or how the work is split between threads: a row gives bit-identical
results alone or batched (what keeps greedy decoding the same alone and batched).

Vectors are 16 float lanes (`vf`): AVX-512, AVX2 (two halves) or plain C, picked at compile time; the lane
arithmetic and the reduction tree are the same on all three.

Matmul, y[m, n] = sum_k x[m, k] * w[n, k]. Quantized formats: each row of x is cut into groups of 32 values, each
rounded to integers Q = round(x / d), d = max |x| / 32258, held as 256 hi + lo (two int8); per group and weight
row the integer dot product of Q with the values u + offset (u unsigned, the offset the type's: see the table below)
is exact in int32 (AVX512-VNNI, AVX2 or plain C), and y accumulates (scale * d) * dot + (zero * d) * sum(Q), group
after group, 16 weight rows in the 16 lanes of one accumulator. 8-bit activations (d = max |x| / 127) on a K-quant
share one d each 256 values (llama.cpp's Q8_K), so a super-block's sub-block dots times their integer sub-scales
add up in int32 before one float step (mm_super8; the mins' sums of Q come as int16 pairs made once a row, in
quantize_rows, for every block that reads it). Float formats: FMAs value after value. Tiles of up
to 8 rows of x share each block's unpacked weights; threads split the weight rows; a row's arithmetic is the same in
any tile.

Weight formats. This is their one description: `gl_repack` writes them from GGUF blocks at load (through
`gpullama/ops/cpu_weights.py`), and the docs point here. A matrix W [N, K] is uint8 blocks [N / 16][units][unit bytes]: rows in groups of 16 (N padded with
rows of zero bytes, whose scales are 0); a group is one contiguous stream of units along K, so the weights are read
front to back. A unit covers 32 values (256 for the K-quants, their super-blocks: K a multiple of it), and holds:
- the values, 32 at a time (8 sections of 32 in a K-quant unit); the 16 rows' values of each 32 come in chunks of 4
  (chunk c of every row, then chunk c + 1):
  - 4, 5, 6 bits (Q4_0, Q4_1, Q4_K, MXFP4; Q5_0, Q5_1, Q5_K; Q6_K): 256 bytes of nibbles (byte k of a row: value k
    in the low nibble, value k + 16 in the high one), then 1 or 2 bit planes (bits 4 and 5) of 64 bytes each (the
    words unpack_values reads); MXFP4's nibbles are its E2M1 codes, read through a 16-entry table (mxfp4_u);
  - 8 bits (Q8_0): 32 bytes a row, its signed quants q;
  - F16: 32 float16, F32: 32 float, value k of the 16 rows then value k + 1;
- then the type's fields (after all 8 value sections in a K-quant unit), in the table's order, each one entry a row
  (16 entries; a K-quant's sc and mn [sub-block][row]): d, m, dmin float16; sc and mn a byte each (Q4_K, Q5_K: the
  6-bit sub-scales, 0 .. 63; Q6_K: int8); e, MXFP4's E8M0 exponent byte.
A value is (u + offset) * scale + zero, u the unsigned value held, in one rounding (an FMA), which is gguf's float32
dequantizer bit for bit: its d * q is exact in float32 for every type, as are the K-quants' d * sc and dmin * mn and
MXFP4's power of two times its doubled values (small integers). Per type, with the bytes a weight of this format and
of the GGUF file (Q4_K and Q5_K: 2-3% more, their 6-bit sub-scales held as bytes; BF16 is widened to float32):

  type   values held             offset  scale          zero        bytes/weight (file)  fields, in order
  Q4_0   4 bits                  -8      d                          0.5625 (0.5625)      d
  Q4_1   4 bits                          d              m           0.625 (0.625)        d, m
  Q5_0   4 bits + 1 plane        -16     d                          0.6875 (0.6875)      d
  Q5_1   4 bits + 1 plane                d              m           0.75 (0.75)          d, m
  Q8_0   q, as u = q + 128       -128    d                          1.0625 (1.0625)      d
  Q4_K   4 bits                          d * sc per 32  -dmin * mn  0.578 (0.5625)       sc [8][16], mn [8][16], d, dmin
  Q5_K   4 bits + 1 plane                d * sc per 32  -dmin * mn  0.703 (0.6875)       as Q4_K
  Q6_K   4 bits + 2 planes       -32     d * sc per 16              0.8203 (0.8203)      sc [16][16], d
  MXFP4  code, u = 2 value + 12  -12     2^(e - 128)                0.53125 (0.53125)    e
  F16    float16                                                    2 (2)
  F32    float32 (F32, BF16)                                        4 (4; BF16: 2)
*/

#include <math.h>
/* GL_OMP(parallel for ...) is `#pragma omp parallel for ...` in a build with OpenMP, and nothing without it (the
   kernels then run on one thread, and -Wall has no unknown pragma to warn of); a `threads` argument read only by
   these directives is marked (void) for that build. */
#define GL_PRAGMA(text) _Pragma(#text)
#ifdef _OPENMP
#include <omp.h>
#define GL_OMP(...) GL_PRAGMA(omp __VA_ARGS__)
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#define GL_OMP(...)
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
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

/* 16-lane int32 vectors: the quantized matmul's exact integer sums (the same arithmetic on every path) */
#if defined(__AVX512F__)
typedef __m512i vi;
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_set1(int32_t a) { return _mm512_set1_epi32(a); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_mul(vi a, vi b) { return _mm512_mullo_epi32(a, b); } /* the low 32 bits of each product */
static inline vi vi_i8(const int8_t *q) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)); }
static inline vi vi_of(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
static inline vf vi_float(vi a) { return _mm512_cvtepi32_ps(a); }
#elif defined(__AVX2__) /* with or without FMA (vf: AVX2, or plain C without FMA) */
typedef struct { __m256i a, b; } vi;
static inline vi vi_of(__m256i lo, __m256i hi) { vi r = {lo, hi}; return r; }
static inline vi vi_zero(void) { return vi_of(_mm256_setzero_si256(), _mm256_setzero_si256()); }
static inline vi vi_set1(int32_t a) { return vi_of(_mm256_set1_epi32(a), _mm256_set1_epi32(a)); }
static inline vi vi_add(vi x, vi y) { return vi_of(_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)); }
static inline vi vi_mul(vi x, vi y) { return vi_of(_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)); }
static inline vi vi_i8(const int8_t *q) {
    return vi_of(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)),
                 _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8))));
}
static inline vf vi_float(vi x) {
#if defined(__FMA__)
    return mk(_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b));
#else
    float f[16];
    _mm256_storeu_ps(f, _mm256_cvtepi32_ps(x.a));
    _mm256_storeu_ps(f + 8, _mm256_cvtepi32_ps(x.b));
    return vf_load(f);
#endif
}
#else
typedef struct { int32_t v[16]; } vi;
#define GL_ILANES(expr) { vi r; for (int i = 0; i < 16; i++) r.v[i] = (expr); return r; }
static inline vi vi_zero(void) GL_ILANES(0)
static inline vi vi_set1(int32_t a) GL_ILANES(a)
static inline vi vi_add(vi a, vi b) GL_ILANES((int32_t)((uint32_t)a.v[i] + (uint32_t)b.v[i]))
static inline vi vi_mul(vi a, vi b) GL_ILANES((int32_t)((uint32_t)a.v[i] * (uint32_t)b.v[i]))
static inline vi vi_i8(const int8_t *q) GL_ILANES(q[i])
#undef GL_ILANES
static inline vf vi_float(vi a) GL_LANES((float)a.v[i])
#endif

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

/* tanh x = 1 - 2 / (e^2x + 1): within a few 1e-8 of it (absolute), exactly +-1 far out */
static inline vf vf_tanh(vf x) {
    vf e = vf_exp(vf_add(x, x));
    return vf_sub(vf_set1(1.0f), vf_div(vf_set1(2.0f), vf_add(e, vf_set1(1.0f))));
}


/* a buffer of at least `bytes` for this thread, kept between calls (NULL when out of memory); each kernel keeps to
   its own slots: the matmul's two (its quantized x, its unpacked weights), the attention's 4 (attn_scratch), the MoE block's 8 (moe_scratch), the
   decoder stack's 6 (stack_scratch) */
enum { SCRATCH_MATMUL = 0, SCRATCH_ATTN = 1, SCRATCH_MOE = 5, SCRATCH_STACK = 13, SCRATCH_UNPACK = 19, SCRATCH_MAMBA = 20,
       SCRATCH_SLOTS = 22 };
static void *scratch(int which, size_t bytes) {
    static _Thread_local void *buf[SCRATCH_SLOTS];
    static _Thread_local size_t size[SCRATCH_SLOTS];
    if (size[which] < bytes) {
        free(buf[which]);
        buf[which] = malloc(bytes);
        size[which] = buf[which] ? bytes : 0;
    }
    return buf[which];
}

/* 16 E8M0 exponent bytes as the floats 2^(e - 127) / 2 (ggml's e8m0_to_fp32_half), exactly: (e - 1) << 23 as
   float bits, subnormal 0x00200000 << e for e < 2 */
static inline vf vf_e8m0_half(const uint8_t *e) {
#if defined(__AVX512F__)
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)e));
    __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(v, _mm512_set1_epi32(1)), 23);
    __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), v);
    __mmask16 small = _mm512_cmplt_epu32_mask(v, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, tiny));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 h[2];
    for (int i = 0; i < 2; i++) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(e + 8 * i)));
        __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23);
        __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), v);
        __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), v);
        h[i] = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
    }
    return mk(h[0], h[1]);
#else
    vf r;
    for (int i = 0; i < 16; i++) {
        uint32_t bits = e[i] < 2 ? 0x00200000u << e[i] : (uint32_t)(e[i] - 1) << 23;
        memcpy(&r.v[i], &bits, 4);
    }
    return r;
#endif
}

/* ------------------------------------------------------------------------------------------------------------
   matmul
   ------------------------------------------------------------------------------------------------------------ */

#define GL_MAX_HEAD_DIM 512 /* attention: D a multiple of 16, at most this */
#define HEAD_PIECE 256 /* attention: dims of a head summed in one pass (its accumulator arrays); wider heads in pieces */

/* Quantized formats (see the top of the file): each GGUF type at its own width, 4-bit low nibbles, then (5 and 6
   bits) bit planes, then the type's own scale fields. */
enum {
    FMT_F16 = 2, FMT_F32 = 3,
    FMT_Q4_0 = 4, FMT_Q4_1 = 5, FMT_Q5_0 = 6, FMT_Q5_1 = 7, FMT_Q8_0 = 8, FMT_Q4_K = 9, FMT_Q5_K = 10, FMT_Q6_K = 11,
    FMT_MXFP4 = 12
};

#define MT 8 /* rows of x per tile: a block's weights are unpacked once per tile */

static inline int fmt_quantized(int fmt) { return fmt >= FMT_Q4_0; }
/* K-quants: a unit is 16 rows x 256 values (8 sub-blocks of 32, then the super-block's fields) */
static inline int fmt_super(int fmt) { return fmt >= FMT_Q4_K && fmt <= FMT_Q6_K; }
static inline int fmt_bits(int fmt) {
    return fmt == FMT_Q4_0 || fmt == FMT_Q4_1 || fmt == FMT_Q4_K || fmt == FMT_MXFP4 ? 4
           : fmt == FMT_Q5_0 || fmt == FMT_Q5_1 || fmt == FMT_Q5_K ? 5
           : fmt == FMT_Q6_K                                       ? 6
                                                                   : 8;
}
/* bit planes above the nibbles (bits 4, 5) */
static inline int fmt_planes(int fmt) { return fmt_bits(fmt) == 5 ? 1 : fmt_bits(fmt) == 6 ? 2 : 0; }
/* bytes of 16 rows x 32 values */
static inline int fmt_vbytes(int fmt) { return fmt_bits(fmt) == 8 ? 512 : 256 + 64 * fmt_planes(fmt); }
/* the integer added to each unsigned value u before its scale: u + offset is the GGUF quant (Q8_0 bytes are read
   as u = q + 128; MXFP4's 4-bit codes as u = its doubled E2M1 value + 12, see mxfp4_u) */
static inline int fmt_offset(int fmt) {
    return fmt == FMT_Q4_0    ? -8
           : fmt == FMT_Q5_0  ? -16
           : fmt == FMT_Q6_K  ? -32
           : fmt == FMT_Q8_0  ? -128
           : fmt == FMT_MXFP4 ? -12
                              : 0;
}
/* MXFP4: a 4-bit code (sign bit 3, then the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) as u = 2 value + 12 */
static const uint8_t mxfp4_u[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
/* whether values have an added zero (a minimum) besides the scale */
static inline int fmt_has_zero(int fmt) {
    return fmt == FMT_Q4_1 || fmt == FMT_Q5_1 || fmt == FMT_Q4_K || fmt == FMT_Q5_K;
}
/* scales per 32 values */
static inline int fmt_sets(int fmt) { return fmt == FMT_Q6_K ? 2 : 1; }

/* bytes of one unit: 16 rows x 32 values (256 for the K-quants), see the layout at the top of the file */
static int64_t unit_bytes(int fmt) {
    if (fmt == FMT_F16 || fmt == FMT_F32) return 16 * 32 * (fmt == FMT_F16 ? 2 : 4);
    if (fmt == FMT_MXFP4) return fmt_vbytes(fmt) + 16; /* the 16 rows' E8M0 exponent bytes */
    if (!fmt_super(fmt)) return fmt_vbytes(fmt) + 32 * (1 + fmt_has_zero(fmt));
    return 8 * fmt_vbytes(fmt) + (fmt == FMT_Q6_K ? 256 + 32 : 256 + 64);
}

/* The 16 rows x 32 values of one value section as unsigned bytes, out[c][4 r + i] = value 4c + i of row r: the
   nibbles (byte 4r + i of chunk j, j < 4, holds value 4j + i in its low nibble and 16 + 4j + i in its high one),
   plus bit p of the little-endian word ((2j + h) * planes + p) * 2 + r / 8 of the planes (h = 1: the high
   nibbles' values) at bit 4 (r % 8) + i, as bit 4 + p: two words, one 64-bit mask of the 16 rows. */
static inline void unpack_values(int fmt, const uint8_t *v, uint8_t out[8][64]) {
    int planes = fmt_planes(fmt);
    if (fmt_bits(fmt) == 8) {
        for (int c = 0; c < 8; c++)
            for (int k = 0; k < 64; k++) out[c][k] = v[64 * c + k] ^ 0x80; /* Q8_0's q as u = q + 128 */
        return;
    }
    for (int c = 0; c < 8; c++)
        for (int row = 0; row < 16; row++)
            for (int i = 0; i < 4; i++) {
                int j = c & 3, h = c >> 2, byte = v[64 * j + 4 * row + i], u = h ? byte >> 4 : byte & 15;
                int bit = 4 * (row & 7) + i;
                for (int p = 0; p < planes; p++) {
                    const uint8_t *word = v + 256 + 4 * (((2 * j + h) * planes + p) * 2 + row / 8);
                    u |= ((word[bit >> 3] >> (bit & 7)) & 1) << (4 + p);
                }
                out[c][4 * row + i] = fmt == FMT_MXFP4 ? mxfp4_u[u] : (uint8_t)u;
            }
}

/* The 16 rows' scale and zero (zero: 0 for the types without one) of set t of sub-block j of the unit at b;
   the K-quants' d * sc and dmin * mn are exact in float32, as in gguf's dequantizers */
static inline void unit_scales(int fmt, const uint8_t *b, int j, int t, vf *scale, vf *zero) {
    int vbytes = fmt_vbytes(fmt);
    *zero = vf_zero();
    if (fmt == FMT_MXFP4) { /* one E8M0 exponent byte a row */
        *scale = vf_e8m0_half(b + vbytes);
    } else if (!fmt_super(fmt)) { /* d, then m */
        *scale = vf_f16((const uint16_t *)(b + vbytes));
        if (fmt_has_zero(fmt)) *zero = vf_f16((const uint16_t *)(b + vbytes + 32));
    } else if (fmt == FMT_Q6_K) { /* int8 scales [16 sets][16 rows], then d */
        const uint8_t *meta = b + 8 * vbytes;
        *scale = vf_mul(vf_f16((const uint16_t *)(meta + 256)), vf_i8((const int8_t *)(meta + 16 * (2 * j + t))));
    } else { /* sc [8][16], mn [8][16], d [16], dmin [16] */
        const uint8_t *meta = b + 8 * vbytes;
        const int8_t *sc = (const int8_t *)meta + 16 * j, *mn = sc + 128; /* 6-bit: 0 .. 63 as int8 */
        *scale = vf_mul(vf_f16((const uint16_t *)(meta + 256)), vf_i8(sc));
        *zero = vf_sub(vf_zero(), vf_mul(vf_f16((const uint16_t *)(meta + 288)), vf_i8(mn)));
    }
}

/* The 16 rows x 32 unsigned values of one value section, unpacked: chunk c holds, per row (lane), values
   4c .. 4c + 3. wg_dots(w, n, hi, lo, c0, c1, bias, eight, out): for each of n rows of x (n <= WG_ROWS), the 16
   weight rows' integer dot products of chunks c0 .. c1 - 1 with the values Q = 256 hi[r] + lo[r] (int8, values
   4 c0 .. 4 c1 - 1), plus bias[r], in out[r]; exact in int32. `eight`: every hi is 0 (8-bit
   activations), whose products the vector paths skip (the same sums). AVX-512 computes the n rows together; AVX2
   and plain C define wg_dot for one row, and wg_dots loops over it. */
#define WG_ROWS 4
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#undef GL_ISA
#define GL_ISA "avx512-vnni"
typedef struct { __m512i c[8]; } wg;
static inline void wg_load(int fmt, const uint8_t *b, wg *w) {
    if (fmt_bits(fmt) == 4) { /* byte k of a row: value k in its low nibble, value k + 16 in its high nibble */
        __m512i m = _mm512_set1_epi8(15);
        for (int j = 0; j < 4; j++) {
            __m512i v = _mm512_loadu_si512((const void *)(b + 64 * j));
            w->c[j] = _mm512_and_si512(v, m);
            w->c[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
        }
        if (fmt == FMT_MXFP4) { /* the codes as u, looked up in every 128-bit lane */
            __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)mxfp4_u));
            for (int c = 0; c < 8; c++) w->c[c] = _mm512_shuffle_epi8(lut, w->c[c]);
        }
    } else if (fmt_bits(fmt) == 8) {
        __m512i flip = _mm512_set1_epi8((char)0x80); /* Q8_0's q as u = q + 128 */
        for (int c = 0; c < 8; c++) w->c[c] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(b + 64 * c)), flip);
    } else { /* nibbles plus bit planes: bit p of a byte's word (rows 0-7, then rows 8-15) masks in 16 << p */
        int planes = fmt_planes(fmt);
        __m512i m = _mm512_set1_epi8(15);
        for (int j = 0; j < 4; j++) {
            __m512i v = _mm512_loadu_si512((const void *)(b + 64 * j));
            __m512i lo = _mm512_and_si512(v, m), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
            for (int h = 0; h < 2; h++)
                for (int p = 0; p < planes; p++) {
                    uint64_t rows;
                    memcpy(&rows, b + 256 + 8 * ((2 * j + h) * planes + p), 8);
                    __m512i bits = _mm512_maskz_mov_epi8((__mmask64)rows, _mm512_set1_epi8((char)(16 << p)));
                    if (h) hi = _mm512_or_si512(hi, bits);
                    else lo = _mm512_or_si512(lo, bits);
                }
            w->c[j] = lo, w->c[4 + j] = hi;
        }
    }
}
/* the n rows' 2 n accumulators (hi, and lo started at the bias) are independent chains, so the dot products
   overlap (one row's two chains alone are latency-bound: 8 dependent vpdpbusd each) */
#define GL_WG_DOTS
static inline __attribute__((always_inline)) void wg_dots(const wg *w, int n, const int8_t *const *hi,
                                                          const int8_t *const *lo, int c0, int c1,
                                                          const int32_t *bias, int eight, vi *out) {
    __m512i a[WG_ROWS], b[WG_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < n; r++) a[r] = _mm512_setzero_si512(), b[r] = _mm512_set1_epi32(bias[r]);
#pragma GCC unroll 8
    for (int c = c0; c < c1; c++)
#pragma GCC unroll 4
        for (int r = 0; r < n; r++) {
            int32_t h4, l4;
            memcpy(&h4, hi[r] + 4 * c, 4);
            memcpy(&l4, lo[r] + 4 * c, 4);
            if (!eight) a[r] = _mm512_dpbusd_epi32(a[r], w->c[c], _mm512_set1_epi32(h4)); /* hi is 0 if eight */
            b[r] = _mm512_dpbusd_epi32(b[r], w->c[c], _mm512_set1_epi32(l4));
        }
#pragma GCC unroll 4
    for (int r = 0; r < n; r++) {
        out[r] = _mm512_add_epi32(_mm512_slli_epi32(a[r], 8), b[r]); /* 256 a + b */
    }
}
#elif defined(__AVX2__)
/* AVX2. 4-bit values: each chunk's 16 rows x 4 nibbles as bytes, 8 rows a register; vpmaddubsw multiplies them by
   hi and by lo (int8) into int16 pair sums (at most 8 chunks x 2 x 15 x 128: no overflow), vpmaddwd by 1 adds a
   row's pairs, and the row's dot is 256 sum(w hi) + sum(w lo). Wider values: each chunk's values widened to int16,
   4 rows a register, times the whole integers Q = 256 hi + lo (an int16) with vpmaddwd. Both give the exact int32
   sums of the plain C path, so the same results bit for bit. */
typedef struct { __m256i c[8][4]; int q4; } wg;
/* 32 bytes: `value` where bit i of the little-endian word at p is set, else 0 */
static inline __m256i plane_bytes(const uint8_t *p, char value) {
    int32_t word;
    memcpy(&word, p, 4);
    __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(word),
                                         _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(value));
}
static inline void wg_load(int fmt, const uint8_t *b, wg *w) {
    int bits = fmt_bits(fmt), planes = fmt_planes(fmt);
    w->q4 = bits == 4 && fmt != FMT_MXFP4; /* MXFP4's u reach 24: 8 chunks of vpmaddubsw pairs could overflow */
    if (w->q4) { /* byte k of a row: value k in its low nibble, value k + 16 in its high nibble */
        __m256i m = _mm256_set1_epi8(15);
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < 2; r++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(b + 64 * j + 32 * r));
                w->c[j][r] = _mm256_and_si256(v, m);
                w->c[4 + j][r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
            }
    } else if (bits == 8) {
        __m128i flip = _mm_set1_epi8((char)0x80); /* Q8_0's q as u = q + 128 */
        for (int c = 0; c < 8; c++)
            for (int g = 0; g < 4; g++)
                w->c[c][g] = _mm256_cvtepu8_epi16(
                    _mm_xor_si128(_mm_loadu_si128((const __m128i *)(b + 64 * c + 16 * g)), flip));
    } else { /* nibbles plus bit planes (MXFP4: its codes looked up as u), widened to int16 */
        __m256i m = _mm256_set1_epi8(15);
        __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)mxfp4_u));
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < 2; r++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(b + 64 * j + 32 * r));
                __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
                const uint8_t *words = b + 256 + 4 * r; /* word ((2j + h) * planes + p) * 2 + r */
                for (int p = 0; p < planes; p++) {
                    lo = _mm256_or_si256(lo, plane_bytes(words + 8 * (2 * j * planes + p), (char)(16 << p)));
                    hi = _mm256_or_si256(hi, plane_bytes(words + 8 * ((2 * j + 1) * planes + p), (char)(16 << p)));
                }
                if (fmt == FMT_MXFP4) lo = _mm256_shuffle_epi8(lut, lo), hi = _mm256_shuffle_epi8(lut, hi);
                w->c[j][2 * r] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));
                w->c[j][2 * r + 1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
                w->c[4 + j][2 * r] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));
                w->c[4 + j][2 * r + 1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
            }
    }
}
/* the 16 rows' sums of 4 rows a register (lanes: row r's two pair sums) -> the rows in order */
static inline __m256i wg_rows(__m256i a, __m256i b) {
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xD8);
}
static inline vi wg_dot(const wg *w, const int8_t *hi, const int8_t *lo, int c0, int c1, int32_t bias, int eight) {
    __m256i r0, r1;
    if (w->q4) {
        __m256i sh0 = _mm256_setzero_si256(), sh1 = sh0, sl0 = sh0, sl1 = sh0;
        for (int c = c0; c < c1; c++) {
            int32_t h4, l4;
            memcpy(&h4, hi + 4 * c, 4);
            memcpy(&l4, lo + 4 * c, 4);
            __m256i hb = _mm256_set1_epi32(h4), lb = _mm256_set1_epi32(l4);
            if (!eight) { /* hi is 0 if eight */
                sh0 = _mm256_add_epi16(sh0, _mm256_maddubs_epi16(w->c[c][0], hb));
                sh1 = _mm256_add_epi16(sh1, _mm256_maddubs_epi16(w->c[c][1], hb));
            }
            sl0 = _mm256_add_epi16(sl0, _mm256_maddubs_epi16(w->c[c][0], lb));
            sl1 = _mm256_add_epi16(sl1, _mm256_maddubs_epi16(w->c[c][1], lb));
        }
        __m256i ones = _mm256_set1_epi16(1), h0 = _mm256_madd_epi16(sh0, ones), h1 = _mm256_madd_epi16(sh1, ones);
        r0 = _mm256_add_epi32(_mm256_slli_epi32(h0, 8), /* 256 h */
                              _mm256_madd_epi16(sl0, ones));
        r1 = _mm256_add_epi32(_mm256_slli_epi32(h1, 8),
                              _mm256_madd_epi16(sl1, ones));
    } else {
        __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                          _mm256_setzero_si256()};
        for (int c = c0; c < c1; c++) {
            int32_t h4, l4;
            memcpy(&h4, hi + 4 * c, 4);
            memcpy(&l4, lo + 4 * c, 4);
            __m128i q = _mm_add_epi16(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_cvtsi32_si128(h4)), 8),
                                      _mm_cvtepi8_epi16(_mm_cvtsi32_si128(l4)));
            __m256i qb = _mm256_set1_epi64x(_mm_cvtsi128_si64(q)); /* Q of the 4 values, for each of 4 rows */
            for (int g = 0; g < 4; g++) acc[g] = _mm256_add_epi32(acc[g], _mm256_madd_epi16(w->c[c][g], qb));
        }
        r0 = wg_rows(acc[0], acc[1]), r1 = wg_rows(acc[2], acc[3]);
    }
    __m256i bv = _mm256_set1_epi32(bias);
    return vi_of(_mm256_add_epi32(r0, bv), _mm256_add_epi32(r1, bv));
}
#else
typedef struct { uint8_t c[8][64]; } wg;
static inline void wg_load(int fmt, const uint8_t *b, wg *w) { unpack_values(fmt, b, w->c); }
static inline vi wg_dot(const wg *w, const int8_t *hi, const int8_t *lo, int c0, int c1, int32_t bias, int eight) {
    vi acc;
    (void)eight; /* hi is 0 then: the same sums */
    for (int r = 0; r < 16; r++) acc.v[r] = bias;
    for (int c = c0; c < c1; c++)
        for (int r = 0; r < 16; r++)
            for (int i = 0; i < 4; i++)
                acc.v[r] += (int32_t)w->c[c][4 * r + i] * (256 * (int32_t)hi[4 * c + i] + (int32_t)lo[4 * c + i]);
    return acc;
}
#endif

#ifndef GL_WG_DOTS
static inline __attribute__((always_inline)) void wg_dots(const wg *w, int n, const int8_t *const *hi,
                                                          const int8_t *const *lo, int c0, int c1,
                                                          const int32_t *bias, int eight, vi *out) {
    for (int r = 0; r < n; r++) out[r] = wg_dot(w, hi[r], lo[r], c0, c1, bias[r], eight);
}
#endif

typedef struct {
    int fmt;
    int64_t K, G, block_bytes; /* G: units a row (K / 32, or K / 256 for the K-quants), block_bytes: a unit's */
    const uint8_t *data;       /* [N / 16][G][block_bytes] */
} weight_t;

static inline weight_t weight_of(int fmt, int64_t K, const uint8_t *data) {
    weight_t w = {fmt, K, K / (fmt_super(fmt) ? 256 : 32), unit_bytes(fmt), data};
    return w;
}

/* The activations of a quantized matmul: each row's groups of 32 values rounded to integers Q = round(x / d),
   d = max |x| / 32258, so |Q| <= 32258 (x to 1 part in 64516 of the group's largest value); Q is held as
   256 hi + lo with hi, lo int8 (for the 8-bit dot products); s is the sum of Q over each half group. The rows come
   in tiles of MT: group g of row m is record xq_rec(m, G, g), so the records of a tile's rows lie side by side group
   after group and a tile's dot products address them at constant offsets (it spared the matmul a tangle of
   per-row pointers); rows past the last of a tile's are never read. */
typedef struct {
    int8_t *q;  /* [tiles][G][MT][64]: a record's hi [32], then its lo [32] */
    float *d;   /* [tiles][G][MT] */
    int32_t *s; /* [tiles][G][MT][2] */
    int32_t *p; /* with `super`: [tiles][G / 8][MT][4], each 256 values' 4 pair words (sum(Q) of groups 2i and 2i + 1
                   as the int16 pair (lo, hi) of word i), what mm_super8's mins take */
    int eight;  /* 8-bit activations: |Q| <= 127, every hi 0 */
    int super;  /* each 256 values' 8 groups share one d (8-bit activations for the K-quants, quantize_rows) */
} xquant_t;

#define Q_MAX 32258 /* the largest |Q| (254 * 127): |hi| <= 126 */
#define Q_MAX8 127  /* the largest |Q| of 8-bit activations (`bits` 8): hi is 0 */

static inline int64_t xq_rec(int64_t m, int64_t G, int64_t g) { return ((m / MT) * G + g) * MT + m % MT; }
/* M rows rounded up to whole tiles */
static inline int64_t xq_pad(int64_t M) { return (M + MT - 1) / MT * MT; }
/* the bytes of Mp rows (whole tiles) of K values, and the xquant_t over such a buffer */
static inline size_t xq_bytes(int64_t Mp, int64_t K) { return (size_t)(Mp * (K / 32)) * (64 + 4 + 8 + 2); }
static inline xquant_t xq_over(uint8_t *buf, int64_t Mp, int64_t K) {
    size_t n = (size_t)(Mp * (K / 32));
    xquant_t q = {(int8_t *)buf, (float *)(buf + 64 * n), (int32_t *)(buf + 68 * n), (int32_t *)(buf + 76 * n), 0, 0};
    return q;
}
/* the rows from r (a multiple of MT) of q */
static inline xquant_t xq_rows(const xquant_t *q, int64_t r, int64_t K) {
    int64_t n = r * (K / 32);
    xquant_t o = {q->q + 64 * n, q->d + n, q->s + 2 * n, q->p + 4 * r * (K / 256), q->eight, q->super};
    return o;
}

/* the largest |v| of 32 values */
static inline float group_amax(const float *v) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v)), _mm512_abs_ps(_mm512_loadu_ps(v + 16))));
#else
    float amax = 0.0f;
    for (int k = 0; k < 32; k++) {
        float a = fabsf(v[k]);
        amax = a > amax ? a : amax; /* fmaxf, without its call */
    }
    return amax;
#endif
}

/* 32 values v as Q = round(v id), clamped to +-qmax, into hi and lo (Q = 256 hi + lo); s[0], s[1]: the sums of Q
   over each 16 */
static inline void quantize_group(const float *v, float id, int32_t qmax, int8_t *hi, int8_t *lo, int32_t *s) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* the plain C below, 16 values a register: the same integers (a product and a rounding to nearest even are
       exact lane by lane; integer sums in any order) */
    __m512i lim = _mm512_set1_epi32(qmax), q[2];
    q[0] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v), _mm512_set1_ps(id)));
    q[1] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 16), _mm512_set1_ps(id)));
    for (int i = 0; i < 2; i++) {
        q[i] = _mm512_max_epi32(_mm512_min_epi32(q[i], lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
        __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q[i], _mm512_set1_epi32(128)), 8);
        _mm_storeu_si128((__m128i *)(hi + 16 * i), _mm512_cvtepi32_epi8(h));
        _mm_storeu_si128((__m128i *)(lo + 16 * i), _mm512_cvtepi32_epi8(_mm512_sub_epi32(q[i], _mm512_slli_epi32(h, 8))));
        s[i] = _mm512_reduce_add_epi32(q[i]);
    }
#else
    s[0] = s[1] = 0;
    for (int k = 0; k < 32; k++) {
        int32_t q = (int32_t)nearbyintf(v[k] * id);
        q = q > qmax ? qmax : q < -qmax ? -qmax : q;
        int32_t h = (q + 128) >> 8; /* floor((q + 128) / 256): -128 <= q - 256 h <= 127, |h| <= 126 */
        hi[k] = (int8_t)h, lo[k] = (int8_t)(q - 256 * h);
        s[k >= 16] += q;
    }
#endif
}

/* Row m of x [M, ldx] quantized into row dest[m] of xq (dest NULL: row m), to 16 bits (|Q| <= Q_MAX) or with
   `bits` 8 to 8 (|Q| <= Q_MAX8, d = max |x| / 127: each hi 0). The max is each group's of 32, or with `super`
   (8-bit activations for a K-quant, as llama.cpp's Q8_K) each 256 values': their 8 groups share one d. */
static void quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K, xquant_t *xq, const int64_t *dest,
                          int bits, int super, int threads) {
    int64_t G = K / 32, span = super ? 8 : 1; /* groups a scale */
    const int32_t qmax = bits == 8 ? Q_MAX8 : Q_MAX;
    xq->eight = bits == 8;
    xq->super = super;
    (void)threads; /* read by GL_OMP only */
    GL_OMP(parallel for num_threads(threads) if (M * K >= 65536))
    for (int64_t m = 0; m < M; m++) {
        int64_t row = dest ? dest[m] : m;
        for (int64_t g0 = 0; g0 < G; g0 += span) {
            const float *v = x + m * ldx + 32 * g0;
            float amax = 0.0f;
            for (int64_t g = 0; g < span; g++) {
                float a = group_amax(v + 32 * g);
                amax = a > amax ? a : amax;
            }
            float d = amax / (float)qmax, id = amax > 0.0f ? (float)qmax / amax : 0.0f;
            for (int64_t g = g0; g < g0 + span; g++) {
                int64_t rec = xq_rec(row, G, g);
                int8_t *hi = xq->q + 64 * rec;
                quantize_group(v + 32 * (g - g0), id, qmax, hi, hi + 32, xq->s + 2 * rec);
                xq->d[rec] = d;
            }
            if (super) { /* the pair words: each |sum(Q)| of 32 values <= 32 x 127, an int16 */
                int32_t *pw = xq->p + 4 * xq_rec(row, G / 8, g0 / 8);
                for (int i = 0; i < 4; i++) {
                    const int32_t *s0 = xq->s + 2 * xq_rec(row, G, g0 + 2 * i), *s1 = s0 + 2 * MT;
                    pw[i] = (int32_t)((uint32_t)(uint16_t)(s0[0] + s0[1]) | (uint32_t)(s1[0] + s1[1]) << 16);
                }
            }
        }
    }
}

/* the integer sub-scales of set t of sub-block j of a K-quant unit at b, one a row (Q4_K, Q5_K: 0 .. 63; Q6_K:
   int8, a set each 16 values) */
static inline vi unit_isc(int fmt, const uint8_t *b, int j, int t) {
    const int8_t *meta = (const int8_t *)(b + 8 * fmt_vbytes(fmt));
    return vi_i8(meta + 16 * (fmt == FMT_Q6_K ? 2 * j + t : j));
}
/* Q4_K's and Q5_K's mins (0 .. 63) of sub-blocks 2p and 2p + 1, as the int16 pair (lo, hi) of each row's lane */
static inline vi unit_min_pair(int fmt, const uint8_t *b, int p) {
    const int8_t *mn = (const int8_t *)(b + 8 * fmt_vbytes(fmt)) + 128 + 32 * p;
    return vi_add(vi_i8(mn), vi_mul(vi_i8(mn + 16), vi_set1(65536)));
}
/* acc + a.lo b.lo + a.hi b.hi, the lanes' int16 halves (vpdpwssd) */
static inline vi vi_dot_pairs(vi acc, vi a, vi b) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    return _mm512_dpwssd_epi32(acc, a, b);
#elif defined(__AVX512BW__) && defined(__AVX512F__)
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#elif defined(__AVX512F__)
    __m256i lo = _mm256_madd_epi16(_mm512_castsi512_si256(a), _mm512_castsi512_si256(b));
    __m256i hi = _mm256_madd_epi16(_mm512_extracti64x4_epi64(a, 1), _mm512_extracti64x4_epi64(b, 1));
    return _mm512_add_epi32(acc, vi_of(lo, hi));
#elif defined(__AVX2__)
    return vi_of(_mm256_add_epi32(acc.a, _mm256_madd_epi16(a.a, b.a)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(a.b, b.b)));
#else
    for (int i = 0; i < 16; i++)
        acc.v[i] += (int32_t)(int16_t)a.v[i] * (int16_t)b.v[i] + (a.v[i] >> 16) * (b.v[i] >> 16);
    return acc;
#endif
}

/* a group's weights unpacked, with its scales and zeros as floats (the float epilogue), or its integer sub-scales
   (and, in a K-quant unit's first 4 groups, the mins of sub-blocks 2j and 2j + 1: the integer epilogue) */
typedef struct {
    wg u;
    union {
        struct { vf scale[2], zero[2]; } f;
        struct { vi sc[2], min_pair; } i;
    };
} wgs_t;

/* the integer epilogue: 8-bit activations on a K-quant (mm_super8) */
static inline int int_epilogue(int fmt, int eight) { return eight && fmt_super(fmt); }

static inline __attribute__((always_inline)) void unpack_group(int fmt, int sets, int eight, const uint8_t *b, int j,
                                                               wgs_t *o) {
    wg_load(fmt, b + j * fmt_vbytes(fmt), &o->u);
    if (int_epilogue(fmt, eight)) {
        for (int t = 0; t < sets; t++) o->i.sc[t] = unit_isc(fmt, b, j, t);
        if (fmt_has_zero(fmt) && j < 4) o->i.min_pair = unit_min_pair(fmt, b, j);
    } else {
        for (int t = 0; t < sets; t++) unit_scales(fmt, b, j, t, &o->f.scale[t], &o->f.zero[t]);
    }
}

/* the lines 8 KiB ahead of unit b, spread evenly over its `sub` sub-blocks (a K-quant unit's scale fields too): this
   is sub-block j's share. One prefetch per group left most of a K-quant unit to the hardware prefetcher, and a whole
   unit's lines at once (36 for Q4_K) stalled the loads behind them. Into L2 (prefetcht1), not L1: an L1 prefetch
   holds one of the core's few L1 miss buffers until its line arrives: one core's Q4_K stream went from 9.0 to 11.6
   GB/s with this on a Xeon VM (docs/performance.md) */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *b, int64_t block_bytes, int j,
                                                                 int sub) {
    for (int64_t l = j * block_bytes / sub; l < (j + 1) * block_bytes / sub; l += 64)
        __builtin_prefetch(b + 8192 + l, 0, 2);
}

/* what wg_dots takes for rows m0 .. m0 + n - 1 of x in group g, set t of `sets`: each row's record (its hi and lo
   halves), and the offset's bias (offset x the sum of Q); sum and d (NULL: not wanted) that sum and the row's d */
static inline __attribute__((always_inline)) void tile_records(const xquant_t *xq, int64_t m0, int n, int64_t G,
                                                               int64_t g, int sets, int t, int offset,
                                                               const int8_t **hi, const int8_t **lo, int32_t *bias,
                                                               int32_t *sum, float *d) {
#pragma GCC unroll 4
    for (int r = 0; r < n; r++) {
        int64_t rec = xq_rec(m0 + r, G, g);
        const int32_t *s = xq->s + 2 * rec;
        int32_t q = sets == 1 ? s[0] + s[1] : s[t];
        bias[r] = offset * q;
        if (sum) sum[r] = q;
        if (d) d[r] = xq->d[rec];
        hi[r] = xq->q + 64 * rec, lo[r] = hi[r] + 32;
    }
}

/* 8-bit activations on a K-quant (xq->super: one d for each 256 values, as llama.cpp's Q8_K): per super-block and
   row of x, the 8 sub-blocks' integer dots times their integer sub-scales add up in int32, exact (at most 8 x 63 x
   31 x 127 x 32 for Q5_K, 16 x 128 x 32 x 127 x 16 for Q6_K), as do the mins times the sub-blocks' sums of Q; then
   y += dx (d sum_j sc_j dot_j - dmin sum_j mn_j sum(Q_j)): a multiply and two FMAs a super-block and row (the
   super-block's weights times its integers, then times the row's d), where mm_int takes two a group. */
static inline __attribute__((always_inline)) void mm_super8_with(int fmt, int sets, const weight_t *w,
                                                                 const xquant_t *xq, int64_t m0, int mt, int64_t rb,
                                                                 float *y, int64_t ldy, const wgs_t *pre, int64_t u0,
                                                                 int64_t u1, int has_pre) {
    int64_t G = w->K / 32;
    int vbytes = fmt_vbytes(fmt), chunks = 8 / sets, offset = fmt_offset(fmt);
    const uint8_t *b = w->data + (rb * w->G + u0) * w->block_bytes;
    vf acc[MT];
    for (int i = 0; i < mt; i++) acc[i] = u0 ? vf_load(y + (m0 + i) * ldy + 16 * rb) : vf_zero();
    if (pre) pre -= u0 * 8; /* pre[g]: group g of the matrix */
    for (int64_t unit = u0; unit < u1; unit++, b += w->block_bytes) {
        /* without pre, the unit's integer scales and mins first: their lines, at the unit's end, then load beside
           the values' instead of after them (an 8B-sized matrix at one row: Q4_K +14%, Q6_K +18%); with pre, each
           where it is used (holding them all cost a prefill 5%) */
        vi isum[MT], scs[16], pairs[4];
        for (int i = 0; i < mt; i++) isum[i] = vi_zero();
        if (!has_pre) {
            for (int j = 0; j < 8; j++)
                for (int t = 0; t < sets; t++) scs[2 * j + t] = unit_isc(fmt, b, j, t);
            if (fmt_has_zero(fmt))
                for (int p = 0; p < 4; p++) pairs[p] = unit_min_pair(fmt, b, p);
        }
        for (int j = 0; j < 8; j++) {
            int64_t g = unit * 8 + j;
            const wg *up;
            wg u;
            if (has_pre) {
                up = &pre[g].u;
            } else {
                prefetch_ahead(b, w->block_bytes, j, 8);
                wg_load(fmt, b + j * vbytes, &u);
                up = &u;
            }
#pragma GCC unroll 2
            for (int t = 0; t < sets; t++) {
                vi sc = has_pre ? pre[g].i.sc[t] : scs[2 * j + t];
#pragma GCC unroll 8
                for (int i0 = 0; i0 < mt; i0 += WG_ROWS) {
                    int n = mt - i0 < WG_ROWS ? mt - i0 : WG_ROWS;
                    const int8_t *hi[WG_ROWS], *lo[WG_ROWS];
                    int32_t bias[WG_ROWS];
                    vi dot[WG_ROWS];
                    tile_records(xq, m0 + i0, n, G, g, sets, t, offset, hi, lo, bias, NULL, NULL);
                    wg_dots(up, n, hi, lo, t * chunks, (t + 1) * chunks, bias, 1, dot);
#pragma GCC unroll 4
                    for (int r = 0; r < n; r++) isum[i0 + r] = vi_add(isum[i0 + r], vi_mul(dot[r], sc));
                }
            }
        }
        const uint8_t *meta = b + 8 * vbytes;
        vf d = vf_f16((const uint16_t *)(meta + 256));
        if (has_pre && fmt_has_zero(fmt))
            for (int p = 0; p < 4; p++) pairs[p] = pre[unit * 8 + p].i.min_pair;
        /* row m0 + i's d is dx[i], its pair words pw[4 i ..]: a tile starts at a multiple of MT (mm_blocks) */
        const float *dx = xq->d + xq_rec(m0, G, unit * 8);
        const int32_t *pw = xq->p + 4 * xq_rec(m0, G / 8, unit);
        /* -dmin; Q6_K has no dmin: its unit ends at meta + 288 */
        vf neg_dmin = fmt_has_zero(fmt) ? vf_sub(vf_zero(), vf_f16((const uint16_t *)(meta + 288))) : vf_zero();
        for (int i = 0; i < mt; i++) {
            vf t = vf_mul(vi_float(isum[i]), d);
            if (fmt_has_zero(fmt)) {
                vi msum = vi_zero();
                for (int p = 0; p < 4; p++) msum = vi_dot_pairs(msum, pairs[p], vi_set1(pw[4 * i + p]));
                t = vf_fma(vi_float(msum), neg_dmin, t);
            }
            acc[i] = vf_fma(t, vf_set1(dx[i]), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) vf_store(y + (m0 + i) * ldy + 16 * rb, acc[i]);
}
/* mm_super8_with twice, has_pre a constant in each: with `pre` tested at run time, GCC's own versioning cost a
   prefill about 5% */
static inline __attribute__((always_inline)) void mm_super8(int fmt, int sets, const weight_t *w, const xquant_t *xq,
                                                            int64_t m0, int mt, int64_t rb, float *y, int64_t ldy,
                                                            const wgs_t *pre, int64_t u0, int64_t u1) {
    if (pre) mm_super8_with(fmt, sets, w, xq, m0, mt, rb, y, ldy, pre, u0, u1, 1);
    else mm_super8_with(fmt, sets, w, xq, m0, mt, rb, y, ldy, NULL, u0, u1, 0);
}

/* rows m0 .. m0 + mt - 1 of y against the 16 weight rows of block `rb` (quantized formats): per 32 values, exact
   integer dot products dot = sum (u + offset) Q, then y += (scale * d) * dot + (zero * d) * sum(Q), one group after
   another. fmt, sets (scales per 32 values) and mt are constants at every call, so the loops unroll into
   registers. pre (NULL: unpack here): the block's groups already unpacked (mm_blocks, for more than one tile). */
static inline __attribute__((always_inline)) void mm_int(int fmt, int sets, int eight, const weight_t *w,
                                                         const xquant_t *xq, int64_t m0, int mt, int64_t rb, float *y,
                                                         int64_t ldy, const wgs_t *pre, int64_t u0, int64_t u1) {
    if (int_epilogue(fmt, eight)) {
        mm_super8(fmt, sets, w, xq, m0, mt, rb, y, ldy, pre, u0, u1);
        return;
    }
    int64_t K = w->K, G = K / 32;
    int sub = fmt_super(fmt) ? 8 : 1, vbytes = fmt_vbytes(fmt), chunks = 8 / sets, offset = fmt_offset(fmt);
    const uint8_t *b = w->data + (rb * w->G + u0) * w->block_bytes;
    vf acc[MT];
    for (int i = 0; i < mt; i++) acc[i] = u0 ? vf_load(y + (m0 + i) * ldy + 16 * rb) : vf_zero();
    if (pre) pre -= u0 * sub; /* pre[g]: group g of the matrix */
    for (int64_t unit = u0; unit < u1; unit++, b += w->block_bytes)
        for (int j = 0; j < sub; j++) {
            int64_t g = unit * sub + j; /* the group of 32 values of x */
            const wg *up;
            wg u;
            if (pre) {
                up = &pre[g].u;
            } else {
                prefetch_ahead(b, w->block_bytes, j, sub);
                wg_load(fmt, b + j * vbytes, &u);
                up = &u;
            }
#pragma GCC unroll 2
            for (int t = 0; t < sets; t++) {
                vf scale, zero;
                if (pre) scale = pre[g].f.scale[t], zero = pre[g].f.zero[t];
                else unit_scales(fmt, b, j, t, &scale, &zero);
#pragma GCC unroll 8
                for (int i0 = 0; i0 < mt; i0 += WG_ROWS) {
                    int n = mt - i0 < WG_ROWS ? mt - i0 : WG_ROWS;
                    const int8_t *hi[WG_ROWS], *lo[WG_ROWS];
                    int32_t sum[WG_ROWS], bias[WG_ROWS];
                    float d[WG_ROWS];
                    vi dot[WG_ROWS];
                    tile_records(xq, m0 + i0, n, G, g, sets, t, offset, hi, lo, bias, sum, d);
                    wg_dots(up, n, hi, lo, t * chunks, (t + 1) * chunks, bias, eight, dot);
#pragma GCC unroll 4
                    for (int r = 0; r < n; r++) {
                        vf *ac = &acc[i0 + r];
                        *ac = vf_fma(vi_float(dot[r]), vf_mul(scale, vf_set1(d[r])), *ac);
                        if (fmt_has_zero(fmt)) *ac = vf_fma(zero, vf_set1(d[r] * (float)sum[r]), *ac);
                    }
                }
            }
        }
    for (int i = 0; i < mt; i++) vf_store(y + (m0 + i) * ldy + 16 * rb, acc[i]);
}

/* the same for the float formats: y += w * x one value after another */
static inline __attribute__((always_inline)) void mm_dense(int fmt, const weight_t *w, const float *x, int64_t ldx,
                                                           int64_t m0, int mt, int64_t rb, float *y, int64_t ldy) {
    const uint8_t *b = w->data + rb * w->G * w->block_bytes;
    vf acc[MT];
    for (int i = 0; i < mt; i++) acc[i] = vf_zero();
    for (int64_t k = 0; k < w->K; k++) {
        vf v = fmt == FMT_F16 ? vf_f16((const uint16_t *)b + 16 * k) : vf_load((const float *)b + 16 * k);
        for (int i = 0; i < mt; i++) acc[i] = vf_fma(v, vf_set1(x[(m0 + i) * ldx + k]), acc[i]);
    }
    for (int i = 0; i < mt; i++) vf_store(y + (m0 + i) * ldy + 16 * rb, acc[i]);
}

/* one tile of mt rows of x (mt a constant after the switch), over units u0 .. u1 - 1 of K (quantized formats) */
static inline __attribute__((always_inline)) void mm_tile(int fmt, int sets, int eight, const weight_t *w,
                                                          const float *x,
                                                          int64_t ldx, const xquant_t *xq, int64_t m0, int mt,
                                                          int64_t rb, float *y, int64_t ldy, const wgs_t *pre,
                                                          int64_t u0, int64_t u1) {
#define GL_TILE(n)                                                                                                   \
    case n:                                                                                                          \
        if (fmt_quantized(fmt)) mm_int(fmt, sets, eight, w, xq, m0, n, rb, y, ldy, pre, u0, u1);                     \
        else mm_dense(fmt, w, x, ldx, m0, n, rb, y, ldy);                                                            \
        break;
    switch (mt) { GL_TILE(1) GL_TILE(2) GL_TILE(3) GL_TILE(4) GL_TILE(5) GL_TILE(6) GL_TILE(7) GL_TILE(8) }
#undef GL_TILE
}

/* More than one tile (a prefill): x's rows in chunks and K in slices, and each block's slice of weights unpacked
   once for the chunk's tiles. A chunk's activations of one slice (128 rows x 4096 values, 1.2 MB) stay in L2 while
   every block uses them; unchunked, each block streamed all of x from L3 or memory (17 MB at K = 14336 and 512
   rows: a third slower there). A tile's sums go through y between slices, stored and loaded back exactly, so a
   row's arithmetic is the same in any chunk, tile or slice. */
#define SLICE_GROUPS 128 /* groups of 32 values a slice of K */
#define CHUNK_ROWS 128  /* rows of x a chunk: whole tiles */

/* blocks rb0 .. rb1 - 1 against every row of x, MT rows at a time */
static inline __attribute__((always_inline)) void mm_blocks(int fmt, int sets, int eight, const weight_t *w,
                                                            const float *x,
                                                            int64_t ldx, const xquant_t *xq, int64_t M, int64_t rb0,
                                                            int64_t rb1, float *y, int64_t ldy) {
    int sub = fmt_super(fmt) ? 8 : 1;
    int64_t units = w->G;
    wgs_t *pre = NULL;
    if (fmt_quantized(fmt) && M > MT) {
        uint8_t *p = scratch(SCRATCH_UNPACK, sizeof(wgs_t) * SLICE_GROUPS + 64);
        if (p) pre = (wgs_t *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    }
    /* without pre (one tile, a float format, or no memory): one chunk of every row, one slice of all of K */
    int64_t chunk = pre ? CHUNK_ROWS : M, slice = pre ? SLICE_GROUPS / sub : units;
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
        int64_t c1 = c0 + chunk < M ? c0 + chunk : M;
        for (int64_t u0 = 0; u0 < units; u0 += slice) {
            int64_t u1 = u0 + slice < units ? u0 + slice : units;
            for (int64_t rb = rb0; rb < rb1; rb++) {
                const uint8_t *b = w->data + (rb * units + u0) * w->block_bytes;
                if (pre)
                    for (int64_t unit = u0; unit < u1; unit++)
                        for (int j = 0; j < sub; j++)
                            unpack_group(fmt, sets, eight, b + (unit - u0) * w->block_bytes, j,
                                         &pre[(unit - u0) * sub + j]);
                /* the next block's slice into L2 meanwhile, a share a tile: its lines do not follow these ones */
                int64_t bytes = (u1 - u0) * w->block_bytes, tiles = (c1 - c0 + MT - 1) / MT;
                const char *next = (const char *)b + units * w->block_bytes;
                for (int64_t m = c0, t = 0; m < c1; m += MT, t++) {
                    if (pre && rb + 1 < rb1)
                        for (int64_t l = bytes * t / tiles / 64 * 64; l < bytes * (t + 1) / tiles; l += 64)
                            __builtin_prefetch(next + l, 0, 2);
                    /* whole tiles from pre; a last part tile unpacks its own (one copy of the kernel a tile size
                       without pre, one with: half the code, and compile time, of every size both ways) */
                    if (pre && c1 - m >= MT) mm_int(fmt, sets, eight, w, xq, m, MT, rb, y, ldy, pre, u0, u1);
                    else mm_tile(fmt, sets, eight, w, x, ldx, xq, m, c1 - m < MT ? (int)(c1 - m) : MT, rb, y, ldy,
                                 NULL, u0, u1);
                }
            }
        }
    }
}

/* each quantized format twice: `eight` a constant, so the 8-bit activations' kernel carries no high-byte work */
#define GL_BLOCKS(name, fmt, sets)                                                                                  \
    static void name(const weight_t *w, const float *x, int64_t ldx, const xquant_t *xq, int64_t M, int64_t rb0,     \
                     int64_t rb1, float *y, int64_t ldy) {                                                           \
        mm_blocks(fmt, sets, 0, w, x, ldx, xq, M, rb0, rb1, y, ldy);                                                 \
    }                                                                                                                \
    static void name##_8(const weight_t *w, const float *x, int64_t ldx, const xquant_t *xq, int64_t M,              \
                         int64_t rb0, int64_t rb1, float *y, int64_t ldy) {                                          \
        mm_blocks(fmt, sets, 1, w, x, ldx, xq, M, rb0, rb1, y, ldy);                                                 \
    }
GL_BLOCKS(mm_f16, FMT_F16, 1)
GL_BLOCKS(mm_f32, FMT_F32, 1)
GL_BLOCKS(mm_q4_0, FMT_Q4_0, 1)
GL_BLOCKS(mm_q4_1, FMT_Q4_1, 1)
GL_BLOCKS(mm_q5_0, FMT_Q5_0, 1)
GL_BLOCKS(mm_q5_1, FMT_Q5_1, 1)
GL_BLOCKS(mm_q8_0, FMT_Q8_0, 1)
GL_BLOCKS(mm_q4_k, FMT_Q4_K, 1)
GL_BLOCKS(mm_q5_k, FMT_Q5_K, 1)
GL_BLOCKS(mm_q6_k, FMT_Q6_K, 2)
GL_BLOCKS(mm_mxfp4, FMT_MXFP4, 1)

typedef void (*blocks_fn)(const weight_t *, const float *, int64_t, const xquant_t *, int64_t, int64_t, int64_t,
                          float *, int64_t);

/* the kernel of format `fmt`, for x quantized as `xq` says (8-bit activations: the `_8` variant) */
static blocks_fn blocks_for(int fmt, const xquant_t *xq) {
    int eight = xq && xq->eight;
    switch (fmt) {
    case FMT_F16: return eight ? mm_f16_8 : mm_f16; /* the same kernel: floats have no activation bits */
    case FMT_Q4_0: return eight ? mm_q4_0_8 : mm_q4_0;
    case FMT_Q4_1: return eight ? mm_q4_1_8 : mm_q4_1;
    case FMT_Q5_0: return eight ? mm_q5_0_8 : mm_q5_0;
    case FMT_Q5_1: return eight ? mm_q5_1_8 : mm_q5_1;
    case FMT_Q8_0: return eight ? mm_q8_0_8 : mm_q8_0;
    case FMT_Q4_K: return eight ? mm_q4_k_8 : mm_q4_k;
    case FMT_Q5_K: return eight ? mm_q5_k_8 : mm_q5_k;
    case FMT_Q6_K: return eight ? mm_q6_k_8 : mm_q6_k;
    case FMT_MXFP4: return eight ? mm_mxfp4_8 : mm_mxfp4;
    default: return eight ? mm_f32_8 : mm_f32;
    }
}

static int64_t matmul_bytes; /* weight bytes gl_matmul has read, for benchmarks */

/* the weight bytes gl_matmul has read so far (every block of each matrix, once per call) */
int64_t gl_matmul_bytes_read(void) { return matmul_bytes; }

/* whether `fmt`'s activations at `bits` share a d each 256 values (quantize_rows' `super`) */
static inline int xq_super_for(int fmt, int bits) { return bits == 8 && fmt_super(fmt); }

/* x quantized (to `bits`, 16 or 8) for the quantized formats into the matmul's scratch (xq->q NULL for the float
   ones); -1: no memory */
static int matmul_quantize(int fmt, const float *x, int64_t M, int64_t K, int64_t ldx, xquant_t *xq, int bits,
                           int threads) {
    xquant_t none = {NULL, NULL, NULL, NULL, 0, 0};
    *xq = none;
    if (!fmt_quantized(fmt)) return 0;
    uint8_t *buf = scratch(SCRATCH_MATMUL, xq_bytes(xq_pad(M), K));
    if (!buf) return -1;
    *xq = xq_over(buf, xq_pad(M), K);
    quantize_rows(x, ldx, M, K, xq, NULL, bits, xq_super_for(fmt, bits), threads);
    return 0;
}

/* gl_matmul with x already quantized (xq: matmul_quantize's, for fmt) */
static void matmul_quantized(int fmt, const float *x, int64_t M, int64_t K, int64_t ldx, const xquant_t *xq,
                             const uint8_t *data, int64_t N, float *y, int64_t ldy, int threads) {
    weight_t w = weight_of(fmt, K, data);
    blocks_fn run = blocks_for(fmt, xq);
    int64_t blocks = N / 16;
    matmul_bytes += blocks * w.G * w.block_bytes;
    if (blocks < 4 * threads && M < MT) threads = 1;
    GL_OMP(parallel num_threads(threads))
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        run(&w, x, ldx, xq, M, blocks * t / nt, blocks * (t + 1) / nt, y, ldy);
    }
}

/* y [M, ldy] (its first N columns) = x [M, ldx] @ W.T for W [N, K] (N a multiple of 16, K of 32; of 256 for the
   K-quants) in format `fmt` laid out in blocks (see the top of the file), x's groups quantized to `bits` (16, or 8)
   for the quantized formats. Returns 0, or -1 when out of memory. */
int gl_matmul(int fmt, const float *x, int64_t M, int64_t K, int64_t ldx,
              const uint8_t *data, int64_t N, float *y, int64_t ldy, int bits, int threads) {
    xquant_t xq;
    if (matmul_quantize(fmt, x, M, K, ldx, &xq, bits, threads)) return -1;
    matmul_quantized(fmt, x, M, K, ldx, &xq, data, N, y, ldy, threads);
    return 0;
}

/* out [T, K] = rows ids[0 .. T - 1] of W (format `fmt`, blocks as for gl_matmul), each value (u + offset) * scale +
   zero in one rounding, as gguf dequantizes it. Returns 0, or -1 when an id is outside [0, N). */
int gl_embedding(int fmt, const uint8_t *data, int64_t N, int64_t K, const int64_t *ids,
                 int64_t T, float *out) {
    weight_t w = weight_of(fmt, K, data);
    int sub = fmt_super(fmt) ? 8 : 1, sets = fmt_sets(fmt), vbytes = fmt_vbytes(fmt);
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -1;
    for (int64_t t = 0; t < T; t++) {
        int64_t rb = ids[t] / 16, lane = ids[t] % 16;
        for (int64_t g = 0; g < K / 32; g++) {
            const uint8_t *b = data + (rb * w.G + g / sub) * w.block_bytes;
            float *o = out + t * K + 32 * g;
            if (!fmt_quantized(fmt)) {
                for (int k = 0; k < 32; k++)
                    o[k] = fmt == FMT_F16 ? half_bits_to_float(((const uint16_t *)b)[16 * k + lane])
                                          : ((const float *)b)[16 * k + lane];
                continue;
            }
            int j = (int)(g % sub);
            uint8_t u[8][64];
            unpack_values(fmt, b + j * vbytes, u);
            float sc[2][16], zr[2][16];
            for (int s = 0; s < sets; s++) {
                vf scale, zero;
                unit_scales(fmt, b, j, s, &scale, &zero);
                vf_store(sc[s], scale);
                vf_store(zr[s], zero);
            }
            for (int k = 0; k < 32; k++) {
                int s = k / (32 / sets);
                o[k] = fmaf((float)(u[k / 4][4 * lane + k % 4] + fmt_offset(fmt)), sc[s][lane], zr[s][lane]);
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------
   Repacking at load: GGUF blocks into the formats above (what `cpu_weights.py` calls for each quantized matrix)
   ------------------------------------------------------------------------------------------------------------ */

/* bytes of one GGUF block of a quantized format's type (32 values; 256 for the K-quants) */
static int gguf_block_bytes(int fmt) {
    switch (fmt) {
    case FMT_Q4_0: return 18;
    case FMT_Q4_1: return 20;
    case FMT_Q5_0: return 22;
    case FMT_Q5_1: return 24;
    case FMT_Q8_0: return 34;
    case FMT_Q4_K: return 144;
    case FMT_Q5_K: return 176;
    case FMT_Q6_K: return 210;
    case FMT_MXFP4: return 17;
    default: return 0;
    }
}

/* value i of 32 in the low nibble of qs[i] (i < 16), in the high nibble of qs[i - 16] otherwise */
static inline void gguf_nibbles(const uint8_t *qs, uint8_t *u) {
    for (int i = 0; i < 16; i++) {
        u[i] = qs[i] & 15;
        u[i + 16] = qs[i] >> 4;
    }
}

/* One GGUF block b: its unsigned values u (as the format holds them, see the table at the top) and its fields f, in
   the table's order, each entry the bytes the format keeps (float16 fields as they are in the file). */
static void gguf_unpack_block(int fmt, const uint8_t *b, uint8_t *u, uint8_t *f) {
    switch (fmt) {
    case FMT_Q4_0: memcpy(f, b, 2); gguf_nibbles(b + 2, u); break;                 /* d, qs[16] */
    case FMT_Q4_1: memcpy(f, b, 4); gguf_nibbles(b + 4, u); break;                 /* d, m, qs[16] */
    case FMT_MXFP4: f[0] = b[0]; gguf_nibbles(b + 1, u); break;                    /* e, codes[16] */
    case FMT_Q8_0: memcpy(f, b, 2); memcpy(u, b + 2, 32); break;                   /* d, q[32] (signed) */
    case FMT_Q5_0: case FMT_Q5_1: {                            /* d, (m,) qh: bit i of a u32 is bit 4 of value i */
        int at = fmt == FMT_Q5_0 ? 2 : 4;
        memcpy(f, b, (size_t)at);
        gguf_nibbles(b + at + 4, u);
        for (int i = 0; i < 32; i++) u[i] |= ((b[at + i / 8] >> (i % 8)) & 1) << 4;
        break;
    }
    case FMT_Q4_K: case FMT_Q5_K: { /* d, dmin, 12 bytes of 6-bit sc and mn, (Q5_K: qh[32],) qs[128] */
        const uint8_t *s = b + 4, *qs = b + (fmt == FMT_Q4_K ? 16 : 48);
        for (int j = 0; j < 4; j++) {
            f[j] = s[j] & 63;
            f[j + 4] = (s[8 + j] & 15) | ((s[j] >> 2) & 0x30);
            f[8 + j] = s[4 + j] & 63;
            f[12 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
        }
        memcpy(f + 16, b, 4);
        for (int c = 0; c < 4; c++) /* chunk c of 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high */
            for (int i = 0; i < 32; i++) {
                u[64 * c + i] = qs[32 * c + i] & 15;
                u[64 * c + 32 + i] = qs[32 * c + i] >> 4;
            }
        if (fmt == FMT_Q5_K) /* bit c of qh[i]: bit 4 of value 32 c + i */
            for (int c = 0; c < 8; c++)
                for (int i = 0; i < 32; i++) u[32 * c + i] |= ((b[16 + i] >> c) & 1) << 4;
        break;
    }
    case FMT_Q6_K: { /* ql[128], qh[64], sc[16] (int8), d */
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 64; i++) {
                u[128 * h + i] = b[64 * h + i] & 15;
                u[128 * h + 64 + i] = b[64 * h + i] >> 4;
            }
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 4; c++)
                for (int i = 0; i < 32; i++) u[128 * h + 32 * c + i] |= ((b[128 + 32 * h + i] >> (2 * c)) & 3) << 4;
        memcpy(f, b + 192, 18);
        break;
    }
    default: break;
    }
}

/* W [N, K] as GGUF rows (rows[n]: the address of row n, K / 32 blocks of 32 values or K / 256 of 256; the rows of
   several matrices can be joined so, without a copy) into the blocks of format `fmt` (dst: [ceil(N / 16)][units]
   [unit_bytes(fmt)]; rows past N are zero bytes, whose scales are 0), by `threads` threads over the groups of 16
   rows. Returns 0, or -1 for a format that is not quantized. */
int gl_repack(int fmt, const int64_t *rows, int64_t N, int64_t K, uint8_t *dst, int threads) {
    int block = gguf_block_bytes(fmt);
    if (block == 0) return -1;
    (void)threads; /* read by GL_OMP only */
    int values = fmt_super(fmt) ? 256 : 32, groups = values / 32, bits = fmt_bits(fmt), planes = fmt_planes(fmt);
    /* the fields: count entries a row of size bytes each (see the table at the top) */
    int n_fields = 0, count[4], size[4];
#define GL_FIELD(c, s) (count[n_fields] = (c), size[n_fields++] = (s))
    if (fmt == FMT_MXFP4) GL_FIELD(1, 1);
    else if (fmt == FMT_Q6_K) { GL_FIELD(16, 1); GL_FIELD(1, 2); }
    else if (fmt_super(fmt)) { GL_FIELD(8, 1); GL_FIELD(8, 1); GL_FIELD(1, 2); GL_FIELD(1, 2); }
    else { GL_FIELD(1, 2); if (fmt_has_zero(fmt)) GL_FIELD(1, 2); }
#undef GL_FIELD
    int64_t units = K / values, ubytes = unit_bytes(fmt), row_groups = (N + 15) / 16;
    GL_OMP(parallel for num_threads(threads) schedule(static))
    for (int64_t rg = 0; rg < row_groups; rg++) {
        uint8_t u[16][256], f[16][20];
        for (int64_t unit = 0; unit < units; unit++) {
            for (int r = 0; r < 16; r++) {
                int64_t row = 16 * rg + r;
                if (row < N) gguf_unpack_block(fmt, (const uint8_t *)(intptr_t)rows[row] + unit * block, u[r], f[r]);
                else memset(u[r], 0, sizeof u[r]), memset(f[r], 0, sizeof f[r]);
            }
            uint8_t *o = dst + (rg * units + unit) * ubytes;
            for (int g = 0; g < groups; g++) {
                const int at = 32 * g;
                if (bits == 8) { /* chunk c of every row: its 4 bytes */
                    for (int c = 0; c < 8; c++)
                        for (int r = 0; r < 16; r++)
                            for (int i = 0; i < 4; i++) *o++ = u[r][at + 4 * c + i];
                    continue;
                }
                for (int c = 0; c < 4; c++) /* byte 4c + i of a row: value 4c + i low, 4c + i + 16 high */
                    for (int r = 0; r < 16; r++)
                        for (int i = 0; i < 4; i++)
                            *o++ = (uint8_t)((u[r][at + 4 * c + i] & 15) | ((u[r][at + 16 + 4 * c + i] & 15) << 4));
                /* word ((2j + h) planes + p) 2 + r8, bit 4 rl + i: bit 4 + p of value 16h + 4j + i of row 8 r8 + rl */
                for (int j = 0; j < 4; j++)
                    for (int h = 0; h < 2; h++)
                        for (int p = 0; p < planes; p++)
                            for (int r8 = 0; r8 < 2; r8++)
                                for (int a = 0; a < 4; a++) {
                                    int byte = 0;
                                    for (int k = 0; k < 8; k++) {
                                        int row = 8 * r8 + 2 * a + (k >> 2), v = at + 16 * h + 4 * j + (k & 3);
                                        byte |= ((u[row][v] >> (4 + p)) & 1) << k;
                                    }
                                    *o++ = (uint8_t)byte;
                                }
            }
            for (int i = 0, off = 0; i < n_fields; off += count[i] * size[i], i++) /* entry c of the 16 rows */
                for (int c = 0; c < count[i]; c++)
                    for (int r = 0; r < 16; r++, o += size[i]) memcpy(o, f[r] + off + c * size[i], (size_t)size[i]);
        }
    }
    return 0;
}

/* bytes of one unit of format `fmt` (16 rows x 32 values, 256 for the K-quants), for the caller's dst */
int64_t gl_unit_bytes(int fmt) { return unit_bytes(fmt); }

/* out[r] = the first index of the largest value of row r of x [rows, n] (NaNs are skipped) */
void gl_argmax(const float *x, int64_t rows, int64_t n, int64_t ldx, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * ldx;
        vf mv = vf_set1(-INFINITY);
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) mv = vf_max(mv, vf_load(v + i));
        float m = vf_hmax(mv);
        for (; i < n; i++) m = v[i] > m ? v[i] : m;
        int64_t best = 0;
        while (best < n && !(v[best] == m)) best++;
        out[r] = best < n ? best : 0;
    }
}

/* The sum of x [n] (float32) read once by `threads` threads in contiguous shares, with four vector accumulators
   a thread: a streaming read as STREAM's, which `gpullama bench` times for the machine's read bandwidth (the limit
   of a decode step, which reads every weight once). The sum is returned so that the reads cannot be left out. */
float gl_read_sum(const float *x, int64_t n, int threads) {
    float total = 0.0f;
    (void)threads; /* read by GL_OMP only */
    GL_OMP(parallel for num_threads(threads) reduction(+ : total) schedule(static))
    for (int64_t part = 0; part < 64; part++) {
        int64_t start = n * part / 64 / 64 * 64, end = part == 63 ? n : n * (part + 1) / 64 / 64 * 64;
        vf a0 = vf_zero(), a1 = vf_zero(), a2 = vf_zero(), a3 = vf_zero();
        int64_t i = start;
        for (; i + 64 <= end; i += 64) {
            a0 = vf_add(a0, vf_load(x + i));
            a1 = vf_add(a1, vf_load(x + i + 16));
            a2 = vf_add(a2, vf_load(x + i + 32));
            a3 = vf_add(a3, vf_load(x + i + 48));
        }
        float sum = vf_hsum(vf_add(vf_add(a0, a1), vf_add(a2, a3)));
        for (; i < end; i++) sum += x[i];
        total += sum;
    }
    return total;
}

/* ------------------------------------------------------------------------------------------------------------
   RMSNorm (with the residual add), rotary + KV write, SwiGLU
   ------------------------------------------------------------------------------------------------------------ */

/* h [T, H] = h h_scale + residual (when not NULL; Granite's residual multiplier: h_scale), in place; out [T, H] = h *
   rsqrt(mean(h^2) + eps) * weight */
void gl_rms_norm(float *h, const float *residual, float h_scale, const float *weight, float eps, int64_t T, int64_t H,
                 float *out, int threads) {
    vf hs = vf_set1(h_scale);
    (void)threads; /* read by GL_OMP only */
    GL_OMP(parallel for num_threads(threads) if (T * H >= 32768))
    for (int64_t t = 0; t < T; t++) {
        float *row = h + t * H;
        const float *res = residual ? residual + t * H : NULL;
        vf ss = vf_zero();
        int64_t k = 0;
        for (; k + 16 <= H; k += 16) {
            vf v = vf_load(row + k);
            if (res) v = vf_add(h_scale != 1.0f ? vf_mul(v, hs) : v, vf_load(res + k)), vf_store(row + k, v);
            ss = vf_fma(v, v, ss);
        }
        if (k < H) {
            int n = (int)(H - k);
            vf v = vf_load_n(row + k, n);
            if (res) v = vf_add(h_scale != 1.0f ? vf_mul(v, hs) : v, vf_load_n(res + k, n)), vf_store_n(row + k, v, n);
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

/* KV cache formats (the pool tensor's dtype says which): float32, float16, and Q8_0 (llama.cpp's -ctk q8_0: each
   32 values of a head's row are int8 q with one float16 scale d, value q * d; d = max |x| / 127 rounded to
   float16, q = round(x / d) half away from zero, as gguf's quantize and ggml's quantize_row_q8_0_ref).

   A cache row (one token, one kv head) takes kv_row_bytes: 4 D, 2 D, or D + D / 16 (D int8, D / 32 float16 scales).
   The pool tensor is [blocks, block_size, Hk, D] (float32 or float16) or [blocks, block_size, Hk, D + D / 16]
   (uint8, Q8_0); its memory per block and kv head, block_size rows:
   - v: row-major, block after block: row (slot, hk) at (slot * Hk + hk) * kv_row_bytes; a Q8_0 row is its D int8,
     then its D / 32 scales.
   - k: each block transposed, [blocks, Hk, D, block_size] (key j of a block in lane j % 16 of a load); Q8_0: the
     int8 [D][block_size], then the scales [D / 32][block_size], of each (block, kv head). */
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8 = 2 };

static inline int64_t kv_row_bytes(int kvt, int64_t D) { return kvt == KV_F32 ? 4 * D : kvt == KV_F16 ? 2 * D : D + D / 16; }

/* float -> IEEE half bits, rounded to nearest even (as torch's .half()) */
static inline uint16_t float_to_half_bits(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u)); /* inf, nan */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504 */
    if (ax < 0x38800000u) { /* below 2^-14: a subnormal half (exact scaling, then round to an integer) */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f));
    }
    uint32_t h = ((((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13)), rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
#endif
}

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return half_bits_to_float(h);
#endif
}

/* one group of 32 values as Q8_0: q[i] at q[i * stride], its scale's half bits returned */
static inline uint16_t quantize_q8_group(const float *x, int8_t *q, int64_t stride) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 32; i++) q[i * stride] = (int8_t)roundf(x[i] * id);
    return float_to_half_bits(d);
}

/* rotate the first R dims of each head of q [T, Hq, D] and k [T, Hk, D] in place (row strides ldq, ldk;
   `cos_sin` [max_pos, R] is cos | sin of each half; R < D: partial rotary, the last D - R dims stay), then write k and
   v (row stride ldv) to the pool rows `slots` in cache format kvt (see the KV cache formats above) */
void gl_rope_and_cache(float *q, int64_t ldq, float *k, int64_t ldk, const float *v, int64_t ldv, int64_t T,
                       int64_t Hq, int64_t Hk, int64_t D, int64_t R, const float *cos_sin, const int64_t *positions,
                       const int64_t *slots, int64_t block_size, int kvt, void *k_cache, void *v_cache, int threads) {
    int64_t rb = kv_row_bytes(kvt, D);
    (void)threads; /* read by GL_OMP only */
    GL_OMP(parallel for num_threads(threads) if (T >= 64))
    for (int64_t t = 0; t < T; t++) {
        const float *cs = cos_sin + positions[t] * R;
        for (int64_t h = 0; h < Hq; h++) rotate(q + t * ldq + h * D, cs, R / 2);
        for (int64_t h = 0; h < Hk; h++) rotate(k + t * ldk + h * D, cs, R / 2);
        int64_t block = slots[t] / block_size, slot = slots[t] % block_size;
        for (int64_t h = 0; h < Hk; h++) {
            const float *kr = k + t * ldk + h * D, *vr = v + t * ldv + h * D;
            uint8_t *kb = (uint8_t *)k_cache + (block * Hk + h) * block_size * rb; /* this block's kv head h */
            uint8_t *vb = (uint8_t *)v_cache + (slots[t] * Hk + h) * rb;
            if (kvt == KV_F32) {
                for (int64_t d = 0; d < D; d++) ((float *)kb)[d * block_size + slot] = kr[d];
                memcpy(vb, vr, sizeof(float) * D);
            } else if (kvt == KV_F16) {
                for (int64_t d = 0; d < D; d++) ((uint16_t *)kb)[d * block_size + slot] = float_to_half_bits(kr[d]);
                for (int64_t d = 0; d < D; d++) ((uint16_t *)vb)[d] = float_to_half_bits(vr[d]);
            } else {
                uint16_t *ks = (uint16_t *)(kb + D * block_size), *vs = (uint16_t *)(vb + D);
                for (int64_t g = 0; g < D / 32; g++) {
                    ks[g * block_size + slot] = quantize_q8_group(kr + 32 * g, (int8_t *)kb + 32 * g * block_size + slot,
                                                                  block_size);
                    vs[g] = quantize_q8_group(vr + 32 * g, (int8_t *)vb + 32 * g, 1);
                }
            }
        }
    }
}

/* out [T, I] = silu(gate) * up for gate_up [T, 2I] (gate first) */
void gl_silu_mul(const float *gate_up, int64_t T, int64_t I, float *out, int threads) {
    (void)threads; /* read by GL_OMP only */
    GL_OMP(parallel for num_threads(threads) if (T * I >= 65536))
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

/* out [T, I] = gelu_tanh(gate) * up for gate_up [T, 2I] (gate first), with gelu_tanh(g) = g (1 + tanh y) / 2 =
   g / (1 + e^(-2y)), y = sqrt(2 / pi) (g + 0.044715 g^3) (the exponent is clamped: no overflow) */
void gl_gelu_tanh_mul(const float *gate_up, int64_t T, int64_t I, float *out, int threads) {
    (void)threads; /* read by GL_OMP only */
    GL_OMP(parallel for num_threads(threads) if (T * I >= 65536))
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i += 16) {
            int n = I - i < 16 ? (int)(I - i) : 16;
            vf gv = vf_load_n(g + i, n);
            vf y = vf_mul(vf_set1(-1.5957691216057308f), vf_fma(vf_mul(vf_set1(0.044715f), gv), vf_mul(gv, gv), gv));
            vf s = vf_div(gv, vf_add(vf_set1(1.0f), vf_exp(y)));
            vf_store_n(out + t * I + i, vf_mul(s, vf_load_n(u + i, n)), n);
        }
    }
}

/* x [T, n] (row stride ldx) in place: x * scale, then cap * tanh(x / cap) when cap > 0 (final logits) */
void gl_soft_cap(float *x, int64_t T, int64_t n, int64_t ldx, float scale, float cap, int threads) {
    (void)threads; /* read by GL_OMP only */
    GL_OMP(parallel for num_threads(threads) if (T * n >= 65536))
    for (int64_t t = 0; t < T; t++) {
        float *row = x + t * ldx;
        for (int64_t i = 0; i < n; i += 16) {
            int c = n - i < 16 ? (int)(n - i) : 16;
            vf v = vf_mul(vf_load_n(row + i, c), vf_set1(scale));
            if (cap > 0.0f) v = vf_mul(vf_tanh(vf_div(v, vf_set1(cap))), vf_set1(cap));
            vf_store_n(row + i, v, c);
        }
    }
}

/* ------------------------------------------------------------------------------------------------------------
   short convolution (LFM2)
   ------------------------------------------------------------------------------------------------------------ */

#define MAX_CONV_KERNEL 8

/* causal depthwise convolution of each sequence's new rows x [T, H] (row stride ldx): out[t][c] = sum over taps j
   of kernel[j][c] * input[t - L + 1 + j][c], added in order j = 0 .. L-1 (a product, then sums of products, as
   gpullama.ops.torch_ops' reference); the inputs before sequence b's first row (query_start[b]) are its state
   states[slots[b]] ([L - 1][H]: its last inputs), zeros when that row is at position 0; afterwards the state holds
   its last L - 1 inputs. L <= MAX_CONV_KERNEL. Sequences and 16-channel groups are independent: any thread split
   gives the same bits. */
void gl_short_conv(const float *x, int64_t ldx, int64_t H, int64_t L, const float *kernel, float *states,
                   const int64_t *slots, const int64_t *positions, const int32_t *query_start, int64_t B, float *out,
                   int threads) {
    int64_t groups = (H + 15) / 16;
    (void)threads; /* read by GL_OMP only */
    GL_OMP(parallel for num_threads(threads) schedule(static) if (B * groups >= 64))
    for (int64_t u = 0; u < B * groups; u++) {
        int64_t b = u / groups, c = (u % groups) * 16, n = H - c < 16 ? H - c : 16;
        int64_t first = query_start[b], end = query_start[b + 1];
        if (first == end) continue;
        float *state = states + slots[b] * (L - 1) * H;
        int fresh = positions[first] == 0;
        vf win[MAX_CONV_KERNEL], k[MAX_CONV_KERNEL];
        for (int64_t j = 0; j < L; j++) k[j] = vf_load_n(kernel + j * H + c, (int)n);
        for (int64_t j = 0; j < L - 1; j++) win[j] = fresh ? vf_zero() : vf_load_n(state + j * H + c, (int)n);
        for (int64_t t = first; t < end; t++) {
            win[L - 1] = vf_load_n(x + t * ldx + c, (int)n);
            vf acc = vf_mul(win[0], k[0]);
            for (int64_t j = 1; j < L; j++) acc = vf_add(acc, vf_mul(win[j], k[j]));
            vf_store_n(out + t * H + c, acc, (int)n);
            for (int64_t j = 0; j < L - 1; j++) win[j] = win[j + 1];
        }
        for (int64_t j = 0; j < L - 1; j++) vf_store_n(state + j * H + c, win[j], (int)n);
    }
}

/* The gated delta rule (Qwen3.5's linear attention) over each sequence's rows, one row after another: q, k [T, Hk,
   Dk] (row strides ldq, ldk), v [T, Hv, Dv] (ldv), decay and beta [T, Hv] (contiguous); value head h reads key head
   h % Hk. q and k are L2-normalized (1 / sqrt(sum x^2 + 1e-6)), q times Dk^-0.5. Head h's state S [Dk, Dv] (slot
   slots[b] of states [slots, Hv, Dk, Dv]; zeros where the sequence's first row is at position 0) takes each row:
   S *= exp(decay); kv = k S; S += k (beta (v - kv)); out = q S (out [T, Hv, Dv] contiguous). Each column of S
   evolves on its own: sequences, heads and 16-column groups are independent, a task keeps its [Dk, 16] tile in
   registers and cache for all its rows, and any thread split gives the same bits. Dk <= MAX_DELTA_KEY_DIM. */
#define MAX_DELTA_KEY_DIM 256

static void unit_rows(const float *x, int64_t D, float scale, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < D; i++) ss += x[i] * x[i];
    float r = scale / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < D; i++) out[i] = x[i] * r;
}

void gl_gated_delta_rule(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                         const float *decay, const float *beta, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                         float *states, const int64_t *slots, const int64_t *positions, const int32_t *query_start,
                         int64_t B, float *out, int threads) {
    int64_t groups = (Dv + 15) / 16;
    float q_scale = 1.0f / sqrtf((float)Dk);
    (void)threads; /* read by GL_OMP only */
    GL_OMP(parallel for num_threads(threads) schedule(static) if (B * Hv * groups >= 16))
    for (int64_t u = 0; u < B * Hv * groups; u++) {
        int64_t b = u / (Hv * groups), h = (u / groups) % Hv, c = (u % groups) * 16, n = Dv - c < 16 ? Dv - c : 16;
        int64_t first = query_start[b], end = query_start[b + 1];
        if (first == end) continue;
        float *state = states + ((slots[b] * Hv + h) * Dk) * Dv + c;
        int fresh = positions[first] == 0;
        vf S[MAX_DELTA_KEY_DIM];
        float qn[MAX_DELTA_KEY_DIM], kn[MAX_DELTA_KEY_DIM];
        for (int64_t i = 0; i < Dk; i++) S[i] = fresh ? vf_zero() : vf_load_n(state + i * Dv, (int)n);
        for (int64_t t = first; t < end; t++) {
            unit_rows(q + t * ldq + (h % Hk) * Dk, Dk, q_scale, qn);
            unit_rows(k + t * ldk + (h % Hk) * Dk, Dk, 1.0f, kn);
            vf e = vf_set1(expf(decay[t * Hv + h])), kv = vf_zero(), o = vf_zero();
            for (int64_t i = 0; i < Dk; i++) {
                S[i] = vf_mul(S[i], e);
                kv = vf_fma(S[i], vf_set1(kn[i]), kv);
            }
            vf delta = vf_mul(vf_sub(vf_load_n(v + t * ldv + h * Dv + c, (int)n), kv), vf_set1(beta[t * Hv + h]));
            for (int64_t i = 0; i < Dk; i++) {
                S[i] = vf_fma(vf_set1(kn[i]), delta, S[i]);
                o = vf_fma(S[i], vf_set1(qn[i]), o);
            }
            vf_store_n(out + (t * Hv + h) * Dv + c, o, (int)n);
        }
        for (int64_t i = 0; i < Dk; i++) vf_store_n(state + i * Dv, S[i], (int)n);
    }
}

/* Mamba2's selective scan over each sequence's rows, one row after another: x [T, H, P] (row stride ldx, each
   head's P values contiguous), dt [T, H] (after softplus, contiguous), a [H] (negative), b and c [T, G, N] (row
   strides ldb, ldc); head h reads group h / (H / G). Head h's state S [N, P] (slot slots[s] of states [slots, H, N,
   P]; zeros where the sequence's first row is at position 0) takes each row: S = S exp(dt a) + b (dt x)^T, out = c S
   (out [T, H, P] contiguous; no D skip). Each column of S evolves on its own: sequences, heads and 16-column groups
   are independent, a task keeps its [N, 16] tile in registers and cache for all its rows, and any thread split gives
   the same bits. N <= MAX_SSM_STATE. */
#define MAX_SSM_STATE 256

void gl_ssm_scan(const float *x, int64_t ldx, const float *dt, const float *a, const float *b, int64_t ldb,
                 const float *c, int64_t ldc, int64_t H, int64_t G, int64_t P, int64_t N, float *states,
                 const int64_t *slots, const int64_t *positions, const int32_t *query_start, int64_t B, float *out,
                 int threads) {
    int64_t groups = (P + 15) / 16, per_group = H / G;
    (void)threads; /* read by GL_OMP only */
    GL_OMP(parallel for num_threads(threads) schedule(static) if (B * H * groups >= 16))
    for (int64_t u = 0; u < B * H * groups; u++) {
        int64_t s = u / (H * groups), h = (u / groups) % H, col = (u % groups) * 16, w = P - col < 16 ? P - col : 16;
        int64_t first = query_start[s], end = query_start[s + 1], g = h / per_group;
        if (first == end) continue;
        float *state = states + ((slots[s] * H + h) * N) * P + col;
        int fresh = positions[first] == 0;
        vf S[MAX_SSM_STATE];
        for (int64_t i = 0; i < N; i++) S[i] = fresh ? vf_zero() : vf_load_n(state + i * P, (int)w);
        for (int64_t t = first; t < end; t++) {
            float step = dt[t * H + h];
            const float *bt = b + t * ldb + g * N, *ct = c + t * ldc + g * N;
            vf e = vf_set1(expf(step * a[h])), o = vf_zero();
            vf input = vf_mul(vf_set1(step), vf_load_n(x + t * ldx + h * P + col, (int)w));
            for (int64_t i = 0; i < N; i++) {
                S[i] = vf_add(vf_mul(S[i], e), vf_mul(vf_set1(bt[i]), input));
                o = vf_fma(S[i], vf_set1(ct[i]), o);
            }
            vf_store_n(out + (t * H + h) * P + col, o, (int)w);
        }
        for (int64_t i = 0; i < N; i++) vf_store_n(state + i * P, S[i], (int)w);
    }
}

/* Mamba2's mixer between its two matrices (Granite 4.0-H), as gpullama.ops.TorchOps.mamba2 composes it, in one
   call: each row of zxbcdt [T, ld] is z [inner] | x B C [C = inner + 2 G N] | dt [H]. x B C goes through the causal
   convolution (gl_short_conv: kernel [L, C], conv_states [slots, L - 1, C]), plus conv_bias and SiLU; the scan
   (gl_ssm_scan; ssm_states [slots, H, N, P], P = inner / H) takes x, B, C and softplus(dt + dt_bias) (torch's
   threshold: above 20, the input itself); then y += d x, y *= silu(z), and each group of inner / G values of a row
   through an RMSNorm (times norm [inner]). out [T, inner]. Returns 0, -1 when out of memory. */
int gl_mamba2(const float *zxbcdt, int64_t ld, int64_t T, int64_t inner, int64_t H, int64_t G, int64_t N, int64_t L,
              const float *kernel, const float *conv_bias, const float *dt_bias, const float *a, const float *d,
              const float *norm, float eps, float *conv_states, float *ssm_states, const int64_t *slots,
              const int64_t *positions, const int32_t *query_start, int64_t B, float *out, int threads) {
    int64_t C = inner + 2 * G * N, P = inner / H, width = inner / G;
    float *xbc = scratch(SCRATCH_MAMBA, sizeof(float) * T * C), *dt = scratch(SCRATCH_MAMBA + 1, sizeof(float) * T * H);
    if (!xbc || !dt) return -1;
    gl_short_conv(zxbcdt + inner, ld, C, L, kernel, conv_states, slots, positions, query_start, B, xbc, threads);
    GL_OMP(parallel for num_threads(threads) schedule(static) if (T * C >= 65536))
    for (int64_t t = 0; t < T; t++) {
        float *r = xbc + t * C;
        for (int64_t j = 0; j < C; j += 16) {
            int n = C - j < 16 ? (int)(C - j) : 16;
            vf v = vf_add(vf_load_n(r + j, n), vf_load_n(conv_bias + j, n));
            vf_store_n(r + j, vf_div(v, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), v)))), n);
        }
        for (int64_t h = 0; h < H; h++) {
            float v = zxbcdt[t * ld + inner + C + h] + dt_bias[h];
            dt[t * H + h] = v > 20.0f ? v : log1pf(expf(v));
        }
    }
    gl_ssm_scan(xbc, C, dt, a, xbc + inner, C, xbc + inner + G * N, C, H, G, P, N, ssm_states, slots, positions,
                query_start, B, out, threads);
    GL_OMP(parallel for num_threads(threads) schedule(static) if (T * G >= 16 && T * inner >= 65536))
    for (int64_t u = 0; u < T * G; u++) {
        int64_t t = u / G, g0 = (u % G) * width;
        float *y = out + t * inner + g0;
        const float *z = zxbcdt + t * ld + g0, *x = xbc + t * C + g0;
        vf ss = vf_zero();
        for (int64_t i = 0; i < width; i += 16) {
            int n = width - i < 16 ? (int)(width - i) : 16;
            vf zv = vf_load_n(z + i, n), gate = vf_div(zv, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), zv)))), dv;
            if (P % 16 == 0) { /* the vector within one head */
                dv = vf_set1(d[(g0 + i) / P]);
            } else {
                float each[16] = {0};
                for (int j = 0; j < n; j++) each[j] = d[(g0 + i + j) / P];
                dv = vf_load(each);
            }
            vf v = vf_mul(vf_fma(vf_load_n(x + i, n), dv, vf_load_n(y + i, n)), gate);
            vf_store_n(y + i, v, n);
            ss = vf_fma(v, v, ss);
        }
        vf r = vf_set1(1.0f / sqrtf(vf_hsum(ss) / (float)width + eps));
        for (int64_t i = 0; i < width; i += 16) {
            int n = width - i < 16 ? (int)(width - i) : 16;
            vf_store_n(y + i, vf_mul(vf_mul(vf_load_n(y + i, n), r), vf_load_n(norm + g0 + i, n)), n);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------
   paged attention
   ------------------------------------------------------------------------------------------------------------ */

#define TILE_ROWS 16 /* query rows (positions x heads of one kv head) that share each key and value load */
#define KV_CHUNK 256 /* keys of one chunk: a row's keys are cut at the multiples of this, whatever the batch */

/* a buffer of at least `bytes` for the attention, kept between calls (NULL when out of memory): slot 0 per thread
   inside the parallel region, slots 1-3 of the calling thread */
static void *attn_scratch(int which, size_t bytes) { return scratch(SCRATCH_ATTN + which, bytes); }

/* 16 keys' dim d (k: a block's kv head, transposed, keys from o) as floats */
static inline __attribute__((always_inline)) vf k_load(int kvt, const uint8_t *k, int64_t bs, int64_t d, int64_t o) {
    return kvt == KV_F16 ? vf_f16((const uint16_t *)k + d * bs + o) : vf_load((const float *)k + d * bs + o);
}

/* values 16c .. 16c + 15 of a cache row's values v as floats (Q8_0: q * d, the scales d from s) */
static inline __attribute__((always_inline)) vf v_load(int kvt, const uint8_t *v, const uint8_t *s, int64_t c) {
    if (kvt == KV_F32) return vf_load((const float *)v + 16 * c);
    if (kvt == KV_F16) return vf_f16((const uint16_t *)v + 16 * c);
    return vf_mul(vf_i8((const int8_t *)v + 16 * c), vf_set1(half_to_float(((const uint16_t *)s)[c / 2])));
}

#if defined(__AVX512F__)
#define KV_VECS 4 /* vectors of 16 keys scored at once: independent FMA chains (registers allow 4 x 4 on AVX-512) */
#else
#define KV_VECS 2
#endif

/* The scores of RN query rows (qr) against KV_VECS vectors of 16 keys (vector v: kt[v], a block's kv head,
   transposed; keys from o[v]), unscaled: per key, FMAs in d order (Q8_0: per 32 dims, then times the key's scale,
   group after group) */
static inline __attribute__((always_inline)) void score_rows(int kvt, int RN, const float *const *qr,
                                                              const uint8_t *const *kt, const int64_t *o, int64_t bs,
                                                              int64_t D, vf acc[][KV_VECS]) {
    for (int r = 0; r < RN; r++)
        for (int v = 0; v < KV_VECS; v++) acc[r][v] = vf_zero();
    if (kvt == KV_Q8) {
        for (int64_t g = 0; g < D / 32; g++) {
            vf ag[4][KV_VECS];
            for (int r = 0; r < RN; r++)
                for (int v = 0; v < KV_VECS; v++) ag[r][v] = vf_zero();
            for (int64_t d = 32 * g; d < 32 * g + 32; d++) {
                vf qb[4];
                for (int r = 0; r < RN; r++) qb[r] = vf_set1(qr[r][d]);
                for (int v = 0; v < KV_VECS; v++) {
                    vf kv = vf_i8((const int8_t *)kt[v] + d * bs + o[v]);
                    for (int r = 0; r < RN; r++) ag[r][v] = vf_fma(qb[r], kv, ag[r][v]);
                }
            }
            for (int v = 0; v < KV_VECS; v++) {
                vf s = vf_f16((const uint16_t *)(kt[v] + D * bs) + g * bs + o[v]);
                for (int r = 0; r < RN; r++) acc[r][v] = vf_fma(ag[r][v], s, acc[r][v]);
            }
        }
    } else {
        for (int64_t d = 0; d < D; d++) {
            vf qb[4];
            for (int r = 0; r < RN; r++) qb[r] = vf_set1(qr[r][d]);
            for (int v = 0; v < KV_VECS; v++) {
                vf kv = k_load(kvt, kt[v], bs, d, o[v]);
                for (int r = 0; r < RN; r++) acc[r][v] = vf_fma(qb[r], kv, acc[r][v]);
            }
        }
    }
}

/* The weighted sums of values of RN rows (their probabilities in scores, row stride KV_CHUNK, key j at j - k0) over
   the keys each sees in k0 .. k1 - 1, in key order, into part (row stride D + 2); a head wider than HEAD_PIECE in
   pieces of it, each over all the keys (at most HEAD_PIECE / 16 accumulators a row) */
static inline __attribute__((always_inline)) void value_rows(int kvt, int RN, const int64_t *n, const int64_t *lo,
                                                              const float *scores, const uint8_t *v_cache, int64_t bs,
                                                              int64_t Hk, int64_t D, const int32_t *table, int64_t hk,
                                                              int64_t k0, int64_t k1, float *part) {
    int64_t rb = kv_row_bytes(kvt, D), size = kvt == KV_F32 ? 4 : kvt == KV_F16 ? 2 : 1;
    int64_t jlo = lo[0] > k0 ? lo[0] : k0, jhi = n[RN - 1] < k1 ? n[RN - 1] : k1;
    for (int64_t d0 = 0; d0 < D; d0 += HEAD_PIECE) { /* a piece: its values at d0 of each row, Q8_0 scales at d0 / 32 */
        int64_t vecs = (D - d0 < HEAD_PIECE ? D - d0 : HEAD_PIECE) / 16;
        vf acc[4][HEAD_PIECE / 16];
        for (int r = 0; r < RN; r++)
            for (int64_t c = 0; c < vecs; c++) acc[r][c] = vf_zero();
        for (int64_t j = jlo; j < jhi;) { /* a run of keys inside one block: rows bs apart in the pool */
            int64_t off = j % bs, end = j - off + bs < jhi ? j - off + bs : jhi, stride = Hk * rb;
            const uint8_t *vr = v_cache + ((int64_t)table[j / bs] * bs * Hk + hk) * rb + off * stride + d0 * size;
            const uint8_t *sr = vr - d0 * size + D + d0 / 16;
            int every = 1; /* every row sees every key of the run */
            for (int r = 0; r < RN; r++) every &= j >= lo[r] && end <= n[r];
            for (; j < end; j++, vr += stride, sr += stride) {
                int use[4];
                vf p[4];
                for (int r = 0; r < RN; r++) {
                    use[r] = every || (j < n[r] && j >= lo[r]);
                    p[r] = vf_set1(use[r] ? scores[r * KV_CHUNK + (j - k0)] : 0.0f);
                }
                if (every) {
                    for (int64_t c = 0; c < vecs; c++) {
                        vf vv = v_load(kvt, vr, sr, c);
                        for (int r = 0; r < RN; r++) acc[r][c] = vf_fma(p[r], vv, acc[r][c]);
                    }
                } else {
                    for (int64_t c = 0; c < vecs; c++) {
                        vf vv = v_load(kvt, vr, sr, c);
                        for (int r = 0; r < RN; r++)
                            if (use[r]) acc[r][c] = vf_fma(p[r], vv, acc[r][c]);
                    }
                }
            }
        }
        for (int r = 0; r < RN; r++)
            for (int64_t c = 0; c < vecs; c++) vf_store(part + r * (D + 2) + d0 + 16 * c, acc[r][c]);
    }
}

/* One chunk of one tile: query rows r = (position p0 + i, head h0 + j) of a sequence, all on kv head hk, each over
   its keys (lo[r] .. n[r] - 1) inside the chunk k0 .. k0 + KV_CHUNK - 1, in groups of up to 4 rows (registers). A
   row's arithmetic does not depend on the tile or its group: score j = sum over d of q[d] k_j[d] (score_rows; key j
   in lane j % 16), times scale (then softcap * tanh(score / softcap)); the chunk's exact max m; exponentials and
   their sum l over 16 lanes in key order from the vector holding the row's first key of the chunk (lanes outside its
   keys add 0), then the tree; the weighted sum o of values in key order (value_rows). Writes each row's partial
   (o [D], m, l) at part + r * (D + 2) (m = -inf, l = 0 when the row has no key in the chunk). */
static inline __attribute__((always_inline)) void attend_chunk(
    int kvt, const float *const *qr, const int64_t *n, const int64_t *lo, int R, const uint8_t *k_cache,
    const uint8_t *v_cache, int64_t bs, int64_t Hk, int64_t D, const int32_t *table, int64_t hk, int64_t k0,
    float scale, float softcap, float *scores, float *part) {
    static const float lanes[48] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                    1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    int64_t k1 = k0 + KV_CHUNK, rb = kv_row_bytes(kvt, D);
    int64_t kstart = lo[0] > k0 ? lo[0] : k0, kend = n[R - 1] < k1 ? n[R - 1] : k1; /* the tile's keys here */
    vf cap = vf_set1(softcap), inv_cap = vf_set1(softcap > 0.0f ? 1.0f / softcap : 0.0f);
    for (int64_t kb = kstart / 16 * 16; kb < kend; kb += 16 * KV_VECS) {
        /* KV_VECS vectors of 16 keys (past the tile's keys: the last one again, its scores not kept) */
        int nv = (int)((kend - kb + 15) / 16) < KV_VECS ? (int)((kend - kb + 15) / 16) : KV_VECS;
        const uint8_t *kt[KV_VECS];
        int64_t o[KV_VECS];
        for (int v = 0; v < KV_VECS; v++) {
            int64_t j = kb + 16 * (v < nv ? v : nv - 1);
            kt[v] = k_cache + ((int64_t)table[j / bs] * Hk + hk) * bs * rb; /* [D][bs] */
            o[v] = j % bs;
        }
        for (int r0 = 0; r0 < R; r0 += 4) {
            int rn = R - r0 < 4 ? R - r0 : 4;
            vf acc[4][KV_VECS];
            switch (rn) {
            case 1: score_rows(kvt, 1, qr + r0, kt, o, bs, D, acc); break;
            case 2: score_rows(kvt, 2, qr + r0, kt, o, bs, D, acc); break;
            case 3: score_rows(kvt, 3, qr + r0, kt, o, bs, D, acc); break;
            default: score_rows(kvt, 4, qr + r0, kt, o, bs, D, acc);
            }
            for (int r = 0; r < rn; r++)
                for (int v = 0; v < nv; v++) {
                    vf sc = vf_mul(acc[r][v], vf_set1(scale));
                    if (softcap > 0.0f) sc = vf_mul(vf_tanh(vf_mul(sc, inv_cap)), cap);
                    vf_store(scores + (r0 + r) * KV_CHUNK + (kb + 16 * v - k0), sc);
                }
        }
    }
    for (int r = 0; r < R; r++) {
        float *sr = scores + r * KV_CHUNK, *pr = part + r * (D + 2);
        int64_t first = lo[r] > k0 ? lo[r] : k0, end = n[r] < k1 ? n[r] : k1, j = first;
        if (first >= end) {
            pr[D] = -INFINITY, pr[D + 1] = 0.0f;
            continue;
        }
        vf mx = vf_set1(-INFINITY);
        for (; j + 16 <= end; j += 16) mx = vf_max(mx, vf_load(sr + (j - k0)));
        float m = vf_hmax(mx);
        for (; j < end; j++) m = sr[j - k0] > m ? sr[j - k0] : m;
        vf sum = vf_zero(), mv = vf_set1(m);
        for (j = first / 16 * 16; j < end; j += 16) {
            int c = end - j < 16 ? (int)(end - j) : 16, skip = j < first ? (int)(first - j) : 0;
            vf p = vf_exp(vf_sub(vf_load_n(sr + (j - k0), c), mv));
            if (c < 16 || skip) p = vf_mul(p, vf_mul(vf_load(lanes + 16 - skip), vf_load(lanes + 32 - c)));
            vf_store(sr + (j - k0), p);
            sum = vf_add(sum, p);
        }
        pr[D] = m, pr[D + 1] = vf_hsum(sum);
    }
    for (int r0 = 0; r0 < R; r0 += 4) { /* values: 4 rows at a time, D / 16 accumulators each */
        int rn = R - r0 < 4 ? R - r0 : 4;
        const float *sc = scores + r0 * KV_CHUNK;
        float *pr = part + r0 * (D + 2);
        switch (rn) {
        case 1: value_rows(kvt, 1, n + r0, lo + r0, sc, v_cache, bs, Hk, D, table, hk, k0, k1, pr); break;
        case 2: value_rows(kvt, 2, n + r0, lo + r0, sc, v_cache, bs, Hk, D, table, hk, k0, k1, pr); break;
        case 3: value_rows(kvt, 3, n + r0, lo + r0, sc, v_cache, bs, Hk, D, table, hk, k0, k1, pr); break;
        default: value_rows(kvt, 4, n + r0, lo + r0, sc, v_cache, bs, Hk, D, table, hk, k0, k1, pr);
        }
    }
}

/* A tile: query rows of sequence b (positions p0 .. p0 + np - 1 of its q_len new ones, heads h0 .. h0 + nh - 1 on
   kv head hk), and its chunks c0 .. c1 - 1 (those holding a key one of its rows sees). */
typedef struct {
    int64_t b, hk, h0, p0, c0, c1;
    int np, nh;
} tile_t;

static tile_t tile_of(int64_t u, const int64_t *first, int64_t B, const int32_t *query_start, const int32_t *seq_lens,
                      int64_t Hk, int64_t G, int64_t nh, int64_t np, int64_t head_tiles, int64_t window) {
    int64_t lo = 0, hi = B - 1;
    while (lo < hi) { /* the sequence whose tiles hold u */
        int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= u) lo = mid; else hi = mid - 1;
    }
    tile_t t;
    int64_t v = u - first[lo], q_len = query_start[lo + 1] - query_start[lo];
    int64_t ht = (v / Hk) % head_tiles, pt = v / (Hk * head_tiles);
    t.b = lo, t.hk = v % Hk, t.h0 = t.hk * G + ht * nh, t.p0 = pt * np;
    t.np = (int)(q_len - t.p0 < np ? q_len - t.p0 : np), t.nh = (int)(G - ht * nh < nh ? G - ht * nh : nh);
    int64_t n0 = seq_lens[lo] - q_len + t.p0 + 1, n1 = n0 + t.np - 1; /* keys of its first and last rows */
    t.c0 = (window > 0 && n0 > window ? n0 - window : 0) / KV_CHUNK, t.c1 = (n1 - 1) / KV_CHUNK + 1;
    return t;
}

/* the rows of tile t: their query vectors, key ends n and key starts lo */
static int tile_rows(const tile_t *t, const float *q, int64_t ldq, int64_t t0, int64_t seq_len, int64_t q_len,
                     int64_t D, int64_t window, const float **qr, int64_t *n, int64_t *lo) {
    for (int i = 0; i < t->np; i++)
        for (int j = 0; j < t->nh; j++) {
            int r = i * t->nh + j;
            qr[r] = q + (t0 + t->p0 + i) * ldq + (t->h0 + j) * D;
            n[r] = seq_len - q_len + t->p0 + i + 1;
            lo[r] = window > 0 && n[r] > window ? n[r] - window : 0;
        }
    return t->np * t->nh;
}

/* Merge each row's chunk partials (part: chunk c's rows at (c - c0) * TILE_ROWS * (D + 2)), in chunk order: M = the largest
   chunk max (and the sink), L = sum of exp(m_c - M) l_c (then + exp(sink - M)), O = sum of exp(m_c - M) o_c (FMAs);
   out = O * (1 / L). One chunk: exactly o * (1 / l). A head wider than HEAD_PIECE in pieces of it (L again each). */
static void merge_tile(const tile_t *t, const float *part, int R, const int64_t *n, const int64_t *lo, int64_t D,
                       int64_t Hq, int64_t t0, const float *sinks, float *out) {
    for (int r = 0; r < R; r++) {
        int64_t a = lo[r] / KV_CHUNK, z = (n[r] - 1) / KV_CHUNK, stride = TILE_ROWS * (D + 2);
        const float *pr = part + (a - t->c0) * stride + r * (D + 2);
        float sink = sinks ? sinks[t->h0 + r % t->nh] : -INFINITY, m = sink;
        for (int64_t c = 0; c <= z - a; c++) m = pr[c * stride + D] > m ? pr[c * stride + D] : m;
        float *dst = out + ((t0 + t->p0 + r / t->nh) * Hq + t->h0 + r % t->nh) * D;
        for (int64_t d0 = 0; d0 < D; d0 += HEAD_PIECE) {
            int64_t vecs = (D - d0 < HEAD_PIECE ? D - d0 : HEAD_PIECE) / 16;
            vf o[HEAD_PIECE / 16];
            for (int64_t i = 0; i < vecs; i++) o[i] = vf_zero();
            float l = 0.0f;
            for (int64_t c = 0; c <= z - a; c++) {
                const float *pc = pr + c * stride;
                float w = expf(pc[D] - m);
                l += w * pc[D + 1];
                for (int64_t i = 0; i < vecs; i++) o[i] = vf_fma(vf_set1(w), vf_load(pc + d0 + 16 * i), o[i]);
            }
            if (sinks) l += expf(sink - m); /* a sink joins the softmax, with no value */
            for (int64_t i = 0; i < vecs; i++) vf_store(dst + d0 + 16 * i, vf_mul(o[i], vf_set1(1.0f / l)));
        }
    }
}

static inline __attribute__((always_inline)) void attend_chunks(
    int kvt, const tile_t *t, int64_t c_from, int64_t c_to, const float *const *qr, const int64_t *n,
    const int64_t *lo, int R, const void *k_cache, const void *v_cache, int64_t bs, int64_t Hk, int64_t D,
    const int32_t *table, float scale, float softcap, float *scores, float *part) {
    for (int64_t c = c_from; c < c_to; c++)
        attend_chunk(kvt, qr, n, lo, R, k_cache, v_cache, bs, Hk, D, table, t->hk, c * KV_CHUNK, scale, softcap,
                     scores, part + (c - c_from) * TILE_ROWS * (D + 2));
}

/* Causal attention of every query row over its sequence's context in the paged pool; window > 0: a query at
   position p sees the keys after p - window only (a sliding-window layer); softcap > 0: Gemma 2's soft-capped
   scores; sinks (NULL: none) [Hq]: head h's softmax also counts exp(sinks[h]), a key without value (gpt-oss).
   q [T, Hq, D] (row stride ldq; D a multiple of 32 for Q8_0, else of 16, at most GL_MAX_HEAD_DIM), out [T, Hq, D];
   the caches in format kvt as gl_rope_and_cache writes them (block_size a multiple of 16); sequence b owns query
   rows query_start[b] .. query_start[b + 1] - 1, its context is seq_lens[b] tokens in the blocks
   block_tables[b, :] (row stride ldb); its last query row sits at position seq_lens[b] - 1.

   Each row's keys are cut into chunks of KV_CHUNK (flash-decoding): a row's result is the fixed-order merge of its
   chunks' partials (merge_tile), whatever the batch, the tiling or the threads. Work items are tiles of up to
   TILE_ROWS rows that share each key and value load; when there are too few tiles to keep the threads busy (a decode
   step of a few sequences) each (tile, chunk) is an item of its own and the merge follows. Returns 0, or -1 when
   out of memory. */
int gl_attention_sinks(int kvt, const float *q, int64_t ldq, const void *k_cache, const void *v_cache,
                       int64_t block_size, int64_t Hq, int64_t Hk, int64_t D, int64_t B, const int32_t *query_start,
                       const int32_t *seq_lens, const int32_t *block_tables, int64_t ldb, float scale,
                       int64_t window, float softcap, const float *sinks, float *out, int threads) {
    int64_t G = Hq / Hk, nh = G < TILE_ROWS ? G : TILE_ROWS, np = TILE_ROWS / nh, head_tiles = (G + nh - 1) / nh;
    int64_t *first = attn_scratch(1, sizeof(int64_t) * (B + 1)); /* first tile of each sequence */
    if (!first) return -1;
    int64_t max_chunks = 1, work = 0;
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t q_len = query_start[b + 1] - query_start[b], chunks = (seq_lens[b] + KV_CHUNK - 1) / KV_CHUNK;
        first[b + 1] = first[b] + Hk * head_tiles * ((q_len + np - 1) / np);
        max_chunks = chunks > max_chunks ? chunks : max_chunks;
        work += q_len * seq_lens[b];
    }
    int64_t tiles = first[B];
    if (work * Hq * D < (1 << 17)) threads = 1;
    int split = threads > 1 && tiles < 8 * threads;
    int64_t *cfirst = NULL, units = tiles; /* split: the first (tile, chunk) item of each tile */
    float *parts = NULL;
    size_t row_floats = (size_t)TILE_ROWS * (D + 2);
    if (split) {
        cfirst = attn_scratch(2, sizeof(int64_t) * (tiles + 1));
        if (!cfirst) return -1;
        cfirst[0] = 0;
        for (int64_t u = 0; u < tiles; u++) {
            tile_t t = tile_of(u, first, B, query_start, seq_lens, Hk, G, nh, np, head_tiles, window);
            cfirst[u + 1] = cfirst[u] + t.c1 - t.c0;
        }
        units = cfirst[tiles];
        parts = attn_scratch(3, sizeof(float) * units * row_floats);
        if (!parts) return -1;
    }
    int failed = 0;
    GL_OMP(parallel num_threads(threads))
    {
        float *scores = attn_scratch(0, sizeof(float) * (TILE_ROWS * KV_CHUNK + (split ? 0 : max_chunks * row_floats)));
        if (!scores) {
            GL_OMP(atomic write)
            failed = 1;
        }
        float *own = scores + TILE_ROWS * KV_CHUNK; /* this thread's partials of one tile */
        const float *qr[TILE_ROWS];
        int64_t n[TILE_ROWS], lo[TILE_ROWS];
        GL_OMP(for schedule(dynamic))
        for (int64_t u = 0; u < units; u++) {
            if (!scores) continue;
            int64_t tu = u, c_from, c_to;
            if (split) { /* the tile whose items hold u, and its chunk */
                int64_t a = 0, z = tiles - 1;
                while (a < z) {
                    int64_t mid = (a + z + 1) / 2;
                    if (cfirst[mid] <= u) a = mid; else z = mid - 1;
                }
                tu = a;
            }
            tile_t t = tile_of(tu, first, B, query_start, seq_lens, Hk, G, nh, np, head_tiles, window);
            int64_t q_len = query_start[t.b + 1] - query_start[t.b];
            int R = tile_rows(&t, q, ldq, query_start[t.b], seq_lens[t.b], q_len, D, window, qr, n, lo);
            c_from = split ? t.c0 + (u - cfirst[tu]) : t.c0, c_to = split ? c_from + 1 : t.c1;
            float *part = split ? parts + u * row_floats : own;
            const int32_t *table = block_tables + t.b * ldb;
            if (kvt == KV_F16)
                attend_chunks(KV_F16, &t, c_from, c_to, qr, n, lo, R, k_cache, v_cache, block_size, Hk, D, table,
                              scale, softcap, scores, part);
            else if (kvt == KV_Q8)
                attend_chunks(KV_Q8, &t, c_from, c_to, qr, n, lo, R, k_cache, v_cache, block_size, Hk, D, table,
                              scale, softcap, scores, part);
            else
                attend_chunks(KV_F32, &t, c_from, c_to, qr, n, lo, R, k_cache, v_cache, block_size, Hk, D, table,
                              scale, softcap, scores, part);
            if (!split) merge_tile(&t, own, R, n, lo, D, Hq, query_start[t.b], sinks, out);
        }
        if (split) {
            GL_OMP(for schedule(static))
            for (int64_t u = 0; u < tiles; u++) {
                if (failed) continue;
                tile_t t = tile_of(u, first, B, query_start, seq_lens, Hk, G, nh, np, head_tiles, window);
                int64_t q_len = query_start[t.b + 1] - query_start[t.b];
                int R = tile_rows(&t, q, ldq, query_start[t.b], seq_lens[t.b], q_len, D, window, qr, n, lo);
                merge_tile(&t, parts + cfirst[u] * row_floats, R, n, lo, D, Hq, query_start[t.b], sinks, out);
            }
        }
    }
    return failed ? -1 : 0;
}

/* gl_attention_sinks without sinks */
int gl_attention(int kvt, const float *q, int64_t ldq, const void *k_cache, const void *v_cache, int64_t block_size,
                 int64_t Hq, int64_t Hk, int64_t D, int64_t B, const int32_t *query_start,
                 const int32_t *seq_lens, const int32_t *block_tables, int64_t ldb, float scale, int64_t window,
                 float softcap, float *out, int threads) {
    return gl_attention_sinks(kvt, q, ldq, k_cache, v_cache, block_size, Hq, Hk, D, B, query_start, seq_lens,
                              block_tables, ldb, scale, window, softcap, NULL, out, threads);
}

/* ------------------------------------------------------------------------------------------------------------
   mixture of experts
   ------------------------------------------------------------------------------------------------------------ */

/* a buffer of at least `bytes` for the MoE kernel, kept between calls (NULL when out of memory); the caller's
   thread only */
static void *moe_scratch(int which, size_t bytes) { return scratch(SCRATCH_MOE + which, bytes); }

enum { ACT_SILU = 0, ACT_SWIGLU_OAI = 1, ACT_GELU_TANH = 2 };

/* The experts of one MoE matrix (gate|up or down) in a matmul format: expert e's blocks at data + e * stride
   bytes, N rows (a multiple of 16) of K values each. */
typedef struct {
    weight_t w;
    int64_t stride, N;
} experts_t;

/* y [P, ldy] = rows of x [P, K] (as floats and, for the quantized formats, quantized) against each active expert:
   rows start[e] .. start[e + 1] - 1 use expert e. The active experts' blocks of 16 weight rows, in order, are cut
   into one contiguous run a thread (each block costed at its rows plus MT, for reading it), so that each thread
   streams through whole stretches of weights as gl_matmul's threads do; an output element's arithmetic is the same
   whichever thread computes it. */
static void experts_matmul(const experts_t *ex, const float *x, const xquant_t *xq, const int64_t *start,
                           const int64_t *pstart, const int64_t *active, int64_t n_active, float *y, int64_t ldy,
                           int threads) {
    blocks_fn run = blocks_for(ex->w.fmt, xq);
    int64_t K = ex->w.K, blocks = ex->N / 16, total = 0;
    for (int64_t a = 0; a < n_active; a++) total += blocks * (start[active[a] + 1] - start[active[a]] + MT);
    if (n_active * blocks < 2) threads = 1;
    (void)threads; /* read by GL_OMP only */
    GL_OMP(parallel num_threads(threads))
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t lo = total * t / nt, hi = total * (t + 1) / nt, at = 0; /* this thread's blocks start in [lo, hi) */
        for (int64_t a = 0; a < n_active && at < hi; a++) {
            int64_t e = active[a], r0 = start[e], M = start[e + 1] - r0, c = M + MT;
            int64_t b0 = lo > at ? (lo - at + c - 1) / c : 0, b1 = (hi - at + c - 1) / c;
            b0 = b0 < blocks ? b0 : blocks, b1 = b1 < blocks ? b1 : blocks;
            at += blocks * c;
            if (b0 >= b1) continue;
            weight_t w = ex->w;
            w.data = ex->w.data + e * ex->stride;
            xquant_t q = {NULL, NULL, NULL, NULL, 0, 0};
            if (xq->q) q = xq_rows(xq, pstart[e], K);
            run(&w, x + r0 * K, K, &q, M, b0, b1, y + r0 * ldy, ldy);
        }
    }
}

/* rows of x [M, K] quantized as quantize_rows does (row m into row dest[m] of Mp), into buffer `which` of the MoE
   scratch */
static int moe_quantize(const float *x, int64_t M, int64_t Mp, int64_t K, const int64_t *dest, xquant_t *xq,
                        int which, int bits, int super, int threads) {
    uint8_t *buf = moe_scratch(which, xq_bytes(Mp, K));
    if (!buf) return -1;
    *xq = xq_over(buf, Mp, K);
    quantize_rows(x, K, M, K, xq, dest, bits, super, threads);
    return 0;
}

/* A MoE block: out [T, H] = sum over j of wts[t, j] * expert_{ids[t, j]}(x[t]), j = 0 .. k-1 in order, where
   expert e is down_e(act(gate_up_e x + b1_e)) + b2_e; gate_up_e has 2I rows (gate, then up; N1 >= 2I padded to
   16), down_e H rows (N2 >= H). act is silu(gate) * up, or gpt-oss's g sigmoid(alpha g) (u + 1) with g = min(gate,
   limit), u = clamp(up, -limit, limit). The (token, slot) pairs are grouped by expert (in token order within
   one), each active expert runs one matmul over its rows for gate|up and one for down; only their weights are
   read. A row's arithmetic depends on nothing else in the batch. Returns 0, or -1 when out of memory. */
static int64_t moe_bytes; /* expert weight bytes gl_moe has read, for benchmarks */

/* the expert weight bytes gl_moe has read so far (every block of each active expert's two matrices) */
int64_t gl_moe_bytes_read(void) { return moe_bytes; }

int gl_moe(int fmt1, const uint8_t *w1, int64_t stride1, int64_t N1, const float *b1,
           int fmt2, const uint8_t *w2, int64_t stride2, int64_t N2, const float *b2,
           const float *x, int64_t T, int64_t H, int64_t I, const int64_t *ids, const float *wts, int64_t k,
           int64_t E, int act, float alpha, float limit, float *out, int bits, int threads) {
    int64_t P = T * k;
    experts_t ex1 = {weight_of(fmt1, H, w1), stride1, N1};
    experts_t ex2 = {weight_of(fmt2, I, w2), stride2, N2};
    int64_t *start = moe_scratch(0, sizeof(int64_t) * (4 * E + 3 + 3 * P));
    if (!start) return -1;
    int64_t *fill = start + E + 1, *active = fill + E, *pair = active + E, *row = pair + P;
    int64_t *pstart = row + P, *prow = pstart + E + 1; /* quantized rows: each expert's from a whole tile */
    /* counting sort of the pairs p = t * k + j by expert: pair[r] is the pair at row r, row[p] its row */
    memset(start, 0, sizeof(int64_t) * (E + 1));
    for (int64_t p = 0; p < P; p++) {
        if (ids[p] < 0 || ids[p] >= E) return -2;
        start[ids[p] + 1]++;
    }
    int64_t n_active = 0;
    for (int64_t e = 0; e < E; e++) {
        if (start[e + 1]) active[n_active++] = e;
        start[e + 1] += start[e];
        fill[e] = start[e];
    }
    for (int64_t p = 0; p < P; p++) pair[fill[ids[p]]] = p, row[p] = fill[ids[p]]++;
    pstart[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        pstart[e + 1] = pstart[e] + xq_pad(start[e + 1] - start[e]);
        for (int64_t r = start[e]; r < start[e + 1]; r++) prow[r] = pstart[e] + r - start[e];
    }
    int64_t Pp = pstart[E];

    moe_bytes += n_active * (stride1 + stride2);
    int quant1 = fmt_quantized(fmt1), quant2 = fmt_quantized(fmt2);
    float *xs = moe_scratch(1, sizeof(float) * P * (H > I ? H : I)); /* gathered rows, then the activations */
    float *y1 = moe_scratch(2, sizeof(float) * P * N1);
    float *y2 = moe_scratch(3, sizeof(float) * P * N2);
    if (!xs || !y1 || !y2) return -1;
    xquant_t xq = {NULL, NULL, NULL, NULL, 0, 0};
    if (quant1) { /* quantize each token once, then gather its rows (identical to quantizing the gathered rows) */
        xquant_t tq;
        if (moe_quantize(x, T, xq_pad(T), H, NULL, &tq, 4, bits, xq_super_for(fmt1, bits), threads)) return -1;
        uint8_t *buf = moe_scratch(5, xq_bytes(Pp, H));
        if (!buf) return -1;
        xq = xq_over(buf, Pp, H);
        xq.eight = tq.eight, xq.super = tq.super;
        int64_t G = H / 32;
        GL_OMP(parallel for num_threads(threads) if (P * H >= 65536))
        for (int64_t r = 0; r < P; r++)
            for (int64_t g = 0; g < G; g++) {
                int64_t from = xq_rec(pair[r] / k, G, g), to = xq_rec(prow[r], G, g);
                memcpy(xq.q + 64 * to, tq.q + 64 * from, 64);
                xq.d[to] = tq.d[from];
                xq.s[2 * to] = tq.s[2 * from], xq.s[2 * to + 1] = tq.s[2 * from + 1];
                if (xq.super && g % 8 == 0)
                    memcpy(xq.p + 4 * xq_rec(prow[r], G / 8, g / 8), tq.p + 4 * xq_rec(pair[r] / k, G / 8, g / 8), 16);
            }
    } else {
        GL_OMP(parallel for num_threads(threads) if (P * H >= 65536))
        for (int64_t r = 0; r < P; r++) memcpy(xs + r * H, x + (pair[r] / k) * H, sizeof(float) * H);
    }
    experts_matmul(&ex1, xs, &xq, start, pstart, active, n_active, y1, N1, threads);

    /* bias and activation: xs [P, I] */
    GL_OMP(parallel for num_threads(threads) if (P * I >= 65536))
    for (int64_t r = 0; r < P; r++) {
        int64_t e = ids[pair[r]];
        float *g = y1 + r * N1, *u = g + I, *h = xs + r * I;
        const float *bg = b1 ? b1 + e * 2 * I : NULL, *bu = b1 ? bg + I : NULL;
        for (int64_t i = 0; i < I; i += 16) {
            int n = I - i < 16 ? (int)(I - i) : 16;
            vf gv = vf_load_n(g + i, n), uv = vf_load_n(u + i, n);
            if (b1) gv = vf_add(gv, vf_load_n(bg + i, n)), uv = vf_add(uv, vf_load_n(bu + i, n));
            vf s;
            if (act == ACT_SWIGLU_OAI) {
                gv = vf_min(gv, vf_set1(limit));
                uv = vf_add(vf_max(vf_min(uv, vf_set1(limit)), vf_set1(-limit)), vf_set1(1.0f));
                s = vf_div(gv, vf_add(vf_set1(1.0f), vf_exp(vf_mul(vf_set1(-alpha), gv))));
            } else if (act == ACT_GELU_TANH) { /* as gl_gelu_tanh_mul (Gemma 4's experts) */
                vf y = vf_mul(vf_set1(-1.5957691216057308f),
                              vf_fma(vf_mul(vf_set1(0.044715f), gv), vf_mul(gv, gv), gv));
                s = vf_div(gv, vf_add(vf_set1(1.0f), vf_exp(y)));
            } else {
                s = vf_div(gv, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), gv))));
            }
            vf_store_n(h + i, vf_mul(s, uv), n);
        }
    }
    xquant_t hq = {NULL, NULL, NULL, NULL, 0, 0};
    if (quant2 && moe_quantize(xs, P, Pp, I, prow, &hq, 6, bits, xq_super_for(fmt2, bits), threads)) return -1;
    experts_matmul(&ex2, xs, &hq, start, pstart, active, n_active, y2, N2, threads);

    /* out[t] = sum over j in order of wts[t, j] * (y2 + b2) */
    GL_OMP(parallel for num_threads(threads) if (T * H * k >= 65536))
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * H;
        for (int64_t i = 0; i < H; i += 16) {
            int n = H - i < 16 ? (int)(H - i) : 16;
            vf acc = vf_zero();
            for (int64_t j = 0; j < k; j++) {
                int64_t p = t * k + j;
                vf v = vf_load_n(y2 + row[p] * N2 + i, n);
                if (b2) v = vf_add(v, vf_load_n(b2 + ids[p] * H + i, n));
                acc = vf_fma(vf_set1(wts[p]), v, acc);
            }
            vf_store_n(o + i, acc, n);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------
   the decoder stack: every layer of a step in one call
   ------------------------------------------------------------------------------------------------------------ */

/* One matrix of the stack as gl_matmul reads it: format, blocks, n rows (a multiple of 16) of k values. */
typedef struct {
    int64_t fmt;
    const uint8_t *data;
    int64_t n, k;
} gl_mat_t;

/* One decoder layer's weights and KV pool (NULL pointers: absent). A dense layer has n_gate_up parts of its gate|up
   matrix (1 or 2, 2I rows in all) and down; a MoE layer (n_gate_up 0) the router (choice_bias [E]: added to the
   probabilities for the choice only, GLM-4.5's exp_probs_b), the experts as gl_moe takes them, and a shared expert
   when n_shared_gate_up > 0 (shared_inter rows, SwiGLU, added to the experts' sum). */
typedef struct {
    const float *attn_norm, *ffn_norm, *post_attn_norm, *post_ffn_norm, *q_norm, *k_norm;
    int64_t n_qkv;
    gl_mat_t qkv[3];
    const float *qkv_bias;
    gl_mat_t o;
    const float *o_bias;
    const float *cos_sin; /* [positions, rot_dim] */
    int64_t rot_dim;
    void *k_cache, *v_cache;
    int64_t window;
    const float *sinks;
    int64_t inter; /* I: the dense MLP's intermediate size, or the experts' */
    int64_t n_gate_up;
    gl_mat_t gate_up[2], down;
    gl_mat_t router;
    const float *router_bias, *choice_bias;
    int64_t fmt1, stride1, n1, fmt2, stride2, n2;
    const uint8_t *w1, *w2;
    const float *b1, *b2;
    int64_t shared_inter, n_shared_gate_up;
    gl_mat_t shared_gate_up[2], shared_down;
    /* a Mamba2 layer (mamba 1: no attention; gl_mamba2's weights and this layer's state pools, [slots, ...]) */
    int64_t mamba;
    gl_mat_t ssm_in, ssm_out;
    const float *conv_kernel, *conv_bias, *dt_bias, *ssm_a, *ssm_d, *ssm_norm;
    float *conv_states, *ssm_states;
} gl_layer_t;

/* What every layer shares: widths (H hidden, Hq and Hk heads of D), the pool's format and block size, the MLP
   activation (0 SwiGLU, 1 GeGLU), the experts' (E of them, top_k
   a token, gating 0: top k of the softmax, 2: of the sigmoids, renormalized when norm_topk; 1: softmax of the top k
   logits; their weights times expert_scale; expert_act ACT_* with alpha, limit), eps, the attention scale and soft
   cap. */
typedef struct {
    int64_t n_layers, H, Hq, Hk, D, kvt, block_size, act;
    int64_t E, top_k, gating, norm_topk, expert_act;
    float eps, scale, softcap, expert_scale, alpha, limit;
    int64_t bits; /* the matmuls' activations: 16 or 8 bits (quantize_rows) */
    float residual_scale; /* each layer's output times this before the residual add (Granite) */
    int64_t ssm_inner, ssm_heads, ssm_groups, ssm_n, conv_L; /* the Mamba2 layers' shapes (gl_mamba2) */
} gl_model_t;

static void *stack_scratch(int which, size_t bytes) { return scratch(SCRATCH_STACK + which, bytes); }

/* y [T, ldy] (first n columns) += bias [n] */
static void add_bias(float *y, int64_t T, int64_t n, int64_t ldy, const float *bias) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < n; j++) y[t * ldy + j] += bias[j];
}

/* each row's top k (first index on ties) of logits [T, E] (row stride ld, rows rewritten), as
   gpullama.ops.experts.route: ids [T, k], wts [T, k]; bias [E] (or NULL) is added to the probabilities for the
   choice, not to the weights */
static void route_rows(float *logits, int64_t ld, int64_t T, int64_t E, int64_t k, int64_t gating, int64_t norm,
                       float scale, const float *bias, int64_t *ids, float *wts) {
    for (int64_t t = 0; t < T; t++) {
        float *l = logits + t * ld;
        if (gating == 0) { /* softmax over all experts, then the top k */
            float m = l[0], s = 0.0f;
            for (int64_t e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
            for (int64_t e = 0; e < E; e++) l[e] = expf(l[e] - m), s += l[e];
            for (int64_t e = 0; e < E; e++) l[e] /= s;
        } else if (gating == 2) { /* sigmoid of each, then the top k */
            for (int64_t e = 0; e < E; e++) l[e] = 1.0f / (1.0f + expf(-l[e]));
        }
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            float top = 0.0f;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= ids[t * k + i] == e;
                float v = bias ? l[e] + bias[e] : l[e];
                if (!taken && (best < 0 || v > top)) best = e, top = v;
            }
            ids[t * k + j] = best, wts[t * k + j] = l[best];
        }
        float *w = wts + t * k;
        if (gating == 1) { /* softmax of the chosen logits (the first is their largest) */
            float s = 0.0f, m = w[0];
            for (int64_t j = 0; j < k; j++) w[j] = expf(w[j] - m), s += w[j];
            for (int64_t j = 0; j < k; j++) w[j] /= s;
        } else if (norm) { /* the sum clamped at float16's smallest normal, as llama.cpp */
            float s = 0.0f;
            for (int64_t j = 0; j < k; j++) s += w[j];
            s = s < 6.103515625e-5f ? 6.103515625e-5f : s;
            for (int64_t j = 0; j < k; j++) w[j] /= s;
        }
        if (scale != 1.0f)
            for (int64_t j = 0; j < k; j++) w[j] *= scale;
    }
}

/* x [T, K] (row stride ldx) @ the parts' rows, side by side in y [T, ldy] */
static int mat_parts(const gl_mat_t *parts, int64_t n_parts, const float *x, int64_t T, int64_t ldx, float *y,
                     int64_t ldy, int bits, int threads) {
    /* x quantized once for all the quantized parts (the same K), again where a part needs the other scale span */
    xquant_t xq = {NULL, NULL, NULL, NULL, 0, 0};
    for (int64_t i = 0, off = 0; i < n_parts; off += parts[i].n, i++) {
        int fmt = (int)parts[i].fmt;
        if (fmt_quantized(fmt) && (!xq.q || xq.super != xq_super_for(fmt, bits)) &&
            matmul_quantize(fmt, x, T, parts[i].k, ldx, &xq, bits, threads))
            return -1;
        matmul_quantized(fmt, x, T, parts[i].k, ldx, &xq, parts[i].data, parts[i].n, y + off, ldy, threads);
    }
    return 0;
}

/* A LoRA adapter's low-rank pair on one matrix (gpullama/lora.py): y[t, off : off + n] += s_t * B (A x_t), A [r, k]
   and bt = B transposed [r, n], float32 (B already times alpha / r). An adapter's pairs on one layer by site (0:
   q|k|v, up to 3; 1: o; 2: gate|up, up to 2; 3: down), n[site] of them. A group: the rows of a step that use one
   adapter, each with its scale, and that adapter's layers. */
typedef struct {
    int64_t off, n, k, r;
    const float *a, *bt;
} gl_lora_t;
typedef struct {
    int64_t n[4];
    gl_lora_t p[4][3];
} gl_lora_layer_t;
typedef struct {
    const gl_lora_layer_t *layers;
    int64_t R;
    const int64_t *rows;
    const float *scales;
} gl_lora_group_t;
#define GL_MAX_LORA_RANK 512

/* a . b over n floats, in 16 independent partial sums (so the compiler keeps them in vector registers) */
static float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t c = 0;
    for (; c + 16 <= n; c += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[c + j] * b[c + j];
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s += acc[j];
    for (; c < n; c++) s += a[c] * b[c];
    return s;
}

/* adds every group's low-rank products of site `site` of layer `layer` to y (x [T, ldx] its matrix's input) */
static void lora_add(const gl_lora_group_t *groups, int64_t n_groups, int64_t layer, int site, const float *x,
                     int64_t ldx, float *y, int64_t ldy) {
    for (int64_t g = 0; g < n_groups; g++) {
        const gl_lora_layer_t *l = groups[g].layers + layer;
        for (int64_t j = 0; j < l->n[site]; j++) {
            const gl_lora_t *p = &l->p[site][j];
            int64_t r = p->r, k = p->k, n = p->n;
            for (int64_t q = 0; q < groups[g].R; q++) {
                int64_t t = groups[g].rows[q];
                float *yt = y + t * ldy + p->off;
                for (int64_t i = 0; i < r; i++) {
                    float v = dot_f32(p->a + i * k, x + t * ldx, k) * groups[g].scales[q];
                    const float *b = p->bt + i * n;
                    for (int64_t c = 0; c < n; c++) yt[c] += b[c] * v;
                }
            }
        }
    }
}

static float *free_buffer(float *const bufs[3], const float *a, const float *b) {
    for (int i = 0; i < 3; i++)
        if (bufs[i] != a && bufs[i] != b) return bufs[i];
    return NULL;
}

/* Every decoder layer of a step, as gpullama.model.Decoder.forward_pooled's loop runs them one op at a time (the
   same kernels in the same order, so the same bits; a MoE layer's routing in route_rows): hidden [T, H] (the
   embeddings) in, the last layer's output in hidden and the residual stream in residual (their sum is what the
   output norm reads). The step's metadata as gl_rope_and_cache and gl_attention take it; `lora` (n_lora groups, or
   NULL and 0) the LoRA adapters of the step's rows, added after each dense matrix as the loop adds them. Returns 0,
   -1 when out of memory. */
int gl_decoder(const gl_model_t *m, const gl_layer_t *layers, int64_t T, float *hidden, float *residual,
               const int64_t *positions, const int64_t *slots, int64_t B, const int32_t *query_start,
               const int32_t *seq_lens, const int32_t *block_tables, int64_t ldb, const gl_lora_group_t *lora,
               int64_t n_lora, const int64_t *state_slots, int threads) {
    int64_t H = m->H, D = m->D, qs = m->Hq * D, kvs = m->Hk * D, W = 0, G = 0;
    int64_t O = qs > m->ssm_inner ? qs : m->ssm_inner; /* the attention's output, or the Mamba2 mixer's */
    int bits = (int)m->bits;
    size_t A = 0;
    for (int64_t i = 0; i < m->n_layers; i++) {
        const gl_layer_t *l = layers + i;
        int64_t w = 0, g = l->n_gate_up ? 2 * l->inter : l->router.n;
        size_t a = l->n_gate_up ? sizeof(float) * T * l->inter : (sizeof(int64_t) + sizeof(float)) * T * m->top_k;
        if (l->n_shared_gate_up) {
            g = 2 * l->shared_inter > g ? 2 * l->shared_inter : g;
            a = sizeof(float) * T * l->shared_inter > a ? sizeof(float) * T * l->shared_inter : a;
        }
        for (int64_t p = 0; p < l->n_qkv; p++) w += l->qkv[p].n;
        if (l->mamba) w = l->ssm_in.n;
        W = w > W ? w : W, G = g > G ? g : G, A = a > A ? a : A;
    }
    float *hbuf = stack_scratch(0, sizeof(float) * 3 * T * H), *x = stack_scratch(1, sizeof(float) * T * H);
    float *qkv = stack_scratch(2, sizeof(float) * T * W), *attn = stack_scratch(3, sizeof(float) * T * O);
    float *gu = stack_scratch(4, sizeof(float) * T * G);
    float *act = stack_scratch(5, A);
    if (!hbuf || !x || !qkv || !attn || !gu || !act) return -1;
    float *const bufs[3] = {hbuf, hbuf + T * H, hbuf + 2 * T * H};
    float *hid = bufs[0], *res = NULL;
    memcpy(hid, hidden, sizeof(float) * T * H);
    for (int64_t i = 0; i < m->n_layers; i++) {
        const gl_layer_t *l = layers + i;
        gl_rms_norm(hid, res, m->residual_scale, l->attn_norm, m->eps, T, H, x, threads);
        res = hid;
        if (l->mamba) { /* in_proj, the mixer (convolution, scan, gate, norm), out_proj */
            int64_t n_in = l->ssm_in.n;
            if (gl_matmul((int)l->ssm_in.fmt, x, T, H, H, l->ssm_in.data, n_in, qkv, n_in, bits, threads) ||
                gl_mamba2(qkv, n_in, T, m->ssm_inner, m->ssm_heads, m->ssm_groups, m->ssm_n, m->conv_L, l->conv_kernel,
                          l->conv_bias, l->dt_bias, l->ssm_a, l->ssm_d, l->ssm_norm, m->eps, l->conv_states,
                          l->ssm_states, state_slots, positions, query_start, B, attn, threads))
                return -1;
            hid = free_buffer(bufs, res, NULL);
            if (gl_matmul((int)l->ssm_out.fmt, attn, T, m->ssm_inner, m->ssm_inner, l->ssm_out.data, l->ssm_out.n, hid,
                          H, bits, threads))
                return -1;
            goto ffn;
        }
        int64_t w = 0;
        for (int64_t p = 0; p < l->n_qkv; p++) w += l->qkv[p].n;
        if (mat_parts(l->qkv, l->n_qkv, x, T, H, qkv, w, bits, threads)) return -1;
        lora_add(lora, n_lora, i, 0, x, H, qkv, w);
        if (l->qkv_bias) add_bias(qkv, T, qs + 2 * kvs, w, l->qkv_bias);
        if (l->q_norm)
            for (int64_t t = 0; t < T; t++) {
                gl_rms_norm(qkv + t * w, NULL, 1.0f, l->q_norm, m->eps, m->Hq, D, qkv + t * w, 1);
                gl_rms_norm(qkv + t * w + qs, NULL, 1.0f, l->k_norm, m->eps, m->Hk, D, qkv + t * w + qs, 1);
            }
        gl_rope_and_cache(qkv, w, qkv + qs, w, qkv + qs + kvs, w, T, m->Hq, m->Hk, D, l->rot_dim, l->cos_sin,
                          positions, slots, m->block_size, (int)m->kvt, l->k_cache, l->v_cache, threads);
        if (gl_attention_sinks((int)m->kvt, qkv, w, l->k_cache, l->v_cache, m->block_size, m->Hq, m->Hk, D, B,
                               query_start, seq_lens, block_tables, ldb, m->scale, l->window, m->softcap, l->sinks,
                               attn, threads))
            return -1;
        hid = free_buffer(bufs, res, NULL);
        if (gl_matmul((int)l->o.fmt, attn, T, qs, qs, l->o.data, l->o.n, hid, H, bits, threads)) return -1;
        lora_add(lora, n_lora, i, 1, attn, qs, hid, H);
        if (l->o_bias) add_bias(hid, T, H, H, l->o_bias);
        if (l->post_attn_norm) {
            float *y = free_buffer(bufs, res, hid);
            gl_rms_norm(hid, NULL, 1.0f, l->post_attn_norm, m->eps, T, H, y, threads);
            hid = y;
        }
    ffn:
        gl_rms_norm(hid, res, m->residual_scale, l->ffn_norm, m->eps, T, H, x, threads);
        res = hid;
        hid = free_buffer(bufs, res, NULL);
        if (l->n_gate_up) {
            int64_t I = l->inter;
            if (mat_parts(l->gate_up, l->n_gate_up, x, T, H, gu, 2 * I, bits, threads)) return -1;
            lora_add(lora, n_lora, i, 2, x, H, gu, 2 * I);
            if (m->act == 1) gl_gelu_tanh_mul(gu, T, I, act, threads);
            else gl_silu_mul(gu, T, I, act, threads);
            if (gl_matmul((int)l->down.fmt, act, T, I, I, l->down.data, l->down.n, hid, H, bits, threads)) return -1;
            lora_add(lora, n_lora, i, 3, act, I, hid, H);
        } else {
            int64_t *ids = (int64_t *)act;
            float *wts = (float *)(ids + T * m->top_k);
            if (gl_matmul((int)l->router.fmt, x, T, H, H, l->router.data, l->router.n, gu, l->router.n, bits,
                          threads))
                return -1;
            if (l->router_bias) add_bias(gu, T, m->E, l->router.n, l->router_bias);
            route_rows(gu, l->router.n, T, m->E, m->top_k, m->gating, m->norm_topk, m->expert_scale, l->choice_bias,
                       ids, wts);
            if (gl_moe((int)l->fmt1, l->w1, l->stride1, l->n1, l->b1, (int)l->fmt2, l->w2, l->stride2, l->n2, l->b2,
                       x, T, H, l->inter, ids, wts, m->top_k, m->E, (int)m->expert_act, m->alpha, m->limit, hid, bits,
                       threads))
                return -1;
            if (l->n_shared_gate_up) { /* the shared expert, added to the experts' sum */
                int64_t I = l->shared_inter;
                float *y = free_buffer(bufs, res, hid);
                if (mat_parts(l->shared_gate_up, l->n_shared_gate_up, x, T, H, gu, 2 * I, bits, threads)) return -1;
                gl_silu_mul(gu, T, I, act, threads);
                if (gl_matmul((int)l->shared_down.fmt, act, T, I, I, l->shared_down.data, l->shared_down.n, y, H,
                              bits, threads))
                    return -1;
                for (int64_t j = 0; j < T * H; j++) hid[j] += y[j];
            }
        }
        if (l->post_ffn_norm) {
            float *y = free_buffer(bufs, res, hid);
            gl_rms_norm(hid, NULL, 1.0f, l->post_ffn_norm, m->eps, T, H, y, threads);
            hid = y;
        }
    }
    memcpy(hidden, hid, sizeof(float) * T * H);
    memcpy(residual, res, sizeof(float) * T * H);
    return 0;
}

const char *gl_isa(void) { return GL_ISA; }
