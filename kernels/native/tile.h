/* The register tile the native products share (moe.c's experts and dense projections,
 * attention.c's scores and values) and its vector helpers: MOE_V floats per vector (AVX-512:
 * 16, else 8), MOE_MR rows per tile. */
#ifndef CANVAS_TILE_H
#define CANVAS_TILE_H
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define MOE_V 16
#define MOE_MR 8
#else
#define MOE_V 8
#define MOE_MR 6
#endif
typedef float mv __attribute__((vector_size(MOE_V * 4)));
typedef int32_t mvi __attribute__((vector_size(MOE_V * 4)));

static inline mv mload(const float *p) {
    mv v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void mstore(float *p, mv v) { memcpy(p, &v, sizeof v); }

static inline mv mfloor(mv y) { /* floor for |y| < 2^31 */
    mv t = __builtin_convertvector(__builtin_convertvector(y, mvi), mv);
    return t + __builtin_convertvector((mvi)(t > y), mv); /* a true lane is -1 */
}

static inline mv mexp(mv x) { /* x in [-80, 80]: 2^n exp(r), a Cephes polynomial for exp(r) */
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    mv n = mfloor(x * log2e + 0.5f);
    mv r = x - n * ln2_hi - n * ln2_lo;
    mv p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    mvi bits = (__builtin_convertvector(n, mvi) + 127) << 23;
    return p * (mv)bits;
}

static inline mv mclamp(mv x, float lo, float hi) { /* NaN stays NaN only through x below */
    mvi low = x < lo, high = x > hi;
    mv l = (mv){0} + lo, h = (mv){0} + hi;
    x = (mv)(((mvi)x & ~low) | ((mvi)l & low));
    return (mv)(((mvi)x & ~high) | ((mvi)h & high));
}

static inline mv mgelu_tanh(mv x) { /* x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) */
    mv z = x * (-1.5957691216057308f - 0.0713548162726009f * x * x);
    return x / (mexp(mclamp(z, -80.0f, 80.0f)) + 1.0f);
}

/* The register tile every product here runs: rows a[0..MR) times a packed block b [k_dim, 2V]
 * (for input k, 2V weights), y0 and y1 the block's two vectors of outputs per row, each sum
 * over k in order. Inlined: the 2 x MR accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_2v(const float *const *a, const float *b,
                                                          int64_t k_dim, mv *y0, mv *y1) {
    for (int r = 0; r < MOE_MR; ++r) y0[r] = y1[r] = (mv){0};
    for (int64_t k = 0; k < k_dim; ++k) {
        mv b0 = mload(b + k * 2 * MOE_V), b1 = mload(b + k * 2 * MOE_V + MOE_V);
#pragma GCC unroll 16
        for (int r = 0; r < MOE_MR; ++r) {
            float s = a[r][k];
            y0[r] += s * b0;
            y1[r] += s * b1;
        }
    }
}

#endif
