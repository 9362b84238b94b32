"""The load-time checks of the AMX paths, run by cpu_kernels.load() on a
CpuKernels (passed in: this module imports nothing of the kernels'; a path is
tried on a twin with it on, `with_paths`): each path is used only where this
CPU runs it and it gives the bits of the path it stands in for."""
from __future__ import annotations

import logging

import numpy as np
import torch

from trajserve.model.formats import CODES
from trajserve.model.quant import STORED_FORMATS, QuantizedWeight

log = logging.getLogger(__name__)


def _bf16_pool(rng: np.random.Generator, blocks: int, hkv: int, bs: int, d: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((2, blocks, hkv, bs, d), dtype=np.float32)).to(torch.bfloat16)


def _chunk_and_its_decodes(k, kv: torch.Tensor, q: torch.Tensor, table: torch.Tensor, ctx: int):
    """A chunk of q's queries (the last at ctx - 1) through prefill_attention,
    and each query decoded alone over the keys it sees."""
    n = q.shape[0]
    chunk, decodes = torch.empty_like(q), torch.empty_like(q)
    per_query = (table.repeat(n), torch.arange(n, dtype=torch.int64) * table.shape[0],
                 torch.arange(ctx - n + 1, ctx + 1, dtype=torch.int64), torch.arange(n, dtype=torch.int64))
    k.prefill_attention(q, kv[0], kv[1], table, ctx, 0.125, chunk)
    k.decode_attention(q, kv[0], kv[1], *per_query, 0.125, decodes)
    return chunk, decodes


def amx_usable(k, flags: frozenset[str]) -> bool:
    """Whether the AMX attention over a bf16 pool (prefill and decode) runs
    here and gives the vector decode kernel's bits: an avx512 build,
    AMX-BF16 in /proc/cpuinfo, the tile state granted by Linux, and a chunk
    computed on tiles, and its queries decoded on tiles, bit for bit equal to
    the vector kernel's decodes."""
    if k.isa != "avx512" or not {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags or not k.lib.ts_amx_init():
        return False
    rng = np.random.default_rng(11)
    kv = _bf16_pool(rng, 9, 2, 16, 64)
    q = torch.from_numpy(rng.standard_normal((40, 6, 64), dtype=np.float32))
    table = torch.tensor([4, 0, 7, 2, 8, 1, 3], dtype=torch.int64)
    tiles, tile_decodes = _chunk_and_its_decodes(k.with_paths(amx=True), kv, q, table, 100)
    k = k.with_paths(amx=False)
    decodes = torch.empty_like(q)
    k.prefill_attention(q, kv[0], kv[1], table, 100, 0.125, decodes)
    if not (torch.equal(tiles, decodes) and torch.equal(tile_decodes, decodes)):
        log.warning("CPU kernels: the AMX attention differs from the vector decode kernel's bits; a bf16 KV "
                    "pool runs on the vector kernel (prefill as decodes: slower)")
        return False
    return True


def amx_kv_quant_usable(k) -> bool:
    """Whether q8_0 / q4_0 pools' attention runs on the AMX tiles (rows read
    as bf16, attention_bf16.c): for each format, a chunk on tiles, a short
    chunk as tile decodes, and every query decoded alone give the same bits,
    and they are the bf16 kernels' bits over a bf16 pool holding the rows'
    values (queries and outputs rotated, model/kv_quant.py). Needs amx_usable."""
    from trajserve.model.kv_quant import FORMATS, GROUP, dequantize_q4_0, dequantize_q8_0, rotate, store_rows

    rng = np.random.default_rng(17)
    x = torch.from_numpy(rng.standard_normal((2, 9, 2, 16, 64), dtype=np.float32)) * 3
    q = torch.from_numpy(rng.standard_normal((40, 6, 64), dtype=np.float32))
    table = torch.tensor([4, 0, 7, 2, 8, 1, 3], dtype=torch.int64)
    ok = True
    for name in ("q8_0", "q4_0"):
        rows = store_rows(x, FORMATS[name])
        tiled = k.with_paths(amx_kv_quant=True)
        tiles, tile_decodes = _chunk_and_its_decodes(tiled, rows, q, table, 100)
        short = torch.empty_like(q[:3])
        tiled.prefill_attention(q[-3:], rows[0], rows[1], table, 100, 0.125, short)
        dequantize = dequantize_q8_0 if name == "q8_0" else dequantize_q4_0
        values = dequantize(rows, 64).to(torch.bfloat16)  # the rotated values, as bf16
        bf16 = torch.empty_like(q)
        k.prefill_attention(rotate(q), values[0], values[1], table, 100, 0.125 / GROUP, bf16)
        bf16 = rotate(bf16) * (1 / GROUP)
        ok = ok and torch.equal(tiles, tile_decodes) and torch.equal(short, tiles[-3:]) and torch.equal(tiles, bf16)
    if not ok:
        log.warning("CPU kernels: the AMX attention over q8_0 / q4_0 rows differs from its own decodes or the bf16 "
                    "kernel's bits; quantized KV pools stay on the vector kernel")
    return ok


def amx_int8_usable(k, flags: frozenset[str]) -> bool:
    """Whether quantized products run on AMX-INT8 tiles here, giving the
    vector kernel's bits: an avx512 build, AMX-INT8 in /proc/cpuinfo, the tile
    state granted, and products of every format with a tile path computed
    both ways equal."""
    if k.isa != "avx512" or not {"amx_tile", "amx_int8"} <= flags or not k.lib.ts_quant_amx_init():
        return False
    rng = np.random.default_rng(13)
    for fmt in STORED_FORMATS:
        rows = k.lib.ts_quant_tile_rows(CODES[fmt])
        if not rows:
            continue
        # Whole tiles and a part, 512 wide: two K-quant super-blocks.
        q = QuantizedWeight.random_blocks(fmt, 40, 512, rng).pack()
        x = torch.from_numpy(rng.standard_normal((rows + 21, 512), dtype=np.float32))
        tiles = k.with_paths(amx_int8=True).qlinear(x, q)
        if not torch.equal(tiles, k.with_paths(amx_int8=False).qlinear(x, q)):
            log.warning("CPU kernels: the AMX-INT8 %s product differs from the vector kernel's bits; "
                        "quantized products stay on the vector kernel", fmt.upper())
            return False
    return True
