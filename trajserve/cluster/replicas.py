"""The front end's view of its replicas (cluster/frontend.py routes over it):
their health, their reports, and the streaming calls into them.

A replica is up from its first answer (`info`) until a call into it fails
with one of Ray's actor errors (its process died or was killed, its node
went away): then it is down, the prefix directory forgets it, and a task
waits for Ray to restart it (the actors have max_restarts) and marks it up
again, empty, once it answers. Every `poll_s` each live replica is asked
for a report (cluster/replica.py Report): its KV events since the last one,
applied to the directory in order, and how busy its engine is.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from trajserve.cluster.asgi import HttpRequest, ResponseStart
from trajserve.cluster.directory import KVEvent, PrefixDirectory
from trajserve.cluster.replica import Report, ReplicaInfo

log = logging.getLogger("trajserve.cluster")


class ReplicaDown(Exception):
    """The replica's actor died or cannot be reached."""


@dataclass
class ReplicaState:
    index: int
    actor: object
    info: ReplicaInfo | None = None
    healthy: bool = False
    epoch: str | None = None
    old_epochs: set[str] = field(default_factory=set)  # of processes that died: their late reports are dropped
    next_seq: int = 0
    pending: dict[int, Report] = field(default_factory=dict)  # reports that came ahead of their turn
    in_flight: int = 0
    tokens: int = 0  # in-flight work left, estimated by the front end
    running: int = 0  # as the last report said
    waiting: int = 0
    kv_usage: float = 0.0
    routed: int = 0
    failures: int = 0
    recovering: asyncio.Task | None = None


def actor_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    return (rex.RayActorError, rex.ActorUnavailableError, rex.WorkerCrashedError, rex.NodeDiedError,
            rex.ObjectLostError, rex.OwnerDiedError)


class ReplicaSet:
    def __init__(self, actors: Sequence, directory: PrefixDirectory | None, registry: CollectorRegistry,
                 poll_s: float = 0.5, restart_wait_s: float = 120.0) -> None:
        """directory: the kv router's, fed by the reports (None: reports are read for load only)."""
        self.replicas = [ReplicaState(i, a) for i, a in enumerate(actors)]
        self.directory = directory
        self.poll_s, self.restart_wait_s = poll_s, restart_wait_s
        self._up = asyncio.Event()
        self._poller: asyncio.Task | None = None
        self._errors = actor_errors()
        r = registry
        self.m_down = Counter("trajserve_router_replica_failures", "times a replica was found dead", ["replica"],
                              registry=r)
        self.m_healthy = Gauge("trajserve_router_replica_healthy", "1 while a replica serves", ["replica"],
                               registry=r)
        self.m_events = Counter("trajserve_router_kv_events", "KV event batches applied to the directory", registry=r)

    def __getitem__(self, j: int) -> ReplicaState:
        return self.replicas[j]

    def __len__(self) -> int:
        return len(self.replicas)

    def __iter__(self):
        return iter(self.replicas)

    @property
    def healthy(self) -> list[ReplicaState]:
        return [r for r in self.replicas if r.healthy]

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> list[ReplicaInfo]:
        """Wait for every replica's first answer (their engines load), then poll."""
        infos = await asyncio.gather(*(self.call(r, "info") for r in self.replicas))
        for r, info in zip(self.replicas, infos):
            self._mark_up(r, info)
        self._poller = asyncio.create_task(self._poll())
        return infos

    async def stop(self) -> None:
        tasks = [t for t in [self._poller, *(r.recovering for r in self.replicas)] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

    async def wait_up(self) -> None:
        """Until some replica serves (ReplicaDown after restart_wait_s)."""
        try:
            await asyncio.wait_for(self._up.wait(), self.restart_wait_s)
        except asyncio.TimeoutError:
            raise ReplicaDown(f"no replica came back within {self.restart_wait_s:.0f} s") from None

    # -------------------------------------------------------------- health
    def _mark_up(self, r: ReplicaState, info: ReplicaInfo) -> None:
        r.info, r.epoch, r.next_seq, r.pending = info, info.epoch, 0, {}
        r.healthy = True
        self.m_healthy.labels(str(r.index)).set(1)
        self._up.set()

    def mark_down(self, r: ReplicaState) -> None:
        if not r.healthy:
            return
        log.warning("replica %d is down; routing around it until it restarts", r.index)
        r.healthy = False
        r.failures += 1
        if r.epoch is not None:
            r.old_epochs.add(r.epoch)
        r.epoch = None
        self.m_down.labels(str(r.index)).inc()
        self.m_healthy.labels(str(r.index)).set(0)
        if self.directory is not None:
            self.directory.forget_replica(r.index)
        if not self.healthy:
            self._up.clear()
        if r.recovering is None or r.recovering.done():
            r.recovering = asyncio.create_task(self._recover(r))

    async def _recover(self, r: ReplicaState) -> None:
        """Ray restarts the actor; it is up again once it answers (a fresh engine, empty caches)."""
        while True:
            try:
                info = await self.call(r, "info", timeout=10.0)
            except (ReplicaDown, asyncio.TimeoutError):
                await asyncio.sleep(self.poll_s)
                continue
            log.warning("replica %d is back (pid %d)", r.index, info.pid)
            self._mark_up(r, info)
            return

    # ------------------------------------------------------------- reports
    def apply(self, r: ReplicaState, rep: Report) -> None:
        """A report, in its epoch's order (one that comes early waits for those before it)."""
        if rep.epoch != r.epoch:
            if rep.epoch in r.old_epochs or r.epoch is None:  # a dead process's, or the replica is down
                return
            # Restarted between two looks: what the old process held is gone.
            r.old_epochs.add(r.epoch)
            if self.directory is not None:
                self.directory.forget_replica(r.index)
            r.epoch, r.next_seq, r.pending = rep.epoch, 0, {}
        r.pending[rep.seq] = rep
        while r.next_seq in r.pending:
            rep = r.pending.pop(r.next_seq)
            r.next_seq += 1
            r.running, r.waiting, r.kv_usage = rep.running, rep.waiting, rep.kv_usage
            if self.directory is not None:
                for tier, stored, hashes in rep.events:
                    self.directory.apply(KVEvent(r.index, hashes, tier, stored))
                self.m_events.inc(len(rep.events))

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            for r in self.healthy:
                try:
                    self.apply(r, await self.call(r, "report", timeout=30.0))
                except ReplicaDown:
                    self.mark_down(r)
                except asyncio.TimeoutError:  # alive but busy (a long step): not down
                    pass

    # --------------------------------------------------------------- calls
    async def call(self, r: ReplicaState, method: str, *args, timeout: float | None = None):
        try:
            return await asyncio.wait_for(getattr(r.actor, method).remote(*args), timeout)
        except self._errors as e:
            raise ReplicaDown(f"replica {r.index}: {type(e).__name__}") from None

    @staticmethod
    def open(r: ReplicaState, req: HttpRequest):
        """The replica's streamed answer to req (read it with head, next and rest)."""
        return r.actor.handle.options(num_returns="streaming").remote(req)

    async def next(self, r: ReplicaState, gen):
        """The next item of an answer (ResponseStart, bytes, Report), None at its end."""
        try:
            ref = await gen.__anext__()
            return await ref
        except StopAsyncIteration:
            return None
        except self._errors as e:
            raise ReplicaDown(f"replica {r.index}: {type(e).__name__}") from None

    async def head(self, r: ReplicaState, gen) -> tuple[ResponseStart, bytes]:
        """The response start and its first body chunk (b"" if none)."""
        start = await self.next(r, gen)
        if not isinstance(start, ResponseStart):
            raise ReplicaDown(f"replica {r.index} answered without a response")
        item = await self.next(r, gen)
        if isinstance(item, Report):
            self.apply(r, item)
            return start, b""
        return start, item or b""

    async def rest(self, r: ReplicaState, gen) -> bytes:
        parts = []
        while (item := await self.next(r, gen)) is not None:
            if isinstance(item, Report):
                self.apply(r, item)
            else:
                parts.append(item)
        return b"".join(parts)

    async def fetch(self, r: ReplicaState, req: HttpRequest) -> tuple[ResponseStart, bytes]:
        """A whole answer."""
        gen = self.open(r, req)
        start, first = await self.head(r, gen)
        return start, first + await self.rest(r, gen)
