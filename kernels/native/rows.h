/* Row helpers of the native norms (norms.c) and the step's per-token kernels (step.c):
 * 8-float vectors, a row's inverse RMS and its scaling, every sum in a fixed order (vector
 * lanes, then the lanes in order, then the scalar tail). */
#ifndef CANVAS_ROWS_H
#define CANVAS_ROWS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float vf __attribute__((vector_size(32)));
#define W 8

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline float inv_rms(const float *x, int64_t h, float eps) {
    vf acc = {0};
    int64_t i = 0;
    for (; i + W <= h; i += W) {
        vf v = load(x + i);
        acc += v * v;
    }
    float sum = 0.0f;
    for (int j = 0; j < W; ++j) sum += acc[j];
    for (; i < h; ++i) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)h + eps);
}

/* out = (x * inv) * w (w NULL: x * inv), then + add (add NULL: nothing). out may be x. */
static inline void scale_row(float *out, const float *x, float inv, const float *w,
                             const float *add, int64_t h) {
    int64_t i = 0;
    for (; i + W <= h; i += W) {
        vf y = load(x + i) * inv;
        if (w) y = y * load(w + i);
        if (add) y = y + load(add + i);
        store(out + i, y);
    }
    for (; i < h; ++i) {
        float y = x[i] * inv;
        if (w) y = y * w[i];
        if (add) y = y + add[i];
        out[i] = y;
    }
}

#endif
