"""Every place a request's identity decides which blocks it may use: two
identities never share a block they should not. Cache salts (device tree and
lower tiers), LoRA adapters (by their weights, not their names), sessions
(paused state held on a tier), stored responses continued under another
salt, and the cluster's prefix directory (salt and adapter in every hash)."""
from __future__ import annotations

import shutil

import httpx
import pytest

from test_server import MODEL, server  # noqa: F401 - server is a fixture
from tiny_models import random_adapter, save_with_tokenizer, tiny_hf_model
from trajserve.cluster.directory import KVEvent, prompt_hashes
from trajserve.cluster.router import KVRouter
from trajserve.kv.scope import CacheScope
from trajserve.llm import LLM
from trajserve.sampling import SamplingParams

B = 4
G = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
P = [(5 * i + 1) % 290 for i in range(41)]  # 10 full blocks before the last token


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("identity")
    base = tiny_hf_model("llama")
    save_with_tokenizer(base, d / "base")
    random_adapter(base, d / "a", 1, targets=("q_proj", "k_proj", "v_proj"))
    random_adapter(base, d / "b", 2, targets=("q_proj", "k_proj", "v_proj"))
    shutil.copytree(d / "a", d / "a_copy")  # the same weights under another name
    return d


def _llm(d, **kw) -> LLM:
    return LLM(str(d / "base"), dtype="float32", num_blocks=64, block_size=B,
               lora_modules={n: str(d / n) for n in ("a", "b", "a_copy")}, **kw)


def _cached(llm: LLM, prompt, salt=None, lora=None) -> int:
    rid = llm.engine.add_request(list(prompt), G, cache_salt=salt, lora=lora)
    while True:
        for o in llm.engine.step():
            if o.request_id == rid and o.finished:
                return o.num_cached_tokens


def test_salts_share_nothing_on_the_device_or_the_lower_tiers(tiny):
    llm = _llm(tiny, host_cache="8MiB")
    assert _cached(llm, P, "A") == 0
    assert _cached(llm, P, "B") == 0 and _cached(llm, P, "A") == 40
    # Push A's blocks down to the host tier (other traffic fills the pool), then ask under B.
    for k in range(5):
        _cached(llm, [(k * 31 + 7 * i) % 290 for i in range(60)], "C")
    assert llm.engine.lower.num_host_blocks > 0  # spilled below the device
    assert _cached(llm, P, "B") == 40  # B's own blocks, hit (device or tier)
    promoted = llm.engine.kv.num_promoted_blocks
    assert _cached(llm, P, None) == 0 and llm.engine.kv.num_promoted_blocks == promoted  # nothing of A's or B's
    llm.close()


def test_adapters_share_by_their_weights_never_by_name(tiny):
    llm = _llm(tiny)
    assert _cached(llm, P, lora="a") == 0
    assert _cached(llm, P, lora="b") == 0  # another adapter's K/V
    assert _cached(llm, P) == 0            # the base model's
    assert _cached(llm, P, lora="a_copy") == 40  # the same files under another name: the same KV
    llm.unload_lora("a")  # its cache goes (the copy's is the same scope: it stays valid)
    llm.load_lora("a", str(tiny / "b"))  # the name again, other weights
    assert _cached(llm, P, lora="a") == 40  # b's blocks (its weights), never the old a's
    out = llm.generate([P], G, use_tqdm=False, lora="a")[0].outputs[0].token_ids
    assert out == llm.generate([P], G, use_tqdm=False, lora="b")[0].outputs[0].token_ids
    llm.close()


def test_invalidating_a_salt_drops_its_kv_on_every_adapter(tiny):
    """A file an agent read changed: KV derived from its old text goes under
    the salt whichever weights computed it; other salts keep theirs."""
    llm = _llm(tiny, host_cache="8MiB")
    for lora in (None, "a", "b"):
        _cached(llm, P, "A", lora)
    _cached(llm, P, "other", "a")
    assert llm.engine.invalidate(P[:20], cache_salt="A") > 0
    assert [_cached(llm, P, "A", lora) for lora in (None, "a", "b")] == [16, 16, 16]  # up to the stale token
    assert _cached(llm, P, "other", "a") == 40
    llm.close()


@pytest.mark.parametrize("tier", ["keep", "host", "disk"])
def test_a_paused_sessions_state_is_its_scopes_alone(tiny, tier):
    llm = _llm(tiny)
    s = llm.open_session(P, cache_salt="A", lora="a")
    s.generate(G)
    s.pause(30.0, decision=tier)
    llm.sessions.flush()
    history = list(s.history)
    for salt, lora in (("B", "a"), ("A", None), ("A", "b"), (None, None)):
        assert _cached(llm, history, salt, lora) == 0, (salt, lora)
    assert llm.sessions.metrics()["mislabelled_blocks"] == 0
    s.resume([3, 4, 5])
    assert s.generate(G).num_cached_tokens >= (len(history) - 1) // B * B
    with pytest.raises(ValueError, match="another cache_salt"):
        llm.sessions.before_turn(s.session_id, "B", "a")
    with pytest.raises(ValueError, match="another model"):
        llm.sessions.before_turn(s.session_id, "A", "b")
    llm.close()


def test_a_stored_response_continued_under_another_salt_hits_nothing_of_the_first(server):  # noqa: F811
    url = server.url
    text = "Summarize the plot of a detective novel in three sentences, naming the detective. " * 3
    first = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": text, "max_output_tokens": 8,
                                                    "temperature": 0, "cache_salt": "tenant-a"}, timeout=300).json()
    follow = {"model": MODEL, "input": "And then?", "max_output_tokens": 4, "temperature": 0,
              "previous_response_id": first["id"]}
    other = httpx.post(url + "/v1/responses", json={**follow, "cache_salt": "tenant-b"}, timeout=300).json()
    assert other["usage"]["input_tokens_details"]["cached_tokens"] == 0
    same = httpx.post(url + "/v1/responses", json={**follow, "cache_salt": "tenant-a"}, timeout=300).json()
    assert same["usage"]["input_tokens_details"]["cached_tokens"] >= 32


def test_the_prefix_directory_keeps_salts_and_adapters_apart():
    """A replica holding a prompt under one scope is no match for the same
    tokens under another: the front end hashes as the replicas' KV managers do."""
    from trajserve.kv.cache_manager import KVCacheManager

    kv = KVCacheManager(64, 16, 0.0, enable_prefix_caching=True, model_id="m")
    toks = list(range(100, 100 + 16 * 20))
    scopes = [CacheScope(), CacheScope("t"), CacheScope(None, "a" * 64), CacheScope("t", "a" * 64)]
    hashes = [prompt_hashes(kv.namespace(sc), toks, 16) for sc in scopes]
    assert len({h[0] for h in hashes}) == len(scopes)
    r = KVRouter(2, block_size=16, promises=False)
    r.directory.apply(KVEvent(1, tuple(hashes[2]), "device"))  # replica 1 holds the adapter's blocks
    assert r.match_tokens(1, hashes[2]) == 16 * 20
    assert all(r.match_tokens(1, h) == 0 for i, h in enumerate(hashes) if i != 2)
