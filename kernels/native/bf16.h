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

/* BV bf16 at p as fp32. */
static inline bvf load_bf16(const bf16 *p) {
    bvh h;
    memcpy(&h, p, sizeof h);
    return (bvf)(__builtin_convertvector(h, bvu) << 16);
}

/* fp32 -> bf16 for BV values, round to nearest even; NaN stays a quiet NaN. */
static inline void store_bf16(bf16 *p, bvf v) {
    bvu bits;
    memcpy(&bits, &v, sizeof bits);
    bvu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    bvu nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
    rounded = (rounded & ~nan) | (((bits >> 16) | 0x40u) & nan);
    const bvh h = __builtin_convertvector(rounded, bvh);
    memcpy(p, &h, sizeof h);
}

/* v rounded to bf16 (nearest even), as fp32. */
static inline bvf bround(bvf v) {
    bvu bits;
    memcpy(&bits, &v, sizeof bits);
    bvu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    bvu nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
    rounded = (rounded & ~nan) | ((bits | 0x400000u) & 0xFFFF0000u & nan);
    return (bvf)rounded;
}

static inline bvf bload(const void *p) {
    bvf v;
    memcpy(&v, p, sizeof v);
    return v;
}

#endif
