"""trajserve vs Hugging Face transformers on the embedded model, float32:
prefill logits and 32 greedy decode steps within 1e-3, identical greedy text."""
import torch

from trajserve.sampling import SamplingParams

PROMPT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
STEPS = 32


def test_logits_and_greedy_text_match_transformers(engine_f32, hf_gguf_model, monkeypatch):
    eng = engine_f32
    ids = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(PROMPT), add_special_tokens=False)
    seen = []  # the logits the sampler sees, per step
    orig = eng.sampler.sample
    monkeypatch.setattr(eng.sampler, "sample", lambda lg, i, p: (seen.append(lg.clone()), orig(lg, i, p))[1])
    eng.add_request(ids, SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True))
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


def test_every_prefill_row_matches_transformers(engine_f32, hf_gguf_model):
    """All rows of a chunked prefill (not just the sampled one) against the reference."""
    from trajserve.engine.scheduler import ScheduledChunk, SchedulerOutput
    from trajserve.engine.request import Request

    eng = engine_f32
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
        eng.kv.free("rows")
    with torch.inference_mode():
        ref = hf_gguf_model(torch.tensor([ids])).logits[0].float()
    diff = (torch.cat(rows) - ref).abs().max().item()
    assert diff < 1e-3, f"max |logit diff| = {diff}"
