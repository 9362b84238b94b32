"""Quantized execution of whole models (--quantization): the loader keeps a
GGUF's bytes, the model runs them through quant_kernels.c, and the result
stays close to the same weights run in float32; every way it cannot run
falls back to float with a message."""
import gguf
import numpy as np
import pytest
import torch

from test_loader import write_gguf
from tiny_models import tiny_hf_model
from trajserve.llm import LLM
from trajserve.model import cpu_kernels
from trajserve.model.loader import load_weights
from trajserve.model.quant import QuantizedWeight, is_matrix
from trajserve.sampling import SamplingParams

K = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(K is None, reason="no C compiler or no AVX2 here")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three uses of a KV cache:",
           "Write a haiku about the sea."]


def _prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([ids], sp, use_tqdm=False)[0]
    return torch.tensor([e[0] for e in out.prompt_logprobs[1:]])


def test_the_embedded_gguf_keeps_its_bytes_and_its_values():
    """auto: every matrix in the file's own Q4_1 / Q8_0 blocks (q and k rows
    moved as the float loader moves them); dequantized, exactly the float
    loader's tensors."""
    _, floats = load_weights(None, torch.float32, "cpu", quantization="none")
    _, kept = load_weights(None, torch.float32, "cpu", quantization="auto")
    formats = {}
    for name, t in kept.items():
        if is_matrix(name):
            assert isinstance(t, QuantizedWeight), name
            formats[t.fmt] = formats.get(t.fmt, 0) + 1
            assert torch.equal(t.dequantize(), floats[name]), name
        else:
            assert torch.equal(t, floats[name]), name
    assert formats == {"q4_1": 7 * 30, "q8_0": 1}  # 7 projections a layer; the tied embedding


@needs_kernels
def test_embedded_model_quantized_against_its_float32_path(engine_f32):
    """The same weights, inputs quantized to 8 bits per 32 values: teacher-
    forced logprobs of 112 tokens within 0.6 nats at every position and 0.04
    on average (measured 0.39 / 0.028; torch's bfloat16 forward, a path users
    accept, is 0.18 / 0.023 off the same float32 one), and greedy text equal
    for its first tokens (the 16 x 64 report: docs/benchmarks.md)."""
    q = LLM(num_blocks=256)
    assert q.engine.quantization == "auto"
    assert set(q.engine.model.weight_formats()) == {"q4_1", "q8_0"}
    assert "weights: q4_1 66.4 MB + q8_0 30.1 MB" in q.engine.startup_summary
    ids = engine_f32.tokenizer.encode(" ".join(PROMPTS) * 4)
    f = LLM.__new__(LLM)
    f.engine = engine_f32
    d = (_prompt_logprobs(q, ids) - _prompt_logprobs(f, ids)).abs()
    assert d.max() < 0.6 and d.mean() < 0.04, (d.max(), d.mean())
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in q.generate(PROMPTS, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in f.generate(PROMPTS, sp, use_tqdm=False)]
    agree = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), 16) for u, v in zip(a, b)]
    assert min(agree) >= 4 and sum(agree) >= 40, agree


@needs_kernels
@pytest.mark.parametrize("qtype,fmt", [(gguf.GGMLQuantizationType.Q4_0, "q4_0"),
                                       (gguf.GGMLQuantizationType.Q8_0, "q8_0"),
                                       (gguf.GGMLQuantizationType.Q5_0, "q8_0")])  # not run as stored: requantized
def test_tiny_llama_gguf_runs_quantized_close_to_float(tmp_path, qtype, fmt):
    """A Llama GGUF (q and k rows in llama.cpp's interleaved order) of each
    kind: kept or requantized as target_format says, the logprobs close to
    the same file dequantized."""
    torch.manual_seed(0)
    model = tiny_hf_model("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, "llama", qtype)
    ids = list(range(3, 60))
    runs = {q: LLM(model=str(path), quantization=q, num_blocks=32, enable_prefix_caching=False)
            for q in ("auto", "none")}
    formats = runs["auto"].engine.model.weight_formats()
    assert fmt in formats, formats
    d = (_prompt_logprobs(runs["auto"], ids) - _prompt_logprobs(runs["none"], ids)).abs()
    assert d.max() < 0.05, d.max()


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_a_float_checkpoint_is_quantized_at_load(tmp_path, fmt):
    torch.manual_seed(1)
    model = tiny_hf_model("qwen2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256)
    model.save_pretrained(tmp_path)
    q = LLM(model=str(tmp_path), quantization=fmt, num_blocks=32)
    f = LLM(model=str(tmp_path), quantization="auto", num_blocks=32)  # a float checkpoint runs as stored
    qf, ff = q.engine.model.weight_formats(), f.engine.model.weight_formats()
    assert set(qf) == {fmt, "q8_0"} and set(ff) == {"float32"}, (qf, ff)  # the LM head: q8_0
    assert sum(qf.values()) < sum(ff.values()) / 3
    assert q.engine.block_layout.model != f.engine.block_layout.model  # other K/V: never each other's disk blocks
    ids = list(range(5, 50))
    d = (_prompt_logprobs(q, ids) - _prompt_logprobs(f, ids)).abs()
    assert d.max() < (0.02 if fmt == "q8_0" else 0.2), d.max()


def test_where_block_formats_cannot_run_the_weights_are_float_and_it_is_said(tmp_path):
    plain = LLM(quantization="q4_0", cpu_kernels=False, dtype="float32", num_blocks=32)
    assert plain.engine.quantization == "none"
    assert "quantization none: q4_0 -> none: --no-cpu-kernels" in plain.engine.startup_summary
    assert set(plain.engine.model.weight_formats()) == {"float32"}
    bf16 = LLM(dtype="bfloat16", num_blocks=32)
    assert bf16.engine.quantization == "none" and "not bfloat16" in bf16.engine.startup_summary
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for llm in (plain, bf16):
        assert len(llm.generate(["Hello"], sp, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_a_bad_quantization_names_the_field():
    with pytest.raises(ValueError, match=r"quantization \(--quantization\) must be one of auto, none"):
        LLM(quantization="int3", num_blocks=8)


@needs_kernels
def test_weight_bytes_per_step_follow_the_format():
    from trajserve.bench.throughput import weight_bytes

    q = LLM(num_blocks=16)
    f = LLM(num_blocks=16, quantization="none")
    qb, fb = weight_bytes(q.engine.model), weight_bytes(f.engine.model)
    # Q4_1 is 20 bytes per 32 weights and Q8_0 34: ~6x fewer bytes than float32.
    assert 5.0 < fb / qb < 6.5, fb / qb
    assert np.isclose(sum(q.engine.model.weight_formats().values()), qb, rtol=0.01)
