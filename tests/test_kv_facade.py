"""The KV manager is closed: outside kv/ no module reads its pool, radix
tree, block tables or admission holds (nor sets its reclaimer); they ask
through its methods (kv/cache_views.py, kv/radix_paths.py). Read with ast
from the source; the checker is checked on a planted file."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.scope import CacheScope

PACKAGE = Path(__file__).resolve().parents[1] / "trajserve"
PRIVATE = {"pool", "radix", "tables", "holds", "reclaimer", "lower"}


def _is_kv(node: ast.AST) -> bool:
    """`kv`, or anything's `.kv` (self.kv, engine.kv, sim.kv ...)."""
    return (isinstance(node, ast.Name) and node.id == "kv") or (isinstance(node, ast.Attribute) and node.attr == "kv")


def reaches_inside(source: str) -> list[str]:
    return [f"line {n.lineno}: .kv.{n.attr}" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Attribute) and n.attr in PRIVATE and _is_kv(n.value)]


def test_the_checker_sees_a_reach_inside():
    assert reaches_inside("x = engine.kv.pool.num_free\nkv.radix.on_event = f\nself.kv.holds.cancel(s)\n") == [
        "line 1: .kv.pool", "line 2: .kv.radix", "line 3: .kv.holds"]
    assert reaches_inside("kv.stats().free_blocks\nself.kv.block_ids(r)\n") == []


def test_no_module_outside_kv_reaches_inside_the_kv_manager():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "kv":
            continue
        hits = reaches_inside(path.read_text())
        if hits:
            found[str(rel)] = hits
    assert not found, found


def test_the_facade_answers_what_callers_read():
    kv = KVCacheManager(16, 4, 0.0, enable_prefix_caching=True)
    toks = list(range(1, 14))
    assert kv.allocate_slots("r", len(toks))
    assert kv.has_table("r") and len(kv.block_ids("r")) == 4
    kv.release("r", toks, len(toks), CacheScope())
    st, pre = kv.stats(), kv.prefix_stats()
    assert (st.num_blocks, st.used_blocks, st.reclaimable_blocks, st.active_blocks) == (16, 3, 3, 0)
    assert st.free_blocks == kv.num_free_blocks == 13 and pre.cached_blocks == 3
    hit = kv.match("s", toks + [99], CacheScope())
    assert hit.num_tokens == 12 and kv.cold_blocks(hit) == 3
    with kv.borrowed(20) as ids:
        assert len(ids) == 13 and kv.num_free_blocks == 0
    assert kv.num_free_blocks == 13
    events = []
    kv.subscribe(lambda stored, hashes: events.append((stored, len(hashes))))
    with pytest.raises(ValueError, match="already has an event sink"):
        kv.subscribe(print)
    kv.clear_cache()
    assert events == [(False, 3)]
    reclaim = lambda n: 0  # noqa: E731
    kv.attach_reclaimer(reclaim)
    with pytest.raises(ValueError, match="already has a reclaimer"):
        kv.attach_reclaimer(lambda n: 0)
    kv.detach_reclaimer(reclaim)
    assert not kv.has_reclaimer
    assert KVCacheManager(8, 4).prefix_stats() is None
