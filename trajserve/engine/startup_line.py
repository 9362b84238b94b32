"""The engine's start-up line: what runs, in what format, and why (each
`why` entry says how an auto setting resolved)."""
from __future__ import annotations


def startup_line(engine, formats: dict[str, int], why: dict[str, str]) -> str:
    e, mc, cc = engine, engine.model_config, engine.config.cache
    m_token = e.kv_format.bytes_per_token(mc)
    kernels = f", C kernels ({e.model.kernels.isa})" if e.model.kernels is not None else ""
    if kernels and mc.mla is not None:
        kernels += " (latent attention: decodes and verifications on them, longer prompt chunks in torch)"
    return (
        f"model {mc.name or e.model_path} ({mc.shape_summary()}) on {e.device} "
        f"in {str(e.dtype).removeprefix('torch.')} ({why['dtype']}){kernels}\n"
        f"weights: {' + '.join(f'{f} {b / 1e6:,.1f} MB' for f, b in formats.items())} read per decode step "
        f"(quantization {e.quantization}: {why['quantization']})\n"
        f"KV cache: {e.kv_format.name} ({why['kv']}) | m_token = {m_token:,} B "
        f"(eq. 1) | block = {cc.block_size} tokens = {e.block_bytes:,} B | {e.num_blocks:,} blocks | "
        f"capacity {e.kv.token_capacity:,} tokens"
        + (f" a sequence ({e.kv.num_blocks * cc.block_size:,} with every layer of every block: window layers' "
           f"pages freed behind their windows, more across sequences)" if e.kv.windowed else "")
        + f" | max_model_len {e.max_model_len:,}{why.get('rope', '')}\n"
        f"speculative decoding: {e.speculative} ({why['speculative']})"
        f" | scheduling: {e.config.scheduler.scheduling}"
        + (f"\n{e.lora.summary()}" if e.lora is not None else ""))
