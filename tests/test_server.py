"""A live `trajserve serve` on 127.0.0.1, driven by the real `openai` client
and by raw HTTP. Greedy outputs are compared with the in-process engine."""
from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine_util import run_requests
from server_util import ServerProcess
from trajserve.sampling import SamplingParams

MODEL = "smol"
SYSTEM = ("You are a coding agent. Tools: read_file(path), write_file(path, text), run_tests(). "
          "Explain the plan before calling a tool. ") * 4


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--dtype", "float32", "--num-blocks", "1024", "--served-model-name", MODEL)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def reference(engine, messages, max_tokens):
    """Greedy tokens of the in-process float32 engine, the request alone."""
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    rid = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0))
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                return o.outputs[0]


def wait_idle(server, timeout=60):
    """No request runs or waits and every used block belongs to the prefix
    cache (none leaked to a dead block table)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (m["trajserve_num_requests_running"] == 0 and m["trajserve_num_requests_waiting"] == 0
                and m["trajserve_kv_free_blocks"] + m["trajserve_kv_cached_blocks"] == m["trajserve_kv_blocks"])
        if idle:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle: {m}")
        time.sleep(0.2)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.head(server.url + "/health").status_code == 200
    # A browser's CORS preflight (any origin, as vLLM by default).
    r = httpx.options(server.url + "/v1/chat/completions", headers={
        "origin": "http://localhost:3000", "access-control-request-method": "POST",
        "access-control-request-headers": "content-type,authorization"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://localhost:3000")


def test_the_base_url_answers_and_every_response_is_counted(server):
    """Clients probe the base URL first (Claude Code sends HEAD /); /metrics
    counts each answer by its status code, refusals included."""
    def count(m, code):
        return m.get(f'trajserve_http_responses_total{{code="{code}"}}', 0.0)
    before = server.metrics()
    assert httpx.head(server.url + "/").status_code == 200
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.json()["server"] == "trajserve"
    assert httpx.get(server.url + "/no-such-route").status_code == 404
    assert httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL}).status_code == 422
    after = server.metrics()
    # 200: HEAD /, GET /, and the /metrics read that took `before` (counted as its answer started).
    assert [count(after, c) - count(before, c) for c in ("200", "404", "422")] == [3, 1, 1]


def test_chat_completion_matches_the_engine(client, engine_f32):
    msgs = [{"role": "user", "content": "Name three prime numbers."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    ref = reference(engine_f32, msgs, 16)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_chat_concatenates_to_the_full_text(client, engine_f32):
    msgs = [{"role": "user", "content": "Write a haiku about caches."}]
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    ref = reference(engine_f32, msgs, 20)
    assert "".join(parts) == ref.text
    assert finish == ref.finish_reason
    assert usage is not None and usage.completion_tokens == len(ref.token_ids)


def test_n2_stop_and_seed(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story."}],
                                       n=2, max_tokens=12, temperature=1.0, seed=5)
    assert [c.index for c in r.choices] == [0, 1]
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story."}],
                                           n=2, max_tokens=12, temperature=1.0, seed=5)
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
    c = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"])
    assert c.choices[0].finish_reason == "stop"
    assert " 7" not in c.choices[0].text and c.choices[0].text.strip().startswith("5")


def test_the_readme_client_example_runs_against_the_server(server, capsys):
    """README's OpenAI-client block as written, only the port is the test
    server's: the model it lists, a reply and the cached-token count."""
    from test_readme import python_blocks

    (block,) = python_blocks(client=True)
    assert "http://127.0.0.1:8000/v1" in block
    ns: dict = {}
    exec(compile(block.replace("http://127.0.0.1:8000/v1", server.url + "/v1"), "README.md", "exec"), ns)
    assert ns["model"] == MODEL
    assert ns["r"].choices[0].message.content and ns["r"].usage.completion_tokens <= 32
    assert capsys.readouterr().out.startswith(ns["r"].choices[0].message.content)


def test_second_turn_reports_cached_tokens(client):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files."}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Open main.py."}]
    second = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0
    assert cached >= first.usage.prompt_tokens - 16


def test_anthropic_messages_with_the_real_model(server, engine_f32):
    """/v1/messages through the official anthropic client: greedy text equals
    the engine's for the same conversation, streamed and not; a second turn
    over the same system prompt reads it from the prefix cache."""
    import anthropic

    a = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    user = [{"role": "user", "content": "Name three prime numbers."}]
    ref = reference(engine_f32, [{"role": "system", "content": SYSTEM}] + user, 16)
    r = a.messages.create(model=MODEL, max_tokens=16, system=SYSTEM, messages=user, extra_body={"temperature": 0})
    assert r.content[0].text == ref.text
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.finish_reason]
    assert r.usage.output_tokens == len(ref.token_ids)
    with a.messages.stream(model=MODEL, max_tokens=16, system=SYSTEM, extra_body={"temperature": 0},
                           messages=user + [{"role": "assistant", "content": r.content[0].text},
                                            {"role": "user", "content": "And two more?"}]) as st:
        text = "".join(st.text_stream)
        final = st.get_final_message()
    assert text == final.content[0].text and final.usage.output_tokens > 0
    # The system prompt and the first turn were computed before.
    assert final.usage.cache_read_input_tokens >= r.usage.input_tokens + r.usage.cache_read_input_tokens - 16
    assert final.usage.cache_read_input_tokens % 16 == 0
    # Over the context, in Anthropic's words (clients compact their history on them).
    with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: \d+ tokens > 8191 maximum"):
        a.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hello " * 8300}])


def test_responses_api_with_the_real_model(client, engine_f32):
    """/v1/responses through the official openai client: greedy text equals
    the engine's; a second response continued by previous_response_id reads
    the first turn from the prefix cache, streamed."""
    user = "Name three prime numbers."
    ref = reference(engine_f32, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], 16)
    first = client.responses.create(model=MODEL, instructions=SYSTEM, input=user, max_output_tokens=16,
                                    temperature=0)
    assert first.output_text == ref.text and first.usage.output_tokens == len(ref.token_ids)
    assert first.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    # Raw events: the client's stream helper insists on response.completed,
    # and a reply cut at max_output_tokens ends with response.incomplete.
    events = list(client.responses.create(model=MODEL, instructions=SYSTEM, input="And two more?",
                                          max_output_tokens=8, temperature=0, previous_response_id=first.id,
                                          stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    second = events[-1].response
    text = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    assert text == second.output_text and second.usage.output_tokens > 0
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16


def test_completions_logprobs_and_batch(client):
    r = client.completions.create(model=MODEL, prompt=["The sky is", "Water is"], max_tokens=4,
                                  temperature=0, logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert all(v <= 0 for v in lp.token_logprobs)
        # Greedy: the chosen token is the most likely one.
        assert all(abs(max(t.values()) - v) < 1e-5 for t, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_echo_scores_the_prompt_as_lm_eval_does(client, engine_f32):
    """lm-evaluation-harness's loglikelihood request: echo + logprobs over
    context + continuation; the prompt's logprobs are the engine's own."""
    text = "The capital of France is Paris"
    r = client.completions.create(model=MODEL, prompt=[text, "Water is"], max_tokens=1, temperature=0,
                                  logprobs=1, echo=True)
    ids = engine_f32.tokenizer.encode(text)
    want = run_requests(engine_f32, [(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))])[0]
    c = r.choices[0]
    assert c.text == text + want.outputs[0].text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 1 and "".join(lp.tokens) == c.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(abs(a - b[0]) < 1e-4 for a, b in zip(lp.token_logprobs[1:len(ids)], want.prompt_logprobs[1:]))
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    # top_logprobs: the likeliest and the token itself (vLLM's), so lm-eval's max() has something to take.
    for t, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[t] == v and 1 <= len(top) <= 2 and max(top.values()) >= v
    water = len(engine_f32.tokenizer.encode("Water is"))
    assert r.choices[1].text.startswith("Water is") and r.usage.prompt_tokens == len(ids) + water
    # Streamed, the first chunk carries the prompt; the chunks add up to the
    # same text and logprobs, offsets counted from the start of the whole text.
    kw = dict(model=MODEL, prompt=text, max_tokens=3, temperature=0, echo=True, logprobs=2)
    chunks = list(client.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].text.startswith(text)
    whole = client.completions.create(**kw).choices[0]
    assert "".join(ch.choices[0].text for ch in chunks) == whole.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(ch.choices[0].logprobs, field) for ch in chunks), []) == getattr(whole.logprobs, field)
    # Each output keeps its own top-k though the engine scored the prompt with the larger.
    r = httpx.post(client.base_url.join("completions").__str__(), timeout=120, json={
        "model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1,
        "prompt_logprobs": 3}).json()["choices"][0]
    assert all(len(top) <= 2 for top in r["logprobs"]["top_logprobs"][1:])
    assert all(3 <= len(e) <= 4 for e in r["prompt_logprobs"][1:])


def test_echo_with_max_tokens_0_scores_the_prompt_only(server, client):
    """The legacy scoring request (echo, max_tokens 0, logprobs): the prompt
    with its logprobs, nothing generated; max_tokens 0 without echo is a 400."""
    text = "The capital of France is Paris"
    kw = dict(model=MODEL, prompt=[text, "Water is wet"], max_tokens=0, temperature=0, echo=True, logprobs=1)
    r = client.completions.create(**kw)
    scored = client.completions.create(**{**kw, "max_tokens": 1})
    for c, s in zip(r.choices, scored.choices):
        assert s.text.startswith(c.text) and c.text in (text, "Water is wet") and c.finish_reason == "length"
        assert c.logprobs.token_logprobs == s.logprobs.token_logprobs[:-1]
        assert c.logprobs.tokens == s.logprobs.tokens[:-1]
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == scored.usage.prompt_tokens
    chunks = list(client.completions.create(stream=True, **kw))
    by_index = {}
    for ch in chunks:
        for c in ch.choices:
            by_index.setdefault(c.index, []).append(c)
    for c in r.choices:
        got = by_index[c.index]
        assert "".join(x.text for x in got) == c.text and got[-1].finish_reason == "length"
        assert sum((x.logprobs.token_logprobs for x in got), []) == c.logprobs.token_logprobs
    bad = httpx.post(server.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "hi",
                                                                       "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert "0 is allowed only with echo=true" in bad.json()["error"]["message"]
    wait_idle(server)


def test_streaming_several_prompts_interleaves_their_choices(server, client):
    """stream=true with a list of prompts (vLLM takes it): choice i * n + k
    of the stream is choice i * n + k of the reply without stream."""
    prompts = ["The sky is", "Water is", "def add(a, b):"]
    kw = dict(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2, logprobs=1, echo=True)
    whole = client.completions.create(**kw)
    texts, lps, usage = {}, {}, None
    for ch in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
        usage = ch.usage or usage
    assert sorted(texts) == list(range(6))
    for c in whole.choices:
        assert texts[c.index] == c.text and lps[c.index] == c.logprobs.token_logprobs
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == 30
    # One prompt the engine refuses (over the context): a 400 before any
    # chunk, and the prompt queued beside it is aborted, its blocks freed.
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": [[1] * 40, [1] * 9000], "max_tokens": 200, "stream": True})
    assert r.status_code == 400 and "max_model_len is 8,192" in r.json()["error"]["message"], r.text
    wait_idle(server)


def test_prompt_logprobs_field_in_vllm_shape(server, engine_f32):
    ids = engine_f32.tokenizer.encode("def add(a, b):\n    return a + b")
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    want = run_requests(engine_f32, [(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))])[0]
    assert plp[0] is None and len(plp) == len(ids)
    for t, entry, (lp, alts, rank) in zip(ids[1:], plp[1:], want.prompt_logprobs[1:]):
        # The token itself (with its rank) and the top 2 (ranks 1 and 2).
        assert abs(entry[str(t)]["logprob"] - lp) < 1e-4 and entry[str(t)]["rank"] == rank
        assert sorted(e["rank"] for k, e in entry.items() if int(k) in alts) == [1, 2]
        assert len(entry) == 2 + (t not in alts)
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": HI, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_logit_bias_and_penalties_reach_the_sampler(client):
    """OpenAI's logit_bias (string token ids) forces a token; a frequency
    penalty changes a greedy reply that repeats itself."""
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logit_bias={"28": 100})
    assert r.choices[0].text == "," * 3  # token 28 is ","
    kw = dict(model=MODEL, prompt="red, blue, red, blue, red, blue,", max_tokens=12, temperature=0)
    assert client.completions.create(**kw).choices[0].text != \
        client.completions.create(frequency_penalty=2.0, **kw).choices[0].text


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run_tests", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 30}}, "required": ["path"],
        "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_forced_tool_choice_makes_the_model_call_as_asked(client):
    """The embedded model never calls a tool by itself; a forced tool_choice
    holds its reply to the call's JSON, so it does."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER, max_tokens=60, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "run_tests"}})
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None
    assert call.function.name == "run_tests" and set(json.loads(call.function.arguments)) == {"path"}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER, max_tokens=80, temperature=0,
                                       tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for c in calls:
        args = json.loads(c.function.arguments)
        assert (c.function.name, set(args)) in (("get_weather", {"city"}), ("run_tests", {"path"}))
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER, max_tokens=80, temperature=0,
                                         tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    streamed = [tc for ch in client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER, max_tokens=80,
                                                            temperature=0, tool_choice="required", stream=True)
                if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed] == \
        [(c.function.name, c.function.arguments) for c in calls]


def test_response_format_and_guided_fields_hold_the_reply(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "celsius": {"type": "integer"}},
              "required": ["city", "celsius"], "additionalProperties": False}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": schema}})
    d = json.loads(r.choices[0].message.content)
    assert set(d) == {"city", "celsius"} and type(d["celsius"]) is int
    r = client.completions.create(model=MODEL, prompt="Is the sky green? Answer:", max_tokens=5, temperature=0,
                                  extra_body={"guided_choice": [" yes", " no"]})
    assert r.choices[0].text in (" yes", " no")
    r = client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text)


# --------------------------------------------------------------- bad input
HI = [{"role": "user", "content": "hi"}]
BAD = [
    ("malformed JSON", "/v1/chat/completions", b'{"model": "smol", "messages": [', 400, "JSON"),
    ("unknown model", "/v1/chat/completions",
     {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "gpt-9"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 422, "messages"),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 422, "messages"),
    ("wrong type", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 422, "max_tokens"),
    ("bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
     422, "role"),
    ("top_p out of range", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400, "top_p"),
    ("max_tokens 0", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("prompt over the context", "/v1/completions", {"model": MODEL, "prompt": [1] * 9000}, 400, "8,192"),
    ("token id outside the vocabulary", "/v1/completions", {"model": MODEL, "prompt": [10**7]}, 400, "vocabulary"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "empty"),
    ("presence_penalty out of range", "/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5},
     400, "presence_penalty must be in [-2, 2]"),
    ("logit_bias key not a token id", "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"a": 1}},
     400, "logit_bias keys must be token ids"),
    ("constraint that does not compile", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "guided_json": {"type": "nonsense"}}, 400, "does not compile"),
    ("two constraints", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
     "guided_regex": "a+", "response_format": {"type": "json_object"}}, 400, "one output constraint per request"),
    ("forced tool not among the tools", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": WEATHER,
      "tool_choice": {"type": "function", "function": {"name": "rm_rf"}}}, 400, "'rm_rf', which is not among"),
    ("logit_bias outside the vocabulary", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "logit_bias": {"49152": 1}}, 400, "logit_bias token id 49152"),
    # A seed over 64 bits used to fail inside a step and stop the engine for everyone.
    ("seed over 64 bits", "/v1/chat/completions", {"model": MODEL, "messages": HI, "seed": 2**64}, 400,
     "seed must be an integer in [-9223372036854775808, 9223372036854775807]"),
    # A huge n used to build its lists on the engine thread until memory ran out.
    ("n over the limit", "/v1/chat/completions", {"model": MODEL, "messages": HI, "n": 2**70}, 400,
     "n must be an integer in [1, 128]"),
    ("max_tokens over the context", "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 10**6},
     400, "max_tokens is too large: 1,000,000. The context holds 8,192 tokens"),
    ("max_tokens over what the prompt leaves", "/v1/completions",
     {"model": MODEL, "prompt": [1] * 8190, "max_tokens": 16}, 400, "(16 > 8,192 - 8,190)"),
    ("suffix", "/v1/completions", {"model": MODEL, "prompt": "def f():", "suffix": "return 1"}, 400,
     "suffix is not supported"),
    ("best_of", "/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of is not supported"),
    ("stream_options without stream", "/v1/chat/completions",
     {"model": MODEL, "messages": HI, "stream_options": {"include_usage": True}}, 400,
     "stream_options is only allowed with stream=true"),
    ("top_logprobs out of range", "/v1/chat/completions",
     {"model": MODEL, "messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs must be in [0, 20]"),
    ("image part", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400,
     "messages.0.content.0: image_url parts are not supported"),
    ("prompt_logprobs with stream", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs is not available with stream=true"),
    ("prompt_logprobs out of range", "/v1/chat/completions", {"model": MODEL, "messages": HI, "prompt_logprobs": 21},
     400, "prompt_logprobs must be in [0, 20], got 21"),
    ("no such route", "/v1/embeddings", {"model": MODEL, "input": "hi"}, 404, "no route POST /v1/embeddings"),
]


@pytest.mark.parametrize("name, path, body, status, words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, client, name, path, body, status,
                                                                    words):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(server.url + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"]
    first = err["message"].split(" ", 1)[0]
    if isinstance(body, dict) and first in body:  # a value out of range: the field is named as OpenAI's param
        assert err["param"] == first, err
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert ok.choices[0].text


def test_body_over_the_cap_is_413(server, client):
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (9 * 2**20),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    # Chunked, the body has no Content-Length: it is counted as it arrives.
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": "x" * (9 * 2**20)}).encode()
    r = httpx.post(server.url + "/v1/completions", content=(body[i:i + 2**16] for i in range(0, len(body), 2**16)),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "over the limit of 8,388,608 bytes" in r.json()["error"]["message"], r.text
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices[0].text
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"},
                   headers={"content-type": "text/plain"}, timeout=60)
    assert r.status_code == 422 and "Content-Type: application/json" in r.json()["error"]["message"], r.text


def test_prompt_larger_than_the_pool_is_400():
    with ServerProcess("--dtype", "float32", "--num-blocks", "8", "--served-model-name", MODEL) as s:
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": [1] * 200}, timeout=60)
        assert r.status_code == 400 and "KV pool" in r.json()["error"]["message"], r.text


# ------------------------------------------------------------- concurrency
def test_32_concurrent_streams_match_solo_runs_and_leave_the_pool_idle(server, engine_f32):
    questions = [f"Task {i}: which file defines function number {i}?" for i in range(32)]
    msgs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions]
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)

    async def one(m):
        stream = await aclient.chat.completions.create(model=MODEL, messages=m, max_tokens=8, temperature=0,
                                                       stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def all_():
        return await asyncio.gather(*(one(m) for m in msgs))

    texts = asyncio.run(all_())
    for m, text in zip(msgs, texts):
        assert text == reference(engine_f32, m, 8).text
    wait_idle(server)


def test_client_disconnect_mid_stream_frees_its_blocks(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    aborts = server.metrics().get('trajserve_requests_total{finish_reason="abort"}', 0)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        got = [json.loads(x[6:]) for x in (next(lines) for _ in range(12)) if x.startswith("data: {")]
        assert got
        m = server.metrics()
        assert m["trajserve_num_requests_running"] == 1
    # Leaving the block closed the connection: the request is aborted, its blocks freed.
    m = wait_idle(server, timeout=30)
    assert m['trajserve_requests_total{finish_reason="abort"}'] == aborts + 1


def test_client_gone_from_a_non_streaming_request_stops_it(server):
    """A non-streaming request's client is checked while it decodes, not
    only when no token arrives: 2,000 tokens would take about a minute, the
    client leaves after 3 s, and the server is idle within seconds."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=3)
    wait_idle(server, timeout=10)
    # Gone before the first token (during a long prefill): no output at all,
    # which the handler must take as a disconnect, not an error.
    server.stderr_so_far()
    for i in range(3):  # the later ones are still queued when they go
        # ~4,000 distinct tokens each (no shared prefix to reuse): over a second of prefill even at
        # ~3,000 tokens/s (AMX), where 0.3 s is the client's patience.
        body = {"model": MODEL, "prompt": f"{i}. " + SYSTEM * 40, "max_tokens": 4}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    wait_idle(server, timeout=60)
    time.sleep(1)
    assert "Exception in ASGI application" not in server.stderr_so_far()


def test_full_admission_queue_is_429_with_retry_after():
    with ServerProcess("--dtype", "float32", "--num-blocks", "256", "--max-num-seqs", "1", "--max-waiting", "1",
                       "--served-model-name", MODEL) as s:
        long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0,
                "ignore_eos": True}

        async def until(name: str, value: float) -> None:
            # The state itself, not a sleep: on a loaded machine the first
            # request may not have been admitted a second later.
            while s.metrics()[name] != value:
                await asyncio.sleep(0.05)

        async def run():
            async with httpx.AsyncClient(base_url=s.url, timeout=300) as c:
                first = asyncio.create_task(c.post("/v1/completions", json=long))
                await asyncio.wait_for(until("trajserve_num_requests_running", 1), 120)
                second = asyncio.create_task(c.post("/v1/completions", json=long))
                await asyncio.wait_for(until("trajserve_num_requests_waiting", 1), 120)
                third = await c.post("/v1/completions", json=long)
                first.cancel()
                second.cancel()
                return third
        third = asyncio.run(run())
        assert third.status_code == 429, third.text
        assert int(third.headers["retry-after"]) >= 1
        assert "limit is 1" in third.json()["error"]["message"]


# ------------------------------------------------------------- bench serve
def test_bench_serve_shared_prefix_and_agent(server):
    from test_cli import trajserve

    r = trajserve("bench", "serve", "--base-url", server.url, "--dataset", "shared-prefix", "--num-prompts", "6",
                  "--input-len", "16", "--output-len", "4", "--prefix-len", "96", "--request-rate", "20",
                  "--goodput", "ttft:60000", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["successful_requests"] == 6 and res["failed_requests"] == 0
    assert res["output_tokens"] == 6 * 4 and res["prompt_tokens"] == 6 * (96 + 16)
    assert res["cached_prompt_tokens"] > 0  # the 96-token prefix is computed once
    assert res["goodput"]["requests_per_s"] > 0 and res["ttft"]["p99_ms"] >= res["ttft"]["median_ms"]
    r = trajserve("bench", "serve", "--base-url", server.url, "--dataset", "agent", "--num-prompts", "2",
                  "--turns", "2", "--input-len", "24", "--output-len", "4", "--prefix-len", "60", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["successful_requests"] == 4 and res["cached_prompt_tokens"] > 0


def test_bench_serve_sweeps_rates_and_reports_the_knee(server):
    from test_cli import trajserve

    r = trajserve("bench", "serve", "--base-url", server.url, "--num-prompts", "4", "--input-len", "16",
                  "--output-len", "4", "--sweep-rate", "40,20", "--goodput", "ttft:60000", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert [row["rate"] for row in res["rates"]] == [20, 40]
    for row in res["rates"]:
        assert row["completed"] > 0 and row["goodput"] == pytest.approx(row["completed"]) and row["refused"] == 0
        assert row["in_system"] > 0  # Little's law: completed per second times their mean time in the system
    best = max(res["rates"], key=lambda row: row["goodput"])
    assert res["knee"]["rate"] == best["rate"] and res["knee"]["goodput"] == best["goodput"]
    assert res["server_admission_cap"] is None  # this server has no --admission
    r = trajserve("bench", "serve", "--base-url", server.url, "--sweep-rate", "4", "--json")
    assert r.returncode != 0 and "--goodput" in r.stderr


# ------------------------------------------- a server with keys and limits
KEY = "sk-test-4f1c"
EXAMPLE_TEMPLATE = str(Path(__file__).resolve().parents[1] / "examples" / "chatml_tools.jinja")


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """--api-key, small session limits, and the example tools template."""
    s = ServerProcess("--dtype", "float32", "--num-blocks", "256", "--served-model-name", MODEL,
                      "--api-key", KEY, "--max-sessions", "2", "--session-ttl", "6",
                      "--chat-template", EXAMPLE_TEMPLATE)
    yield s
    s.close()


def test_api_key_guards_the_v1_routes_only(keyed_server):
    """OpenAI clients send the key as a bearer token, Anthropic's as
    x-api-key; a wrong or missing one is a 401 in each API's error shape,
    also for a /v1 path that does not exist. Probes, scrapes, tokenize and
    CORS preflights carry no key and pass."""
    url = keyed_server.url
    ok = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert ok.completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for path in ("/v1/models", "/v1/no-such-route"):
        r = httpx.get(url + path)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"], (path, r.text)
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": []},
                   headers={"x-api-key": "sk-wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    anthropic = pytest.importorskip("anthropic")
    reply = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120).messages.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    assert reply.usage.output_tokens == 1
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(url + path).status_code == 200, path
    assert httpx.post(url + "/tokenize", json={"prompt": "hi"}).status_code == 200
    pre = httpx.options(url + "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"]


def test_api_key_guards_the_route_list(keyed_server):
    """/openapi.json names every route: with keys set it wants one, as /v1 does."""
    url = keyed_server.url
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(url + path).status_code == 401, path
    r = httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]


def _raw(url: str, head: bytes) -> bytes:
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def test_header_limits(keyed_server):
    """Too many header fields, or one too long, is a 431 naming the limit; a
    head larger than the HTTP parser buffers is its 400; the server goes on."""
    url = keyed_server.url
    r = httpx.get(url + "/health", headers={f"x-h{i}": "v" for i in range(101)})
    assert r.status_code == 431 and "at most 100 are allowed" in r.json()["error"]["message"]
    r = httpx.get(url + "/health", headers={"x-big": "v" * 20_000})
    assert r.status_code == 431 and "'x-big'" in r.json()["error"]["message"]
    for head in (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 100_000 + b"\r\nConnection: close\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(10_000))
                 + b"Connection: close\r\n\r\n"):
        status = int(_raw(url, head).split(b" ", 2)[1])
        assert status in (400, 431)
    assert httpx.get(url + "/health", headers={f"x-h{i}": "v" for i in range(50)}).status_code == 200


def test_chat_template_flag_renders_tools(keyed_server):
    """--chat-template replaces the model's template everywhere the server
    renders a chat: the tools a request sends reach the prompt."""
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Run the tests."}]
    with_tools = httpx.post(keyed_server.url + "/tokenize", json={"messages": msgs, "tools": tools}).json()
    plain = httpx.post(keyed_server.url + "/tokenize", json={"messages": msgs}).json()
    text = httpx.post(keyed_server.url + "/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
    assert '"name": "run_tests"' in text and "<tools>" in text and with_tools["count"] > plain["count"]


def test_session_records_expire_by_idle_time_and_by_count(keyed_server):
    """--max-sessions 2: a third session closes the least recently active;
    --session-ttl 6: idle records close on their own (the loop ticks while
    idle), /metrics counts both, and a later turn under an expired id simply
    starts a new record."""
    url, auth = keyed_server.url, {"Authorization": f"Bearer {KEY}"}

    def turn(sid: str) -> None:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": SYSTEM + sid, "max_tokens": 2,
                                                       "temperature": 0, "session_id": sid}, headers=auth,
                       timeout=120)
        assert r.status_code == 200, r.text

    def present(sid: str) -> bool:
        return httpx.get(url + f"/v1/sessions/{sid}", headers=auth).status_code == 200

    for sid in ("s1", "s2", "s3"):
        turn(sid)
    assert [present(x) for x in ("s1", "s2", "s3")] == [False, True, True]
    assert keyed_server.metrics()['trajserve_sessions_expired_total{reason="cap"}'] == 1
    deadline = time.monotonic() + 60
    while present("s3") and time.monotonic() < deadline:
        time.sleep(0.5)
    m = keyed_server.metrics()
    assert not present("s2") and not present("s3")
    assert m['trajserve_sessions_expired_total{reason="idle"}'] == 2 and m["trajserve_sessions"] == 0
    turn("s1")
    assert httpx.get(url + "/v1/sessions/s1", headers=auth).json()["turns"] == 1


# ------------------------------------------------------- tokenize, version
def test_tokenize_and_detokenize(server, client, engine_f32):
    """vLLM's /tokenize: a prompt as /v1/completions encodes it, messages as
    /v1/chat/completions renders them (the count is the chat's
    prompt_tokens); /detokenize gives the text back."""
    tok = engine_f32.tokenizer
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "Hello, world", "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tok.encode("Hello, world") and body["count"] == len(body["tokens"])
    assert body["token_strs"] == [tok.id_to_token(i) for i in body["tokens"]] and body["max_model_len"] > 0
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which tool first?"}]
    counted = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
    reply = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert counted["count"] == reply.usage.prompt_tokens and counted["token_strs"] is None
    back = httpx.post(server.url + "/detokenize", json={"tokens": counted["tokens"]}).json()["prompt"]
    assert back == tok.apply_chat_template(msgs)  # specials included
    for path, body, words in (("/tokenize", {}, "either prompt"),
                              ("/tokenize", {"prompt": "a", "messages": msgs}, "not both"),
                              ("/tokenize", {"prompt": "a", "model": "gpt-9"}, "gpt-9"),
                              ("/detokenize", {"tokens": [1, 10**9]}, "outside the vocabulary")):
        r = httpx.post(server.url + path, json=body)
        assert r.status_code in (400, 404) and words in r.json()["error"]["message"], (path, body, r.text)
    v = httpx.get(server.url + "/version").json()["version"]
    assert v and v != "unknown"


# ------------------------------------------------------------ agent sessions
def test_session_pause_and_resume_through_the_extensions(server, client):
    """A turn with tool_wait_s pauses the session under the keep policy; the
    next turn with the same session_id resumes it and hits its history."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Run the tests."}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                           extra_body={"session_id": "agent-1", "tool_wait_s": 30.0,
                                                       "tool": "run_tests"})
    info = httpx.get(server.url + "/v1/sessions/agent-1").json()
    assert info["state"] == "paused" and info["turns"] == 1
    assert info["residency"] in ("kept", "saving", "offloaded", "loading", "dropped")
    assert info["decision"]["decision"] in ("keep", "host", "disk", "drop") and info["decision"]["reason"]
    assert info["num_tokens"] == first.usage.prompt_tokens + first.usage.completion_tokens
    m = server.metrics()
    assert m[f'trajserve_keep_decisions_total{{decision="{info["decision"]["decision"]}"}}'] >= 1
    assert m["trajserve_sessions_paused"] >= 1 and 'trajserve_kv_tier_bytes{tier="host"}' in m
    assert 'trajserve_keep_demotions_total{to="disk"}' in m
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Tool output: 3 passed."}]
    second = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                            extra_headers={"X-Session-Id": "agent-1"})
    info = httpx.get(server.url + "/v1/sessions/agent-1").json()
    assert info["state"] == "idle" and info["turns"] == 2
    if info["decision"]["decision"] != "drop":  # kept or reloaded: the history is served from cache
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    forks = httpx.post(server.url + "/v1/sessions/agent-1/fork", json={"n": 2}).json()["forks"]
    assert len(forks) == 2 and httpx.get(server.url + f"/v1/sessions/{forks[0]}").json()["num_tokens"] == \
        info["num_tokens"]
    for sid in ["agent-1", *forks]:
        assert httpx.delete(server.url + f"/v1/sessions/{sid}").json()["deleted"]
    assert httpx.get(server.url + "/v1/sessions/agent-1").status_code == 404
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "tool_wait_s": 1.0})
    assert r.status_code == 400 and "session_id" in r.json()["error"]["message"]
    wait_idle(server)


def test_host_tier_under_the_prefix_cache_serves_an_evicted_conversation(tmp_path):
    """`serve --kv-host-cache --kv-disk-cache`: a conversation pushed out of a 32-block pool by
    other traffic comes back from the host tier on its next turn (usage
    reports the cached tokens) and /metrics shows the traffic. Stopped with
    SIGTERM, the server shuts its engine down and exits 0, leaving no
    temporary directory behind (uvicorn raises the signal again after its own
    shutdown; it must not kill the process before ours)."""
    with ServerProcess("--dtype", "float32", "--num-blocks", "32", "--kv-host-cache", "64MiB",
                       "--kv-disk-cache", "64MiB", "--served-model-name", MODEL, tmpdir=str(tmp_path)) as s:
        def complete(prompt: str) -> dict:
            r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                             "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        turn1 = "You are a coding agent with tools read_file and run_tests. " * 8 + "Task: list the files."
        first = complete(turn1)
        for k in range(3):
            complete(f"Unrelated request {k}: " + "summarize the weather report for the coast. " * 20)
        second = complete(turn1 + first["choices"][0]["text"] + " Now open main.py.")
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 32
        m = s.metrics()
        assert m["trajserve_prefix_cache_spilled_blocks_total"] > 0
        assert m["trajserve_prefix_cache_promoted_blocks_total"] > 0
        assert m['trajserve_prefix_cache_tier_bytes{tier="host"}'] > 0
        # The tiers' scratch disk directory (no --kv-disk-dir), which sessions share, exists while serving.
        assert list(tmp_path.glob("trajserve-kv-*")), "the disk tier's scratch directory exists while serving"
        assert s.close() == 0
    assert list(tmp_path.iterdir()) == []
