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
