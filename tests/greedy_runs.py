"""Greedy runs of a tiny model's directory through the engine, shared by
the model-family tests (windows, latent attention): three prompts, two of
them over a shared head of 24 tokens, 64 greedy tokens each."""
from __future__ import annotations

import time

import torch

from trajserve.config import CacheConfig, EngineConfig
from trajserve.engine.engine import LLMEngine
from trajserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


def engine(d, cache: dict | None = None, **kw) -> LLMEngine:
    """float32, 96 blocks of 4 tokens, prefix caching on, unless `cache` says otherwise."""
    c = dict(num_blocks=96, block_size=4, enable_prefix_caching=True) | (cache or {})
    return LLMEngine(EngineConfig(model=str(d), dtype="float32", cache=CacheConfig(**c), **kw))


def prompts() -> list[list[int]]:
    torch.manual_seed(5)
    shared = torch.randint(0, 299, (24,)).tolist()  # a head the second and third share
    return [torch.randint(0, 299, (17,)).tolist(), shared + [7, 8, 9], shared + [11, 12] + list(range(20, 34))]


def run(eng: LLMEngine, batch: list[list[int]], cached: list[int] | None = None,
        params: SamplingParams = GREEDY) -> list[list[int]]:
    """Greedy tokens of each prompt, run together; `cached` gets each one's prefix-cache hit."""
    rids = [eng.add_request(p, params) for p in batch]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    if cached is not None:
        cached.extend(done[r].num_cached_tokens for r in rids)
    return [list(done[r].outputs[0].token_ids) for r in rids]


def run_staggered(eng: LLMEngine, batch: list[list[int]]) -> list[list[int]]:
    """As run, the first prompt a step ahead of the others: cached heads are hit while it decodes."""
    rids = [eng.add_request(batch[0], GREEDY)]
    eng.step()
    rids += [eng.add_request(p, GREEDY) for p in batch[1:]]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    return [done[r] for r in rids]


def hf_greedy(hf, batch: list[list[int]]) -> list[list[int]]:
    """transformers' greedy 64 tokens of each prompt, alone."""
    out = []
    for p in batch:
        with torch.inference_mode():
            g = hf.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
        out.append(g[0, len(p):].tolist())
    return out


PAUSED_OBSERVATION = 21  # tokens of the observation paused_turns resumes with


def paused_turns(d, decision: str, disk_dir) -> tuple[list[int], list[int], str, int, int, int]:
    """Two 12-token turns of a session over prompts()[2] and an observation,
    once straight through and once paused between them (`decision`: keep,
    host, disk or drop; prefetch: disk, loaded back before the resume).
    Returns the second turn's tokens unpaused and paused, where the paused
    state went, the blocks it saved to a tier, the second turn's cached
    prompt tokens and its prompt's length."""
    from trajserve.sessions.config import SessionConfig
    from trajserve.sessions.manager import SessionManager

    eng = engine(d)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt, observation = prompts()[2], list(range(40, 40 + PAUSED_OBSERVATION))
    mgr = SessionManager(eng, SessionConfig(disk_dir=str(disk_dir)))
    try:
        s = mgr.open(prompt)
        s.generate(params)
        s.history.extend(observation)
        want = list(s.generate(params).outputs[0].token_ids)
        s.close()
        eng.kv.clear_cache()
        s = mgr.open(prompt)
        s.generate(params)
        s.pause(decision="disk" if decision == "prefetch" else decision, expected_wait_s=60)
        mgr.flush()
        residency, saved = s.residency.value, s.saved_blocks
        if decision == "prefetch":  # the return is near: loaded back in the background before the resume
            mgr.machine.set_prefetch(s.record, time.monotonic())
            mgr.tick()
            mgr.flush()
            assert s.prefetched
        s.resume(observation)
        out = s.generate(params)
        s.close()
        return want, list(out.outputs[0].token_ids), residency, saved, out.num_cached_tokens, len(out.prompt_token_ids)
    finally:
        mgr.shutdown()
        eng.close()


def assert_served_as_transformers_generates(model_path, hf) -> None:
    """The engine's greedy tokens of prompts() (a batch of three, two over a
    shared head, prefix caching on; then again with the heads cached) equal
    transformers' greedy generation of each prompt alone."""
    want = hf_greedy(hf, prompts())
    eng = engine(model_path)
    try:
        cached: list[int] = []
        assert run(eng, prompts()) == want
        assert run(eng, prompts(), cached) == want and min(cached) > 0
    finally:
        eng.close()
