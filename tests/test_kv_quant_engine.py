"""q8_0 / q4_0 KV pools in the engine: capacity for the same memory, forks
(copy-on-write of quantized blocks), the host and disk tiers carrying the
quantized bytes as they are, and each format's blocks never read by an
engine of another. The per-format invariances of chunking, caching,
batching and preemption run in test_engine_invariance.py."""
from __future__ import annotations

import pytest
import torch

from trajserve.config import CacheConfig, EngineConfig
from trajserve.engine.dtype import resolve_kv_dtype
from trajserve.engine.engine import LLMEngine
from trajserve.kv.scope import CacheScope
from trajserve.sampling import SamplingParams

QFORMATS = ["q8_0", "q4_0"]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
SYSTEM = ("You are a coding agent. Tools: read_file(path), write_file(path, text), run(cmd). "
          "Always explain the plan before calling a tool. ") * 3


def run(engine, ids, sp=GREEDY):
    rid = engine.add_request(ids, sp)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done[rid]


def test_the_same_memory_holds_1_85x_and_3_4x_the_tokens_of_bf16():
    budget = 64 << 20
    engines = {kv: LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory=budget,
                                                                             kv_cache_dtype=kv)))
               for kv in ("bfloat16", "q8_0", "q4_0")}
    cap = {kv: e.kv.token_capacity for kv, e in engines.items()}
    assert cap["q8_0"] / cap["bfloat16"] >= 1.85 and cap["q4_0"] / cap["bfloat16"] >= 3.4
    q8 = engines["q8_0"]
    assert "KV cache: q8_0" in q8.startup_summary and "m_token = 12,240 B" in q8.startup_summary
    k, v = q8.runner.kv_caches[0]
    assert k.dtype == torch.uint8 and k.shape[-1] == 68 and k.shape == v.shape
    # the bytes the pool holds are what the pricing and the planner count
    assert sum(t.numel() for kv in q8.runner.kv_caches for t in kv) == q8.num_blocks * 16 * 12_240


def test_a_head_dim_the_groups_do_not_divide_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"kv_cache_dtype \(--kv-cache-dtype\) q4_0 needs head_dim a multiple of 32"):
        resolve_kv_dtype("q4_0", torch.float32, None, head_dim=48)
    fmt, why = resolve_kv_dtype("q8_0", torch.bfloat16, None, head_dim=64)
    assert fmt.name == "q8_0" and "torch's attention" in why


@pytest.fixture(scope="module", params=QFORMATS)
def fmt(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(fmt):
    """The same format, no prefix cache, no tiers: what every path must give."""
    return LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=256, kv_cache_dtype=fmt,
                                                                     enable_prefix_caching=False)))


def test_fork_mid_decode_greedy_branches_give_the_unforked_tokens(fmt, reference):
    eng = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=128, kv_cache_dtype=fmt)))
    ids = eng.tokenizer.encode("The history of the printing press begins in")
    ref = run(reference, ids).outputs[0].token_ids
    rid = eng.add_request(ids, GREEDY)
    while len(eng.groups[rid].completions[0].token_ids) < 5:
        eng.step()
    assert eng.groups[rid].seqs[0].num_computed_tokens % eng.kv.block_size, "fork point should leave a partial tail"
    copies = eng.metrics()["cow_copies"]
    (child,) = eng.fork(rid, 1)
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.metrics()["cow_copies"] > copies  # the shared tail's quantized bytes were copied
    assert outs[rid].outputs[0].token_ids == ref and outs[child].outputs[0].token_ids == ref


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_conversation_resumes_from_a_lower_tier_with_the_formats_tokens(fmt, reference, tier, tmp_path):
    cache = CacheConfig(num_blocks=24, watermark=0.0, kv_cache_dtype=fmt,
                        host_cache_bytes=16 << 20 if tier == "host" else 0,
                        disk_cache_bytes=16 << 20 if tier == "disk" else 0, disk_cache_dir=str(tmp_path))
    eng = LLMEngine(EngineConfig(dtype="float32", cache=cache))
    tok = eng.tokenizer
    turn1 = tok.encode(SYSTEM + " Task: list the files.")
    history = turn1 + list(run(eng, turn1).outputs[0].token_ids)
    for k in range(3):  # other traffic pushes turn 1 out of the 24-block pool
        run(eng, tok.encode(f"Unrelated request number {k}: " + "summarize the weather report. " * 30))
    assert eng.kv.cached_prefix(history, CacheScope()).num_tokens < 64
    turn2 = history + tok.encode(" Now open main.py.")
    out = run(eng, turn2)
    assert out.outputs[0].token_ids == run(reference, turn2).outputs[0].token_ids
    low = eng.metrics()["lower_tiers"]
    assert (low["loaded_host_blocks"] if tier == "host" else low["loaded_disk_blocks"]) > 0
    assert out.num_cached_tokens >= (len(history) - 1) // 16 * 16 - 16
    if tier == "disk":
        eng.lower.flush()
        files = list(tmp_path.glob("*.kv"))
        layout = eng.block_layout
        assert layout.dtype == fmt + "+h32" and layout.shape[-1] == (68 if fmt == "q8_0" else 36)
        assert all(f.stat().st_size == layout.file_bytes for f in files)
    eng.close()


def test_blocks_of_one_format_are_never_read_by_another(tmp_path):
    cache = dict(num_blocks=64, disk_cache_bytes=16 << 20, disk_cache_dir=str(tmp_path))
    eng = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_dtype="q8_0", **cache)))
    run(eng, eng.tokenizer.encode(SYSTEM + " Task: list the files."))
    eng.close()  # writes the device tree down to the disk dir
    assert list(tmp_path.glob("*.kv"))
    other = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_dtype="q4_0", **cache)))
    assert other.metrics()["lower_tiers"]["restored_blocks"] == 0 and not list(tmp_path.glob("*.kv"))
    other.close()


@pytest.mark.parametrize("kv,plan_kv", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("bfloat16", "bf16")])
def test_plan_and_the_engine_agree_on_block_bytes_and_capacity(kv, plan_kv):
    """`plan --kv-dtype q8_0` on this machine's CPU and an engine given the
    pool the plan leaves (--kv-cache-memory): the same bytes per block and
    the same token capacity (one definition of a format's size)."""
    import argparse

    from trajserve.plan import plan
    from trajserve.commands.plan import add_plan_parser, request_from

    p = argparse.ArgumentParser()
    add_plan_parser(p)
    req = request_from(p.parse_args(["--model", "smollm2-135m", "--gpu", "cpu-local", "--gpu-memory", "1GiB",
                                     "--reserve", "0", "--headroom", "0", "--kv-dtype", plan_kv,
                                     "--weight-dtype", "fp32", "--context", "3000"]))
    result = plan(req)
    eng = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory=int(result.kv_pool_per_device),
                                                                     kv_cache_dtype=kv)))
    from trajserve.engine.memory import bytes_per_block

    assert bytes_per_block(eng.model_config, 16, eng.kv_format) == result.block_bytes_device
    # The engine's one figure, and the bytes a block's copy on a tier holds.
    assert eng.block_bytes == result.block_bytes_device == eng.block_layout.payload_bytes
    assert eng.kv.token_capacity == result.token_capacity


def test_kv_agreement_bench_on_its_two_shortest_prompts(capsys):
    """`bench kv-agreement` end to end on the 200- and 386-token prompts:
    every row reported, and q8_0 K/V moving the next-token distributions by
    a KL well under the issue's 0.01 (0.0003-0.0005 measured)."""
    import argparse
    import json

    from trajserve.bench.kv_agreement import TOKENS, run

    assert run(argparse.Namespace(model=None, kv_cache_dtype="q8_0", quantization="none", prompts=2, num_blocks=128,
                                  json=True)) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["prompt_tokens"] for r in out["rows"]] == [200, 386]
    assert out["kv_dtype"] == "q8_0" and out["reference_kv_dtype"] == "float32"
    assert all(0 <= r["identical_tokens"] <= TOKENS and -1e-6 <= r["mean_kl"] < 0.01 for r in out["rows"])
    assert out["summary"]["mean_kl"] < 0.01
    for r in out["rows"]:  # a gap where the continuations part, and float32 chose its own argmax there
        assert (r["divergence_gap"] is None) == (r["identical_tokens"] == TOKENS)
        assert r["divergence_gap"] is None or r["divergence_gap"] >= 0
    with pytest.raises(ValueError, match="--prompts must be 1 to 16"):
        run(argparse.Namespace(model=None, kv_cache_dtype="q8_0", quantization="none", prompts=0, num_blocks=128,
                               json=True))


@pytest.mark.parametrize("decision", ["host", "disk"])
def test_a_session_paused_to_host_or_disk_resumes_with_the_formats_tokens(fmt, decision, tmp_path):
    """Session offload moves a quantized pool's blocks as bytes (its block
    bytes from the format): pause to host or disk, resume, same tokens as
    the same session never paused."""
    from test_sessions import two_turns

    from trajserve.sessions.config import SessionConfig
    from trajserve.sessions.manager import SessionManager

    eng = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=256, kv_cache_dtype=fmt)))
    mgr = SessionManager(eng, SessionConfig(disk_dir=str(tmp_path / "kv")))
    try:
        assert mgr.offload.block_bytes == 16 * eng.kv_format.bytes_per_token(eng.model_config)
        ref_first, ref_second, _ = two_turns(mgr, "Fix the failing test.")
        eng.kv.clear_cache()
        first, second, (d, before, after) = two_turns(mgr, "Fix the failing test.", pause=decision)
        assert d.decision.value == decision and after < before
        assert first.outputs[0].token_ids == ref_first.outputs[0].token_ids
        assert second.outputs[0].token_ids == ref_second.outputs[0].token_ids
        assert second.num_cached_tokens >= before and mgr.stats.swap_in_bytes > 0
    finally:
        mgr.shutdown()
