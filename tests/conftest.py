import os
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: on a 2-core machine shared
# with another process, spinning made a decode step ~20x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("TRAJSERVE_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def embedded_gguf() -> Path:
    from trajserve.model.loader import default_model_path

    return Path(default_model_path())


@pytest.fixture(scope="session")
def hf_gguf_model(embedded_gguf: Path):
    """transformers' LlamaForCausalLM read from the same GGUF (float32): the
    reference no one here wrote. Loading takes ~30 s, so it is shared."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(embedded_gguf.parent), gguf_file=embedded_gguf.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def engine_f32():
    """A float32 engine on the embedded model with a small pool, on the
    default path: its weights in the GGUF's own blocks where the C kernels
    load (--quantization auto), its pool bfloat16 where AMX runs the
    prefill attention (--kv-cache-dtype auto)."""
    from trajserve.config import CacheConfig, EngineConfig
    from trajserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=512)))


@pytest.fixture(scope="session")
def engine_float_weights():
    """The same with the weights dequantized to float32 (--quantization
    none) and a float32 KV pool: what transformers computes from the GGUF,
    checked against it to 1e-3; quantized execution is checked against this one."""
    from trajserve.config import CacheConfig, EngineConfig
    from trajserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(dtype="float32", quantization="none",
                                  cache=CacheConfig(num_blocks=512, kv_cache_dtype="float32")))


@pytest.fixture(scope="module")
def scripted():
    """An in-process server whose model says what `scripted.reply` holds."""
    import anthropic
    import openai
    from fastapi.testclient import TestClient

    from trajserve.config import CacheConfig, EngineConfig
    from trajserve.engine.engine import LLMEngine
    from trajserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from trajserve.server.app import build_app
    from trajserve.server.config import ServerConfig

    engine = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=64,
                                                                       enable_prefix_caching=False)))
    # The reply, how it ends (finish_reason, stop_reason) and the prompt
    # tokens the prefix cache is said to have served.
    state = {"reply": "", "prompts": [], "params": [], "end": ("stop", None), "cached": 0}

    async def generate(prompt, params, cache_salt=None, is_disconnected=None, lora=None, priority=0, program=None,
                       deadline_s=None):
        state["prompts"].append(prompt)
        state["params"].append(params)
        text = state["reply"]
        pieces = [text[i:i + 5] for i in range(0, len(text), 5)] or [""]  # 5-character deltas: tags arrive split
        for n, piece in enumerate(pieces, 1):
            done = n == len(pieces)
            c = CompletionOutput(0, text[:5 * n], list(range(n)), *(state["end"] if done else (None, None)),
                                 delta_text=piece, delta_token_ids=[n])
            yield RequestOutput("r", None, list(prompt), [c], done, RequestMetrics(0.0), state["cached"])

    def app_over(config: ServerConfig):
        app = build_app(engine, config)  # its engine loop never starts: the script stands in for it
        app.state.engine.generate = generate
        return app

    for key, parser in (("client", "auto"), ("llama3", "llama3_json")):
        state[key] = openai.OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0, http_client=TestClient(
            app_over(ServerConfig(served_model_names=("m",), tool_call_parser=parser))))
    # Anthropic's client on the same app, under two model names (aliases).
    app = app_over(ServerConfig(served_model_names=("m", "claude-test")))
    state["http"] = TestClient(app)
    state["anthropic"] = anthropic.Anthropic(base_url="http://testserver", api_key="x", max_retries=0,
                                             http_client=TestClient(app))
    state["tok"] = engine.tokenizer
    state["app_over"] = app_over  # an app under another ServerConfig, on the same script
    return state
