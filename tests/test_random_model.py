"""`bench random-model`: a GGUF of a catalog shape with random weights that
the engine loads with the shape read back from the file, the tokenizer padded
to the shape's vocabulary."""
import gguf

from trajserve.bench.random_model import write_random_gguf
from trajserve.config import ModelConfig, MoESpec
from trajserve.llm import LLM
from trajserve.plan.catalog import get_model
from trajserve.plan.model_shapes import read_gguf_config, total_params
from trajserve.sampling import SamplingParams


def test_a_written_shape_reads_back_and_serves(tmp_path):
    cfg = ModelConfig("qwen3", vocab_size=49152 + 40, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, max_position_embeddings=4096,
                      tie_word_embeddings=False, name="t")
    path = tmp_path / "r.gguf"
    write_random_gguf(cfg, path, "q8_0")
    back = read_gguf_config(path)
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "qk_norm", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(back, f) == getattr(cfg, f), f
    assert total_params(back) == total_params(cfg)
    tokens = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == cfg.vocab_size and tokens[-1] == "<|unused_39|>"
    llm = LLM(model=str(path), num_blocks=32)
    assert set(llm.engine.model.weight_formats()) <= {"q8_0", "float32"}
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_routed_shape_reads_back_with_its_experts(tmp_path):
    """A MoE shape is written as llama.cpp's qwen3moe (router, stacked
    experts): the engine reads the experts back and serves it."""
    cfg = ModelConfig("qwen3_moe", vocab_size=49152, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, max_position_embeddings=4096,
                      moe=MoESpec(8, 2, 64, True, (0, 1)), name="t")
    path = tmp_path / "moe.gguf"
    write_random_gguf(cfg, path, "q8_0")
    back = read_gguf_config(path)
    assert back.moe == cfg.moe and back.architecture == "qwen3_moe"
    assert total_params(back) == total_params(cfg)
    llm = LLM(model=str(path), num_blocks=32)
    routed = [L.moe for L in llm.engine.model.layers]
    assert all(m is not None and len(m.experts) == 8 for m in routed)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_catalog_shapes_for_speed_runs():
    m = get_model("smollm2-1.7b")
    assert (m.config.num_layers, m.config.hidden_size, m.config.intermediate_size) == (24, 2048, 8192)
    assert total_params(m.config) == m.params == 1_711_376_384
    assert total_params(get_model("llama-3.2-3b").config) == 3_212_749_824


def test_a_gemma3_shape_and_its_all_global_twin(tmp_path):
    """A Gemma 3 shape is written as llama.cpp's gemma3 (its window and
    per-layer pattern, sandwich and query-key norms); the twin has no window
    layer. The engine frees window pages for the first, not the second."""
    import dataclasses

    from trajserve.config import WindowSpec

    base = get_model("gemma-3-1b").config
    assert base.window == WindowSpec(512, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 18, 19, 20, 21, 22,
                                           24, 25))
    small = dataclasses.replace(base, vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=6,
                                num_heads=4, num_kv_heads=1, head_dim=16, max_position_embeddings=4096,
                                window=WindowSpec(32, (0, 1, 2, 3, 4)))
    for window, name in ((small.window, "g.gguf"), (None, "global.gguf")):
        path = tmp_path / name
        write_random_gguf(dataclasses.replace(small, window=window), path, "q8_0")
        back = read_gguf_config(path)
        assert back.architecture == "gemma3" and back.sandwich_norms and back.qk_norm
        assert (back.window.size, back.window.layers) == (32, (0, 1, 2, 3, 4)) if window else back.window is None
        llm = LLM(model=str(path), num_blocks=64)
        assert llm.engine.kv.windowed == (window is not None)
        out = llm.generate(["Hello " * 40], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_a_gpt_oss_shape_with_mxfp4_experts(tmp_path):
    """A gpt-oss shape is written as llama.cpp's gpt-oss (biases, sinks,
    every other layer a window, MXFP4 experts as the release ships them):
    the engine reads it as gpt-oss, runs its experts as stored, and serves it."""
    import dataclasses

    from trajserve.config import WindowSpec

    base = get_model("gpt-oss-20b").config
    assert (base.num_layers, base.moe.num_experts, base.moe.top_k) == (24, 32, 4)
    small = dataclasses.replace(base, vocab_size=49152, hidden_size=64, intermediate_size=64, num_layers=4,
                                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
                                window=WindowSpec(16, (0, 2)), moe=dataclasses.replace(base.moe, layers=(0, 1, 2, 3),
                                                                                       expert_size=64))
    path = tmp_path / "oss.gguf"
    write_random_gguf(small, path, "q8_0", experts="mxfp4")
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0 and "blk.3.attn_sinks.weight" in types
    back = read_gguf_config(path)
    assert back.architecture == "gpt_oss" and back.attn_sinks and back.mlp_bias
    assert (back.window.size, back.window.layers) == (16, (0, 2)) and back.moe.scoring == "topk_softmax"
    llm = LLM(model=str(path), num_blocks=64)
    assert llm.engine.model.layers[0].moe is not None
    assert set(llm.engine.model.weight_formats()) == {"q8_0", "mxfp4", "float32"}
    out = llm.generate(["Hello " * 20], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
