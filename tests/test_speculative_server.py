"""`trajserve serve --speculative ngram`: the same greedy text as the engine
without speculation, streamed or not; usage reports the accepted and
rejected draft tokens (OpenAI's prediction-token fields) and /metrics the
drafts, acceptance and mean accepted length."""
from __future__ import annotations

import openai
import pytest

from server_util import ServerProcess
from test_server import reference
from test_speculative_engine import LINES

MODEL = "smol"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--dtype", "float32", "--num-blocks", "1024", "--served-model-name", MODEL,
                      "--speculative", "ngram")
    yield s
    s.close()


def test_served_with_speculation_same_text_usage_and_metrics(server, engine_f32):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "Repeat this text exactly:\n\n" + "\n".join(LINES)}]
    want = reference(engine_f32, messages, 80)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0)
    assert r.choices[0].message.content == want.text
    d = r.usage.completion_tokens_details
    assert d.accepted_prediction_tokens > 20 and d.rejected_prediction_tokens >= 0
    assert d.accepted_prediction_tokens < r.usage.completion_tokens
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text
    streamed = stream[-1].usage.completion_tokens_details
    assert streamed.accepted_prediction_tokens > 20
    m = server.metrics()
    # Both replies' accepted drafts (each may differ: a draft's length follows the measured step cost).
    assert m["trajserve_spec_decode_accepted_tokens_total"] == \
        d.accepted_prediction_tokens + streamed.accepted_prediction_tokens
    assert m["trajserve_spec_decode_draft_tokens_total"] >= m["trajserve_spec_decode_accepted_tokens_total"]
    assert 0 < m["trajserve_spec_decode_acceptance_ratio"] <= 1
    assert m["trajserve_spec_decode_mean_accepted_length"] > 1
