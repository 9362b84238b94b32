"""Tokenizer: the embedded GGUF's tokenizer against transformers' GGUF-built
one, chat templates, HF directories, and the streaming detokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import pre_tokenizers

from trajserve.model import pre_tokenizers as pre_tokenizer_module
from trajserve.model.loader import default_model_path
from trajserve.model.pre_tokenizers import GGUF_PRE_TOKENIZERS, gguf_pre_tokenizer
from trajserve.model.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    load_tokenizer,
    read_chat_template,
)

transformers = pytest.importorskip("transformers")

# Strings on which transformers' GGUF tokenizer is a faithful reference.
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "tabs\t\tand   spaces   at the end   ",
    "  leading spaces",
    "\n\n\nnewlines\r\n\r\nand CRLF",
    "I'm sure they'll say it's fine, don't you think? WE'VE SEEN IT.",
    "pi is 3.14159, a million is 1,000,000 and 2024-11-30T08:00:00Z",
    "naïve café résumé Ελληνικά русский язык",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "emoji 🤖👍🏽🇺🇸 ❤️ and a family 👨‍👩‍👧",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>trajserve<file_sep>x.py",
    "a<|im_end|>b <|im_start|> c",
    "",
    " ",
]
# Whitespace runs before digits: llama.cpp's "smollm" pre-tokenizer (like
# SmolLM2's tokenizer.json) isolates every digit *before* the GPT-2 regex, so
# "x  1" is [x, "ĠĠ", 1]. transformers' GGUF loader ignores "smollm" and uses
# plain GPT-2 splitting, giving [x, "Ġ", "Ġ", 1]. We follow llama.cpp.
DIGIT_TEXTS = ["x  1", "a   123 b", "x\n\n 42", "total:    9000 items\n  7"]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return Path(default_model_path())


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> Tokenizer:
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_smollm_split(hf) -> Backend:
    """transformers' GGUF tokenizer with SmolLM2's real pre-tokenizer put back."""
    tok = Backend.from_str(hf.backend_tokenizer.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return tok


# ---------------------------------------------------------------- embedded GGUF


def test_special_ids_and_sizes(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert (ours.bos_token, ours.bos_token_id) == ("<|im_start|>", 1)
    assert (ours.eos_token, ours.eos_token_id) == ("<|im_end|>", 2)
    # <|im_end|> ends a turn; <|endoftext|> ends a document.
    assert ours.eos_token_ids == {2, 0}


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, hf, text: str) -> None:
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", TEXTS + DIGIT_TEXTS)
def test_encode_matches_smollm_pre_tokenizer(ours: Tokenizer, hf_smollm_split, text: str) -> None:
    assert ours.encode(text) == hf_smollm_split.encode(text).ids


def test_digits_isolated_after_whitespace_run(ours: Tokenizer, hf) -> None:
    ids = ours.encode("x  1")
    assert [ours.id_to_token(i) for i in ids] == ["x", "ĠĠ", "1"]
    assert ids != hf("x  1")["input_ids"]  # the transformers quirk described above


def test_special_tokens_are_single_ids(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("<|im_end|>") == [2]
    assert ours.encode("<|im_start|>user") == [1, ours.encode("user")[0]]
    # SmolLM2 adds no BOS of its own.
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS + DIGIT_TEXTS)
def test_decode_round_trip(ours: Tokenizer, hf, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_decode_skips_control_tokens(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ours.decode(ids) == "user\nhi"
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List 3 primes."},
        {"role": "assistant", "content": "2, 3, 5"},
        {"role": "user", "content": "Now in 日本語 🤖?"},
    ],
    [{"role": "user", "content": "  spaces \n\n and newlines  "}, {"role": "assistant", "content": ""}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, hf, messages, add_generation_prompt: bool) -> None:
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    assert ours.encode_chat(messages, add_generation_prompt) == hf(expected, add_special_tokens=False)["input_ids"]


def test_chat_prompt_ends_with_assistant_header(ours: Tokenizer) -> None:
    ids = ours.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[-4:] == ours.encode("<|im_start|>assistant\n")
    assert ids[0] == 1 and ids.count(2) == 2  # system + user turns each end with <|im_end|>


@pytest.mark.parametrize("messages", [CONVERSATIONS[1][:3], [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "Sure: "}]])
def test_continue_final_message_matches_transformers(ours: Tokenizer, hf, messages) -> None:
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                      continue_final_message=True)
    assert ours.apply_chat_template(messages, continue_final_message=True) == expected
    assert expected.endswith(messages[-1]["content"])  # the turn is left open


# ---------------------------------------------------------------- templates


def _tiny_template_tokenizer(ours: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(ours.backend, bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=template)


def test_template_helpers_and_sandbox(ours: Tokenizer) -> None:
    import jinja2

    t = _tiny_template_tokenizer(
        ours, "{% if messages[0].role == 'system' %}{{ raise_exception('no system here') }}{% endif %}ok"
    )
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(jinja2.TemplateError, match="no system here"):
        t.apply_chat_template([{"role": "system", "content": "x"}])

    t = _tiny_template_tokenizer(ours, "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}")
    rendered = t.apply_chat_template([{"role": "user", "content": "é"}])
    assert rendered == '<|im_start|>[{"role": "user", "content": "é"}]<|im_end|>'

    # trim_blocks / lstrip_blocks as in transformers.
    t = _tiny_template_tokenizer(ours, "  {% for m in messages %}\n[{{ m.content }}]\n  {% endfor %}\n")
    assert t.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a]\n[b]\n"

    # Extra keyword arguments reach the template.
    t = _tiny_template_tokenizer(ours, "{{ tools | length }}")
    assert t.apply_chat_template([], tools=[{"name": "grep"}]) == "1"

    t = _tiny_template_tokenizer(ours, "{{ ''.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        t.apply_chat_template([])

    # continue_final_message with a template that trims the content (Llama 3's `| trim`).
    t = _tiny_template_tokenizer(ours, "{% for m in messages %}<{{ m.content | trim }}>{% endfor %}")
    assert t.apply_chat_template([{"role": "assistant", "content": " go on "}], continue_final_message=True) == "<go on"
    with pytest.raises(ValueError, match="last message with text content"):
        t.apply_chat_template([{"role": "assistant", "content": ""}], continue_final_message=True)

    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(ours.backend, bos_token=None, eos_token=None).apply_chat_template([])


def test_read_chat_template_from_a_file_or_text(tmp_path: Path, ours: Tokenizer) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert read_chat_template(str(f)) == f.read_text()
    assert read_chat_template("<{{ messages | length }}>") == "<{{ messages | length }}>"
    with pytest.raises(ValueError, match=r"no such file, and not a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match=r"line 2: unexpected"):  # a syntax error stops start-up, naming its line
        read_chat_template("{% for m in messages %}\n{{ m.content }")
    # Replacing a tokenizer's template replaces what it renders (the compiled one is dropped).
    t = _tiny_template_tokenizer(ours, "A{{ messages | length }}")
    assert t.apply_chat_template([]) == "A0"
    t.chat_template = read_chat_template("B{{ messages | length }}")
    assert t.apply_chat_template([]) == "B0"


EXAMPLE_TEMPLATE = Path(__file__).resolve().parents[1] / "examples" / "chatml_tools.jinja"


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_example_tools_template_is_the_model_template_plus_tools(ours: Tokenizer, messages) -> None:
    """examples/chatml_tools.jinja renders a conversation without tools as
    SmolLM2's own template does (so nothing changes for plain chats), and
    with tools lists them and writes calls as the model emits them (Hermes
    <tool_call> JSON, as server/tool_calls.py parses and writes them)."""
    from trajserve.server.tool_calls import hermes_text

    t = Tokenizer(ours.backend, bos_token=ours.bos_token, eos_token=ours.eos_token,
                  chat_template=read_chat_template(str(EXAMPLE_TEMPLATE)))
    for gen in (True, False):
        assert t.apply_chat_template(messages, add_generation_prompt=gen) == \
            ours.apply_chat_template(messages, add_generation_prompt=gen)
    tool = {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "read_file", "arguments": {"path": p}}}
             for i, p in enumerate(["a.py", "b.py"])]
    turns = [*messages, {"role": "assistant", "content": "Reading.", "tool_calls": calls},
             {"role": "tool", "tool_call_id": "c0", "content": "x = 1"}]
    text = t.apply_chat_template(turns, tools=[tool])
    assert json.dumps(tool) in text.split("<|im_end|>")[0]  # listed in the system turn
    written = "\n".join(hermes_text("read_file", c["function"]["arguments"]) for c in calls)
    assert f"<|im_start|>assistant\nReading.{written}<|im_end|>\n<|im_start|>tool\nx = 1<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------- HF directory


@pytest.fixture(scope="module")
def hf_dir(hf, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("smollm2-tokenizer")
    hf.save_pretrained(str(d))
    return d


def test_hf_dir_tokenizer(hf_dir: Path, hf, ours: Tokenizer) -> None:
    tok = load_tokenizer(hf_dir)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.eos_token_ids == {0, 2}
    for text in TEXTS + DIGIT_TEXTS:
        # tokenizer.json carries transformers' pre-tokenizer, quirk included.
        assert tok.encode(text) == hf(text)["input_ids"], text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages) == ours.apply_chat_template(messages)


def test_hf_dir_bos_flag_and_generation_config(hf_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "tok"
    d.mkdir()
    for f in hf_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    config["bos_token"] = {"content": "<|endoftext|>", "special": True}  # AddedToken-dict form
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    tok = load_tokenizer(d)
    assert tok.bos_token_id == 0
    assert tok.encode("hi")[0] == 0 and tok.encode("hi", add_special_tokens=False)[0] != 0
    assert tok.eos_token_ids == {0, 2, 5}


def test_hf_dir_without_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------- GGUF variants


def _byte_alphabet() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def _write_tokenizer_gguf(path: Path, pre: str, add_bos: bool | None,
                          template: str = "{{ bos_token }}{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}"
                          ) -> list[str]:
    tokens = _byte_alphabet() + ["Ġt", "he", "Ġthe", "<|begin_of_text|>", "<|eot_id|>", "<think>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 4]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    w.add_eos_token_id(tokens.index("<|eot_id|>"))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_gguf_llama3_style_vocabulary(tmp_path: Path, add_bos: bool | None) -> None:
    path = tmp_path / "tok.gguf"
    tokens = _write_tokenizer_gguf(path, "llama-bpe", add_bos)
    tok = load_tokenizer(path)
    bos, eot, think = (tokens.index(t) for t in ("<|begin_of_text|>", "<|eot_id|>", "<think>"))
    # llama.cpp adds BOS for llama-bpe vocabularies unless the file says otherwise.
    adds_bos = add_bos is not False
    ids = tok.encode(" the<think>x<|eot_id|>")
    body = [tokens.index("Ġthe"), think, tokens.index("x"), eot]
    assert ids == ([bos] if adds_bos else []) + body
    assert tok.encode(" the<think>x<|eot_id|>", add_special_tokens=False) == body
    # User-defined tokens are text; control tokens are skipped.
    assert tok.decode(ids) == " the<think>x"
    assert tok.eos_token_ids == {eot}
    # The template writes BOS itself: no second one.
    chat = tok.encode_chat([{"role": "user", "content": "the"}])
    assert chat.count(bos) == 1 and chat[0] == bos


def test_a_chat_gets_only_the_bos_its_template_writes(tmp_path: Path) -> None:
    """A tokenizer that adds BOS to plain text, under a template that writes
    none: the chat's ids have none, as transformers' apply_chat_template
    (tokenize=True) and vLLM's chat API give them (encode_chat added one here
    while the server's renderer did not)."""
    path = tmp_path / "tok.gguf"
    template = "{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}"
    tokens = _write_tokenizer_gguf(path, "llama-bpe", True, template)
    tok = load_tokenizer(path)
    bos = tokens.index("<|begin_of_text|>")
    assert tok.encode(" the")[0] == bos  # plain text: the tokenizer's BOS
    assert bos not in tok.encode_chat([{"role": "user", "content": " the"}])


def test_every_chat_is_rendered_by_encode_chat() -> None:
    """One rendering path: nothing in the package calls the template except
    Tokenizer.encode_chat (the server, sessions, LLM.chat, the CLI and the
    benches disagreed on BOS when each rendered and encoded on its own)."""
    root = Path(__file__).resolve().parents[1] / "trajserve"
    callers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if p.name != "tokenizer.py" and "apply_chat_template(" in p.read_text())
    assert callers == []


def test_pre_tokenizer_families() -> None:
    def split(pre: str, text: str) -> list[str]:
        return [piece for piece, _ in gguf_pre_tokenizer(pre).pre_tokenize_str(text)]

    assert split("gpt2", "abc 12345") == ["abc", "Ġ12345"]
    assert split("smollm", "abc 12345") == ["abc", "Ġ", "1", "2", "3", "4", "5"]
    assert split("llama-bpe", "abc 12345") == ["abc", "Ġ", "123", "45"]
    assert split("qwen2", "abc 12345") == ["abc", "Ġ", "1", "2", "3", "4", "5"]
    assert split("qwen2", "Hello\n\n  world") == ["Hello", "ĊĊ", "Ġ", "Ġworld"]
    # o200k (gpt-oss): a case turn splits a word, contractions stay on it, digits go in threes, "/" ends a symbol run.
    assert split("gpt-4o", "HelloWorld's JSONParser 12345") == ["Hello", "World's", "ĠJSONParser", "Ġ", "123", "45"]
    assert split("gpt-4o", "a+=b;\n/path//x") == ["a", "+=", "b", ";Ċ/", "path", "//", "x"]
    # DeepSeek V3: digits in threes and CJK runs split off first; a symbol leads a Latin word.
    assert split("deepseek-v3", "a.b_c 12345 中文abc") == ["a", ".b", "_c", "Ġ", "123", "45", "Ġ",
                                                           "ä¸Ńæĸĩ", "abc"]
    assert {"smollm", "gpt2", "llama-bpe", "qwen2", "gpt-4o", "deepseek-v3", "deepseek-llm"} <= set(GGUF_PRE_TOKENIZERS)
    with pytest.raises(ValueError, match=r"'chameleon'.*supported:.*llama-bpe.*qwen2.*smollm"):
        gguf_pre_tokenizer("chameleon")


def _text_pieces(pre: str, text: str) -> list[str]:
    """The pre-tokenizer's pieces as text (its byte-level map undone)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return [bytes(byte_of[c] for c in piece).decode() for piece, _ in gguf_pre_tokenizer(pre).pre_tokenize_str(text)]


def test_deepseek_llm_pre_tokenizer() -> None:
    """DeepSeek LLM / V2's splits: newlines alone, letter runs and
    punctuation runs each with one space before, trailing spaces, CJK runs
    (with the wide U+0800-U+4E00 range), digit runs; what no split takes
    stays as the text between."""
    def split(text: str) -> list[str]:
        return _text_pieces("deepseek-llm", text)

    assert split("Hello, world! 123") == ["Hello", ",", " world", "!", " ", "123"]
    assert split("a\n\nb  ") == ["a", "\n", "\n", "b", "  "]
    assert split("x  y") == ["x", " ", " y"]
    assert split("ÀÉ αβγ Жук") == ["ÀÉ", " αβγ", " Жук"]
    # The CJK split's wide range holds the quotation marks (U+201C): it takes them out of a punctuation run.
    assert split("！？“ok”") == ["！？", "“", "ok", "”"]
    assert split("！？ok") == ["！？", "ok"]
    assert split("中文かな한국 x") == ["中文かな한국", " x"]
    # Cased letters DeepSeek's class leaves out are no letters here: a math
    # letter, an Armenian small letter, Latin Extended-D's from U+A790 break a run.
    assert split("α𝐀β") == ["α", "𝐀", "β"]
    assert split("Բարեւ") == ["Բ", "արեւ"]
    assert split("ßꞎꞐ") == ["ßꞎ", "Ꞑ"]
    # The punctuation class spans ASCII's letters (":-~"): it splits them off a run of other letters.
    assert split(" aß") == [" a", "ß"]
    # Letters the CJK range holds (Cherokee's capitals, U+13A0) split off after.
    assert split("Ꭰꭰ") == ["Ꭰ", "ꭰ"]


def test_gguf_deepseek_llm_vocabulary_loads(tmp_path: Path) -> None:
    """A DeepSeek V2 file's vocabulary (pre-tokenizer `deepseek-llm`) is read, not refused."""
    path = tmp_path / "tok.gguf"
    tokens = _write_tokenizer_gguf(path, "deepseek-llm", True)
    tok = load_tokenizer(path)
    assert tok.encode(" the\nthe") == [tokens.index(t) for t in ("<|begin_of_text|>", "Ġthe", "Ċ", "t", "he")]


def test_deepseek_llm_letters_need_the_unicode_its_class_came_from(monkeypatch) -> None:
    """A Unicode database with one more cased letter outside the exclusions
    gives another class than DeepSeek's: refused, not guessed."""
    import unicodedata

    real = unicodedata.category
    monkeypatch.setattr(pre_tokenizer_module.unicodedata, "category",
                        lambda c: "Lu" if c == "\u0378" else real(c))  # U+0378: unassigned in Greek
    pre_tokenizer_module._deepseek_letters.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"deepseek-llm.*2730 cased letters.*2729"):
            pre_tokenizer_module._deepseek_letters()
    finally:
        pre_tokenizer_module._deepseek_letters.cache_clear()


# ---------------------------------------------------------------- streaming


MULTIBYTE = "héllo wörld — 日本語のテキスト 🤖👍🏽 naïve café 한국어 👨‍👩‍👧 end"


def test_incremental_detokenizer_multibyte(ours: Tokenizer) -> None:
    ids = ours.encode(MULTIBYTE)
    # Some token really does split a character, or this test tests nothing.
    assert any("\ufffd" in ours.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(ours)
    pieces = [detok.step(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == ours.decode(ids) == MULTIBYTE
    assert detok.text == MULTIBYTE
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_with_prompt_and_specials(ours: Tokenizer) -> None:
    prompt = ours.encode_chat([{"role": "user", "content": "hi"}])
    gen = ours.encode("Sure — ça va? 🤖<|im_end|>")
    detok = IncrementalDetokenizer(ours, prompt_ids=prompt)
    text = detok.extend(gen) + detok.flush()
    assert text == "Sure — ça va? 🤖"
    keep = IncrementalDetokenizer(ours, prompt_ids=prompt, skip_special_tokens=False)
    assert keep.extend(gen) + keep.flush() == "Sure — ça va? 🤖<|im_end|>"


def test_incremental_detokenizer_flushes_incomplete_tail(ours: Tokenizer) -> None:
    ids = ours.encode("🤖")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(ours)
    assert detok.extend(ids[:-1]) == ""  # half an emoji: held back
    assert detok.flush() == ours.decode(ids[:-1])  # end of stream: emit what there is


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_incremental_detokenizer_property_text(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours)
    assert detok.extend(ids) + detok.flush() == ours.decode(ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(min_value=0, max_value=49151), max_size=30))
def test_incremental_detokenizer_property_any_ids(ours: Tokenizer, ids: list[int]) -> None:
    """A model may emit any ids, including broken UTF-8; the stream still
    reassembles to exactly the full decode."""
    detok = IncrementalDetokenizer(ours)
    assert "".join(detok.step(i) for i in ids) + detok.flush() == ours.decode(ids)
