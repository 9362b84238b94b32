"""`trajserve serve --lora-modules a=DIR --lora-dir DIR` as a vLLM user runs
it: the request's model field picks the adapter (the engine's tokens),
/v1/models lists base and adapters, adapters load from --lora-dir by name
only (a path, a climb out of it, a bad name: 400 naming the field) and
unload, /metrics counts per adapter, a session stays with its adapter."""
from __future__ import annotations

import re
import time
import shutil

import httpx
import pytest

from server_util import ServerProcess
from tiny_models import random_adapter, save_with_tokenizer, tiny_hf_model
from trajserve.llm import LLM
from trajserve.sampling import SamplingParams

PROMPT = [11, 42, 7, 99, 23, 5, 61, 8, 150, 3, 77, 201, 9, 14, 30, 2, 88]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_server")
    base = tiny_hf_model("llama")
    save_with_tokenizer(base, d / "base")
    random_adapter(base, d / "a", 1)
    (d / "pool").mkdir()
    random_adapter(base, d / "pool" / "b", 2, targets=("q_proj", "v_proj"))
    (d / "pool" / "loose.txt").write_text("not an adapter")
    server = ServerProcess("--model", str(d / "base"), "--dtype", "float32", "--num-blocks", "256",
                           "--block-size", "4", "--lora-modules", f"a={d / 'a'}", "--lora-dir", str(d / "pool"))
    ref = LLM(str(d / "base"), dtype="float32", num_blocks=256, block_size=4,
              lora_modules={"a": str(d / "a"), "b": str(d / "pool" / "b")})
    yield d, server, ref
    server.close()
    ref.close()
    shutil.rmtree(d, ignore_errors=True)


def _complete(url: str, model: str, prompt=PROMPT, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                     "temperature": 0, **extra}, timeout=60)


def _want(ref: LLM, lora: str | None, prompt=PROMPT) -> str:
    return ref.generate([prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False,
                        lora=lora)[0].outputs[0].text


def test_the_model_field_picks_the_adapter(setup):
    _, server, ref = setup
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["base", "a"]
    assert models[1]["parent"] == "base" and "dir" not in str(models[1])  # no path is shown
    texts = {m: _complete(server.url, m).json()["choices"][0]["text"] for m in ("base", "a")}
    assert texts == {"base": _want(ref, None), "a": _want(ref, "a")} and texts["base"] != texts["a"]
    r = _complete(server.url, "b")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert "`base`, `a`" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models/a").json()["id"] == "a"


def test_adapters_load_from_the_lora_dir_by_name_only(setup):
    _, server, ref = setup
    url = server.url
    for body, param in (({"lora_name": "b", "lora_path": "../a"}, "lora_path"),
                        ({"lora_name": "b", "lora_path": "/etc"}, "lora_path"),
                        ({"lora_name": "b", "lora_path": "loose.txt"}, "lora_path"),
                        ({"lora_name": "x"}, "lora_name"),            # not in the directory
                        ({"lora_name": "../b", "lora_path": "b"}, "lora_name"),
                        ({"lora_name": "base", "lora_path": "b"}, "lora_name"),  # the base model's name
                        ({"lora_name": "a", "lora_path": "b"}, "lora_name")):    # taken
        r = httpx.post(url + "/v1/load_lora_adapter", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/x" * 200})
    assert r.status_code == 422 and "lora_path" in r.text
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 200 and "Success" in r.text
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["base", "a", "b"]
    assert _complete(url, "b").json()["choices"][0]["text"] == _want(ref, "b")
    # Its turns hit its own cache, never a's.
    again = _complete(url, "b", PROMPT + [4]).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 12
    other = _complete(url, "a", PROMPT + [4, 5]).json()  # a has PROMPT cached too; b's blocks are not a's
    assert other["choices"][0]["text"] == _want(ref, "a", PROMPT + [4, 5])
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 200
    assert _complete(url, "b").status_code == 404
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    assert _complete(url, "a").json()["choices"][0]["text"] == _want(ref, "a")  # the others serve on


def test_metrics_per_adapter_and_sessions_keep_their_adapter(setup):
    _, server, ref = setup
    url = server.url
    r = _complete(url, "a", PROMPT[:9], session_id="s1")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _want(ref, "a", PROMPT[:9])
    r = _complete(url, "base", PROMPT[:9], session_id="s1")
    assert r.status_code == 400 and "belongs to another model" in r.json()["error"]["message"]
    text = httpx.get(url + "/metrics").text
    got = {m[0]: float(m[1]) for m in re.findall(r'^trajserve_lora_requests_total\{adapter="(\w+)"\} (\S+)$', text,
                                                 re.M)}
    assert got["a"] >= 3
    assert re.search(r'^trajserve_lora_generation_tokens_total\{adapter="a"\} (\d+)', text, re.M)
    assert re.search(r'^trajserve_lora_adapters\{state="loaded"\} 1\.0$', text, re.M)


def test_a_paused_lora_session_leaves_the_adapters_cache_exact(setup):
    """The hostile probe's sequence: the base model holds the prompt cached
    when a LoRA session on it pauses to the host tier and resumes; the
    adapter's later requests still get the adapter's text."""
    _, server, ref = setup
    url = server.url
    m = [(13 * i + 2) % 290 for i in range(48)]
    first = _complete(url, "a", m, cache_salt="ref").json()["choices"][0]["text"]
    assert first == _want(ref, "a", m)
    assert _complete(url, "base", m, max_tokens=1).status_code == 200
    r = _complete(url, "a", m, session_id="s-probe", tool_wait_s=5)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == first
    deadline = time.monotonic() + 10
    while (got := httpx.get(url + "/v1/sessions/s-probe").json())["residency"] != "offloaded":
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    assert got["decision"]["decision"] == "host" and got["saved_blocks"] == (48 + 8 - 1) // 4
    r = _complete(url, "a", m + [4, 5], session_id="s-probe")
    assert r.json()["choices"][0]["text"] == _want(ref, "a", m + [4, 5])
    r = _complete(url, "a", m).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 44 and r["choices"][0]["text"] == first
    assert _complete(url, "base", m).json()["choices"][0]["text"] == _want(ref, None, m)
