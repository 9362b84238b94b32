"""One engine replica: the single-engine server (its engine, loop thread and
app, server/serve.py build_server) inside a Ray actor (cluster/launch.py
wraps this class with ray.remote).

The front end (cluster/frontend.py) hands it each HTTP request it routes
here; `handle` runs the request through the app in-process (cluster/asgi.py)
and streams back the response start, the body's chunks, and last a Report:
the KV events since the previous report and how busy the engine is. The
events are what this replica's caches did (kv-cache-management figure 7's
directory is fed by them): blocks entering or leaving the radix tree
(device) and the host and disk tiers, named by their chained hashes. A
report rides on every response, so the directory has a turn's blocks before
the client can send the next turn; the front end also polls `report` to see
evictions caused by others and to notice a dead replica.

`epoch` changes when Ray restarts the actor (a fresh process, empty caches):
the front end then forgets what the directory said about this replica.
"""
from __future__ import annotations

import argparse
import os
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from trajserve.cluster import asgi
from trajserve.server.config import ServerConfig


@dataclass(frozen=True, slots=True)
class Report:
    epoch: str
    seq: int  # reports of one epoch are numbered: the front end applies them in order
    events: tuple[tuple[str, bool, tuple[bytes, ...]], ...]  # (tier, stored, chained hashes)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    index: int
    epoch: str
    pid: int
    node: str
    model_id: str  # the radix namespace's model part: (model_id, cache scope)
    block_size: int
    names: tuple[str, ...]
    max_model_len: int
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA name -> digest (the cache scope's part)


class Replica:
    def __init__(self, args: argparse.Namespace, index: int, config: ServerConfig) -> None:
        from trajserve.server.serve import build_server

        self.index = index
        self.epoch = uuid.uuid4().hex
        if getattr(args, "disk_cache_dir", None):  # one engine holds a --kv-disk-dir: each replica its own under it
            args = argparse.Namespace(**{**vars(args),
                                         "disk_cache_dir": os.path.join(args.disk_cache_dir, f"replica-{index}")})
        self.server = build_server(args, config)
        self._lock = threading.Lock()  # events come from the engine thread (and the disk writer's caller)
        self._events: list[tuple[str, bool, list[bytes]]] = []
        self._seq = 0
        engine = self.server.engine
        if engine.kv.prefix_caching:
            engine.kv.subscribe(lambda stored, hashes: self._push("device", stored, hashes))
        if engine.lower is not None:
            engine.lower.subscribe(lambda tier, stored, h: self._push(tier, stored, (h,)))
            for tier, hashes in engine.lower.contents().items():  # a --kv-disk-dir's blocks adopted at start-up
                if hashes:
                    self._push(tier, True, hashes)

    def _push(self, tier: str, stored: bool, hashes) -> None:
        with self._lock:
            last = self._events[-1] if self._events else None
            if last is not None and last[0] == tier and last[1] == stored:  # one entry per run of alike events
                last[2].extend(hashes)
            else:
                self._events.append((tier, stored, list(hashes)))

    def info(self) -> ReplicaInfo:
        import ray

        engine = self.server.engine
        adapters = {name: a.digest for name, a in engine.lora.adapters.items()} if engine.lora is not None else {}
        return ReplicaInfo(self.index, self.epoch, os.getpid(), ray.util.get_node_ip_address(),
                           engine.kv.model_id,
                           engine.kv.block_size, tuple(self.server.names), engine.max_model_len, adapters)

    def tokenizer(self):
        """The front end renders prompts with the replicas' own tokenizer and template."""
        return self.server.engine.tokenizer

    def report(self) -> Report:
        with self._lock:
            events, self._events = self._events, []
            seq = self._seq
            self._seq += 1
        snap = self.server.aengine.snapshot
        return Report(self.epoch, seq, tuple((t, s, tuple(h)) for t, s, h in events), int(snap.get("running", 0)),
                      int(snap.get("waiting", 0)), float(snap.get("U_KV", 0.0)))

    async def handle(self, req: asgi.HttpRequest) -> AsyncIterator:
        """The app's answer to req (a ResponseStart, then bytes), then a Report."""
        async for item in asgi.call(self.server.app, req):
            yield item
        yield self.report()

    def close(self) -> None:
        self.server.close()
