/* Canvas attention on the CPU over the paged KV cache: the fast-numerics twin of
 * `kernels.reference.canvas_attention` (bound from `kernels.native.attention`; one argument
 * struct, `AttentionArgs`, declared field for field in `kernels.native.args`).
 *
 * The twin gathers every row's prefix keys from their pages into a padded [R, Hkv, S, D]
 * tensor, concatenates the new keys, builds a boolean mask and calls SDPA; at small canvas
 * steps the gathers, concatenations and masks cost a large fraction of SDPA itself. Here a
 * work item is one row, one KV head and a block of at most `qblock` of the row's queries (all
 * the head's query heads): its keys are read from their pages (the prefix) and from the new
 * keys (the row's own tokens) into packed blocks in this thread's scratch, the scores of every
 * query against every key it may see come out of the register tile (`tile.h`), the softmax runs
 * over each query's visible keys only (no mask tensor, no padding), and the values' product
 * is the same tile again. A DECODE row's queries see its prefix range and all its new keys; an
 * ENCODE row's query at position p sees the keys at p' <= p (and p' > p - window on a sliding
 * layer), so a causal block never reads the keys after its last query. An item of fewer score
 * rows than a tile (an AR step: one query per row) packs nothing: its scores, softmax and
 * values come straight from the keys' rows (`attend_few`).
 *
 * Numerics: scores are q.k summed over D in order, times `scale`; the softmax subtracts the
 * row's maximum and takes the polynomial exp (~1 ulp; arguments clamped at -80, where exp is
 * below 2e-35 of the maximum's term); the values' sums run over the keys in order. Nothing
 * depends on other rows or on the thread that runs an item, so a row's values never depend on
 * its batch; they differ from SDPA's (blocked online softmax) in the last bits. fp32 or bf16
 * (`bf` 1: q, k, v, the pools and out all bf16: each row read into fp32 as it is used, the
 * arithmetic in fp32, the output rounded to bf16; `bf` 2: the same tensors, the scores and the
 * values' product on AMX tiles where the library has them: `attend_amx`), contiguous; D a
 * multiple of 2V.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "parallel.h"
#include "tile.h"

#define BLOCK (2 * MOE_V)

typedef struct {
    const void *q, *k, *v, *k_pool, *v_pool;
    const int32_t *start, *offset, *count, *decode, *page_table;
    void *out;
    int64_t max_pages, hq, hkv, d, size, window, qblock;
    float scale;
    int64_t bf; /* 1: every tensor bf16; 2: and the scores and values on AMX */
} Attn;

/* Row `index` (in rows of d) of tensor t as fp32: in place, or for bf16 converted into buf. */
static inline const float *row_f32(const Attn *a, const void *t, int64_t index, float *buf) {
    if (!a->bf) return (const float *)t + index * a->d;
    const bf16 *src = (const bf16 *)t + index * a->d;
    int64_t x = 0;
    for (; x + BV <= a->d; x += BV) {
        const bvf v = load_bf16(src + x);
        memcpy(buf + x, &v, sizeof v);
    }
    for (; x < a->d; ++x) buf[x] = bf_to_f(src[x]);
    return buf;
}

/* Key `pos` of row r, head h (of the pool or the new keys `fresh`) as fp32 (buf: for bf16):
 * from its page below `start`, else the row's new keys. */
static inline const float *key_row(const Attn *a, const void *pool, const void *fresh, int64_t r,
                                   int64_t h, int64_t pos, float *buf) {
    int64_t st = a->start[r];
    if (pos >= st) return row_f32(a, fresh, (a->offset[r] + pos - st) * a->hkv + h, buf);
    int64_t page = a->page_table[r * a->max_pages + pos / a->size];
    return row_f32(a, pool, (page * a->hkv + h) * a->size + pos % a->size, buf);
}

/* Output row `index` (rows of d) from fp32 o: for bf16 rounded into the output (o a buffer),
 * for fp32 o is the output row already. */
static inline void put_row(const Attn *a, int64_t index, const float *o) {
    if (!a->bf) return;
    bf16 *dst = (bf16 *)a->out + index * a->d;
    int64_t x = 0;
    for (; x + BV <= a->d; x += BV) store_bf16(dst + x, bload(o + x));
    for (; x < a->d; ++x) dst[x] = f_to_bf(o[x]);
}

/* Where output row `index` is computed: in place for fp32, buf for bf16. */
static inline float *out_row(const Attn *a, int64_t index, float *buf) {
    return a->bf ? buf : (float *)a->out + index * a->d;
}

/* Keys [klo, klo + n) packed for the scores' tile: kp [Lp / 2V, D, 2V] (key j at block j / 2V,
 * lane j % 2V); values for the values' tile: vp [D / 2V, Lp, 2V]. Padding keys are zeros. */
static void pack_keys(const Attn *a, int64_t r, int64_t h, int64_t klo, int64_t n, int64_t lp,
                      float *kp, float *vp, float *rowbuf) {
    const int64_t d = a->d;
    memset(kp, 0, sizeof(float) * lp * d);
    memset(vp, 0, sizeof(float) * lp * d);
    for (int64_t j = 0; j < n; ++j) {
        const float *kr = key_row(a, a->k_pool, a->k, r, h, klo + j, rowbuf);
        const float *vr = key_row(a, a->v_pool, a->v, r, h, klo + j, rowbuf + d);
        float *kb = kp + (j / BLOCK) * d * BLOCK + j % BLOCK;
        for (int64_t x = 0; x < d; ++x) kb[x * BLOCK] = kr[x];
        for (int64_t c = 0; c < d / BLOCK; ++c)
            memcpy(vp + (c * lp + j) * BLOCK, vr + c * BLOCK, sizeof(float) * BLOCK);
    }
}

/* [jlo, jhi): the keys (indices from klo, nk of them) that a query at position pos sees: all of
 * them in a DECODE row; in an ENCODE row those at or before pos and, on a sliding layer, after
 * pos - window. */
static inline void visible(const Attn *a, int dec, int64_t pos, int64_t klo, int64_t nk,
                           int64_t *jlo, int64_t *jhi) {
    *jlo = 0;
    *jhi = nk;
    if (dec) return;
    *jhi = pos + 1 - klo;
    if (a->window > 0 && pos - (a->window - 1) > klo) *jlo = pos - (a->window - 1) - klo;
}

/* p[0, lp) = exp(s - max) over the visible keys [jlo, jhi), 0 elsewhere; returns 1 / sum. */
static float softmax_row(float *p, int64_t lp, int64_t jlo, int64_t jhi, float scale) {
    mvi iota;
    for (int x = 0; x < MOE_V; ++x) iota[x] = x;
    const mv low = (mv){0} - __builtin_inff();
    mv top = low;
    for (int64_t j = jlo / MOE_V * MOE_V; j < jhi; j += MOE_V) {
        mvi idx = iota + (int32_t)j;
        mvi keep = (idx >= (int32_t)jlo) & (idx < (int32_t)jhi);
        mv x = mload(p + j);
        x = (mv)(((mvi)x & keep) | ((mvi)low & ~keep));
        mvi more = x > top;
        top = (mv)(((mvi)x & more) | ((mvi)top & ~more));
    }
    float best = top[0];
    for (int x = 1; x < MOE_V; ++x) best = top[x] > best ? top[x] : best;
    best *= scale; /* scale > 0: the maximum of the scaled scores */
    mv acc = {0};
    for (int64_t j = 0; j < lp; j += MOE_V) {
        mvi idx = iota + (int32_t)j;
        mvi keep = (idx >= (int32_t)jlo) & (idx < (int32_t)jhi);
        mv e = mexp(mclamp(mload(p + j) * scale - best, -80.0f, 0.0f));
        e = (mv)((mvi)e & keep);
        mstore(p + j, e);
        acc += e;
    }
    float sum = 0.0f;
    for (int x = 0; x < MOE_V; ++x) sum += acc[x];
    return 1.0f / sum;
}

static inline float mdot(const float *x, const float *y, int64_t d) {
    mv acc = {0};
    for (int64_t i = 0; i < d; i += MOE_V) acc += mload(x + i) * mload(y + i);
    float sum = 0.0f;
    for (int x = 0; x < MOE_V; ++x) sum += acc[x];
    return sum;
}

/* An item of fewer score rows than a tile (an AR step's one query per row): each query's
 * scores, softmax and values straight from the keys' rows, nothing packed. s: [nk] scratch;
 * rowbuf: [3, D] (bf16 rows read into fp32, the output row). */
static void attend_few(const Attn *a, int64_t r, int64_t h, int64_t t0, int64_t t1, int64_t klo,
                       int64_t nk, int dec, float *s, float *rowbuf) {
    const int64_t d = a->d, g = a->hq / a->hkv, st = a->start[r];
    float *qbuf = rowbuf, *kbuf = rowbuf + d, *obuf = rowbuf + 2 * d;
    for (int64_t i = 0; i < (t1 - t0) * g; ++i) {
        const int64_t token = a->offset[r] + t0 + i / g, head = h * g + i % g;
        const float *qr = row_f32(a, a->q, token * a->hq + head, qbuf);
        int64_t jlo, jhi;
        visible(a, dec, st + t0 + i / g, klo, nk, &jlo, &jhi);
        float best = -__builtin_inff(), sum = 0.0f;
        for (int64_t j = jlo; j < jhi; ++j) {
            s[j] = mdot(qr, key_row(a, a->k_pool, a->k, r, h, klo + j, kbuf), d) * a->scale;
            best = s[j] > best ? s[j] : best;
        }
        float *o = out_row(a, token * a->hq + head, obuf);
        memset(o, 0, sizeof(float) * d);
        for (int64_t j = jlo; j < jhi; ++j) {
            const float p = expf(s[j] - best);
            const float *vr = key_row(a, a->v_pool, a->v, r, h, klo + j, kbuf);
            sum += p;
            for (int64_t x = 0; x < d; x += MOE_V) mstore(o + x, mload(o + x) + p * mload(vr + x));
        }
        const float inv = 1.0f / sum;
        for (int64_t x = 0; x < d; x += MOE_V) mstore(o + x, mload(o + x) * inv);
        put_row(a, token * a->hq + head, o);
    }
}

#if CANVAS_AMX
/* Key `pos` of row r, head h, bf16 as it is stored: from its page below `start`, else the row's
 * new keys (`key_row` without the conversion). */
static inline const bf16 *key_bf16(const Attn *a, const void *pool, const void *fresh,
                                   int64_t r, int64_t h, int64_t pos) {
    const int64_t st = a->start[r], d = a->d;
    if (pos >= st) return (const bf16 *)fresh + ((a->offset[r] + pos - st) * a->hkv + h) * d;
    const int64_t page = a->page_table[r * a->max_pages + pos / a->size];
    return (const bf16 *)pool + ((page * a->hkv + h) * a->size + pos % a->size) * d;
}

/* An item's scores and values on AMX tiles (`bf` 2: bf16 tensors, D a multiple of 32): q's
 * rows bf16 as they are, the keys packed as TDPBF16PS' right-hand side (kb [Lp / 16, D / 2, 16,
 * 2]: 16 keys' pairs of dimensions), the values too (vb [D / 16, Lp / 2, 16, 2]: 16 dimensions'
 * pairs of keys); the scores in fp32 (q.k over D in TDPBF16PS' order, times `scale` in the
 * softmax), each softmax row's exp rounded to bf16 in place of its scores (the values' product
 * takes bf16: the rounding of the weights, not of the sums, which stay fp32), the output divided
 * by the fp32 sum and rounded to bf16. Score rows 16 at a time (the last tile as many as are
 * left); a row's values depend on its own keys and queries only. */
static void attend_amx(const Attn *a, int64_t r, int64_t h, int64_t t0, int64_t m, int64_t klo,
                       int64_t nk, int64_t lp, int dec, float *scratch, int64_t lmax) {
    const int64_t d = a->d, g = a->hq / a->hkv, st = a->start[r];
    bf16 *kb = (bf16 *)scratch, *vb = (bf16 *)(scratch + lmax * d);
    float *s = scratch + 2 * lmax * d, *qbuf = s + g * a->qblock * lmax;
    float *ob = qbuf + g * a->qblock * d; /* `attend`'s scratch: kp, vp, s, qbuf, obuf */
    bf16 *qb = (bf16 *)qbuf;
    memset(kb, 0, sizeof(bf16) * lp * d);
    memset(vb, 0, sizeof(bf16) * lp * d);
    for (int64_t j = 0; j < nk; j += 2) {
        const bf16 *k0 = key_bf16(a, a->k_pool, a->k, r, h, klo + j);
        const bf16 *v0 = key_bf16(a, a->v_pool, a->v, r, h, klo + j);
        const int two = j + 1 < nk; /* an odd last key's partner: zero values */
        const bf16 *v1 = two ? key_bf16(a, a->v_pool, a->v, r, h, klo + j + 1) : v0;
        for (int e = 0; e < 2 && j + e < nk; ++e) { /* a key's pairs of dimensions: words */
            const bf16 *kr = e ? key_bf16(a, a->k_pool, a->k, r, h, klo + j + 1) : k0;
            uint32_t *dst = (uint32_t *)kb + ((j + e) / 16) * (d / 2) * 16 + (j + e) % 16;
            for (int64_t p = 0; p < d / 2; ++p) memcpy(dst + p * 16, kr + 2 * p, 4);
        }
        for (int64_t c = 0; c < d / 16; ++c) { /* the two keys' values, dimension by dimension */
            bf16 *dst = vb + (c * (lp / 2) + j / 2) * 32;
            for (int x = 0; x < 16; ++x)
                dst[2 * x] = v0[c * 16 + x], dst[2 * x + 1] = two ? v1[c * 16 + x] : 0;
        }
    }
    for (int64_t i = 0; i < m; ++i) {
        const int64_t index = (a->offset[r] + t0 + i / g) * a->hq + h * g + i % g;
        memcpy(qb + i * d, (const bf16 *)a->q + index * d, sizeof(bf16) * d);
    }
    int configured = 0;
    for (int64_t m0 = 0; m0 < m; m0 += 16) {
        const int mt = m - m0 < 16 ? (int)(m - m0) : 16;
        if (mt != configured) amx_configure_dense(mt), configured = mt;
        for (int64_t c = 0; c < lp / 16; ++c) {
            _tile_zero(0);
            for (int64_t x = 0; x < d; x += 32) {
                _tile_loadd(4, qb + m0 * d + x, d * 2);
                _tile_loadd(6, kb + (c * (d / 2) + x / 2) * 32, 64);
                _tile_dpbf16ps(0, 4, 6);
            }
            _tile_stored(0, s + m0 * lp + c * 16, lp * 4);
        }
        float inv[16];
        for (int x = 0; x < mt; ++x) {
            int64_t jlo, jhi;
            float *row = s + (m0 + x) * lp;
            visible(a, dec, st + t0 + (m0 + x) / g, klo, nk, &jlo, &jhi);
            inv[x] = softmax_row(row, lp, jlo, jhi, a->scale);
            for (int64_t j = 0; j < lp; j += BV) /* in place: bf16 j at byte 2j, read at 4j */
                store_bf16((bf16 *)row + j, bload(row + j));
        }
        for (int64_t c = 0; c < d / 16; ++c) {
            _tile_zero(0);
            for (int64_t j = 0; j < lp; j += 32) {
                _tile_loadd(4, (const bf16 *)(s + m0 * lp) + j, lp * 4);
                _tile_loadd(6, vb + (c * (lp / 2) + j / 2) * 32, 64);
                _tile_dpbf16ps(0, 4, 6);
            }
            _tile_stored(0, ob + c * 16, d * 4);
        }
        for (int x = 0; x < mt; ++x) {
            const int64_t i = m0 + x;
            float *o = ob + x * d;
            bf16 *dst = (bf16 *)a->out + ((a->offset[r] + t0 + i / g) * a->hq + h * g + i % g) * d;
            for (int64_t y = 0; y < d; y += BV) store_bf16(dst + y, bload(o + y) * inv[x]);
        }
    }
    if (configured) _tile_release();
}
#endif

/* One item: row r, KV head h, the row's queries [t0, t1). scratch: kp, vp [Lp, D], the scores
 * [G * qblock, Lp], then (bf16) the queries [G * qblock, D], a tile's outputs [16, D] and three
 * rows [3, D] (ATTN_EXTRA). */
#define ATTN_EXTRA(d, g, qblock) ((d) * ((g) * (qblock) + 16 + 3))
static void attend(const Attn *a, int64_t r, int64_t h, int64_t t0, float *scratch, int64_t lmax) {
    const int64_t d = a->d, g = a->hq / a->hkv, st = a->start[r], n = a->count[r];
    const int64_t t1 = t0 + a->qblock < n ? t0 + a->qblock : n;
    const int dec = a->decode[r] != 0;
    int64_t klo, khi;
    if (dec) {
        klo = a->window > 0 && st - (a->window - 1) > 0 ? st - (a->window - 1) : 0;
        khi = st + n;
    } else {
        int64_t first = st + t0 - (a->window - 1);
        klo = a->window > 0 && first > 0 ? first : 0;
        khi = st + t1;
    }
    const int64_t nk = khi - klo, lp = (nk + BLOCK - 1) / BLOCK * BLOCK;
    if (lp > lmax) return; /* never: the caller sizes the scratch for the longest */
    const int64_t m = g * (t1 - t0); /* query i of the block, head j: score row i * g + j */
    float *kp = scratch, *vp = kp + lmax * d, *s = vp + lmax * d;
    float *qbuf = s + g * a->qblock * lmax, *obuf = qbuf + g * a->qblock * d;
    float *rowbuf = obuf + 16 * d;
    if (m < MOE_MR) {
        attend_few(a, r, h, t0, t1, klo, nk, dec, scratch, rowbuf);
        return;
    }
#if CANVAS_AMX
    if (a->bf == 2 && d % 32 == 0 && amx_ready()) {
        attend_amx(a, r, h, t0, m, klo, nk, lp, dec, scratch, lmax);
        return;
    }
#endif
    pack_keys(a, r, h, klo, nk, lp, kp, vp, rowbuf);
    const float *rows[MOE_MR];
    float inv[MOE_MR];
    for (int64_t m0 = 0; m0 < m; m0 += MOE_MR) {
        const int mt = m - m0 < MOE_MR ? (int)(m - m0) : MOE_MR;
        for (int x = 0; x < MOE_MR; ++x) {
            int64_t i = m0 + (x < mt ? x : mt - 1);
            const int64_t index = (a->offset[r] + t0 + i / g) * a->hq + h * g + i % g;
            rows[x] = row_f32(a, a->q, index, qbuf + i * d);
        }
        for (int64_t c = 0; c < lp / BLOCK; ++c) {
            mv y0[MOE_MR], y1[MOE_MR];
            tile_2v(rows, kp + c * d * BLOCK, d, y0, y1);
            for (int x = 0; x < mt; ++x) {
                mstore(s + (m0 + x) * lp + c * BLOCK, y0[x]);
                mstore(s + (m0 + x) * lp + c * BLOCK + MOE_V, y1[x]);
            }
        }
        for (int x = 0; x < mt; ++x) {
            int64_t jlo, jhi;
            visible(a, dec, st + t0 + (m0 + x) / g, klo, nk, &jlo, &jhi);
            inv[x] = softmax_row(s + (m0 + x) * lp, lp, jlo, jhi, a->scale);
            rows[x] = s + (m0 + x) * lp;
        }
        for (int x = mt; x < MOE_MR; ++x) rows[x] = rows[mt - 1];
        for (int64_t c = 0; c < d / BLOCK; ++c) {
            mv y0[MOE_MR], y1[MOE_MR];
            tile_2v(rows, vp + c * lp * BLOCK, lp, y0, y1);
            for (int x = 0; x < mt; ++x) {
                int64_t i = m0 + x;
                float *o = out_row(a, (a->offset[r] + t0 + i / g) * a->hq + h * g + i % g,
                                   obuf + x * d);
                mstore(o + c * BLOCK, y0[x] * inv[x]);
                mstore(o + c * BLOCK + MOE_V, y1[x] * inv[x]);
            }
        }
        for (int x = 0; x < mt; ++x) {
            int64_t i = m0 + x;
            put_row(a, (a->offset[r] + t0 + i / g) * a->hq + h * g + i % g, obuf + x * d);
        }
    }
}

int64_t canvas_attention_lanes(void) { return MOE_V; }

CANVAS_DEFINE_OPENMP(canvas_attention_openmp)

/* Items [begin, end) of `items` ([num_items, 3]: row, KV head, first query), on
 * `threads` threads of the calling thread's OpenMP team (one item at a time each, the next
 * free thread taking the next: items differ in size), thread t with scratch
 * [t * per_thread, (t + 1) * per_thread); without OpenMP one by one on scratch 0. */
typedef struct {
    const void *q, *k, *v, *k_pool, *v_pool;
    const int32_t *start, *offset, *count, *decode, *page_table;
    const int64_t *items;
    void *out;
    float *scratch;
    int64_t max_pages, hq, hkv, d, size, window, qblock;
    float scale;
    int64_t lmax, bf, begin, end, threads; /* items [begin, end); bf: Attn's */
} AttentionArgs;

void canvas_attention(const AttentionArgs *p) {
    const Attn a = {p->q,        p->k,   p->v,         p->k_pool, p->v_pool, p->start,
                    p->offset,   p->count, p->decode,  p->page_table, p->out, p->max_pages,
                    p->hq,       p->hkv, p->d,         p->size,   p->window, p->qblock,
                    p->scale,    p->bf};
    const int64_t threads = p->threads, lmax = p->lmax, *items = p->items;
    const int64_t g = p->hq / p->hkv;
    const int64_t per_thread = lmax * (2 * p->d + g * p->qblock) + ATTN_EXTRA(p->d, g, p->qblock);
    float *scratch = p->scratch;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
#endif
    for (int64_t i = p->begin; i < p->end; ++i)
        attend(&a, items[3 * i], items[3 * i + 1], items[3 * i + 2],
               scratch + (threads > 1 ? CANVAS_THREAD() : 0) * per_thread, lmax);
}
