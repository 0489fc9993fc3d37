/* AMX tiles for the native kernels (bf16_amx.h's products, attention.c's bf16 scores and
 * values): CANVAS_AMX where the compiler targets AMX (-march=native on a CPU with amx_tile and
 * amx_bf16), `amx_ready` where Linux also grants this process the tile data (arch_prctl
 * ARCH_REQ_XCOMP_PERM, once per process), and the tile configurations. */
#ifndef CANVAS_AMX_H
#define CANVAS_AMX_H
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define CANVAS_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

static int amx_ready(void) {
    static int state = -1; /* the request is the process's: asked once */
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxConfig;

/* Tiles 0-3 accumulators and 4, 5 rows (`rows` each: a partial tile of rows is read and
 * written in place), 6, 7 a right-hand side (16 pairs); every tile 64 bytes wide. */
static void amx_configure_dense(int rows) {
    AmxConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = t >= 6 ? 16 : rows;
    _tile_loadconfig(&cfg);
}
#else
#define CANVAS_AMX 0
static int amx_ready(void) { return 0; }
#endif
#endif
