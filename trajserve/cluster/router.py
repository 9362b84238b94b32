"""Which replica serves a request: the cluster's routing policies.

kv   kv-cache-management figure 7's joint objective over the prefix
     directory (directory.py):

         w* = argmax_j [ mu * Match_j / S  -  (1 - mu) * (L_j / L_max)^gamma ]

     Match_j: the prompt tokens replica j would not compute, its leading run
     of held blocks x block size, a block on the host or disk tier credited
     by what reloading it saves against recomputing it (host_credit,
     disk_credit); S: the prompt's tokens; L_j: its load, the tokens it
     still has to compute (ReplicaLoad) plus the contexts its sessions hold
     there (their next turns need that KV kept or recomputed: without this,
     idle agents between tool calls looked free and piled onto the replica
     holding their shared preamble: `simulate --replicas 4 --trajectories
     64 --turns 6 --preamble-tokens 2000 --rate 4 --num-blocks 3000`, hit
     rate 0.43 against round-robin's 0.64; with it 0.62). The spec leaves
     L_max and the parameters open; here L_max = S by default (load_scale
     "prompt"), so with mu = 0.5 and gamma = 1 the score is (Match_j -
     L_j) / 2S: the replica where this request's first token comes
     soonest, queued work plus the part of its prompt not cached, both in
     tokens (and what its sessions hold). load_scale
     "busiest" takes L_max = the largest load now, the formula's literal
     reading; it gives the busiest replica the whole penalty however small
     the loads, which scattered one document's questions (hit rate 0.74
     against 0.92 in tests/test_sim_fleet.py's workload). mu: before the
     sessions' contexts counted, 0.6 and 0.7 let a full match outweigh any
     load and sent every trajectory of that run to one replica; with them,
     0.5 and 0.7 do alike there (hit rate 0.66 and 0.67). Ties go to the
     lesser load, then the lower index.
round-robin     in turn, over healthy replicas
least-loaded    the smallest L_j
char-prefix     Ray Serve's PrefixCacheAffinityRouter, as a baseline: a
                prefix tree of the prompts each replica was sent (here
                chunks of 16 tokens, hashed), the replica with the longest
                match if it covers at least `match_threshold` of the prompt
                and the replicas' queues differ by at most
                `imbalance_threshold` requests, else the least loaded; it
                sees no blocks, no tiers, no evictions and no salts.

Every policy keeps a session on the replica it first went to while that
replica is healthy (its paused state stays where it is); a session whose
replica is gone is routed afresh (and recomputes there).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from trajserve.cluster.directory import PrefixDirectory

CHAR_CHUNK = 16


@dataclass(slots=True)
class ReplicaLoad:
    """What a replica reports with its KV events: the work it has left, in
    tokens to compute (prompt tokens not computed yet, output tokens to come)."""
    running_tokens: int = 0  # of the sequences it runs
    waiting_tokens: int = 0  # of those queued, not yet admitted
    healthy: bool = True
    requests: int = 0  # running + waiting (char-prefix's imbalance test)

    @property
    def tokens(self) -> int:
        return self.running_tokens + self.waiting_tokens


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router sees of a request: its prompt's block hashes (under
    its namespace), its length, the tokens themselves (char-prefix only),
    and its session, if any."""
    hashes: Sequence[bytes]
    num_tokens: int
    token_ids: Sequence[int] = ()
    session_id: str | None = None


@dataclass
class Router:
    """The shared part: health and session affinity; `_choose` is the policy."""
    num_replicas: int
    sessions: dict[str, int] = field(default_factory=dict)
    # The context each session last sent (tokens) and their sum per replica:
    # what its sessions will need held there, and recompute if it is not
    # (the kv router counts it as load).
    session_tokens: dict[str, int] = field(default_factory=dict)
    held_tokens: list[int] = field(default_factory=list)
    name = "base"

    def __post_init__(self) -> None:
        self.held_tokens = [0] * self.num_replicas

    def route(self, req: RouteRequest, loads: Sequence[ReplicaLoad]) -> int:
        if len(loads) != self.num_replicas:
            raise ValueError(f"{len(loads)} loads for {self.num_replicas} replicas")
        healthy = [j for j, load in enumerate(loads) if load.healthy]
        if not healthy:
            raise RuntimeError("no healthy replica")
        sid = req.session_id
        if sid is not None:
            j = self.sessions.get(sid)
            if j is None or not loads[j].healthy:
                self.end_session(sid)
                j = self.sessions[sid] = self._choose(req, loads, healthy)
            self.held_tokens[j] += req.num_tokens - self.session_tokens.get(sid, 0)
            self.session_tokens[sid] = req.num_tokens
        else:
            j = self._choose(req, loads, healthy)
        self._sent(req, j)
        return j

    def end_session(self, session_id: str) -> None:
        """The session closed (or moved): its context no longer counts where it was."""
        j = self.sessions.pop(session_id, None)
        if j is not None:
            self.held_tokens[j] -= self.session_tokens.pop(session_id, 0)

    def _choose(self, req: RouteRequest, loads: Sequence[ReplicaLoad], healthy: list[int]) -> int:
        raise NotImplementedError

    def _sent(self, req: RouteRequest, replica: int) -> None:
        """What a policy learns from its own decision (char-prefix's tree, kv's promises)."""

    def done(self, req: RouteRequest, replica: int) -> None:
        """The request routed to replica finished, failed or was given up."""


def least_loaded(loads: Sequence[ReplicaLoad], among: Sequence[int]) -> int:
    return min(among, key=lambda j: (loads[j].tokens, j))


@dataclass
class RoundRobin(Router):
    name = "round-robin"
    _next: itertools.count = field(default_factory=itertools.count)

    def _choose(self, req, loads, healthy):
        return healthy[next(self._next) % len(healthy)]


@dataclass
class LeastLoaded(Router):
    name = "least-loaded"

    def _choose(self, req, loads, healthy):
        return least_loaded(loads, healthy)


@dataclass
class KVRouter(Router):
    directory: PrefixDirectory = field(default_factory=PrefixDirectory)
    block_size: int = 16
    mu: float = 0.5
    gamma: float = 1.0
    host_credit: float = 0.8
    disk_credit: float = 0.4
    load_scale: str = "prompt"
    promises: bool = True  # a prefix sent to a replica counts as held there until done (directory.promise)
    name = "kv"

    def __post_init__(self) -> None:
        Router.__post_init__(self)
        if not (0.0 <= self.mu <= 1.0 and self.gamma > 0 and 0.0 <= self.disk_credit <= self.host_credit <= 1.0
                and self.load_scale in ("prompt", "busiest")):
            raise ValueError(f"kv router: mu in [0, 1], gamma > 0, 0 <= disk_credit <= host_credit <= 1, load_scale "
                             f"prompt or busiest; got mu={self.mu}, gamma={self.gamma}, host_credit="
                             f"{self.host_credit}, disk_credit={self.disk_credit}, load_scale={self.load_scale!r}")

    def match_tokens(self, replica: int, hashes: Sequence[bytes]) -> float:
        held = self.directory.match(replica, hashes)
        return self.block_size * (held.device + self.host_credit * held.host + self.disk_credit * held.disk)

    def scores(self, req: RouteRequest, loads: Sequence[ReplicaLoad], among: Sequence[int]) -> dict[int, float]:
        s = max(1, req.num_tokens)
        load = {j: loads[j].tokens + self.held_tokens[j] for j in among}
        l_max = s if self.load_scale == "prompt" else max(load.values())
        return {j: self.mu * self.match_tokens(j, req.hashes) / s
                - (1 - self.mu) * ((load[j] / l_max) ** self.gamma if l_max else 0.0) for j in among}

    def _choose(self, req, loads, healthy):
        score = self.scores(req, loads, healthy)
        return max(healthy, key=lambda j: (score[j], -loads[j].tokens, -j))

    def _sent(self, req, replica):
        if self.promises:
            self.directory.promise(replica, req.hashes)

    def done(self, req, replica):
        if self.promises:
            self.directory.settle(replica, req.hashes)


@dataclass
class CharPrefix(Router):
    match_threshold: float = 0.1  # Ray Serve's defaults
    imbalance_threshold: int = 10
    _sent_to: list[set[int]] = field(default_factory=list)
    name = "char-prefix"

    def __post_init__(self) -> None:
        Router.__post_init__(self)
        self._sent_to = [set() for _ in range(self.num_replicas)]

    @staticmethod
    def _prefixes(token_ids: Sequence[int]) -> list[int]:
        out, h = [], 0
        for i in range(0, len(token_ids) - CHAR_CHUNK + 1, CHAR_CHUNK):
            h = hash((h, tuple(token_ids[i:i + CHAR_CHUNK])))
            out.append(h)
        return out

    def _choose(self, req, loads, healthy):
        queued = [loads[j].requests for j in healthy]
        if max(queued) - min(queued) > self.imbalance_threshold:
            return least_loaded(loads, healthy)
        prefixes = self._prefixes(req.token_ids)
        best, best_n = [], 0
        for j in healthy:
            n = 0
            for p in prefixes:
                if p not in self._sent_to[j]:
                    break
                n += 1
            if n > best_n:
                best, best_n = [j], n
            elif n == best_n and n:
                best.append(j)
        if best and best_n * CHAR_CHUNK >= self.match_threshold * max(1, len(req.token_ids)):
            return least_loaded(loads, best)
        return least_loaded(loads, healthy)

    def _sent(self, req, replica):
        self._sent_to[replica].update(self._prefixes(req.token_ids))


ROUTERS = {r.name: r for r in (KVRouter, RoundRobin, LeastLoaded, CharPrefix)}


def make_router(name: str, num_replicas: int, **options) -> Router:
    if name not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
    return ROUTERS[name](num_replicas, **options)
