"""Sliding-window models through the engine, on tiny random Mistral (every
layer a window) and Gemma 3 (three window layers, one global; its own RoPE
per kind, sandwich norms, GELU, soft-capped logits) written by transformers,
windows of 8 tokens under prompts of 17-40: greedy tokens over 64 as
transformers generates them, and the same tokens whatever the chunk size,
block size, batch, warm prefix cache (a hit resumes exactly), preemption,
host-tier reload, speculation or a session paused to each tier; LoRA on
Gemma 3 refused by name."""
from __future__ import annotations

import pytest
import torch

from tiny_models import save_with_tokenizer, tiny_hf_model
from trajserve.config import CacheConfig, EngineConfig, SchedulerConfig
from trajserve.engine.engine import LLMEngine
from trajserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    extra = {"num_hidden_layers": 3} if request.param == "mistral" else {}
    hf = tiny_hf_model(request.param, **extra)
    save_with_tokenizer(hf, d)
    return d, hf


def _engine(d, cache: dict | None = None, **kw) -> LLMEngine:
    c = dict(num_blocks=96, block_size=4, enable_prefix_caching=True) | (cache or {})
    return LLMEngine(EngineConfig(model=str(d), dtype="float32", cache=CacheConfig(**c), **kw))


def _prompts() -> list[list[int]]:
    torch.manual_seed(5)
    shared = torch.randint(0, 299, (24,)).tolist()  # a head the second and third share
    return [torch.randint(0, 299, (17,)).tolist(), shared + [7, 8, 9], shared + [11, 12] + list(range(20, 34))]


def _run(eng: LLMEngine, prompts: list[list[int]], cached: list[int] | None = None) -> list[list[int]]:
    """Greedy tokens of each prompt, run together; `cached` gets each one's prefix-cache hit."""
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    if cached is not None:
        cached.extend(done[r].num_cached_tokens for r in rids)
    return [list(done[r].outputs[0].token_ids) for r in rids]


@pytest.fixture(scope="module")
def reference(model_dir):
    _, hf = model_dir
    out = []
    for p in _prompts():
        with torch.inference_mode():
            g = hf.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
        out.append(g[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("kw", [{}, {"cpu_kernels": False}], ids=["c-kernels", "torch"])
def test_greedy_tokens_match_transformers_alone_and_batched(model_dir, reference, kw):
    d, _ = model_dir
    eng = _engine(d, **kw)
    try:
        w = eng.model_config.window
        assert w is not None and w.size == 8 and len(w.layers) == (3 if eng.model_config.architecture == "gemma3"
                                                                 else eng.model_config.num_layers)
        assert "sliding windows of 8 tokens" in eng.startup_summary
        prompts = _prompts()
        cached: list[int] = []
        assert [_run(eng, [p], cached)[0] for p in prompts] == reference  # alone: the third hits the shared head
        assert cached[:2] == [0, 0] and cached[2] >= 24  # the third resumed the shared head, past every window
        eng.kv.clear_cache()
        assert _run(eng, prompts) == reference  # together: prefill and decode rows mixed in one batch
    finally:
        eng.close()


@pytest.mark.parametrize("case", ["chunk-5", "block-16", "preempt", "host-tier", "speculative", "no-prefix-cache"])
def test_greedy_tokens_do_not_depend_on_how_the_engine_runs_them(model_dir, reference, case):
    d, _ = model_dir
    kw: dict = {}
    cache: dict = {}
    if case == "chunk-5":
        kw["scheduler"] = SchedulerConfig(max_num_batched_tokens=5, speculative="off")
    elif case == "block-16":
        cache = {"block_size": 16, "num_blocks": 24}
    elif case == "preempt":  # 3 x (up to 104 tokens) in 40 blocks of 4: someone is preempted and recomputed
        cache = {"num_blocks": 40}
        kw["scheduler"] = SchedulerConfig(speculative="off")
    elif case == "host-tier":  # evicted prefixes go to host memory and load back on the hit
        cache = {"num_blocks": 40, "host_cache_bytes": 1 << 22}
    elif case == "speculative":
        kw["scheduler"] = SchedulerConfig(speculative="ngram")
    else:
        cache = {"enable_prefix_caching": False}
    eng = _engine(d, cache, **kw)
    try:
        prompts = _prompts()
        assert _run(eng, prompts) == reference
        # again, staggered: the cached heads (or their host copies) are hit while others decode
        rids = [eng.add_request(prompts[0], GREEDY)]
        eng.step()
        rids += [eng.add_request(p, GREEDY) for p in prompts[1:]]
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
        assert [done[r] for r in rids] == reference
        if case == "preempt":
            assert eng.scheduler.num_preemptions > 0
    finally:
        eng.close()


def test_lora_on_gemma3_is_refused_by_name(tmp_path):
    save_with_tokenizer(tiny_hf_model("gemma3"), tmp_path)
    with pytest.raises(ValueError, match="gemma3 model are not supported"):
        _engine(tmp_path, enable_lora=True)


@pytest.mark.parametrize("decision", ["keep", "host", "disk", "drop"])
def test_a_session_paused_to_each_tier_resumes_to_the_same_tokens(model_dir, tmp_path, decision):
    """Two turns of a session over a window model, paused between them
    (kept, on the host or disk tier, or dropped and recomputed): the second
    turn's greedy tokens are those of the turns run without a pause."""
    from trajserve.sessions.config import SessionConfig
    from trajserve.sessions.manager import SessionManager

    d, _ = model_dir
    eng = _engine(d)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt, observation = _prompts()[2], list(range(40, 61))
    mgr = SessionManager(eng, SessionConfig(disk_dir=str(tmp_path / "kv")))
    try:
        s = mgr.open(prompt)
        s.generate(params)
        s.history.extend(observation)
        want = s.generate(params).outputs[0].token_ids
        s.close()
        eng.kv.clear_cache()
        s = mgr.open(prompt)
        s.generate(params)
        s.pause(decision=decision)
        mgr.flush()
        assert s.residency.value == {"keep": "kept", "drop": "dropped"}.get(decision, "offloaded")
        assert (s.saved_blocks > 0) == (decision in ("host", "disk"))  # the state went down to its tier
        s.resume(observation)
        assert s.generate(params).outputs[0].token_ids == want
        s.close()
    finally:
        mgr.shutdown()
        eng.close()


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gemma3"}, "Gemma 3's image-text checkpoint; supported: its text model"),
    ({"layer_types": ["chunked_attention"] * 4}, r"unsupported layer_types \['chunked_attention'\]"),
    ({"attn_logit_softcapping": 50.0}, "unsupported attn_logit_softcapping=50.0"),
    ({"sliding_window": None}, "needs sliding_window >= 1"),
])
def test_what_the_engine_does_not_run_is_refused_by_name(tmp_path, change, message):
    import json

    from trajserve.model.hf_reader import _hf_config

    tiny_hf_model("gemma3").config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text()) | change
    with pytest.raises(ValueError, match=message):
        _hf_config(raw)


def test_an_older_gemma3_config_names_its_windows_by_pattern():
    from trajserve.config import WindowSpec

    raw = {"model_type": "gemma3_text", "sliding_window": 512, "rope_local_base_freq": 10000.0}
    assert WindowSpec.from_hf(raw, 12) == WindowSpec(512, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10), 10000.0)
    assert WindowSpec.from_hf(raw | {"sliding_window_pattern": 3}, 6).layers == (0, 1, 3, 4)
    assert WindowSpec.from_hf({"model_type": "mistral", "sliding_window": 4096}, 2).layers == (0, 1)
    assert WindowSpec.from_hf({"model_type": "mistral", "sliding_window": None}, 2) is None
