"""Agent sessions: a token history that lives across turns and tool pauses.

Spec: kv-cache-management section 1 (tool waits), "保留、驱逐、重计算或卸载"
(keep / offload / drop by the break-even wait), "分层辅助存储" (host and disk
tiers). A session's KV state is the radix path of its history: every turn's
blocks are cached as they fill, so the next turn's prompt (the history plus
the new observation) hits them. At a pause the keep policy decides where
that path waits:

    keep   pin the path in the device pool (a lease; when it runs out the
           state moves down a tier)
    host   copy its blocks to host memory, then free them on the device
    disk   write them to the disk tier (identity + checksum per block), free them
    drop   free them; the next turn recomputes (prefill) what is missing

Where the state waits and when it moves is the pause state machine's
(sessions/pause_machine.py), which the simulator runs too: leases, the
admission ceiling, pressure (kept state gives way to running work before
anyone is preempted, the session expected back last first), prefetch at a
safe lower bound of the wait, and the stall drop. Its transfers are real
copies here (sessions/offload.py): saves and loads on the runner's
copy engine, a resume's reload streaming in under the turn's prefill, disk
blocks checked for identity and damage on the way back (a block that fails
is recomputed, never served).

This module owns the sessions themselves: ids, turns, histories, forks,
expiry (idle ttl, the max_sessions cap), and the engine-step hooks that
advance the machine whoever steps the engine.
"""
from __future__ import annotations

import enum
import itertools
import logging
import math
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from trajserve.kv.scope import CacheScope
from trajserve.outputs import RequestOutput
from trajserve.sampling import SamplingParams
from trajserve.sessions.config import SessionConfig
from trajserve.sessions.host import EngineHost
from trajserve.sessions.ids import check_session_id
from trajserve.sessions.keep_policy import Decision, KeepPolicy, PauseDecision
from trajserve.sessions.offload import SessionOffload, SessionPause
from trajserve.sessions.pause_machine import PauseCounts, PauseMachine
from trajserve.sessions.wait_estimator import WaitEstimator

log = logging.getLogger("trajserve")
class SessionBusy(RuntimeError):
    """A second turn of a session arrived while one is still running."""


TURNS_KEPT = 64  # a session's latest turns whose hit rates describe() lists


class SessionState(enum.Enum):
    IDLE = "idle"  # between turns, state on the device
    PAUSED = "paused"  # waiting for a tool; state wherever the policy put it
    CLOSED = "closed"


@dataclass(eq=False)
class Session:
    """A session, as its manager keeps it. Where its KV state waits through a
    pause is its record's (`record`: the pause machine's fields and the
    offload's, each declared and written by its owner); the record's fields
    read here are views."""
    session_id: str
    cache_salt: str | None
    history: list[int]
    manager: SessionManager
    state: SessionState = SessionState.IDLE
    tool: str | None = None
    turns: int = 0
    last_output: RequestOutput | None = None
    prompt_tokens: int = 0  # over all turns, for the session's hit rate
    cached_tokens: int = 0
    # (prompt tokens, cached tokens, output tokens) of the latest turns: H_prefix turn by turn (eq. 2)
    turn_hits: deque = field(default_factory=lambda: deque(maxlen=TURNS_KEPT))
    # Its latest pauses: what it waited for, the wait expected and the one
    # observed at its resume, and where the policy put its state.
    pauses: deque = field(default_factory=lambda: deque(maxlen=TURNS_KEPT))
    in_flight: bool = False
    last_active: float = field(default_factory=time.monotonic)  # the last turn, pause or resume
    expired: str | None = None  # why the manager closed it: "idle" (ttl) or "cap" (max_sessions)
    lora: object = None  # the LoRA adapter every turn runs (lora/adapter.py), None for the base model
    # What named it: "session_id" (the client's id), or the field of the
    # client's own API a conversation was inferred from (server/conversations.py).
    origin: str = "session_id"
    record: SessionPause = field(init=False, repr=False)  # its pause record, made with it

    def __post_init__(self) -> None:
        self.record = SessionPause(session_id=self.session_id)

    @property
    def scope(self) -> CacheScope:  # where every turn's blocks live: salt and adapter (kv/scope.py)
        return CacheScope.of(self.cache_salt, self.lora)

    @property
    def num_tokens(self) -> int:
        return len(self.history)

    def generate(self, params: SamplingParams | None = None) -> RequestOutput:
        return self.manager.generate(self, params)

    def pause(self, expected_wait_s: float | None = None, tool: str | None = None,
              decision: Decision | str | None = None) -> PauseDecision:
        return self.manager.pause(self, expected_wait_s, tool, decision)

    def resume(self, observation: str | list[int] = ()) -> None:
        self.manager.resume(self, observation)

    def fork(self, n: int = 1) -> list[Session]:
        return self.manager.fork(self, n)

    def close(self) -> None:
        self.manager.close(self)


# Read-only views of the record's fields (describe, the benches and the tests
# read them); only the pause machine and the offload write them.
for _name in ("tier", "residency", "decision", "pin", "lease_deadline", "paused_at", "forced", "expected_wait_s",
              "prefetch_at", "prefetched", "table", "copy", "hold", "importing", "saved_blocks"):
    setattr(Session, _name, property(lambda s, _n=_name: getattr(s.record, _n)))


@dataclass
class SessionStats(PauseCounts):
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_out_s: float = 0.0
    swap_in_s: float = 0.0
    corrupt_blocks: int = 0  # saved blocks rejected on the way back: damaged or not the block saved
    resume_stall_s: float = 0.0  # time resumed turns waited for their state (loads not hidden)
    reload_hidden_s: float = 0.0  # copy time of resume reloads hidden behind the turn's prefill
    reload_no_room: int = 0  # reloads given up because the pool had no room (the turn recomputes)
    expired: Counter = field(default_factory=Counter)  # sessions closed by the manager: "idle" / "cap"


class SessionManager:
    def __init__(self, engine: EngineHost, config: SessionConfig = SessionConfig(),
                 policy: KeepPolicy | None = None, waits: WaitEstimator | None = None) -> None:
        """config: the tiers, prefetch, expiry (sessions/config.py). policy,
        waits: the keep policy and wait estimator (default: priced with the
        engine's rates, learning from this manager's pauses)."""
        if not engine.kv.prefix_caching:
            raise ValueError("sessions keep their state in the prefix cache: enable prefix caching")
        if engine.kv.has_reclaimer:
            raise ValueError("this engine already has a session manager: shut that one down first")
        if not isinstance(config, SessionConfig):
            raise TypeError(f"config must be a SessionConfig, got {type(config).__name__}")
        self.config = config
        self.engine = engine
        # The policy's ceiling is the scheduler's: one tau_high for admission and keeping.
        # The engine's rates: what this manager measures also prices preemption.
        self.policy = policy or KeepPolicy(engine.rates, admission_ceiling=engine.config.scheduler.admission_ceiling,
                                           idle_keep_factor=config.idle_keep_factor)
        self.waits = waits or WaitEstimator()
        self.stats = SessionStats()
        self.offload = SessionOffload(engine, self.policy.rates, self.stats, config.host_bytes, config.disk_dir,
                                      config.disk_bytes, config.overlap_reload)
        self.machine = PauseMachine(engine.kv, self.policy, self.offload, self.stats,
                                    block_bytes=self.offload.block_bytes,
                                    ceiling_blocks=lambda: engine.scheduler.ceiling_blocks,
                                    clock=time.monotonic, prefetch_fraction=config.prefetch_fraction)
        self.idle_ttl_s, self.max_sessions = config.idle_ttl_s, config.max_sessions
        # Least recently active first (_touch moves a session to the end), so
        # expiry and the cap look only at the front.
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self._ids = itertools.count()
        self.stalled = False  # the last step ran nothing and could release nothing
        # Every engine step runs the manager's housekeeping, whoever steps it.
        engine.step_hooks.add(self, before=self.tick, after=self._after_step, idle=self.tick)

    @property
    def host(self):
        """The host tier saved state goes to (kv/tiers.py HostKVStore)."""
        return self.offload.tiers.host

    @property
    def disk(self):
        """The disk tier (DiskKVStore), or None."""
        return self.offload.tiers.disk

    @property
    def block_bytes(self) -> int:
        return self.offload.block_bytes

    # ------------------------------------------------------------- lifecycle
    def open(self, prompt: list[dict] | str | list[int], cache_salt: str | None = None,
             session_id: str | None = None, lora: str | None = None) -> Session:
        """A session over a chat (messages: rendered with the chat template, ready
        for the assistant), a text or token ids; its turns run adapter `lora`."""
        tok = self.engine.tokenizer
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            ids = tok.encode_chat(prompt)
        elif isinstance(prompt, str):
            ids = tok.encode(prompt)
        else:
            ids = list(prompt)
        self.engine.validate_prompt(ids)
        sid = check_session_id(session_id) if session_id is not None else f"sess-{next(self._ids)}"
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} is already open")
        return self._add(Session(sid, cache_salt, ids, self, lora=self.engine.adapter(lora)))

    def _add(self, s: Session) -> Session:
        if self.max_sessions is not None:
            self._trim(self.max_sessions - 1)
        self.sessions[s.session_id] = s
        return s

    def _trim(self, limit: int) -> None:
        """Close the least recently active sessions until at most `limit`
        are open; those with a turn in flight stay (tick() trims again once
        their turns end). Closing a record loses only its saved state: the
        next turn of that id recomputes what the prefix cache no longer holds."""
        if len(self.sessions) <= limit:
            return
        idle = (o for o in self.sessions.values() if not o.in_flight)
        for old in list(itertools.islice(idle, len(self.sessions) - limit)):
            self._expire_one(old, "cap")

    def _touch(self, s: Session) -> None:
        s.last_active = time.monotonic()
        if s.session_id in self.sessions:
            self.sessions.move_to_end(s.session_id)

    def _expire(self, now: float) -> None:
        """Close the sessions idle for idle_ttl_s (front of the order)."""
        if self.idle_ttl_s is None:
            return
        while self.sessions:
            s = next(iter(self.sessions.values()))
            if now - s.last_active < self.idle_ttl_s:
                return
            if s.in_flight:  # a turn longer than the ttl is activity
                self._touch(s)
                continue
            self._expire_one(s, "idle")

    def _expire_one(self, s: Session, why: str) -> None:
        self.close(s)
        s.expired = why
        self.stats.expired[why] += 1

    def shutdown(self) -> None:
        """Close every session, let queued writes land, and detach from the engine."""
        for s in list(self.sessions.values()):
            self.close(s)
        self.offload.close()
        self.engine.step_hooks.remove(self)
        self.machine.detach()

    def close(self, s: Session) -> None:
        if s.state is SessionState.CLOSED:
            return
        self.offload.settle(s.record)
        self.offload.release_saved(s.record)
        self.machine.forget(s)
        s.state = SessionState.CLOSED
        self.sessions.pop(s.session_id, None)
        self.offload.copying.pop(s.session_id, None)

    def fork(self, s: Session, n: int) -> list[Session]:
        """n sessions with the same history; they share its cached blocks
        (same namespace, same prefix) until their histories diverge. A paused
        session forks too (the children start idle; it stays paused, its state
        where the policy put it: saved blocks are copied back into the tree as
        cold cache for the children), since over HTTP only its next turn
        resumes it; one with a turn in flight does not (its history is not settled)."""
        self._check_open(s, "fork")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork: n must be an integer >= 1, got {n!r}")
        if s.in_flight:
            raise SessionBusy(f"session {s.session_id!r} has a turn in flight: fork it when the turn ends")
        self._touch(s)  # the children's arrival must not close it (max_sessions)
        if s.state is SessionState.PAUSED:
            self.offload.share_saved(s.record)
        return [self._add(Session(f"{s.session_id}.{next(self._ids)}", s.cache_salt, list(s.history), self,
                                  lora=s.lora))
                for _ in range(n)]

    # ------------------------------------------------- turns run elsewhere
    # The HTTP server runs turns as ordinary requests on the engine thread
    # and tells the manager about them: before_turn brings a paused
    # session's state back, after_turn records the history and pauses it if
    # the client announced a tool wait.

    def before_turn(self, session_id: str, cache_salt: str | None, lora: str | None = None,
                    origin: str = "session_id") -> Session:
        s = self.sessions.get(session_id)
        adapter = self.engine.adapter(lora)
        if s is None:
            s = self._add(Session(check_session_id(session_id), cache_salt, [], self, lora=adapter, origin=origin))
        elif s.cache_salt != cache_salt:
            raise ValueError(f"session {session_id!r} belongs to another cache_salt")
        elif s.scope != CacheScope.of(cache_salt, adapter):  # another adapter, or other weights
            raise ValueError(f"session {session_id!r} belongs to another model ({s.lora.name if s.lora else 'base'})")
        elif s.in_flight:
            raise SessionBusy(f"session {session_id!r} already has a turn in flight; send turns one at a time")
        elif s.state is SessionState.PAUSED:
            self.resume(s)
        s.in_flight = True
        self._touch(s)
        return s

    def after_turn(self, s: Session, prompt_ids: list[int], out: RequestOutput | None,
                   tool_wait_s: float | None = None, tool: str | None = None,
                   decision: Decision | str | None = None, priority: int = 0) -> None:
        """Record a finished turn; with a wait hint, a tool name or a forced
        decision, pause the session (the hint may be None: the wait is then
        estimated from the tool's history). priority: the turn's (under
        --scheduling priority / program its paused state is reclaimed after
        less urgent sessions')."""
        s.in_flight = False
        self.engine.kv.cancel_hold(s)  # the turn ended (admitted, or not at all)
        if out is None or not out.finished or s.state is SessionState.CLOSED:
            return
        s.history = list(prompt_ids) + list(out.outputs[0].token_ids)
        s.record.priority = self.engine.scheduler.eviction_class(priority) or 0
        self._turn_done(s, out)
        if tool_wait_s is not None or tool is not None or decision is not None:
            self.pause(s, tool_wait_s, tool, decision)

    def _turn_done(self, s: Session, out: RequestOutput) -> None:
        self._touch(s)
        s.turns += 1
        s.last_output = out
        s.prompt_tokens += len(out.prompt_token_ids)
        s.cached_tokens += out.num_cached_tokens
        s.turn_hits.append((len(out.prompt_token_ids), out.num_cached_tokens, len(out.outputs[0].token_ids)))
        if out.metrics.ttft:
            self.machine.observe_prefill(len(out.prompt_token_ids) - out.num_cached_tokens, out.metrics.ttft)

    def describe(self, s: Session) -> dict:
        kv = self.engine.kv
        hit = kv.cached_prefix(s.history, s.scope) if s.history else None
        return {"id": s.session_id, "origin": s.origin, "state": s.state.value,
                "tier": s.tier.value if s.tier is not None else "device",
                "residency": s.residency.value if s.residency is not None else None,
                "num_tokens": len(s.history), "device_tokens": hit.num_tokens if hit else 0,
                "saved_blocks": s.saved_blocks, "turns": s.turns,
                # A save or load still copying: "tier" is where the state is
                # going; its blocks are counted where they are now.
                "copying": s.copy.kind if s.copy is not None else None,
                "blocks_by_tier": s.table.counts() if s.table is not None else None,
                "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                "hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                "turn_hits": [{"prompt_tokens": p, "cached_tokens": c, "hit_rate": c / p if p else 0.0,
                               "output_tokens": o} for p, c, o in s.turn_hits],
                "waiting_for": s.tool if s.state is SessionState.PAUSED else None,
                "decision": None if s.decision is None else {
                    "decision": s.decision.decision.value, "reason": s.decision.reason,
                    "lease_s": s.decision.lease_s},
                "pauses": [dict(p) for p in s.pauses]}

    def calibrate(self, prefill_tokens: int = 256) -> dict:
        """Measure the rates the keep policy prices with, on this machine, now
        (engine/calibration.py). Run it while the engine is idle (start-up)."""
        return self.offload.calibrate(prefill_tokens)

    # ------------------------------------------------------------------ turns
    def generate(self, s: Session, params: SamplingParams | None = None) -> RequestOutput:
        """One turn: the history is the prompt (its cached blocks hit); the
        reply is appended to the history."""
        self._check_open(s, "generate")
        if s.state is SessionState.PAUSED:
            raise ValueError(f"session {s.session_id!r} is paused for a tool: resume it with the observation first")
        eng = self.engine  # its step() runs the manager's housekeeping (tick) before each step
        rid = eng.add_request(list(s.history), params, cache_salt=s.cache_salt, lora=s.lora)
        out = None
        s.in_flight = True  # expiry passes over it while the turn runs
        try:
            while out is None:
                for o in eng.step():
                    if o.request_id == rid and o.finished:
                        out = o
                if self.stalled:
                    eng.abort_request(rid)
                    raise RuntimeError(f"session {s.session_id!r}: the turn cannot be scheduled "
                                       f"(pool of {eng.kv.num_blocks} blocks)")
        finally:
            s.in_flight = False
            eng.kv.cancel_hold(s)
        s.history.extend(out.outputs[0].token_ids)
        self._turn_done(s, out)
        return out

    def pause(self, s: Session, expected_wait_s: float | None = None, tool: str | None = None,
              decision: Decision | str | None = None) -> PauseDecision:
        """The session waits for a tool: decide where its state waits, and put it there."""
        self._check_open(s, "pause")
        if s.state is SessionState.PAUSED:
            raise ValueError(f"session {s.session_id!r} is already paused")
        if expected_wait_s is not None and not 0 <= expected_wait_s < math.inf:
            raise ValueError(f"expected_wait_s must be a finite number of seconds >= 0, got {expected_wait_s!r}")
        if decision is not None:
            decision = Decision(decision)
        self._touch(s)  # before tick(), whose expiry must not take s
        self.engine.kv.cancel_hold(s)  # the turn ran: its resume's hold is over
        self.tick()
        self.offload.land(s.record)  # paused again before its reload landed: that copy ends first
        est = self.waits.estimate(tool, expected_wait_s)
        s.state, s.tool = SessionState.PAUSED, tool
        r = s.record  # what is paused: the history as it is now, its keys, its scope
        r.keys, r.history, r.scope = self._block_keys(s), s.history, s.scope
        placed = self.machine.pause(s, r, est.seconds, est.source != "prior", decision, time.monotonic())
        s.pauses.append({"turn": s.turns, "waiting_for": tool, "expected_wait_s": est.seconds,
                         "wait_source": est.source, "decision": placed.decision.value, "reason": placed.reason,
                         "waited_s": None})
        return placed

    def resume(self, s: Session, observation: str | list[int] = ()) -> None:
        """The tool returned: bring the state back and append the observation
        (text is encoded without special tokens: render it with the chat
        template's markers yourself, or pass token ids)."""
        self._check_open(s, "resume")
        if s.state is not SessionState.PAUSED:
            raise ValueError(f"session {s.session_id!r} is not paused")
        ids = self.engine.tokenizer.encode(observation, add_special_tokens=False) \
            if isinstance(observation, str) else list(observation)
        # Checked before anything changes: appended, a bad token (or a history
        # over the context) would fail every later turn of the session.
        self.engine.validate_prompt(s.history + ids)
        waited = time.monotonic() - s.paused_at
        self.waits.observe(s.tool, waited)
        if s.pauses:
            s.pauses[-1]["waited_s"] = waited
        self.machine.resume(s, time.monotonic())
        s.history.extend(ids)
        self._touch(s)
        s.state = SessionState.IDLE

    def _block_keys(self, s: Session) -> list:
        """The history's block keys, chunked once: a history only appended to
        since the last pause (the same list: a turn's reply, an observation)
        keeps the keys it had and chunks its new full blocks alone; a turn
        that sent a new history (the server's) is chunked whole."""
        kv, r = self.engine.kv, s.record
        B, n = kv.block_size, len(s.history) // kv.block_size
        keys = list(r.keys) if r.keys is not None and r.history is s.history and len(r.keys) <= n else []
        keys += kv.block_keys(s.history[len(keys) * B:n * B])
        return keys

    # ------------------------------------------------------- engine steps
    def tick(self) -> None:
        """Before each engine step: expiry and the cap, copies that landed,
        then the pause machine (leases, prefetches, the admission ceiling)."""
        now = time.monotonic()
        self._expire(now)
        if self.max_sessions is not None:
            self._trim(self.max_sessions)
        self.offload.poll()
        self.machine.tick(now)

    def _after_step(self) -> None:
        """After each engine step: if nothing ran and nothing could be
        released (forced-kept state fills the pool), whoever loops on step() must stop."""
        eng = self.engine
        self.stalled = (eng.last_step.num_seqs == 0 and eng.has_unfinished_requests()
                        and not self.machine.relieve_stall())

    def flush(self) -> None:
        """Land every copy in flight and wait until every queued disk write has landed."""
        self.offload.flush([s.record for s in self.sessions.values()])

    def _check_open(self, s: Session, what: str) -> None:
        if s.state is SessionState.CLOSED:
            why = ""
            if s.expired == "idle":
                why = f" (no activity for {self.idle_ttl_s:g} s)"
            elif s.expired == "cap":
                why = f" (the least recently active of {self.max_sessions} open sessions)"
            raise ValueError(f"{what}: session {s.session_id!r} is closed{why}")

    def metrics(self) -> dict:
        st, tiers = self.stats, self.offload.tiers
        return {"sessions": len(self.sessions), "paused": len(self.machine.paused),
                "keep_decisions": dict(st.decisions), "placed": dict(st.placed),
                "demoted_to": dict(st.demoted_to),
                # The tiers' contents (the prefix cache's too when they are the engine's); what sessions hold:
                "host_bytes": self.host.nbytes, "disk_bytes": self.disk.nbytes if self.disk is not None else 0,
                "held_blocks": tiers.num_held(), "held_bytes": tiers.held_bytes(),
                "swap_out_bytes": st.swap_out_bytes, "swap_in_bytes": st.swap_in_bytes,
                "swap_out_s": st.swap_out_s, "swap_in_s": st.swap_in_s, "corrupt_blocks": st.corrupt_blocks,
                "mislabelled_blocks": tiers.stats.mislabelled_blocks,
                "write_errors": tiers.stats.write_errors, "lease_demotions": st.lease_demotions,
                "recomputed_tokens": st.recomputed_tokens,
                "host_blocks": len(self.host), "disk_blocks": tiers.num_disk_blocks,
                "pressure_demotions": st.pressure_demotions, "stall_drops": st.stall_drops,
                "prefetches": st.prefetches, "prefetch_hits": st.prefetch_hits,
                "resume_stalls": st.resume_stalls, "resume_stall_s": st.resume_stall_s,
                "reload_hidden_s": st.reload_hidden_s, "reload_no_room": st.reload_no_room,
                "copies_in_flight": sum(s.copy is not None for s in self.offload.copying.values()),
                "expired": {k: st.expired.get(k, 0) for k in ("idle", "cap")}}
