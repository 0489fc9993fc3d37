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
 * expert's weights are read once. fp32, contiguous. GCC/Clang vector extensions.
 *
 * Every exported kernel takes one argument struct (`kernels.native.args` declares the same
 * fields in the same order); those over rows take [begin, end) and `threads` (parallel.h).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "parallel.h"
#include "tile.h"

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
typedef struct {
    const float *x, *gate_up, *down, *weights;
    const int64_t *ids;
    float *out, *scratch;
    int64_t begin, end, h, inter; /* slots [begin, end) */
} MoeTokenArgs;

void canvas_moe_token(const MoeTokenArgs *a) {
    const float *x = a->x, *gate_up = a->gate_up, *down = a->down, *weights = a->weights;
    const int64_t *ids = a->ids, h = a->h, inter = a->inter;
    float *out = a->out, *scratch = a->scratch;
    for (int64_t k = a->begin; k < a->end; ++k) {
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
 * `canvas_moe_rows` runs rows [begin, end) of the token-expert pairs sorted by expert
 * (`pairs`: pair index token * top_k + slot of each sorted row; `ends`: each expert's end row).
 * A tile is up to MR rows of one expert: its tokens' hidden rows are read in place (no gather),
 * gate and up for V columns each come out of one pass over H (accumulators in registers), the
 * GeGLU product goes to the tile's act [MR, inter] (in L1), and the down projection of the
 * tile, weighted by each pair's router weight, is stored to ybuf at the pair's own row. No two
 * rows write the same place, so threads split the rows freely; the caller sums each token's
 * top_k rows (a fixed order: the values never depend on the batch's other tokens).
 *
 * Weights come pre-packed (`kernels.native.moe.pack_experts`), so every load is one vector:
 *   gup [E, inter / V, H, 2V]: for column block j and input k, the V gate then the V up weights;
 *   dnp [E, H / 2V, inter, 2V]: for output block c and input k, 2V down weights.
 * Each tile re-reads its expert's packed weights, which the caller keeps to experts that fit
 * the core's L2 cache. GELU(tanh) is x * sigmoid(2u) with a polynomial exp (~1 ulp): equal to
 * ATen's 0.5 x (1 + tanh(u)) up to rounding. */

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

static void moe_rows(const float *x, const float *gup, const float *dnp, const float *weights,
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

/* The sorted rows [begin, end): `canvas_moe_rows` on the calling thread (act: [MOE_MR, inter]),
 * `canvas_moe_rows_parallel` on `threads` threads of its OpenMP team (act: one such tile per
 * thread). */
typedef struct {
    const float *x, *gup, *dnp, *weights;
    const int64_t *pairs, *ends;
    float *ybuf, *act;
    int64_t num_experts, top_k, h, inter, begin, end, threads;
} MoeRowsArgs;

void canvas_moe_rows(const MoeRowsArgs *a) {
    moe_rows(a->x, a->gup, a->dnp, a->weights, a->pairs, a->ends, a->ybuf, a->act,
             a->num_experts, a->top_k, a->h, a->inter, a->begin, a->end);
}
void canvas_moe_rows_parallel(const MoeRowsArgs *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  moe_rows(a->x, a->gup, a->dnp, a->weights, a->pairs, a->ends, a->ybuf,
                           a->act + t * MOE_MR * a->inter,
                           a->num_experts, a->top_k, a->h, a->inter, b, e));
}

/* The pairs (token * top_k + slot) of ids [num_pairs] sorted by expert, each expert's in pair
 * order (a counting sort), and each expert's end row. Returns 0, or -1 when an id is not an
 * expert (nothing written then). */
typedef struct {
    const int64_t *ids;
    int64_t num_pairs, num_experts;
    int64_t *pairs, *ends;
} MoeSortArgs;

int64_t canvas_moe_sort(const MoeSortArgs *a) {
    const int64_t *ids = a->ids, num_pairs = a->num_pairs, num_experts = a->num_experts;
    int64_t *pairs = a->pairs, *ends = a->ends;
    for (int64_t p = 0; p < num_pairs; ++p)
        if (ids[p] < 0 || ids[p] >= num_experts) return -1;
    memset(ends, 0, sizeof(int64_t) * num_experts);
    for (int64_t p = 0; p < num_pairs; ++p) ++ends[ids[p]];
    for (int64_t e = 1; e < num_experts; ++e) ends[e] += ends[e - 1];
    for (int64_t p = num_pairs - 1; p >= 0; --p) pairs[--ends[ids[p]]] = p;
    for (int64_t e = 0; e < num_experts; ++e) ends[e] = e + 1 < num_experts ? ends[e + 1] : num_pairs;
    return 0;
}

/* out[t] = ybuf[t * top_k] + ... + ybuf[t * top_k + top_k - 1] (slots in order) for tokens
 * [begin, end); h a multiple of V. */
static void moe_sum(const float *ybuf, float *out, int64_t top_k, int64_t h, int64_t begin,
                    int64_t end) {
    for (int64_t t = begin; t < end; ++t)
        for (int64_t x = 0; x < h; x += MOE_V) {
            mv acc = mload(ybuf + t * top_k * h + x);
            for (int64_t k = 1; k < top_k; ++k) acc += mload(ybuf + (t * top_k + k) * h + x);
            mstore(out + t * h + x, acc);
        }
}

typedef struct {
    const float *ybuf;
    float *out;
    int64_t top_k, h, begin, end, threads;
} MoeSumArgs;

void canvas_moe_sum(const MoeSumArgs *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end, moe_sum(a->ybuf, a->out, a->top_k, a->h, b, e));
}

/* ---- Dense projections on packed weights (`kernels.native.moe.linear`, `linear_many`) --------
 *
 * out[M, N] = x[M, K] @ w^T for rows [row_begin, row_end), w packed as [N / 2V, K, 2V] (for
 * output block c and input k, 2V weights): the same register tile as the experts' down
 * projection, output block by block (a block's K x 2V weights stay in L1 across the row tiles).
 * Every output's sum runs over k in order, whatever the row's batch. Several projections of the
 * same x (attention's q, k and v) run as one: their weights packed one after the other, output
 * columns [0, n0) go to out0 (rows of n0), [n0, n0 + n1) to out1 and the rest to out2, each
 * column's value the same as from its own projection. */
/* a[0..MR): the rows [row, row + m) of x (rows of k_dim), the last repeated to fill the tile;
 * returns m = min(MR, row_end - row). */
static inline int tile_rows(const float **a, const float *x, int64_t row, int64_t row_end,
                            int64_t k_dim) {
    const int m = row_end - row < MOE_MR ? (int)(row_end - row) : MOE_MR;
    for (int r = 0; r < MOE_MR; ++r) a[r] = x + (row + (r < m ? r : m - 1)) * k_dim;
    return m;
}

static void linear_rows(const float *x, const float *wp, float *const out[3], const int64_t n_of[3],
                        int64_t k_dim, int64_t n, int64_t row_begin, int64_t row_end) {
    for (int64_t c = 0; c < n / (2 * MOE_V); ++c) {
        int64_t col = c * 2 * MOE_V, part = 0;
        while (part < 2 && col >= n_of[part]) col -= n_of[part++];
        float *dst = out[part];
        const int64_t ld = n_of[part];
        for (int64_t row = row_begin; row < row_end; row += MOE_MR) {
            const float *a[MOE_MR];
            const int m = tile_rows(a, x, row, row_end, k_dim);
            mv y0[MOE_MR], y1[MOE_MR];
            tile_2v(a, wp + c * k_dim * 2 * MOE_V, k_dim, y0, y1);
            for (int r = 0; r < m; ++r) {
                mstore(dst + (row + r) * ld + col, y0[r]);
                mstore(dst + (row + r) * ld + col + MOE_V, y1[r]);
            }
        }
    }
}

typedef struct {
    const float *x, *wp;
    float *out;
    int64_t k_dim, n, begin, end, threads;
} LinearArgs;

void canvas_linear(const LinearArgs *a) {
    float *const outs[3] = {a->out, NULL, NULL};
    const int64_t n_of[3] = {a->n, 0, 0};
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  linear_rows(a->x, a->wp, outs, n_of, a->k_dim, a->n, b, e));
}

/* n0 and n1 multiples of 2V; out2 gets n - n0 - n1 columns (NULL when none). */
typedef struct {
    const float *x, *wp;
    float *out0, *out1, *out2;
    int64_t n0, n1, k_dim, n, begin, end, threads;
} LinearSplitArgs;

void canvas_linear_split(const LinearSplitArgs *a) {
    float *const outs[3] = {a->out0, a->out1, a->out2};
    const int64_t n_of[3] = {a->n0, a->n1, a->n - a->n0 - a->n1};
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  linear_rows(a->x, a->wp, outs, n_of, a->k_dim, a->n, b, e));
}

/* ---- A gated MLP's gate and up projections with its GeGLU (`kernels.native.moe.gated_linear`)
 *
 * out[M, I] = gelu_tanh(x @ gate^T) * (x @ up^T) for rows [row_begin, row_end), the two weights
 * packed as one expert's gup ([I / V, K, 2V]: for column block j and input k, V gate then V up
 * weights). Each block's tile gives V gate and V up columns whose sums run over k in order,
 * bit for bit those of `canvas_linear`, and the product is `canvas_geglu`'s: the values of
 * linear, linear and gated_act, in one pass without the [M, 2I] intermediates. */
static void gated_rows(const float *x, const float *gup, float *out, int64_t k_dim,
                       int64_t inter, int64_t row_begin, int64_t row_end) {
    for (int64_t j = 0; j < inter / MOE_V; ++j) {
        for (int64_t row = row_begin; row < row_end; row += MOE_MR) {
            const float *a[MOE_MR];
            const int m = tile_rows(a, x, row, row_end, k_dim);
            mv g[MOE_MR], u[MOE_MR];
            tile_2v(a, gup + j * k_dim * 2 * MOE_V, k_dim, g, u);
            for (int r = 0; r < m; ++r) mstore(out + (row + r) * inter + j * MOE_V, mgelu_tanh(g[r]) * u[r]);
        }
    }
}

typedef struct {
    const float *x, *gup;
    float *out;
    int64_t k_dim, inter, begin, end, threads;
} GatedLinearArgs;

void canvas_gated_linear(const GatedLinearArgs *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  gated_rows(a->x, a->gup, a->out, a->k_dim, a->inter, b, e));
}
