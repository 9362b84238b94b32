"""OpenAI's reply bodies and stream chunks from engine outputs: usage,
the legacy and chat logprobs objects, vLLM's prompt_logprobs, a chat
choice's message with its parsed tool calls; /v1/messages and
/v1/responses translate the chat chunks into their own events."""
from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import AsyncIterator

from trajserve.outputs import CompletionOutput, RequestOutput
from trajserve.server.errors import APIError
from trajserve.server.protocol import ChatCompletionRequest, CompletionRequest
from trajserve.server import harmony
from trajserve.server.tool_calls import ForcedStream, call_stream, parse_calls


def prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty: at least 1 token is required", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(c.token_ids) for f in finals for c in f.outputs)
    drafted = sum(f.metrics.num_draft_tokens for f in finals)
    accepted = sum(f.metrics.num_accepted_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.num_cached_tokens for f in finals)},
            # OpenAI's names for predicted tokens the output kept / discarded:
            # here speculative decoding's draft tokens (--speculative)
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafted - accepted}}


def token_str(tok, t: int) -> str:
    return tok.decode([t], skip_special_tokens=False)


def completion_logprobs(ids: list[int], lps, tok, k: int, start: int = 0) -> dict | None:
    """The legacy logprobs object. An entry of lps is (logprob, {token: logprob}
    top alternatives, ...) or None (an echoed prompt's first token, which
    nothing predicts). top_logprobs: the k likeliest and the token itself,
    as vLLM gives them; text_offset counts from `start` (the text before)."""
    if lps is None:
        return None
    tokens = [token_str(tok, t) for t in ids]
    offsets, pos = [], start
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    top = []
    for t, s, e in zip(ids, tokens, lps):
        if e is None:
            top.append(None)
            continue
        d = {token_str(tok, a): v for a, v in itertools.islice(e[1].items(), k)}
        d.setdefault(s, e[0])
        top.append(d)
    return {"tokens": tokens, "token_logprobs": [e and e[0] for e in lps], "top_logprobs": top,
            "text_offset": offsets}


def echo_logprobs(out: RequestOutput, ids: list[int], lps: list | None, echo: bool) -> tuple[list[int], list]:
    """A choice's tokens and their logprobs, the prompt's first when echoed."""
    if not echo or lps is None:
        return ids, lps
    return out.prompt_token_ids + ids, out.prompt_logprobs + lps


def prompt_logprobs(final: RequestOutput, tok, k: int) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id:
    {logprob, rank, decoded_token}} for the token itself and the top k (the
    engine may hold more: echo + logprobs asked for them too)."""
    if final.prompt_logprobs is None:
        return None
    out: list = [None]
    for t, (lp, alts, rank) in zip(final.prompt_token_ids[1:], final.prompt_logprobs[1:]):
        d = {a: {"logprob": v, "rank": r, "decoded_token": token_str(tok, a)}
             for r, (a, v) in enumerate(itertools.islice(alts.items(), k), 1)}
        d[t] = {"logprob": lp, "rank": rank, "decoded_token": token_str(tok, t)}
        out.append(d)
    return out


def chat_logprobs(ids: list[int], lps, tok) -> dict | None:
    if lps is None:
        return None
    content = []
    for t, (lp, alts) in zip(ids, lps):
        s = token_str(tok, t)
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": token_str(tok, a), "logprob": v,
                                          "bytes": list(token_str(tok, a).encode())} for a, v in alts.items()]})
    return {"content": content}


def chat_message(c: CompletionOutput, req: ChatCompletionRequest, fmt: str) -> dict:
    """A finished choice's message and finish_reason; with tools, its tool
    calls (fmt: the model's tool-call format, server/tool_calls.py)."""
    opening = req.held_opening  # a harmony reply held to JSON: its header is in the prompt
    if req.forced_tool is not None:
        parsed = harmony.held_call(opening, c.text, req.forced_tool)
    elif fmt == "harmony":  # every reply: its reasoning and its answer are separate messages
        parsed = harmony.parse(opening + c.text, calls=req.parses_tool_calls)
    else:
        parsed = parse_calls(c.text, fmt) if req.parses_tool_calls else None
    parsed = one_call_if_asked(parsed, req)
    if parsed is None:
        return {"message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
    message = {"role": "assistant", "content": parsed.content if parsed.tool_calls or fmt == "harmony" else c.text}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if not parsed.tool_calls:
        return {"message": message, "finish_reason": c.finish_reason}
    return {"message": {**message, "tool_calls": parsed.tool_calls}, "finish_reason": calls_finish(req)}


def one_call_if_asked(parsed, req: ChatCompletionRequest):
    """parallel_tool_calls=false: a reply that calls several tools keeps the
    first (a forced "required" reply is held to one call by its schema)."""
    if parsed is not None and req.parallel_tool_calls is False and len(parsed.tool_calls) > 1:
        parsed.tool_calls = parsed.tool_calls[:1]
    return parsed


def calls_finish(req: ChatCompletionRequest) -> str:
    # OpenAI's: a call the client named ends as "stop", one the model chose as "tool_calls".
    return "stop" if req.forced_tool not in (None, "required") else "tool_calls"


def choice_call_stream(req: ChatCompletionRequest, fmt: str):
    """A choice's streaming parser when the reply may hold tool calls, else None."""
    opening = req.held_opening
    if req.forced_tool is not None:
        return ForcedStream(functools.partial(harmony.held_call, opening, forced=req.forced_tool))
    if fmt == "harmony":
        stream = harmony.HarmonyStream(calls=req.parses_tool_calls)
        stream.feed(opening)  # the header only: nothing to send
        return stream
    return call_stream(fmt) if req.parses_tool_calls else None


def prompt_only(out: RequestOutput) -> RequestOutput:
    """A scoring request's output (echo, max_tokens 0): the token sampled
    past the prompt is not part of the reply."""
    comps = [dataclasses.replace(c, text="", token_ids=[], delta_text="", delta_token_ids=[],
                                 logprobs=None if c.logprobs is None else [],
                                 finish_reason="length" if c.finish_reason in ("stop", "length")
                                 else c.finish_reason, stop_reason=None)
             for c in out.outputs]
    return dataclasses.replace(out, outputs=comps)


def new_logprobs(c: CompletionOutput, sent: dict[int, int], index: int | None = None
                  ) -> tuple[list[int], list] | None:
    """The choice's tokens and logprobs not sent yet (sent: per choice index, how many were)."""
    if c.logprobs is None:
        return None
    index = c.index if index is None else index
    k = sent.get(index, 0)
    sent[index] = len(c.logprobs)
    return c.token_ids[k:len(c.logprobs)], c.logprobs[k:]


async def completion_chunks(outs: AsyncIterator[tuple[int, RequestOutput]], rid, created, model,
                             req: CompletionRequest, tok, echoed: list[str], n: int) -> AsyncIterator[dict]:
    """Chunks of prompt i's choices (index i * n + choice, as the reply
    without stream numbers them), interleaved as the steps produce them."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sent: dict[int, int] = {}
    at: dict[int, int] = {}  # per choice: text_offset of its next token (the echo and tokens sent before)
    finals: dict[int, RequestOutput] = {}
    async for i, out in outs:
        finals[i] = out
        for c in out.outputs:
            index = i * n + c.index
            first = index not in at  # the choice's first chunk carries the echo
            if not c.delta_token_ids and not (first and req.echo):
                continue
            new = new_logprobs(c, sent, index)
            if new:
                new = echo_logprobs(out, *new, first and req.echo)
            lp = completion_logprobs(*new, tok, req.logprobs, at.get(index, 0)) \
                if new and req.logprobs is not None else None
            if lp is not None and lp["tokens"]:
                at[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            else:
                at.setdefault(index, 0)
            choice = {"index": index, "text": (echoed[i] if first else "") + c.delta_text, "logprobs": lp,
                      "finish_reason": c.finish_reason}
            chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                     "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            yield chunk
    if include_usage and finals:
        yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": usage(list(finals.values()))}


async def chat_chunks(outs, rid, created, model, req: ChatCompletionRequest, tok, fmt: str
                       ) -> AsyncIterator[dict]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sent: dict[int, int] = {}
    started: set[int] = set()
    parsers = {}  # per choice, with tools: choice_call_stream's parser (holds back what may be a call)
    final = None

    notes = dict(req.notes)  # what the reply says beside its text (tools_not_shown, prefix_break): the first chunk

    def chunk(index: int, delta: dict, finish: str | None, logprobs=None) -> dict:
        d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            d["usage"] = None
        if notes:
            d.update(notes)
            notes.clear()
        return d

    async for out in outs:
        final = out
        for c in out.outputs:
            if c.index not in started:
                started.add(c.index)
                p = choice_call_stream(req, fmt)
                if p is not None:
                    parsers[c.index] = p
                yield chunk(c.index, {"role": "assistant", "content": ""}, None)
            if not c.delta_token_ids:
                continue
            new = new_logprobs(c, sent)
            lp = chat_logprobs(*new, tok) if new and req.logprobs else None
            text = parsers[c.index].feed(c.delta_text) if c.index in parsers else c.delta_text
            thought = parsers[c.index].take_reasoning() if isinstance(parsers.get(c.index), harmony.HarmonyStream) \
                else ""
            if thought:
                yield chunk(c.index, {"reasoning_content": thought}, None)
            if text or lp:
                yield chunk(c.index, {"content": text}, None, lp)
            if c.finished:
                finish = c.finish_reason
                if c.index in parsers:
                    rest = one_call_if_asked(parsers[c.index].finish(), req)
                    if rest.reasoning:
                        yield chunk(c.index, {"reasoning_content": rest.reasoning}, None)
                    if rest.content:
                        yield chunk(c.index, {"content": rest.content}, None)
                    if rest.tool_calls:
                        finish = calls_finish(req)
                        yield chunk(c.index, {"tool_calls": [{"index": i, **call}
                                                             for i, call in enumerate(rest.tool_calls)]}, None)
                yield chunk(c.index, {}, finish)
    if include_usage and final is not None:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": usage([final])}
