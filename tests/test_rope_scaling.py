"""--rope-scaling / --rope-factor: a model's RoPE stretched past its trained
context, as transformers computes it (a tiny random Llama trained to 64
positions, run to 160 under YaRN and linear scaling against the same
weights in transformers with that rope_scaling), and refused where it
cannot hold."""
from __future__ import annotations

import pytest
import torch

from tiny_models import save_with_tokenizer, tiny_hf_model
from trajserve.config import CacheConfig, EngineConfig
from trajserve.engine.engine import LLMEngine
from trajserve.sampling import SamplingParams

TRAINED = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rope")
    hf = tiny_hf_model("llama", max_position_embeddings=TRAINED)
    save_with_tokenizer(hf, d)
    return d, hf


def _engine(d, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(d), dtype="float32", cache=CacheConfig(num_blocks=64), **kw))


def _reference(hf, scaling: dict) -> torch.nn.Module:
    """The same weights in transformers, its RoPE scaled as asked."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**hf.config.to_dict(), "rope_scaling": scaling,
                         "max_position_embeddings": int(TRAINED * scaling["factor"])})
    ref = LlamaForCausalLM(cfg).eval()
    ref.load_state_dict(hf.state_dict())
    return ref


@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_a_stretched_context_scores_as_transformers(model_dir, kind):
    d, hf = model_dir
    eng = _engine(d, rope_scaling=kind, rope_factor=4.0)
    try:
        assert eng.max_model_len == 4 * TRAINED  # the default context grows with the factor
        assert f"context {TRAINED} -> {4 * TRAINED} tokens: quality past the trained {TRAINED} is not promised" \
            in eng.startup_summary
        torch.manual_seed(3)
        ids = torch.randint(0, 299, (160,)).tolist()  # 2.5x the trained context
        eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        out = None
        while eng.has_unfinished_requests():
            out = next((o for o in eng.step() if o.finished), out)
        ours = torch.tensor([out.prompt_logprobs[i][0] for i in range(1, len(ids))])  # (logprob, rank) of the token
        scaling = {"rope_type": kind, "factor": 4.0}
        if kind == "yarn":
            scaling["original_max_position_embeddings"] = TRAINED
        with torch.inference_mode():
            logp = _reference(hf, scaling)(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(ours, want, atol=2e-4, rtol=2e-4)
        # The unstretched model scores the stretched positions otherwise (the test can fail).
        with torch.inference_mode():
            plain = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        apart = (plain[torch.arange(len(ids) - 1), torch.tensor(ids[1:])] - want).abs().max()
        assert apart > 5 * (ours - want).abs().max(), (apart, (ours - want).abs().max())
    finally:
        eng.close()


def test_what_cannot_hold_is_refused_by_name(model_dir, tmp_path):
    d, _ = model_dir
    with pytest.raises(ValueError, match=r"--max-model-len.*over the model's context of 64.*--rope-scaling"):
        _engine(d, max_model_len=128)
    with pytest.raises(ValueError, match=r"rope_factor \(--rope-factor\)"):
        _engine(d, rope_scaling="yarn")
    with pytest.raises(ValueError, match=r"rope_factor \(--rope-factor\)"):
        _engine(d, rope_scaling="yarn", rope_factor=1.0)
    with pytest.raises(ValueError, match=r"rope_scaling \(--rope-scaling\)"):
        _engine(d, rope_factor=2.0)
    with pytest.raises(ValueError, match=r"rope_scaling \(--rope-scaling\) must be one of linear, yarn"):
        _engine(d, rope_scaling="ntk", rope_factor=2.0)
    scaled = tmp_path / "scaled"
    save_with_tokenizer(tiny_hf_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}), scaled)
    with pytest.raises(ValueError, match="already scales its RoPE"):
        _engine(scaled, rope_scaling="yarn", rope_factor=2.0)


def test_stretched_blocks_are_another_models_on_disk(model_dir):
    d, _ = model_dir
    plain, yarn = _engine(d), _engine(d, rope_scaling="yarn", rope_factor=2.0)
    try:
        assert plain.block_layout.model != yarn.block_layout.model
        assert plain.block_layout.shape == yarn.block_layout.shape
    finally:
        plain.close()
        yarn.close()
