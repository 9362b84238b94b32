"""gpt-oss's MXFP4 checkpoints (config.json quantization_config quant_method
"mxfp4", as OpenAI ships gpt-oss): each layer's expert projections come as
`*_blocks` [experts, rows, in / 32, 16] bytes and `*_scales` [experts,
rows, in / 32] e8m0 bytes, rows of gate_up interleaved (gate, up, gate,
...). They become one QuantizedWeight an expert and projection in GGML's
MXFP4 block (the e8m0 byte, then 16 bytes: value j in the low nibble of
byte j, value j + 16 in the high one) where the checkpoint packs values 2j
and 2j + 1 into byte j: the same codes and scales, reordered, so the C
kernels run them as stored (model/quant.py)."""
from __future__ import annotations

import torch

from trajserve.model.quant import QuantizedWeight


def is_packed(name: str) -> bool:
    return name.endswith(("_blocks", "_scales"))


def ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[rows, in / 32, 16] checkpoint bytes and [rows, in / 32] scales ->
    [rows, in / 32 * 17] GGML MXFP4 bytes."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32)  # value order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).reshape(blocks.shape[0], -1).contiguous()


def split_packed_experts(out: dict, num_layers: int) -> None:
    """Each layer's packed experts (and their float biases, the router as
    mlp.gate) under one name an expert, as model/hf_reader.py's
    _split_stacked_experts does for a float checkpoint."""
    for i in range(num_layers):
        p = f"model.layers.{i}.mlp."
        if p + "experts.gate_up_proj_blocks" not in out:
            continue
        gu = out.pop(p + "experts.gate_up_proj_blocks"), out.pop(p + "experts.gate_up_proj_scales")
        down = out.pop(p + "experts.down_proj_blocks"), out.pop(p + "experts.down_proj_scales")
        gu_b, down_b = out.pop(p + "experts.gate_up_proj_bias"), out.pop(p + "experts.down_proj_bias")
        for e in range(gu[0].shape[0]):
            q = f"{p}experts.{e}."
            for name, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                blocks, scales = gu[0][e, rows], gu[1][e, rows]
                out[q + name + ".weight"] = QuantizedWeight(ggml_blocks(blocks, scales), "mxfp4",
                                                            (blocks.shape[0], blocks.shape[1] * 32))
            out[q + "gate_proj.bias"], out[q + "up_proj.bias"] = gu_b[e, 0::2].contiguous(), gu_b[e, 1::2].contiguous()
            out[q + "down_proj.weight"] = QuantizedWeight(ggml_blocks(down[0][e], down[1][e]), "mxfp4",
                                                          (down[0].shape[1], down[0].shape[2] * 32))
            out[q + "down_proj.bias"] = down_b[e]
        out[p + "gate.weight"], out[p + "gate.bias"] = out.pop(p + "router.weight"), out.pop(p + "router.bias")
