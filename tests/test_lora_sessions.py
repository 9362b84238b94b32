"""A session opened with a LoRA adapter pauses and resumes in its own cache
scope (salt + adapter, kv/scope.py): a keep pins the adapter's path, host and
disk save and restore it, a drop leaves the base model's copy of the same
tokens alone, the keep policy prices the adapter's blocks, and no block of
the base model ever enters the adapter's cache (or the reverse) -- checked
against a fresh engine with no cache, beside a base-model session on the
same prompt, through forks and every tier."""
from __future__ import annotations

import pytest
import torch

from tiny_models import random_adapter, save_with_tokenizer, tiny_hf_model
from trajserve.kv.lower_tiers import LowerTiers
from trajserve.kv.scope import CacheScope
from trajserve.llm import LLM
from trajserve.sampling import SamplingParams

B = 4
G = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
M = [(7 * i + 3) % 290 for i in range(40)]  # 10 blocks
OBS, OBS2 = [5, 6, 7, 8, 9], [11, 12, 13]
TIERS = ("keep", "host", "disk", "drop")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama and an adapter on the attention projections (so its K/V
    differ from the base model's for the same tokens), and a reference engine
    with no prefix cache."""
    d = tmp_path_factory.mktemp("lora_sessions")
    base = tiny_hf_model("llama")
    save_with_tokenizer(base, d / "base")
    random_adapter(base, d / "a", 1, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    fresh = LLM(str(d / "base"), dtype="float32", num_blocks=256, block_size=B, enable_prefix_caching=False,
                lora_modules={"a": str(d / "a")})
    yield d, fresh
    fresh.close()


def _llm(d, num_blocks=64) -> LLM:
    return LLM(str(d / "base"), dtype="float32", num_blocks=num_blocks, block_size=B,
               lora_modules={"a": str(d / "a")})


def _want(fresh: LLM, tokens: list[int], lora: str | None) -> list[int]:
    return fresh.generate([tokens], G, use_tqdm=False, lora=lora)[0].outputs[0].token_ids


def _cached(llm: LLM, tokens: list[int], scope: CacheScope) -> int:
    return llm.engine.kv.cached_prefix(tokens, scope).num_tokens


def _no_leak(llm: LLM) -> None:
    llm.sessions.shutdown()
    kv = llm.engine.kv
    kv.clear_cache()
    assert kv.pool.num_free == kv.num_blocks


@pytest.mark.parametrize("tier", TIERS)
def test_a_paused_lora_session_never_poisons_the_adapters_cache(tiny, tier):
    """The probe's sequence: the base model has the prompt cached, a LoRA
    session on it pauses and resumes; its next turn and every later request
    of the adapter get the adapter's tokens, and the base model keeps its copy."""
    d, fresh = tiny
    llm = _llm(d)
    first = _want(fresh, M, "a")
    llm.generate([M], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)  # the base model caches M
    base_held = _cached(llm, M, CacheScope())
    assert base_held == len(M)
    s = llm.open_session(M, lora="a")
    assert s.generate(G).outputs[0].token_ids == first
    history = list(s.history)
    s.pause(5.0, decision=tier)
    llm.sessions.flush()
    full = (len(history) - 1) // B * B  # the last token's KV is computed by the next turn
    if tier == "keep":
        assert _cached(llm, history, s.scope) == full and s.pin is not None
    elif tier in ("host", "disk"):
        assert _cached(llm, history, s.scope) == 0 and s.saved_blocks == full // B
    else:
        assert _cached(llm, history, s.scope) == 0
    assert _cached(llm, M, CacheScope()) == base_held  # the base model's copy is untouched
    s.resume(OBS)
    out = s.generate(G)
    assert out.outputs[0].token_ids == _want(fresh, history + OBS, "a")
    if tier != "drop":
        assert out.num_cached_tokens >= full  # restored, not recomputed
    later = llm.generate([M], G, use_tqdm=False, lora="a")[0]
    assert later.outputs[0].token_ids == first
    assert llm.generate([M], G, use_tqdm=False)[0].outputs[0].token_ids == _want(fresh, M, None)
    assert llm.sessions.metrics()["mislabelled_blocks"] == 0
    _no_leak(llm)
    llm.close()


def test_a_kept_lora_session_survives_pool_pressure(tiny):
    d, fresh = tiny
    llm = _llm(d)
    s = llm.open_session(M, lora="a")
    s.generate(G)
    history = list(s.history)
    s.pause(60.0, decision="keep")  # forced: pressure does not move it
    for k in range(6):  # base-model traffic cycles the rest of the pool several times
        other = [(k * 37 + 11 * i) % 290 for i in range(60)]
        llm.generate([other], G, use_tqdm=False)
    assert _cached(llm, history, s.scope) == (len(history) - 1) // B * B
    s.resume(OBS)
    out = s.generate(G)
    assert out.num_cached_tokens >= (len(history) - 1) // B * B
    assert out.outputs[0].token_ids == _want(fresh, history + OBS, "a")
    _no_leak(llm)
    llm.close()


def test_the_keep_policy_prices_the_adapters_blocks(tiny):
    d, _ = tiny
    llm = _llm(d)
    s = llm.open_session(M, lora="a")
    s.generate(G)
    seen = []
    policy = llm.sessions.policy
    decide = policy.decide
    policy.decide = lambda state: seen.append(state) or decide(state)
    d_ = s.pause(5.0)
    assert seen[0].num_tokens == (len(s.history) - 1) // B * B  # the session's own blocks, not the base model's (none)
    assert d_.t_recompute_s > 0
    s.close()
    _no_leak(llm)
    llm.close()


@pytest.mark.parametrize("tier", TIERS)
def test_a_lora_session_forked_paused_and_resumed_beside_a_base_session(tiny, tier):
    """Same prompt, two scopes: the LoRA session forks, both parents pause to
    `tier` while the child runs a turn, both resume; every reply is the fresh
    engine's, and nothing leaks."""
    d, fresh = tiny
    llm = _llm(d, num_blocks=96)
    a, b = llm.open_session(M, lora="a"), llm.open_session(M)
    assert a.generate(G).outputs[0].token_ids == _want(fresh, M, "a")
    assert b.generate(G).outputs[0].token_ids == _want(fresh, M, None)
    [child] = a.fork()
    ha, hb = list(a.history), list(b.history)
    a.pause(5.0, decision=tier)
    b.pause(5.0, decision=tier)
    llm.sessions.flush()
    child.history.extend(OBS2)
    assert child.generate(G).outputs[0].token_ids == _want(fresh, ha + OBS2, "a")
    a.resume(OBS)
    b.resume(OBS)
    assert a.generate(G).outputs[0].token_ids == _want(fresh, ha + OBS, "a")
    assert b.generate(G).outputs[0].token_ids == _want(fresh, hb + OBS, None)
    assert llm.generate([M], G, use_tqdm=False, lora="a")[0].outputs[0].token_ids == _want(fresh, M, "a")
    assert llm.generate([M], G, use_tqdm=False)[0].outputs[0].token_ids == _want(fresh, M, None)
    _no_leak(llm)
    llm.close()


def test_saved_blocks_are_refused_under_another_scope(tiny):
    """A saved block carries the scope it was computed under: a record that
    claims another scope at its resume gets nothing back (counted as
    mislabelled) and its turn is recomputed under the scope it claims."""
    d, fresh = tiny
    llm = _llm(d)
    s = llm.open_session(M, lora="a")
    s.generate(G)
    history = list(s.history)
    s.pause(5.0, decision="host")
    llm.sessions.flush()
    assert s.saved_blocks > 0
    s.lora, s.record.scope = None, CacheScope()  # the session and its pause record now claim the base model
    s.resume(OBS)
    assert llm.sessions.metrics()["mislabelled_blocks"] >= 1
    out = s.generate(G)
    assert out.outputs[0].token_ids == _want(fresh, history + OBS, None)
    _no_leak(llm)
    llm.close()


def test_a_tier_never_serves_a_block_under_a_namespace_it_was_not_stored_in():
    tiers = LowerTiers(lambda ids: [], lambda ids, data: None, 1 << 20)
    blocks = [torch.full((4,), float(i)) for i in range(3)]
    hashes = [bytes([i]) * 16 for i in range(3)]
    assert tiers.reserve("host", sum(b.nbytes for b in blocks))
    assert tiers.hold(b"A" * 16, hashes, blocks, "host", sum(b.nbytes for b in blocks)) == 3
    assert tiers.fetch(b"B" * 16, hashes) == [] and tiers.stats.mislabelled_blocks == 1
    assert len(tiers.fetch(b"A" * 16, hashes)) == 3
    # Holding the same names for another namespace shares nothing.
    assert tiers.hold(b"B" * 16, hashes, blocks, "host", 0) == 0 and tiers.stats.mislabelled_blocks == 2
    tiers.close()


def test_the_kv_manager_takes_only_a_scope(tiny):
    d, _ = tiny
    llm = _llm(d)
    kv = llm.engine.kv
    for bad in (None, "tenant", ("tenant", "lora", "x")):
        with pytest.raises(TypeError, match="CacheScope"):
            kv.cached_prefix(M, bad)
        with pytest.raises(TypeError, match="CacheScope"):
            kv.match("r", M, bad)
    with pytest.raises(TypeError):
        CacheScope(b"salt")
    llm.close()
