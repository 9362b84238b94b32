"""Tokenizer, chat template and streaming detokenizer.

Built on the `tokenizers` library from either source a model can come from:

- a GGUF file: llama.cpp stores the byte-level BPE vocabulary, merges and
  token types as metadata, and names the pre-tokenizer split in
  `tokenizer.ggml.pre`; we rebuild the equivalent `tokenizers.Tokenizer`.
- a Hugging Face directory: tokenizer.json as saved, tokenizer_config.json for
  the chat template and special tokens.

The chat template is rendered with jinja2 the way transformers does it, so a
prompt is byte-identical to what `apply_chat_template` would give.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, processors
from tokenizers import Tokenizer as Backend

from trajserve.model.gguf_reader import PathLike, gguf_value, open_gguf
from trajserve.model.loader import is_gguf, resolve_model_path
from trajserve.model.pre_tokenizers import GGUF_PRE_TOKENIZERS, gguf_pre_tokenizer
from trajserve.model.tool_prompt import template_shows_tools, with_tools_shown

# Token strings that end a turn; a model emits one of them instead of (or as)
# its eos, so generation must stop on any of them (llama.cpp's "EOG" set).
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
    "<EOT>",
)
# OpenAI's harmony format (gpt-oss): a reply is several messages (its
# reasoning, its answer, its tool calls), each closed by <|end|>; the reply
# ends at <|return|> (the answer written) or <|call|> (a tool to run).
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
HARMONY_END_TOKENS = ("<|return|>", "<|call|>", "<|endoftext|>")

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special,
# USER_DEFINED ones are matched whole in text but decoded like any other.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

def check_unicode(text: object, field: str) -> None:
    """ValueError naming the field if text is a str that cannot be UTF-8 (a lone surrogate)."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{field} is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
                             f"{e.start}") from None


class Tokenizer:
    """Text <-> token ids, the chat template, and the ids that end generation."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        template_vars: dict[str, Any] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template  # the setter also clears the compiled template
        self.tool_prompt: str | None = None  # tools for a template that renders none (model/tool_prompt.py)
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        # Special token strings a template may reference beyond bos/eos (pad_token, unk_token).
        self._template_vars = dict(template_vars or {})
        # OpenAI's harmony format (gpt-oss): its control tokens end and separate a reply's messages.
        self.harmony = all(t in self._special_ids() for t in HARMONY_TOKENS)
        self.eos_token_ids: set[int] = self._end_of_generation_ids(extra_eos_token_ids)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def shows_tools(self) -> bool:
        """Whether a request's tools reach the model: the template renders
        them, or --tool-prompt writes them into the system message."""
        return self.tool_prompt is not None or template_shows_tools(self.chat_template)

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._chat_template = template
        self._compiled_template: Any = None  # compiled on first use

    def _special_ids(self) -> dict[str, int]:
        return {t.content: i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}

    def is_special(self, token: str) -> bool:
        """Is `token` one of the vocabulary's special (control) tokens?"""
        return token in self._special_ids()

    def _end_of_generation_ids(self, extra: Iterable[int]) -> set[int]:
        ids = set(extra)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        specials = self._special_ids()
        for name in HARMONY_END_TOKENS if self.harmony else END_OF_TURN_TOKENS:
            if name in specials:
                ids.add(specials[name])
        if self.harmony:  # <|end|> closes one message of the reply, not the reply (a file may name it eot)
            ids.discard(specials["<|end|>"])
        return ids

    # ------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in `text` (e.g. `<|im_start|>`) become their ids;
        `add_special_tokens` only controls the BOS/EOS the model adds itself.
        Text that is not valid Unicode (a lone surrogate, which JSON's \\ud800
        escapes allow) is a ValueError, not the backend's TypeError."""
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            check_unicode(text, "prompt")
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ------------------------------------------------------------ chat

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
        **template_kwargs: Any
    ) -> str:
        """The prompt text for `messages`, as transformers' apply_chat_template(tokenize=False).
        Extra keyword arguments (tools=, documents=, ...) reach the template.

        continue_final_message: the reply continues the last message (an
        assistant prefill) instead of opening a new turn: the text ends where
        that message's content ends, before the template closes the turn.
        Templates write the content verbatim or stripped (Llama 3's `| trim`),
        so the cut is at the last occurrence of either."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (none in the GGUF metadata or tokenizer_config.json)")
        if self._compiled_template is None:
            self._compiled_template = _jinja_env().from_string(self.chat_template)
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **self._template_vars}
        context.update(template_kwargs)
        tools = template_kwargs.get("tools")
        if tools and self.tool_prompt is not None and not template_shows_tools(self.chat_template):
            messages = with_tools_shown(messages, tools)
        text = self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt and not continue_final_message,
            **context
        )
        if not continue_final_message:
            return text
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str) or not final.strip():
            raise ValueError("continue_final_message needs a last message with text content to continue")
        for piece in (final, final.strip()):
            at = text.rfind(piece)
            if at >= 0:
                return text[:at + len(piece)]
        raise ValueError("continue_final_message: the chat template does not write the last message's content "
                         "verbatim, so there is no place to continue it from")

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
        **template_kwargs: Any
    ) -> list[int]:
        """Prompt ids for `messages`: the template's text encoded without the
        tokenizer's own BOS/EOS, since the template writes any it needs
        (Llama 3's `{{ bos_token }}`), as transformers'
        apply_chat_template(tokenize=True) and vLLM's chat API encode it.
        Every chat path calls this one: LLM.chat, sessions, the server's
        render_chat, the CLI, the benches."""
        text = self.apply_chat_template(messages, add_generation_prompt, continue_final_message, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, path: PathLike) -> Tokenizer:
        reader = open_gguf(path)
        kind = gguf_value(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)")
        tokens: list[str] = gguf_value(reader, "tokenizer.ggml.tokens")
        merges: list[str] = gguf_value(reader, "tokenizer.ggml.merges") or []
        types: list[int] = gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        pre = gguf_value(reader, "tokenizer.ggml.pre", "default")
        family = GGUF_PRE_TOKENIZERS.get(pre)

        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(
            vocab=vocab,
            merges=[tuple(m.split(" ", 1)) for m in merges],
            # Llama 3 looks a whole pre-token up in the vocabulary before merging.
            ignore_merges=family == "llama3",
        )
        backend = Backend(bpe)
        backend.pre_tokenizer = gguf_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        # The vocabulary already holds these strings at their ids, so adding
        # them only makes the text matcher keep them whole; no new ids appear.
        control = [t for t, k in zip(tokens, types) if k == _TOKEN_TYPE_CONTROL]
        user_defined = [t for t, k in zip(tokens, types) if k == _TOKEN_TYPE_USER_DEFINED]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

        def token_at(key: str) -> str | None:
            i = gguf_value(reader, f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
        # llama.cpp's defaults when the flag is absent: Llama 3 adds BOS, GPT-2 style vocabularies do not.
        add_bos = gguf_value(reader, "tokenizer.ggml.add_bos_token", family == "llama3")
        add_eos = gguf_value(reader, "tokenizer.ggml.add_eos_token", False)
        _set_bos_eos(backend, bos if add_bos else None, eos if add_eos else None)
        extra = [gguf_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            chat_template=gguf_value(reader, "tokenizer.chat_template"),
            extra_eos_token_ids=[i for i in extra if i is not None],
            vocab_size=len(tokens),
            template_vars={"unk_token": token_at("unknown_token_id"), "pad_token": token_at("padding_token_id")},
        )

    @classmethod
    def from_hf_dir(cls, path: PathLike) -> Tokenizer:
        d = Path(path)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{str(d)!r} has no tokenizer.json; supported: a fast (tokenizers) tokenizer saved as "
                "tokenizer.json (sentencepiece tokenizer.model alone is not)"
            )
        backend = Backend.from_file(str(tok_file))
        config = _read_json(d / "tokenizer_config.json")
        bos, eos = _token_str(config.get("bos_token")), _token_str(config.get("eos_token"))
        # tokenizer_config's flags win over the saved post-processor, as in transformers.
        if "add_bos_token" in config or "add_eos_token" in config:
            _set_bos_eos(
                backend,
                bos if config.get("add_bos_token") else None,
                eos if config.get("add_eos_token") else None,
            )
        extra = _read_json(d / "generation_config.json").get("eos_token_id")
        extra_ids = extra if isinstance(extra, list) else [extra] if isinstance(extra, int) else []
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            chat_template=_hf_chat_template(d, config),
            extra_eos_token_ids=extra_ids,
            template_vars={k: _token_str(config.get(k)) for k in ("unk_token", "pad_token")},
        )


def load_tokenizer(path: PathLike | None) -> Tokenizer:
    """Tokenizer of a .gguf file or a Hugging Face directory (None: the embedded model)."""
    p = resolve_model_path(path)
    return Tokenizer.from_gguf(p) if is_gguf(p) else Tokenizer.from_hf_dir(p)


# ---------------------------------------------------------------- streaming


class IncrementalDetokenizer:
    """Turns a growing list of token ids into new text, one piece per step.

    A byte-level token may hold half of a UTF-8 character; decoding it alone
    gives U+FFFD. We hold such tokens back until the character completes, and
    decode a small window that starts a few tokens earlier, so word-initial
    spaces come out as they do in a full decode. Joining every returned piece
    (plus flush()) equals decode(all ids).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool | None = None,
        context_tokens: int = 5,
    ) -> None:
        """skip_special_tokens None: a harmony vocabulary's reply keeps them
        (they separate its messages: server/harmony.py reads them back),
        any other's drops them."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = not tokenizer.harmony if skip_special_tokens is None else skip_special_tokens
        # A few prompt tokens give the first generated token its left context.
        self._ids: list[int] = list(prompt_ids)[-context_tokens:] if context_tokens else []
        self._prefix = 0  # window start: context already emitted
        self._read = len(self._ids)  # first id whose text is not emitted yet
        self.text = ""  # everything emitted so far

    def step(self, token_id: int) -> str:
        """Add one id; return the text it completes ('' while a character is split)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def extend(self, token_ids: Iterable[int]) -> str:
        pieces = [self.step(t) for t in token_ids]
        return "".join(pieces)

    def flush(self) -> str:
        """At end of stream: emit what is held back, even an incomplete character."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], self.skip_special_tokens)
        after = decode(self._ids[self._prefix :], self.skip_special_tokens)
        if len(after) <= len(before) and not final:
            return ""
        if after.endswith("\ufffd") and not final:
            return ""
        piece = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += piece
        return piece


# ---------------------------------------------------------------- helpers


def _set_bos_eos(backend: Backend, bos: str | None, eos: str | None) -> None:
    """Make `encode(add_special_tokens=True)` add exactly these tokens."""
    single, pair, special = "$A", "$A $B:1", []
    if bos is not None:
        single, pair = f"{bos} {single}", f"{bos} $A {bos}:1 $B:1"
        special.append((bos, backend.token_to_id(bos)))
    if eos is not None:
        single, pair = f"{single} {eos}", f"{pair} {eos}:1"
        if eos != bos:
            special.append((eos, backend.token_to_id(eos)))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _token_str(value: Any) -> str | None:
    """tokenizer_config writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(d: Path, config: dict) -> str | None:
    # Newer transformers save the template beside the config.
    jinja_file = d / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(d / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def read_chat_template(value: str) -> str:
    """A chat template given as a file's path or as the Jinja text itself
    (vLLM's --chat-template), compiled once here so a syntax error stops
    start-up with its line instead of failing every chat request."""
    from jinja2.exceptions import TemplateSyntaxError

    path = Path(value)
    if "{" not in value and path.is_file():
        text = path.read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"chat template {value!r}: no such file, and not a Jinja template (no {{{{ or {{%)")
    try:
        _jinja_env().from_string(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat template {value if len(value) < 80 else value[:77] + '...'!r}: "
                         f"line {e.lineno}: {e.message}") from None
    return text


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Templates expect transformers' tojson: non-ASCII kept, no HTML escaping.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _jinja_env() -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Settings transformers uses, so rendered prompts match it byte for byte;
    # sandboxed because templates come with downloaded models.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


__all__ = ["Tokenizer", "IncrementalDetokenizer", "load_tokenizer", "read_chat_template", "END_OF_TURN_TOKENS",
           "GGUF_PRE_TOKENIZERS"]
