"""The radix prefix cache inside the engine: same greedy tokens with the cache
on and off, hits where the spec says they must happen, none across tenants
or after invalidation, and no leaked blocks."""
import pytest

from trajserve.config import CacheConfig, EngineConfig
from trajserve.engine.engine import LLMEngine
from trajserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SYSTEM = ("You are a coding agent. Tools: read_file(path), write_file(path, text), run_tests(). "
          "Always explain the plan before calling a tool. ") * 6


@pytest.fixture(scope="module")
def engine_off():
    return LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=512, enable_prefix_caching=False)))


def run(engine, prompt_ids, salt=None):
    rid = engine.add_request(prompt_ids, GREEDY, cache_salt=salt)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    return out


def assert_no_leak(engine):
    engine.kv.clear_cache()
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    engine.kv.pool.check()


def test_multi_turn_conversation_hits_and_matches_uncached(engine_f32, engine_off):
    tok = engine_f32.tokenizer
    engine_f32.kv.clear_cache()
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, user in enumerate(["List the files.", "Open main.py.", "Run the tests."]):
        messages.append({"role": "user", "content": user})
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        on, off = run(engine_f32, ids), run(engine_off, ids)
        assert on.outputs[0].token_ids == off.outputs[0].token_ids, f"turn {turn}"
        assert off.num_cached_tokens == 0
        if turn > 0:
            # Everything up to the last full block before the new user text was computed last turn.
            assert on.num_cached_tokens >= len(ids) - 64
            assert on.num_cached_tokens % engine_f32.kv.block_size == 0
        messages.append({"role": "assistant", "content": on.outputs[0].text})
    assert engine_f32.metrics()["H_prefix"] > 0
    assert_no_leak(engine_f32)


def test_concurrent_requests_hit_a_running_prefix(engine_f32, engine_off):
    tok = engine_f32.tokenizer
    engine_f32.kv.clear_cache()
    base = tok.encode(SYSTEM)
    prompts = [base + tok.encode(f" Task {i}: fix bug number {i}.") for i in range(4)]
    first = engine_f32.add_request(prompts[0], GREEDY)
    engine_f32.step()  # first prompt's blocks are computed (and cached) while it still runs
    ids = [engine_f32.add_request(p, GREEDY) for p in prompts[1:]]
    outs = {}
    while engine_f32.has_unfinished_requests():
        for o in engine_f32.step():
            if o.finished:
                outs[o.request_id] = o
    full_blocks = (len(base) // 16) * 16
    for rid, p in zip([first] + ids, prompts):
        assert outs[rid].outputs[0].token_ids == run(engine_off, p).outputs[0].token_ids
    for rid in ids:
        assert outs[rid].num_cached_tokens >= full_blocks - 16
    assert_no_leak(engine_f32)


def test_tenants_never_share_and_invalidate_drops(engine_f32):
    engine_f32.kv.clear_cache()
    ids = engine_f32.tokenizer.encode(SYSTEM + " Summarize the repository.")
    assert run(engine_f32, ids, salt="tenant-a").num_cached_tokens == 0
    assert run(engine_f32, ids, salt="tenant-b").num_cached_tokens == 0  # same text, other salt
    assert run(engine_f32, ids, salt="tenant-a").num_cached_tokens > 0
    # The file the prompt was built from changed: state after that point must not be served.
    dropped = engine_f32.invalidate(ids[:40], cache_salt="tenant-a")
    assert dropped > 0
    again = run(engine_f32, ids, salt="tenant-a")
    assert again.num_cached_tokens < 40
    assert_no_leak(engine_f32)


def test_invalidate_by_text_covers_the_boundary_token_and_refuses_an_empty_prefix(engine_f32):
    """A text prefix ending in a space encodes alone as "... " where the
    prompt has " word": matching all its tokens found nothing and the stale
    state stayed. It now drops what follows all but its last token."""
    engine_f32.kv.clear_cache()
    prompt = SYSTEM + " Summarize the repository."
    run(engine_f32, prompt)
    cut = prompt.index(" Summarize") + 1  # "... Summarize": the text up to and including the space
    assert engine_f32.invalidate(prompt[:cut]) > 0
    assert run(engine_f32, prompt).num_cached_tokens <= len(engine_f32.tokenizer.encode(prompt[:cut]))
    for bad, words in (("", "at least 2 tokens"), ([], "the prefix is empty"), (123, "text or a list of token ids")):
        with pytest.raises(ValueError, match=words):
            engine_f32.invalidate(bad)
    assert run(engine_f32, prompt).num_cached_tokens > 0  # nothing was wiped by the refused calls
    assert_no_leak(engine_f32)
