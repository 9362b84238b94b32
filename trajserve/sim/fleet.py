"""N replicas behind one router, on one virtual clock (the cluster's view).

Each replica is the simulator's own control plane (sim/build.py: the
engine's Scheduler and KVCacheManager with its radix cache, stepped by a
CostModelRunner); the router is the cluster's own code (cluster/router.py),
fed by the radix caches' KV events (kv/radix_cache.py on_event) through a
PrefixDirectory, as a real front end would be.

Events, in time order: a call arrives (its prompt is built from its
session's history, hashed into the namespace's chained block hashes, routed
with each replica's load, and queued there), or a replica's step ends (the
next one starts at once if it has work). A step is executed when it starts
(its effects are known then; its calls finish at its end); a call routed
while another replica's step runs sees that replica's state as of its step
start. Each replica's cache, pool and queue are its own.

Not modelled here (the single-replica simulator has them): tool pauses
and the keep policy, forks, lower tiers of the prefix cache, speculation,
a concurrency gate. A call that cannot fit a replica's pool is refused
(its session ends), as the engine refuses it.
"""
from __future__ import annotations

import gc
import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trajserve.cluster.directory import KVEvent, prompt_hashes
from trajserve.cluster.router import KVRouter, ReplicaLoad, RouteRequest, Router
from trajserve.engine.core import EngineCore
from trajserve.request import Request
from trajserve.kv.scope import CacheScope
from trajserve.sim.executor import CostModelExecutor
from trajserve.sim.simulator import greedy_params, refused
from trajserve.sim.tokens import TokenSource
from trajserve.sim.workload import Session


@dataclass(slots=True)
class FleetResult:
    router: str
    replicas: int
    calls: int
    rejected: int
    prompt_tokens: int
    cached_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    end_time_s: float
    calls_per_replica: list[int]
    wall_s: float

    @property
    def hit_rate(self) -> float:
        """H_prefix (eq. 2, kv-cache-management) over the whole fleet."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        return {"router": self.router, "replicas": self.replicas, "calls": self.calls, "rejected": self.rejected,
                "hit_rate": self.hit_rate, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "ttft_p50_s": self.ttft_p50_s, "ttft_p99_s": self.ttft_p99_s, "end_time_s": self.end_time_s,
                "calls_per_replica": self.calls_per_replica, "wall_s": self.wall_s}


class Fleet:
    def __init__(self, setup, replicas: int, router: Router, tokens: TokenSource) -> None:
        if replicas < 1 or router.num_replicas != replicas:
            raise ValueError(f"a fleet of {replicas} replicas needs a router for as many, got {router.num_replicas}")
        if setup.keep_policy not in ("cache",) or setup.prefix_host_blocks or setup.prefix_disk_blocks \
                or setup.spec_accept is not None:
            raise ValueError("the fleet simulation runs no tool pauses (--keep-policy cache), no prefix-cache "
                             "tiers and no speculation")
        self.router, self.tokens = router, tokens
        self.sims = [setup.simulator()[0] for _ in range(replicas)]
        self.cores = []
        for j, sim in enumerate(self.sims):
            executor = CostModelExecutor(sim.runner, tokens, None, None, None)
            self.cores.append((EngineCore(sim.sched, executor), executor))
            if isinstance(router, KVRouter) and sim.kv.prefix_caching:
                sim.kv.subscribe(lambda stored, hashes, j=j:
                                 router.directory.apply(KVEvent(j, tuple(hashes), "device", stored)))
        kv = self.sims[0].kv
        self.block_size, self.cap = kv.block_size, kv.token_capacity

    def _load(self, j: int) -> ReplicaLoad:
        s = self.sims[j].sched

        def left(r: Request) -> int:  # tokens still to compute: the prompt's rest, the outputs to come
            return r.num_tokens - r.num_computed_tokens + r.sampling_params.max_tokens - r.num_output_tokens

        return ReplicaLoad(running_tokens=sum(left(r) for r in s.running),
                           waiting_tokens=sum(left(r) for r in s.waiting),
                           requests=len(s.running) + len(s.waiting))

    def run(self, sessions: Sequence[Session]) -> FleetResult:
        gc_was = gc.isenabled()
        gc.disable()  # as Simulator.run: the radix trees' tuples make full collections slow
        try:
            return self._run(sessions)
        finally:
            if gc_was:
                gc.enable()

    def _run(self, sessions: Sequence[Session]) -> FleetResult:
        t_wall = time.perf_counter()
        n = len(self.sims)
        events: list[tuple[float, int, int, object]] = []  # (time, seq, kind 0 arrival / 1 step end, payload)
        seq = 0
        for s in sessions:
            if s.calls:
                events.append((s.next_arrival(0.0), seq, 0, s))
                seq += 1
        heapq.heapify(events)
        stepping = [False] * n  # a step-end event is pending for the replica
        live: dict[str, tuple[Session, RouteRequest, int]] = {}  # request id -> its session, view, replica
        per_replica = [0] * n
        ttft, prompt_tokens, cached_tokens, rejected, clock = [], 0, 0, 0, 0.0
        stalls = [0] * n
        while events:
            clock, _, kind, payload = heapq.heappop(events)
            if kind == 0:
                s: Session = payload
                call = s.calls[s.next]
                prompt = call.prompt(s.history)
                s.history = []
                if refused(self.sims[0].kv, prompt):
                    rejected += len(s.calls) - s.next
                    continue
                ns = self.sims[0].kv.namespace(CacheScope(call.cache_salt))
                # A session id only where the session has more calls to make (a
                # client sends none with a one-off request).
                req_view = RouteRequest(prompt_hashes(ns, prompt, self.block_size)
                                        if isinstance(self.router, KVRouter) else (),
                                        len(prompt), prompt, s.name if len(s.calls) > 1 else None)
                j = self.router.route(req_view, [self._load(i) for i in range(n)])
                rid = f"{s.name}#{s.next}"
                req = Request(rid, prompt, greedy_params(max(1, call.output_len)), self.cap,
                              arrival_time=clock, cache_salt=call.cache_salt, program=s.name)
                if call.output_ids is not None:
                    self.cores[j][1].forced[rid] = call.output_ids
                live[rid] = (s, req_view, j)
                per_replica[j] += 1
                self.sims[j].sched.add(req)
                if not stepping[j]:
                    stepping[j] = True
                    heapq.heappush(events, (clock, seq, 1, j))
                    seq += 1
                continue
            j = payload
            sched = self.sims[j].sched
            if not sched.has_unfinished():
                stepping[j] = False
                continue
            core, executor = self.cores[j]
            executor.now = clock
            step = core.step()
            if step is None:  # nothing could run (all preempted, or an admission that freed too little)
                stalls[j] += 1
                if stalls[j] > 100:
                    raise RuntimeError(f"replica {j} stalled: {len(sched.waiting)} waiting, "
                                       f"{len(sched.running)} running")
                heapq.heappush(events, (clock, seq, 1, j))
                seq += 1
                continue
            stalls[j] = 0
            end = step.end
            for req in step.finished:
                s, view, _ = live.pop(req.request_id)
                self.router.done(view, j)
                executor.forced.pop(req.request_id, None)
                prompt_tokens += req.num_prompt_tokens
                cached_tokens += req.num_cached_tokens
                ttft.append(req.first_token_time - req.arrival_time)
                s.history = req.all_token_ids
                s.next += 1
                if s.next < len(s.calls):
                    heapq.heappush(events, (s.next_arrival(end), seq, 0, s))
                    seq += 1
                else:
                    s.history = []
                    self.router.end_session(s.name)
            heapq.heappush(events, (end, seq, 1, j))
            seq += 1
        q = np.percentile(ttft, [50, 99]) if ttft else [float("nan")] * 2
        return FleetResult(self.router.name, n, len(ttft), rejected, prompt_tokens, cached_tokens, float(q[0]),
                           float(q[1]), clock, per_replica, time.perf_counter() - t_wall)
