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
    disk   write them to the disk tier (size + CRC-32 per block), free them
    drop   free them; the next turn recomputes (prefill) what is missing

Resume loads saved blocks back into fresh device blocks and inserts them in
the tree, so the next turn's prompt hits them like any cached prefix. A
block that fails its checks on the way back is discarded, and everything
from it on is recomputed: never served corrupt, output unchanged.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from trajserve.engine.engine import LLMEngine
from trajserve.engine.memory import bytes_per_block
from trajserve.kv.keep_policy import CostRates, Decision, KeepPolicy, PauseDecision, PauseState
from trajserve.kv.radix_cache import RadixNode
from trajserve.kv.tiers import DiskKVStore, HostKVStore
from trajserve.kv.wait_estimator import WaitEstimator
from trajserve.outputs import RequestOutput
from trajserve.sampling import SamplingParams


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
    saved_blocks: int = 0  # full blocks saved on the host / disk tier
    pin: RadixNode | None = None
    lease_deadline: float | None = None
    paused_at: float | None = None
    tool: str | None = None
    turns: int = 0
    last_output: RequestOutput | None = None
    prompt_tokens: int = 0  # over all turns, for the session's hit rate
    cached_tokens: int = 0
    in_flight: bool = False

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
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_out_s: float = 0.0
    swap_in_s: float = 0.0
    corrupt_blocks: int = 0
    lease_demotions: int = 0
    recomputed_tokens: int = 0  # tokens a resumed turn had to prefill again


class SessionManager:
    def __init__(self, engine: LLMEngine, policy: KeepPolicy | None = None,
                 host_bytes: int = 2 * 2**30, disk_dir: str | None = None, disk_bytes: int = 8 * 2**30,
                 waits: WaitEstimator | None = None) -> None:
        if engine.kv.radix is None:
            raise ValueError("sessions keep their state in the prefix cache: enable prefix caching")
        self.engine = engine
        self.block_bytes = bytes_per_block(engine.model_config, engine.kv.block_size, engine.dtype)
        self.policy = policy or KeepPolicy(CostRates(prefill_tokens_per_s=300.0, host_bytes_per_s=5e9,
                                                     disk_bytes_per_s=1e9))
        self.waits = waits or WaitEstimator()
        self.host = HostKVStore(host_bytes)
        self._tmp = None if disk_dir else tempfile.TemporaryDirectory(prefix="trajserve-kv-")
        self.disk = DiskKVStore(disk_dir or self._tmp.name, disk_bytes)
        self.sessions: dict[str, Session] = {}
        self.stats = SessionStats()
        self._ids = itertools.count()

    # ------------------------------------------------------------- lifecycle
    def open(self, prompt: list[dict] | str | list[int], cache_salt: str | None = None,
             session_id: str | None = None) -> Session:
        """A session over a chat (messages: rendered with the chat template,
        ready for the assistant), a text or token ids."""
        tok = self.engine.tokenizer
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            ids = tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=True), add_special_tokens=False)
        elif isinstance(prompt, str):
            ids = tok.encode(prompt)
        else:
            ids = list(prompt)
        self.engine._validate_prompt(ids)
        sid = session_id or f"sess-{next(self._ids)}"
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} is already open")
        s = Session(sid, cache_salt, ids, self)
        self.sessions[sid] = s
        return s

    def close(self, s: Session) -> None:
        if s.state is SessionState.CLOSED:
            return
        self._release_saved(s)
        if s.pin is not None:
            self.engine.kv.unpin(s.pin)
            s.pin = None
        s.state = SessionState.CLOSED
        self.sessions.pop(s.session_id, None)

    def fork(self, s: Session, n: int) -> list[Session]:
        """n sessions with the same history; they share its cached blocks
        (same namespace, same prefix) until their histories diverge."""
        self._check_open(s, "fork")
        if s.state is SessionState.PAUSED:
            raise ValueError(f"session {s.session_id!r} is paused: resume it before forking")
        return [self.open(list(s.history), s.cache_salt, f"{s.session_id}.{next(self._ids)}") for _ in range(n)]

    # ------------------------------------------------- turns run elsewhere
    # The HTTP server runs turns as ordinary requests on the engine thread
    # and tells the manager about them: before_turn brings a paused
    # session's state back, after_turn records the history and pauses it if
    # the client announced a tool wait.

    def before_turn(self, session_id: str, cache_salt: str | None) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            s = Session(session_id, cache_salt, [], self)
            self.sessions[session_id] = s
        elif s.cache_salt != cache_salt:
            raise ValueError(f"session {session_id!r} belongs to another cache_salt")
        elif s.in_flight:
            raise SessionBusy(f"session {session_id!r} already has a turn in flight; send turns one at a time")
        elif s.state is SessionState.PAUSED:
            self.resume(s)
        s.in_flight = True
        return s

    def after_turn(self, s: Session, prompt_ids: list[int], out: RequestOutput | None,
                   tool_wait_s: float | None = None, tool: str | None = None,
                   decision: Decision | str | None = None) -> None:
        """Record a finished turn; with a wait hint, a tool name or a forced
        decision, pause the session (the hint may be None: the wait is then
        estimated from the tool's history)."""
        s.in_flight = False
        if out is None or not out.finished or s.state is SessionState.CLOSED:
            return
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
                "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                "hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                "decision": None if s.decision is None else {
                    "decision": s.decision.decision.value, "reason": s.decision.reason,
                    "lease_s": s.decision.lease_s}}

    # ------------------------------------------------------------------ turns
    def generate(self, s: Session, params: SamplingParams | None = None) -> RequestOutput:
        """One turn: the history is the prompt (its cached blocks hit); the
        reply is appended to the history."""
        self._check_open(s, "generate")
        if s.state is SessionState.PAUSED:
            raise ValueError(f"session {s.session_id!r} is paused for a tool: resume it with the observation first")
        self.tick()
        eng = self.engine
        rid = eng.add_request(list(s.history), params, cache_salt=s.cache_salt)
        out = None
        while out is None:
            for o in eng.step():
                if o.request_id == rid and o.finished:
                    out = o
        s.history.extend(out.outputs[0].token_ids)
        s.turns += 1
        s.last_output = out
        s.prompt_tokens += len(out.prompt_token_ids)
        s.cached_tokens += out.num_cached_tokens
        self._observe_prefill(out)
        return out

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
        self.tick()
        kv = self.engine.kv
        hit = kv.cached_prefix(s.history, s.cache_salt)
        nblocks = len(hit.block_ids)
        wait = self.waits.expected(tool, expected_wait_s)
        d = self.policy.decide(PauseState(
            num_tokens=nblocks * kv.block_size, kv_bytes=nblocks * self.block_bytes, expected_wait_s=wait,
            pool_usage=kv.usage(), host_free_bytes=self.host.free_bytes, disk_free_bytes=self.disk.free_bytes))
        if decision is not None:
            forced = Decision(decision)
            keep = forced is Decision.KEEP
            # A forced keep holds until resume (no lease): the caller decided.
            d = dataclasses.replace(d, decision=forced, lease_s=None,
                                    fallback=d.target if keep else d.fallback,
                                    reason=f"forced {forced.value} (policy: {d.reason})")
        s.state, s.paused_at, s.tool, s.decision = SessionState.PAUSED, time.monotonic(), tool, d
        self._place(s, d.decision, d.lease_s)
        return d

    def resume(self, s: Session, observation: str | list[int] = ()) -> None:
        """The tool returned: bring the state back and append the observation
        (text is encoded without special tokens: render it with the chat
        template's markers yourself, or pass token ids)."""
        self._check_open(s, "resume")
        if s.state is not SessionState.PAUSED:
            raise ValueError(f"session {s.session_id!r} is not paused")
        self.waits.observe(s.tool, time.monotonic() - s.paused_at)
        kv = self.engine.kv
        if s.pin is not None:
            kv.unpin(s.pin)
            s.pin = None
        if s.tier in (Decision.HOST, Decision.DISK):
            self._reload(s)
        hit = kv.cached_prefix(s.history, s.cache_salt)
        self.stats.recomputed_tokens += max(0, len(s.history) - 1 - hit.num_tokens)
        ids = self.engine.tokenizer.encode(observation, add_special_tokens=False) \
            if isinstance(observation, str) else list(observation)
        s.history.extend(ids)
        s.state, s.tier, s.lease_deadline = SessionState.IDLE, None, None

    def tick(self) -> None:
        """Move kept state whose lease ran out one tier down."""
        now = time.monotonic()
        for s in list(self.sessions.values()):
            if s.state is SessionState.PAUSED and s.tier is Decision.KEEP and s.lease_deadline is not None \
                    and now >= s.lease_deadline:
                self.stats.lease_demotions += 1
                self.engine.kv.unpin(s.pin)
                s.pin = None
                # Where the policy said the state goes once the lease is over.
                fallback = s.decision.fallback if s.decision is not None else None
                self._place(s, fallback or self.policy.demote(Decision.KEEP), None)

    # ------------------------------------------------------------ placement
    def _place(self, s: Session, d: Decision, lease_s: float | None) -> None:
        kv = self.engine.kv
        self.stats.decisions[d.value] += 1
        if d is Decision.KEEP:
            s.pin = kv.pin(s.history, s.cache_salt)
            s.lease_deadline = None if lease_s is None else time.monotonic() + lease_s
        elif d in (Decision.HOST, Decision.DISK):
            d = self._save(s, d)
            kv.evict_prefix(s.history, s.cache_salt)
        else:
            kv.evict_prefix(s.history, s.cache_salt)
        s.tier = d

    def _save(self, s: Session, d: Decision) -> Decision:
        """Copy the session's device blocks to the tier; a tier without room
        falls to the next (host -> disk -> drop)."""
        hit = self.engine.kv.cached_prefix(s.history, s.cache_salt)
        if not hit.block_ids:
            return Decision.DROP
        t = time.perf_counter()
        data = self.engine.runner.read_blocks(hit.block_ids)
        nbytes = data.numel() * data.element_size()
        store = self.host if d is Decision.HOST else self.disk
        saved = 0
        for i in range(len(hit.block_ids)):
            if not store.put(self._key(s, i), data[i]):
                break
            saved += 1
        dt = time.perf_counter() - t
        self.stats.swap_out_bytes += nbytes
        self.stats.swap_out_s += dt
        (self.policy.rates.observe_host_copy if d is Decision.HOST else self.policy.rates.observe_disk_copy)(
            nbytes, dt)
        if saved < len(hit.block_ids):
            for i in range(saved):
                store.discard(self._key(s, i))
            return self._save(s, Decision.DISK) if d is Decision.HOST else Decision.DROP
        s.saved_blocks = saved
        return d

    def _reload(self, s: Session) -> None:
        kv, runner = self.engine.kv, self.engine.runner
        store = self.host if s.tier is Decision.HOST else self.disk
        t = time.perf_counter()
        got = kv.begin_import(s.history, s.cache_salt, s.saved_blocks)
        if got is not None:  # None: no room on the device; the next turn recomputes
            hit, new_ids = got
            have = len(hit.block_ids)
            blocks = []
            for i in range(have, have + len(new_ids)):
                b = store.get(self._key(s, i))
                if b is None:  # missing or corrupt: recompute from here on
                    break
                blocks.append(b)
            if blocks:
                data = torch.stack(blocks)
                runner.write_blocks(new_ids[:len(blocks)], data)
                self.stats.swap_in_bytes += data.numel() * data.element_size()
            kv.finish_import(s.history, s.cache_salt, hit, new_ids, len(blocks))
            self.stats.corrupt_blocks = self.disk.num_corrupt
            self.stats.swap_in_s += time.perf_counter() - t
        self._release_saved(s)

    def _release_saved(self, s: Session) -> None:
        for i in range(s.saved_blocks):
            self.host.discard(self._key(s, i))
            self.disk.discard(self._key(s, i))
        s.saved_blocks = 0

    @staticmethod
    def _key(s: Session, i: int) -> str:
        return f"{s.session_id}-{i}"

    def _check_open(self, s: Session, what: str) -> None:
        if s.state is SessionState.CLOSED:
            raise ValueError(f"{what}: session {s.session_id!r} is closed")

    def metrics(self) -> dict:
        st = self.stats
        return {"sessions": len(self.sessions),
                "paused": sum(s.state is SessionState.PAUSED for s in self.sessions.values()),
                "keep_decisions": dict(st.decisions), "host_bytes": self.host.nbytes, "disk_bytes": self.disk.nbytes,
                "swap_out_bytes": st.swap_out_bytes, "swap_in_bytes": st.swap_in_bytes,
                "swap_out_s": st.swap_out_s, "swap_in_s": st.swap_in_s, "corrupt_blocks": st.corrupt_blocks,
                "lease_demotions": st.lease_demotions, "recomputed_tokens": st.recomputed_tokens}
