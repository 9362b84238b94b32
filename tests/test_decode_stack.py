"""A decode step's layers in one C call (model/decode_stack.py) give the
per-layer path's bits: the same greedy tokens and the same logprobs, to the
last bit, for every kind of product, pool and layer it runs; it runs on the
decode-only steps and nowhere else."""
import gguf
import pytest
import torch

from greedy_runs import prompts
from test_loader import write_gguf
from tiny_models import save_with_tokenizer, tiny_hf_model
from trajserve.config import CacheConfig, EngineConfig, SchedulerConfig
from trajserve.engine.engine import LLMEngine
from trajserve.model import cpu_kernels
from trajserve.model.decode_stack import DecodeStack
from trajserve.model.linear import QLinearParts
from trajserve.sampling import SamplingParams

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler or no AVX2 here")
SP = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
Q4_0, Q8_0, Q4_K, Q5_K, Q6_K = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0,
                                gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K,
                                gguf.GGMLQuantizationType.Q6_K)


@pytest.fixture
def stack_calls(monkeypatch) -> list[int]:
    """Rows of every decode step the stack ran."""
    calls: list[int] = []
    run = DecodeStack.__call__

    def counted(self, x, *a):
        calls.append(x.shape[0])
        return run(self, x, *a)
    monkeypatch.setattr(DecodeStack, "__call__", counted)
    return calls


def _model(tmp_path, case: str):
    """(model path, engine keywords) of each case."""
    torch.manual_seed(3)
    if case == "float weights, GQA":
        m = tiny_hf_model("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=300)
        save_with_tokenizer(m, tmp_path)
        return tmp_path, {}
    if case == "qwen2 biases, q4_0 at load, bf16 pool":
        m = tiny_hf_model("qwen2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=300)
        save_with_tokenizer(m, tmp_path)
        return tmp_path, {"quantization": "q4_0", "kv": "bfloat16"}
    if case == "qwen3 q/k norms":
        m = tiny_hf_model("qwen3", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=300)
        save_with_tokenizer(m, tmp_path)
        return tmp_path, {}
    if case == "sliding window, all-global q4_0 pool":  # (a quantized pool's rows: head_dim 32)
        m = tiny_hf_model("mistral", hidden_size=128, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=1, vocab_size=300, sliding_window=12)
        save_with_tokenizer(m, tmp_path)
        return tmp_path, {"kv": "q4_0", "free_window_blocks": False}
    path = tmp_path / "tiny.gguf"
    if case == "q4_0 with v and down in q8_0, q8_0 pool":
        m = tiny_hf_model("llama", hidden_size=128, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=300)
        write_gguf(path, m, "llama", Q4_0, qtypes={".v_proj.": Q8_0, ".down_proj.": Q8_0}, tokenizer=True)
        return path, {"kv": "q8_0"}
    assert case in ("Q4_K with v and down in Q6_K", "Q5_K with v and down in Q6_K")  # Q4_K_M's, Q5_K_M's mix
    m = tiny_hf_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300)
    write_gguf(path, m, "llama", Q4_K if case.startswith("Q4_K") else Q5_K,
               qtypes={".v_proj.": Q6_K, ".down_proj.": Q6_K}, tokenizer=True)
    return path, {}


def _engine(path, kw: dict, off: tuple[str, ...]) -> LLMEngine:
    cache = CacheConfig(num_blocks=96, block_size=4, kv_cache_dtype=kw.get("kv", "float32"),
                        free_window_blocks=kw.get("free_window_blocks", True))
    # Speculation off: every step after the prompts' is a decode step (its verifying chunks would not be).
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", cache=cache, kernel_paths_off=off,
                                  quantization=kw.get("quantization", "auto"),
                                  scheduler=SchedulerConfig(speculative="off")))


def _greedy(eng: LLMEngine) -> list[tuple]:
    """Tokens and top logprobs of three prompts, the first a step ahead (so
    steps mix a decode with prefill chunks as well as decode alone)."""
    batch = prompts()
    rids = [eng.add_request(batch[0], SP)]
    eng.step()
    rids += [eng.add_request(p, SP) for p in batch[1:]]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
    return [(list(done[r].token_ids), done[r].logprobs) for r in rids]


@pytest.mark.parametrize("case", ["float weights, GQA", "qwen2 biases, q4_0 at load, bf16 pool", "qwen3 q/k norms",
                                  "sliding window, all-global q4_0 pool", "q4_0 with v and down in q8_0, q8_0 pool",
                                  "Q4_K with v and down in Q6_K", "Q5_K with v and down in Q6_K"])
def test_the_stack_gives_the_per_layer_paths_bits(tmp_path, case, stack_calls):
    path, kw = _model(tmp_path, case)
    alone = _greedy(_engine(path, kw, ("decode_stack",)))
    assert stack_calls == []
    eng = _engine(path, kw, ())
    if case.startswith(("q4_0 with", "Q4_K", "Q5_K")):  # the fused q|k|v of two formats: one product per part
        assert isinstance(eng.model.layers[0].qkv, QLinearParts)
    assert _greedy(eng) == alone
    # It ran the decode-only steps, of 1 to 3 rows: the prompts' chunks were
    # steps it left to the per-layer path.
    assert len(stack_calls) >= 20 and set(stack_calls) <= {1, 2, 3} and 3 in stack_calls


def test_the_embedded_model_decodes_the_same_on_the_stack(embedded_gguf, stack_calls):
    """The default model on the default path (its Q4_1 / Q8_0 blocks as
    stored), two threads and one."""
    kw = {"kv": "float32"}
    alone = _greedy(_engine(embedded_gguf, kw, ("decode_stack",)))
    assert _greedy(_engine(embedded_gguf, kw, ())) == alone
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _greedy(_engine(embedded_gguf, kw, ())) == alone
    finally:
        torch.set_num_threads(threads)
    assert stack_calls


@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe", "gemma3", "deepseek_v2", "gpt_oss"])
def test_models_it_does_not_run_keep_the_per_layer_path(tmp_path, kind):
    """Experts, Gemma's norms, latent attention, sinks: no stack."""
    save_with_tokenizer(tiny_hf_model(kind), tmp_path)
    model = _engine(tmp_path, {}, ()).model
    assert model.kernels is not None and model.stack is None


def test_steps_it_does_not_run(tmp_path, stack_calls):
    """A window pool's steps (each layer reads its own pages) go the per-layer way."""
    m = tiny_hf_model("mistral", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=1, vocab_size=300, sliding_window=12)
    save_with_tokenizer(m, tmp_path)
    eng = _engine(tmp_path, {"free_window_blocks": True}, ())
    assert eng.model.stack is not None
    _greedy(eng)
    assert stack_calls == []  # every step read the pool through each layer's own pages
