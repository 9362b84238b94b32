"""POST /v1/completions: the legacy API (a text, token ids, or a list of
prompts; echo, logprobs, scoring with max_tokens 0)."""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from trajserve.server import openai_format as oai
from trajserve.server import streams
from trajserve.server.errors import APIError
from trajserve.server.protocol import CompletionRequest
from trajserve.server.state import ServerState, server_state

router = APIRouter()


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, st: ServerState = Depends(server_state)):
    lora = st.check_model(req.model)
    # echo with max_tokens 0 scores the prompt and generates nothing (the
    # legacy API's scoring request): the engine samples the one token
    # the prefill gives anyway, and the reply leaves it out.
    score_only = req.echo and req.max_tokens == 0
    if req.max_tokens == 0 and not score_only:
        raise APIError(400, "max_tokens must be >= 1; 0 is allowed only with echo=true (the prompt is scored, "
                            "nothing is generated)", param="max_tokens")
    sp = st.sampling(req, 1 if score_only else req.max_tokens, 16, req.logprobs)
    if req.echo and req.logprobs is not None:
        # echo + logprobs scores the prompt's tokens too (the legacy API's
        # way to score text, e.g. lm-evaluation-harness's loglikelihood).
        sp.prompt_logprobs = max(sp.prompt_logprobs or 0, req.logprobs)
    # Text prompts are encoded here (as the engine would) to check each
    # one's room for max_tokens before any is queued.
    given = oai.prompt_list(req.prompt)
    prompts = [st.tok.encode(p) if isinstance(p, str) else p for p in given]
    # echo: the prompt as sent (token prompts decoded, special tokens kept).
    echoed = [(p if isinstance(p, str) else st.tok.decode(p, skip_special_tokens=False)) if req.echo else ""
              for p in given]
    for p in prompts:
        st.check_room(len(p), sp, "max_tokens" in req.model_fields_set and req.max_tokens is not None)
    await st.compile_constraint(sp)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    sess = await st.begin_session(req, request, len(prompts), lora, prompts[0] if len(prompts) == 1 else None)
    try:
        order = st.order(req, sess, request)
    except APIError:  # a bad deadline header: the turn never ran
        st.end_session(sess, None, req)
        raise
    if req.stream:
        # Every prompt is queued before the stream starts: one the engine
        # refuses is a 400 for the request, and the others are aborted.
        started = await asyncio.gather(*(st.start(p, sp, req.cache_salt, request, True, "prompt", lora, order)
                                         for p in prompts), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            for r in started:
                if not isinstance(r, BaseException):
                    await r.aclose()
            st.end_session(sess, None, req)
            raise next((e for e in failed if isinstance(e, APIError)), failed[0])
        if sess is not None:  # a session turn has one prompt
            started[0] = st.session_stream(started[0], sess, req)
        outs = streams.merge(started)
        if score_only:
            outs = ((i, oai.prompt_only(out)) async for i, out in outs)
        return streams.sse(oai.completion_chunks(outs, rid, created, st.reply_model(req), req, st.tok, echoed, sp.n))

    async def one(p):
        final = None
        try:
            final = await streams.last(await st.start(p, sp, req.cache_salt, request, False, "prompt", lora, order))
            return final
        finally:
            st.end_session(sess, final, req)

    try:  # all prompts run in the same batches; a failure cancels (aborts) the rest
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(p)) for p in prompts]
    except ExceptionGroup as eg:
        raise next((e for e in eg.exceptions if isinstance(e, APIError)), eg.exceptions[0]) from None
    finals = [t.result() for t in tasks]
    if any(f is None for f in finals):
        return Response(status_code=499)  # client went away
    if score_only:
        finals = [oai.prompt_only(f) for f in finals]
    choices = []
    for i, final in enumerate(finals):
        for c in final.outputs:
            scored = oai.echo_logprobs(final, c.token_ids, c.logprobs, req.echo)
            choice = {"index": i * sp.n + c.index, "text": echoed[i] + c.text,
                      "finish_reason": c.finish_reason,
                      "logprobs": oai.completion_logprobs(*scored, st.tok, req.logprobs)
                      if req.logprobs is not None else None}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = oai.prompt_logprobs(final, st.tok, req.prompt_logprobs)
            choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": created, "model": st.reply_model(req),
            "choices": choices, "usage": oai.usage(finals)}
