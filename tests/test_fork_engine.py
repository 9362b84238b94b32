"""Forks on the real model: branches share the parent's blocks, a write into
the shared partial tail copies that block only, and no branch disturbs
another's KV (greedy branches give the unforked tokens)."""
import dataclasses

import pytest

from trajserve.config import CacheConfig, EngineConfig, SchedulerConfig
from trajserve.engine.engine import LLMEngine
from trajserve.sampling import SamplingParams

PROMPT = "The history of the printing press begins in"
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def drain(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def idle(engine):
    engine.kv.clear_cache()
    assert engine.kv.pool.num_free == engine.kv.num_blocks and not engine.kv.tables
    engine.kv.pool.check()


@pytest.fixture()
def engine(engine_f32):
    engine_f32.kv.clear_cache()
    return engine_f32


def test_fork_mid_decode_branches_are_independent(engine):
    ids = engine.tokenizer.encode(PROMPT)
    ref = drain_one(engine, ids, GREEDY)
    rid = engine.add_request(ids, GREEDY)
    while len(engine.groups[rid].completions[0].token_ids) < 5:
        engine.step()
    parent = engine.groups[rid].seqs[0]
    assert parent.num_computed_tokens % engine.kv.block_size, "fork point should leave a partial tail"
    copies = engine.metrics()["cow_copies"]
    used = engine.kv.pool.num_used
    hot = SamplingParams(max_tokens=24, temperature=1.5, seed=7, ignore_eos=True)
    (sampled,) = engine.fork(rid, 1, hot)
    (greedy,) = engine.fork(rid, 1)
    assert engine.kv.pool.num_used == used, "fork allocated blocks"
    prefix = list(parent.all_token_ids)
    outs = drain(engine)
    # Two children and the parent write into the shared tail: two copies, the last holder writes in place.
    assert engine.metrics()["cow_copies"] - copies == 2
    assert outs[rid].outputs[0].token_ids == ref
    assert outs[greedy].outputs[0].token_ids == ref
    s = outs[sampled].outputs[0]
    assert s.token_ids[:5] == ref[:5] and s.token_ids != ref
    # The sampled branch is what a fresh request from the fork point draws.
    fresh = drain_one(engine, prefix, dataclasses.replace(LLMEngine._seq_params(hot, 1), max_tokens=19))
    assert s.token_ids[5:] == fresh
    assert s.text == engine.tokenizer.decode(s.token_ids)
    idle(engine)


def drain_one(engine, ids, sp):
    rid = engine.add_request(ids, sp)
    return drain(engine)[rid].outputs[0].token_ids


def test_n4_prefills_the_prompt_once(engine):
    ids = engine.tokenizer.encode("Here are twelve unrelated words, one per line: " * 3)
    sp = SamplingParams(n=4, max_tokens=6, temperature=1.2, seed=3, ignore_eos=True)
    engine.add_request(ids, sp)
    computed = 0
    while engine.has_unfinished_requests():
        out = engine.step()
        computed += engine.last_step.num_tokens
        if out and out[0].finished:
            res = out[0]
    # One prefill, then 4 x 5 decode tokens (the last sample is never fed back).
    assert computed == len(ids) + 4 * 5
    assert len({tuple(c.token_ids) for c in res.outputs}) > 1, "n samples, not one repeated"
    idle(engine)


def test_spec_fork_example_on_the_model():
    """4 sampled branches of a 95-block prompt, 9 private blocks each, hold
    95 + 4 x 9 = 131 blocks at their peak, not 4 x (95 + 9) = 416. Blocks of
    4 tokens keep the run short; the block counts are the spec's. The prefix
    cache is off: with it, branches that happen to sample the same 4 tokens
    would share that block too, and the count would be lower than the spec's."""
    B = 4
    # Decoding a token a step, as the spec counts: with drafts the branches
    # finish at different steps and the peak falls below its figure.
    engine = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(block_size=B, num_blocks=300,
                                                                       enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(speculative="off")))
    base = engine.tokenizer.encode(PROMPT * 100)[: 95 * B]
    assert len(base) == 95 * B
    # 9B output tokens: the first 9B - 1 are fed back, filling 9 blocks per branch.
    sp = SamplingParams(n=4, max_tokens=9 * B, temperature=1.0, seed=11, ignore_eos=True)
    engine.add_request(base, sp)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv.pool.num_used)
    assert peak == 95 + 4 * 9 == 131
    idle(engine)


def test_fork_errors(engine):
    with pytest.raises(ValueError, match="no request 'nope' in flight"):
        engine.fork("nope")
    rid = engine.add_request(engine.tokenizer.encode(PROMPT), dataclasses.replace(GREEDY, n=2))
    with pytest.raises(ValueError, match="n=2"):
        engine.fork(rid)
    engine.abort_request(rid)
    rid = engine.add_request(engine.tokenizer.encode(PROMPT), GREEDY)
    with pytest.raises(ValueError, match="n must be >= 1"):
        engine.fork(rid, 0)
    engine.abort_request(rid)
    idle(engine)


def test_fork_of_a_waiting_request_queues_children(engine):
    ids = engine.tokenizer.encode(PROMPT)
    ref = drain_one(engine, ids, GREEDY)
    rid = engine.add_request(ids, GREEDY)
    kids = engine.fork(rid, 2)  # nothing computed yet
    outs = drain(engine)
    assert all(outs[k].outputs[0].token_ids == ref for k in [rid, *kids])
    idle(engine)
