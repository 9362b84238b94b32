"""`trajserve simulate` end to end: JSON, goodput, plot, cache-size sweep,
calibrated profiles, trace workloads and --validate against a measurement
file (no model is loaded anywhere in this file)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from trajserve.bench.replay import replay
from trajserve.cli import main
from trajserve.config import SchedulerConfig
from trajserve.plan.catalog import get_model
from trajserve.sim.hardware import PROFILE_KIND, ModelCost

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"


def simulate(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(["simulate", *argv, "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


def test_commands_are_registered():
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--help"])
    assert e.value.code == 0
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])


def test_chat_summary_goodput_and_plot(capsys, tmp_path):
    png = tmp_path / "u.png"
    res = simulate(capsys, "--workload", "chat", "--num-requests", "60", "--input-len", "2048", "--output-len",
                   "64", "--prefix-len", "1024", "--rate", "20", "--slo", "ttft:200", "tpot:30", "--plot", str(png))
    s = res["summary"]
    assert s["calls"] == 60 and s["output_tokens"] == 60 * 64
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        assert d["p50"] <= d["p90"] <= d["p99"]
    assert s["goodput"]["slo_ms"] == {"ttft": 200.0, "tpot": 30.0}
    assert 0 <= s["goodput"]["requests_per_s"] <= s["throughput"]["requests_per_s"]
    # 1,024 of 2,048 prompt tokens are shared: H_prefix approaches 1/2, never above.
    assert 0.3 < s["prefix_hit_rate"] <= 0.5
    assert s["prefix_hit_rate"] == pytest.approx(s["cached_tokens"] / s["prompt_tokens"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["setup"]["num_blocks"] == 97_291  # 8 x H100, Llama-3-70B: eqs. 3-5 through trajserve.plan


def test_cache_blocks_sweep_is_sorted_and_bigger_pools_hit_more(capsys, tmp_path):
    flags = ["--workload", "agent", "--trajectories", "12", "--turns", "4", "--preamble-tokens", "2000",
             "--tool-min-tokens", "500", "--tool-max-tokens", "1500", "--reply-tokens", "50",
             "--tool-wait", "exp:3", "--rate", "2", "--cache-blocks", "6000,1500,3000"]
    # The device cache alone (no pause announced): what survives is what fits.
    png = tmp_path / "sweep.png"
    res = simulate(capsys, *flags, "--keep-policy", "cache", "--sweep-plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = res["sweep"]
    assert [r["num_blocks"] for r in rows] == [1500, 3000, 6000]
    hits = [r["hit_rate"] for r in rows]
    assert hits == sorted(hits) and hits[-1] > hits[0]
    assert "summary" not in res  # a sweep alone runs only the sweep
    # With the keep policy, paused state the small pool cannot hold waits on
    # the host tier and comes back: the small pool hits as the large one does.
    policy = [r["hit_rate"] for r in simulate(capsys, *flags)["sweep"]]
    assert policy[0] > hits[0] and policy[0] == pytest.approx(hits[-1])
    capsys.readouterr()
    assert main(["simulate", "--sweep-plot", str(png), "--json", "--no-progress"]) != 0
    assert "--sweep-plot needs --cache-blocks" in capsys.readouterr().err
    # A size too small for any call is a row that says so; the rest of the sweep stands (it was lost).
    rows = simulate(capsys, "--trajectories", "4", "--turns", "2", "--cache-blocks", "100,4000",
                    "--sweep-plot", str(png))["sweep"]
    assert "no call finished" in rows[0]["error"] and rows[0]["rejected"] == 4
    assert rows[1]["num_blocks"] == 4000 and rows[1]["hit_rate"] > 0


def test_agent_branching_reports_per_turn(capsys):
    res = simulate(capsys, "--trajectories", "4", "--turns", "3", "--preamble-tokens", "1000", "--reply-tokens", "20",
                   "--tool-min-tokens", "100", "--tool-max-tokens", "200", "--tool-wait", "const:1",
                   "--branching", "2", "--branch-turn", "2")
    s = res["summary"]
    assert s["sequences"] == 4 + 4 * 2 + 4 * 2 and s["calls"] == 4 + 4 + 8
    assert s["cow_copies"] > 0
    assert [t["turn"] for t in res["per_turn"]] == [1, 2, 3]


def profile_doc() -> dict:
    m = ModelCost.from_spec(get_model("smollm2-135m"), 1, "fp32", "fp32")
    return {"kind": PROFILE_KIND, "version": 1,
            "device": {"name": "test cpu", "peak_flops": 40e9, "attention_flops": 10e9, "bandwidth": 18e9,
                       "kv_bandwidth": 3e9, "fixed_overhead_s": 0.02, "per_seq_overhead_s": 0.002,
                       "host_link_bandwidth": 7e9, "nvme_bandwidth": 2e8, "memory_bytes": 8e9},
            "model": m.to_profile(), "engine": {"memory_fraction": 0.25}, "fit": {"median_abs_rel_error": 0.05}}


def test_profile_replaces_catalog_hardware_and_model(capsys, tmp_path):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(profile_doc()))
    res = simulate(capsys, "--profile", str(prof), "--workload", "chat", "--num-requests", "10",
                   "--input-len", "256", "--output-len", "4")
    st = res["setup"]
    assert st["model"] == "SmolLM2-135M" and st["peak_flops"] == 40e9 and st["mfu"] == 1.0
    assert st["per_seq_overhead_s"] == 0.002
    # Pool: 25% of the profiled 8 GB over m_token (46,080 B of fp32 KV) x 16 tokens.
    assert st["num_blocks"] == int(2e9 // (46_080 * 16))
    # One 256-token prefill, alone: t_fixed + t_seq + matmul FLOPs / P (compute-bound at this size).
    one = simulate(capsys, "--profile", str(prof), "--workload", "chat", "--num-requests", "1",
                   "--input-len", "256", "--output-len", "1")
    m = ModelCost.from_spec(get_model("smollm2-135m"), 1, "fp32", "fp32")
    flops_s = (2 * m.matmul_params * 256 + 2 * m.head_params) / 40e9 + 4 * 30 * 576 * (256 * 257 // 2) / 10e9
    assert one["summary"]["ttft_ms"]["p50"] == pytest.approx((0.02 + 0.002 + flops_s) * 1e3, rel=1e-9)


def agent_requests():
    """2 trajectories x 3 turns with a shared 100-token preamble, as bench agent sends them."""
    pre = list(range(1000, 1100))
    reqs, hist = [], {}
    nxt = 5000
    for turn in (1, 2, 3):
        for i in (0, 1):
            new = list(range(nxt, nxt + 37))
            nxt += 37
            prompt = (pre + new) if turn == 1 else hist[i] + new
            outs = list(range(nxt, nxt + 9))
            nxt += 9
            hist[i] = prompt + outs
            reqs.append({"turn": turn, "trajectory": i, "prompt_ids": prompt, "output_ids": outs})
    res = replay([(r["prompt_ids"], r["output_ids"]) for r in reqs], 400, 16, SchedulerConfig(64, 512, 512))
    for r, c in zip(reqs, res.cached_tokens):
        n = len(r["prompt_ids"])
        r.update(prompt_tokens=n, cached_tokens=c, output_tokens=len(r["output_ids"]), ttft_s=0.05 + 0.001 * (n - c))
    return reqs


def test_validate_against_a_saved_measurement_reproduces_the_hits(capsys, tmp_path):
    prof, meas = tmp_path / "p.json", tmp_path / "m.json"
    prof.write_text(json.dumps(profile_doc()))
    reqs = agent_requests()
    meas.write_text(json.dumps({"kind": "trajserve-agent-measurement", "command": "test",
                                "engine": {"block_size": 16, "num_blocks": 400, "max_num_batched_tokens": 512,
                                           "max_prefill_chunk": 512, "max_num_seqs": 64},
                                "config": {"reply_tokens": 9}, "wall_s": 2.0, "busy_s": 1.5, "requests": reqs}))
    res = simulate(capsys, "--validate", "--measured", str(meas), "--profile", str(prof))
    assert res["hits_reproduced"]
    rows = {r["metric"]: r for r in res["rows"]}
    assert rows["engine busy time (makespan)"]["measured"] == 1.5
    assert rows["engine busy time (makespan)"]["predicted"] > 0
    hit = rows["prefix hit rate (eq. 2)"]
    assert hit["predicted"] == pytest.approx(hit["measured"]) and hit["measured"] > 0.4
    assert [t["turn"] for t in res["per_turn"]] == [1, 2, 3]

    # bench agent's own JSON carries no token ids: prompts are rebuilt from the
    # cached counts, so the predicted hit rate still equals the measured one.
    bench = {"command": "trajserve bench agent", "block_size": 16, "num_blocks": 400, "reply_tokens": 9,
             "requests": [{k: v for k, v in r.items() if not k.endswith("_ids") and k != "output_tokens"}
                          for r in reqs]}
    meas.write_text(json.dumps(bench))
    res = simulate(capsys, "--validate", "--measured", str(meas), "--profile", str(prof))
    rows = {r["metric"]: r for r in res["rows"]}
    assert rows["prefix hit rate (eq. 2)"]["predicted"] == pytest.approx(rows["prefix hit rate (eq. 2)"]["measured"])
    assert rows["engine busy time (makespan)"]["measured"] is None  # not in bench agent's file
    assert res["hits_reproduced"]


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"traces not found at {TRACES}")
def test_trace_workloads_from_the_command_line(capsys):
    res = simulate(capsys, "--workload", "claude-code", "--trace", str(TRACES / "claude-code" / "trace_0016.json"))
    assert res["summary"]["calls"] > 10 and res["summary"]["prefix_hit_rate"] > 0.5
    res = simulate(capsys, "--workload", "mooncake", "--num-requests", "50", "--time-scale", "0.5")
    assert res["summary"]["calls"] == 50


def test_bad_arguments_fail_cleanly(capsys, tmp_path):
    assert main(["simulate", "--gpu", "tpu-v9", "--json", "--no-progress"]) == 2
    assert main(["simulate", "--slo", "ttft:-1", "--json", "--no-progress"]) == 2
    assert main(["simulate", "--tool-wait", "gauss:3", "--json", "--no-progress"]) == 2
    assert main(["simulate", "--validate", "--measured", "/nonexistent.json", "--json", "--no-progress"]) == 2
    # 0 used to read as "not given" and run the default 1,000 requests.
    assert main(["simulate", "--workload", "chat", "--num-requests", "0", "--json", "--no-progress"]) == 2
    assert main(["simulate", "--max-prefill-chunk", "0", "--json", "--no-progress"]) == 2
    assert main(["simulate", "--turns", "3", "--branching", "2", "--branch-turn", "4", "--json",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown gpu" in err and "--slo" in err and "tool wait" in err
    assert "--num-requests must be >= 1, got 0" in err
    assert "--max-prefill-chunk must be >= 1 (unset: the token budget), got 0" in err
    assert "branch turn 4 is past the last turn (3)" in err
    # These ran for ever (a NaN rate, no sequence slots) or ran ignoring the value.
    for bad in (["--rate", "nan"], ["--max-num-seqs", "0"], ["--watermark", "2"], ["--seed", "-1"],
                ["--max-num-batched-tokens", "-5"], ["--save-measured", "x.json"],
                ["--plot", "/nonexistent/dir/u.png"], ["--workload", "chat"],
                ["--validate", "--cache-blocks", "100,200"]):
        capsys.readouterr()
        assert main(["simulate", "--trajectories", "2", "--turns", "1", *bad, "--json", "--no-progress"]) == 2
        assert bad[0] in capsys.readouterr().err, bad
    trace = tmp_path / "t.json"
    trace.write_text("{}")  # was a KeyError
    assert main(["simulate", "--workload", "claude-code", "--trace", str(trace), "--json", "--no-progress"]) == 2
    assert "is not a Claude Code trace: it lacks id, block_size, requests" in capsys.readouterr().err
