/*
 * The row kernels' thread rule, for the C files that call them in sequence (encoder_layer.c,
 * decoder_layer.c) the way their Python entry points would: below PARALLEL_MIN_ELEMENTS
 * elements a row pass runs on one thread, as common.py's _PARALLEL_MIN_ELEMENTS decides for a
 * call from Python (waking the OpenMP team costs more than it saves; torch's own grain size
 * for element-wise ops is 32768).
 */
#include <stdint.h>

#define PARALLEL_MIN_ELEMENTS 32768

static inline int row_threads(int64_t numel, int num_threads) { return numel >= PARALLEL_MIN_ELEMENTS ? num_threads : 1; }
