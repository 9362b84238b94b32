"""Sliding-window models through the engine, on tiny random Mistral (every
layer a window) and Gemma 3 (three window layers, one global; its own RoPE
per kind, sandwich norms, GELU, soft-capped logits) written by transformers,
windows of 8 tokens under prompts of 17-40: greedy tokens over 64 as
transformers generates them, and the same tokens whatever the chunk size,
block size, batch, warm prefix cache (a hit resumes exactly), preemption,
host-tier reload, speculation or a session paused to each tier; state
that went down to the host or disk tier (a paused, prefetched or forked
session, an LRU spill) resumes at its end, its last window's window parts
with it, and is priced at what it copies; one sequence grows past the
pool's whole blocks; LoRA on Gemma 3 refused by name."""
from __future__ import annotations

import pytest

from tiny_models import save_with_tokenizer, tiny_hf_model
from greedy_runs import PAUSED_OBSERVATION, engine, hf_greedy, paused_turns, prompts, run, run_staggered
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


def test_a_sequence_grows_past_the_pools_whole_blocks(model_dir):
    """A pool of 24 whole blocks (96 tokens with every layer) holds one
    sequence of far more: every block keeps its global pages, window pages
    only the window and the chunk being written need. Two requests of 190
    and 160 tokens run alone and together on it (one preempted for the
    other) with the greedy tokens of a pool that holds both whole."""
    import torch

    from trajserve.sampling import SamplingParams

    d, _ = model_dir
    torch.manual_seed(1)
    batch = [torch.randint(0, 299, (150,)).tolist(), torch.randint(0, 299, (120,)).tolist()]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    sched = SchedulerConfig(max_num_batched_tokens=16, speculative="off")
    big = engine(d, {"num_blocks": 128}, scheduler=sched)
    try:
        want = run(big, batch, params=params)
    finally:
        big.close()
    eng = engine(d, {"num_blocks": 24}, scheduler=sched)
    try:
        assert eng.kv.token_capacity >= 190 > 24 * 4
        assert [run(eng, [p], params=params)[0] for p in batch] == want
        assert run(eng, batch, params=params) == want
        assert eng.scheduler.num_preemptions > 0
        eng.kv.pool.check()
    finally:
        eng.close()


def test_a_conversation_grows_past_the_pools_whole_blocks(model_dir):
    """Ten turns of one conversation to 220 tokens on the 24-block pool: the
    tree keeps each turn's prompt and path ends' windows, more pages than
    the pool has once the conversation is long; the oldest give their
    window pages back (every turn still resumes at the last one's end), so
    each turn hits what it hits on a pool that holds everything, with the
    same tokens (without that the pool stalls)."""
    import torch

    from trajserve.sampling import SamplingParams

    d, _ = model_dir
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    sched = SchedulerConfig(max_num_batched_tokens=16, speculative="off")

    def turns(num_blocks: int) -> tuple[list[list[int]], list[int]]:
        eng = engine(d, {"num_blocks": num_blocks}, scheduler=sched)
        torch.manual_seed(2)
        history, outs, cached = torch.randint(0, 299, (30,)).tolist(), [], []
        try:
            for _ in range(10):
                outs.append(run(eng, [history], cached, params=params)[0])
                history = history + outs[-1] + torch.randint(0, 299, (11,)).tolist()
            eng.kv.pool.check()
        finally:
            eng.close()
        return outs, cached

    big, small = turns(128), turns(24)
    assert small == big and big[1][-1] == 188  # the last turn resumed the whole conversation before it


def test_lora_on_gemma3_is_refused_by_name(tmp_path):
    save_with_tokenizer(tiny_hf_model("gemma3"), tmp_path)
    with pytest.raises(ValueError, match="gemma3 model are not supported"):
        engine(tmp_path, enable_lora=True)


@pytest.mark.parametrize("decision", ["keep", "host", "disk", "prefetch", "drop"])
def test_a_session_paused_to_each_tier_resumes_to_the_same_tokens(model_dir, tmp_path, decision):
    """Two turns of a session over a window model, paused between them
    (kept, on the host or disk tier, loaded back from disk before the
    resume, or dropped and recomputed): the second turn's greedy tokens are
    those of the turns run without a pause, and state that was kept or
    saved is resumed whole: the last window's window parts went down to the
    tier and came back with its blocks."""
    want, got, residency, saved, cached, prompt_len = paused_turns(model_dir[0], decision, tmp_path / "kv")
    assert residency == {"keep": "kept", "drop": "dropped"}.get(decision, "offloaded")
    assert (saved > 0) == (decision in ("host", "disk", "prefetch"))  # the state went down to its tier
    assert got == want
    history = prompt_len - PAUSED_OBSERVATION  # the first turn's prompt and reply
    assert cached == (0 if decision == "drop" else (history - 1) // 4 * 4)  # every full block with KV


def test_a_pause_is_priced_at_the_bytes_its_save_copies(model_dir, tmp_path):
    """A window model's save copies every block's global layers and the last
    window's window layers, not every layer of every block: the keep
    policy prices (and the tier reserves) that, in whole blocks' worth, and
    the bytes that land on the host tier are within one block of it."""
    from trajserve.sampling import SamplingParams
    from trajserve.sessions.config import SessionConfig
    from trajserve.sessions.manager import SessionManager

    eng = engine(model_dir[0])
    mgr = SessionManager(eng, SessionConfig(disk_dir=str(tmp_path / "kv")))
    priced = []
    decide = mgr.machine.policy.decide
    mgr.machine.policy.decide = lambda state: priced.append(state.kv_bytes) or decide(state)
    try:
        s = mgr.open(prompts()[2] + list(range(100, 140)))
        s.generate(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        s.pause(decision="host")
        mgr.flush()
        held, every_layer = mgr.offload.tiers.held_bytes()["host"], s.saved_blocks * eng.block_bytes
        assert priced[0] - eng.block_bytes < held <= priced[0] < every_layer / 2
    finally:
        mgr.shutdown()
        eng.close()


def test_forks_of_a_session_paused_to_the_host_hit_its_whole_history(model_dir, tmp_path):
    """Forking a session paused on the host tier copies its saved blocks
    back as cold cache, the last window's window parts with them: the
    first child's turn hits the whole history, with the unpaused tokens."""
    from trajserve.sampling import SamplingParams
    from trajserve.sessions.config import SessionConfig
    from trajserve.sessions.manager import SessionManager

    eng = engine(model_dir[0])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    observation = list(range(40, 40 + PAUSED_OBSERVATION))
    mgr = SessionManager(eng, SessionConfig(disk_dir=str(tmp_path / "kv")))
    try:
        s = mgr.open(prompts()[2])
        s.generate(params)
        s.history.extend(observation)
        want = list(s.generate(params).outputs[0].token_ids)
        s.close()
        eng.kv.clear_cache()
        s = mgr.open(prompts()[2])
        s.generate(params)
        history = len(s.history)
        s.pause(decision="host")
        mgr.flush()
        child = s.fork(1)[0]
        child.history.extend(observation)
        out = child.generate(params)
        assert list(out.outputs[0].token_ids) == want
        assert out.num_cached_tokens == (history - 1) // 4 * 4
    finally:
        mgr.shutdown()
        eng.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_prefix_spilled_to_a_lower_tier_comes_back_with_its_window(tmp_path, tier):
    """A Gemma 3 prefix pushed out of a small pool by another request goes
    down to the host (or disk) tier, the window part of its last window
    with it; the next request over it loads it back and resumes at its end
    (no window recomputed), with the tokens transformers generates."""
    import torch

    from trajserve.sampling import SamplingParams

    hf = tiny_hf_model("gemma3")
    save_with_tokenizer(hf, tmp_path)
    lower = {"host_cache_bytes": 1 << 22} if tier == "host" else {"disk_cache_bytes": 1 << 22}
    eng = engine(tmp_path, {"num_blocks": 26, **lower})
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    try:
        first = prompts()[2] + list(range(100, 140))
        reply = run(eng, [first], params=params)[0]
        run(eng, [prompts()[0] + list(range(200, 260))], params=params)  # needs the room: the first path spills
        assert (eng.lower.num_host_blocks if tier == "host" else eng.lower.num_disk_blocks) > 0
        again = first + reply + [5, 6, 7]
        cached: list[int] = []
        got = run(eng, [again], cached, params=params)[0]
        with torch.inference_mode():
            want = hf.generate(torch.tensor([again]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert got == want[0, len(again):].tolist()
        assert eng.kv.stats().promoted_blocks > 0 and eng.kv.num_window_recomputed_tokens == 0
        assert cached[0] == (len(first) + len(reply) - 1) // 4 * 4  # the whole first path, to its last full block
    finally:
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
