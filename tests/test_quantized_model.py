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
from trajserve.engine.model_runner import ModelRunner, allocate_kv_pool
from trajserve.request import Request
from trajserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.llm import LLM
from trajserve.model import cpu_kernels
from trajserve.model.llama import LlamaModel
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


def _tiny_logprobs(path, quantization: str) -> tuple[torch.Tensor, LlamaModel]:
    """Every row's next-token logprobs of a fixed 60-token prompt (a chunk,
    a chunk over the cached prefix, a decode step), tiny models having no
    tokenizer for LLM."""
    cfg, weights = load_weights(path, torch.float32, "cpu", quantization=quantization)
    model = LlamaModel(cfg, weights, 128, torch.float32, "cpu")
    kv = KVCacheManager(32, 4, 0.0)
    runner = ModelRunner(model, allocate_kv_pool(cfg.num_layers, 32, 4, cfg.num_kv_heads, cfg.head_dim,
                                                 torch.float32, "cpu"), 4)
    ids = [(7 * i + 3) % cfg.vocab_size for i in range(60)]
    req = Request("a", ids, SamplingParams(), 10**6)
    assert kv.allocate_slots("a", len(ids))
    rows = []
    for start, end in ((0, 13), (13, 59), (59, 60)):
        batch = runner.prepare(SchedulerOutput([ScheduledChunk(req, start, end - start, kv.table("a").block_ids)]))
        batch.sample_rows = torch.arange(end - start)
        batch.sample_meta = None
        rows.append(runner.run(batch))
    return torch.cat(rows).log_softmax(-1), model


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
def test_embedded_model_quantized_against_its_float32_path(engine_float_weights):
    """The same weights, inputs quantized to 8 bits per 32 values: teacher-
    forced logprobs of 112 tokens within 0.6 nats at every position and 0.05
    on average (measured 0.38 / 0.036; torch's bfloat16 forward, a path users
    accept, is 0.18 / 0.023 off the same float32 one), and greedy texts that
    agree for half their tokens before they part (the 16 x 64 report:
    docs/benchmarks.md)."""
    q = LLM(num_blocks=256)
    assert q.engine.quantization == "auto"
    assert set(q.engine.model.weight_formats()) == {"q4_1", "q8_0"}
    assert "quantized at load" not in q.engine.startup_summary  # the file's own types run
    assert "weights: q4_1 66.4 MB + q8_0 30.1 MB" in q.engine.startup_summary
    ids = engine_float_weights.tokenizer.encode(" ".join(PROMPTS) * 4)
    f = LLM.__new__(LLM)
    f.engine = engine_float_weights
    d = (_prompt_logprobs(q, ids) - _prompt_logprobs(f, ids)).abs()
    assert d.max() < 0.6 and d.mean() < 0.05, (d.max(), d.mean())
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in q.generate(PROMPTS, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in f.generate(PROMPTS, sp, use_tqdm=False)]
    agree = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), 16) for u, v in zip(a, b)]
    assert sum(agree) >= 32, agree  # of 64; measured 37 (5, 16, 16, 0: one first token is a near tie)


@needs_kernels
@pytest.mark.parametrize("qtype,fmt", [(gguf.GGMLQuantizationType.Q4_0, "q4_0"),
                                       (gguf.GGMLQuantizationType.Q8_0, "q8_0"),
                                       (gguf.GGMLQuantizationType.Q4_K, "q4_k"),
                                       (gguf.GGMLQuantizationType.Q5_K, "q5_k"),
                                       (gguf.GGMLQuantizationType.Q6_K, "q6_k"),
                                       (gguf.GGMLQuantizationType.Q5_0, "q8_0")])  # not run as stored: requantized
def test_tiny_llama_gguf_runs_quantized_close_to_float(tmp_path, qtype, fmt):
    """A Llama GGUF (q and k rows in llama.cpp's interleaved order) of each
    kind: kept or requantized as target_format says, the logprobs close to
    the same file dequantized (K-quants need widths of 256)."""
    torch.manual_seed(0)
    wide = qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K)
    model = tiny_hf_model("llama", hidden_size=256 if wide else 64, intermediate_size=512 if wide else 96,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, "llama", qtype)
    q, qmodel = _tiny_logprobs(path, "auto")
    f, fmodel = _tiny_logprobs(path, "none")
    assert set(qmodel.weight_formats()) == {fmt}
    said: dict[str, int] = {}
    load_weights(path, torch.float32, "cpu", quantization="auto", requantized=said)
    # 7 matrices a layer, the embedding and the LM head; none when the file's own type runs
    assert said == ({} if qtype.name.lower() == fmt else {f"{qtype.name} -> q8_0": 7 * 2 + 2})
    assert set(fmodel.weight_formats()) == {"float32"}
    d = (q - f).abs().max()
    assert d < (0.02 if fmt == "q8_0" and qtype != gguf.GGMLQuantizationType.Q5_0 else 0.05), d


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_a_float_checkpoint_is_quantized_at_load(tmp_path, fmt):
    torch.manual_seed(1)
    model = tiny_hf_model("qwen2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256)
    model.save_pretrained(tmp_path)
    q, qmodel = _tiny_logprobs(tmp_path, fmt)
    f, fmodel = _tiny_logprobs(tmp_path, "auto")  # a float checkpoint runs as stored
    qf, ff = qmodel.weight_formats(), fmodel.weight_formats()
    assert set(qf) == ({"q8_0"} if fmt == "q8_0" else {fmt, "q8_0"}) and set(ff) == {"float32"}, (qf, ff)
    assert sum(qf.values()) < sum(ff.values()) / 3
    d = (q - f).abs().max()
    assert d < (0.02 if fmt == "q8_0" else 0.2), d


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


def test_kernels_that_do_not_load_leave_a_float_engine_that_serves(monkeypatch, caplog):
    """No compiler, a failed build or a failed known-answer check: load()
    gives None, and an explicit format is refused with a warning, not an error."""
    import logging

    monkeypatch.setattr(cpu_kernels, "load", lambda isa=None: None)
    with caplog.at_level(logging.WARNING):
        llm = LLM(quantization="q4_1", dtype="float32", num_blocks=32)
    assert llm.engine.model.kernels is None and llm.engine.quantization == "none"
    assert "the C kernels did not load" in llm.engine.startup_summary
    assert "--quantization q4_1 cannot run here" in caplog.text
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    assert len(llm.generate(["Hi"], sp, use_tqdm=False)[0].outputs[0].token_ids) == 3


@needs_kernels
def test_fused_matrices_of_two_formats_run_each_as_stored(tmp_path):
    """q|k in q4_0 and v in q8_0 (as a mixed GGUF holds them, Q4_K_M's v in
    Q6_K too): one product per part into one output, each in its format,
    the same values as the three products run alone; a gate|up of two
    formats runs together in q8_0."""
    torch.manual_seed(2)
    model = tiny_hf_model("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256)
    model.save_pretrained(tmp_path)
    cfg, weights = load_weights(tmp_path, torch.float32, "cpu", quantization="q4_0")
    p = "model.layers.0."
    for name in (p + "self_attn.v_proj.weight", p + "mlp.up_proj.weight"):  # as a mixed GGUF would hold them
        weights[name] = QuantizedWeight.quantize(weights[name].dequantize(), "q8_0")
    parts = {n: weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"}
    m = LlamaModel(cfg, weights, 64, torch.float32, "cpu")
    qkv = m.layers[0].qkv
    assert [x.panels.fmt for x in qkv.parts] == ["q4_0", "q4_0", "q8_0"] and m.layers[1].qkv.panels.fmt == "q4_0"
    assert m.layers[0].gate_up.gate.fmt == m.layers[0].gate_up.up.fmt == "q8_0"
    assert "float32" not in m.weight_formats()
    x = torch.randn(5, 64)
    alone = torch.cat([K.qlinear(x, parts[n].pack()) for n in "qkv"], dim=1)
    assert torch.equal(qkv(x), alone)
    res = torch.randn(5, alone.shape[1])
    assert torch.equal(qkv(x, res.clone()), res + alone)


def test_bench_paths_are_the_ones_this_cpu_runs():
    from trajserve.bench.paths import machine_paths
    from trajserve.engine.dtype import cpu_has_native_bf16

    names = [p["name"] for p in machine_paths()]
    isas = cpu_kernels.supported_isas() if K is not None else []
    assert names[0] == "auto" and names[-1] == "float32 torch"
    assert [n for n in names if n.startswith("quantized")] == [f"quantized ({isa}), {kv} KV" for isa in isas
                                                                for kv in ("bfloat16", "float32")]
    assert ("bfloat16 torch" in names) == cpu_has_native_bf16()


def test_bench_prefill_after_a_cached_prefix_is_served_from_the_cache(engine_f32):
    """bench throughput --cached-prefix: the timed request hits the prefix
    the untimed one left (else it raises instead of reporting a cold prompt)."""
    import random

    from trajserve.bench.throughput import prefill_run

    r = prefill_run(engine_f32, 24, 1, random.Random(3), cached_prefix=64)
    assert r["cached_prefix"] == 64 and r["tokens"] == 24 and r["tokens_per_s"] > 0
    engine_f32.kv.clear_cache()


def test_bench_paths_hold_auto_against_the_other_configurations():
    from trajserve.bench.paths import auto_versus

    def row(path, config, b1, prefill):
        return {"path": path, "config": config, "tokens_per_s": {"1": b1}, "prefill_tokens_per_s": prefill}

    ok = [row("auto", ["float32", "bfloat16", "auto", "C (avx512)"], 180.0, 3000.0),
          row("twin", ["float32", "bfloat16", "auto", "C (avx512)"], 220.0, 3100.0),  # auto's own path, run again
          row("f32 KV", ["float32", "float32", "auto", "C (avx512)"], 200.0, 1900.0),
          row("torch", ["bfloat16", "bfloat16", "none", "torch"], 30.0, 2950.0)]
    twin, versus = auto_versus(ok, ["b=1", "prefill"])
    assert twin == "twin"
    assert versus["b=1"]["fastest"] == "f32 KV" and versus["b=1"]["auto_over_fastest"] == 0.9
    assert versus["prefill"]["fastest"] == "torch" and abs(versus["prefill"]["auto_over_fastest"] - 3000 / 2950) < 1e-9


@pytest.mark.slow
def test_quant_agreement_bench_reports_every_prompt(capsys):
    import argparse
    import json

    from trajserve.bench.quant_agreement import PROMPTS, TOKENS, run

    assert run(argparse.Namespace(model=None, num_blocks=None, quantization="auto", kv_cache_dtype="auto",
                                  bf16=False, json=True)) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rows"]) == len(PROMPTS) and out["summary"]["tokens"] == TOKENS
    assert 0 <= out["summary"]["mean_identical_prefix"] <= 1 and out["summary"]["mean_abs_dlogprob_forced"] < 0.1
