"""The offline API (LLM.generate / chat / stream, LLMEngine requests) and bad
input, float32 on the embedded SmolLM2-135M.

Bad input must fail with a ValueError that names the field and its limit,
before anything is allocated, and must leave requests already in flight
untouched."""
from __future__ import annotations

import dataclasses
import math

import pytest

from engine_util import gone_when_dropped, run_requests
from trajserve.config import CacheConfig, EngineConfig, SchedulerConfig
from trajserve.engine.engine import LLMEngine
from trajserve.llm import LLM
from trajserve.sampling import SamplingParams

STORY = "The history of the printing press begins"
CODE = "def add(a, b):\n    return"
QUESTION = "Water boils at a temperature of"


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", num_blocks=96, block_size=16, seed=0)


@pytest.fixture(scope="module")
def story_ref(llm):
    """STORY alone, greedy, 24 tokens (ignore EOS)."""
    out = llm.generate(STORY, greedy(24), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 24
    return out.outputs[0]


def clear_prefix_cache(engine: LLMEngine) -> None:
    clear = getattr(engine.kv, "clear_cache", None)  # engines with a radix prefix cache
    if clear is not None:
        clear()


def available(engine: LLMEngine) -> int:
    """Blocks a new request can get: free, or cached but held by no request."""
    return engine.kv.pool.num_free + getattr(engine.kv, "num_reclaimable", 0)


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert not engine.groups and not engine.kv.tables
    assert available(engine) == engine.kv.num_blocks
    clear_prefix_cache(engine)
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    engine.kv.pool.check()


@pytest.fixture(autouse=True)
def _cold_cache(request):
    """Each test starts with an empty prefix cache (U_KV = 0)."""
    if "llm" in request.fixturenames:
        clear_prefix_cache(request.getfixturevalue("llm").engine)


def drain(engine: LLMEngine) -> dict[str, object]:
    finished = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError("engine did not finish")


# ------------------------------------------------------------------ generate
def test_generate_returns_outputs_in_input_order(llm, story_ref):
    prompts = [STORY, CODE, QUESTION]
    # The first prompt runs longest, so requests finish out of input order.
    params = [greedy(24), greedy(3), greedy(9)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tok = llm.tokenizer
    assert [o.prompt for o in outs] == prompts
    for o, p, sp in zip(outs, prompts, params):
        assert o.finished
        assert o.prompt_token_ids == tok.encode(p)
        (c,) = o.outputs
        assert len(c.token_ids) == sp.max_tokens
        assert c.finish_reason == "length" and c.stop_reason is None
        assert c.text == tok.decode(c.token_ids)
    # Batched with others, STORY still gives the tokens it gives alone.
    assert outs[0].outputs[0].token_ids == story_ref.token_ids
    assert_idle(llm.engine)


def test_finish_on_eos(llm):
    msgs = [{"role": "user", "content": "Say only: yes"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=100, temperature=0))[0]
    c = out.outputs[0]
    eos = llm.tokenizer.eos_token_ids
    assert c.finish_reason == "stop"
    assert c.stop_reason in eos and c.token_ids[-1] == c.stop_reason
    assert len(c.token_ids) < 100 and not any(t in eos for t in c.token_ids[:-1])
    assert "yes" in c.text.lower()
    assert "<|im_end|>" not in c.text  # the end-of-turn token is not text
    # ignore_eos runs past it to max_tokens.
    c2 = llm.chat(msgs, SamplingParams(max_tokens=len(c.token_ids) + 3, temperature=0, ignore_eos=True))[0].outputs[0]
    assert c2.finish_reason == "length" and len(c2.token_ids) == len(c.token_ids) + 3
    assert c2.token_ids[:len(c.token_ids)] == c.token_ids
    assert_idle(llm.engine)


def test_stop_token_ids(llm, story_ref):
    ref = story_ref.token_ids
    k = 6
    first = ref.index(ref[k])  # the stop token may occur earlier
    c = llm.generate(STORY, greedy(24, stop_token_ids=[ref[k]]), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == ref[: first + 1]
    assert c.finish_reason == "stop" and c.stop_reason == ref[k]
    assert_idle(llm.engine)


def _stop_across_tokens(llm, ref_tokens: list[int], k: int) -> tuple[str, int]:
    """A stop string whose first half ends token k-1 and second half starts
    token k; returns it and the number of tokens needed to complete it."""
    tok = llm.tokenizer
    text = tok.decode(ref_tokens)
    cut = len(tok.decode(ref_tokens[:k]))
    stop = text[cut - 2: cut + 2]
    assert stop.strip() and text.find(stop) == cut - 2, stop
    need = next(n for n in range(1, len(ref_tokens) + 1) if stop in tok.decode(ref_tokens[:n]))
    return stop, need


@pytest.mark.parametrize("include", [False, True])
def test_stop_string(llm, story_ref, include):
    stop, need = _stop_across_tokens(llm, story_ref.token_ids, 7)
    pos = story_ref.text.find(stop)
    sp = greedy(24, stop=[stop, "no such stop string"], include_stop_str_in_output=include)
    c = llm.generate(STORY, sp, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == story_ref.text[: pos + len(stop) if include else pos]
    # Generation stopped at the token that completed the stop string.
    assert c.token_ids == story_ref.token_ids[:need]
    assert_idle(llm.engine)


# ------------------------------------------------------------------ sampling
def _tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def test_n2_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(n=2, temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    a = llm.generate(STORY, sp, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in a.outputs)
    # Two samples, not one sample twice.
    assert a.outputs[0].token_ids != a.outputs[1].token_ids
    # Same seed, another run, now batched with unrelated (seeded and unseeded) requests.
    others = [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=1234, max_tokens=20, ignore_eos=True), greedy(7)]
    outs = llm.generate([CODE, STORY, STORY, QUESTION], [others[0], others[1], sp, others[2]],
                        use_tqdm=False)
    assert _tokens(outs[2]) == _tokens(a)
    # Sample 0 of n=2 is the sample n=1 draws with the same seed.
    one = llm.generate(STORY, dataclasses.replace(sp, n=1), use_tqdm=False)[0]
    assert _tokens(one) == [a.outputs[0].token_ids]
    # A different seed gives other tokens.
    sp2 = SamplingParams(n=2, temperature=1.0, top_p=0.95, seed=4321, max_tokens=12, ignore_eos=True)
    assert _tokens(llm.generate(STORY, sp2, use_tqdm=False)[0]) != _tokens(a)
    assert_idle(llm.engine)


def test_greedy_n2_gives_identical_completions(llm, story_ref):
    out = llm.generate(STORY, greedy(24, n=2), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == story_ref.token_ids
    assert out.outputs[0].text == out.outputs[1].text == story_ref.text


def test_logprobs(llm, story_ref):
    c = llm.generate(STORY, greedy(8, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == story_ref.token_ids[:8]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    for tok, (lp, alts) in zip(c.token_ids, c.logprobs):
        assert lp <= 0.0
        assert len(alts) == 3 and all(v <= 0.0 for v in alts.values())
        assert sum(math.exp(v) for v in alts.values()) <= 1.0 + 1e-5
        # Greedy: the chosen token is the most likely one.
        assert tok in alts
        assert lp == pytest.approx(max(alts.values()), abs=1e-6)
        assert alts[tok] == pytest.approx(lp, abs=1e-6)
    # Sampled tokens: logprob of the chosen token, even when it is not in the top 3.
    s = llm.generate(STORY, SamplingParams(temperature=1.5, seed=7, max_tokens=8, ignore_eos=True, logprobs=3),
                     use_tqdm=False)[0].outputs[0]
    for tok, (lp, alts) in zip(s.token_ids, s.logprobs):
        assert lp <= 0.0 and len(alts) == 3
        assert lp <= max(alts.values()) + 1e-6
        if tok in alts:
            assert alts[tok] == pytest.approx(lp, abs=1e-6)


# ------------------------------------------------------------------ streaming
def test_stream_deltas_concatenate_to_final_text(llm, story_ref):
    outs = list(llm.stream(STORY, greedy(24)))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text == story_ref.text
    assert sum((o.outputs[0].delta_token_ids for o in outs), []) == story_ref.token_ids
    assert_idle(llm.engine)


def test_stream_with_stop_string_across_tokens(llm, story_ref):
    """Text already streamed cannot be taken back: a stop string that begins in
    one token and ends in the next must not leave its first half in the stream."""
    stop, _ = _stop_across_tokens(llm, story_ref.token_ids, 7)
    outs = list(llm.stream(STORY, greedy(24, stop=[stop])))
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop"
    assert final.text == story_ref.text[: story_ref.text.find(stop)]
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text


def test_breaking_out_of_a_stream_frees_its_blocks(llm):
    eng = llm.engine
    other_sp = greedy(16)
    other_ref = llm.generate(CODE, other_sp, use_tqdm=False)[0].outputs[0].token_ids
    other = eng.add_request(CODE, other_sp)
    n = 0
    for out in llm.stream(STORY, greedy(24)):
        n += 1
        if n == 3:
            rid = out.request_id
            assert rid in eng.kv.tables
            break
    # The generator was closed: its request is gone, its blocks are back.
    assert rid not in eng.groups and rid not in eng.kv.tables
    assert [r.request_id for r in eng.scheduler.running] == [other]
    assert eng.kv.num_blocks - available(eng) == len(eng.kv.table(other).block_ids)
    finished = drain(eng)
    assert finished[other].outputs[0].token_ids == other_ref
    assert_idle(eng)


# ------------------------------------------------------------------ chat
def test_chat_applies_template(llm):
    tok = llm.tokenizer
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    out = llm.chat(msgs, greedy(2))[0]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert "You are terse." in rendered and rendered.rstrip().endswith("assistant")
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids == tok.encode_chat(msgs)
    assert len(out.outputs[0].token_ids) == 2
    # A batch of conversations keeps its order.
    outs = llm.chat([msgs, [{"role": "user", "content": "Bye"}]], greedy(1))
    assert outs[0].prompt_token_ids == out.prompt_token_ids
    assert outs[1].prompt_token_ids == tok.encode_chat([{"role": "user", "content": "Bye"}])


# ------------------------------------------------------------------ engine requests, metrics
def test_abort_mid_decode_frees_blocks_and_metrics_track_the_pool(llm, story_ref):
    eng = llm.engine
    assert eng.metrics()["U_KV"] == 0.0
    keep = eng.add_request(STORY, greedy(24))
    drop = eng.add_request(QUESTION * 8, greedy(24))
    waiting = eng.add_request(CODE, greedy(4))
    eng.scheduler.reconfigure(max_num_seqs=2)  # `waiting` stays queued
    try:
        for _ in range(4):
            eng.step()
        m = eng.metrics()
        assert m["running"] == 2 and m["waiting"] == 1
        assert 0.0 < m["U_KV"] <= 1.0
        assert m["U_KV"] == pytest.approx(eng.kv.pool.num_used / eng.kv.num_blocks)
        assert m["free_blocks"] == eng.kv.pool.num_free == m["num_blocks"] - eng.kv.pool.num_used
        used_by_drop = len(eng.kv.table(drop).block_ids)
        assert used_by_drop > 1
        avail_before = available(eng)
        out = eng.abort_request(drop)  # its final output, for the counters
        assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) >= 2
        assert out.num_cached_tokens >= 0 and out.metrics.finished_time is not None
        assert eng.abort_request(drop) is None  # gone already
        assert eng.abort_request(waiting).outputs[0].token_ids == []  # never admitted
        assert eng.abort_request("no-such-request") is None  # no-op
        assert available(eng) == avail_before + used_by_drop
        assert drop not in eng.kv.tables and drop not in eng.groups
        assert [r.request_id for r in eng.scheduler.running] == [keep] and not eng.scheduler.waiting
        assert eng.kv.num_blocks - available(eng) == len(eng.kv.table(keep).block_ids)
        assert eng.metrics()["U_KV"] == pytest.approx(eng.kv.pool.num_used / eng.kv.num_blocks)
        finished = drain(eng)
    finally:
        eng.scheduler.reconfigure(max_num_seqs=64)
    assert set(finished) == {keep}
    assert finished[keep].outputs[0].token_ids == story_ref.token_ids
    assert_idle(eng)
    assert eng.metrics()["U_KV"] == 0.0


def test_ttft_and_inter_token_times(llm):
    out = llm.generate(CODE, greedy(6), use_tqdm=False)[0]
    m = out.metrics
    assert m.ttft is not None and m.ttft > 0
    assert m.first_token_time == pytest.approx(m.arrival_time + m.ttft)
    assert len(m.inter_token_times) == len(out.outputs[0].token_ids) - 1 == 5
    assert all(t > 0 for t in m.inter_token_times)
    assert m.finished_time >= m.first_token_time + sum(m.inter_token_times) - 1e-6
    assert m.num_preemptions == 0


def test_duplicate_request_id(llm):
    eng = llm.engine
    eng.add_request(CODE, greedy(2), request_id="dup")
    with pytest.raises(ValueError, match="dup"):
        eng.add_request(QUESTION, greedy(2), request_id="dup")
    # n=2 runs as sequences "x#0", "x#1"; a user id equal to one of them must
    # not share their block table.
    eng.add_request(CODE, greedy(2, n=2), request_id="x")
    with pytest.raises(ValueError, match="x#0"):
        eng.add_request(QUESTION, greedy(2), request_id="x#0")
    finished = drain(eng)
    assert set(finished) == {"dup", "x"}
    assert finished["dup"].prompt == CODE
    assert_idle(eng)


# ------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def tiny() -> LLMEngine:
    """max_model_len 64 and a pool of 2 blocks x 16 = 32 tokens."""
    return LLMEngine(EngineConfig(dtype="float32", max_model_len=64, cache=CacheConfig(block_size=16, num_blocks=2)))


def _mutated(**kw) -> SamplingParams:
    """Valid at construction, then changed: add_request must validate again."""
    sp = greedy(4)
    for k, v in kw.items():
        setattr(sp, k, v)
    return sp


BAD_INPUTS = [
    # (prompt, params or None, regex the message must match)
    ("prompt_over_max_model_len", [100] * 70, None, r"70 tokens.*max_model_len is 64"),
    ("prompt_over_pool", [100] * 40, None, r"40 tokens.*KV pool.*2 blocks x 16 tokens = 32"),
    ("max_tokens_0", "hi", _mutated(max_tokens=0), r"max_tokens.*>= 1.*0"),
    ("max_tokens_negative", "hi", _mutated(max_tokens=-3), r"max_tokens.*>= 1"),
    ("top_p_0", "hi", _mutated(top_p=0.0), r"top_p.*\(0, 1\]"),
    ("top_p_1.5", "hi", _mutated(top_p=1.5), r"top_p.*\(0, 1\].*1\.5"),
    ("temperature_negative", "hi", _mutated(temperature=-0.5), r"temperature.*>= 0.*-0\.5"),
    ("temperature_nan", "hi", _mutated(temperature=float("nan")), r"temperature"),
    ("stop_token_ids_int", "hi", _mutated(stop_token_ids=13), r"stop_token_ids must be a list"),
    ("seed_text", "hi", _mutated(seed="abc"), r"seed must be an integer"),
    ("seed_over_64_bits", "hi", _mutated(seed=2**70), r"seed must be an integer in"),
    ("logprobs_float", "hi", _mutated(logprobs=2.5), r"logprobs must be an integer"),
    ("empty_prompt_text", "", None, r"empty"),
    ("empty_prompt_ids", [], None, r"empty"),
    ("token_id_too_big", [1, 2, 49152], None, r"49152.*vocabulary.*\[0, 49152\)"),
    ("token_id_negative", [1, -1], None, r"-1.*vocabulary"),
]


def test_bad_input_is_rejected_before_allocation_and_spares_requests_in_flight(llm, tiny):
    good_prompt, good_sp = QUESTION, greedy(12)
    want = llm.generate(good_prompt, good_sp, use_tqdm=False)[0].outputs[0].token_ids
    rid = tiny.add_request(good_prompt, good_sp, request_id="good")
    tiny.step()
    tiny.step()  # prefilled and decoding
    results = {}
    for name, prompt, sp, pattern in BAD_INPUTS:
        state = (tiny.kv.pool.num_free, dict(tiny.kv.tables), len(tiny.scheduler.waiting),
                 len(tiny.scheduler.running), set(tiny.groups))
        with pytest.raises(ValueError, match=pattern) as e:
            tiny.add_request(prompt, sp)
        results[name] = str(e.value)
        after = (tiny.kv.pool.num_free, dict(tiny.kv.tables), len(tiny.scheduler.waiting),
                 len(tiny.scheduler.running), set(tiny.groups))
        assert after == state, f"{name} changed engine state"
        for out in tiny.step():  # the good request keeps going between bad ones
            if out.finished:
                results["good"] = out
    # A prompt that fits both limits is accepted; run it after the good one.
    while "good" not in results:
        for out in tiny.step():
            if out.finished:
                results["good"] = out
    assert results["good"].outputs[0].token_ids == want
    assert rid == "good"
    assert_idle(tiny)


@pytest.mark.parametrize("kw, pattern", [
    (dict(max_tokens=0), r"max_tokens"), (dict(top_p=0.0), r"top_p"), (dict(top_p=1.5), r"top_p"),
    (dict(temperature=-1.0), r"temperature"), (dict(top_k=-2), r"top_k"), (dict(n=0), r"\bn\b"),
    (dict(logprobs=21), r"logprobs"), (dict(stop=[""]), r"stop"),
    # Types: each of these used to pass here and fail inside a step.
    (dict(max_tokens="5"), r"max_tokens must be an integer"), (dict(max_tokens=True), r"max_tokens"),
    (dict(temperature="0.5"), r"temperature must be a number"), (dict(temperature=float("inf")), r"finite"),
    (dict(seed="abc"), r"seed must be an integer"), (dict(seed=1.5), r"seed"), (dict(seed=2**70), r"seed"),
    (dict(logprobs=2.5), r"logprobs must be an integer"), (dict(stop_token_ids=13), r"stop_token_ids"),
    (dict(stop_token_ids=None), r"stop_token_ids"), (dict(stop_token_ids=[1.0]), r"stop_token_ids"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids must be token ids >= 0, got -1"),
    (dict(stop=None), r"stop must be a string or a list"), (dict(logit_bias=[1, 2]), r"logit_bias must be a dict"),
    (dict(logit_bias={1: "a"}), r"logit_bias values"), (dict(ignore_eos="no"), r"ignore_eos must be true or false"),
    (dict(n=129), r"n must be an integer in \[1, 128\]"),
])
def test_sampling_params_reject_bad_values_at_construction(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kw)


def test_generate_with_one_bad_prompt_queues_nothing(llm):
    free = llm.engine.kv.pool.num_free
    with pytest.raises(ValueError, match="empty"):
        llm.generate([STORY, CODE, ""], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([STORY, CODE, QUESTION], [greedy(4), greedy(4)], use_tqdm=False)
    assert llm.engine.kv.pool.num_free == free
    assert_idle(llm.engine)


@pytest.mark.parametrize("path", ["/nonexistent/model.gguf", "/nonexistent-dir"])
def test_unknown_model_path(path):
    with pytest.raises((FileNotFoundError, ValueError), match=path):
        LLMEngine(EngineConfig(model=path, dtype="float32"))


def test_close_removes_the_sessions_directory(tmp_path, monkeypatch):
    """LLM.close() (here through a with block) closes every session and the
    engine's background threads at once: the session manager's temporary
    directory goes then, not whenever the garbage collector finds it."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with LLM(dtype="float32", num_blocks=96, block_size=16) as llm:
        session = llm.open_session(STORY)
        session.generate(greedy(2))
        assert list(tmp_path.glob("trajserve-kv-*")), "the sessions' directory exists while the LLM is open"
    assert llm.sessions is None  # the LLM is still referenced: only close() can have removed the directory
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="this engine is closed"):  # as its docstring says: not usable
        llm.generate(STORY, greedy(2), use_tqdm=False)


def test_a_dropped_engine_frees_its_model_and_pool_without_the_garbage_collector():
    """Nothing in an engine points back at it, or at its model, in a cycle:
    the last reference going frees the model and the pool there and then. A
    cycle waits for the garbage collector, which counts Python objects, not
    bytes, so a process that builds engines in turn (`serve --slo`'s
    calibration, the benches' rounds) would hold every pool it built."""
    def build() -> LLMEngine:
        return LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=64, block_size=16)))

    # decode steps: the one-call layer stack where the kernels run it
    assert gone_when_dropped(build, lambda e: run_requests(e, [(STORY, greedy(4))])) == [True, True, True]


def test_a_tiny_temperature_is_greedy(llm, story_ref):
    """logits / 1e-40 overflow float32 (nan after the softmax): below 1e-5 a
    temperature samples as its limit, greedy (as vLLM)."""
    out = llm.generate(STORY, SamplingParams(max_tokens=24, temperature=1e-40, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == story_ref.token_ids


def test_a_step_that_raises_leaves_the_llm_usable(llm, story_ref, monkeypatch):
    """Whatever a step raises, the LLM's requests are aborted on the way out:
    the next generate runs (before, the request stayed in the batch and every
    later call raised the same error)."""
    real = llm.engine.sampler.sample
    calls = []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected sampler fault")
        return real(*a, **kw)

    monkeypatch.setattr(llm.engine.sampler, "sample", failing)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([STORY, CODE], greedy(8), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.groups
    monkeypatch.setattr(llm.engine.sampler, "sample", real)
    assert llm.generate(STORY, greedy(24), use_tqdm=False)[0].outputs[0].token_ids == story_ref.token_ids
    assert_idle(llm.engine)


@pytest.mark.parametrize("config, pattern", [
    (dict(scheduler=SchedulerConfig(max_prefill_chunk=-1)), r"max_prefill_chunk \(--max-prefill-chunk\) must be an "
                                                            r"integer >= 1, got -1"),  # reached the C kernels
    (dict(scheduler=SchedulerConfig(max_num_seqs=0)), r"max_num_seqs"),                # scheduled nothing, for ever
    (dict(scheduler=SchedulerConfig(max_num_batched_tokens=-5)), r"max_num_batched_tokens"),
    (dict(cache=CacheConfig(block_size=0)), r"block_size"),
    (dict(cache=CacheConfig(num_blocks=0)), r"num_blocks"),
    (dict(cache=CacheConfig(memory_fraction=5)), r"memory_fraction \(--memory-fraction\) must be in \(0, 1\]"),
    (dict(max_model_len=0), r"max_model_len"),
    (dict(num_threads=0), r"num_threads \(--threads\) must be"),  # the flag's own name
    (dict(device="tpu"), r"device must be cpu or cuda\[:N\], got 'tpu'"),
    (dict(max_model_len=10**6), r"max_model_len \(--max-model-len\) 1,000,000 is over the model's context of 8,192"),
    (dict(cache=CacheConfig(kv_cache_memory=10**15)), r"KV pool of .* blocks needs .* GiB; only .* GiB of host "
                                                      r"memory is available"),  # was killed by the OOM killer
    # Accepted before, and the host tier was silently absent.
    (dict(cache=CacheConfig(host_cache_bytes=2**20, enable_prefix_caching=False)),
     r"--kv-host-cache / --kv-disk-cache\) are tiers under the prefix cache, which .*--no-prefix-caching"),
    (dict(cache=CacheConfig(disk_cache_bytes=2**20, disk_cache_dir="/proc/nope")),
     r"the disk tier's directory '/proc/nope' cannot be used: No such file or directory"),  # was a bare errno
])
def test_engine_options_are_checked_before_anything_is_allocated(config, pattern):
    with pytest.raises(ValueError, match=pattern):
        LLMEngine(EngineConfig(dtype="float32", **config))


def test_sizes_take_tb_and_name_the_option():
    with pytest.raises(ValueError, match=r"kv_cache_memory \(--kv-cache-memory\) 'abc' is not a size"):
        LLM(kv_cache_memory="abc")
    with pytest.raises(ValueError, match=r"only .* GiB of host memory is available"):
        LLM(kv_cache_memory="1TB", dtype="float32")


def test_abort_keeps_the_reasons_of_choices_that_had_finished(llm):
    """n = 2, one choice stopped by a stop token while the other runs: the
    aborted request's output keeps the finished choice's reason ("stop") and
    marks only the running one "abort", so the counters see both."""
    eng = llm.engine
    sp = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=64, ignore_eos=True)
    # A token the first choice writes early becomes a stop token for both.
    first = eng.add_request(STORY, sp)
    out = None
    while out is None or len(out.outputs[0].token_ids) < 6:
        out = next((o for o in eng.step() if o.request_id == first), out)
    stop_id = out.outputs[0].token_ids[4]
    eng.abort_request(first)
    rid = eng.add_request(STORY, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=64, ignore_eos=True,
                                                stop_token_ids=[stop_id]))
    for _ in range(200):
        outs = {o.request_id: o for o in eng.step()}
        o = outs.get(rid)
        if o is not None and [c.finish_reason for c in o.outputs].count(None) == 1:
            break
    else:
        pytest.fail("no step left exactly one choice running")
    final = eng.abort_request(rid)
    assert sorted(c.finish_reason for c in final.outputs) == ["abort", "stop"]
    assert_idle(eng)
