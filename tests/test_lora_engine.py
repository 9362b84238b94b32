"""Multi-LoRA serving on tiny random models with random PEFT
adapters: a row's logits are the base model's with its adapter merged
(against PEFT itself, with the C kernels and with the torch forward, rows of
several adapters and of none in one forward); mixed batches give each
request the tokens it gets alone; adapters never share a block or a tier
entry; more adapters than slots; unloading while a request runs; sessions
carry their adapter; refusals name the limit."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_models import random_adapter, save_with_tokenizer, tiny_hf_model
from trajserve.engine.model_runner import ModelRunner, allocate_kv_pool
from trajserve.request import Request
from trajserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.scope import CacheScope
from trajserve.llm import LLM
from trajserve.lora.adapter import AdapterError, load_adapter
from trajserve.lora.rows import LoRARows
from trajserve.lora.slots import LoRASlots
from trajserve.model.cpu_kernels import load as load_kernels
from trajserve.model.llama import LlamaModel
from trajserve.model.loader import load_weights
from trajserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama with three adapters: a on every projection (r 4), b on q
    and v (r 8), c on the MLP only (r 2); and their PEFT models."""
    d = tmp_path_factory.mktemp("lora")
    base = tiny_hf_model("llama")
    save_with_tokenizer(base, d / "base")
    peft = {"a": random_adapter(base, d / "a", 1),
            "b": random_adapter(base, d / "b", 2, targets=("q_proj", "v_proj"), r=8),
            "c": random_adapter(base, d / "c", 3, targets=("gate_proj", "up_proj", "down_proj"), r=2)}
    return d, peft


def _llm(d: Path, names=("a", "b", "c"), **options) -> LLM:
    return LLM(str(d / "base"), dtype="float32", num_blocks=256, block_size=4,
               lora_modules={n: str(d / n) for n in names}, **options)


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 299, (18 + 5 * i,), generator=g).tolist() for i in range(n)]


def _hit(engine, tokens: list[int], scope) -> int:
    m = engine.kv.cached_prefix(tokens, scope)
    return m.num_tokens if m is not None else 0


def _peft_logits(peft, name: str | None, ids: list[int]) -> torch.Tensor:
    model = peft[name or "a"]
    with torch.inference_mode():
        if name is None:
            with model.disable_adapter():
                return model(torch.tensor([ids])).logits[0].float()
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c-kernels", "torch"])
def test_each_row_gets_the_logits_of_its_adapter_merged(tiny, cpu_kernels):
    """One forward over four sequences (adapters a, none, b, c): every row's
    logits equal PEFT's for that adapter, over a prefill chunk, a chunk on
    top of the cached prefix and a decode row."""
    d, peft = tiny
    cfg, weights = load_weights(d / "base", torch.float32, "cpu")
    model = LlamaModel(cfg, weights, 256, torch.float32, "cpu", use_cpu_kernels=cpu_kernels)
    assert (model.kernels is not None) == (cpu_kernels and load_kernels() is not None)
    slots = LoRASlots(cfg, max_loras=3, max_rank=8)
    adapters = {n: load_adapter(d / n, n, cfg, 8) for n in "abc"}
    slot_of = slots.acquire(adapters.values())
    kv = KVCacheManager(128, 4, 0.0)
    runner = ModelRunner(model, allocate_kv_pool(cfg.num_layers, 128, 4, cfg.num_kv_heads, cfg.head_dim,
                                                 torch.float32, "cpu"), 4)
    names = ["a", None, "b", "c"]
    prompts = _prompts(len(names))
    reqs = [Request(f"r{i}", p, SamplingParams(), 10**6) for i, p in enumerate(prompts)]
    for r in reqs:
        assert kv.allocate_slots(r.request_id, len(r.prompt_token_ids))
    got = [[] for _ in reqs]
    for lo, hi in ((0, 7), (7, -1), (-1, None)):  # chunk, chunk over the cached prefix, the last token
        chunks, rows = [], []
        for i, r in enumerate(reqs):
            n = len(r.prompt_token_ids)
            start, end = lo % n, (hi % n if hi is not None else n)
            chunks.append(ScheduledChunk(r, start, end - start, kv.table(r.request_id).block_ids))
            rows += [slot_of[adapters[names[i]].digest] if names[i] else -1] * (end - start)
        batch = runner.prepare(SchedulerOutput(chunks))
        out = model.forward(batch.input_ids, batch.positions, batch.meta, runner.kv_caches,
                            torch.arange(len(rows)), None, None,
                            LoRARows(slots, torch.tensor(rows, dtype=torch.int32), model.kernels))
        row = 0
        for i, c in enumerate(chunks):
            got[i].append(out[row:row + c.num_tokens])
            row += c.num_tokens
    for i, name in enumerate(names):
        ref = _peft_logits(peft, name, prompts[i])
        torch.testing.assert_close(torch.cat(got[i]), ref, atol=2e-5, rtol=1e-4)
        if name is not None:  # the adapter changes the logits: the check above could fail
            assert (_peft_logits(peft, None, prompts[i]) - ref).abs().max() > 0.1


def _forward_rows(d: Path, names: list[str], prompt: list[int], rows_of: list[str | None], cpu_kernels=True):
    """Logits of one prefill of `prompt` with row i under adapter rows_of[i]
    (adapters `names` from d, each directory d / name)."""
    cfg, weights = load_weights(d / "base", torch.float32, "cpu")
    model = LlamaModel(cfg, weights, 256, torch.float32, "cpu", use_cpu_kernels=cpu_kernels)
    slots = LoRASlots(cfg, max_loras=len(names), max_rank=8)
    ads = {n: load_adapter(d / n, n, cfg, 8) for n in names}
    slot_of = slots.acquire(ads.values())
    kv = KVCacheManager(64, 4, 0.0)
    runner = ModelRunner(model, allocate_kv_pool(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim,
                                                 torch.float32, "cpu"), 4)
    req = Request("r", prompt, SamplingParams(), 10**6)
    assert kv.allocate_slots("r", len(prompt))
    batch = runner.prepare(SchedulerOutput([ScheduledChunk(req, 0, len(prompt), kv.table("r").block_ids)]))
    rows = torch.tensor([slot_of[ads[n].digest] if n else -1 for n in rows_of], dtype=torch.int32)
    return model.forward(batch.input_ids, batch.positions, batch.meta, runner.kv_caches, torch.arange(len(prompt)),
                         None, None, LoRARows(slots, rows, model.kernels)), ads


def test_sizes_off_the_kernels_blocks_and_bf16_adapters_run_exactly(tmp_path):
    """Widths that are not multiples of 16 (the kernel's tail paths: k = 76,
    n = 8 and 76) against PEFT; and an adapter stored in bf16 runs exactly
    its values: the same numbers stored as float32 give the same bits."""
    base = tiny_hf_model("llama", hidden_size=40, intermediate_size=76, num_attention_heads=5,
                         num_key_value_heads=1, head_dim=8)
    save_with_tokenizer(base, tmp_path / "base")
    peft = random_adapter(base, tmp_path / "a", 4, r=3)
    from safetensors.torch import load_file, save_file

    w = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    for name, dtype in (("h16", torch.bfloat16), ("h32", torch.float32)):  # bf16 values, two file formats
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_bytes((tmp_path / "a" / "adapter_config.json").read_bytes())
        save_file({k: v.to(torch.bfloat16).to(dtype) for k, v in w.items()},
                  str(tmp_path / name / "adapter_model.safetensors"))
    prompt = _prompts(1, seed=23)[0][:11]
    run = {n: _forward_rows(tmp_path, ["a", "h16", "h32"], prompt, [n] * len(prompt)) for n in ("a", "h16", "h32")}
    torch.testing.assert_close(run["a"][0], _peft_logits({"a": peft}, "a", prompt), atol=2e-5, rtol=1e-4)
    ads = run["a"][1]
    assert ads["h16"].dtype == torch.bfloat16 and ads["h32"].dtype == torch.float32
    assert torch.equal(run["h16"][0], run["h32"][0]) and not torch.equal(run["h16"][0], run["a"][0])


def test_greedy_tokens_match_peft_and_mixed_batches_equal_each_alone(tiny):
    d, peft = tiny
    llm = _llm(d)
    names = ["a", "b", None, "c", "a", None]
    prompts = _prompts(len(names))
    mixed = llm.generate(prompts, GREEDY, use_tqdm=False, lora=names)
    for p, name, out in zip(prompts, names, mixed):
        alone = llm.generate([p], GREEDY, use_tqdm=False, lora=name)[0].outputs[0]
        # The C kernels: bit for bit, tokens and their logprobs.
        assert (out.outputs[0].token_ids, out.outputs[0].logprobs) == (alone.token_ids, alone.logprobs)
        model = peft[name or "a"]
        with torch.inference_mode():
            if name is None:
                with model.disable_adapter():
                    hf = model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
            else:
                hf = model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert out.outputs[0].token_ids == hf[0, len(p):].tolist(), name
    m = llm.engine.metrics()["lora"]
    assert m["adapters"]["a"]["requests"] == 4 and m["adapters"]["a"]["generation_tokens"] == 48
    assert m["adapters"]["c"]["requests"] == 2 and sorted(m["resident"]) == ["a", "b", "c"]
    llm.engine.kv.clear_cache()  # no block leaked by mixed, drafted LoRA batches
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks
    llm.close()


def test_torch_path_mixed_batches_give_the_same_tokens(tiny):
    d, _ = tiny
    llm = _llm(d, cpu_kernels=False)
    assert llm.engine.model.kernels is None
    names = ["a", None, "b", "c"]
    prompts = _prompts(len(names), seed=9)
    mixed = llm.generate(prompts, GREEDY, use_tqdm=False, lora=names)
    for p, name, out in zip(prompts, names, mixed):
        assert out.outputs[0].token_ids == llm.generate([p], GREEDY, use_tqdm=False, lora=name)[0].outputs[0].token_ids
    llm.close()


def test_adapters_share_no_block_and_no_tier_entry(tiny):
    """The same prompt under a, then b, then the base model: no hit across
    them; under a again, a hit, from the device and, after its blocks were
    pushed to the host tier, from there. b never loads a's blocks back."""
    d, _ = tiny
    llm = _llm(d, host_cache="1MiB")
    eng = llm.engine
    p = _prompts(1, seed=11)[0] + _prompts(1, seed=12)[0]
    run = lambda name: llm.generate([p], GREEDY, use_tqdm=False, lora=name)[0]  # noqa: E731
    first = run("a")
    assert first.num_cached_tokens == 0
    assert run("b").num_cached_tokens == 0
    assert run(None).num_cached_tokens == 0
    again = run("a")
    assert again.num_cached_tokens >= len(p) - 4 and again.outputs[0].token_ids == first.outputs[0].token_ids
    a_scope = CacheScope(None, eng.lora.get("a").digest)
    assert _hit(eng, p, a_scope) > 0 and _hit(eng, p, CacheScope(None, eng.lora.get("c").digest)) == 0
    # Every path (a's, b's, the base's) goes down to the host tier.
    eng.kv.radix.evict(eng.kv.radix.num_cached_blocks)
    assert eng.kv.radix.num_cached_blocks == 0 and eng.lower.num_host_blocks > 0
    promoted = eng.kv.num_promoted_blocks
    assert run("c").num_cached_tokens == 0 and eng.kv.num_promoted_blocks == promoted  # none of theirs
    back = run("a")
    assert back.num_cached_tokens > 0 and eng.kv.num_promoted_blocks > promoted  # its own, from the host tier
    assert back.outputs[0].token_ids == first.outputs[0].token_ids
    llm.close()


def test_more_adapters_than_slots_wait_and_load_on_demand(tiny):
    d, _ = tiny
    names = ["a", "b", "c", None, "c", "a", "b"]
    prompts = _prompts(len(names), seed=13)
    ref = _llm(d)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY, use_tqdm=False, lora=names)]
    ref.close()
    llm = _llm(d, max_loras=1)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora=names)]
    assert got == want
    m = llm.engine.metrics()["lora"]
    assert m["max_loras"] == 1 and len(m["resident"]) == 1 and m["slot_loads"] >= 3
    llm.close()


def test_unloading_an_adapter_in_use_finishes_its_requests_with_it(tiny):
    d, _ = tiny
    llm = _llm(d)
    eng = llm.engine
    p = _prompts(1, seed=17)[0]
    want = llm.generate([p], GREEDY, use_tqdm=False, lora="a")[0].outputs[0].token_ids
    scope = CacheScope(None, eng.lora.get("a").digest)
    assert _hit(eng, p, scope) > 0
    rid = eng.add_request(p + [5], GREEDY, lora="a")
    eng.step()
    eng.unload_lora("a")  # mid-request
    with pytest.raises(AdapterError, match="no LoRA adapter named 'a'"):
        eng.add_request(p, GREEDY, lora="a")
    done = None
    while eng.has_unfinished_requests():
        done = next((o for o in eng.step() if o.request_id == rid and o.finished), done)
    base = llm.generate([p + [5]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert done.outputs[0].token_ids != base  # not the base model's tokens...
    llm.load_lora("a2", str(d / "a"))  # ...but the adapter's (the same files under another name)
    again = llm.generate([p + [5]], GREEDY, use_tqdm=False, lora="a2")[0]
    assert done.outputs[0].token_ids == again.outputs[0].token_ids
    assert llm.generate([p], GREEDY, use_tqdm=False, lora="a2")[0].outputs[0].token_ids == want
    # Nothing leaked: with the cache emptied every block is free again.
    eng.kv.clear_cache()
    assert eng.kv.pool.num_free == eng.kv.num_blocks and not eng.lora.in_flight
    llm.close()


def test_a_session_carries_its_adapter(tiny):
    d, _ = tiny
    llm = _llm(d)
    p = _prompts(1, seed=19)[0]
    s = llm.open_session(p, lora="b")
    out = s.generate(GREEDY)
    assert out.outputs[0].token_ids == llm.generate([p], GREEDY, use_tqdm=False, lora="b")[0].outputs[0].token_ids
    s.history += [7, 8, 9]
    second = s.generate(GREEDY)
    assert second.num_cached_tokens >= len(p)  # its own history, under its adapter
    assert second.outputs[0].token_ids == llm.generate([s.history[:-12]], GREEDY, use_tqdm=False,
                                                       lora="b")[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="belongs to another model"):
        llm.sessions.before_turn(s.session_id, None, "a")
    llm.close()


def test_refusals_name_the_limit(tiny, tmp_path):
    d, _ = tiny
    llm = LLM(str(d / "base"), dtype="float32", num_blocks=64, block_size=4)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora="a")
    llm.close()
    with pytest.raises(AdapterError, match="r = 8 is over --max-lora-rank 4"):
        _llm(d, max_lora_rank=4)
    with pytest.raises(ValueError, match="lora_modules .*NAME=PATH"):
        LLM(str(d / "base"), dtype="float32", lora_modules=["../x=" + str(d / "a")])
    llm = _llm(d, names=("a",))
    with pytest.raises(AdapterError, match="no LoRA adapter named 'zz' .loaded: a."):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora="zz")
    with pytest.raises(AdapterError, match="already loaded"):
        llm.load_lora("a", str(d / "b"))
    with pytest.raises(AdapterError, match="lora_name must match"):
        llm.load_lora("a/../b", str(d / "b"))
    with pytest.raises(ValueError, match="got 1 lora names for 2 prompts"):
        llm.generate([[1, 2], [3, 4]], GREEDY, use_tqdm=False, lora=["a"])
    assert not llm.engine.has_unfinished_requests()
    llm.close()


def test_forks_and_n_samples_keep_the_adapter(tiny):
    d, _ = tiny
    llm = _llm(d)
    eng = llm.engine
    p = _prompts(1, seed=29)[0]
    want = llm.generate([p], GREEDY, use_tqdm=False, lora="c")[0].outputs[0].token_ids
    rid = eng.add_request(p, GREEDY, lora="c")
    eng.step()
    eng.step()
    (child,) = eng.fork(rid)
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert done[rid] == want and done[child] == want
    two = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=2), use_tqdm=False,
                       lora="c")[0]
    assert [o.token_ids for o in two.outputs] == [want, want]
    assert eng.lora.metrics()["adapters"]["c"]["requests"] == 4  # the fork counts as one
    llm.close()


def test_the_kv_pool_leaves_room_for_the_slots(monkeypatch):
    from trajserve.config import CacheConfig, ModelConfig
    from trajserve.engine import memory

    cfg = tiny_hf_model("llama").config

    mc = ModelConfig("llama", cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                     cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    monkeypatch.setattr(memory, "available_memory", lambda device: 10**8)
    reserve = LoRASlots.max_bytes(mc, 4, 16)
    # 4 slots x 6 B (a float32 and a bf16 stack) x P_adapter: 2 layers x r 16 x sum of (in + out) over
    # q, k, v, o (64 -> 64, 64 -> 32 twice, 64 -> 64) and gate, up, down (64 -> 128 twice, 128 -> 64).
    assert reserve == 4 * 6 * 2 * 16 * (128 + 96 + 96 + 128 + 3 * 192)
    cc = CacheConfig(memory_fraction=0.5)
    per_block = memory.bytes_per_block(mc, cc.block_size, torch.float32)
    cpu = torch.device("cpu")
    assert memory.num_blocks_for(cc, mc, torch.float32, cpu) == 5 * 10**7 // per_block
    assert memory.num_blocks_for(cc, mc, torch.float32, cpu, reserve) == (5 * 10**7 - reserve) // per_block
    with pytest.raises(ValueError, match="besides .* for LoRA slots"):
        memory.num_blocks_for(CacheConfig(kv_cache_memory=10**8 - reserve // 2), mc, torch.float32, cpu, reserve)


def test_lora_dtype_bfloat16_runs_a_float_file_as_its_bf16_rounding(tmp_path):
    """--lora-dtype bfloat16: a float32 adapter file runs as the same values
    rounded to bf16, bit for bit what a bf16 file of them gives, under an
    identity of its own (other numbers: other KV); auto keeps the file's
    float32 values, and float32 widens a bf16 file exactly."""
    from safetensors.torch import load_file, save_file

    base = tiny_hf_model("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16)
    save_with_tokenizer(base, tmp_path / "base")
    random_adapter(base, tmp_path / "f32", 4, r=4)
    w = load_file(str(tmp_path / "f32" / "adapter_model.safetensors"))
    (tmp_path / "b16").mkdir()
    (tmp_path / "b16" / "adapter_config.json").write_bytes((tmp_path / "f32" / "adapter_config.json").read_bytes())
    save_file({k: v.bfloat16() for k, v in w.items()}, str(tmp_path / "b16" / "adapter_model.safetensors"))
    cfg, _ = load_weights(tmp_path / "base", torch.float32, "cpu")
    auto = load_adapter(tmp_path / "f32", "f", cfg, 8)
    rounded = load_adapter(tmp_path / "f32", "f", cfg, 8, "bfloat16")
    assert (auto.dtype, rounded.dtype) == (torch.float32, torch.bfloat16) and auto.digest != rounded.digest
    assert load_adapter(tmp_path / "b16", "b", cfg, 8, "float32").dtype == torch.float32
    prompt = _prompts(1, seed=5)[0][:12]

    def logits(run_dtype: str, name: str) -> torch.Tensor:
        llm = LLM(str(tmp_path / "base"), dtype="float32", num_blocks=64, block_size=4,
                  lora_modules={name: str(tmp_path / name)}, lora_dtype=run_dtype)
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                           use_tqdm=False, lora=name)[0]
        llm.close()
        return torch.tensor([out.prompt_logprobs[i][0] for i in range(1, len(prompt))])
    as_bf16 = logits("bfloat16", "f32")
    assert torch.equal(as_bf16, logits("auto", "b16"))
    assert not torch.equal(as_bf16, logits("auto", "f32"))
