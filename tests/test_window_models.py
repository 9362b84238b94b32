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

from tiny_models import save_with_tokenizer, tiny_hf_model
from greedy_runs import engine, hf_greedy, paused_turns, prompts, run, run_staggered
from trajserve.config import SchedulerConfig

@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    extra = {"num_hidden_layers": 3} if request.param == "mistral" else {}
    hf = tiny_hf_model(request.param, **extra)
    save_with_tokenizer(hf, d)
    return d, hf


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_greedy(model_dir[1], prompts())


@pytest.mark.parametrize("kw", [{}, {"cpu_kernels": False}], ids=["c-kernels", "torch"])
def test_greedy_tokens_match_transformers_alone_and_batched(model_dir, reference, kw):
    d, _ = model_dir
    eng = engine(d, **kw)
    try:
        w = eng.model_config.window
        assert w is not None and w.size == 8 and len(w.layers) == (3 if eng.model_config.architecture == "gemma3"
                                                                 else eng.model_config.num_layers)
        assert "sliding windows of 8 tokens" in eng.startup_summary
        batch = prompts()
        cached: list[int] = []
        assert [run(eng, [p], cached)[0] for p in batch] == reference  # alone: the third hits the shared head
        assert cached[:2] == [0, 0] and cached[2] >= 24  # the third resumed the shared head, past every window
        eng.kv.clear_cache()
        assert run(eng, batch) == reference  # together: prefill and decode rows mixed in one batch
    finally:
        eng.close()


@pytest.mark.parametrize("case", ["chunk-5", "block-16", "preempt", "small-pool", "host-tier", "speculative",
                                  "no-prefix-cache"])
def test_greedy_tokens_do_not_depend_on_how_the_engine_runs_them(model_dir, reference, case):
    d, _ = model_dir
    kw: dict = {}
    cache: dict = {}
    if case == "chunk-5":
        kw["scheduler"] = SchedulerConfig(max_num_batched_tokens=5, speculative="off")
    elif case == "block-16":
        cache = {"block_size": 16, "num_blocks": 24}
    elif case == "preempt":  # 3 x (up to 104 tokens) in 40 blocks of 4, every layer kept: someone is preempted
        cache = {"num_blocks": 40, "free_window_blocks": False}
        kw["scheduler"] = SchedulerConfig(speculative="off")
    elif case == "small-pool":  # a pool of pages too small for all three with every layer kept
        cache = {"num_blocks": 27}
        kw["scheduler"] = SchedulerConfig(speculative="off")
    elif case == "host-tier":  # evicted prefixes go to host memory and load back on the hit
        cache = {"num_blocks": 40, "host_cache_bytes": 1 << 22}
    elif case == "speculative":
        kw["scheduler"] = SchedulerConfig(speculative="ngram")
    else:
        cache = {"enable_prefix_caching": False}
    eng = engine(d, cache, **kw)
    try:
        batch = prompts()
        assert run(eng, batch) == reference
        # again, staggered: the cached heads (or their host copies) are hit while others decode
        assert run_staggered(eng, batch) == reference
        if case == "preempt":
            assert eng.scheduler.num_preemptions > 0
        if case == "small-pool":  # 27 blocks' worth of pages, window parts freed and evicted under pressure
            assert eng.kv.pool.num_pages == 27 * eng.model_config.num_layers
    finally:
        eng.close()


def test_lora_on_gemma3_is_refused_by_name(tmp_path):
    save_with_tokenizer(tiny_hf_model("gemma3"), tmp_path)
    with pytest.raises(ValueError, match="gemma3 model are not supported"):
        engine(tmp_path, enable_lora=True)


@pytest.mark.parametrize("decision", ["keep", "host", "disk", "drop"])
def test_a_session_paused_to_each_tier_resumes_to_the_same_tokens(model_dir, tmp_path, decision):
    """Two turns of a session over a window model, paused between them
    (kept, on the host or disk tier, or dropped and recomputed): the second
    turn's greedy tokens are those of the turns run without a pause."""
    want, got, residency, saved = paused_turns(model_dir[0], decision, tmp_path / "kv")
    assert residency == {"keep": "kept", "drop": "dropped"}.get(decision, "offloaded")
    assert (saved > 0) == (decision in ("host", "disk"))  # the state went down to its tier
    assert got == want


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
