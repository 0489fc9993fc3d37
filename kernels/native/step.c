/* Canvas' per-token CPU kernels of a forward, the fast-numerics twins of
 * `kernels.reference.qkv_norm_rope` (attention's per-head RMS norms and RoPE),
 * `kernels.reference.route_experts` (the router: norm, scores, top-k, softmax over the chosen),
 * `kernels.reference_layer.gated_act` (GeGLU) and `kernels.reference.philox_uniform` (the
 * sampler's counter-based random numbers, bit for bit), bound from `kernels.native.step`.
 *
 * The twins are ATen sequences of 5 to 16 passes over [tokens, heads, dim] or [tokens, hidden]
 * (norm, two half-width products per RoPE half, topk, softmax, gathers); at a small model's
 * canvas steps their dispatches and passes cost several times the arithmetic. Here every token is one pass with its rows in the core's cache. Every sum runs in
 * a fixed order (rows.h), so a token's values never depend on its batch; they differ from the
 * twins' in the last bits (ATen's sums and BLAS's order; GELU's tanh as x * sigmoid(2u)).
 * `canvas_qkv_norm_rope_bf16` takes bf16 tensors, computes in fp32 and rounds where the bf16
 * twin rounds (the norm's output, each RoPE product, their sum).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "parallel.h"
#include "rows.h"
#include "tile.h"

/* out = (x1 c - x2 s, x2 c + x1 s) for the halves x1, x2 of x [d] and c, s the first halves
 * of the token's cos and sin. */
static void rope_row(float *out, const float *x, const float *c, const float *s, int64_t d) {
    const int64_t half = d / 2;
    int64_t i = 0;
    for (; i + W <= half; i += W) {
        vf x1 = load(x + i), x2 = load(x + half + i), cc = load(c + i), ss = load(s + i);
        store(out + i, x1 * cc - x2 * ss);
        store(out + half + i, x2 * cc + x1 * ss);
    }
    for (; i < half; ++i) {
        float x1 = x[i], x2 = x[half + i];
        out[i] = x1 * c[i] - x2 * s[i];
        out[half + i] = x2 * c[i] + x1 * s[i];
    }
}

/* Tokens [b, e): q's and k's heads normed with their weights and rotated, v's heads normed.
 * ld: q's, k's and v's elements from one token to the next (their heads contiguous: columns of
 * one projection's output over q, k and v); the outputs contiguous. */
static void qkv_rows(const float *q, const float *k, const float *v, const float *qw,
                     const float *kw, const float *cos, const float *sin, float *qo, float *ko,
                     float *vo, int64_t hq, int64_t hkv, int64_t d, const int64_t *ld, float eps,
                     int64_t b, int64_t e) {
    float tmp[d];
    for (int64_t r = b; r < e; ++r) {
        const float *c = cos + r * d, *s = sin + r * d;
        for (int64_t j = 0; j < hq; ++j) {
            const float *x = q + r * ld[0] + j * d;
            scale_row(tmp, x, inv_rms(x, d, eps), qw, 0, d);
            rope_row(qo + (r * hq + j) * d, tmp, c, s, d);
        }
        for (int64_t j = 0; j < hkv; ++j) {
            const float *x = k + r * ld[1] + j * d, *y = v + r * ld[2] + j * d;
            scale_row(tmp, x, inv_rms(x, d, eps), kw, 0, d);
            rope_row(ko + (r * hkv + j) * d, tmp, c, s, d);
            scale_row(vo + (r * hkv + j) * d, y, inv_rms(y, d, eps), 0, 0, d);
        }
    }
}

/* x's d bf16 values as fp32 (exact). */
static inline void row_to_f32(float *out, const bf16 *x, int64_t d) {
    int64_t i = 0;
    for (; i + BV <= d; i += BV) {
        const bvf v = load_bf16(x + i);
        memcpy(out + i, &v, sizeof v);
    }
    for (; i < d; ++i) out[i] = bf_to_f(x[i]);
}

/* Tokens [b, e) of the router: h = rms_norm(x, scale) / sqrt(H); scores = proj @ h; the top_k
 * scores (largest first, the lower expert on a tie); weights = softmax over them times each
 * chosen expert's per_expert_scale. The projection comes transposed and padded (`projt`
 * [H, ep], ep a multiple of V, zeros past the experts), so a token's scores are V experts per
 * vector (four partial sums over the hidden units, in a fixed order): one FMA per unit and
 * block of experts, where the [E, H] rows took a dot product and a horizontal sum each. */
static void route_rows(const float *x, const bf16 *xb, const float *scale, const float *projt,
                       const float *pes, float *weights, int64_t *ids, int64_t hidden,
                       int64_t experts, int64_t ep, int64_t top_k, float eps, int64_t b,
                       int64_t e) {
    float h[hidden], scores[ep], xf[xb ? hidden : 1];
    const float root = 1.0f / sqrtf((float)hidden);
    for (int64_t r = b; r < e; ++r) {
        const float *xr = x + r * hidden;
        if (xb) row_to_f32(xf, xb + r * hidden, hidden), xr = xf;
        scale_row(h, xr, inv_rms(xr, hidden, eps), scale, 0, hidden);
        for (int64_t i = 0; i < hidden; ++i) h[i] *= root;
        for (int64_t j = 0; j < ep; j += MOE_V) { /* four chains: FMA latency, not a chain */
            mv acc[4] = {{0}, {0}, {0}, {0}};
            int64_t i = 0;
            for (; i + 4 <= hidden; i += 4)
                for (int c = 0; c < 4; ++c) acc[c] += h[i + c] * mload(projt + (i + c) * ep + j);
            for (; i < hidden; ++i) acc[0] += h[i] * mload(projt + i * ep + j);
            mstore(scores + j, (acc[0] + acc[1]) + (acc[2] + acc[3]));
        }
        float *w = weights + r * top_k, sum = 0.0f;
        int64_t *id = ids + r * top_k;
        for (int64_t t = 0; t < top_k; ++t) {
            int64_t best = -1;
            for (int64_t j = 0; j < experts; ++j)
                if (scores[j] == scores[j] && (best < 0 || scores[j] > scores[best])) best = j;
            if (best < 0) best = t; /* every score NaN: any expert (the NaN flows on) */
            id[t] = best;
            w[t] = scores[best];
            scores[best] = NAN; /* taken */
        }
        const float top = w[0];
        for (int64_t t = 0; t < top_k; ++t) sum += w[t] = expf(w[t] - top);
        for (int64_t t = 0; t < top_k; ++t) w[t] = w[t] / sum * pes[id[t]];
    }
}

/* out[i] = gelu_tanh(gate[i]) * up[i] for i in [b, e). */
static void geglu_range(const float *gate, const float *up, float *out, int64_t b, int64_t e) {
    int64_t i = b;
    for (; i + MOE_V <= e; i += MOE_V) mstore(out + i, mgelu_tanh(mload(gate + i)) * mload(up + i));
    for (; i < e; ++i) {
        const float x = gate[i];
        out[i] = x / (expf(-1.5957691216057308f * (x + 0.044715f * x * x * x)) + 1.0f) * up[i];
    }
}

CANVAS_DEFINE_OPENMP(canvas_step_openmp)

int64_t canvas_step_lanes(void) { return MOE_V; }

/* Each kernel's arguments, one struct (`kernels.native.args`: the same fields in the same
 * order); tokens (GeGLU: elements) [begin, end) on `threads` threads (parallel.h). */
typedef struct {
    const float *q, *k, *v, *qw, *kw, *cos, *sin;
    float *qo, *ko, *vo;
    int64_t hq, hkv, d, ldq, ldk, ldv;
    float eps;
    int64_t begin, end, threads;
} QkvArgs;

/* xb: bf16 rows in place of x (NULL: x), each read into fp32 (exact): the fp32 kernel's values
 * on an fp32 copy of the rows. */
typedef struct {
    const float *x, *scale, *projt, *pes;
    float *weights;
    int64_t *ids;
    const bf16 *xb;
    int64_t hidden, experts, ep, top_k;
    float eps;
    int64_t begin, end, threads;
} RouteArgs;

typedef struct {
    const float *gate, *up;
    float *out;
    int64_t begin, end, threads;
} GegluArgs;

typedef struct {
    const int64_t *seeds, *counters;
    float *out;
    int64_t n;
} PhiloxArgs;

void canvas_qkv_norm_rope(const QkvArgs *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  qkv_rows(a->q, a->k, a->v, a->qw, a->kw, a->cos, a->sin, a->qo, a->ko, a->vo,
                           a->hq, a->hkv, a->d, (const int64_t[3]){a->ldq, a->ldk, a->ldv},
                           a->eps, b, e));
}
void canvas_route(const RouteArgs *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  route_rows(a->x, a->xb, a->scale, a->projt, a->pes, a->weights, a->ids, a->hidden,
                             a->experts, a->ep, a->top_k, a->eps, b, e));
}
/* Elements [begin, end), split in whole vectors (the values do not depend on the split). */
void canvas_geglu(const GegluArgs *a) {
    const int64_t begin = a->begin, end = a->end;
    PARALLEL_ROWS(a->threads, begin / MOE_V, (end + MOE_V - 1) / MOE_V,
                  geglu_range(a->gate, a->up, a->out, b * MOE_V > begin ? b * MOE_V : begin,
                              e * MOE_V < end ? e * MOE_V : end));
}
/* `kernels.reference.philox_uniform` bit for bit: Philox4x32-10 keyed by each 64-bit seed on
 * each 64-bit counter (low word, high word, 0, 0), the first output word folded as Triton reads
 * it (int32; negatives as ~x) and scaled to [0, 1) in fp32. seeds and counters: [n] each
 * (broadcast by the caller). The twin is ~140 NumPy passes. */
void canvas_philox_uniform(const PhiloxArgs *a) {
    const int64_t *seeds = a->seeds, *counters = a->counters, n = a->n;
    float *out = a->out;
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t seed = (uint64_t)seeds[i], counter = (uint64_t)counters[i];
        uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
        uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
        for (int round = 0; round < 10; ++round) {
            const uint64_t pb = (uint64_t)0xCD9E8D57u * c2, pa = (uint64_t)0xD2511F53u * c0;
            const uint32_t n0 = (uint32_t)(pb >> 32) ^ c1 ^ k0, n2 = (uint32_t)(pa >> 32) ^ c3 ^ k1;
            c1 = (uint32_t)pb;
            c3 = (uint32_t)pa;
            c0 = n0;
            c2 = n2;
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const uint32_t folded = c0 >= 0x80000000u ? c0 ^ 0xFFFFFFFFu : c0;
        out[i] = (float)folded * 4.6566127342e-10f;
    }
}

/* ---- bf16 q/k/v ------------------------------------------------------------------------- */

static inline float rnd(float x) { return bf_to_f(f_to_bf(x)); }

/* out = bf16(norm(x) * w) (w NULL: none), rotated when c is not NULL: the normed halves x1, x2
 * as bf16(bf16(x1 c) - bf16(x2 s)), bf16(bf16(x2 c) + bf16(x1 s)). tmp: [d] scratch. */
static void norm_rope_bf16(bf16 *out, const bf16 *x, const float *w, const float *c,
                           const float *s, float *tmp, int64_t d, float eps) {
    row_to_f32(tmp, x, d);
    scale_row(tmp, tmp, inv_rms(tmp, d, eps), w, 0, d);
    int64_t i = 0;
    if (!c) {
        for (; i + BV <= d; i += BV) store_bf16(out + i, bload(tmp + i));
        for (; i < d; ++i) out[i] = f_to_bf(tmp[i]);
        return;
    }
    const int64_t half = d / 2;
    for (; i + BV <= half; i += BV) { /* the scalar loop's roundings, 16 lanes at a time */
        const bvf x1 = bround(bload(tmp + i)), x2 = bround(bload(tmp + half + i));
        const bvf cv = bload(c + i), sv = bload(s + i);
        store_bf16(out + i, bround(x1 * cv) - bround(x2 * sv));
        store_bf16(out + half + i, bround(x2 * cv) + bround(x1 * sv));
    }
    for (; i < half; ++i) {
        const float x1 = rnd(tmp[i]), x2 = rnd(tmp[half + i]);
        out[i] = f_to_bf(rnd(x1 * c[i]) - rnd(x2 * s[i]));
        out[half + i] = f_to_bf(rnd(x2 * c[i]) + rnd(x1 * s[i]));
    }
}

static void qkv_rows_bf16(const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *qw,
                          const bf16 *kw, const bf16 *cos, const bf16 *sin, bf16 *qo, bf16 *ko,
                          bf16 *vo, int64_t hq, int64_t hkv, int64_t d, const int64_t *ld,
                          float eps, int64_t b, int64_t e) {
    float tmp[d], qwf[d], kwf[d], c[d], s[d];
    row_to_f32(qwf, qw, d);
    row_to_f32(kwf, kw, d);
    for (int64_t r = b; r < e; ++r) {
        row_to_f32(c, cos + r * d, d);
        row_to_f32(s, sin + r * d, d);
        for (int64_t j = 0; j < hq; ++j)
            norm_rope_bf16(qo + (r * hq + j) * d, q + r * ld[0] + j * d, qwf, c, s, tmp, d, eps);
        for (int64_t j = 0; j < hkv; ++j) {
            const int64_t at = (r * hkv + j) * d;
            norm_rope_bf16(ko + at, k + r * ld[1] + j * d, kwf, c, s, tmp, d, eps);
            norm_rope_bf16(vo + at, v + r * ld[2] + j * d, 0, 0, 0, tmp, d, eps);
        }
    }
}

/* QkvArgs with bf16 tensors (the same fields). */
typedef struct {
    const bf16 *q, *k, *v, *qw, *kw, *cos, *sin;
    bf16 *qo, *ko, *vo;
    int64_t hq, hkv, d, ldq, ldk, ldv;
    float eps;
    int64_t begin, end, threads;
} QkvBf16Args;

void canvas_qkv_norm_rope_bf16(const QkvBf16Args *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  qkv_rows_bf16(a->q, a->k, a->v, a->qw, a->kw, a->cos, a->sin, a->qo, a->ko,
                                a->vo, a->hq, a->hkv, a->d, (const int64_t[3]){a->ldq, a->ldk, a->ldv}, a->eps, b, e));
}
