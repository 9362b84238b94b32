"""`trajserve bench lora` runs end to end (its figures are docs/benchmarks.md's,
not asserted here): the cases, each repeatable, the adapters written
and loaded, an on-demand load measured."""
from __future__ import annotations

import json

from trajserve.cli import main
from trajserve.model.cpu_kernels import load as load_kernels


def test_bench_lora_runs_every_case(capsys):
    capsys.readouterr()
    assert main(["bench", "lora", "--rounds", "1", "--max-tokens", "4", "--requests", "4", "--adapters", "2",
                 "--rank", "4", "--num-blocks", "256", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    # lora-vector: where bf16 adapters run on AVX512-BF16 dot products, the vector path beside them.
    k = load_kernels()
    dp = k is not None and k.lora_dp
    assert [c["name"] for c in r["cases"]] == ["base", "lora", "lora-torch"] + (["lora-vector"] if dp else [])
    assert all(c["repeatable"] and c["decode_step_ms"] > 0 for c in r["cases"])
    assert r["cases"][0]["step_ratio"] == 1.0 and r["targets"] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert r["on_demand"]["cold_loads"] >= 1 and r["on_demand"]["slot_load_ms"] > 0
