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

Copies run on the runner's copy engine ("异步分页换入换出", kv/copy_engine.py):
a save pins the path until its host copy lands, then the session's tiered
block table is remapped to the tier and the device frames are freed. Resume
puts saved blocks into fresh device blocks and the tree at once, so the next
turn's prompt hits them like any cached prefix, while their KV streams in
under that turn's prefill (the forward waits per layer). A block that fails
its checks on the way back is discarded, and everything from it on is
recomputed: never served corrupt, output unchanged.

Pressure ("服务遥测动态"; the pitfall of keeping paused state resident
whatever the wait): the manager is the KV manager's reclaimer. When a
running request or an admission finds the pool short, or U_KV (without the
cold cache) passes the admission ceiling, kept paused state moves down a
tier -- the session expected back last goes first -- before any running
request is preempted. Only a keep the caller forced stays; if nothing can
run at all because of it, step() drops the oldest (the engine's stand-in for
an out-of-memory failure), counted as a stall drop.

Prefetch ("异步分页换入换出"): when the wait is known (a hint or the tool's
history), offloaded state is loaded back at a safe lower bound of the wait
(prefetch_fraction x the wait, less the reload time), so the resumed turn
finds it on the device; a resume that has to load first counts a stall.
Prefetches, and disk writes, run wholly in the background: a step never
waits for a transfer it does not need.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import math
import re
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from trajserve.engine.engine import LLMEngine
from trajserve.engine.memory import bytes_per_block
from trajserve.engine.calibration import calibrate_rates
from trajserve.kv.block_format import BlockIdentity, namespace_digest
from trajserve.kv.copy_engine import CopyJob
from trajserve.kv.dir_lock import ScratchDir
from trajserve.kv.keep_policy import Decision, KeepPolicy, PauseDecision, PauseState
from trajserve.kv.radix_cache import MatchResult, RadixNode
from trajserve.kv.tiered_table import Tier, TieredBlockTable
from trajserve.kv.tiers import DISK_HEADER_BYTES, DiskKVStore, HostKVStore
from trajserve.kv.wait_estimator import WaitEstimator
from trajserve.outputs import RequestOutput
from trajserve.sampling import SamplingParams

log = logging.getLogger("trajserve")
# A session id a client chooses: bounded, and of characters that survive a
# URL path unescaped, so GET / DELETE /v1/sessions/{id} reach every id a turn
# accepted; it starts with neither a dot nor a dash ("..", "-rf"). Ids never
# name files: saved blocks are keyed by the manager's own counter.
SESSION_ID_MAX = 128
_SESSION_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@-]*")


def check_session_id(sid: object) -> str:
    """The id, or a ValueError that names the field and the limit."""
    if not isinstance(sid, str) or not sid:
        raise ValueError(f"session_id must be a non-empty string, got {type(sid).__name__}")
    if len(sid) > SESSION_ID_MAX:
        raise ValueError(f"session_id is {len(sid):,} characters; at most {SESSION_ID_MAX} are allowed")
    if not _SESSION_ID.fullmatch(sid):
        raise ValueError("session_id may hold only letters, digits and _ . : @ - (starting with a letter, digit "
                         f"or _), at most {SESSION_ID_MAX} characters")
    return sid


class SessionBusy(RuntimeError):
    """A second turn of a session arrived while one is still running."""


class SessionState(enum.Enum):
    IDLE = "idle"  # between turns, state on the device
    PAUSED = "paused"  # waiting for a tool; state wherever the policy put it
    CLOSED = "closed"


@dataclass(eq=False)
class Session:
    session_id: str
    cache_salt: str | None
    history: list[int]
    manager: SessionManager
    state: SessionState = SessionState.IDLE
    tier: Decision | None = None  # where a paused session's state waits
    decision: PauseDecision | None = None
    # Where each block of the state is (device / host / disk), while it is
    # saved or being moved; None when it is simply on the device.
    table: TieredBlockTable | None = None
    pin: RadixNode | None = None  # a keep (or a landed prefetch) holds the path
    lease_deadline: float | None = None
    paused_at: float | None = None
    tool: str | None = None
    turns: int = 0
    last_output: RequestOutput | None = None
    prompt_tokens: int = 0  # over all turns, for the session's hit rate
    cached_tokens: int = 0
    in_flight: bool = False
    forced: bool = False  # the caller chose the tier: pressure does not move a forced keep
    expected_wait_s: float = math.inf
    prefetch_at: float | None = None  # when to load offloaded state back
    prefetched: bool = False
    io: Future | None = None  # background disk write of this session's blocks
    copy: CopyJob | None = None  # a save or load in flight on the copy engine
    hold: RadixNode | None = None  # pins the device frames a copy reads or writes
    saving: tuple[Decision, int] | None = None  # a save's target tier and reserved bytes
    importing: tuple[MatchResult, list[int]] | None = None  # a prefetch's blocks, adopted when it lands
    last_active: float = field(default_factory=time.monotonic)  # the last turn, pause or resume
    expired: str | None = None  # why the manager closed it: "idle" (ttl) or "cap" (max_sessions)

    @property
    def saved_blocks(self) -> int:
        """Blocks of the state held on the host or disk tier."""
        return 0 if self.table is None else len(self.table) - self.table.counts()["device"]

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


@dataclass
class SessionStats:
    decisions: Counter = field(default_factory=Counter)
    placed: Counter = field(default_factory=Counter)  # where each pause's state went (a full tier falls through)
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_out_s: float = 0.0
    swap_in_s: float = 0.0
    corrupt_blocks: int = 0  # saved blocks rejected on the way back: damaged or not the block saved
    write_errors: int = 0  # disk writes that failed: those blocks are recomputed on resume
    lease_demotions: int = 0
    recomputed_tokens: int = 0  # tokens a resumed turn had to prefill again
    pressure_demotions: int = 0  # kept states moved down a tier to make room for running work
    stall_drops: int = 0  # forced-kept states dropped because nothing could run
    prefetches: int = 0
    prefetch_hits: int = 0  # resumes that found prefetched state on the device
    resume_stalls: int = 0  # resumes that had to load state back first
    resume_stall_s: float = 0.0  # time resumed turns waited for their state (loads not hidden)
    reload_hidden_s: float = 0.0  # copy time of resume reloads hidden behind the turn's prefill
    reload_no_room: int = 0  # reloads given up because the pool had no room (the turn recomputes)
    expired: Counter = field(default_factory=Counter)  # sessions closed by the manager: "idle" / "cap"


class SessionManager:
    def __init__(self, engine: LLMEngine, policy: KeepPolicy | None = None,
                 host_bytes: int = 2 * 2**30, disk_dir: str | None = None, disk_bytes: int = 8 * 2**30,
                 waits: WaitEstimator | None = None, prefetch_fraction: float = 0.8,
                 overlap_reload: bool = True, idle_ttl_s: float | None = None,
                 max_sessions: int | None = None) -> None:
        """idle_ttl_s: a session with no turn, pause or resume for this long is
        closed (its saved state freed); max_sessions: opening one more closes
        the least recently active. Both off by default, for callers that hold
        their Session objects; the server sets them (--session-ttl,
        --max-sessions), since its clients need not say when they are done."""
        if engine.kv.radix is None:
            raise ValueError("sessions keep their state in the prefix cache: enable prefix caching")
        if engine.kv.reclaimer is not None:
            raise ValueError("this engine already has a session manager: shut that one down first")
        self.engine = engine
        self.block_bytes = bytes_per_block(engine.model_config, engine.kv.block_size, engine.dtype)
        # The policy's ceiling is the scheduler's: one tau_high for admission and keeping.
        # The engine's rates: what this manager measures also prices preemption.
        self.policy = policy or KeepPolicy(engine.rates, admission_ceiling=engine.config.scheduler.admission_ceiling)
        self.waits = waits or WaitEstimator()
        self.host = HostKVStore(host_bytes)
        # Saved state does not outlive the manager: a scratch directory of its
        # own (locked while it runs, swept by the next one if it is killed).
        self._tmp = None if disk_dir else ScratchDir("session")
        self.disk = DiskKVStore(disk_dir or self._tmp.name, disk_bytes, engine.block_layout,
                                lock=disk_dir is not None)
        self._saves = itertools.count()  # names saved blocks: never the client's session id
        self._idents: dict[str, BlockIdentity] = {}  # saved block key -> what its file must hold
        if idle_ttl_s is not None and not 0 < idle_ttl_s < math.inf:
            raise ValueError(f"idle_ttl_s must be a finite number of seconds > 0 (or None: never), "
                             f"got {idle_ttl_s!r}")
        if max_sessions is not None and (not isinstance(max_sessions, int) or max_sessions < 1):
            raise ValueError(f"max_sessions must be an integer >= 1 (or None: no limit), got {max_sessions!r}")
        self.idle_ttl_s, self.max_sessions = idle_ttl_s, max_sessions
        # Least recently active first (_touch moves a session to the end), so
        # expiry and the cap look only at the front.
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        # The sessions tick() looks after: paused, or with a copy in flight
        # (a superset: added when either begins, pruned by tick), so a step
        # costs nothing per idle session.
        self._watched: dict[str, Session] = {}
        self.stats = SessionStats()
        self._ids = itertools.count()
        if not 0 <= prefetch_fraction <= 1:
            raise ValueError(f"prefetch_fraction must be in [0, 1], got {prefetch_fraction}")
        self.prefetch_fraction = prefetch_fraction
        # False: a resume waits for its whole reload before the turn runs (the
        # serial baseline the overlap is measured against).
        self.overlap_reload = overlap_reload
        # One writer thread: disk writes leave the engine thread; the disk
        # store is touched under the lock (the thread writes, resume reads).
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trajserve-kv-io")
        self._disk_lock = threading.Lock()
        self._disk_pending = 0  # bytes of writes queued, reserved on the disk cap
        self._host_reserved = 0  # bytes of host saves still copying
        self.stalled = False  # the last step ran nothing and could release nothing
        # Every engine step runs the manager's housekeeping, whoever steps it.
        engine.step_hooks.add(self, before=self.tick, after=self._after_step)
        engine.kv.reclaimer = self._reclaim

    # ------------------------------------------------------------- lifecycle
    def open(self, prompt: list[dict] | str | list[int], cache_salt: str | None = None,
             session_id: str | None = None) -> Session:
        """A session over a chat (messages: rendered with the chat template,
        ready for the assistant), a text or token ids."""
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
        return self._add(Session(sid, cache_salt, ids, self))

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
        self._io.shutdown(wait=True)  # the copy engine is the runner's: it stays
        self.engine.step_hooks.remove(self)
        if self.engine.kv.reclaimer == self._reclaim:
            self.engine.kv.reclaimer = None
        self.disk.release()
        if self._tmp is not None:
            self._tmp.cleanup()

    def close(self, s: Session) -> None:
        if s.state is SessionState.CLOSED:
            return
        self._settle(s)
        self._release_saved(s)
        self.engine.kv.holds.cancel(s)
        if s.pin is not None:
            self.engine.kv.unpin(s.pin)
            s.pin = None
        s.state = SessionState.CLOSED
        self.sessions.pop(s.session_id, None)
        self._watched.pop(s.session_id, None)

    def fork(self, s: Session, n: int) -> list[Session]:
        """n sessions with the same history; they share its cached blocks
        (same namespace, same prefix) until their histories diverge. A paused
        session forks too (the children start idle; it stays paused, its state
        where the policy put it), since over HTTP only its next turn resumes it;
        one with a turn in flight does not (its history is not settled)."""
        self._check_open(s, "fork")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork: n must be an integer >= 1, got {n!r}")
        if s.in_flight:
            raise SessionBusy(f"session {s.session_id!r} has a turn in flight: fork it when the turn ends")
        self._touch(s)  # the children's arrival must not close it (max_sessions)
        if s.state is SessionState.PAUSED:
            self._share_saved(s)
        return [self._add(Session(f"{s.session_id}.{next(self._ids)}", s.cache_salt, list(s.history), self))
                for _ in range(n)]

    def _share_saved(self, s: Session) -> None:
        """Forking a session paused on the host or disk: its saved blocks are
        copied back into the tree as cold cache (the parent keeps its saved
        copy and stays where it is), so the children's first turns hit them
        instead of recomputing the whole history."""
        if s.copy is not None:
            self._land(s)  # a save or prefetch in flight ends first
        if s.table is None or s.tier not in (Decision.HOST, Decision.DISK):
            return  # on the device already (kept, prefetched) or dropped
        kv = self.engine.kv
        self._collect_write(s)
        got = kv.begin_import(s.history, s.cache_salt, len(s.table))
        if got is None:
            return  # no room: the children recompute
        hit, new_ids = got
        have = len(hit.block_ids)
        data = self._fetch(s, have, have + len(new_ids))
        if data:
            self.engine.runner.write_blocks(new_ids[:len(data)], torch.stack(data))
        kv.finish_import(s.history, s.cache_salt, hit, new_ids, len(data))
        self.stats.corrupt_blocks = self.disk.num_rejected

    # ------------------------------------------------- turns run elsewhere
    # The HTTP server runs turns as ordinary requests on the engine thread
    # and tells the manager about them: before_turn brings a paused
    # session's state back, after_turn records the history and pauses it if
    # the client announced a tool wait.

    def before_turn(self, session_id: str, cache_salt: str | None) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            s = self._add(Session(check_session_id(session_id), cache_salt, [], self))
        elif s.cache_salt != cache_salt:
            raise ValueError(f"session {session_id!r} belongs to another cache_salt")
        elif s.in_flight:
            raise SessionBusy(f"session {session_id!r} already has a turn in flight; send turns one at a time")
        elif s.state is SessionState.PAUSED:
            self.resume(s)
        s.in_flight = True
        self._touch(s)
        return s

    def after_turn(self, s: Session, prompt_ids: list[int], out: RequestOutput | None,
                   tool_wait_s: float | None = None, tool: str | None = None,
                   decision: Decision | str | None = None) -> None:
        """Record a finished turn; with a wait hint, a tool name or a forced
        decision, pause the session (the hint may be None: the wait is then
        estimated from the tool's history)."""
        s.in_flight = False
        self.engine.kv.holds.cancel(s)  # the turn ended (admitted, or not at all)
        if out is None or not out.finished or s.state is SessionState.CLOSED:
            return
        self._touch(s)
        s.history = list(prompt_ids) + list(out.outputs[0].token_ids)
        s.turns += 1
        s.last_output = out
        s.prompt_tokens += len(prompt_ids)
        s.cached_tokens += out.num_cached_tokens
        self._observe_prefill(out)
        if tool_wait_s is not None or tool is not None or decision is not None:
            self.pause(s, tool_wait_s, tool, decision)

    def describe(self, s: Session) -> dict:
        kv = self.engine.kv
        hit = kv.cached_prefix(s.history, s.cache_salt) if s.history else None
        return {"id": s.session_id, "state": s.state.value,
                "tier": s.tier.value if s.tier is not None else "device",
                "num_tokens": len(s.history), "device_tokens": hit.num_tokens if hit else 0,
                "saved_blocks": s.saved_blocks, "turns": s.turns,
                # A save or load still copying: "tier" is where the state is
                # going; its blocks are counted where they are now.
                "copying": s.copy.kind if s.copy is not None else None,
                "blocks_by_tier": s.table.counts() if s.table is not None else None,
                "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                "hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                "decision": None if s.decision is None else {
                    "decision": s.decision.decision.value, "reason": s.decision.reason,
                    "lease_s": s.decision.lease_s}}

    def calibrate(self, prefill_tokens: int = 256) -> dict:
        """Measure the rates the keep policy prices with, on this machine, now
        (engine/calibration.py). Run it while the engine is idle (start-up)."""
        with self._disk_lock:
            return calibrate_rates(self.engine, self.policy.rates, self.disk, prefill_tokens)

    # ------------------------------------------------------------------ turns
    def generate(self, s: Session, params: SamplingParams | None = None) -> RequestOutput:
        """One turn: the history is the prompt (its cached blocks hit); the
        reply is appended to the history."""
        self._check_open(s, "generate")
        if s.state is SessionState.PAUSED:
            raise ValueError(f"session {s.session_id!r} is paused for a tool: resume it with the observation first")
        eng = self.engine  # its step() runs the manager's housekeeping (tick) before each step
        rid = eng.add_request(list(s.history), params, cache_salt=s.cache_salt)
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
            eng.kv.holds.cancel(s)
        s.history.extend(out.outputs[0].token_ids)
        self._touch(s)
        s.turns += 1
        s.last_output = out
        s.prompt_tokens += len(out.prompt_token_ids)
        s.cached_tokens += out.num_cached_tokens
        self._observe_prefill(out)
        return out

    def _after_step(self) -> None:
        """After each engine step (tick() ran before it): if nothing could run
        because forced-kept state fills the pool, drop the oldest such state;
        nothing ran and nothing was released: whoever loops on step() must stop."""
        eng = self.engine
        self.stalled = eng.last_step.num_seqs == 0 and eng.has_unfinished_requests() and not self._relieve_stall()

    def _relieve_stall(self) -> bool:
        busy = [s for s in self._watched.values() if s.copy is not None]
        for s in busy:  # copies in flight hold frames: land them, then try again
            self._land(s)
        if busy:
            return True
        victims = [s for s in self._watched.values() if s.state is SessionState.PAUSED and s.pin is not None]
        if not victims:
            return self.engine.kv.holds.release_all() > 0
        v = min(victims, key=lambda s: s.paused_at)
        self.engine.kv.unpin(v.pin)
        v.pin = None
        self.engine.kv.evict_prefix(v.history, v.cache_salt)
        v.tier = Decision.DROP
        self.stats.stall_drops += 1
        return True

    def _observe_prefill(self, out: RequestOutput) -> None:
        """Keep the policy's recompute estimate on measured prefill speed."""
        computed = len(out.prompt_token_ids) - out.num_cached_tokens
        if out.metrics.ttft and computed >= 64:
            self.policy.rates.observe_prefill(computed, out.metrics.ttft)

    def pause(self, s: Session, expected_wait_s: float | None = None, tool: str | None = None,
              decision: Decision | str | None = None) -> PauseDecision:
        """The session waits for a tool: decide where its state waits, and put it there."""
        self._check_open(s, "pause")
        if s.state is SessionState.PAUSED:
            raise ValueError(f"session {s.session_id!r} is already paused")
        if expected_wait_s is not None and not 0 <= expected_wait_s < math.inf:
            raise ValueError(f"expected_wait_s must be a finite number of seconds >= 0, got {expected_wait_s!r}")
        self._touch(s)  # before tick(), whose expiry must not take s
        self.engine.kv.holds.cancel(s)  # the turn ran: its resume's hold is over
        self.tick()
        if s.copy is not None:
            self._land(s)  # paused again before its reload landed: that copy ends first
        kv = self.engine.kv
        hit = kv.cached_prefix(s.history, s.cache_salt)
        nblocks = len(hit.block_ids)
        est = self.waits.estimate(tool, expected_wait_s)
        wait = est.seconds
        d = self.policy.decide(PauseState(
            num_tokens=nblocks * kv.block_size, kv_bytes=nblocks * self.block_bytes, expected_wait_s=wait,
            pool_usage=kv.active_usage(), host_free_bytes=self.host_free_bytes,
            disk_free_bytes=self.disk_free_bytes))
        if decision is not None:
            forced = Decision(decision)
            keep = forced is Decision.KEEP
            # A forced keep holds until resume (no lease): the caller decided.
            d = dataclasses.replace(d, decision=forced, lease_s=None,
                                    fallback=d.target if keep else d.fallback,
                                    reason=f"forced {forced.value} (policy: {d.reason})")
        s.state, s.paused_at, s.tool, s.decision = SessionState.PAUSED, time.monotonic(), tool, d
        self._watched[s.session_id] = s
        s.forced = decision is not None
        s.expected_wait_s = wait if est.source != "prior" else math.inf
        s.prefetched, s.prefetch_at = False, None
        self._place(s, d.decision, d.lease_s)
        self.stats.placed[s.tier.value] += 1
        return d

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
        self.waits.observe(s.tool, time.monotonic() - s.paused_at)
        kv = self.engine.kv
        t = time.perf_counter()
        if s.copy is not None and s.copy.kind == "save":
            self._abandon_save(s)  # back before its save landed: the state never left
            s.tier = Decision.KEEP
        elif s.copy is not None:  # a prefetch still loading: it must land first
            self._land_load(s)
            self.stats.resume_stall_s += time.perf_counter() - t
        if s.pin is not None:  # held until the turn is admitted (kv/admission_hold.py)
            kv.holds.hold(s, s.pin)
            s.pin = None
        if s.prefetched:
            self.stats.prefetch_hits += 1
        elif s.tier in (Decision.HOST, Decision.DISK):
            # The turn's prefill overlaps the copy; what it waits is added when the load lands.
            self._start_load(s, prefetch=False)
            self.stats.resume_stalls += 1
            self.stats.resume_stall_s += time.perf_counter() - t
            if not self.overlap_reload and s.copy is not None:
                self._land_load(s)  # counts its own wait
        hit = kv.cached_prefix(s.history, s.cache_salt)
        self.stats.recomputed_tokens += max(0, len(s.history) - 1 - hit.num_tokens)
        s.history.extend(ids)
        self._touch(s)
        s.state, s.tier, s.lease_deadline = SessionState.IDLE, None, None
        s.prefetched, s.prefetch_at = False, None

    def tick(self) -> None:
        """Between steps: kept state whose lease ran out moves one tier down;
        above the admission ceiling kept state leaves the device; offloaded
        state whose return is near is loaded back."""
        now = time.monotonic()
        self._expire(now)
        if self.max_sessions is not None:
            self._trim(self.max_sessions)
        for s in list(self._watched.values()):
            if s.copy is not None and s.copy.done:
                self._land(s)
            if s.state is SessionState.PAUSED and s.tier is Decision.KEEP and s.lease_deadline is not None \
                    and now >= s.lease_deadline:
                self.stats.lease_demotions += 1
                self._demote(s)
        kv = self.engine.kv
        over = kv.num_active_blocks - self.engine.scheduler.ceiling_blocks
        if over > 0:
            kv.reclaim(over)
        for s in list(self._watched.values()):
            if s.state is SessionState.PAUSED and s.prefetch_at is not None and now >= s.prefetch_at \
                    and s.tier in (Decision.HOST, Decision.DISK):
                self._prefetch(s)
            if s.state is not SessionState.PAUSED and s.copy is None:
                self._watched.pop(s.session_id, None)

    def _demote(self, s: Session, sync: bool = False) -> None:
        """A kept state leaves the device: where the policy said it goes once
        the lease is over (its fallback), with a prefetch if the return is known.
        sync: the pool needs the frames now, so a save lands before returning."""
        self.engine.kv.unpin(s.pin)
        s.pin = None
        s.prefetched = False
        fallback = s.decision.fallback if s.decision is not None else None
        self._place(s, fallback or self.policy.demote(Decision.KEEP), None, sync)

    def _settle(self, s: Session) -> None:
        """No copy in flight for s afterwards (before closing it)."""
        if s.copy is None:
            return
        if s.copy.kind == "save":
            self._abandon_save(s)
        else:
            self._land_load(s)

    def _reclaim(self, need: int) -> int:
        """The KV manager's reclaimer: free `need` blocks by moving kept
        paused state down a tier, the session expected back last first (its
        hold costs the most block-seconds). Forced keeps stay; a prefetch's
        hold is the manager's own, so it can go again."""
        kv = self.engine.kv
        now = time.monotonic()
        # Saves in flight first: their frames are leaving anyway, landing them is only a wait.
        freed = self._land_saves(need)
        cands = [s for s in self._watched.values()
                 if s.state is SessionState.PAUSED and s.pin is not None and (s.prefetched or not s.forced)]
        cands.sort(key=lambda s: s.paused_at + s.expected_wait_s - now, reverse=True)
        for s in cands:
            if freed >= need:
                break
            before = kv.pool.num_free
            self._demote(s, sync=True)
            self.stats.pressure_demotions += 1
            freed += kv.pool.num_free - before
        return freed

    def _prefetch(self, s: Session) -> None:
        """Load offloaded state back ahead of the resume and hold it there.
        Not above the ceiling: that would only push other state out."""
        s.prefetch_at = None
        kv = self.engine.kv
        if kv.active_usage() >= self.policy.admission_ceiling or s.copy is not None:
            return
        self._start_load(s, prefetch=True)  # lands in a later tick (or at the resume)

    # ------------------------------------------------------------ placement
    # Saves and loads run on the runner's copy engine (kv/copy_engine.py):
    # a save keeps the path pinned until its host copy lands, then the
    # session's tiered block table is remapped and the device frames freed
    # (land_save); a load streams into blocks layer by layer while the
    # prefill that reads them runs (the runner waits per layer). tick()
    # lands whatever finished; pressure lands a save at once.

    def _place(self, s: Session, d: Decision, lease_s: float | None, sync: bool = False) -> None:
        kv = self.engine.kv
        self.stats.decisions[d.value] += 1
        if d is Decision.KEEP:
            s.pin = kv.pin(s.history, s.cache_salt)
            s.lease_deadline = None if lease_s is None else time.monotonic() + lease_s
        elif d in (Decision.HOST, Decision.DISK):
            d = self._save(s, d, sync)
        if d is Decision.DROP:
            kv.evict_prefix(s.history, s.cache_salt)
        s.tier = d
        if d in (Decision.HOST, Decision.DISK) and math.isfinite(s.expected_wait_s) and self.prefetch_fraction > 0:
            # A safe lower bound of the return, less the time the reload takes.
            dec = s.decision
            reload_s = 0.0 if dec is None else (dec.t_reload_host_s if d is Decision.HOST else dec.t_reload_disk_s)
            s.prefetch_at = s.paused_at + max(0.0, self.prefetch_fraction * s.expected_wait_s - reload_s)
            if s.prefetch_at <= time.monotonic():
                s.prefetch_at = None  # the return is due already: the resume loads it

    @property
    def host_free_bytes(self) -> int:
        return self.host.free_bytes - self._host_reserved

    @property
    def disk_free_bytes(self) -> int:
        # Both under the lock: the I/O thread moves bytes from pending to written.
        with self._disk_lock:
            return max(0, self.disk.free_bytes - self._disk_pending)

    def _save(self, s: Session, d: Decision, sync: bool) -> Decision:
        """Start copying the session's device blocks to the tier; a tier
        without room falls to the next (host -> disk -> drop). The room is
        reserved now, the blocks stay pinned until the copy lands."""
        assert s.copy is None, "one copy per session at a time (pause lands a reload first)"
        kv = self.engine.kv
        hit = kv.cached_prefix(s.history, s.cache_salt)
        if not hit.block_ids:
            return Decision.DROP
        n = len(hit.block_ids)
        if d is Decision.HOST:
            if n * self.block_bytes <= self.host_free_bytes:
                self._host_reserved += n * self.block_bytes
                reserved = n * self.block_bytes
            else:
                d = Decision.DISK
        if d is Decision.DISK:
            reserved = n * (DISK_HEADER_BYTES + self.block_bytes)
            with self._disk_lock:  # check and reserve in one step
                fits = reserved <= self.disk.free_bytes - self._disk_pending
                if fits:
                    self._disk_pending += reserved
            if not fits:
                return Decision.DROP
        s.hold = kv.pin(s.history, s.cache_salt)
        s.table = TieredBlockTable(Tier.DEVICE, hit.block_ids)
        s.saving = (d, reserved, kv.prefix_hashes(s.history, s.cache_salt, n))
        s.copy = self.engine.runner.copy.save(hit.block_ids)
        self._watched[s.session_id] = s
        if sync:
            self._land_save(s)
        return d

    def _land_save(self, s: Session) -> None:
        """The host copy is there (waits for it if not): store it, remap the
        table to the tier, free the device frames. A disk save goes on to
        the disk writer thread from here."""
        job, (d, reserved, hashes) = s.copy, s.saving
        self.engine.runner.copy.finish(job)
        s.copy, s.saving = None, None
        data, job.data = job.data, None
        n = data.shape[0]
        save = next(self._saves)
        keys = [f"save{save}-{i}" for i in range(n)]
        ns = namespace_digest(self.engine.kv.namespace(s.cache_salt))
        for k, h in zip(keys, hashes):
            self._idents[k] = BlockIdentity(ns, h)
        if d is Decision.HOST:
            self._host_reserved -= reserved
            for k, block in zip(keys, data):
                ok = self.host.put(k, block, copy=False)  # a fresh host tensor, reserved room
                assert ok, "host tier reservation did not hold"
            self.policy.rates.observe_host_copy(job.nbytes, job.seconds)
        else:
            s.io = self._io.submit(self._write_disk, keys, data, reserved)
        s.table.remap(0, Tier.HOST if d is Decision.HOST else Tier.DISK, keys)
        self.stats.swap_out_bytes += job.nbytes
        self.stats.swap_out_s += job.seconds
        self.engine.kv.unpin(s.hold)
        s.hold = None
        self.engine.kv.evict_prefix(s.history, s.cache_salt)

    def _land_saves(self, need: int | None = None) -> int:
        """Land saves in flight (all, or until `need` blocks are free); returns blocks freed."""
        pool, freed = self.engine.kv.pool, 0
        for s in list(self._watched.values()):
            if need is not None and freed >= need:
                break
            if s.copy is not None and s.copy.kind == "save":
                before = pool.num_free
                self._land_save(s)
                freed += pool.num_free - before
        return freed

    def _abandon_save(self, s: Session) -> None:
        """Resumed or closed before the save landed: the blocks never left
        the device, so the copy is thrown away."""
        d, reserved, _ = s.saving
        self.engine.runner.copy.finish(s.copy)
        s.copy.data = None
        s.copy, s.saving, s.table = None, None, None
        if d is Decision.HOST:
            self._host_reserved -= reserved
        else:
            with self._disk_lock:
                self._disk_pending -= reserved
        self.engine.kv.unpin(s.hold)
        s.hold = None

    def _write_disk(self, keys: list[str], data: torch.Tensor, reserved: int) -> tuple[int, int, float]:
        """On the I/O thread: write the blocks. Returns (blocks written, bytes,
        seconds); the engine thread accounts them when it collects the result.
        A write that fails (disk full, an I/O error) ends the run there: it is
        logged and counted, and the blocks from it on are recomputed on resume."""
        t = time.perf_counter()
        written = 0
        with self._disk_lock:
            self._disk_pending -= reserved
            for i, k in enumerate(keys):
                try:
                    if not self.disk.put(k, data[i], self._idents[k]):
                        break
                except Exception as e:  # noqa: BLE001 - on the writer thread: the turn must not fail for ever
                    log.warning("session disk tier: writing a saved block failed (%s); the state from "
                                "block %d on will be recomputed", e, i)
                    self.disk.path(k).with_suffix(".tmp").unlink(missing_ok=True)
                    self.stats.write_errors += 1
                    break
                written += 1
        return written, written * data[0].numel() * data.element_size(), time.perf_counter() - t

    def _collect_write(self, s: Session) -> None:
        """Wait for the session's disk write (if any); entries it could not
        write are dropped from the table (recomputed on resume)."""
        if s.io is None:
            return
        written, nbytes, dt = s.io.result()
        s.io = None
        self.policy.rates.observe_disk_copy(nbytes, dt)
        self.stats.swap_out_s += dt
        if s.table is not None:
            for _, key in s.table.frames_in(Tier.DISK)[written:]:
                self._idents.pop(key, None)
            s.table.truncate(written)

    def flush(self) -> None:
        """Land every copy in flight and wait until every queued disk write has landed."""
        for s in list(self.sessions.values()):
            self._land(s)
            self._collect_write(s)

    def _land(self, s: Session) -> None:
        if s.copy is not None:
            self._land_save(s) if s.copy.kind == "save" else self._land_load(s)

    def _start_load(self, s: Session, prefetch: bool) -> bool:
        """Bring saved blocks back into fresh device blocks. False when the
        device has no room (the next turn recomputes them).

        resume:   the blocks are read (a disk block passes its checks here,
                  before anyone can hit it), join the tree at once, and their
                  KV streams in on the copy engine while the turn's prefill
                  runs: the runner waits per layer, so the copy of deep layers
                  hides behind the compute of shallow ones.
        prefetch: reading and copying both run in the background; the tree
                  takes the blocks when the copy lands (_land_load)."""
        kv = self.engine.kv
        self._collect_write(s)
        got = kv.begin_import(s.history, s.cache_salt, len(s.table))
        if got is None:
            # Other sessions' saves in flight still hold their frames: land them and try again.
            if self._land_saves():
                got = kv.begin_import(s.history, s.cache_salt, len(s.table))
        if got is None:
            self.stats.reload_no_room += 1
            self._release_saved(s)
            return False
        hit, new_ids = got
        have = len(hit.block_ids)
        copy = self.engine.runner.copy
        if prefetch:
            s.copy = copy.load(new_ids, lambda: self._fetch(s, have, have + len(new_ids)))
            self._watched[s.session_id] = s
            s.importing = (hit, new_ids)
            return True
        data = self._fetch(s, have, have + len(new_ids))
        filled = len(data)
        kv.finish_import(s.history, s.cache_salt, hit, new_ids, filled)
        self._release_saved(s)
        if filled:
            # Device-resident now (the KV still streaming in): the table says so until it lands.
            s.table = TieredBlockTable(Tier.DEVICE, hit.block_ids + new_ids[:filled])
            s.hold = kv.pin(s.history, s.cache_salt)  # nobody evicts blocks still being written
            s.copy = copy.load(new_ids[:filled], data)
            self._watched[s.session_id] = s
        return True

    def _fetch(self, s: Session, start: int, end: int) -> list[torch.Tensor]:
        """Saved blocks [start, end) from their tiers, up to the first one
        missing or failing its checks (may run on the copy thread). Host
        blocks are not copied here: the copy engine gathers them per layer."""
        blocks = []
        with self._disk_lock:
            for i in range(start, min(end, len(s.table))):
                tier, key = s.table.tiers[i], s.table.frames[i]
                b = (self.host.get(key) if tier is Tier.HOST else
                     self.disk.get(key, self._idents[key]) if tier is Tier.DISK else None)
                if b is None:  # missing or corrupt: recompute from here on
                    break
                blocks.append(b)
        return blocks

    def _land_load(self, s: Session) -> None:
        """A load finished (waits for it if not): a prefetch's blocks join the
        tree now; a resume's were there already and are unpinned."""
        job = s.copy
        kv = self.engine.kv
        t = time.perf_counter()
        try:
            self.engine.runner.copy.finish(job)
        except RuntimeError:
            if s.importing is None:
                raise  # a resume's blocks are in the tree already: nothing safe to fall back to
            job.filled = 0  # a failed prefetch adopts nothing: the turn recomputes
        waited = time.perf_counter() - t  # the engine thread waited here, on top of the forward's waits
        s.copy = None
        if s.importing is not None:
            hit, new_ids = s.importing
            s.importing = None
            kv.finish_import(s.history, s.cache_salt, hit, new_ids, job.filled)
            self._release_saved(s)
            if job.filled:
                # Held on the device until the resume (the reclaimer may still move it).
                s.pin = kv.pin(s.history, s.cache_salt)
                s.tier, s.prefetched, s.lease_deadline = Decision.KEEP, True, None
                self.stats.prefetches += 1
            else:
                s.tier = Decision.DROP  # nothing came back (missing, corrupt or failed)
        else:
            kv.unpin(s.hold)
            s.hold, s.table = None, None
            self.stats.resume_stall_s += job.waited_s + waited  # what the copy did not hide
            self.stats.reload_hidden_s += max(0.0, job.seconds - job.waited_s - waited)
        self.stats.swap_in_bytes += job.nbytes
        self.stats.swap_in_s += job.seconds
        self.stats.corrupt_blocks = self.disk.num_rejected
        if job.nbytes:
            self.policy.rates.observe_host_copy(job.nbytes, job.seconds)

    def _release_saved(self, s: Session) -> None:
        """Let go of the session's blocks on the host and disk tiers."""
        self._collect_write(s)  # a write in flight must land before its files go
        if s.table is None:
            return
        with self._disk_lock:
            for _, key in s.table.frames_in(Tier.HOST):
                self.host.discard(key)
                self._idents.pop(key, None)
            for _, key in s.table.frames_in(Tier.DISK):
                self.disk.discard(key)
                self._idents.pop(key, None)
        s.table = None

    def _check_open(self, s: Session, what: str) -> None:
        if s.state is SessionState.CLOSED:
            why = ""
            if s.expired == "idle":
                why = f" (no activity for {self.idle_ttl_s:g} s)"
            elif s.expired == "cap":
                why = f" (the least recently active of {self.max_sessions} open sessions)"
            raise ValueError(f"{what}: session {s.session_id!r} is closed{why}")

    def metrics(self) -> dict:
        st = self.stats
        return {"sessions": len(self.sessions),
                "paused": sum(s.state is SessionState.PAUSED for s in self._watched.values()),
                "keep_decisions": dict(st.decisions), "placed": dict(st.placed),
                "host_bytes": self.host.nbytes, "disk_bytes": self.disk.nbytes,
                "swap_out_bytes": st.swap_out_bytes, "swap_in_bytes": st.swap_in_bytes,
                "swap_out_s": st.swap_out_s, "swap_in_s": st.swap_in_s, "corrupt_blocks": st.corrupt_blocks,
                "write_errors": st.write_errors, "lease_demotions": st.lease_demotions,
                "recomputed_tokens": st.recomputed_tokens,
                "host_blocks": len(self.host), "disk_blocks": self.disk.num_blocks,
                "pressure_demotions": st.pressure_demotions, "stall_drops": st.stall_drops,
                "prefetches": st.prefetches, "prefetch_hits": st.prefetch_hits,
                "resume_stalls": st.resume_stalls, "resume_stall_s": st.resume_stall_s,
                "reload_hidden_s": st.reload_hidden_s, "reload_no_room": st.reload_no_room,
                "copies_in_flight": sum(s.copy is not None for s in self._watched.values()),
                "expired": {k: st.expired.get(k, 0) for k in ("idle", "cap")}}
