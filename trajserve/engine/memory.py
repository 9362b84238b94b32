"""Sizing the KV pool: bytes per block from eq. 1 and a byte budget."""
from __future__ import annotations

import torch

from trajserve import units
from trajserve.config import CacheConfig, ModelConfig


def available_memory(device: torch.device) -> int:
    """Bytes free on the device now (host RAM on CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def bytes_per_block(model: ModelConfig, block_size: int, fmt) -> int:
    """m_token (eq. 1, kv-cache-management) times tokens per block; fmt a
    KVFormat (model/kv_quant.py) or a float torch dtype. One definition of a
    format's bytes: trajserve.plan.kv_format, which the planner uses too."""
    from trajserve.model.kv_quant import kv_format

    return (kv_format(fmt) if isinstance(fmt, torch.dtype) else fmt).bytes_per_token(model) * block_size


def num_blocks_for(cache: CacheConfig, model: ModelConfig, dtype, device: torch.device, reserve: int = 0) -> int:
    """Blocks of the pool. `reserve`: bytes something else allocated later
    needs (LoRA slots), kept out of a --memory-fraction budget and counted
    against the memory free."""
    per_block = bytes_per_block(model, cache.block_size, dtype)
    if cache.num_blocks is not None:
        n = cache.num_blocks
    else:
        budget = cache.kv_cache_memory
        if budget is None:
            budget = int(available_memory(device) * cache.memory_fraction) - reserve
        n = budget // per_block
    if n < 1:
        raise ValueError(
            f"KV cache budget too small: one block of {cache.block_size} tokens needs {per_block:,} bytes")
    # A pool larger than the memory free now would be killed (host) or fail
    # (device) partway through allocation; say so instead.
    free = available_memory(device) - reserve
    if n * per_block > free:
        raise ValueError(f"KV pool of {n:,} blocks needs {units.gib(n * per_block)}; only {units.gib(free)} "
                         f"of {'device' if device.type == 'cuda' else 'host'} memory is available"
                         + (f" besides {units.gib(reserve)} for LoRA slots" if reserve else ""))
    return n


def parse_bytes(text: str | int | None, what: str = "size") -> int | None:
    """'2GiB', '512MB', '1TB', '1e9' or an int -> bytes (None stays None);
    ValueError naming `what` for anything else (trajserve/units.py)."""
    return None if text is None else units.parse_bytes(text, what)
