"""AsyncEngine: the synchronous LLMEngine on its own thread, fed from asyncio.

Every engine call (add, abort, fork, step) runs on the engine thread, between
steps, so nothing races the scheduler and an abort frees blocks only after
the step in flight that reads them has finished. Handlers submit closures to
an inbox and await results; each request's outputs come back on its own
asyncio.Queue via call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from trajserve.engine.engine import LLMEngine
from trajserve.outputs import RequestOutput
from trajserve.sampling import SamplingParams
from trajserve.server.admission_limit import AdmissionLimit, num_ahead_of
from trajserve.server.config import DEFAULT

log = logging.getLogger("trajserve.server")
# How often a request whose client cannot be read mid-stream (a non-streaming
# one) checks that the client is still connected.
DISCONNECT_CHECK_S = 0.5


class QueueFull(RuntimeError):
    """The admission queue is at its limit; the client should retry later."""

    def __init__(self, waiting: int, limit: int, retry_after_s: float) -> None:
        super().__init__(f"the admission queue holds {waiting} requests, its limit is {limit}; retry later")
        self.retry_after_s = retry_after_s


class EngineDead(RuntimeError):
    pass


class StepFailed(RuntimeError):
    """The step a request ran in raised; the request was aborted and the
    engine went on serving the others."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    deadline_s: float | None = None  # the request's own, for goodput (server/goodput.py)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = DEFAULT.max_waiting,
                 on_finished: Callable[[RequestOutput, float | None], None] | None = None,
                 extra_metrics: Callable[[], dict] | None = None,
                 admission: AdmissionLimit | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.admission = admission  # --admission: a cap on the requests in the engine
        # (fn, loop, future): fn(engine) runs on the engine thread; the future
        # (None for fire-and-forget jobs) gets its result on the caller's loop.
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._error: BaseException | None = None
        # Read by /metrics from other threads: replaced whole, never mutated.
        self.snapshot: dict[str, Any] = {}
        # Every request that ends, its output final: finished, or aborted
        # (its unfinished choices say "abort", or "error" when a step failed
        # under them), so counters see all the work done.
        self.on_finished = on_finished
        self.num_failed_steps = 0  # steps that raised and were recovered from (_fail_in_flight)
        # More figures for the snapshot, computed on the engine thread.
        self.extra_metrics = extra_metrics
        self._refresh_snapshot()  # the engine thread refreshes it after every step and while idle
        self._thread = threading.Thread(target=self._run, name="trajserve-engine", daemon=True)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def running(self) -> bool:
        """The engine thread has not returned (shutdown waits at most 30 s)."""
        return self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    # ---------------------------------------------------------- engine calls
    def call(self, fn: Callable[[LLMEngine], Any]) -> Awaitable[Any]:
        """Run fn(engine) on the engine thread between steps; await its result."""
        if not self.alive:
            raise EngineDead(f"the engine loop stopped: {self._error!r}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._inbox.put((fn, loop, fut))
        self._wake.set()
        return fut

    async def add(self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
                  request_id: str | None = None, lora: str | None = None, priority: int = 0,
                  program: str | None = None, deadline_s: float | None = None) -> tuple[str, asyncio.Queue]:
        """Queue a request; returns its id and the queue its outputs arrive on.
        Raises ValueError (bad input), QueueFull, AdmissionFull or DeadlineMiss (engine/deadline.py)
        before anything is queued."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def add(engine: LLMEngine) -> str:
            waiting = len(engine.scheduler.waiting)
            if waiting >= self.max_waiting:
                raise QueueFull(waiting, self.max_waiting, retry_after_s=1.0)
            if self.admission is not None:
                self.admission.check(num_ahead_of(engine.scheduler, priority))
            rid = engine.add_request(prompt, params, request_id=request_id, cache_salt=cache_salt, lora=lora,
                                     priority=priority, program=program, deadline_s=deadline_s)
            self._streams[rid] = _Stream(loop, q, deadline_s)
            return rid

        return await self.call(add), q

    async def generate(self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
                       is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                       lora: str | None = None, priority: int = 0, program: str | None = None,
                       deadline_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step until it finishes. Leaving
        early (client gone, generator closed) aborts it and frees its blocks."""
        rid, q = await self.add(prompt, params, cache_salt, lora=lora, priority=priority, program=program,
                                deadline_s=deadline_s)
        finished = False
        loop = asyncio.get_running_loop()
        check_at = loop.time() + DISCONNECT_CHECK_S
        try:
            while True:
                if is_disconnected is None:
                    out = await q.get()
                else:
                    # Checked every DISCONNECT_CHECK_S whether outputs arrive or
                    # not: a decoding request yields every step, and its client
                    # may have gone long ago.
                    try:
                        out = await asyncio.wait_for(q.get(), timeout=max(0.0, check_at - loop.time()))
                    except TimeoutError:
                        out = None
                    if loop.time() >= check_at:
                        check_at = loop.time() + DISCONNECT_CHECK_S
                        if await is_disconnected():
                            return
                    if out is None:
                        continue
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run fn(engine) on the engine thread, without waiting for it."""
        self._inbox.put((fn, None, None))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        def job(engine: LLMEngine) -> None:
            st = self._streams.pop(request_id, None)
            out = engine.abort_request(request_id)
            if out is not None:
                self._ended(out, st)
        self._inbox.put((job, None, None))
        self._wake.set()

    # ------------------------------------------------------------ the loop
    def _run(self) -> None:
        engine = self.engine
        last_end = None  # when the previous step ended, while the engine has been busy since
        try:
            while not self._stop:
                self._drain_inbox()
                if not engine.has_unfinished_requests():
                    last_end = None
                    engine.step_hooks.idle()  # a session manager's leases, prefetches, expiry
                    self._refresh_snapshot()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                try:
                    outs = engine.step()
                except Exception as e:  # noqa: BLE001 - recovered below, or fatal if that fails
                    self._fail_in_flight(e)
                    continue
                if self.admission is not None:
                    # Step to step, as clients see it: the loop's own work and the HTTP threads' share of
                    # the CPU included, not only the step's.
                    now = time.perf_counter()
                    if last_end is not None:
                        self.admission.observe_step(engine.last_step.num_seqs, now - last_end)
                    last_end = now
                for out in outs:
                    st = self._streams.get(out.request_id)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                        self._ended(out, st)
                    if st is not None:
                        st.loop.call_soon_threadsafe(st.queue.put_nowait, out)
                self._refresh_snapshot()
        except BaseException as e:  # noqa: BLE001 - every waiting client must hear of it
            self._error = e
            log.exception("engine loop failed")
            for st in self._streams.values():
                st.loop.call_soon_threadsafe(st.queue.put_nowait, EngineDead(f"engine loop failed: {e!r}"))
            self._streams.clear()
            while True:  # callers blocked on call() must not hang
                try:
                    _, loop, fut = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if fut is not None:
                    loop.call_soon_threadsafe(_set_exception, fut, EngineDead(f"engine loop failed: {e!r}"))

    def _fail_in_flight(self, e: Exception) -> None:
        """A step raised (an input no check caught, a kernel fault): the
        requests that may have been in it are aborted, their clients told,
        and the loop goes on for the rest (waiting requests are kept). If
        aborting fails too, the state cannot be trusted: re-raise, and the
        loop stops for everyone (the caller's fatal path)."""
        log.exception("a step failed; aborting the requests in flight and going on")
        aborted = self.engine.abort_in_flight()
        for rid, out in aborted.items():
            st = self._streams.pop(rid, None)
            if out is not None:
                self._ended(out, st)
            if st is not None:
                st.loop.call_soon_threadsafe(st.queue.put_nowait, StepFailed(
                    f"the step this request ran in failed ({e!r}); it was aborted, and the server goes on"))
        self.num_failed_steps += 1

    def _ended(self, out: RequestOutput, st: _Stream | None) -> None:
        """A request ended (finished, aborted, failed): the metrics' callback and the admission cap hear of it."""
        if self.on_finished is not None:
            self.on_finished(out, st.deadline_s if st is not None else None)
        if self.admission is not None:
            self.admission.observe(out)

    def _refresh_snapshot(self) -> None:
        snap = self.engine.metrics()
        if self.admission is not None:
            snap.update(self.admission.metrics())
        if self.extra_metrics is not None:
            snap.update(self.extra_metrics())
        self.snapshot = snap

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn, loop, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                res = fn(self.engine)
            except Exception as e:  # bad input: handed to the awaiting handler
                if fut is None:
                    raise
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                if fut is not None:
                    loop.call_soon_threadsafe(_set_result, fut, res)


def _set_result(fut: asyncio.Future, res: Any) -> None:
    if not fut.done():
        fut.set_result(res)


def _set_exception(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
