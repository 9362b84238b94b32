"""What every route of the server shares, injected into each (the routers
in server/routes/ take it with Depends(server_state)): the engine and its
async loop, the tokenizer, the served names, the session manager, the
stored responses; and the checks and steps the APIs have in common --
model names, sampling parameters, room in the context, queueing a request,
a session's turn around it, and rendering a chat (the one place a chat
becomes prompt ids)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from trajserve.kv.retention import TTL_S
from trajserve.kv.scope import CacheScope
from trajserve.lora.adapter import AdapterError
from trajserve.outputs import RequestOutput
from trajserve.sampling import SamplingParams
from trajserve.server import harmony, responses, streams
from trajserve.engine.deadline import DeadlineMiss
from trajserve.server.admission_limit import AdmissionFull
from trajserve.server.async_engine import AsyncEngine, EngineDead, QueueFull
from trajserve.server.conversations import conversation_id, inferred_tool, lineage
from trajserve.server.errors import SAMPLING_FIELDS, APIError, field_named
from trajserve.server.generation_defaults import NONE as NO_DEFAULTS
from trajserve.server.generation_defaults import GenerationDefaults
from trajserve.server.goodput import DEADLINE_HEADER, check_deadline_ms
from trajserve.server.key_priority import KeyPriorities
from trajserve.server.hints import SESSIONLESS, pause_from_hints, priority_from_hints
from trajserve.server.metrics import ServerMetrics
from trajserve.server.openai_format import chat_message
from trajserve.server.prefix_break import TurnShape, diagnose
from trajserve.server.protocol import ChatCompletionRequest
from trajserve.server.tool_calls import FORMATS, forced_schema, format_for_template
from trajserve.sessions.ids import check_session_id
from trajserve.sessions.manager import SessionBusy, SessionManager
from trajserve.structured import StructuredOutput

log = logging.getLogger("trajserve.server")
TURN_RECORDS = 4096  # sessions whose turns are compared (the least recently active go first)
BREAKS_KEPT = 16  # a session's latest prefix breaks, on GET /v1/sessions/{id}


@dataclass
class TurnRecord:
    shape: TurnShape | None = None
    breaks: deque = field(default_factory=lambda: deque(maxlen=BREAKS_KEPT))


def calls_format_for(tok, tool_call_parser: str) -> str:
    """The model's tool-call format (server/tool_calls.py): from its chat
    template for "auto", else the one named."""
    if tool_call_parser not in ("auto", *FORMATS):
        raise ValueError(f"tool call parser must be auto or one of {', '.join(FORMATS)}, got {tool_call_parser!r}")
    return format_for_template(tok.chat_template) if tool_call_parser == "auto" else tool_call_parser


class ServerState:
    def __init__(self, aengine: AsyncEngine, names: list[str], metrics: ServerMetrics,
                 sessions: SessionManager | None, calls_format: str,
                 generation: GenerationDefaults = NO_DEFAULTS, key_priorities: KeyPriorities | None = None) -> None:
        self.aengine, self.engine = aengine, aengine.engine
        self.key_priorities = key_priorities  # --api-key-priority
        self.tok = self.engine.tokenizer
        self.names, self.served_model_name = names, names[0]
        self.metrics, self.sessions = metrics, sessions
        self.calls_format = calls_format
        self.generation = generation  # --override-generation-config
        self.store = responses.ResponseStore()  # /v1/responses with store: true
        self._said_tools = False  # tools a template cannot show: logged once
        # Each session's last turn shape and its prefix breaks (server/prefix_break.py), the most recent last.
        self.turns: OrderedDict[str, TurnRecord] = OrderedDict()

    def model_card(self, name: str) -> dict:
        card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "trajserve",
                "max_model_len": self.engine.max_model_len}
        if name not in self.names:  # a LoRA adapter: vLLM's card names its base (no path is shown)
            card.update(root=name, parent=self.served_model_name)
        return card

    @property
    def adapter_names(self) -> list[str]:
        return sorted(self.engine.lora.adapters) if self.engine.lora is not None else []

    def reply_model(self, req) -> str:
        """The name a reply carries: the one the request used (an alias
        included), else the first served name."""
        return req.model or self.served_model_name

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names, None for the base model; 404 for neither.
        (Read on the event loop: a dict lookup, while the engine thread may load or unload.)"""
        if model is None or model in self.names:
            return None
        if self.engine.lora is not None and model in self.engine.lora.adapters:
            return model
        served = self.names + self.adapter_names
        raise APIError(404, f"the model `{model}` does not exist; this server serves "
                            f"{', '.join(f'`{n}`' for n in served)}", param="model", code="model_not_found")

    def sampling(self, req, max_tokens, default_max, logprobs, structured=None):
        try:
            structured = structured or req.structured()
            return req.sampling_params(max_tokens, default_max, logprobs, structured, self.generation)
        except ValueError as e:
            raise APIError(400, str(e), param=field_named(e, type(req).model_fields)) from None

    async def compile_constraint(self, sp) -> None:
        """A structured output compiles here, on a worker thread (llguidance
        releases the GIL), so the engine thread only copies the compiled
        matcher: a large schema does not hold up everyone else's steps."""
        if sp.structured is not None:
            try:
                await asyncio.to_thread(self.engine.prepare_structured, sp)
            except ValueError as e:
                raise APIError(400, str(e)) from None

    async def _tool_schema_error(self, tools, e: APIError) -> APIError:
        """A forced tool call's schema did not compile: name the tool whose
        parameters do not (each compiled alone; the error path only)."""
        for i, t in enumerate(tools):
            one = SamplingParams(structured=StructuredOutput(json_schema=t.function.parameters or {"type": "object"}))
            try:
                await asyncio.to_thread(self.engine.prepare_structured, one)
            except ValueError as bad:
                return APIError(400, f"tools.{i} ({t.function.name!r}): its parameters are not a JSON schema "
                                     f"replies can be held to: {bad}", param=f"tools.{i}.function.parameters")
        return APIError(400, f"tools: the tools' schemas together cannot hold a forced call: {e.message}",
                        param="tools")

    def check_room(self, n_prompt: int, sp, explicit: bool) -> None:
        """A max_tokens the client gave that the context cannot hold after the
        prompt is a 400 (as OpenAI and vLLM answer; agent frameworks compact
        their history on it), not a reply cut short without notice. A prompt
        over the context is the engine's error, below."""
        limit = self.engine.max_model_len
        if explicit and n_prompt < limit and n_prompt + sp.max_tokens > limit:
            raise APIError(400, f"max_tokens is too large: {sp.max_tokens:,}. The context holds {limit:,} tokens "
                                f"and the prompt has {n_prompt:,} ({sp.max_tokens:,} > {limit:,} - {n_prompt:,})",
                           param="max_tokens", code="context_length_exceeded")

    async def start(self, prompt, sp, salt, request: Request, stream: bool, param: str = "messages",
                    lora: str | None = None, order: dict | None = None) -> streams.Outputs:
        """Queue the request now (so bad input fails before a stream starts)
        and return its output iterator. param: the request's prompt field
        (named by a context error); lora: the adapter (check_model); order:
        its priority and program (order())."""
        try:
            gen = self.aengine.generate(prompt, sp, salt, None if stream else request.is_disconnected, lora=lora,
                                        **(order or {}))
            first = await anext(gen)
        except StopAsyncIteration:  # the client left before the first output: nothing to send
            first = None
        except (QueueFull, AdmissionFull) as e:
            raise APIError(429, str(e), "rate_limit_error",
                           headers={"Retry-After": str(max(1, round(e.retry_after_s)))}) from None
        except DeadlineMiss as e:  # predicted late: refused before it queued (--deadline-admission)
            self.metrics.deadline_refusals.labels(str(e.status)).inc()
            raise APIError(e.status, str(e), "rate_limit_error" if e.busy else "server_error", param="deadline_ms",
                           headers={"Retry-After": str(round(e.retry_after_s))} if e.busy else None) from None
        except EngineDead as e:
            raise APIError(503, str(e), "server_error") from None
        except AdapterError as e:  # unloaded between the check and the queue
            raise APIError(404, str(e), param="model", code="model_not_found") from None
        except ValueError as e:
            code = "context_length_exceeded" if "tokens" in str(e) else None
            name = field_named(e, SAMPLING_FIELDS | {"prompt"})
            raise APIError(400, str(e), param=param if name == "prompt" else name, code=code) from None

        return streams.Outputs(first, gen)

    async def begin_session(self, req, request: Request, n_prompts: int = 1, lora: str | None = None,
                            prompt: list[int] | None = None):
        """The session a request is a turn of: its session_id (or
        X-Session-Id), else the conversation its own API's fields name
        (server/conversations.py; prompt: its ids, whose head tells a
        harness's side calls from its main loop), else None."""
        sid = req.session_id or request.headers.get("x-session-id")
        if sid is None:
            return await self._inferred_session(req, n_prompts, lora, prompt)
        if self.sessions is None:
            raise APIError(400, "sessions keep their state in the prefix cache, which this server runs without",
                           param="session_id")
        if req.n != 1 or n_prompts != 1:
            raise APIError(400, "a session turn takes one prompt and n=1", param="session_id")
        try:
            check_session_id(sid)
        except ValueError as e:
            raise APIError(400, str(e), param="session_id") from None
        try:
            return await self.aengine.call(lambda _: self.sessions.before_turn(sid, req.cache_salt, lora))
        except SessionBusy as e:
            raise APIError(409, str(e), param="session_id") from None
        except AdapterError as e:
            raise APIError(404, str(e), param="model", code="model_not_found") from None
        except ValueError as e:  # the session belongs to another cache_salt or model
            raise APIError(400, str(e), param="session_id") from None

    async def _inferred_session(self, req, n_prompts: int, lora: str | None, prompt: list[int] | None):
        named = req.conversation()
        if named is None or self.sessions is None or req.n != 1 or n_prompts != 1 or prompt is None:
            for name in ("tool_wait_s", "tool_decision"):
                if getattr(req, name) is not None:
                    raise APIError(400, f"{name} needs a session_id (field or X-Session-Id header)", param=name)
            return None
        origin, key = named
        base = conversation_id(key, origin, req.cache_salt, lora)

        def turn(_):
            sid = lineage(self.sessions.sessions, base, prompt)
            if sid is None:  # its lineage has a turn running, or none is free: run without a session
                return None
            try:
                return self.sessions.before_turn(sid, req.cache_salt, lora, origin=origin)
            except (ValueError, AdapterError):  # the adapter went away or was loaded again: no session
                return None
        return await self.aengine.call(turn)

    def order(self, req, sess, request: Request) -> dict:
        """Where the scheduler puts the request (--scheduling priority /
        program): its priority field, else Dynamo's hint, else its API
        key's, else 0, never better than its key's (--api-key-priority);
        its program: the session or conversation it is a turn of. And its
        own deadline: the body's deadline_ms, else the header."""
        priority = req.priority if req.priority is not None else priority_from_hints(req.nvext)
        if self.key_priorities is not None:
            priority = self.key_priorities.apply(request.headers, priority)
        deadline_ms = req.deadline_ms
        header = request.headers.get(DEADLINE_HEADER)
        if deadline_ms is None and header is not None:
            try:
                value = float(header)
            except ValueError:
                value = header[:64]  # named as it came (cut), never parsed further
            try:
                deadline_ms = check_deadline_ms(value, DEADLINE_HEADER)
            except ValueError as e:
                raise APIError(400, str(e), param=DEADLINE_HEADER) from None
        req.turn_priority = priority or 0
        return {"priority": priority or 0, "program": sess.session_id if sess is not None else None,
                "deadline_s": None if deadline_ms is None else deadline_ms / 1e3}

    def _read_hints(self, req, sess) -> None:
        """Other engines' hint envelopes (server/hints.py): the pause they ask
        for, kept for the turn's end; each hint counted."""
        if req.kv_hints is None and req.nvext is None:
            return
        pause, seen = pause_from_hints(req.kv_hints, req.nvext)
        for source, hint, outcome in seen:
            self.metrics.hints.labels(source, hint, "no_session" if outcome == "applied" and sess is None
                                      and hint not in SESSIONLESS else outcome).inc()
        req.hinted_pause = pause

    def end_session(self, sess, final: RequestOutput | None, req) -> None:
        """The turn ended (final None: it never ran). Its pause is the
        request's own (tool_wait_s, tool, tool_decision), else the hints'
        (server/hints.py); a conversation's turn with neither pauses on
        what its reply waits for: its first tool call (a chat's reply parsed
        as its API returns it), or the human (a completion's)."""
        if sess is None:
            return
        hinted = req.hinted_pause
        wait = req.tool_wait_s if req.tool_wait_s is not None else hinted.get("wait")
        tool = req.tool if req.tool is not None else hinted.get("tool")
        decision = req.tool_decision if req.tool_decision is not None else hinted.get("decision")
        if sess.origin != "session_id" and (wait, tool, decision) == (None, None, None) \
                and final is not None and final.finished:
            message = chat_message(final.outputs[0], req, self.calls_format)["message"] \
                if isinstance(req, ChatCompletionRequest) else None
            tool = inferred_tool(message)
        self.aengine.submit(lambda _: self.sessions.after_turn(
            sess, final.prompt_token_ids if final else [], final, wait, tool, decision, req.turn_priority))

    async def session_stream(self, outs, sess, req):
        final = None
        try:
            async for out in outs:
                final = out
                yield out
        finally:
            self.end_session(sess, final, req)

    def get_session(self, session_id: str):
        s = self.sessions.sessions.get(session_id) if self.sessions is not None else None
        if s is None:
            raise APIError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
        return s

    def render_chat(self, req: ChatCompletionRequest) -> list[int]:
        return render_chat(self.tok, req)

    def _diagnose(self, sess, req: ChatCompletionRequest, ids: list[int]) -> None:
        """Where this turn's prompt leaves the session's previous context, and
        why (server/prefix_break.py): noted on the reply, kept with the
        session's turns, counted in /metrics. The session's turn is in flight:
        its history is this request's to read."""
        shape = TurnShape.of(len(ids), req.messages,
                             [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None)
        record = self.turns.pop(sess.session_id, None) or TurnRecord()
        self.turns[sess.session_id] = record  # the most recent last
        while len(self.turns) > TURN_RECORDS:
            self.turns.popitem(last=False)
        if record.shape is not None and sess.history:
            hit = diagnose(sess.turns, sess.history, record.shape, ids, shape,  # turns finished: this one's index
                           lambda t: self.tok.decode(t, skip_special_tokens=False))
            if hit is not None:
                record.breaks.append(hit)
                self.metrics.observe_break(hit)
                req.note("prefix_break", hit.as_dict())
        record.shape = shape

    def retain(self, prompt: list[int], marks: list[tuple[int, str]], salt: str | None, lora: str | None) -> None:
        """Keep the prompt's blocks up to each (token position, ttl) for that
        ttl ("5m", "1h", "24h"): every tier evicts them last
        (kv/retention.py). On the engine thread, which owns the KV manager;
        a read of the same prefix with the same mark refreshes it."""
        spans = [(position, TTL_S[ttl]) for position, ttl in marks if position >= self.engine.kv.block_size]
        if not spans:
            return

        def job(engine) -> None:
            try:
                scope = CacheScope.of(salt, engine.adapter(lora))
            except ValueError:  # its adapter was unloaded since (AdapterError): its blocks went with it
                return
            for position, ttl_s in spans:
                engine.kv.retain(prompt, scope, position, ttl_s)
        self.aengine.submit(job)

    def tools_not_shown(self, req: ChatCompletionRequest) -> str | None:
        """Why the request's tools do not reach the model (its chat template
        renders none and --tool-prompt is off), or None."""
        if not req.tools or self.tok.shows_tools:
            return None
        return (f"the model's chat template renders no tools: its {len(req.tools)} tool definitions were not "
                "shown to the model (the server's --tool-prompt hermes writes them into the system message)")

    async def open_chat(self, req: ChatCompletionRequest, request: Request, room_checked: bool = True,
                        ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """Check, render and queue a chat request; its outputs, the session
        (if any) updated when they end (ids: the request as already rendered).
        Shared by /v1/chat/completions and
        /v1/messages (room_checked=False: a max_tokens over what the context
        leaves is not an error; the reply stops at the context's end)."""
        lora = self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}", param="top_logprobs")
        forced = None  # tool_choice "required" or a named function: the reply is held to the call's JSON
        # A harmony reply held to JSON opens on the header its message takes (server/harmony.py).
        harmony_held = self.calls_format == "harmony" and (req.forced_tool is not None or req.structured_given)
        if req.forced_tool is not None:
            tool_names = [t.function.name for t in req.tools or []]
            if not tool_names:
                raise APIError(400, f"tool_choice {req.forced_tool!r} needs tools", param="tool_choice")
            if req.forced_tool != "required" and req.forced_tool not in tool_names:
                raise APIError(400, f"tool_choice names the function {req.forced_tool!r}, which is not among "
                                    f"the tools ({', '.join(tool_names)})", param="tool_choice")
            if req.structured_given:
                raise APIError(400, "a forced tool_choice and an output constraint (response_format, "
                                    "structured_outputs, guided_*) cannot both hold", param="tool_choice")
            tools = [t.model_dump() for t in req.tools]
            if harmony_held:
                req.held_opening = harmony.held_opening(req.forced_tool, tool_names)
            if req.held_opening == harmony.REQUIRED_OPENING:  # the call's name is the model's, then its arguments
                forced = StructuredOutput(grammar=harmony.required_grammar(tools, self.tok.is_special))
            else:
                forced = StructuredOutput(json_schema=forced_schema(tools, req.forced_tool,
                                                                    req.parallel_tool_calls is not False))
        elif harmony_held:
            req.held_opening = harmony.held_opening(None)
        ids = self.render_chat(req) if ids is None else ids
        if req.held_opening:
            ids = ids + self.tok.encode(req.held_opening, add_special_tokens=False)
        if (not_shown := self.tools_not_shown(req)) is not None:
            req.note("tools_not_shown", not_shown)
            if not self._said_tools:  # once, not per request
                self._said_tools = True
                log.warning("%s (said once here; each such reply says it in tools_not_shown)", not_shown)
        # Without max_tokens a reply may fill the context, as OpenAI's API allows.
        # n > 1: no more than the pool holds for all n at once (the engine refuses more).
        default_max = max(1, self.engine.max_model_len - len(ids))
        if req.n > 1:
            default_max = max(1, min(default_max, self.engine.max_tokens_within_pool(len(ids), req.n)))
        sp = self.sampling(req, req.requested_max_tokens, default_max,
                           (req.top_logprobs or 0) if req.logprobs else None, forced)
        self.check_room(len(ids), sp, room_checked and req.requested_max_tokens is not None)
        try:
            await self.compile_constraint(sp)
        except APIError as e:
            if forced is None:
                raise
            raise await self._tool_schema_error(req.tools, e) from None
        if req.prompt_cache_retention == "24h":  # OpenAI's extended retention: the whole prompt's prefix
            self.retain(ids, [(len(ids), "24h")], req.cache_salt, lora)
        sess = await self.begin_session(req, request, lora=lora, prompt=ids)
        if sess is not None:
            self._diagnose(sess, req, ids)
        self._read_hints(req, sess)
        try:
            outs = await self.start(ids, sp, req.cache_salt, request, req.stream, lora=lora,
                                    order=self.order(req, sess, request))
        except APIError:
            self.end_session(sess, None, req)
            raise
        return self.session_stream(outs, sess, req)

    def stored(self, response_id: str, param: str):
        got = self.store.get(response_id)
        if got is None:
            raise APIError(404, f"no stored response {response_id!r} (responses are kept in memory while "
                                f"store is true, the latest {self.store.limit:,})", param=param,
                           code="previous_response_not_found" if param == "previous_response_id" else None)
        return got


def render_chat(tok, req: ChatCompletionRequest, upto: int | None = None) -> list[int]:
    """The prompt ids for a chat request through the model's template (also
    what the cluster's front end hashes to route it: cluster/route_key.py).
    upto: only its first `upto` messages, as history (no reply prompt): the
    tokens a prefix of the conversation renders to."""
    # A template that does not render tool_calls (SmolLM2's) gets them as text.
    calls_as_text = "tool_calls" not in (tok.chat_template or "")
    try:
        for i, m in enumerate(req.messages):
            m.check_parts(f"messages.{i}")
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    try:
        messages = req.messages if upto is None else req.messages[:upto]
        return tok.encode_chat([m.as_template_dict(calls_as_text) for m in messages],
                               add_generation_prompt=req.add_generation_prompt and upto is None,
                               continue_final_message=req.continue_final_message and upto is None,
                               **({"tools": [t.model_dump(exclude_none=True) for t in req.tools]}
                                  if req.tools else {}))
    except Exception as e:  # noqa: BLE001 - template errors (raise_exception in jinja) are the client's
        raise APIError(400, f"chat template failed on these messages: {e}", param="messages") from None


def server_state(request: Request) -> ServerState:
    return request.app.state.server


