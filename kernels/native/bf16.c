/* Canvas' bf16 products on the CPU: the dense projections (`canvas_bf16_linear`, the split q/k/v
 * `canvas_bf16_linear_split`), a gated MLP's gate and up with its GeGLU
 * (`canvas_bf16_gated_linear`) and the experts' tiles (`canvas_bf16_moe_rows`,
 * `canvas_bf16_moe_sum`), the bf16 twins of moe.c's fp32 tiles (`kernels.native.bf16`).
 *
 * Operands: bf16 activations (rows of k_dim, read in place), bf16 weights packed once
 * (`kernels.native.bf16.pack_*`) as pairs of inputs per output column: for a block of 2 x 16
 * output columns and the input pair (2p, 2p + 1), 2 x 16 x 2 bf16 (column c's two weights side
 * by side, the layout of `vdpbf16ps`), k_dim padded to even with zero weights. Sums in fp32, over
 * the input pairs in order, each pair's odd product added before its even one (vdpbf16ps'
 * order); a bf16 x bf16 product is exact in fp32, so the AVX512-BF16 path and the generic one
 * (the same sums with fp32 vector arithmetic, correct on any CPU) give the same bits up to
 * vdpbf16ps' flushing of denormals. Outputs rounded to bf16 (to nearest even), or fp32 where a
 * sum goes on (the experts' slots). A row's values never depend on the other rows.
 *
 * `path` in every struct, one of `canvas_bf16_paths`' bits: BF_GENERIC, BF_AVX512 (vdpbf16ps) or
 * BF_AMX (the experts on AMX tiles: bf16_amx.h; the dense products then take vdpbf16ps).
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "parallel.h"
#include "tile.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define BF_DPBF16 1
#else
#define BF_DPBF16 0
#endif
enum { BF_GENERIC = 1, BF_AVX512 = 2, BF_AMX = 4 };

#define BMR 8 /* rows per tile */

CANVAS_DEFINE_OPENMP(canvas_bf16_openmp)

/* One input pair's step of the generic tile: the packed weights w0, w1 of inputs (2p, 2p + 1),
 * each row's pair of inputs xs[r] (the odd one in the high half). */
static inline __attribute__((always_inline)) void pair_step(const bf16 *b, const uint32_t *xs,
                                                            bvf *y0, bvf *y1) {
    bvu w0, w1;
    memcpy(&w0, b, sizeof w0);
    memcpy(&w1, b + 2 * BV, sizeof w1);
    const bvf e0 = (bvf)(w0 << 16), o0 = (bvf)(w0 & 0xFFFF0000u);
    const bvf e1 = (bvf)(w1 << 16), o1 = (bvf)(w1 & 0xFFFF0000u);
#pragma GCC unroll 8
    for (int r = 0; r < BMR; ++r) {
        const float xe = bf_to_f((bf16)xs[r]), xo = bf_to_f((bf16)(xs[r] >> 16));
        y0[r] += xo * o0;
        y0[r] += xe * e0;
        y1[r] += xo * o1;
        y1[r] += xe * e1;
    }
}

/* The tile: rows a[0..BMR) times a packed block b [pairs, 2, BV, 2], y0 and y1 the block's
 * two vectors of outputs per row. */
static void tile_generic(const bf16 *const *a, const bf16 *b, int64_t k_dim, bvf *y0, bvf *y1) {
    const int64_t whole = k_dim / 2;
    uint32_t xs[BMR];
    for (int r = 0; r < BMR; ++r) y0[r] = y1[r] = (bvf){0};
    for (int64_t p = 0; p < whole; ++p) {
        for (int r = 0; r < BMR; ++r) memcpy(&xs[r], a[r] + 2 * p, 4);
        pair_step(b + p * 4 * BV, xs, y0, y1);
    }
    if (k_dim % 2) { /* the last input, its pair's other half 0 (as its packed weights) */
        for (int r = 0; r < BMR; ++r) xs[r] = a[r][k_dim - 1];
        pair_step(b + whole * 4 * BV, xs, y0, y1);
    }
}

#if BF_DPBF16
static void tile_dpbf16(const bf16 *const *a, const bf16 *b, int64_t k_dim, bvf *y0, bvf *y1) {
    const int64_t whole = k_dim / 2;
    __m512 acc0[BMR], acc1[BMR];
    for (int r = 0; r < BMR; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < whole; ++p) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b + p * 4 * BV);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b + p * 4 * BV + 2 * BV);
#pragma GCC unroll 8
        for (int r = 0; r < BMR; ++r) {
            int32_t word;
            memcpy(&word, a[r] + 2 * p, 4);
            const __m512bh x = (__m512bh)_mm512_set1_epi32(word);
            acc0[r] = _mm512_dpbf16_ps(acc0[r], x, w0);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], x, w1);
        }
    }
    if (k_dim % 2) { /* the last input, its pair's other half 0 (as its packed weights) */
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b + whole * 4 * BV);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b + whole * 4 * BV + 2 * BV);
        for (int r = 0; r < BMR; ++r) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int32_t)a[r][k_dim - 1]);
            acc0[r] = _mm512_dpbf16_ps(acc0[r], x, w0);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], x, w1);
        }
    }
    for (int r = 0; r < BMR; ++r) {
        memcpy(&y0[r], &acc0[r], sizeof y0[r]);
        memcpy(&y1[r], &acc1[r], sizeof y1[r]);
    }
}
#endif

static inline void tile(int path, const bf16 *const *a, const bf16 *b, int64_t k_dim, bvf *y0,
                        bvf *y1) {
#if BF_DPBF16
    if (path & (BF_AVX512 | BF_AMX)) {
        tile_dpbf16(a, b, k_dim, y0, y1);
        return;
    }
#endif
    (void)path;
    tile_generic(a, b, k_dim, y0, y1);
}

/* a[0..BMR): rows [row, row + m) of x (rows of ld), the last repeated; returns m. */
static inline int rows_of(const bf16 **a, const bf16 *x, int64_t row, int64_t row_end,
                          int64_t ld) {
    const int m = row_end - row < BMR ? (int)(row_end - row) : BMR;
    for (int r = 0; r < BMR; ++r) a[r] = x + (row + (r < m ? r : m - 1)) * ld;
    return m;
}

/* gelu_tanh(g) * u, 16 lanes, by tile.h's vectors (the fp32 tiles' GELU). */
static inline bvf geglu16(bvf g, bvf u) {
    float gs[BV], us[BV];
    memcpy(gs, &g, sizeof gs);
    memcpy(us, &u, sizeof us);
    for (int i = 0; i < BV; i += MOE_V) mstore(gs + i, mgelu_tanh(mload(gs + i)) * mload(us + i));
    return bload(gs);
}

#include "bf16_amx.h"

/* The paths this library has (BF_AMX where the CPU has AMX and Linux grants this process its
 * tile data: bf16_amx.h). */
int64_t canvas_bf16_paths(void) {
    return BF_GENERIC | (BF_DPBF16 ? BF_AVX512 : 0) | (amx_ready() ? BF_AMX : 0);
}

/* ---- Dense projections: out[M, N] = x[M, K] @ w^T, w packed [N / 2BV, pairs, 2, BV, 2]; several
 * projections of the same x as one (q, k, v): columns [0, n0) to out0, [n0, n0 + n1) to out1,
 * the rest to out2 (moe.c's `linear_rows`). */
static void linear_rows(int path, const bf16 *x, const bf16 *wp, bf16 *const out[3],
                        const int64_t n_of[3], int64_t k_dim, int64_t n, int64_t row_begin,
                        int64_t row_end) {
    const int64_t block = ((k_dim + 1) / 2) * 4 * BV;
    if (path == BF_AMX && k_dim % 32 == 0) {
        amx_dense_rows(0, x, wp, out, n_of, k_dim, n, row_begin, row_end);
        return;
    }
    for (int64_t c = 0; c < n / (2 * BV); ++c) {
        int64_t col = c * 2 * BV, part = 0;
        while (part < 2 && col >= n_of[part]) col -= n_of[part++];
        bf16 *dst = out[part];
        const int64_t ld = n_of[part];
        for (int64_t row = row_begin; row < row_end; row += BMR) {
            const bf16 *a[BMR];
            const int m = rows_of(a, x, row, row_end, k_dim);
            bvf y0[BMR], y1[BMR];
            tile(path, a, wp + c * block, k_dim, y0, y1);
            for (int r = 0; r < m; ++r) {
                store_bf16(dst + (row + r) * ld + col, y0[r]);
                store_bf16(dst + (row + r) * ld + col + BV, y1[r]);
            }
        }
    }
}

/* n0 and n1 multiples of 2BV (n1 = n - n0 and out1 = NULL for one projection: n0 = n). */
typedef struct {
    const bf16 *x, *wp;
    bf16 *out0, *out1, *out2;
    int64_t n0, n1, k_dim, n, path, begin, end, threads;
} Bf16LinearArgs;

void canvas_bf16_linear(const Bf16LinearArgs *a) {
    bf16 *const outs[3] = {a->out0, a->out1, a->out2};
    const int64_t n_of[3] = {a->n0, a->n1, a->n - a->n0 - a->n1};
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  linear_rows((int)a->path, a->x, a->wp, outs, n_of, a->k_dim, a->n, b, e));
}

/* ---- Gate and up with GeGLU: out[M, I] = gelu_tanh(x @ gate^T) * (x @ up^T), the two packed as
 * [I / BV, pairs, 2 (gate, up), BV, 2]. */
static void gated_rows(int path, const bf16 *x, const bf16 *gup, bf16 *out, int64_t k_dim,
                       int64_t inter, int64_t row_begin, int64_t row_end) {
    const int64_t block = ((k_dim + 1) / 2) * 4 * BV;
    if (path == BF_AMX && k_dim % 32 == 0) {
        bf16 *const outs[3] = {out, NULL, NULL};
        const int64_t n_of[3] = {inter, 0, 0};
        amx_dense_rows(1, x, gup, outs, n_of, k_dim, inter, row_begin, row_end);
        return;
    }
    for (int64_t j = 0; j < inter / BV; ++j) {
        for (int64_t row = row_begin; row < row_end; row += BMR) {
            const bf16 *a[BMR];
            const int m = rows_of(a, x, row, row_end, k_dim);
            bvf g[BMR], u[BMR];
            tile(path, a, gup + j * block, k_dim, g, u);
            for (int r = 0; r < m; ++r)
                store_bf16(out + (row + r) * inter + j * BV, geglu16(g[r], u[r]));
        }
    }
}

typedef struct {
    const bf16 *x, *gup;
    bf16 *out;
    int64_t k_dim, inter, path, begin, end, threads;
} Bf16GatedArgs;

void canvas_bf16_gated_linear(const Bf16GatedArgs *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  gated_rows((int)a->path, a->x, a->gup, a->out, a->k_dim, a->inter, b, e));
}

/* ---- Experts: moe.c's `canvas_moe_rows` in bf16. The sorted rows [begin, end) (pairs: token *
 * top_k + slot of each row, ends: each expert's end row, from moe.c's `canvas_moe_sort`); a tile
 * is up to BMR rows of one expert: gate and up over its packed gup [E, I / BV, pairs(H), 2, BV,
 * 2], GeGLU in fp32 rounded to bf16 into act [BMR, I] (the twin's bf16 product), then the down
 * projection over dnp [E, H / 2BV, pairs(I), 2, BV, 2], weighted by the pair's router weight
 * (fp32), stored in fp32 at the pair's row of ybuf [pairs, H]. */
static void moe_rows(int path, const bf16 *x, const bf16 *gup, const bf16 *dnp,
                     const float *weights, const int64_t *pairs, const int64_t *ends, float *ybuf,
                     bf16 *act, int64_t num_experts, int64_t top_k, int64_t h, int64_t inter,
                     int64_t row_begin, int64_t row_end) {
    const int64_t gblock = ((h + 1) / 2) * 4 * BV, dblock = (inter / 2) * 4 * BV;
    if (path == BF_AMX && amx_takes(h, inter)) {
        amx_moe_rows(x, gup, dnp, weights, pairs, ends, ybuf, act, num_experts, top_k, h, inter,
                     row_begin, row_end);
        return;
    }
    int64_t e = 0, row = row_begin;
    while (row < row_end) {
        while (e < num_experts && ends[e] <= row) ++e;
        if (e == num_experts) return;
        const int64_t stop = ends[e] < row_end ? ends[e] : row_end;
        const int m = stop - row < BMR ? (int)(stop - row) : BMR;
        const bf16 *a[BMR];
        for (int r = 0; r < BMR; ++r) a[r] = x + (pairs[row + (r < m ? r : m - 1)] / top_k) * h;
        const bf16 *g_e = gup + e * (inter / BV) * gblock, *d_e = dnp + e * (h / (2 * BV)) * dblock;
        for (int64_t j = 0; j < inter / BV; ++j) {
            bvf g[BMR], u[BMR];
            tile(path, a, g_e + j * gblock, h, g, u);
            for (int r = 0; r < BMR; ++r) store_bf16(act + r * inter + j * BV, geglu16(g[r], u[r]));
        }
        const bf16 *acts[BMR];
        for (int r = 0; r < BMR; ++r) acts[r] = act + r * inter;
        for (int64_t c = 0; c < h / (2 * BV); ++c) {
            bvf y0[BMR], y1[BMR];
            tile(path, acts, d_e + c * dblock, inter, y0, y1);
            for (int r = 0; r < m; ++r) {
                const int64_t pair = pairs[row + r];
                float *y = ybuf + pair * h + c * 2 * BV;
                const bvf s0 = y0[r] * weights[pair], s1 = y1[r] * weights[pair];
                memcpy(y, &s0, sizeof s0);
                memcpy(y + BV, &s1, sizeof s1);
            }
        }
        row += m;
    }
}

/* act: [threads, BF_SCRATCH(h, inter)] bf16, each thread's scratch (its GeGLU tile, and AMX's
 * gathered rows and accumulators). */
typedef struct {
    const bf16 *x, *gup, *dnp;
    const float *weights;
    const int64_t *pairs, *ends;
    float *ybuf;
    bf16 *act;
    int64_t num_experts, top_k, h, inter, path, begin, end, threads;
} Bf16MoeArgs;

void canvas_bf16_moe_rows(const Bf16MoeArgs *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  moe_rows((int)a->path, a->x, a->gup, a->dnp, a->weights, a->pairs, a->ends,
                           a->ybuf, a->act + t * BF_SCRATCH(a->h, a->inter), a->num_experts, a->top_k, a->h,
                           a->inter, b, e));
}

/* out[t] = bf16(ybuf[t * top_k] + ... + ybuf[t * top_k + top_k - 1]) (fp32, slots in order)
 * for tokens [begin, end); h a multiple of BV. */
typedef struct {
    const float *ybuf;
    bf16 *out;
    int64_t top_k, h, begin, end, threads;
} Bf16SumArgs;

static void moe_sum(const float *ybuf, bf16 *out, int64_t top_k, int64_t h, int64_t begin,
                    int64_t end) {
    for (int64_t t = begin; t < end; ++t)
        for (int64_t x = 0; x < h; x += BV) {
            bvf acc = bload(ybuf + t * top_k * h + x);
            for (int64_t k = 1; k < top_k; ++k) acc += bload(ybuf + (t * top_k + k) * h + x);
            store_bf16(out + t * h + x, acc);
        }
}

void canvas_bf16_moe_sum(const Bf16SumArgs *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end, moe_sum(a->ybuf, a->out, a->top_k, a->h, b, e));
}

/* ---- GeGLU of bf16 gate and up (the dense MLP's, where oneDNN ran the projections):
 * out = bf16(bf16(gelu_tanh(gate)) * up), rounded where the twin (F.gelu, then mul_) rounds;
 * rows [begin, end) of `width` elements, gate's and up's rows `ld` elements apart (the halves
 * of one [gate; up] product's rows, or two tensors' rows), out's contiguous. */
typedef struct {
    const bf16 *gate, *up;
    bf16 *out;
    int64_t width, ld, begin, end, threads;
} Bf16GegluArgs;

static void geglu_row(const bf16 *gate, const bf16 *up, bf16 *out, int64_t width) {
    const bvf one = (bvf){0} + 1.0f;
    int64_t i = 0;
    /* Whole blocks straight from the rows: staging each through variable-length copies cost
     * more than the GELU itself. */
    for (; i + BV <= width; i += BV)
        store_bf16(out + i, bround(geglu16(load_bf16(gate + i), one)) * load_bf16(up + i));
    if (i < width) { /* the last partial block, zero-padded */
        const int64_t n = width - i;
        bf16 g[BV] = {0}, u[BV] = {0}, o[BV];
        memcpy(g, gate + i, n * sizeof(bf16));
        memcpy(u, up + i, n * sizeof(bf16));
        store_bf16(o, bround(geglu16(load_bf16(g), one)) * load_bf16(u));
        memcpy(out + i, o, n * sizeof(bf16));
    }
}

void canvas_bf16_geglu(const Bf16GegluArgs *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end, for (int64_t r = b; r < e; ++r)
        geglu_row(a->gate + r * a->ld, a->up + r * a->ld, a->out + r * a->width, a->width));
}
