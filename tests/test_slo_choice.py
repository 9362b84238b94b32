"""`trajserve serve --slo` (server/slo_choice.py): the candidates of `plan
choose` (inference-optimization 8.6.3) priced from this engine's fitted step
times, the choice made, and the engine built as the choice says."""
from __future__ import annotations

import math
import re

import pytest

from trajserve.cli import build_parser, main
from trajserve.plan.catalog import get_device, get_model
from trajserve.plan.choose import candidates
from trajserve.server.slo_choice import (APPLIED, CALIBRATION_SALT, build_for_slo, calibrate, measured_b,
                                         parse_slo, price, runs_as)

# Four requests of 512 tokens, 128 shared: the shared prefix saves little, so
# q8_0 with separate contexts (C) needs less memory than the pool's format
# shared (B) for a float32 or bfloat16 pool.
SLO = "requests=4,input=512,shared=128,output=16,deadline=10000s"


def _args(slo: str = SLO, *more: str):
    return build_parser().parse_args(["serve", "--slo", slo, "--num-blocks", "512", *more])


@pytest.fixture(scope="module")
def calibrated():
    from trajserve.llm import LLM

    args = _args()
    engine = LLM.from_args(args).engine
    ran = calibrate(engine, args.slo)
    yield engine, args.slo, ran
    engine.close()


# ------------------------------------------------------------------ parsing
def test_a_full_slo_parses():
    w = parse_slo("requests=16,input=8192,shared=6144,output=256,deadline=7s,memory=12GiB,lookup=2.5,drafts=3")
    assert (w.requests, w.input, w.shared, w.output, w.deadline_s) == (16, 8192, 6144, 256, 7.0)
    assert (w.memory_bytes, w.lookup, w.drafts) == (12 << 30, 2.5, 3)
    assert parse_slo(SLO).memory_bytes is None  # the pool's bytes


@pytest.mark.parametrize("text, names", [
    ("requests=4,input=512,shared=128,output=16", "deadline"),
    ("requests=0,input=512,shared=128,output=16,deadline=1", "requests"),
    ("requests=four,input=512,shared=128,output=16,deadline=1", "requests"),
    ("requests=4,input=512,shared=128,output=16,deadline=nan", "deadline"),
    ("requests=4,input=512,shared=128,output=16,deadline=-1s", "deadline"),
    ("requests=4,input=512,shared=128,output=16,deadline=1e9", "deadline"),
    ("requests=4,input=512,shared=512,output=16,deadline=1", "shared"),
    ("requests=4,input=512,shared=-1,output=16,deadline=1", "shared"),
    ("requests=4,input=512,shared=128,output=0,deadline=1", "output"),
    ("requests=4,input=512,shared=128,output=16,deadline=1,lookup=inf", "lookup"),
    ("requests=4,input=512,shared=128,output=16,deadline=1,drafts=0", "drafts"),
    ("requests=4,input=512,shared=128,output=16,deadline=1,memory=lots", "memory"),
    ("requests=4,input=512,shared=128,output=16,deadline=1,memory=0", "memory"),
    ("requests=4,input=512,shared=128,output=16,deadline=1,speed=9", "requests=N"),
    ("requests=4,requests=5,input=512,shared=128,output=16,deadline=1", "twice"),
])
def test_a_bad_slo_names_the_field(text, names):
    with pytest.raises(ValueError, match=names):
        parse_slo(text)


def test_the_command_line_refuses_a_bad_slo_before_loading_anything(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--slo", "requests=4,input=512,shared=128,output=16,deadline=0"])
    assert e.value.code == 2 and "--slo deadline must be > 0" in capsys.readouterr().err
    assert main(["serve", "--slo", SLO, "--replicas", "2"]) == 2
    assert "does not take --replicas" in capsys.readouterr().err


# ------------------------------------------------------- the candidates' inputs
def test_the_pool_format_and_no_draft_model_change_only_what_they_should():
    model, device = get_model("qwen3-8b"), get_device("rtx-pro-6000")
    bf16 = {x.name: x for x in candidates(model, device, 16, 8192, 6144, 256, 12 << 30, 7.0)}
    fp32 = {x.name: x for x in candidates(model, device, 16, 8192, 6144, 256, 12 << 30, 7.0, kv_format="fp32",
                                          draft=False)}
    assert "D" not in fp32 and set(bf16) == set("ABCDE")
    assert fp32["B"].memory_bytes == 2 * bf16["B"].memory_bytes and fp32["B"].time_s == bf16["B"].time_s
    # C stores q8_0 either way; its round, interpolated in rounds measured at a pool twice as wide, is shorter.
    assert fp32["C"].memory_bytes == bf16["C"].memory_bytes and fp32["C"].time_s < bf16["C"].time_s
    assert fp32["B"].what.startswith("fp32 KV")


def test_calibration_fits_the_step_times_and_leaves_no_cache_behind(calibrated):
    engine, w, ran = calibrated
    assert engine.deadlines.steps.ready and ran["steps"] >= 16 and ran["requests"] == 4
    assert 0 < ran["shared"] < ran["prompt"] <= 256
    assert engine.invalidate(cache_salt=CALIBRATION_SALT) == 0  # its namespace was dropped whole
    assert not engine.has_unfinished_requests()


def test_b_is_priced_from_the_fit_and_b_runs_its_rounds(calibrated):
    engine, w, _ = calibrated
    m = measured_b(engine, w)
    assert m.shared_prefill_s > m.shared_round_s > 0
    # The model is linear and no coefficient is negative: twice the batch never costs less.
    assert m.rounds[2 * w.requests] >= m.rounds[w.requests] >= m.rounds[1] > 0
    cands, chosen, memory = price(engine, w)
    by = {x.name: x for x in cands}
    assert set(by) == {"A", "B", "C", "E"}  # no draft model here
    assert by["B"].time_s == pytest.approx(m.shared_prefill_s + (w.output - 1) * m.shared_round_s)
    assert by["E"].time_s == pytest.approx(
        m.shared_prefill_s + math.ceil((w.output - 1) / w.lookup) * (m.shared_round_s + m.lookup_round_extra_s))
    assert memory == engine.num_blocks * engine.block_bytes
    assert chosen is not None and chosen.name in APPLIED


def _memory_for_c(engine, w):
    """Bytes that hold C's KV and none of the others'."""
    by = {x.name: x for x in price(engine, w)[0]}
    others = min(by[x].memory_bytes for x in "ABE")
    assert by["C"].memory_bytes < others
    return int((by["C"].memory_bytes + others) / 2)


def test_memory_for_c_only_chooses_c(calibrated):
    engine, w, _ = calibrated
    from dataclasses import replace

    cands, chosen, _ = price(engine, replace(w, memory_bytes=_memory_for_c(engine, w)))
    assert [x.name for x in cands if x.fits] == ["C"] and chosen.name == "C"
    _, none, _ = price(engine, replace(w, memory_bytes=1))
    assert none is None


def test_serve_builds_the_engine_the_choice_names(calibrated):
    engine, w, _ = calibrated
    memory = _memory_for_c(engine, w)
    built, line = build_for_slo(_args(f"{SLO},memory={memory}"), parse_slo(f"{SLO},memory={memory}"))
    try:
        assert runs_as(built) == {**runs_as(built), **APPLIED["C"]}
        assert built.kv_format.name == "q8_0" and not built.config.cache.enable_prefix_caching
        assert "chosen: C (q8_0 KV, separate contexts)" in line and "(engine rebuilt)" in line
        assert "calibration steps" in line and "A " in line and "(does not fit)" in line
    finally:
        built.close()


def test_serve_with_nothing_on_time_keeps_the_configured_engine():
    slo = "requests=4,input=512,shared=128,output=16,deadline=0.001s"
    built, line = build_for_slo(_args(slo, "--speculative", "off"), parse_slo(slo))
    try:
        assert "none fits and is on time: serving as configured" in line and "rebuilt" not in line
        assert runs_as(built)["speculative"] == "off" and built.config.cache.enable_prefix_caching
    finally:
        built.close()


def test_a_batch_the_engine_cannot_run_at_once_is_refused_before_calibrating():
    with pytest.raises(ValueError, match="max-num-seqs"):
        build_for_slo(_args(SLO, "--max-num-seqs", "2"), parse_slo(SLO))


def test_the_server_says_the_choice_at_start_up(capsys):
    from trajserve.server.config import ServerConfig
    from trajserve.server.serve import build_server

    args = _args(SLO, "--speculative", "off")
    server = build_server(args, ServerConfig.from_args(args))
    try:
        err = capsys.readouterr().err
        assert "SLO: 4 requests x 512 input (128 shared) + 16 output tokens within 10000 s" in err
        chosen = re.search(r"chosen: ([A-E]) ", err).group(1)
        assert runs_as(server.engine) == {**runs_as(server.engine), **APPLIED[chosen]}
    finally:
        server.close()
