"""mla_attention.c, latent attention's decode rows over the paged pool, on
every build this CPU runs: against a float64 softmax over the same rows
(float32 and bf16 pools, block sizes under, at and over its 64-key parts,
heads that do not fill its 4-head tasks), a row's bits the same alone and
in any batch, and what it cannot take refused."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajserve.model import cpu_kernels
from trajserve.model.attention import AttentionMetadata, PrefillSeq
from trajserve.model.mla import head_products, latent_attention

ISAS = cpu_kernels.supported_isas()
BUILDS = {isa: cpu_kernels.load(isa) for isa in ISAS}


def _meta(rows: list[tuple[int, int]], tables: list[list[int]]) -> AttentionMetadata:
    """Decode rows only: row i is query row rows[i][0], its context rows[i][1], its blocks tables[i]."""
    flat = [b for t in tables for b in t]
    starts, n = [], 0
    for t in tables:
        starts.append(n)
        n += len(t)
    ix = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return AttentionMetadata(None, None, ix([r for r, _ in rows]), None, None, None, len(rows), [],
                             dec_tables=ix(flat), dec_table_start=ix(starts), dec_ctx=ix([c for _, c in rows]))


def _reference(q: torch.Tensor, keys: torch.Tensor, scale: float, dv: int) -> torch.Tensor:
    """[H, dv] in float64: softmax(scale q . k) over the rows, weighing their first dv values."""
    q64, k64 = q.double(), keys.double()
    p = torch.softmax(scale * q64 @ k64.T, dim=-1)
    return p @ k64[:, :dv]


def _pool(blocks: int, bs: int, dk: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(blocks, 1, bs, dk, generator=g).to(dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=12, deadline=None)
@given(ctxs=st.lists(st.integers(1, 300), min_size=1, max_size=4), bs=st.sampled_from([4, 16, 100]),
       heads=st.integers(1, 9), rope=st.sampled_from([8, 64]), rank=st.sampled_from([32, 512]),
       seed=st.integers(0, 2**16))
def test_latent_attention_matches_a_float64_softmax(isa, dtype, ctxs, bs, heads, rope, rank, seed):
    K = BUILDS[isa]
    dk = rank + rope
    need = [-(-c // bs) for c in ctxs]
    pool = _pool(sum(need) + 2, bs, dk, dtype, seed)
    perm = torch.randperm(sum(need) + 2, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    tables, at = [], 0
    for n in need:  # each sequence's blocks scattered over the pool
        tables.append(perm[at:at + n])
        at += n
    q = torch.randn(len(ctxs), heads, dk, generator=torch.Generator().manual_seed(seed + 2))
    scale = dk ** -0.5
    out = latent_attention(K, q, pool, _meta([(i, c) for i, c in enumerate(ctxs)], tables), scale, rank)
    assert out.shape == (len(ctxs), heads, rank)
    for i, c in enumerate(ctxs):
        keys = pool[tables[i]].reshape(-1, dk)[:c].float()  # what the pool holds, as float32
        want = _reference(q[i], keys, scale, rank)
        err = (out[i].double() - want).abs().max().item()
        assert err < 2e-5 * max(1.0, want.abs().max().item()), (i, c, err)


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(isa):
    """A row's arithmetic is its own: 40 rows at consecutive positions of
    one sequence at once (as a chunk's would be), one of them alone, and
    beside other sequences' rows give it the same bits."""
    K = BUILDS[isa]
    bs, dk, rank, heads = 16, 72, 64, 6
    pool = _pool(12, bs, dk, torch.float32, 0)
    table = [7, 2, 9, 0, 5]  # 80 slots
    q = torch.randn(40, heads, dk, generator=torch.Generator().manual_seed(3))
    chunk = latent_attention(K, q, pool, _meta([(j, 31 + j) for j in range(40)], [table] * 40), 0.1, rank)
    for j in (0, 17, 39):
        alone = latent_attention(K, q[j:j + 1].contiguous(), pool, _meta([(0, 31 + j)], [table]), 0.1, rank)
        mixed = torch.stack([q[5], q[j], q[11]])
        batch = latent_attention(K, mixed, pool, _meta([(0, 12), (1, 31 + j), (2, 64)], [[3], table, [1, 4, 6, 8]]),
                                 0.1, rank)
        assert torch.equal(alone[0], chunk[j]) and torch.equal(batch[1], chunk[j])
    # the same 40 rows as a prefill chunk (a verified draft's rows), beside a decode row: each over its causal prefix
    prefill = AttentionMetadata(None, None, torch.tensor([0]), None, None, None, 1,
                                [PrefillSeq(1, 40, 70, torch.tensor(table))], dec_tables=torch.tensor([3]),
                                dec_table_start=torch.tensor([0]), dec_ctx=torch.tensor([12]))
    both = latent_attention(K, torch.cat([q[5:6], q]), pool, prefill, 0.1, rank)
    assert torch.equal(both[1:], chunk)


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 20), heads=st.integers(1, 5), k=st.sampled_from([8, 128, 130]),
       n=st.sampled_from([16, 40, 512]), seed=st.integers(0, 2**16))
def test_head_products_match_float64_and_do_not_depend_on_the_rows(isa, rows, heads, k, n, seed):
    """ts_linear_heads: out[t, h] = x[t, h, :k] @ w_h^T for every head, read
    from rows wider than k; a row's bits are the same alone."""
    K = BUILDS[isa]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, heads, k + 3, generator=g)  # the last 3 values of a head are not read
    w = torch.randn(heads, n, k, generator=g)
    panels = torch.cat([cpu_kernels.pack(w[h]) for h in range(heads)])
    out = torch.empty(rows, heads, n)
    head_products(K, x, k, panels, n, out)
    want = torch.einsum("thk,hnk->thn", x[..., :k].double(), w.double())
    assert (out.double() - want).abs().max().item() < 1e-4 * max(1.0, k ** 0.5)
    last = torch.empty(1, heads, n)
    head_products(K, x[-1:], k, panels, n, last)
    assert torch.equal(last[0], out[-1])
    with pytest.raises(ValueError, match="do not match panels"):
        head_products(K, x, k + 1, panels, n, out)


@pytest.mark.parametrize("isa", ISAS)
def test_what_the_kernel_cannot_take_is_refused(isa):
    K = BUILDS[isa]
    meta = _meta([(0, 3)], [[0]])
    with pytest.raises(ValueError, match="past the kernel's widths"):
        latent_attention(K, torch.randn(1, 2, 1200), _pool(1, 4, 1200, torch.float32, 0), meta, 1.0, 1100)
    with pytest.raises(TypeError, match="contiguous float32"):
        latent_attention(K, torch.randn(1, 2, 40).half(), _pool(1, 4, 40, torch.float32, 0), meta, 1.0, 32)
    with pytest.raises(TypeError, match="contiguous float32"):
        latent_attention(K, torch.randn(1, 2, 40), _pool(1, 4, 40, torch.float16, 0), meta, 1.0, 32)


def test_bench_latent_reports_both_paths_and_their_agreement(capsys):
    from trajserve.cli import main

    assert main(["bench", "latent", "--heads", "5", "--rank", "32", "--rope", "8", "--batch", "1,3",
                 "--context", "40", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["batch"], r["context"]) for r in report["rows"]] == [(1, 40), (3, 40)]
    for r in report["rows"]:
        assert r["torch_ms"] > 0 and r["kernel_ms"] > 0 and r["speedup"] == r["torch_ms"] / r["kernel_ms"]
        assert r["max_abs_diff"] < 1e-5  # the same attention both ways
