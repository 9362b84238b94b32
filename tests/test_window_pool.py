"""The KV manager over a window model's pool (kv/window_pool.py,
kv/window_parts.py), without tensors: every page accounted for, every
block a table's window covers keeps its window part through chunks, hits,
forks, copy-on-write and releases; a hit cut back where a window part is
gone; and the tokens the pool holds against its all-global twin at equal
bytes (Gemma 3's 52 window layers of 62, window 1,024, 8K-token contexts)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.scope import CacheScope

SCOPE = CacheScope.of(None)


def _windows_held(kv: KVCacheManager) -> None:
    kv.pool.check()
    for rid, table in kv.tables.items():
        start = kv._win_from[rid]
        assert all(kv.pool.has_window(b) for b in table.block_ids[start:]), rid
        assert start <= kv.window_start(len(table.block_ids) * kv.block_size) or start == 0


def _compute(kv: KVCacheManager, rid: str, tokens: list[int], start: int, end: int, chunk: int) -> bool:
    """Compute tokens [start, end) of rid in chunks, as the scheduler would."""
    hit = kv.match(rid, tokens, SCOPE) if rid not in kv.tables else None
    if hit is not None:
        start = max(start, hit.num_tokens)
    pos = start
    while pos < end:
        n = min(chunk, end - pos)
        if not kv.allocate_slots(rid, pos + n, hit if rid not in kv.tables else None, write_from=pos):
            return False
        hit = None
        kv.take_copies()
        pos += n
        kv.cache_computed(rid, tokens, pos, SCOPE)
    return True


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_window_a_table_covers_keeps_its_parts(data):
    kv = KVCacheManager(24, 4, watermark=0.0, enable_prefix_caching=True, window=(8, 4, (0, 1, 3)))
    heads = [list(range(100, 124)), list(range(200, 212))]
    live: dict[str, list[int]] = {}
    for step in range(data.draw(st.integers(4, 14))):
        op = data.draw(st.sampled_from(["new", "grow", "fork", "release"]))
        if op == "new" or not live:
            rid = f"r{step}"
            tokens = data.draw(st.sampled_from(heads)) + data.draw(st.lists(st.integers(0, 50), max_size=20))
            if _compute(kv, rid, tokens, 0, len(tokens), data.draw(st.integers(1, 12))):
                live[rid] = tokens
            else:
                kv.release(rid)
        elif op == "grow":
            rid = data.draw(st.sampled_from(sorted(live)))
            extra = data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=10))
            tokens = live[rid] + extra
            if _compute(kv, rid, tokens, len(live[rid]), len(tokens), data.draw(st.integers(1, 6))):
                live[rid] = tokens
            else:
                kv.release(rid)
                del live[rid]
        elif op == "fork":
            parent = data.draw(st.sampled_from(sorted(live)))
            child = f"f{step}"
            kv.fork(parent, child)
            live[child] = list(live[parent])
        else:
            rid = data.draw(st.sampled_from(sorted(live)))
            tokens = live.pop(rid)
            kv.release(rid, tokens, len(tokens), SCOPE)
        _windows_held(kv)
    for rid, tokens in list(live.items()):
        kv.release(rid, tokens, len(tokens), SCOPE)
    _windows_held(kv)
    # Nothing holds a block now: whatever the tree keeps, a prompt of the pool's capacity is admitted.
    assert kv.can_admit("probe", kv.token_capacity, None, others_running=False)
    kv.clear_cache()
    assert kv.pool.num_free_pages == kv.pool.num_pages  # every page back once nothing holds a block


def test_a_hit_resumes_at_a_kept_boundary_and_is_cut_where_a_window_part_is_gone():
    kv = KVCacheManager(64, 4, watermark=0.0, enable_prefix_caching=True, window=(8, 4, (0, 1, 3)))
    prompt = list(range(40))
    assert _compute(kv, "a", prompt, 0, 40, 16)
    reply = prompt + list(range(500, 530))
    assert _compute(kv, "a", reply, 40, 70, 1)  # decoded one by one: the prompt's inner blocks shed their windows
    kv.release("a", reply, 70, SCOPE)
    # The next turn resumes at the reply's end (kept), a fork of the prompt at its end (kept)...
    assert kv.match("b", reply + [7, 7, 7], SCOPE).num_tokens == 68
    assert kv.match("c", prompt + [9], SCOPE).num_tokens == 40
    # ...but a prefix that ends inside, where no window part is left, is recomputed from a kept point.
    before = kv.num_window_recomputed_tokens
    hit = kv.match("d", reply[:56] + [8, 8], SCOPE)
    assert hit.num_tokens == 40 and kv.num_window_recomputed_tokens - before == 16


def _sequences_held(window: tuple | None, num_blocks: int, context: int, block: int, chunk: int) -> int:
    """Sequences of `context` tokens computed one after another in chunks
    until the pool is full (each keeps its blocks)."""
    kv = KVCacheManager(num_blocks, block, watermark=0.0, enable_prefix_caching=False, window=window)
    n = 0
    while _compute(kv, f"s{n}", [n] * context, 0, context, chunk):
        n += 1
    return n


def test_the_pool_holds_what_the_window_layers_shed_at_equal_bytes():
    """Gemma 3 27B's shape: 62 layers, 52 of them windows of 1,024 tokens;
    8,192-token contexts, blocks of 16, chunks of 512. All-global: a block
    is 62 pages; here a sequence's blocks keep their 10 global pages and
    only its last window's blocks (65) their 52 window pages:
    512 x 10 + 65 x 52 = 8,500 pages against 31,744, 3.73x the sequences."""
    layers, windows = 62, tuple(i for i in range(62) if (i + 1) % 6)[:52]
    dense = _sequences_held(None, 4096, 8192, 16, 512)
    paged = _sequences_held((1024, layers, windows), 4096, 8192, 16, 512)
    assert dense == 8  # 4,096 blocks / 512 a sequence
    # 253,952 pages; each sequence 8,500 once computed, and its last chunk's 32 blocks whole while computed
    assert paged == (4096 * 62 - 32 * 52) // 8500 == 29
    assert paged / dense >= 3.6


def test_gemma3_27b_layout_passes_4x_from_16k_contexts():
    """The same layout at 16,384-token contexts: a sequence keeps 1,024 x 10
    global pages and 65 x 52 window pages, 13,620 against 63,488 (ideal
    4.66x); 37 sequences where the all-global twin holds 8, 4.6x. At 8,192
    (above) no pool reaches 4x: a token there costs 10/62 + 52/62 x
    1,040 / 8,192 of an all-global token, 3.7x at best; 4x needs contexts
    of about 9,800 tokens and up (10,400 for 6 layers, 5 of them windows)."""
    layers, windows = 62, tuple(i for i in range(62) if (i + 1) % 6)[:52]
    dense = _sequences_held(None, 8192, 16384, 16, 512)
    paged = _sequences_held((1024, layers, windows), 8192, 16384, 16, 512)
    assert dense == 8
    assert paged == (8192 * 62 - 32 * 52) // 13620 == 37
    assert paged / dense >= 4.0


def test_gemma3_1b_layout_holds_over_4x_at_8k():
    """Gemma 3 1B's shape: 26 layers, 22 of them windows of 512 tokens (5 to
    1, the last two windows); 8,192-token contexts, blocks of 16, chunks of
    512. A sequence keeps 512 x 4 global pages and 33 x 22 window pages once
    computed: 2,774 against 13,312 all-global (ideal 4.8x); 38 sequences
    where the all-global twin holds 8, 4.75x."""
    layers = 26
    windows = tuple(i for i in range(layers) if (i + 1) % 6)
    assert len(windows) == 22
    dense = _sequences_held(None, 4096, 8192, 16, 512)
    paged = _sequences_held((512, layers, windows), 4096, 8192, 16, 512)
    assert dense == 8 and paged == 38 and paged / dense >= 4.0


def test_a_hit_whose_window_part_went_since_its_match_is_not_admitted():
    kv = KVCacheManager(64, 4, watermark=0.0, enable_prefix_caching=True, window=(8, 4, (0, 1, 3)))
    tokens = list(range(30))
    assert _compute(kv, "a", tokens, 0, 30, 8)
    kv.release("a", tokens, 30, SCOPE)
    hit = kv.match("b", tokens + [1, 2], SCOPE)
    assert hit.num_tokens == 28
    kv.pool.imported([hit.block_ids[-1]], [False])  # its window pages gone between the match and the admission
    assert not kv.allocate_slots("b", 32, hit, write_from=28) and not kv.has_table("b")
    assert kv.match("b", tokens + [1, 2], SCOPE) is None  # matched again: cut back (no earlier window kept)
    _windows_held(kv)


def _agent_hits(window: tuple | None, num_blocks: int) -> tuple[int, int]:
    """16 agents x 6 turns, round robin: each turn resends its whole history
    plus a 40-token tool result, then decodes a 24-token reply one token a
    step. Returns (prompt tokens served from the cache, prompt tokens)."""
    import random

    rng = random.Random(7)
    kv = KVCacheManager(num_blocks, 4, watermark=0.0, enable_prefix_caching=True, window=window)
    preamble = list(range(1000, 1160))  # a 160-token system prompt all agents share
    histories = {a: preamble + [2000 + a] * 8 for a in range(16)}
    cached = total = 0
    for turn in range(6):
        for a in range(16):
            rid = f"a{a}t{turn}"
            prompt = histories[a] + [rng.randrange(3000, 3100) for _ in range(40)]
            hit = kv.match(rid, prompt, SCOPE)
            cached += hit.num_tokens if hit is not None else 0
            total += len(prompt)
            assert _compute(kv, rid, prompt, 0, len(prompt), 64)
            tokens = list(prompt)
            for _ in range(24):
                tokens.append(rng.randrange(4000, 4100))
                assert kv.allocate_slots(rid, len(tokens), write_from=len(tokens) - 1)
                kv.cache_computed(rid, tokens, len(tokens), SCOPE)
            kv.release(rid, tokens, len(tokens), SCOPE)
            histories[a] = tokens
            _windows_held(kv)
    return cached, total


@pytest.mark.parametrize("num_blocks", [1200, 400, 250])
def test_agent_turns_hit_on_a_window_pool_as_on_its_all_global_twin(num_blocks):
    """At equal bytes (num_blocks blocks' worth of 6 layers, 5 of them
    windows of 32 tokens; 250 holds under a quarter of the working set), the
    share of prompt tokens served from the cache is at least 95 % of the
    all-global twin's: each turn resumes at the previous turn's kept path
    end; an agent whose own path was evicted resumes at the shared system
    prompt's end, kept where the first request to recompute it left it (its
    window pages adopted by the tree's copy)."""
    dense_hit, total = _agent_hits(None, num_blocks)
    window_hit, total_w = _agent_hits((32, 6, (0, 1, 2, 3, 4)), num_blocks)
    assert total_w == total and dense_hit > 0.4 * total
    assert window_hit >= 0.95 * dense_hit


def test_what_eviction_would_free_counts_the_kept_windows_exactly():
    """Cached paths whose last window the tree keeps hold most of the pages.
    What eviction would free (num_reclaimable, in whole blocks) counts
    their kept window pages with their global ones, and not those of a
    path a request holds: exactly what evicting every unheld path frees.
    A new prompt that needs nearly all of it is admitted."""
    def filled():
        kv = KVCacheManager(40, 4, watermark=0.0, enable_prefix_caching=True, window=(8, 6, (0, 1, 2, 3, 4)))
        for i in range(8):  # 8 paths of 4 blocks: the last two of each keep their window parts in the tree
            tokens = list(range(1000 * (i + 1), 1000 * (i + 1) + 16))
            assert _compute(kv, f"p{i}", tokens, 0, 16, 16)
            kv.release(f"p{i}", tokens, 16, SCOPE)
        return kv

    kv = filled()
    held = list(range(1000, 1016)) + [7, 7, 7, 7, 7]  # path 0 and more: its blocks are in use
    assert _compute(kv, "held", held, 0, len(held), 16) and kv.pool.num_dormant_windows == 14
    free, reclaimable = kv.pool.num_free, kv.num_reclaimable
    assert reclaimable > 28 * len(kv.pool.global_cols) // 6  # more than the 28 dormant blocks' global pages alone
    kv.radix.clear()  # every path nobody holds
    assert kv.pool.num_free == free + reclaimable
    _windows_held(kv)

    kv = filled()
    need = kv.pool.num_free + kv.num_reclaimable
    assert kv.can_admit("new", need * 4, None, others_running=False)
    assert _compute(kv, "new", list(range(50_000, 50_000 + need * 4)), 0, need * 4, 16)
    _windows_held(kv)


def test_a_sequence_past_the_pool_sheds_the_least_recently_used_resume_points_first():
    """Two conversations' next turns run, each past its first turn's end
    (a resume point whose window part only the tree keeps). One grows until
    nothing is left to evict and the pool sheds such parts: the path used
    least recently (b's, whose turn started first) loses its part first,
    though a's blocks have the lower ids."""
    kv = KVCacheManager(12, 4, watermark=0.0, enable_prefix_caching=True, window=(8, 6, (0, 1, 2, 3, 4)))
    first = {c: list(range(base, base + 16)) for c, base in (("a", 100), ("b", 200))}
    ends = {}
    for c in ("a", "b"):
        assert _compute(kv, f"{c}1", first[c], 0, 16, 16)
        ends[c] = kv.tables[f"{c}1"].block_ids[-1]
        kv.release(f"{c}1", first[c], 16, SCOPE)
    assert ends["a"] < ends["b"]
    turn = {"a": first["a"] + list(range(300, 600)), "b": first["b"] + list(range(400, 440))}
    for c in ("b", "a"):  # b's next turn starts first
        assert _compute(kv, f"{c}2", turn[c], 0, 24, 8) and _compute(kv, f"{c}2", turn[c], 24, 32, 4)
    assert kv.pool.win_refs[ends["a"]] == kv.pool.win_refs[ends["b"]] == 1  # the tree's alone
    pos = 32
    while kv.pool.has_window(ends["a"]) and kv.pool.has_window(ends["b"]):
        assert _compute(kv, "a2", turn["a"], pos, pos + 4, 4), "the pool filled before shedding"
        pos += 4
    assert kv.pool.has_window(ends["a"]) and not kv.pool.has_window(ends["b"])
    _windows_held(kv)
