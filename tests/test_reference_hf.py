"""trajserve vs Hugging Face transformers on the embedded model, float32:
prefill logits and 32 greedy decode steps within 1e-3, identical greedy text."""
import torch

from trajserve.sampling import SamplingParams

PROMPT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
STEPS = 32


def test_logits_and_greedy_text_match_transformers(engine_float_weights, hf_gguf_model, monkeypatch):
    eng = engine_float_weights
    ids = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(PROMPT), add_special_tokens=False)
    seen = []  # the logits the sampler sees, per step
    orig = eng.sampler.sample
    monkeypatch.setattr(eng.sampler, "sample", lambda lg, *rest: (seen.append(lg.clone()), orig(lg, *rest))[1])
    eng.add_request(ids, SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True))
    # One row of logits a step: without drafts (a verified draft's rows go to
    # the sampler a round at a time; tests/test_speculative_engine.py).
    with eng.scheduler.without_drafts():
        while eng.has_unfinished_requests():
            eng.step()
    monkeypatch.undo()
    ours = torch.cat(seen)  # [STEPS, vocab]: prefill's last row, then each decode step
    assert ours.shape[0] == STEPS

    with torch.inference_mode():
        hf_out = hf_gguf_model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False,
                                        min_new_tokens=STEPS)
        gen = hf_out[0, len(ids):].tolist()
        # Teacher-forced logits over prompt + generated tokens: row len(ids)-1+i predicts token i.
        ref = hf_gguf_model(hf_out[:, :-1]).logits[0, len(ids) - 1:].float()

    ours_tokens = ours.argmax(-1).tolist()
    assert ours_tokens == gen, "greedy tokens differ from transformers"
    assert eng.tokenizer.decode(ours_tokens) == eng.tokenizer.decode(gen)
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-3, f"max |logit diff| = {diff}"
    print(f"max |logit diff| over prefill + {STEPS} decode steps: {diff:.2e}")


def test_every_prefill_row_matches_transformers(engine_float_weights, hf_gguf_model):
    """All rows of a chunked prefill (not just the sampled one) against the reference."""
    from trajserve.engine.scheduler import ScheduledChunk, SchedulerOutput
    from trajserve.request import Request

    eng = engine_float_weights
    ids = eng.tokenizer.encode("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n")
    req = Request("rows", ids, SamplingParams(), 10**6)
    assert eng.kv.allocate_slots("rows", len(ids))
    try:
        table = eng.kv.table("rows").block_ids
        rows = []
        # Two chunks: the second attends to the first through the paged cache.
        for start, end in ((0, 11), (11, len(ids))):
            batch = eng.runner.prepare(SchedulerOutput([ScheduledChunk(req, start, end - start, table)]))
            batch.sample_rows = torch.arange(end - start)
            batch.sample_meta = None  # every row through the whole last layer
            rows.append(eng.runner.run(batch))
    finally:
        eng.kv.release("rows")
    with torch.inference_mode():
        ref = hf_gguf_model(torch.tensor([ids])).logits[0].float()
    diff = (torch.cat(rows) - ref).abs().max().item()
    assert diff < 1e-3, f"max |logit diff| = {diff}"


def test_penalties_and_bias_match_transformers_and_leave_the_batch_alone(engine_float_weights, hf_gguf_model):
    """Greedy with a repetition penalty against transformers' own
    (generate(repetition_penalty=)); frequency / presence penalties and a
    logit bias against a loop over transformers' logits written here from
    the OpenAI definition. All three run in one batch with a plain request,
    which must come out as it does alone."""
    from collections import Counter

    from engine_util import run_requests

    eng, steps = engine_float_weights, 24
    ids = eng.tokenizer.encode("List the colors: red, blue, green, red, blue, green, red,")
    rep = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    freq = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, frequency_penalty=1.5,
                          presence_penalty=0.5, logit_bias={28: -5.0})  # 28: ","
    plain = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    (alone,) = [o.outputs[0].token_ids for o in run_requests(eng, [(ids, plain)])]
    got_rep, got_freq, got_plain = [o.outputs[0].token_ids
                                    for o in run_requests(eng, [(ids, rep), (ids, freq), (ids, plain)])]
    assert got_plain == alone
    assert got_rep != alone and got_freq != alone  # the penalties did something here
    with torch.inference_mode():
        ref_rep = hf_gguf_model.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps,
                                         do_sample=False, repetition_penalty=1.3)[0, len(ids):].tolist()
        ref_freq = []
        for _ in range(steps):
            logits = hf_gguf_model(torch.tensor([ids + ref_freq])).logits[0, -1].float()
            logits[28] -= 5.0
            for t, n in Counter(ref_freq).items():
                logits[t] -= 1.5 * n + 0.5
            ref_freq.append(int(logits.argmax()))
    assert got_rep == ref_rep
    assert got_freq == ref_freq
    # A bias on a token the vocabulary does not have is refused by name.
    import pytest
    with pytest.raises(ValueError, match=r"logit_bias token id 49152 is outside the vocabulary \[0, 49152\)"):
        eng.add_request(ids, SamplingParams(logit_bias={49152: 1.0}))
