/* Canvas' fused CPU norms: the fast-numerics twins of `kernels.reference.rms_norm_fused` and of a
 * DiffusionGemma layer's norm tails (`kernels.reference_layer`: add_rms_norm, rms_norm_pair,
 * close_layer), one row at a time with the row in the core's cache, where the twins make 3 to
 * 10 passes over the whole [N, H] activations (each a memory pass at a prefill's or 16
 * canvases' size).
 *
 * Gemma's RMSNorm: y = x * inv * w, inv = 1 / sqrt(mean(x^2) + eps), rounded as the twin
 * rounds it ((x * inv) * w). Every sum runs in a fixed order (vector lanes, then the lanes in
 * order, then the scalar tail), so a row's value never depends on its batch; the values differ
 * from the twins' in the last bits (their sums run in ATen's order). fp32, contiguous rows; the
 * `_bf16` kernels take bf16 rows and weights, compute in fp32 and round to bf16 where the bf16
 * twins round (each norm's output, each sum of two bf16 tensors, the layer scalar's product).
 * GCC/Clang vector extensions; the rows split among threads as `parallel.h` says (on torch's
 * OpenMP team where built with OpenMP, else in ranges the Python side hands to its threads:
 * `kernels.native.threads.split_rows`).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "parallel.h"
#include "rows.h"

/* rms_norm(x, w) (+ residual when residual is not NULL: add_rms_norm). */
static void rms_norm_rows(const float *x, const float *w, const float *residual, float *out,
                          int64_t row_begin, int64_t row_end, int64_t h, float eps) {
    for (int64_t r = row_begin; r < row_end; ++r) {
        const float *xr = x + r * h;
        scale_row(out + r * h, xr, inv_rms(xr, h, eps), w, residual ? residual + r * h : 0, h);
    }
}

/* (rms_norm(x, wa), rms_norm(x, wb)) from one mean square. */
static void rms_norm_pair_rows(const float *x, const float *wa, const float *wb, float *out_a,
                               float *out_b, int64_t row_begin, int64_t row_end, int64_t h,
                               float eps) {
    for (int64_t r = row_begin; r < row_end; ++r) {
        const float *xr = x + r * h;
        float inv = inv_rms(xr, h, eps);
        scale_row(out_a + r * h, xr, inv, wa, 0, h);
        scale_row(out_b + r * h, xr, inv, wb, 0, h);
    }
}

/* (residual + rms_norm(rms_norm(dense, wd) + rms_norm(moe, wm), w)) * scale, scale one value
 * (scale_per_row 0) or one per row. */
static void close_layer_rows(const float *dense, const float *moe, const float *residual,
                             const float *wd, const float *wm, const float *w,
                             const float *scale, int64_t scale_per_row, float *out,
                             int64_t row_begin, int64_t row_end, int64_t h, float eps) {
    for (int64_t r = row_begin; r < row_end; ++r) {
        const float *d = dense + r * h, *m = moe + r * h, *res = residual + r * h;
        float *o = out + r * h;
        scale_row(o, d, inv_rms(d, h, eps), wd, 0, h);
        float inv_m = inv_rms(m, h, eps);
        int64_t i = 0;
        for (; i + W <= h; i += W) store(o + i, load(o + i) + load(m + i) * inv_m * load(wm + i));
        for (; i < h; ++i) o[i] = o[i] + m[i] * inv_m * wm[i];
        scale_row(o, o, inv_rms(o, h, eps), w, res, h);
        const float s = scale[scale_per_row ? r : 0];
        for (i = 0; i + W <= h; i += W) store(o + i, load(o + i) * s);
        for (; i < h; ++i) o[i] = o[i] * s;
    }
}

/* The exported kernels: rows [begin, end) on `threads` threads (parallel.h). */
CANVAS_DEFINE_OPENMP(canvas_norms_openmp)

/* Each call's arguments, one struct (`kernels.native.args`: the same fields in the same order). */
typedef struct {
    const float *x, *w, *residual; /* residual NULL: rms_norm, else add_rms_norm */
    float *out;
    int64_t begin, end, h;
    float eps;
    int64_t threads;
} NormArgs;

typedef struct {
    const float *x, *wa, *wb;
    float *out_a, *out_b;
    int64_t begin, end, h;
    float eps;
    int64_t threads;
} NormPairArgs;

typedef struct {
    const float *dense, *moe, *residual, *wd, *wm, *w, *scale;
    int64_t scale_per_row;
    float *out;
    int64_t begin, end, h;
    float eps;
    int64_t threads;
} CloseLayerArgs;

void canvas_rms_norm(const NormArgs *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  rms_norm_rows(a->x, a->w, a->residual, a->out, b, e, a->h, a->eps));
}
void canvas_rms_norm_pair(const NormPairArgs *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  rms_norm_pair_rows(a->x, a->wa, a->wb, a->out_a, a->out_b, b, e, a->h, a->eps));
}
void canvas_close_layer(const CloseLayerArgs *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  close_layer_rows(a->dense, a->moe, a->residual, a->wd, a->wm, a->w, a->scale,
                                   a->scale_per_row, a->out, b, e, a->h, a->eps));
}

/* ---- bf16 rows ---------------------------------------------------------------------------- */

static inline float inv_rms_bf16(const bf16 *x, int64_t h, float eps) {
    bvf acc = {0};
    int64_t i = 0;
    for (; i + BV <= h; i += BV) {
        const bvf v = load_bf16(x + i);
        acc += v * v;
    }
    float sum = 0.0f;
    for (int j = 0; j < BV; ++j) sum += acc[j];
    for (; i < h; ++i) sum += bf_to_f(x[i]) * bf_to_f(x[i]);
    return 1.0f / sqrtf(sum / (float)h + eps);
}

/* out = bf16((x * inv) * w) (w NULL: x * inv), then bf16(out + add) (add NULL: nothing), or
 * out may be x. */
static inline void scale_row_bf16(bf16 *out, const bf16 *x, float inv, const bf16 *w,
                                  const bf16 *add, int64_t h) {
    int64_t i = 0;
    for (; i + BV <= h; i += BV) {
        bvf y = load_bf16(x + i) * inv;
        if (w) y = y * load_bf16(w + i);
        if (add) y = bround(y) + load_bf16(add + i);
        store_bf16(out + i, y);
    }
    for (; i < h; ++i) {
        float y = bf_to_f(x[i]) * inv;
        if (w) y = y * bf_to_f(w[i]);
        if (add) y = bf_to_f(f_to_bf(y)) + bf_to_f(add[i]);
        out[i] = f_to_bf(y);
    }
}

static void rms_norm_rows_bf16(const bf16 *x, const bf16 *w, const bf16 *residual, bf16 *out,
                               int64_t row_begin, int64_t row_end, int64_t h, float eps) {
    for (int64_t r = row_begin; r < row_end; ++r) {
        const bf16 *xr = x + r * h;
        scale_row_bf16(out + r * h, xr, inv_rms_bf16(xr, h, eps), w,
                       residual ? residual + r * h : 0, h);
    }
}

static void rms_norm_pair_rows_bf16(const bf16 *x, const bf16 *wa, const bf16 *wb, bf16 *out_a,
                                    bf16 *out_b, int64_t row_begin, int64_t row_end, int64_t h,
                                    float eps) {
    for (int64_t r = row_begin; r < row_end; ++r) {
        const bf16 *xr = x + r * h;
        const float inv = inv_rms_bf16(xr, h, eps);
        scale_row_bf16(out_a + r * h, xr, inv, wa, 0, h);
        scale_row_bf16(out_b + r * h, xr, inv, wb, 0, h);
    }
}

/* The twin's close_layer in bf16: d = bf16(norm(dense)), m = bf16(norm(moe)), s = bf16(d + m),
 * o = bf16(bf16(norm(s)) + residual), out = bf16(o * scale). */
static void close_layer_rows_bf16(const bf16 *dense, const bf16 *moe, const bf16 *residual,
                                  const bf16 *wd, const bf16 *wm, const bf16 *w,
                                  const bf16 *scale, int64_t scale_per_row, bf16 *out,
                                  int64_t row_begin, int64_t row_end, int64_t h, float eps) {
    for (int64_t r = row_begin; r < row_end; ++r) {
        const bf16 *d = dense + r * h, *m = moe + r * h, *res = residual + r * h;
        bf16 *o = out + r * h;
        scale_row_bf16(o, d, inv_rms_bf16(d, h, eps), wd, 0, h);
        const float inv_m = inv_rms_bf16(m, h, eps);
        int64_t i = 0;
        for (; i + BV <= h; i += BV)
            store_bf16(o + i, load_bf16(o + i) + bround(load_bf16(m + i) * inv_m * load_bf16(wm + i)));
        for (; i < h; ++i)
            o[i] = f_to_bf(bf_to_f(o[i]) + bf_to_f(f_to_bf(bf_to_f(m[i]) * inv_m * bf_to_f(wm[i]))));
        scale_row_bf16(o, o, inv_rms_bf16(o, h, eps), w, res, h);
        const float s = bf_to_f(scale[scale_per_row ? r : 0]);
        for (i = 0; i + BV <= h; i += BV) store_bf16(o + i, load_bf16(o + i) * s);
        for (; i < h; ++i) o[i] = f_to_bf(bf_to_f(o[i]) * s);
    }
}

/* The fp32 kernels' structs with bf16 rows (the same fields: `kernels.native.args`). */
typedef struct {
    const bf16 *x, *w, *residual;
    bf16 *out;
    int64_t begin, end, h;
    float eps;
    int64_t threads;
} NormBf16Args;

typedef struct {
    const bf16 *x, *wa, *wb;
    bf16 *out_a, *out_b;
    int64_t begin, end, h;
    float eps;
    int64_t threads;
} NormPairBf16Args;

typedef struct {
    const bf16 *dense, *moe, *residual, *wd, *wm, *w, *scale;
    int64_t scale_per_row;
    bf16 *out;
    int64_t begin, end, h;
    float eps;
    int64_t threads;
} CloseLayerBf16Args;

void canvas_rms_norm_bf16(const NormBf16Args *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  rms_norm_rows_bf16(a->x, a->w, a->residual, a->out, b, e, a->h, a->eps));
}
void canvas_rms_norm_pair_bf16(const NormPairBf16Args *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  rms_norm_pair_rows_bf16(a->x, a->wa, a->wb, a->out_a, a->out_b, b, e, a->h,
                                          a->eps));
}
void canvas_close_layer_bf16(const CloseLayerBf16Args *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  close_layer_rows_bf16(a->dense, a->moe, a->residual, a->wd, a->wm, a->w,
                                        a->scale, a->scale_per_row, a->out, b, e, a->h, a->eps));
}
