"""Prompt-cache retention (kv/retention.py): a prefix a client marked
(Anthropic's cache_control with its ttl, OpenAI's prompt_cache_retention
"24h") is evicted last on every tier, so under pressure it still hits where
an unmarked prefix was dropped; a retention expires, and its map is bounded."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from test_lower_tiers import TokenPool, manager, run_request

from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.retention import Retention
from trajserve.kv.scope import CacheScope

B = 4
MARKED, UNMARKED = list(range(100, 116)), list(range(200, 216))  # 4 blocks each


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_retention_holds_until_its_ttl_and_the_map_is_bounded():
    clock = Clock()
    r = Retention(clock, max_entries=4)
    r.retain([b"a", b"b"], 300.0)
    r.retain([b"a"], 60.0)  # a shorter one does not cut the longer
    assert r.holds(b"a") and r.holds_hex(b"b".hex()) and not r.holds(b"c")
    clock.now += 301
    assert not r.holds_any([b"a", b"b"]) and len(r) == 0  # expired, and dropped as read
    r.retain([b"1", b"2", b"3"], 100.0)
    r.retain([b"4", b"5"], 50.0)  # over the cap: the entries expiring soonest go
    assert len(r) == 4 and r.holds(b"1") and r.holds(b"2") and r.holds(b"3")


def _cached(kv: KVCacheManager, tokens: list[int]) -> int:
    return kv.cached_prefix(tokens, CacheScope(None)).num_tokens


@pytest.mark.parametrize("retained", [False, True])
def test_the_device_evicts_a_retained_prefix_last(retained):
    kv = KVCacheManager(12, B, watermark=0.0, enable_prefix_caching=True)
    pool = TokenPool(12)
    run_request(kv, pool, "marked", MARKED)  # the least recently used of the two
    run_request(kv, pool, "unmarked", UNMARKED)
    if retained:
        assert kv.retain(MARKED, CacheScope(None), len(MARKED), 3600.0) == 4
    run_request(kv, pool, "new", list(range(300, 324)))  # 6 blocks: one of the two prefixes must go
    if retained:  # LRU would take the marked one; the unmarked one went instead
        assert (_cached(kv, MARKED), _cached(kv, UNMARKED)) == (16, 0)
        assert kv.retention.num_deferred == 0
    else:
        assert (_cached(kv, MARKED), _cached(kv, UNMARKED)) == (0, 16)
    # Not pinned: when nothing else is left, it goes too (the pool's frames are the running requests').
    run_request(kv, pool, "big", list(range(400, 448)))  # all 12 blocks
    assert _cached(kv, MARKED) == 0 and _cached(kv, list(range(400, 448))) == 48
    assert kv.retention.num_deferred == (1 if retained else 0)  # taken once nothing else was left


def test_an_expired_retention_is_evicted_in_lru_order():
    clock = Clock()
    kv = KVCacheManager(12, B, watermark=0.0, enable_prefix_caching=True)
    kv.retention.clock = clock
    pool = TokenPool(12)
    run_request(kv, pool, "marked", MARKED)
    run_request(kv, pool, "unmarked", UNMARKED)
    kv.retain(MARKED, CacheScope(None), len(MARKED), 300.0)
    clock.now += 301
    run_request(kv, pool, "new", list(range(300, 324)))
    assert (_cached(kv, MARKED), _cached(kv, UNMARKED)) == (0, 16)


def test_a_retained_prefix_outlives_the_host_tier_where_an_unmarked_one_is_dropped():
    kv, pool, lower = manager(num_blocks=8, host_blocks=4)
    scope = CacheScope(None)
    run_request(kv, pool, "marked", MARKED)
    kv.retain(MARKED, scope, len(MARKED), 3600.0)
    run_request(kv, pool, "unmarked", UNMARKED)
    run_request(kv, pool, "flood1", list(range(300, 332)))  # 8 blocks: both prefixes leave the device
    assert kv.pool.num_free == 0 and lower.num_host_blocks == 4
    # The host tier holds 4 blocks: the unmarked prefix was the one dropped (LRU would keep the newer).
    # From the host tier, tokens checked; 3 of its 4 blocks, as any match (the last token is always computed).
    assert run_request(kv, pool, "marked-again", MARKED) == 12
    assert run_request(kv, pool, "unmarked-again", UNMARKED) == 0


def test_a_retention_is_for_its_own_scope():
    kv = KVCacheManager(12, B, watermark=0.0, enable_prefix_caching=True)
    pool = TokenPool(12)
    run_request(kv, pool, "marked", MARKED)
    run_request(kv, pool, "unmarked", UNMARKED)
    kv.retain(MARKED, CacheScope("another-tenant"), len(MARKED), 3600.0)  # not these blocks' scope
    run_request(kv, pool, "new", list(range(300, 324)))
    assert (_cached(kv, MARKED), _cached(kv, UNMARKED)) == (0, 16)


@pytest.fixture(scope="module")
def tight_server():
    """The embedded model behind the server, on a pool of 40 blocks (640
    tokens) and a host tier of 16 blocks."""
    from trajserve.config import CacheConfig, EngineConfig
    from trajserve.engine.engine import LLMEngine
    from trajserve.server.app import build_app
    from trajserve.server.config import ServerConfig

    engine = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=40, enable_prefix_caching=True)))
    engine.close()
    block_bytes = engine.block_bytes
    engine = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(
        num_blocks=40, enable_prefix_caching=True, host_cache_bytes=16 * block_bytes)))
    app = build_app(engine, ServerConfig(served_model_names=("m",)))
    app.state.engine.start()
    try:
        with TestClient(app) as c:
            yield c, engine
    finally:
        app.state.engine.shutdown()
        app.state.sessions.shutdown()
        engine.close()


def _system(topic: str) -> str:
    return (f"You are a careful assistant for questions about {topic}. Answer in one short sentence, cite no "
            f"sources, and say so when you do not know. ") * 5


def _ask(client, topic: str, ttl: str | None, question: str = "Hi.") -> dict:
    block = {"type": "text", "text": _system(topic)}
    if ttl is not None:
        block["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 1, "temperature": 0, "system": [block],
                                          "messages": [{"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_a_1h_breakpoint_still_hits_from_its_tier_where_an_unmarked_prefix_was_evicted(tight_server):
    client, engine = tight_server
    first = _ask(client, "tides", "1h")
    marked = first["cache_creation"]["ephemeral_1h_input_tokens"]
    assert marked > 140 and first["cache_read_input_tokens"] == 0  # written at the mark, for an hour
    _ask(client, "volcanoes", None)
    _ask(client, "glaciers", None)
    # A prompt that needs 36 of the 40 blocks: everything else leaves the device, the marked prefix last,
    # down to the host tier (16 blocks: it keeps the marked prefix, the unmarked ones are dropped there).
    _ask(client, "comets", None, "Summarise this list: " + ", ".join(f"item {i}" for i in range(78)))
    promoted = engine.kv.num_promoted_blocks
    again = _ask(client, "tides", "1h")
    assert again["cache_read_input_tokens"] >= marked - 16 and again["cache_creation_input_tokens"] <= 16
    assert engine.kv.num_promoted_blocks > promoted  # it came back from the host tier
    unmarked = _ask(client, "volcanoes", None)
    assert unmarked["cache_read_input_tokens"] < 16  # dropped: at most a shared first block


def test_openai_24h_retention_keeps_the_whole_prompt(tight_server):
    client, engine = tight_server
    before = len(engine.kv.retention)
    r = client.post("/v1/chat/completions", json={
        "model": "m", "max_tokens": 1, "temperature": 0, "prompt_cache_retention": "24h",
        "messages": [{"role": "system", "content": _system("rivers")}, {"role": "user", "content": "Hi."}]})
    assert r.status_code == 200, r.text
    assert len(engine.kv.retention) - before == r.json()["usage"]["prompt_tokens"] // 16  # its full blocks
    before = len(engine.kv.retention)
    r = client.post("/v1/chat/completions", json={
        "model": "m", "max_tokens": 1, "prompt_cache_retention": "in_memory",
        "messages": [{"role": "system", "content": _system("lakes")}, {"role": "user", "content": "Hi."}]})
    assert r.status_code == 200 and len(engine.kv.retention) == before  # the default retains nothing
