/* bf16.c's experts on AMX tiles (`path` BF_AMX): TDPBF16PS on 16 x 32 bf16 rows times 16 input
 * pairs x 16 columns, accumulating 16 x 16 fp32, on the same packed weights as the vector tiles
 * (a block's 16 columns of one input pair are one 64-byte tile row; the next pair's 128 bytes
 * on). Where the compiler targets AMX (-march=native on a CPU with amx_tile and amx_bf16) and
 * Linux grants this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, once: `amx_ready`).
 *
 * A tile of up to 16 rows of one expert: its tokens' rows gathered into 16 x H (the last
 * repeated), gate and up for 16 columns at a time into two accumulators (each sum over the input
 * pairs in order, the pair's products added as TDPBF16PS adds them), their GeGLU in fp32 rounded
 * to bf16 into the tile's act [16, I], then the down projection 32 columns at a time, weighted and
 * stored in fp32 as the vector tiles store them. H and I whole blocks of 32. */
#ifndef CANVAS_BF16_AMX_H
#define CANVAS_BF16_AMX_H
#include <stdint.h>
#include <string.h>

#define AMX_ROWS 16
/* Each thread's scratch (bf16 elements): the gathered rows, act, and two 16 x 16 fp32 tiles. */
#define BF_SCRATCH(h, inter) (AMX_ROWS * ((h) + (inter)) + 4 * AMX_ROWS * BV)

#include "amx.h"

#if CANVAS_AMX
static int amx_takes(int64_t h, int64_t inter) { return h % 32 == 0 && inter % 32 == 0; }

/* Tiles 0-3: accumulators; 4: rows; 5, 6: weights. Every tile 16 rows of 64 bytes. */
static void amx_configure(void) {
    AmxConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* Tiles 0 and 1 = a [16, k_dim] (rows of lda) times the packed blocks b0, b1 (their pairs 128
 * bytes apart), over the input pairs in order. */
#define AMX_PRODUCT(a, lda, b0, b1, k_dim)                                                \
    do {                                                                                   \
        _tile_zero(0);                                                                     \
        _tile_zero(1);                                                                     \
        for (int64_t k_ = 0; k_ < (k_dim); k_ += 32) {                                     \
            _tile_loadd(4, (a) + k_, (lda) * 2);                                           \
            _tile_loadd(5, (b0) + k_ * 2 * BV, 4 * BV * 2);                                \
            _tile_loadd(6, (b1) + k_ * 2 * BV, 4 * BV * 2);                                \
            _tile_dpbf16ps(0, 4, 5);                                                       \
            _tile_dpbf16ps(1, 4, 6);                                                       \
        }                                                                                  \
    } while (0)

static void amx_moe_rows(const bf16 *x, const bf16 *gup, const bf16 *dnp, const float *weights,
                         const int64_t *pairs, const int64_t *ends, float *ybuf, bf16 *scratch,
                         int64_t num_experts, int64_t top_k, int64_t h, int64_t inter,
                         int64_t row_begin, int64_t row_end) {
    bf16 *rows = scratch, *act = scratch + AMX_ROWS * h;
    float *c0 = (float *)(act + AMX_ROWS * inter), *c1 = c0 + AMX_ROWS * BV;
    const int64_t gblock = (h / 2) * 4 * BV, dblock = (inter / 2) * 4 * BV;
    amx_configure();
    int64_t e = 0, row = row_begin;
    while (row < row_end) {
        while (e < num_experts && ends[e] <= row) ++e;
        if (e == num_experts) break;
        const int64_t stop = ends[e] < row_end ? ends[e] : row_end;
        const int m = stop - row < AMX_ROWS ? (int)(stop - row) : AMX_ROWS;
        for (int r = 0; r < AMX_ROWS; ++r)
            memcpy(rows + r * h, x + (pairs[row + (r < m ? r : m - 1)] / top_k) * h, h * 2);
        const bf16 *g_e = gup + e * (inter / BV) * gblock, *d_e = dnp + e * (h / (2 * BV)) * dblock;
        for (int64_t j = 0; j < inter / BV; ++j) {
            AMX_PRODUCT(rows, h, g_e + j * gblock, g_e + j * gblock + 2 * BV, h);
            _tile_stored(0, c0, BV * 4);
            _tile_stored(1, c1, BV * 4);
            for (int r = 0; r < AMX_ROWS; ++r)
                store_bf16(act + r * inter + j * BV, geglu16(bload(c0 + r * BV), bload(c1 + r * BV)));
        }
        for (int64_t c = 0; c < h / (2 * BV); ++c) {
            AMX_PRODUCT(act, inter, d_e + c * dblock, d_e + c * dblock + 2 * BV, inter);
            _tile_stored(0, c0, BV * 4);
            _tile_stored(1, c1, BV * 4);
            for (int r = 0; r < m; ++r) {
                const int64_t pair = pairs[row + r];
                float *y = ybuf + pair * h + c * 2 * BV;
                const bvf s0 = bload(c0 + r * BV) * weights[pair];
                const bvf s1 = bload(c1 + r * BV) * weights[pair];
                memcpy(y, &s0, sizeof s0);
                memcpy(y + BV, &s1, sizeof s1);
            }
        }
        row += m;
    }
    _tile_release();
}

/* Rows [row, row + m) of one block of columns from the accumulators c0, c1 (16 x 16 fp32
 * each): `gated`, GeGLU of gate (c0) and up (c1) rounded into out[0]'s columns [16c, 16c + 16);
 * else the block's 32 columns rounded into the output (out0/out1/out2 by n_of) they fall in. */
static void amx_store(int gated, bf16 *const out[3], const int64_t n_of[3], int64_t c,
                      int64_t row, int m, const float *c0, const float *c1) {
    if (gated) {
        for (int r = 0; r < m; ++r)
            store_bf16(out[0] + (row + r) * n_of[0] + c * BV,
                       geglu16(bload(c0 + r * BV), bload(c1 + r * BV)));
        return;
    }
    int64_t col = c * 2 * BV, part = 0;
    while (part < 2 && col >= n_of[part]) col -= n_of[part++];
    bf16 *dst = out[part];
    const int64_t ld = n_of[part];
    for (int r = 0; r < m; ++r) {
        store_bf16(dst + (row + r) * ld + col, bload(c0 + r * BV));
        store_bf16(dst + (row + r) * ld + col + BV, bload(c1 + r * BV));
    }
}

/* The dense products on AMX tiles (K a multiple of 32), rows [row_begin, row_end) of x read in
 * place: 32 rows at a time (two tiles of rows against each block's two tiles of weights: each
 * weight tile loaded once per 32 rows), the last rows of a range 16 or fewer at a time. A
 * row's sums are the same whichever tile holds it: each runs over the input pairs in order,
 * 32 inputs per TDPBF16PS. `gated`: bf16.c's `gated_rows` (gate and up's blocks of 16
 * columns, their GeGLU rounded once); else its `linear_rows` (blocks of 32 columns to
 * out0/out1/out2). */
static void amx_dense_rows(int gated, const bf16 *x, const bf16 *wp, bf16 *const out[3],
                           const int64_t n_of[3], int64_t k_dim, int64_t n, int64_t row_begin,
                           int64_t row_end) {
    const int64_t block = (k_dim / 2) * 4 * BV, blocks = n / (gated ? BV : 2 * BV);
    const int64_t lda = k_dim * 2, ldb = 4 * BV * 2;
    float acc[4][AMX_ROWS * BV] __attribute__((aligned(64)));
    int configured = 0;
    int64_t row = row_begin;
    for (; row + 2 * AMX_ROWS <= row_end; row += 2 * AMX_ROWS) {
        if (configured != AMX_ROWS) amx_configure_dense(AMX_ROWS), configured = AMX_ROWS;
        const bf16 *a0 = x + row * k_dim, *a1 = a0 + AMX_ROWS * k_dim;
        for (int64_t c = 0; c < blocks; ++c) {
            const bf16 *b = wp + c * block;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k = 0; k < k_dim; k += 32) {
                _tile_loadd(4, a0 + k, lda);
                _tile_loadd(5, a1 + k, lda);
                _tile_loadd(6, b + k * 2 * BV, ldb);
                _tile_loadd(7, b + k * 2 * BV + 2 * BV, ldb);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, acc[0], BV * 4); /* tile numbers are immediates */
            _tile_stored(1, acc[1], BV * 4);
            _tile_stored(2, acc[2], BV * 4);
            _tile_stored(3, acc[3], BV * 4);
            amx_store(gated, out, n_of, c, row, AMX_ROWS, acc[0], acc[1]);
            amx_store(gated, out, n_of, c, row + AMX_ROWS, AMX_ROWS, acc[2], acc[3]);
        }
    }
    for (; row < row_end; row += AMX_ROWS) {
        const int m = row_end - row < AMX_ROWS ? (int)(row_end - row) : AMX_ROWS;
        if (m != configured) amx_configure_dense(m), configured = m;
        for (int64_t c = 0; c < blocks; ++c) {
            const bf16 *b = wp + c * block;
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t k = 0; k < k_dim; k += 32) {
                _tile_loadd(4, x + row * k_dim + k, lda);
                _tile_loadd(6, b + k * 2 * BV, ldb);
                _tile_loadd(7, b + k * 2 * BV + 2 * BV, ldb);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
            }
            _tile_stored(0, acc[0], BV * 4);
            _tile_stored(1, acc[1], BV * 4);
            amx_store(gated, out, n_of, c, row, m, acc[0], acc[1]);
        }
    }
    if (configured) _tile_release();
}
#else
static int amx_takes(int64_t h, int64_t inter) { return (void)h, (void)inter, 0; }
static void amx_moe_rows(const bf16 *x, const bf16 *gup, const bf16 *dnp, const float *weights,
                         const int64_t *pairs, const int64_t *ends, float *ybuf, bf16 *scratch,
                         int64_t num_experts, int64_t top_k, int64_t h, int64_t inter,
                         int64_t row_begin, int64_t row_end) {
    (void)x, (void)gup, (void)dnp, (void)weights, (void)pairs, (void)ends, (void)ybuf;
    (void)scratch, (void)num_experts, (void)top_k, (void)h, (void)inter, (void)row_begin;
    (void)row_end;
}
static void amx_dense_rows(int gated, const bf16 *x, const bf16 *wp, bf16 *const out[3],
                           const int64_t n_of[3], int64_t k_dim, int64_t n, int64_t row_begin,
                           int64_t row_end) {
    (void)gated, (void)x, (void)wp, (void)out, (void)n_of, (void)k_dim, (void)n;
    (void)row_begin, (void)row_end;
}
#endif
#endif
