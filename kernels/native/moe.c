/* Canvas' one-token mixture of experts on the CPU: the fast-numerics twin of
 * `kernels.reference.fused_moe_scattered` for a single token (an AR step at one request), where
 * the twin's ~10 dispatches per expert (two matrix-vector products on views of the expert's
 * weights, the GeGLU product, the weighting, the sum) cost more than the arithmetic.
 *
 * Expert e of the token x [H]: gate, up = gate_up[e] @ x ([2I, H] rows: the gate's I, then the
 * up's I); act = gelu_tanh(gate) * up; y = down[e] @ act ([H, I] rows); out[k] = weight[k] * y
 * for slot k. The caller sums the slots. Every dot product runs in a fixed order (vector lanes,
 * then the lanes in order, then the scalar tail), so the values never depend on the batch; they
 * differ from the twin's (BLAS's order, ATen's GELU) in the last bits. Memory-bound: each
 * expert's weights are read once. fp32, contiguous. GCC/Clang vector extensions, no OpenMP.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "parallel.h"

typedef float vf __attribute__((vector_size(32)));
#define W 8

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    vf acc0 = {0}, acc1 = {0};
    int64_t i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {
        acc0 += load(a + i) * load(b + i);
        acc1 += load(a + i + W) * load(b + i + W);
    }
    for (; i + W <= n; i += W) acc0 += load(a + i) * load(b + i);
    acc0 += acc1;
    float sum = 0.0f;
    for (int j = 0; j < W; ++j) sum += acc0[j];
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

/* GELU, tanh approximation (PyTorch's approximate="tanh"). */
static inline float gelu_tanh(float x) {
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

/* Slots [slot_begin, slot_end) of one token: out[k * h ..] = weights[k] * expert_{ids[k]}(x).
 * scratch: [num_slots, inter] floats (the GeGLU products). */
void canvas_moe_token(const float *x, const float *gate_up, const float *down,
                      const float *weights, const int64_t *ids, float *out, float *scratch,
                      int64_t slot_begin, int64_t slot_end, int64_t h, int64_t inter) {
    for (int64_t k = slot_begin; k < slot_end; ++k) {
        const float *gu = gate_up + ids[k] * 2 * inter * h;
        const float *dn = down + ids[k] * h * inter;
        float *act = scratch + k * inter;
        for (int64_t j = 0; j < inter; ++j) {
            float gate = dot(gu + j * h, x, h);
            float up = dot(gu + (inter + j) * h, x, h);
            act[j] = gelu_tanh(gate) * up;
        }
        float w = weights[k];
        float *o = out + k * h;
        for (int64_t r = 0; r < h; ++r) o[r] = dot(dn + r * inter, act, inter) * w;
    }
}

/* ---- Many tokens: the experts' FFNs as register-tiled matrix products -------------------------
 *
 * `canvas_moe_rows` runs rows [row_begin, row_end) of the token-expert pairs sorted by expert
 * (`pairs`: pair index token * top_k + slot of each sorted row; `ends`: each expert's end row).
 * A tile is up to MR rows of one expert: its tokens' hidden rows are read in place (no gather),
 * gate and up for V columns each come out of one pass over H (accumulators in registers), the
 * GeGLU product goes to the tile's act [MR, inter] (in L1), and the down projection of the
 * tile, weighted by each pair's router weight, is stored to ybuf at the pair's own row. No two
 * rows write the same place, so threads split the rows freely; the caller sums each token's
 * top_k rows (a fixed order: the values never depend on the batch's other tokens).
 *
 * Weights come pre-packed (`kernels.native_cpu.pack_experts`), so every load is one vector:
 *   gup [E, inter / V, H, 2V]: for column block j and input k, the V gate then the V up weights;
 *   dnp [E, H / 2V, inter, 2V]: for output block c and input k, 2V down weights.
 * Each tile re-reads its expert's packed weights, which the caller keeps to experts that fit
 * the core's L2 cache. GELU(tanh) is x * sigmoid(2u) with a polynomial exp (~1 ulp): equal to
 * ATen's 0.5 x (1 + tanh(u)) up to rounding. */
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

/* act[r, j*V ..] = gelu(gate) * up of the tile's rows a[0..MR) for every column block j. */
static void moe_gate_up(const float *const *a, const float *gup, int64_t h, int64_t inter,
                        float *act) {
    for (int64_t j = 0; j < inter / MOE_V; ++j) {
        mv g[MOE_MR], u[MOE_MR];
        tile_2v(a, gup + j * h * 2 * MOE_V, h, g, u);
        for (int r = 0; r < MOE_MR; ++r) mstore(act + r * inter + j * MOE_V, mgelu_tanh(g[r]) * u[r]);
    }
}

/* ybuf[pair of row r, c*2V ..] = weight * (act[r] @ down^T) for the tile's first m rows. */
static void moe_down(const float *act, const float *dnp, int64_t h, int64_t inter, int m,
                     const int64_t *pair, const float *weights, float *ybuf) {
    const float *a[MOE_MR];
    for (int r = 0; r < MOE_MR; ++r) a[r] = act + r * inter;
    for (int64_t c = 0; c < h / (2 * MOE_V); ++c) {
        mv y0[MOE_MR], y1[MOE_MR];
        tile_2v(a, dnp + c * inter * 2 * MOE_V, inter, y0, y1);
        for (int r = 0; r < m; ++r) {
            float *y = ybuf + pair[r] * h + c * 2 * MOE_V;
            mstore(y, y0[r] * weights[pair[r]]);
            mstore(y + MOE_V, y1[r] * weights[pair[r]]);
        }
    }
}

int64_t canvas_moe_lanes(void) { return MOE_V; }

void canvas_moe_rows(const float *x, const float *gup, const float *dnp, const float *weights,
                     const int64_t *pairs, const int64_t *ends, float *ybuf, float *act,
                     int64_t num_experts, int64_t top_k, int64_t h, int64_t inter,
                     int64_t row_begin, int64_t row_end) {
    /* act: [MOE_MR, inter] scratch of this call */
    int64_t e = 0, row = row_begin;
    while (row < row_end) {
        while (e < num_experts && ends[e] <= row) ++e;
        if (e == num_experts) return;
        int64_t stop = ends[e] < row_end ? ends[e] : row_end;
        int m = stop - row < MOE_MR ? (int)(stop - row) : MOE_MR;
        const float *a[MOE_MR];
        for (int r = 0; r < MOE_MR; ++r) a[r] = x + (pairs[row + (r < m ? r : m - 1)] / top_k) * h;
        moe_gate_up(a, gup + e * inter * h * 2, h, inter, act);
        moe_down(act, dnp + e * h * inter, h, inter, m, pairs + row, weights, ybuf);
        row += m;
    }
}

/* Rows [0, num_rows) in `threads` ranges (parallel.h), each with its own act tile
 * (act: [threads, MOE_MR, inter]). */
CANVAS_DEFINE_OPENMP(canvas_moe_openmp)

void canvas_moe_rows_parallel(const float *x, const float *gup, const float *dnp,
                              const float *weights, const int64_t *pairs, const int64_t *ends,
                              float *ybuf, float *act, int64_t num_experts, int64_t top_k,
                              int64_t h, int64_t inter, int64_t num_rows, int64_t threads) {
    PARALLEL_ROWS(threads, 0, num_rows,
                  canvas_moe_rows(x, gup, dnp, weights, pairs, ends, ybuf,
                                  act + t * MOE_MR * inter,
                                  num_experts, top_k, h, inter, b, e));
}

/* ---- Dense projections on packed weights (`kernels.native_moe.linear`) ------------------------
 *
 * out[M, N] = x[M, K] @ w^T for rows [row_begin, row_end), w packed as [N / 2V, K, 2V] (for
 * output block c and input k, 2V weights): the same register tile as the experts' down
 * projection, output block by block (a block's K x 2V weights stay in L1 across the row tiles).
 * Every output's sum runs over k in order, whatever the row's batch. */
static void linear_rows(const float *x, const float *wp, float *out, int64_t k_dim, int64_t n,
                        int64_t row_begin, int64_t row_end) {
    for (int64_t c = 0; c < n / (2 * MOE_V); ++c) {
        for (int64_t row = row_begin; row < row_end; row += MOE_MR) {
            int m = row_end - row < MOE_MR ? (int)(row_end - row) : MOE_MR;
            const float *a[MOE_MR];
            for (int r = 0; r < MOE_MR; ++r) a[r] = x + (row + (r < m ? r : m - 1)) * k_dim;
            mv y0[MOE_MR], y1[MOE_MR];
            tile_2v(a, wp + c * k_dim * 2 * MOE_V, k_dim, y0, y1);
            for (int r = 0; r < m; ++r) {
                mstore(out + (row + r) * n + c * 2 * MOE_V, y0[r]);
                mstore(out + (row + r) * n + c * 2 * MOE_V + MOE_V, y1[r]);
            }
        }
    }
}

void canvas_linear(const float *x, const float *wp, float *out, int64_t k_dim, int64_t n,
                   int64_t row_begin, int64_t row_end, int64_t threads) {
    PARALLEL_ROWS(threads, row_begin, row_end, linear_rows(x, wp, out, k_dim, n, b, e));
}
