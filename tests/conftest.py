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
    """A float32 engine on the embedded model with a small pool."""
    from trajserve.config import CacheConfig, EngineConfig
    from trajserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=512)))
