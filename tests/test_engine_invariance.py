"""Batching never changes the result: greedy output (float32, embedded
SmolLM2-135M) is token-identical to each prompt run alone, whatever the chunk
size, block size, batch composition, arrival order or preemption, over a
float32 and a bfloat16 KV pool, and identical to Hugging Face transformers.

A wrong cache slot, a lost or repeated token, a stale block after recompute
or a mask off by one changes at least one of 6 x 24 greedy tokens.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from trajserve.config import CacheConfig, EngineConfig, SchedulerConfig
from trajserve.engine.engine import LLMEngine
from trajserve.sampling import SamplingParams

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

_SENTENCES = [
    "The river rose overnight and the ferry stopped running, so the village sent letters by bicycle.",
    "A compiler turns source code into machine instructions, checking types along the way.",
    "In 1887 the observatory recorded a comet that no one saw again for seventy years.",
    "She wrote the shopping list on the back of an old train ticket: eggs, flour, lemons, tea.",
    "Photosynthesis stores the energy of sunlight in the chemical bonds of sugar molecules.",
    "The committee postponed its decision until the engineers had measured the bridge again.",
    "Gradient descent takes small steps downhill on the loss surface until the slope is flat.",
    "Every Tuesday the market filled with the smell of roasted chestnuts and fresh bread.",
]


def _long_text(n_sentences: int, offset: int) -> str:
    return " ".join(_SENTENCES[(offset + 3 * i) % len(_SENTENCES)] for i in range(n_sentences))


def _prompts(tok) -> list[list[int]]:
    chat = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Name three animals that live in the Arctic and explain why."}]),
        add_special_tokens=False)
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
        _long_text(7, 1),
        _long_text(11, 2),
        _long_text(33, 5),
    ]
    prompts = [tok.encode(t) for t in texts]
    prompts.insert(1, chat)
    return prompts


def _kv_dtypes() -> list[str]:
    from trajserve.model import cpu_kernels

    # A bfloat16 pool runs in the C kernels (AMX tiles where the CPU has them,
    # else decode-kernel chunks); q8_0 and q4_0 rows are dequantized as the
    # kernels read them. Every pool is tested wherever it runs.
    return ["float32", "bfloat16", "q8_0", "q4_0"] if cpu_kernels.load() is not None else ["float32"]


@pytest.fixture(scope="module", params=_kv_dtypes())
def kv_dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine(engine_f32, kv_dtype):
    """The default path (weights in the GGUF's blocks, --quantization auto,
    where the C kernels load) over each KV pool: every invariance below
    holds on it bit for bit."""
    if engine_f32.kv_format.name == kv_dtype:
        return engine_f32
    return LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=512, kv_cache_dtype=kv_dtype)))


@pytest.fixture(scope="module")
def prompts(engine_f32):
    ps = _prompts(engine_f32.tokenizer)
    lens = sorted(len(p) for p in ps)
    # Varied lengths: one tiny prompt, several spanning many 16-token blocks, one ~600.
    assert 5 <= lens[0] <= 8 and 500 <= lens[-1] <= 700, lens
    return ps


@contextlib.contextmanager
def sched_config(engine: LLMEngine, **kw):
    old = engine.scheduler.config
    engine.scheduler.reconfigure(**kw)
    try:
        yield
    finally:
        engine.scheduler.reconfigure(**{k: getattr(old, k) for k in kw})


def clear_prefix_cache(engine: LLMEngine) -> None:
    """Drop cached blocks no request holds, so the next run computes every
    token (chunking is only exercised on tokens that are computed)."""
    clear = getattr(engine.kv, "clear_cache", None)
    if clear is not None:
        clear()


def cache_off() -> dict:
    """CacheConfig kwargs that turn the radix prefix cache off, where it exists."""
    return {"enable_prefix_caching": False} if "enable_prefix_caching" in CacheConfig.__dataclass_fields__ else {}


def check_refcounts(engine: LLMEngine) -> None:
    """Each block's refcount = block tables holding it + 1 if the radix tree does."""
    kv = engine.kv
    kv.pool.check()
    radix = getattr(kv, "radix", None)
    tree = 0 if radix is None else radix.num_cached_blocks + getattr(radix, "num_detached_blocks", 0)
    assert sum(kv.pool.ref_counts) == sum(len(t.block_ids) for t in kv.tables.values()) + tree


def assert_pool_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert not engine.kv.tables
    check_refcounts(engine)
    clear_prefix_cache(engine)  # what is left must be free, not leaked
    assert engine.kv.pool.num_free == engine.kv.num_blocks, "blocks leaked"
    engine.kv.pool.check()


def drain(engine: LLMEngine, results: dict, max_steps: int = 100_000) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    raise AssertionError("engine did not finish")


def run_outputs(engine: LLMEngine, prompts, sp=GREEDY, warm: bool = False) -> list:
    if not warm:
        clear_prefix_cache(engine)
    ids = [engine.add_request(p, sp) for p in prompts]
    results: dict = {}
    drain(engine, results)
    outs = [results[i] for i in ids]
    if not warm:
        assert_pool_clean(engine)
    return outs


def run_batch(engine: LLMEngine, prompts, sp=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in run_outputs(engine, prompts, sp)]


@pytest.fixture(scope="module")
def reference(engine, prompts) -> list[list[int]]:
    """Each prompt alone, whole prompt in one step."""
    ref = []
    with sched_config(engine, max_prefill_chunk=4096, max_num_batched_tokens=4096):
        for p in prompts:
            steps_before = engine.scheduler.num_preemptions
            ref.extend(run_batch(engine, [p]))
            assert engine.scheduler.num_preemptions == steps_before
    assert all(len(r) == MAX_TOKENS for r in ref)
    return ref


def _diff(got, ref) -> str:
    for i, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            k = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
            return f"prompt {i}: first difference at output token {k}: {g[k:k + 4]} vs {r[k:k + 4]}"
    return ""


@pytest.mark.parametrize("chunk", [7, 512])
def test_chunk_size_does_not_change_tokens(engine, prompts, reference, chunk):
    """All prompts submitted at once; each step's token budget = chunk cap.
    (Chunk 64 runs in test_staggered_arrival.)"""
    # Budget 7 is shared with the decodes, so long prompts would take hundreds
    # of steps; the prompts under 150 tokens (several 16-token blocks, chunk
    # edges never block-aligned) suffice at chunk 7.
    idx = [i for i in range(len(prompts)) if chunk > 7 or len(prompts[i]) < 150]
    with sched_config(engine, max_prefill_chunk=chunk, max_num_batched_tokens=chunk, max_num_seqs=64):
        steps = 0
        orig_step = engine.step

        def counting_step():
            nonlocal steps
            steps += 1
            return orig_step()

        engine.step = counting_step
        try:
            got = run_batch(engine, [prompts[i] for i in idx])
        finally:
            del engine.step
    want = [reference[i] for i in idx]
    assert got == want, _diff(got, want)
    # Prompts really were cut into chunks: more steps than the decodes alone
    # need (a verified draft outputs up to 1 + max_draft tokens a step).
    longest = max(len(prompts[i]) for i in idx)
    per_step = 1 + (engine.scheduler.proposer.config.max_draft if engine.scheduler.proposer else 0)
    assert steps >= -(-MAX_TOKENS // per_step) + (longest - 1) // chunk


@pytest.mark.parametrize("kernels", [True, False])
def test_last_layer_goes_on_with_the_sampled_rows_alone(engine, prompts, reference, kernels):
    """The last layer stores every row's K/V, then runs attention, o, MLP and
    the final norm for the sampled rows only (LlamaModel.forward's
    sample_meta). Every step's logits must equal those of the whole last
    layer: bit for bit on the C kernels, within float rounding on the torch
    forward. The steps cover a chunk that samples nothing alone, chunks that
    do not sample beside decodes, and prompts' last chunks beside decodes."""
    eng = engine if kernels else LLMEngine(EngineConfig(dtype="float32", cpu_kernels=False,
                                                         cache=CacheConfig(num_blocks=256)))
    model = eng.runner.model
    assert (model.kernels is not None) == kernels
    forward, seen = model.forward, []

    def both(input_ids, positions, meta, kv, sample_rows, before_layer=None, sample_meta=None, lora=None):
        whole = forward(input_ids, positions, meta, kv, sample_rows, before_layer, None, lora)
        alone = forward(input_ids, positions, meta, kv, sample_rows, before_layer, sample_meta, lora)
        if kernels:
            assert torch.equal(alone, whole)
        else:
            torch.testing.assert_close(alone, whole, rtol=1e-5, atol=1e-4)
        seen.append((meta.num_decodes, len(meta.prefills), sample_rows.numel()))
        return alone

    long = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    rest = [i for i in range(len(prompts)) if i != long and len(prompts[i]) < 150]
    model.forward = both
    # Without drafts: a verified draft samples every row of its chunk, and
    # the steps this test needs are chunks that sample nothing beside decodes.
    try:
        with eng.scheduler.without_drafts(), sched_config(eng, max_prefill_chunk=64, max_num_batched_tokens=64,
                                                          max_num_seqs=64):
            clear_prefix_cache(eng)
            ids = [eng.add_request(prompts[long], GREEDY)]
            eng.step()  # the long prompt's first chunk, alone: nothing to sample
            ids += [eng.add_request(prompts[i], GREEDY) for i in rest]
            results: dict = {}
            drain(eng, results)
    finally:
        del model.forward
    if kernels:  # (the torch forward's rounding may part from the reference's on a near tie)
        got = [results[i].outputs[0].token_ids for i in ids]
        want = [reference[i] for i in [long, *rest]]
        assert got == want, _diff(got, want)
    assert seen[0] == (0, 1, 0)
    assert any(d and p and s < d + p for d, p, s in seen), "no step where a chunk beside decodes sampled nothing"
    assert any(d and s == d + p and p for d, p, s in seen), "no step where a prompt's last chunk sampled beside decodes"


def test_warm_prefix_cache_does_not_change_tokens(engine, prompts, reference):
    """The same batch twice: the second run reads every full prompt block from
    the radix prefix cache instead of computing it."""
    if getattr(engine.kv, "radix", None) is None:
        pytest.skip("engine has no prefix cache")
    with sched_config(engine, max_prefill_chunk=64, max_num_batched_tokens=64, max_num_seqs=64):
        clear_prefix_cache(engine)
        cold = run_outputs(engine, prompts, warm=True)
        warm = run_outputs(engine, prompts, warm=True)
    for outs in (cold, warm):
        got = [o.outputs[0].token_ids for o in outs]
        assert got == reference, _diff(got, reference)
    B = engine.kv.block_size
    assert [o.num_cached_tokens for o in cold] == [0] * len(prompts)
    for o, p in zip(warm, prompts):
        # Block-aligned hits that leave at least the last prompt token to compute.
        n = o.num_cached_tokens
        assert n % B == 0 and n <= len(p) - 1
        if len(p) > 2 * B:
            assert n >= len(p) - 1 - B, (len(p), n)
    assert_pool_clean(engine)


def test_max_num_seqs_queues_the_rest(engine, prompts, reference):
    """max_num_seqs=3: three prompts wait in the queue and are admitted as
    others finish, joining batches that mix decodes with a prefill."""
    with sched_config(engine, max_num_seqs=3, max_prefill_chunk=64, max_num_batched_tokens=64):
        seen_running = []
        orig_step = engine.step

        def watching_step():
            seen_running.append(len(engine.scheduler.running))
            return orig_step()

        engine.step = watching_step
        try:
            got = run_batch(engine, prompts)
        finally:
            del engine.step
    assert max(seen_running) == 3
    assert got == reference, _diff(got, reference)


def test_staggered_arrival(engine, prompts, reference):
    """New prompts arrive (and prefill in 64-token chunks, budget 64) while
    others are mid-decode."""
    results: dict[str, list[int]] = {}
    order = [3, 0, 5, 1, 4, 2]  # arrival order: mix long and short
    ids: dict[int, str] = {}
    clear_prefix_cache(engine)
    with sched_config(engine, max_prefill_chunk=64, max_num_batched_tokens=64, max_num_seqs=64):
        for k, i in enumerate(order):
            if k:
                assert any(r.num_output_tokens > 0 for r in engine.scheduler.running), \
                    "no request mid-decode when the next one arrived"
            ids[i] = engine.add_request(prompts[i], GREEDY)
            # Step until the newest request decodes, so the next one joins a
            # batch that mixes decodes with its prefill.
            seen = 0
            while seen < 2 and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                    if out.request_id == ids[i]:
                        seen = len(out.outputs[0].token_ids)
            assert seen >= 2
        drain(engine, results)
    assert_pool_clean(engine)
    got = [results[ids[i]].outputs[0].token_ids for i in range(len(prompts))]
    assert got == reference, _diff(got, reference)


def test_block_size_8_does_not_change_tokens(prompts, reference, kv_dtype):
    # Room for all prompts at once (~2,048 tokens), so nothing is preempted.
    eng = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(block_size=8, num_blocks=256,
                                                                    kv_cache_dtype=kv_dtype)))
    eng.scheduler.reconfigure(max_prefill_chunk=128, max_num_batched_tokens=128)
    got = run_batch(eng, prompts)
    assert eng.scheduler.num_preemptions == 0
    assert got == reference, _diff(got, reference)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_block_size_32_with_preemption_does_not_change_tokens(prompts, reference, monkeypatch, kv_dtype,
                                                              speculative):
    """Block size 32 (block 16 is the reference engine) and a pool that holds
    every prompt but not every prompt plus its 24 tokens: decoding requests
    are preempted, their blocks freed, and later recomputed from prompt +
    generated tokens. With speculation (drafts never preempt; requests finish
    in fewer steps) the same pool may not run short: the tokens are still
    the reference's and the refcounts hold after every step."""
    B = 32
    # Every prompt fits at once (+1 block); their decode growth does not.
    num_blocks = sum(-(-(len(p) + 1) // B) for p in prompts) + 1
    assert num_blocks >= -(-(max(map(len, prompts)) + MAX_TOKENS) // B)  # the longest fits alone
    # Prefix caching off: a preempted request recomputes everything.
    # No admission ceiling (1.0): this tests preemption.
    eng = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(block_size=B, num_blocks=num_blocks,
                                                                    kv_cache_dtype=kv_dtype, **cache_off()),
                                 scheduler=SchedulerConfig(max_prefill_chunk=64, max_num_batched_tokens=64,
                                                           admission_ceiling=1.0,
                                                           speculative="auto" if speculative else "off")))
    assert eng.scheduler.ceiling_blocks == num_blocks
    preempted_at: list[tuple[str, int]] = []  # (request, output tokens it had)
    orig_preempt = eng.scheduler._preempt

    def recording_preempt(req, out):
        preempted_at.append((req.request_id, req.num_output_tokens))
        orig_preempt(req, out)

    monkeypatch.setattr(eng.scheduler, "_preempt", recording_preempt)
    # Longest first: the newest (short) requests are the victims, mid-decode.
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    ids = {i: eng.add_request(prompts[i], GREEDY) for i in order}
    results: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        # Refcounts and the free list agree after every step, preemptions included.
        check_refcounts(eng)
        assert sum(len(t.block_ids) for t in eng.kv.tables.values()) == eng.kv.pool.num_used
        steps += 1
        assert steps < 10_000
    assert eng.scheduler.num_preemptions == len(preempted_at)
    if not speculative:
        assert preempted_at, "pool was not small enough to preempt"
        assert any(n > 0 for _, n in preempted_at), f"no request was preempted mid-decode: {preempted_at}"
    got = [results[ids[i]] for i in range(len(prompts))]
    assert got == reference, _diff(got, reference)
    assert eng.kv.pool.num_free == eng.kv.num_blocks
    assert not eng.kv.tables
    eng.kv.pool.check()


@pytest.mark.parametrize("which", ["chat", "longest"])
def test_matches_transformers_greedy(engine_float_weights, prompts, hf_gguf_model, which):
    """The weights dequantized, as transformers reads the GGUF: the same
    greedy tokens (the default, quantized path is compared with this one in
    tests/test_quantized_model.py)."""
    i = 1 if which == "chat" else max(range(len(prompts)), key=lambda j: len(prompts[j]))
    ids = prompts[i]
    with sched_config(engine_float_weights, max_prefill_chunk=4096, max_num_batched_tokens=4096):
        ours = run_batch(engine_float_weights, [ids])[0]
    with torch.inference_mode():
        out = hf_gguf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    hf = out[0, len(ids):].tolist()
    assert ours == hf, _diff([ours], [hf])
