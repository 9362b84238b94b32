"""Latent-attention models (model/mla.py) on tiny random DeepSeek V2 and V3
written by transformers: the pool keeps one latent row a token and layer, as
many bytes as the planner counts; routing as transformers' routers route;
what the engine does not run is refused by name. (Their greedy tokens
against transformers: tests/test_model_families.py.)"""
from __future__ import annotations

import json

import pytest
import torch

from trajserve import SamplingParams

from tiny_models import save_with_tokenizer, tiny_hf_model
from greedy_runs import engine, hf_greedy, prompts, run


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = tiny_hf_model(request.param, num_hidden_layers=3)
    save_with_tokenizer(hf, d)
    return d, hf


def test_the_pool_keeps_one_latent_row_a_token_and_layer_as_the_planner_counts(model_dir):
    """(kv_lora_rank + qk_rope_head_dim) x layers x 4 bytes a token (eq. 1
    for MLA), the planner's m_token of the same config.json; no per-head K
    or V anywhere: the attention reads the latent rows as both."""
    from trajserve.plan.kv_format import m_token
    from trajserve.plan.model_shapes import read_hf_config, total_params

    d, hf = model_dir
    eng = engine(d)
    try:
        mc, B = eng.model_config, eng.config.cache.block_size
        for k, v in eng.runner.kv_caches:
            assert v is k and tuple(k.shape) == (eng.num_blocks, 1, B, 32 + 8)
        planned, _, _ = read_hf_config(d)
        assert eng.kv_format.bytes_per_token(mc) == (32 + 8) * 3 * 4 == m_token(planned, "fp32")
        assert eng.block_bytes * eng.num_blocks == sum(k.numel() * k.element_size() for k, _ in eng.runner.kv_caches)
        assert total_params(planned) == sum(p.numel() for p in hf.parameters())  # as transformers counts it
    finally:
        eng.close()


def test_at_deepseeks_latent_widths_a_token_costs_576_values_a_layer(tmp_path):
    """DeepSeek V2 / V3's own latent widths (kv_lora_rank 512, RoPE key 64,
    heads of 128 + 64 / 128): the pool row is 576 values a layer, the
    planner's m_token of the same config.json, and decodes through the
    latent kernel at these widths give transformers' greedy tokens."""
    from trajserve.plan.kv_format import m_token
    from trajserve.plan.model_shapes import read_hf_config

    hf = tiny_hf_model("deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                       q_lora_rank=None, num_attention_heads=4, num_key_value_heads=4,
                       eos_token_id=None, bos_token_id=None, pad_token_id=None)  # token 1 is an argmax here:
    save_with_tokenizer(hf, tmp_path)  # as an EOS, transformers' min_new_tokens would mask it
    eng = engine(tmp_path)
    try:
        assert eng.runner.model.kernels is not None  # decode rows run on mla_attention.c
        planned, _, _ = read_hf_config(tmp_path)
        layers = hf.config.num_hidden_layers
        assert eng.kv_format.bytes_per_token(eng.model_config) == (512 + 64) * layers * 4 == m_token(planned, "fp32")
        batch = prompts()
        assert run(eng, batch) == hf_greedy(hf, batch)
    finally:
        eng.close()


def test_a_rows_bits_do_not_depend_on_its_batch_or_drafts(model_dir):
    """On the C kernels a decode row and a verification's rows run the
    latent attention over their own causal prefix and the absorbed products
    are one product a head, so the chosen tokens' logprobs are the same
    floats whether the prompts run alone or together, decoded one by one or
    through verified drafts: speculation's auto is on for these models. One
    prompt is longer than a verification (its chunk runs in SDPA)."""
    from trajserve.config import SchedulerConfig
    from trajserve.model.mla import VERIFY_ROWS

    d, _ = model_dir
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    batch = prompts() + [torch.arange(VERIFY_ROWS + 20).remainder(290).tolist()]

    def logprobs(eng, together: bool) -> list[list[float]]:
        groups = [batch] if together else [[p] for p in batch]
        out = []
        for group in groups:
            rids = [eng.add_request(p, params) for p in group]
            done = {}
            while eng.has_unfinished_requests():
                done |= {o.request_id: o for o in eng.step() if o.finished}
            out += [[lp for lp, _ in done[r].outputs[0].logprobs] for r in rids]
        return out

    runs = {}
    for name, kw, together in (("alone", {"speculative": "off"}, False), ("batch", {"speculative": "off"}, True),
                               ("drafts", {"speculative": "auto"}, True)):
        eng = engine(d, {"enable_prefix_caching": False}, scheduler=SchedulerConfig(**kw))
        try:
            if name == "drafts":
                assert eng.speculative == "ngram"
            runs[name] = logprobs(eng, together)
            if name == "drafts":
                assert eng.scheduler.proposer.num_drafts > 0
        finally:
            eng.close()
    for name, got in runs.items():
        assert got == runs["alone"], name


def test_lora_and_a_quantized_latent_pool_are_refused_by_name(model_dir):
    d, _ = model_dir
    with pytest.raises(ValueError, match="deepseek2 model are not supported"):
        engine(d, enable_lora=True)
    with pytest.raises(ValueError, match="q8_0 is not supported for latent attention"):
        engine(d, {"kv_cache_dtype": "q8_0"})


@pytest.mark.parametrize("change, message", [
    ({"topk_method": "noaux_tc"}, "unsupported topk_method 'noaux_tc' for deepseek_v2"),
    ({"kv_lora_rank": None}, "needs kv_lora_rank"),
    ({"attention_bias": True}, "no attention_bias"),
    ({"n_group": 3}, "n_group 3 must divide the 8 experts"),
])
def test_what_the_engine_does_not_run_is_refused_by_name(tmp_path, change, message):
    from trajserve.model.hf_reader import _hf_config

    tiny_hf_model("deepseek_v2").config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text()) | change
    with pytest.raises(ValueError, match=message):
        _hf_config(raw)


def test_routing_matches_transformers_routers():
    """route() against transformers' own router modules on random hidden
    states: the same experts and weights for every token."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from trajserve.config import MoESpec
    from trajserve.model.moe import route

    for kind, router_cls in (("deepseek_v2", DeepseekV2TopkRouter), ("deepseek_v3", DeepseekV3TopkRouter)):
        config = tiny_hf_model(kind).config
        router = router_cls(config)
        torch.manual_seed(3)
        with torch.no_grad():
            router.weight.normal_()
            bias = None
            if kind == "deepseek_v3":
                router.e_score_correction_bias.normal_(std=0.1)
                bias = router.e_score_correction_bias
        spec = MoESpec.from_hf(config.to_dict(), config.num_hidden_layers)
        h = torch.randn(200, config.hidden_size)
        _, want_w, want_e = router(h)
        w, e = route(spec, h @ router.weight.T, bias)
        order_want, order = want_e.sort(dim=-1), e.sort(dim=-1)
        assert torch.equal(order.values, order_want.values)
        torch.testing.assert_close(w.gather(1, order.indices), want_w.gather(1, order_want.indices))
