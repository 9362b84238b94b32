"""OpenAI request bodies (pydantic) and their mapping to SamplingParams.

Fields the OpenAI API defines and trajserve does not use are accepted and
ignored (clients send them routinely); wrong types and missing required
fields are 422s; values outside their range are 400s naming the field and
its limit (SamplingParams.validate)."""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt

from trajserve.config import PRIORITY_RANGE
from trajserve.sampling import SamplingParams
from trajserve.server.conversations import KEY_MAX
from trajserve.server.generation_defaults import NONE as NO_DEFAULTS
from trajserve.server.generation_defaults import GenerationDefaults
from trajserve.server.goodput import DEADLINE_MAX_MS
from trajserve.server.hints import KvHints, NvExt
from trajserve.server.tool_calls import hermes_text
from trajserve.structured import StructuredOutput


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` body field: one constraint."""
    model_config = ConfigDict(extra="ignore")
    json_: dict | str | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# A pause's placement a client may force (sessions/keep_policy.py Decision).
PauseTier = Literal["keep", "host", "disk", "drop"]


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    ignore_eos: StrictBool = False  # extension (vLLM)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's shape) -> bias
    prompt_logprobs: int | None = None  # extension (vLLM): score each prompt token, top-k alternatives
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's prompt-cache fields: the key names the conversation
    # (server/conversations.py); caching is automatic either way.
    prompt_cache_key: str | None = Field(default=None, max_length=KEY_MAX)
    prompt_cache_retention: Literal["in-memory", "in_memory", "24h"] | None = None
    store: StrictBool | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    # The conversation another API's fields named (origin, key): Responses'
    # client_metadata, Messages' metadata.user_id (set by their translation).
    _conversation: tuple[str, str] | None = PrivateAttr(default=None)
    # What the server says about the request beside the reply (tools it
    # could not show, a prefix break): extension fields of the reply.
    _notes: dict = PrivateAttr(default_factory=dict)
    # The pause other engines' hints ask for (server/hints.py), read when the turn begins.
    _hinted_pause: dict = PrivateAttr(default_factory=dict)
    # The priority the request runs at (ServerState.order): its session's paused state keeps it.
    _turn_priority: int = PrivateAttr(default=0)
    # A harmony reply held to JSON: the header written into the prompt before it (server/harmony.py).
    _held_opening: str = PrivateAttr(default="")
    # Other engines' hint envelopes (server/hints.py): vLLM's kv_hints, Dynamo's nvext.
    kv_hints: KvHints | None = None
    nvext: NvExt | None = None
    # Agent / tenant extensions.
    cache_salt: str | None = Field(default=None, description="requests share cached KV only within one salt")
    deadline_ms: float | None = Field(default=None, gt=0, le=DEADLINE_MAX_MS, allow_inf_nan=False,
                                      description="arrival to the last token, for goodput (or header "
                                                  "x-trajserve-deadline-ms)")
    priority: StrictInt | None = Field(default=None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1],
                                       description="lower runs first under --scheduling priority / program "
                                                   "(vLLM's); default 0")
    session_id: str | None = Field(default=None, description="pins a trajectory (or header X-Session-Id)")
    tool_wait_s: float | None = Field(default=None, ge=0, description="a tool pause follows this turn: "
                                      "the session's state waits where the keep policy puts it")
    tool: str | None = Field(default=None, description="the tool about to run (its wait history informs the policy)")
    tool_decision: PauseTier | None = Field(default=None, description="where the session's state waits through "
                                            "the pause (default: the keep policy decides)")
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs
    # / guided_* fields (trajserve/structured.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def hinted_pause(self) -> dict:
        return self._hinted_pause

    @hinted_pause.setter
    def hinted_pause(self, pause: dict) -> None:
        self._hinted_pause = dict(pause)

    @property
    def turn_priority(self) -> int:
        return self._turn_priority

    @turn_priority.setter
    def turn_priority(self, priority: int) -> None:
        self._turn_priority = priority

    @property
    def held_opening(self) -> str:
        return self._held_opening

    @held_opening.setter
    def held_opening(self, opening: str) -> None:
        self._held_opening = opening

    def note(self, field: str, value) -> None:
        self._notes[field] = value

    def name_conversation(self, origin: str, key: str) -> None:
        """The conversation another API's own field names (its translation says so)."""
        self._conversation = (origin, key)

    @property
    def notes(self) -> dict:
        return dict(self._notes)

    def conversation(self) -> tuple[str, str] | None:
        """(origin, key) of the conversation the request names without a
        session_id, or None (server/conversations.py)."""
        if self._conversation is not None:
            return self._conversation
        if self.prompt_cache_key:
            return "prompt_cache_key", self.prompt_cache_key
        context = self.nvext.agent_context if self.nvext is not None else None
        trajectory = context.trajectory() if context is not None else None
        return ("nvext.agent_context", trajectory) if trajectory else None

    @property
    def structured_given(self) -> bool:
        rf = self.response_format
        return (rf is not None and rf.type != "text") or any(
            getattr(self, k) is not None for k in ("structured_outputs", "guided_json", "guided_regex",
                                                   "guided_choice", "guided_grammar"))

    def structured(self) -> StructuredOutput | None:
        """The one output constraint the request asks for (ValueError if it
        asks for more than one, naming them)."""
        found = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found["response_format"] = StructuredOutput(json_object=True)
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            found["response_format"] = StructuredOutput(json_schema=rf.json_schema.schema_)
        so = self.structured_outputs
        if so is not None:
            found["structured_outputs"] = StructuredOutput(json_schema=so.json_, json_object=bool(so.json_object),
                                                           regex=so.regex, choice=so.choice, grammar=so.grammar)
        for name, kw in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                         ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found[name] = StructuredOutput(**{kw: getattr(self, name)})
        if len(found) > 1:
            raise ValueError(f"one output constraint per request; got {', '.join(found)}")
        return next(iter(found.values()), None)

    def check_unsupported(self) -> None:
        """Fields a client may send whose meaning trajserve cannot give:
        refused by name (ValueError) rather than ignored."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream=true (as vLLM)")

    def sampling_params(self, max_tokens: int | None, default_max: int, logprobs: int | None,
                        structured: StructuredOutput | None = None,
                        defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingParams:
        """defaults: the server's (--override-generation-config), for the
        fields this request leaves out, and its cap on max_tokens."""
        self.check_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = {}
        for k, v in (self.logit_bias or {}).items():
            if not k.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
            bias[int(k)] = v
        sp = SamplingParams(
            n=self.n, max_tokens=defaults.cap(default_max if max_tokens is None else max_tokens),
            temperature=defaults.value("temperature", self.temperature, 1.0),
            top_p=defaults.value("top_p", self.top_p, 1.0), top_k=defaults.value("top_k", self.top_k, 0),
            seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=defaults.value("repetition_penalty", self.repetition_penalty, 1.0),
            logit_bias=bias, structured=structured)
        sp.validate()
        return sp


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    n: int = Field(default=1, ge=1, le=64)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise ValueError("suffix is not supported (no fill-in-the-middle)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of is not supported (only best_of == n), got best_of={self.best_of}, n={self.n}")


class ContentPart(BaseModel):
    """A part of a message's content. Only text parts are read; others
    (image_url, input_audio, file) are refused by name when the prompt is
    built (ChatMessage.check_parts), not as a type error."""
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict = "{}"


class ToolCall(BaseModel):
    """A call the assistant made in an earlier turn (the client sends it back)."""
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")  # strict, and whatever else a template may read
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    # What a reasoning model thought before this (assistant) turn's tool calls,
    # as the server returned it (server/harmony.py).
    reasoning_content: str | None = None

    def check_parts(self, where: str) -> None:
        """ValueError naming a content part that is not text."""
        for j, p in enumerate(self.content if isinstance(self.content, list) else []):
            if p.type != "text":
                raise ValueError(f"{where}.content.{j}: {p.type} parts are not supported; "
                                 "the models served here read text")
            if p.text is None:
                raise ValueError(f"{where}.content.{j}: a text part needs its text")

    def as_template_dict(self, calls_as_text: bool = False) -> dict:
        """The message as chat templates read it. Tool calls go in as
        templates expect them (Qwen's writes `arguments | tojson`, so a JSON
        string becomes an object, as vLLM does); with calls_as_text (a
        template that does not render tool_calls), they are written into the
        content in the Hermes form the model produced them in, so the history
        keeps them and the prefix cache still matches the reply's tokens."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text or "" for p in content)
        # Chat templates of small models know system/user/assistant; a
        # developer message is a system message there.
        role = "system" if self.role == "developer" else self.role
        d = {"role": role, "content": content or ""}
        if self.name:
            d["name"] = self.name
        if self.tool_call_id:
            d["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": _json_object(c.function.arguments)}}
                     for c in self.tool_calls]
            if calls_as_text:
                d["content"] += "\n".join(hermes_text(c["function"]["name"], c["function"]["arguments"])
                                          for c in calls)
            else:
                d["tool_calls"] = calls
                if self.reasoning_content and not d["content"]:
                    # Harmony keeps the analysis that led to a call until the turn's answer:
                    # gpt-oss's template writes `thinking` back before the call (others ignore it).
                    d["thinking"] = self.reasoning_content
        return d


def _json_object(arguments: str | dict):
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # the template gets what the client sent


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: _FunctionName


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # False: at most one call per reply
    add_generation_prompt: StrictBool = True
    # extension (vLLM): the reply continues the last message (an assistant
    # prefill) instead of opening a new turn
    continue_final_message: StrictBool = False

    @property
    def parses_tool_calls(self) -> bool:
        """OpenAI's default is "auto" when tools are given: the reply may call
        them (server/tool_calls.py). Not under an output constraint: the
        client asked for the reply itself in that shape."""
        return bool(self.tools) and self.tool_choice in (None, "auto") and not self.structured_given

    @property
    def forced_tool(self) -> str | None:
        """"required" or the name of the function tool_choice names (the
        reply is then held to JSON for the call: server/tool_calls.py)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "required" if self.tool_choice == "required" else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text prompt (encoded as /v1/completions encodes
    it), or chat messages (rendered as /v1/chat/completions renders them)."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = True  # prompt form only: the template writes a chat's own
    return_token_strs: StrictBool = False

    def chat(self) -> ChatCompletionRequest:
        return ChatCompletionRequest(model=self.model, messages=self.messages, tools=self.tools,
                                     add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]
