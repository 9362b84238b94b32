"""The cluster's prefix directory and routing policies: the
directory's hashes are the radix cache's own, a replica's match
is its leading run of held blocks by tier, the kv router's choice follows
kv-cache-management figure 7's objective (its worked example: 32,000 of
40,000 tokens held is an 80 % match), salts never share, sessions stick to
a healthy replica, and the baselines do what they are named for."""
from __future__ import annotations

import random

import pytest

from trajserve.cluster.directory import KVEvent, PrefixDirectory, prompt_hashes
from trajserve.cluster.router import (CharPrefix, KVRouter, LeastLoaded, ReplicaLoad, RoundRobin, RouteRequest,
                                      make_router)
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.scope import CacheScope

B = 16


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def test_prompt_hashes_are_the_radix_caches_own():
    kv = KVCacheManager(64, B, 0.0, enable_prefix_caching=True, model_id="m")
    toks = _tokens(5 * B + 3)
    for scope in (CacheScope(), CacheScope("tenant-a"), CacheScope(None, "d" * 64)):
        assert prompt_hashes(kv.namespace(scope), toks, B) == kv.prefix_hashes(toks, scope, 5)
    assert prompt_hashes(kv.namespace(CacheScope("a")), toks, B)[0] != \
        prompt_hashes(kv.namespace(CacheScope("b")), toks, B)[0]


def test_a_replicas_match_is_its_leading_run_of_held_blocks_by_tier():
    d = PrefixDirectory()
    h = prompt_hashes(("m", None), _tokens(10 * B), B)
    d.apply(KVEvent(0, tuple(h[:6]), "device"))
    d.apply(KVEvent(0, tuple(h[4:6]), "host"))                 # spilled down...
    d.apply(KVEvent(0, tuple(h[4:6]), "device", stored=False))  # ...and gone from the device
    d.apply(KVEvent(0, tuple(h[7:10]), "device"))              # after a gap: useless
    d.apply(KVEvent(1, tuple(h[:2]), "disk"))
    m = d.match(0, h)
    assert (m.device, m.host, m.disk, m.blocks) == (4, 2, 0, 6)
    assert d.match(1, h).disk == 2 and d.match(2, h).blocks == 0
    d.apply(KVEvent(0, (h[4],), "device"))                     # loaded back, its host copy kept
    assert d.match(0, h).device == 5
    d.apply(KVEvent(0, (h[4],), "device", stored=False))       # evicted again: the host copy counts
    assert (d.match(0, h).device, d.match(0, h).host) == (4, 2)
    d.apply(KVEvent(0, (h[1],), "device", stored=False))       # evicted: the run ends before it
    assert d.match(0, h).blocks == 1
    assert d.forget_replica(0) == 8 and d.match(0, h).blocks == 0 and len(d) == 2
    with pytest.raises(ValueError, match="tier must be one of"):
        d.apply(KVEvent(0, (h[0],), "tape"))


def test_kv_router_follows_figure_7s_objective():
    """S = 40,000 tokens in blocks of 16; worker 1 holds the first 32,000
    (an 80 % hit) and is the busiest: mu 0.7, gamma 2 and L_max the
    largest load (the formula read literally) still send it there
    (0.7 x 0.8 - 0.3 x 1 = 0.26 > 0), and it computes only 8,000 tokens.
    With the default L_max = S, its load counts against the prompt's size."""
    toks = _tokens(40_000)
    ns = ("m", None)
    h = prompt_hashes(ns, toks, B)
    # (No promises: each route below would count the request's own prefix as held by the replica it chose.)
    r = KVRouter(3, block_size=B, mu=0.7, gamma=2.0, load_scale="busiest", promises=False)
    r.directory.apply(KVEvent(1, tuple(h[:2000]), "device"))
    loads = [ReplicaLoad(1_000), ReplicaLoad(50_000), ReplicaLoad(0)]
    req = RouteRequest(h, len(toks))
    assert r.match_tokens(1, h) == 32_000
    score = r.scores(req, loads, [0, 1, 2])
    assert score[1] == pytest.approx(0.7 * 0.8 - 0.3) and score[2] == 0.0
    assert r.route(req, loads) == 1
    # Affinity traded for load: with mu 0.2 the busiest loses (0.2 x 0.8 - 0.8 < 0).
    assert KVRouter(3, directory=r.directory, block_size=B, mu=0.2, load_scale="busiest",
                    promises=False).route(req, loads) == 2
    # The default, (Match - L) / 2S: worker 1's 32,000 held tokens do not pay for its 50,000 queued, and the
    # idle worker 2 (0) beats worker 0 (-1,000 / 80,000).
    default = KVRouter(3, directory=r.directory, block_size=B, promises=False)
    assert default.scores(req, loads, [0, 1, 2])[1] == pytest.approx((32_000 - 50_000) / 80_000)
    assert default.route(req, loads) == 2
    loads[1].running_tokens = 20_000  # now its cache is worth the wait
    assert default.route(req, loads) == 1
    # Lower tiers count for less: a host copy beats a disk copy of the same blocks.
    r2 = KVRouter(2, block_size=B, promises=False)
    r2.directory.apply(KVEvent(0, tuple(h[:100]), "disk"))
    r2.directory.apply(KVEvent(1, tuple(h[:100]), "host"))
    assert r2.route(req, [ReplicaLoad(), ReplicaLoad()]) == 1
    # Another salt: other hashes, no match anywhere; the least loaded wins.
    other = prompt_hashes(("m", "tenant-b"), toks, B)
    assert all(r.match_tokens(j, other) == 0 for j in range(3))
    assert r.route(RouteRequest(other, len(toks)), loads) == 2
    with pytest.raises(ValueError, match="mu in"):
        KVRouter(2, mu=1.5)


def test_sessions_stick_to_a_healthy_replica_and_move_when_it_dies():
    r = RoundRobin(3)
    req = RouteRequest((), 10, session_id="s")
    loads = [ReplicaLoad() for _ in range(3)]
    first = r.route(req, loads)
    assert all(r.route(req, loads) == first for _ in range(5))
    loads[first].healthy = False
    moved = r.route(req, loads)
    assert moved != first and r.route(req, loads) == moved
    loads[first].healthy = True
    assert r.route(req, loads) == moved  # it stays where its state now is
    assert r.held_tokens[moved] == 10 and sum(r.held_tokens) == 10  # its context counts where it is
    r.route(RouteRequest((), 25, session_id="s"), loads)  # the next turn, longer
    assert r.held_tokens[moved] == 25
    r.end_session("s")
    assert sum(r.held_tokens) == 0 and "s" not in r.sessions
    # The kv router counts sessions' held contexts as load: equal matches (none), the emptier replica.
    kv = KVRouter(2)
    kv.route(RouteRequest((), 5_000, session_id="a"), [ReplicaLoad(), ReplicaLoad()])
    assert kv.route(RouteRequest((), 100), [ReplicaLoad(), ReplicaLoad()]) == 1
    with pytest.raises(RuntimeError, match="no healthy replica"):
        r.route(req, [ReplicaLoad(healthy=False)] * 3)


def test_baselines():
    loads = [ReplicaLoad(5), ReplicaLoad(1), ReplicaLoad(3)]
    rr = RoundRobin(3)
    assert [rr.route(RouteRequest((), 1), loads) for _ in range(4)] == [0, 1, 2, 0]
    assert LeastLoaded(3).route(RouteRequest((), 1), loads) == 1
    cp = CharPrefix(3)
    toks = _tokens(400)
    first = cp.route(RouteRequest((), 400, toks), loads)
    assert first == 1  # nothing sent yet: the least loaded
    loads[1].running_tokens = 100  # now the busiest; the prompt's prefix still pulls there
    assert cp.route(RouteRequest((), 401, toks + [7]), loads) == 1
    # Blind to salts: another tenant's identical prompt goes there too (it cannot hit).
    assert cp.route(RouteRequest(prompt_hashes(("m", "b"), toks, B), 400, toks), loads) == 1
    # Under the threshold (a 16-token match of 400): least loaded.
    assert cp.route(RouteRequest((), 400, toks[:16] + _tokens(384, 1)), loads) == 2
    assert make_router("kv", 2).name == "kv"
    with pytest.raises(ValueError, match="router must be one of kv, round-robin, least-loaded, char-prefix"):
        make_router("random", 2)


def test_a_directory_fed_by_the_radix_caches_events_agrees_with_it():
    """Random requests over shared prefixes on a small pool (admission,
    release, LRU eviction under pressure, invalidation, clear): after every
    operation, the directory's match for each prompt is the radix cache's."""
    from trajserve.cluster.directory import KVEvent

    kv = KVCacheManager(40, 4, 0.0, enable_prefix_caching=True, model_id="m")
    d = PrefixDirectory()
    kv.radix.on_event = lambda stored, hashes: d.apply(KVEvent(0, tuple(hashes), "device", stored))
    rng = random.Random(3)
    stems = [_tokens(12, s) for s in range(4)]
    prompts: list[tuple[str, list[int]]] = []
    for i in range(300):
        op = rng.random()
        if op < 0.8:
            salt = CacheScope(rng.choice([None, "t"]))
            toks = rng.choice(stems) + _tokens(rng.randrange(1, 30), 100 + i)
            rid = f"r{i}"
            hit = kv.match(rid, toks, salt)
            if kv.allocate_slots(rid, len(toks), hit):
                kv.release(rid, toks, len(toks), salt)  # computed, then finished: its blocks go to the tree
            prompts.append((salt, toks))
        elif op < 0.9:
            salt, toks = rng.choice(prompts) if prompts else (CacheScope(), stems[0])
            kv.invalidate(toks[:rng.randrange(1, len(toks))], salt)
        elif op < 0.95:
            kv.radix.evict(rng.randrange(1, 10))
        else:
            kv.clear_cache()
        for salt, toks in prompts[-20:]:
            want = kv.radix.match_prefix(kv.namespace(salt), toks).num_tokens // 4
            assert d.match(0, prompt_hashes(kv.namespace(salt), toks, 4)).device == want
    assert d.num_events > 100


def test_a_prefix_being_computed_counts_as_held_until_its_request_is_done():
    """Two agents with one preamble arriving together meet on one replica
    (the first one's blocks are not stored yet); the promise ends with the
    request, and a replica's death drops its promises."""
    router = KVRouter(2, block_size=B)
    pre = _tokens(40 * B)
    a = RouteRequest(prompt_hashes(("m", None), pre + _tokens(B, 1), B), 41 * B)
    b = RouteRequest(prompt_hashes(("m", None), pre + _tokens(B, 2), B), 41 * B)
    loads = [ReplicaLoad(), ReplicaLoad()]
    ja = router.route(a, loads)
    loads[ja].running_tokens += 300  # a is in flight there, its prefill under way
    assert router.route(b, loads) == ja  # 40 of b's 41 blocks are being computed there: worth the wait
    assert router.match_tokens(ja, a.hashes) == 41 * B and router.match_tokens(1 - ja, a.hashes) == 0
    without = KVRouter(2, block_size=B, promises=False)
    assert without.route(b, loads) != ja  # a router blind to it sends b to the idle replica
    router.done(a, ja)
    assert router.match_tokens(ja, a.hashes) == 40 * B  # b's promise still holds the preamble, not a's last block
    router.done(b, ja)
    assert router.match_tokens(ja, b.hashes) == 0 and len(router.directory._promised) == 0
    router.route(a, loads)
    router.directory.forget_replica(ja)
    assert router.match_tokens(ja, a.hashes) == 0
