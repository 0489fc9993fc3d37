/* Canvas' fused CPU sampler: the fast-numerics twin of `kernels.reference_sampler.fused_sample`
 * (and of the probabilities `sample_and_embed` multiplies by the embedding) in three passes
 * over each row, where the twin makes about fifteen passes over the whole [P, V] logits.
 *
 * Per row p of logits [P, V] (fp32, contiguous), temperature T[p] > 0 and uniform u[p] in [0, 1):
 *   s      = logits / T;  top = max s, argmax = its first index
 *   d      = max(s - top, -70);  e = exp(d), 0 below 4.3e-31 (as the twin: no subnormals)
 *   probs  = e / sum e;  lse = top + log(sum e);  entropy = max(log(sum e) - sum probs * d, 0)
 *   sample = the first index whose running sum of probs exceeds u * sum probs
 * A row with a NaN or an infinite maximum gets lse = entropy = NaN (the engine fails such a
 * row's request), probabilities 0 and sample = argmax.
 *
 * C with GCC/Clang vector extensions (W = 8 lanes: AVX2 or AVX-512 under -march=native, two
 * SSE registers otherwise). The rows split among threads as `parallel.h` says: built with
 * -fopenmp (where the compiler has it), on torch's own OpenMP team, so torch's runtime stays
 * the only one in the process; without OpenMP, in ranges the Python side hands to its own
 * threads, which call this without the GIL (`kernels.native.threads.split_rows`).
 * Every sum runs in a fixed order (vector lanes, then lanes in order, then the scalar tail),
 * so a row's results never depend on where it sits in memory, i.e. on its batch. Built with
 * the system compiler at first use (`kernels.native.build`); `exp` is a Cephes-style
 * polynomial (~1 ulp), so values differ from the twin's in the last bits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "parallel.h"

#define NEGLIGIBLE_LOG_PROB (-70.0f)
#define NEGLIGIBLE_PROB (4.3e-31f)
#define BLOCK 64 /* the sample's search sums blocks of this many probabilities first (a multiple of W) */

/* GCC/Clang vector extensions: 8 lanes, compiled to whatever SIMD -march=native offers. */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
#define W 8

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* exp(x) for x in [-70, 0] (all this kernel needs): 2^n * exp(r), r = x - n ln 2 in
 * [-ln2/2, ln2/2], a Cephes polynomial for exp(r). One lane and W lanes, the same operations. */
#define EXP_BODY(FLOOR)                                                                    \
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f,                      \
                ln2_lo = -2.12194440e-4f;                                                  \
    n = FLOOR;                                                                             \
    r = x - n * ln2_hi - n * ln2_lo;                                                       \
    p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                           \
    p = p * r + 8.3334519073e-3f;                                                          \
    p = p * r + 4.1665795894e-2f;                                                          \
    p = p * r + 1.6666665459e-1f;                                                          \
    p = p * r + 5.0000001201e-1f;                                                          \
    p = p * r * r + r + 1.0f;

static inline float exp_one(float x) {
    float n, r, p;
    EXP_BODY(floorf(x * log2e + 0.5f))
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline vf floor_w(vf y) { /* floor for |y| < 2^31 */
    vf t = __builtin_convertvector(__builtin_convertvector(y, vi), vf);
    return t + __builtin_convertvector((vi)(t > y), vf); /* a true lane is -1 */
}

static inline vf exp_w(vf x) {
    vf n, r, p;
    EXP_BODY(floor_w(x * log2e + 0.5f))
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)bits;
}

static inline vf select_w(vi mask, vf yes, vf no) {
    return (vf)(((vi)yes & mask) | ((vi)no & ~mask));
}

static inline float sum_w(vf v) { /* lanes in a fixed order */
    float total = 0.0f;
    for (int j = 0; j < W; ++j) total += v[j];
    return total;
}

/* s = x / t into out (it is the row's scratch until pass 3), its maximum and a NaN flag. */
static float scaled_max(const float *x, float t, int64_t vocab, float *out, int *nan_seen) {
    vf top = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
              -INFINITY};
    vi nan = {0};
    int64_t i = 0;
    for (; i + W <= vocab; i += W) {
        vf s = load(x + i) / t;
        memcpy(out + i, &s, sizeof s);
        top = select_w(s > top, s, top);
        nan |= s != s;
    }
    float best = -INFINITY;
    int flag = 0;
    for (; i < vocab; ++i) {
        float s = x[i] / t;
        out[i] = s;
        best = s > best ? s : best;
        flag |= s != s;
    }
    for (int j = 0; j < W; ++j) {
        best = top[j] > best ? top[j] : best;
        flag |= nan[j] != 0;
    }
    *nan_seen = flag;
    return best;
}

/* out = e = exp(d), d = max(out - top, -70), 0 below 4.3e-31; returns sum e and, in
 * *weighted, sum e * d (the entropy's numerator: sum p * d = sum e * d / sum e). */
static float exponentials(float *out, int64_t vocab, float top, float *weighted) {
    vf total = {0}, dot = {0};
    int64_t i = 0;
    for (; i + W <= vocab; i += W) {
        vf d = load(out + i) - top;
        d = select_w(d < NEGLIGIBLE_LOG_PROB, (vf){0} + NEGLIGIBLE_LOG_PROB, d);
        vf e = exp_w(d);
        e = select_w(e < NEGLIGIBLE_PROB, (vf){0}, e);
        memcpy(out + i, &e, sizeof e);
        total += e;
        dot += e * d;
    }
    float tail = 0.0f, tail_dot = 0.0f;
    for (; i < vocab; ++i) {
        float d = out[i] - top;
        d = d < NEGLIGIBLE_LOG_PROB ? NEGLIGIBLE_LOG_PROB : d;
        float e = exp_one(d);
        e = e < NEGLIGIBLE_PROB ? 0.0f : e;
        out[i] = e;
        tail += e;
        tail_dot += e * d;
    }
    *weighted = sum_w(dot) + tail_dot;
    return sum_w(total) + tail;
}

/* out /= total; returns the sum of the quotients. */
static float normalise(float *out, int64_t vocab, float total) {
    vf mass = {0};
    int64_t i = 0;
    for (; i + W <= vocab; i += W) {
        vf q = load(out + i) / total;
        memcpy(out + i, &q, sizeof q);
        mass += q;
    }
    float tail = 0.0f;
    for (; i < vocab; ++i) {
        out[i] /= total;
        tail += out[i];
    }
    return sum_w(mass) + tail;
}

/* The first index whose running sum of probs exceeds target: whole blocks of BLOCK summed
 * first, then the running sum within the block that crosses it; -1 if none does. */
static int64_t search(const float *probs, int64_t vocab, float target) {
    float running = 0.0f;
    int64_t block = 0;
    for (; block + BLOCK <= vocab; block += BLOCK) {
        vf part = {0};
        for (int64_t i = block; i < block + BLOCK; i += W) part += load(probs + i);
        float sum = sum_w(part);
        if (running + sum > target) break;
        running += sum;
    }
    for (int64_t i = block; i < vocab; ++i) {
        running += probs[i];
        if (running > target) return i;
    }
    return -1;
}

static void sample_rows(const float *logits, int64_t vocab, const float *temperature,
                        const float *uniform, int64_t row_begin, int64_t row_end, float *probs,
                        int64_t *sample, int64_t *argmax, float *entropy, float *lse) {
    for (int64_t p = row_begin; p < row_end; ++p) {
        float *out = probs + p * vocab;
        int nan_seen;
        const float top = scaled_max(logits + p * vocab, temperature[p], vocab, out, &nan_seen);
        int64_t best = 0;
        while (best < vocab - 1 && !(out[best] == top)) ++best; /* the first maximum */
        argmax[p] = best;
        if (nan_seen || !isfinite(top)) {
            memset(out, 0, (size_t)vocab * sizeof *out);
            sample[p] = best;
            entropy[p] = NAN;
            lse[p] = NAN;
            continue;
        }
        float weighted;
        const float total = exponentials(out, vocab, top, &weighted);
        const float log_z = logf(total);
        const float mass = normalise(out, vocab, total);
        const float h = log_z - weighted / total;
        entropy[p] = h > 0.0f ? h : 0.0f;
        lse[p] = top + log_z;
        int64_t chosen = search(out, vocab, uniform[p] * mass);
        if (chosen < 0) { /* rounding left the target above the sum: the last possible token */
            chosen = best;
            for (int64_t i = vocab - 1; i >= 0; --i)
                if (out[i] > 0.0f) {
                    chosen = i;
                    break;
                }
        }
        sample[p] = chosen;
    }
}

/* Rows [begin, end) on `threads` threads (parallel.h). */
CANVAS_DEFINE_OPENMP(canvas_sampler_openmp)

/* The call's arguments, one struct (`kernels.native.args`: the same fields in the same
 * order). */
typedef struct {
    const float *logits;
    int64_t vocab;
    const float *temperature, *uniform;
    float *probs;
    int64_t *sample, *argmax;
    float *entropy, *lse;
    int64_t begin, end, threads;
} SampleArgs;

void canvas_sample_rows(const SampleArgs *a) {
    PARALLEL_ROWS(a->threads, a->begin, a->end,
                  sample_rows(a->logits, a->vocab, a->temperature, a->uniform, b, e, a->probs,
                              a->sample, a->argmax, a->entropy, a->lse));
}
