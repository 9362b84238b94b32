"""The one code space for the data formats the C kernels read (formats.h):
weight panels (q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, mxfp4) and KV pool rows (float32, bfloat16, q8_0,
q4_0) share it, so a format is one number whichever kernel takes it."""
from __future__ import annotations

CODES: dict[str, int] = {"float32": 0, "bfloat16": 1, "q8_0": 2, "q4_0": 3, "q4_1": 4, "q4_k": 5, "q6_k": 6, "q5_k": 7,
                        "mxfp4": 8}
