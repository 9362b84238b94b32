"""Speculative decoding never changes the output: greedy tokens,
text, logprobs and finish reasons with drafts equal those without, across
chunk sizes, batch composition, preemption, fork, sessions paused to each
tier, structured output and stop strings; a seeded sample is the same text
(the C kernels compute a verified row the same bits as a decode step); and
the pool and the radix tree are back to their start after a random soak.

Two proposers drive it: prompt lookup drafting the longest match every step
(adaptive=False: the cost rule would skip drafts it prices as unprofitable),
and a hostile one whose drafts are mostly random tokens of random lengths,
so rejection and rollback at every position are exercised.
"""
from __future__ import annotations

import random

import pytest

from test_engine_invariance import _prompts, assert_pool_clean, drain, run_outputs
from trajserve.config import CacheConfig, EngineConfig, SchedulerConfig
from trajserve.engine.engine import LLMEngine
from trajserve.sampling import SamplingParams
from trajserve.speculative.proposer import DraftProposer, SpecConfig
from trajserve.structured import StructuredOutput

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

LINES = ["The river rose overnight and the ferry stopped running, so the village sent letters by bicycle.",
         "A compiler turns source code into machine instructions, checking types along the way.",
         "In 1887 the observatory recorded a comet that no one saw again for seventy years.",
         "She wrote the shopping list on the back of an old train ticket: eggs, flour, lemons, tea.",
         "Every Tuesday the market filled with the smell of roasted chestnuts and fresh bread."]


def copy_prompt(tok, n_lines: int = 6, offset: int = 0) -> list[int]:
    """A request the embedded model answers by copying its context."""
    doc = "\n".join(LINES[(offset + 2 * i) % len(LINES)] for i in range(n_lines))
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Repeat this text exactly:\n\n" + doc}]),
                      add_special_tokens=False)


class RandomDrafts(DraftProposer):
    """Mostly wrong drafts: random tokens of random length, or the lookup's
    draft with a random token spliced in; every length and rejection point."""

    def __init__(self, seed: int = 0, vocab: int = 49152) -> None:
        super().__init__(SpecConfig("ngram", 8, adaptive=False))
        self.rng, self.vocab = random.Random(seed), vocab

    def propose(self, req, limit):
        good = super().propose(req, limit)
        k = self.rng.randint(0, min(limit, 8))
        roll = self.rng.random()
        if roll < 0.3 or not good:
            return [self.rng.randrange(self.vocab) for _ in range(k)]
        if roll < 0.7 and len(good) > 1:
            good = list(good)
            good[self.rng.randrange(len(good))] = self.rng.randrange(self.vocab)
        return good


def lookup() -> DraftProposer:
    return DraftProposer(SpecConfig("ngram", 8, adaptive=False))


def engine_with(proposer: DraftProposer | None, num_blocks: int = 512, **sched) -> LLMEngine:
    """The embedded model in float32 (engine_f32's configuration) drafting
    with `proposer`, passed in at construction (None: speculation off)."""
    return LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=num_blocks),
                                  scheduler=SchedulerConfig(speculative="off", **sched)), proposer)


PROPOSERS = {"lookup": lookup, "random": RandomDrafts}


@pytest.fixture(scope="module")
def prompts(plain):
    tok = plain.tokenizer
    return [copy_prompt(tok), copy_prompt(tok, 4, 1)] + [p for p in _prompts(tok) if len(p) < 300]


@pytest.fixture(scope="module")
def plain():
    engine = engine_with(None)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference(plain, prompts):
    """Each prompt alone, no speculation."""
    return [run_outputs(plain, [p], GREEDY)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("kind", PROPOSERS)
@pytest.mark.parametrize("chunk", [7, 64, 512])
def test_greedy_tokens_are_unchanged_across_chunks_and_batching(prompts, reference, kind, chunk):
    idx = [i for i, p in enumerate(prompts) if chunk > 7 or len(p) < 150]
    prop = PROPOSERS[kind]()
    engine = engine_with(prop, max_prefill_chunk=chunk, max_num_batched_tokens=max(chunk, 16))
    got = [o.outputs[0].token_ids for o in run_outputs(engine, [prompts[i] for i in idx], GREEDY)]
    engine.close()
    assert got == [reference[i] for i in idx]
    assert prop.num_draft_tokens > 0
    if kind == "lookup":  # every step drafts 8 where a match exists: the copies' drafts are accepted
        assert prop.num_accepted_tokens > 0.3 * prop.num_draft_tokens


def test_small_pool_preemption_and_rollback(prompts, reference):
    """A pool too small for the batch: requests are preempted and
    recomputed while others verify drafts; rolled-back blocks return."""
    engine = engine_with(RandomDrafts(seed=3), num_blocks=20, admission_ceiling=1.0)
    assert sum(len(p) + GREEDY.max_tokens for p in prompts[:4]) > engine.kv.token_capacity
    got = [o.outputs[0].token_ids for o in run_outputs(engine, prompts[:4], GREEDY)]
    assert engine.scheduler.num_preemptions > 0
    assert got == reference[:4]


def test_fork_children_continue_identically(prompts):
    def forked(proposer):
        engine = engine_with(proposer)
        rid = engine.add_request(prompts[0], GREEDY)
        results: dict = {}
        for _ in range(6):
            engine.step()
        kids = engine.fork(rid, 2)
        drain(engine, results)
        out = [results[i].outputs[0].token_ids for i in [rid] + kids]
        assert_pool_clean(engine)
        engine.close()
        return out

    want = forked(None)
    assert forked(RandomDrafts(seed=5)) == want
    assert forked(lookup()) == want


@pytest.mark.parametrize("decision", ["keep", "host", "disk", "drop"])
def test_session_pause_to_each_tier(tmp_path, decision):
    from test_sessions import two_turns
    from trajserve.sessions.config import SessionConfig
    from trajserve.sessions.manager import SessionManager

    def turns(proposer, sub):
        engine = engine_with(proposer)
        mgr = SessionManager(engine, SessionConfig(disk_dir=str(tmp_path / sub)))
        try:
            first, second, _ = two_turns(mgr, "Repeat the word 'pytest' five times.", pause=decision)
        finally:
            mgr.shutdown()
            engine.close()
        return first.outputs[0].token_ids, second.outputs[0].token_ids

    prop = RandomDrafts(seed=7)
    assert turns(prop, "spec") == turns(None, "plain")
    assert prop.num_draft_tokens > 0


def test_structured_output_stop_strings_and_logprobs(plain, prompts):
    tok = plain.tokenizer
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "line": {"type": "string"}},
              "required": ["city", "line"]}
    json_prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": (
        "Answer in JSON with keys city and line. Example: {\"city\": \"Paris\", \"line\": \"" + LINES[0] +
        "\"}. Now for Rome, with the line: " + LINES[0])}]), add_special_tokens=False)
    cases = [
        (json_prompt, SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutput(json_schema=schema))),
        # A stop string the copy reaches mid-draft: the output ends there, tokens and text.
        (prompts[0], SamplingParams(max_tokens=80, temperature=0, stop=["letters by"])),
        (prompts[1], SamplingParams(max_tokens=80, temperature=0, stop=["comet"], include_stop_str_in_output=True)),
        # max_tokens inside a draft, logprobs of every accepted token.
        (prompts[1], SamplingParams(max_tokens=13, temperature=0, logprobs=3)),
        # Penalties see each verified row's own context.
        (prompts[1], SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, presence_penalty=0.5)),
    ]

    def run(proposer):
        engine = engine_with(proposer) if proposer is not None else plain
        return run_outputs(engine, [p for p, _ in cases[:1]], cases[0][1]) + [
            run_outputs(engine, [p], sp)[0] for p, sp in cases[1:]]

    want = run(None)
    prop = lookup()
    got = run(prop)
    for w, g in zip(want, got):
        a, b = w.outputs[0], g.outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
            (a.token_ids, a.text, a.finish_reason, a.stop_reason)
        if a.logprobs is not None:
            assert len(b.logprobs) == len(b.token_ids)
            for x, y in zip(a.logprobs, b.logprobs):
                assert x[1].keys() == y[1].keys()
                assert x[0] == pytest.approx(y[0], abs=1e-5)
    assert [w.outputs[0].stop_reason for w in want[1:3]] == ["letters by", "comet"]  # the stops were reached
    assert prop.num_accepted_tokens > 0


def test_seeded_sampling_gives_the_same_text(plain, prompts):
    """One draw per output token from the same distribution in the same
    order: with bit-identical logits a seed gives the same sample."""
    sps = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=s) for s in (1, 2, 3)]

    def run(proposer):
        engine = engine_with(proposer) if proposer is not None else plain
        return [run_outputs(engine, [prompts[0]], sp)[0].outputs[0].token_ids for sp in sps]

    prop = lookup()
    assert run(prop) == run(None)
    assert prop.num_accepted_tokens > 0


def test_random_soak_leaves_pool_and_tree_as_they_were(prompts):
    """Requests of every kind with aborts, forks and a small pool, drafts
    mostly wrong: nothing leaks (refcounts match the tables and the tree,
    and every block is free once the cache is cleared)."""
    prop = RandomDrafts(seed=11)
    engine = engine_with(prop, num_blocks=28, admission_ceiling=1.0)
    rng = random.Random(11)
    live: list[str] = []
    for step in range(250):
        if rng.random() < 0.4 and len(live) < 10:
            sp = SamplingParams(max_tokens=rng.randint(1, 80), temperature=rng.choice([0, 0.7]),
                                seed=rng.randint(0, 99), stop=rng.choice([[], ["the"]]))
            live.append(engine.add_request(rng.choice(prompts[:4]), sp))
        if live and rng.random() < 0.03:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        if live and rng.random() < 0.03 and live[-1] in engine.groups:
            try:
                live.extend(engine.fork(live[-1], 1))
            except ValueError:
                pass
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
    drain(engine, {})
    assert_pool_clean(engine)
    assert engine.scheduler.num_preemptions > 0 and prop.num_accepted_tokens > 0
    assert prop.num_draft_tokens > 2 * prop.num_accepted_tokens  # mostly rejected: rollbacks ran


def test_suffix_source_drafts_from_finished_requests_of_the_same_salt_only(plain):
    """An agent re-sends a turn (a retry, a sibling branch): with `suffix`
    the second request drafts from the first's finished tokens and accepts
    most of them; under another cache_salt it gets nothing from them. The
    text is the same either way."""
    tok = plain.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Write a short story about a lighthouse keeper."}])
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)

    def second_request(method, salt):
        prop = DraftProposer(SpecConfig(method, 8, adaptive=False))
        engine = engine_with(prop)
        first = engine.add_request(prompt, sp, cache_salt="a")
        results: dict = {}
        drain(engine, results)
        before = prop.num_accepted_tokens, prop.num_draft_tokens
        second = engine.add_request(prompt, sp, cache_salt=salt)
        drain(engine, results)
        engine.close()
        acc, drafted = prop.num_accepted_tokens - before[0], prop.num_draft_tokens - before[1]
        return results[first].outputs[0].token_ids, results[second].outputs[0].token_ids, acc, drafted

    a1, a2, suffix_acc, suffix_drafted = second_request("suffix", "a")
    b1, b2, other_salt_acc, _ = second_request("suffix", "b")
    c1, c2, ngram_acc, _ = second_request("ngram", "a")
    assert a1 == a2 == b1 == b2 == c1 == c2
    assert suffix_acc >= 40 and suffix_acc > 0.8 * suffix_drafted  # the first request's text, drafted back
    assert other_salt_acc == ngram_acc < 0.5 * suffix_acc  # another tenant's text is never a draft
