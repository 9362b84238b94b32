/* The one code space for the data formats the C kernels read: weights
 * (q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, mxfp4 panels, quant_kernels.c) and KV pool rows (float32,
 * bfloat16, q8_0, q4_0; kv_rows.h). model/formats.py holds the same numbers
 * for the Python side; tests/test_formats.py reads this file and compares. */
#ifndef TRAJSERVE_FORMATS_H
#define TRAJSERVE_FORMATS_H

enum { TS_F32 = 0, TS_BF16 = 1, TS_Q8_0 = 2, TS_Q4_0 = 3, TS_Q4_1 = 4, TS_Q4_K = 5, TS_Q6_K = 6, TS_Q5_K = 7,
       TS_MXFP4 = 8 };

#endif
