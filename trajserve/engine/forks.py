"""n > 1 samples of one prompt and forks of a running request
(engine/scheduler.py's Scheduler): children continue from the parent's
tokens and computed KV, its blocks shared copy-on-write (kv/ forks them)."""
from __future__ import annotations

import dataclasses
from trajserve.request import Request, RequestStatus


class Forks:
    """The Scheduler's forking: it holds running, waiting, kv,
    pending_samples, ceiling_blocks and num_throttled_forks."""

    def fork(self, parent: Request, children: list[Request], throttle: bool = True) -> None:
        """Children continue from the parent's state (tokens and computed KV),
        sharing its blocks copy-on-write. They join as the newest running
        requests, so they are the first preempted. A parent without blocks
        (waiting), or a pool above the admission ceiling, gives children that
        queue like new prompts (and hit the parent's cached blocks)."""
        throttle = throttle and self.kv.num_active_blocks >= self.ceiling_blocks
        self.num_throttled_forks += len(children) if throttle else 0
        for child in children:
            child.all_token_ids = list(parent.all_token_ids)
            child.num_cached_tokens = parent.num_cached_tokens
            if parent.status is RequestStatus.RUNNING and self.kv.has_table(parent.request_id) and not throttle:
                self.kv.fork(parent.request_id, child.request_id)
                child.num_computed_tokens = parent.num_computed_tokens
                child.status = RequestStatus.RUNNING
                self.running.append(child)
            else:
                child.num_computed_tokens = 0
                child.status = RequestStatus.WAITING
                self.waiting.append(child)

    def _fork_samples(self, out) -> None:
        """`out`: the step's SchedulerOutput. Prefills that end this step fork into their other samples, before
        the parent advances: each child takes the parent's state so far and
        joins this step's chunks, so the update advances it like the parent,
        with its own sampled token. Never queued (they branch now)."""
        for chunk in list(out.chunks):
            if not chunk.sample or chunk.request.status is not RequestStatus.RUNNING:
                continue
            children = self.pending_samples.pop(chunk.request.request_id, None)
            if children is None:
                continue
            self.fork(chunk.request, children, throttle=False)
            for child in children:
                out.chunks.append(dataclasses.replace(chunk, request=child,
                                                      block_ids=self.kv.table(child.request_id).block_ids))
