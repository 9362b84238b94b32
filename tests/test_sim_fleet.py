"""`simulate --replicas N`: N copies of the engine's scheduler and KV
manager behind the cluster's own routers (sim/fleet.py), on the cost model.
Every call runs once, on one replica; requests that share a document go
where its blocks are under kv routing (fed by the radix caches' events) and
hit far more often than scattered round-robin; the CLI prints every router
and the one-cache baseline."""
from __future__ import annotations

import json
import random

import pytest

from trajserve.cli import main
from trajserve.cluster.router import make_router
from trajserve.config import SchedulerConfig
from trajserve.plan.catalog import get_device, get_model
from trajserve.sim.build import SimSetup
from trajserve.sim.fleet import Fleet
from trajserve.sim.hardware import Hardware, ModelCost
from trajserve.sim.workload import Call, Session, fixed


def _setup(blocks: int) -> SimSetup:
    return SimSetup(Hardware.from_device(get_device("h100")), ModelCost.from_spec(get_model("llama-3-70b"), 8),
                    blocks, 16, SchedulerConfig(64, 4096, 4096), keep_policy="cache")


def _documents(tokens, docs: int = 8, requests: int = 240, doc_len: int = 2048, seed: int = 0):
    """Questions about `docs` long documents (one call each, no session):
    each prompt is a document then 32 fresh tokens."""
    texts = [tokens.fresh(doc_len) for _ in range(docs)]
    rng = random.Random(seed)
    picks = [rng.randrange(docs) for _ in range(requests)]
    return [Session(f"q{i}", [Call(fixed(lambda d=d: texts[d] + tokens.fresh(32)), 16, arrival=i * 0.05)])
            for i, d in enumerate(picks)]


def _run(router: str, replicas: int = 4, blocks: int = 400):
    s = _setup(blocks)
    tokens = s.simulator()[1]
    options = {"block_size": 16} if router == "kv" else {}
    return Fleet(s, replicas, make_router(router, replicas, **options), tokens).run(_documents(tokens))


def test_every_call_runs_once_on_one_replica():
    for name in ("round-robin", "least-loaded", "kv", "char-prefix"):
        r = _run(name)
        assert r.calls == 240 and sum(r.calls_per_replica) == 240 and r.rejected == 0
        assert r.prompt_tokens == 240 * (2048 + 32)
        assert 0 < r.ttft_p50_s <= r.ttft_p99_s
    assert _run("round-robin").calls_per_replica == [60, 60, 60, 60]


def test_kv_routing_keeps_each_document_where_its_blocks_are():
    """8 documents of 128 blocks, 4 replicas of 400 blocks: each replica
    can keep 2-3 documents. Round-robin makes every replica hold all 8 (they
    evict each other); kv routing sends a document's questions to the
    replica holding it, without piling them all on one."""
    kv, rr = _run("kv"), _run("round-robin")
    assert kv.hit_rate > 0.8 > rr.hit_rate + 0.3
    assert min(kv.calls_per_replica) > 20  # spread, not one replica for everything
    assert kv.ttft_p99_s < rr.ttft_p99_s


def test_cli_prints_every_router_and_the_one_cache_baseline(capsys, tmp_path):
    png = tmp_path / "routers.png"
    capsys.readouterr()
    assert main(["simulate", "--replicas", "2", "--router", "all", "--trajectories", "8", "--turns", "3",
                 "--preamble-tokens", "512", "--num-blocks", "2000", "--plot", str(png), "--json",
                 "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["router"] for r in out["routers"]] == ["kv", "round-robin", "least-loaded", "char-prefix"]
    assert all(r["calls"] == 24 for r in out["routers"]) and out["one_cache"]["calls"] == 24
    assert png.stat().st_size > 10_000
    for bad, message in ((["--router", "random"], "--router must be all or a comma list"),
                         (["--replicas", "0"], "--replicas must be an integer >= 1"),
                         (["--prefix-host-cache", "1TB"], "--replicas runs without")):
        assert main(["simulate", "--replicas", "2", *bad, "--json", "--no-progress"]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs a router for as many"):
        Fleet(_setup(100), 3, make_router("kv", 2), None)
