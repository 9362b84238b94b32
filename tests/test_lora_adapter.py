"""PEFT LoRA adapters read and checked against the base model: the
deltas are PEFT's own merge, the planner counts the same
parameters, and every adapter this engine cannot serve is refused naming
the file, field or module and its shapes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tiny_models import tiny_hf_model
from trajserve.lora.adapter import AdapterError, load_adapter
from trajserve.plan.adapters import adapter_params
from trajserve.plan.model_shapes import read_hf_config

TARGETS = ["q_proj", "v_proj", "down_proj"]


def peft_adapter(tmp: Path, kind: str = "llama", r: int = 4, alpha: float = 8, rslora: bool = False,
                 targets=TARGETS, **overrides):
    """A tiny base model (saved beside) and a PEFT adapter on it with random
    B (PEFT starts B at zero: a no-op adapter would prove nothing)."""
    from peft import LoraConfig, get_peft_model

    base = tiny_hf_model(kind, **overrides)
    base.save_pretrained(tmp / "base", safe_serialization=True)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                            use_rslora=rslora))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.2)
    model.save_pretrained(tmp / "adapter")
    return model


@pytest.mark.parametrize("kind, rslora", [("llama", False), ("qwen3", True)])
def test_deltas_are_peft_merge_and_the_planner_counts_the_same(tmp_path, kind, rslora):
    overrides = {"head_dim": 32} if kind == "qwen3" else {}
    model = peft_adapter(tmp_path, kind, rslora=rslora, **overrides)
    cfg = read_hf_config(tmp_path / "base")[0]
    ad = load_adapter(tmp_path / "adapter", "a", cfg)
    assert (ad.rank, ad.alpha, ad.modules) == (4, 8.0, TARGETS)
    assert ad.scaling == pytest.approx(8 / 2 if rslora else 8 / 4)
    from safetensors.torch import load_file

    before = load_file(str(tmp_path / "base" / "model.safetensors"))  # the base weights as saved
    merged = model.merge_and_unload()
    for layer in range(cfg.num_layers):
        for module in TARGETS:
            part = "self_attn" if module != "down_proj" else "mlp"
            key = f"model.layers.{layer}.{part}.{module}.weight"
            want = dict(merged.named_parameters())[key] - before[key]
            torch.testing.assert_close(ad.delta(layer, module), want, rtol=1e-5, atol=1e-6)
        assert ad.delta(layer, "o_proj") is None
    assert ad.num_params == adapter_params(cfg, 4, TARGETS)
    assert len(ad.digest) == 64 and load_adapter(tmp_path / "adapter", "b", cfg).digest == ad.digest


def test_an_adapter_for_another_shape_names_the_module_and_shapes(tmp_path):
    peft_adapter(tmp_path, intermediate_size=96)
    cfg = read_hf_config(tmp_path / "base")[0]
    other = cfg.__class__(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "intermediate_size": 128})
    with pytest.raises(AdapterError, match=r"layer 0 down_proj: lora_A \(4, 96\) and lora_B \(64, 4\) do not fit "
                                           r"the base model's down_proj \[64 x 128\]"):
        load_adapter(tmp_path / "adapter", "a", other)


def _edit(d: Path, config=None, drop=None, add=None):
    from safetensors.torch import load_file, save_file

    if config:
        c = json.loads((d / "adapter_config.json").read_text())
        c.update(config)
        (d / "adapter_config.json").write_text(json.dumps(c))
    if drop or add:
        w = load_file(str(d / "adapter_model.safetensors"))
        for k in drop or ():
            del w[k]
        w.update(add or {})
        save_file(w, str(d / "adapter_model.safetensors"))


@pytest.mark.parametrize("edit, message", [
    (dict(config={"use_dora": True}), "DoRA"),
    (dict(config={"lora_bias": True}), "LoRA biases"),
    (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (dict(config={"rank_pattern": {"q_proj": 8}}), "rank_pattern"),
    (dict(config={"peft_type": "IA3"}), "only LORA"),
    (dict(config={"r": 0}), "r must be a positive integer"),
    (dict(config={"r": 128}), "over --max-lora-rank 64"),
    (dict(config={"lora_alpha": "8"}), "lora_alpha must be a positive number"),
    (dict(drop=["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]), "layer 1 v_proj: lora_B is missing"),
    (dict(add={"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(64)}),
     "is not a LoRA A/B matrix"),
    (dict(add={"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.ones(4, 64),
               "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": torch.ones(64, 4)}),
     "adapts layer 7; the base model has 2 layers"),
    (dict(add={"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": torch.ones(4, 64)}),
     "q_proj is not a projection of mlp"),
    (dict(add={"base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight": torch.full((4, 64), float("nan")),
               "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight": torch.ones(64, 4)}),
     "NaN or infinity"),
])
def test_adapters_the_engine_cannot_serve_are_refused_by_name(tmp_path, edit, message):
    peft_adapter(tmp_path)
    cfg = read_hf_config(tmp_path / "base")[0]
    _edit(tmp_path / "adapter", **edit)
    with pytest.raises(AdapterError, match=message):
        load_adapter(tmp_path / "adapter", "a", cfg)


def test_missing_or_broken_files(tmp_path):
    peft_adapter(tmp_path)
    cfg = read_hf_config(tmp_path / "base")[0]
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter(tmp_path / "base", "a", cfg)
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        load_adapter(tmp_path / "adapter", "a", cfg)
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        load_adapter(tmp_path / "adapter", "a", cfg)
    (tmp_path / "adapter" / "adapter_config.json").write_text("{")
    with pytest.raises(AdapterError, match="not JSON"):
        load_adapter(tmp_path / "adapter", "a", cfg)


def test_planner_reads_qwen3_configs_whose_layers_are_all_full_attention(tmp_path):
    """transformers writes layer_types for every Qwen3 config (all
    "full_attention"): no window; a "sliding_attention" layer is a window
    layer of sliding_window tokens, and without a size it is refused."""
    tiny_hf_model("qwen3", head_dim=32).save_pretrained(tmp_path, safe_serialization=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert set(raw["layer_types"]) == {"full_attention"}
    assert read_hf_config(tmp_path)[0].num_layers == 2
    assert read_hf_config(tmp_path)[0].window is None
    raw["layer_types"][1] = "sliding_attention"
    raw["sliding_window"] = None
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="needs sliding_window >= 1"):
        read_hf_config(tmp_path)
    raw["sliding_window"] = 64
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert read_hf_config(tmp_path)[0].window.layers == (1,)
