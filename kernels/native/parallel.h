/* Rows [begin, end) in `canvas_chunks` contiguous ranges per thread, each running CALL with its
 * own `b` and `e` (and `t`, the running thread's index, for per-thread scratch), handed to the
 * threads as they come free: a thread that the OS preempts (the clients, the HTTP front end
 * and other tenants share these cores) no longer holds the other at the region's end with half
 * the rows (static halves lose when another process takes part of a core). Built with -fopenmp
 * (`kernels.native.build` builds every library so where the compiler can), the ranges run on
 * the calling thread's OpenMP team, which is torch's: this library shares torch's libgomp
 * (the same soname, loaded first), so the work goes to torch's own
 * workers, which spin briefly after each of torch's parallel regions and would otherwise hold
 * the other cores against any thread of ours. Without OpenMP the ranges run one by one. */
#ifndef CANVAS_PARALLEL_H
#define CANVAS_PARALLEL_H
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#define CANVAS_PRAGMA(text) _Pragma(#text)
#define CANVAS_OMP_FOR(n) CANVAS_PRAGMA(omp parallel for schedule(dynamic, 1) num_threads(n) if(n > 1))
#define CANVAS_THREAD() omp_get_thread_num()
#else
#define CANVAS_OMP_FOR(threads)
#define CANVAS_THREAD() 0
#endif

/* Ranges per thread, a library's global (4; 1: one range per thread, static halves). Tests and
 * experiments set it through ctypes (`c_int64.in_dll(lib, "canvas_chunks")`). */
extern int64_t canvas_chunks;

#define PARALLEL_ROWS(threads, begin, end, CALL)                                            \
    do {                                                                                   \
        const int64_t n_ = (threads) > 1 ? (threads) : 1, b0_ = (begin), e0_ = (end);      \
        int64_t p_ = n_ > 1 ? n_ * canvas_chunks : 1;                                      \
        if (p_ > e0_ - b0_) p_ = e0_ - b0_ > n_ ? e0_ - b0_ : n_;                          \
        CANVAS_OMP_FOR(n_)                                                                 \
        for (int64_t t_ = 0; t_ < p_; ++t_) {                                              \
            const int64_t b = b0_ + (e0_ - b0_) * t_ / p_;                                 \
            const int64_t e = b0_ + (e0_ - b0_) * (t_ + 1) / p_;                           \
            const int64_t t = CANVAS_THREAD();                                             \
            (void)t;                                                                       \
            CALL;                                                                          \
        }                                                                                  \
    } while (0)

/* 1 when built with OpenMP. */
#define CANVAS_DEFINE_OPENMP(name)                                                         \
    int64_t canvas_chunks = 4;                                                             \
    int64_t name(void) {                                                                   \
        return CANVAS_OPENMP_ON;                                                           \
    }
#ifdef _OPENMP
#define CANVAS_OPENMP_ON 1
#else
#define CANVAS_OPENMP_ON 0
#endif
#endif
