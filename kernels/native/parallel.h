/* Rows [begin, end) in `threads` contiguous ranges, each running CALL with its own `b` and
 * `e` (and `t`, the range's index). Built with -fopenmp (kernels/native_cpu.py builds every library so where the compiler
 * can), the ranges run on the calling thread's OpenMP team, which is torch's: this library
 * shares torch's libgomp (the same soname, loaded first), so the work goes to torch's own
 * workers, which spin briefly after each of torch's parallel regions and would otherwise hold
 * the other cores against any thread of ours. Without OpenMP the ranges run one by one. */
#ifndef CANVAS_PARALLEL_H
#define CANVAS_PARALLEL_H
#include <stdint.h>

#ifdef _OPENMP
#define CANVAS_OMP_FOR(threads) _Pragma("omp parallel for schedule(static, 1) num_threads(threads) if(threads > 1)")
#else
#define CANVAS_OMP_FOR(threads)
#endif

#define PARALLEL_ROWS(threads, begin, end, CALL)                                            \
    do {                                                                                   \
        const int64_t n_ = (threads) > 1 ? (threads) : 1, b0_ = (begin), e0_ = (end);      \
        CANVAS_OMP_FOR(n_)                                                                 \
        for (int64_t t = 0; t < n_; ++t) {                                              \
            const int64_t b = b0_ + (e0_ - b0_) * t / n_;                                 \
            const int64_t e = b0_ + (e0_ - b0_) * (t + 1) / n_;                           \
            CALL;                                                                          \
        }                                                                                  \
    } while (0)

/* 1 when built with OpenMP. */
#define CANVAS_DEFINE_OPENMP(name)                                                         \
    int64_t name(void) {                                                                   \
        return CANVAS_OPENMP_ON;                                                           \
    }
#ifdef _OPENMP
#define CANVAS_OPENMP_ON 1
#else
#define CANVAS_OPENMP_ON 0
#endif
#endif
