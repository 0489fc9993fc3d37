/* bf16 storage for the native kernels (bf16.c's products, norms.c's bf16 rows): 16-float
 * vectors, bf16 to fp32 (exact) and fp32 to bf16 rounded to nearest even as torch rounds. */
#ifndef CANVAS_BF16_H
#define CANVAS_BF16_H
#include <stdint.h>
#include <string.h>

#define BV 16 /* floats per vector */
typedef uint16_t bf16;
typedef float bvf __attribute__((vector_size(BV * 4)));
typedef uint32_t bvu __attribute__((vector_size(BV * 4)));
typedef uint16_t bvh __attribute__((vector_size(BV * 2)));

static inline float bf_to_f(bf16 h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline bf16 f_to_bf(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (bf16)((bits >> 16) | 0x40u); /* quiet NaN */
    return (bf16)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#ifdef __AVX512F__
#include <immintrin.h>
/* The widening and narrowing of 16 lanes as one instruction each (vpmovzxwd, vpmovdw): GCC
 * splits `__builtin_convertvector` between 16-bit and 32-bit lanes into halves and shuffles,
 * which cost the bf16 rows more than their arithmetic. The same values. */
static inline bvu widen16(const bf16 *p) {
    return (bvu)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
}
static inline void narrow16(bf16 *p, bvu v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16((__m512i)v));
}
#else
static inline bvu widen16(const bf16 *p) {
    bvh h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, bvu);
}
static inline void narrow16(bf16 *p, bvu v) {
    const bvh h = __builtin_convertvector(v, bvh);
    memcpy(p, &h, sizeof h);
}
#endif

/* BV bf16 at p as fp32. */
static inline bvf load_bf16(const bf16 *p) { return (bvf)(widen16(p) << 16); }

#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define BF_CVTNE 1
/* vcvtneps2bf16 rounds as `round16` does (to nearest even, a NaN to its quiet NaN) but for
 * denormal inputs, which it flushes to zero: it takes vectors without one, `round16` the rest,
 * so the bits never depend on the CPU. */
static inline int cvtne_takes(bvf v) { return _mm512_fpclass_ps_mask((__m512)v, 0x20) == 0; }
static inline bvu cvtne16(bvf v) {
    return (bvu)_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)v));
}
#else
#define BF_CVTNE 0
static inline int cvtne_takes(bvf v) { return (void)v, 0; }
static inline bvu cvtne16(bvf v) { return (bvu)v; }
#endif

/* v's BV values as bf16 in the low halves of 32-bit lanes: to nearest even, NaN to a quiet
 * NaN (torch's rounding). */
static inline bvu round16(bvf v) {
    if (BF_CVTNE && cvtne_takes(v)) return cvtne16(v);
    bvu bits;
    memcpy(&bits, &v, sizeof bits);
    bvu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    bvu nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
    return (rounded & ~nan) | (((bits >> 16) | 0x40u) & nan);
}

/* fp32 -> bf16 for BV values, round to nearest even; NaN stays a quiet NaN. */
static inline void store_bf16(bf16 *p, bvf v) { narrow16(p, round16(v)); }

/* v rounded to bf16 (nearest even), as fp32. */
static inline bvf bround(bvf v) { return (bvf)(round16(v) << 16); }

static inline bvf bload(const void *p) {
    bvf v;
    memcpy(&v, p, sizeof v);
    return v;
}

#endif
