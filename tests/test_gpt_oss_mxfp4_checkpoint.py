"""gpt-oss's MXFP4 checkpoints (quantization_config mxfp4: each expert
projection's *_blocks and *_scales): read as GGML's MXFP4 blocks of the
same codes and scales, run as stored, logits as transformers computes them
over the values transformers' own unpacking gives."""
from __future__ import annotations

import json

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from test_reference_hf_tiny import chunked_logits
from tiny_models import save_with_tokenizer, tiny_hf_model
from trajserve.model.llama import LlamaModel
from trajserve.model.loader import load_weights
from trajserve.model.quant import QuantizedWeight

MXFP4 = gguf.GGMLQuantizationType.MXFP4


def checkpoint_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, in] floats -> the checkpoint's blocks [E, rows, in / 32, 16]
    (values 2j and 2j + 1 in byte j) and e8m0 scales [E, rows, in / 32],
    written here from gguf's MXFP4 quantizer, independently of the reader."""
    E, rows, k = w.shape
    raw = gguf.quants.quantize(w.reshape(-1, k).numpy(), MXFP4).reshape(E, rows, k // 32, 17)
    codes = np.concatenate([raw[..., 1:] & 0x0F, raw[..., 1:] >> 4], axis=-1)  # value order
    return torch.from_numpy(codes[..., 0::2] | (codes[..., 1::2] << 4)), torch.from_numpy(raw[..., 0].copy())


def write_mxfp4_checkpoint(d, hf) -> None:
    """The tiny model saved, its experts replaced by blocks and scales as
    OpenAI's release stores them (gate_up rows interleaved gate, up)."""
    save_with_tokenizer(hf, d)
    (f,) = list(d.glob("*.safetensors"))
    tensors = load_file(str(f))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = checkpoint_blocks(tensors.pop(name).transpose(1, 2).contiguous())  # [E, out, in]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(f))
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (d / "config.json").write_text(json.dumps(cfg))


def test_an_mxfp4_checkpoint_runs_its_experts_as_stored_and_scores_as_transformers(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = tiny_hf_model("gpt_oss", num_hidden_layers=2)
    write_mxfp4_checkpoint(tmp_path, hf)
    packed = load_file(str(next(tmp_path.glob("*.safetensors"))))
    with torch.no_grad():  # the reference model: transformers' own unpacking of the checkpoint's experts
        for i, layer in enumerate(hf.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                p = f"model.layers.{i}.mlp.experts.{proj}"
                getattr(layer.mlp.experts, proj).copy_(
                    convert_moe_packed_tensors(packed[p + "_blocks"], packed[p + "_scales"], dtype=torch.float32))
    counts: dict[str, int] = {}
    cfg, weights = load_weights(tmp_path, torch.float32, "cpu", quantization="auto", requantized=counts)
    gate = weights["model.layers.1.mlp.experts.5.gate_proj.weight"]
    assert isinstance(gate, QuantizedWeight) and gate.fmt == "mxfp4" and counts == {}
    assert torch.equal(gate.dequantize(), hf.model.layers[1].mlp.experts.gate_up_proj[5, :, 0::2].T)
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (40,)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    # Dequantized (torch's products): transformers' logits; as stored (the C kernels round the activations too).
    _, floats = load_weights(tmp_path, torch.float32, "cpu")
    plain = chunked_logits(LlamaModel(cfg, floats, 256, torch.float32, "cpu", use_cpu_kernels=False), ids)
    torch.testing.assert_close(plain, ref, atol=1e-4, rtol=1e-4)
    stored = chunked_logits(LlamaModel(cfg, weights, 256, torch.float32, "cpu"), ids)
    assert (stored - ref).norm() < 0.15 * ref.norm()
