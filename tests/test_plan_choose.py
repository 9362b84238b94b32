"""`trajserve plan choose` (plan/choose.py) on the chapter's closing
question (inference-optimization 8.6.3) and exercise 8-9's configuration E:
16 requests of 8,192 input tokens (6,144 shared) and 256 output tokens,
arriving together, within 7 s and 12 GiB for KV and auxiliary buffers, on
the RTX PRO 6000 / Qwen3-8B instance."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from trajserve.plan.catalog import get_device, get_model
from trajserve.plan.choose import candidates, choose

GiB, MiB = 1 << 30, 1 << 20


def _by_name(memory=12 * GiB, deadline=7.0, output=256):
    cands = candidates(get_model("qwen3-8b"), get_device("rtx-pro-6000"), 16, 8192, 6144, output, memory, deadline)
    return {x.name: x for x in cands}, choose(cands)


def test_the_chapters_figures_and_its_choice():
    c, chosen = _by_name()
    assert c["A"].memory_bytes == 19_008 * MiB and not c["A"].fits
    assert round(c["B"].time_s, 2) == 9.01 and round(c["B"].memory_bytes / GiB, 2) == 5.91 and not c["B"].on_time
    assert round(c["C"].time_s, 2) == 14.55 and round(c["C"].memory_bytes / GiB, 2) == 9.86
    assert round(c["D"].time_s, 2) == 4.56 and round(c["D"].memory_bytes / GiB, 2) == 9.02
    # E: B's memory and prefill, 2 tokens a round over 128 rounds of 27.35 + 0.1 ms.
    assert round(c["E"].time_s, 2) == 5.55 and c["E"].memory_bytes == c["B"].memory_bytes
    assert round(c["D"].gpu_s_per_good, 3) == 0.285 and math.isinf(c["B"].gpu_s_per_good)
    assert chosen.name == "D"  # D and E both fit and are on time; D takes less GPU time per good result


def test_six_gib_leaves_only_the_lookup_drafts():
    c, chosen = _by_name(memory=6 * GiB)
    assert [x for x in "ABCDE" if c[x].fits] == ["B", "E"] and not c["B"].on_time
    assert chosen.name == "E"


def test_sixteen_token_outputs():
    c, chosen = _by_name(output=16)
    assert [round(c[x].time_s, 2) for x in "BDE"] == [2.45, 2.37, 2.26]
    assert chosen.name == "E"


def test_nothing_on_time_chooses_nothing():
    _, chosen = _by_name(deadline=1.0)
    assert chosen is None


def test_a_shared_prefix_longer_than_the_input_is_refused():
    with pytest.raises(ValueError, match="shared prefix"):
        candidates(get_model("qwen3-8b"), get_device("rtx-pro-6000"), 16, 100, 200, 16, GiB, 7.0)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "trajserve.cli", "plan", "choose", *args], capture_output=True,
                          text=True, timeout=120)


def test_the_command_prints_the_table_and_json():
    r = _cli("--requests", "16", "--input", "8192", "--shared-prefix", "6144", "--output", "256",
             "--deadline", "7s", "--memory", "6GiB")
    assert r.returncode == 0, r.stderr
    assert "chosen: E" in r.stdout and "does not fit" in r.stdout
    js = json.loads(_cli("--json").stdout)
    assert js["chosen"] == "D" and [x["name"] for x in js["candidates"]] == list("ABCDE")
    bad = _cli("--deadline", "-3s")
    assert bad.returncode == 2 and "--deadline" in bad.stderr
