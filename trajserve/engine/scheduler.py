"""Iteration-level continuous batching with chunked prefill.

Spec: inference-optimization 8.2 (continuous batching, token budget);
kv-cache-management "分块预填充调度". Each step:

  1. running decodes first (one token each), so a long prompt never stalls
     the streams already producing tokens;
  2. then running partial prefills, then waiting requests, each cut to
     min(remaining, token budget left, per-request chunk cap), in the
     order --scheduling says: fcfs (arrival), priority (a request's
     priority, then arrival) or program (priority, then the level of the
     service its program has attained, then the program's start:
     engine/program_precedence.py); the queue's head waits for room, so a
     big prompt is not starved; under priority and program scheduling,
     while a call decodes, the calls it outranks add no prefill or draft
     rows to its steps for a while (engine/program_precedence.py);
  3. when the pool is short mid-step, first release paused agent state (the
     KV manager's reclaimer), then preempt a running request and re-queue it
     at the front: with a pricer (kv/preemption.py) the one cheapest to bring
     back, its blocks swapped to the host tier or dropped for recompute by
     the break-even rule; without one the newest, recomputed (its blocks stay
     as cold cache either way until the pool needs them); under priority or
     program scheduling only the lowest priority running is a candidate;
     and when the queue's head outranks running requests but the pool
     cannot hold it, the last of them in the policy's order go back first;
  4. admission ceiling: while active blocks (U_KV without the cold cache)
     would exceed tau_high (0.88) of the pool, the queue head waits, unless
     nothing runs; forks above it queue as new requests (they hit the
     parent's cached blocks when admitted).

n > 1 samples of one prompt: the prompt is prefilled once; in the update of
the step that ends its prefill, the other sequences fork off it (blocks
shared copy-on-write), each with its own first token, which the executor
sampled from the parent's logits row (samples_of tells it which).

Works on token ids and block ids only: it hands an executor a
SchedulerOutput, so the same code drives the real model or a cost model.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trajserve.config import SchedulerConfig
from trajserve.engine.attained_service import AttainedService
from trajserve.engine.forks import Forks
from trajserve.engine.program_precedence import PrefillHolds, outranks, program_ranking
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.preemption import PreemptionPricer
from trajserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from trajserve.speculative.proposer import DraftProposer


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step (= num_computed_tokens)
    num_tokens: int
    block_ids: list[int]  # the request's block table (live reference)
    # Speculation: draft tokens after the last known one, verified this step
    # (their rows are the chunk's last len(draft); num_tokens counts them).
    # A shared empty tuple by default: no list per chunk on the simulator's hot path.
    draft: list[int] | tuple = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def sample(self) -> bool:
        """The chunk reaches the last known token, so its logits give the next one."""
        return self.end - len(self.draft) == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Copy-on-write block copies (src, dst) to run before the forward.
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler(Forks):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, pricer: PreemptionPricer | None = None,
                 proposer: DraftProposer | None = None) -> None:
        """pricer: prices swap against recompute for preemption (an engine with a
        host tier); without one a preempted request is recomputed. proposer:
        drafts for decoding sequences (speculative decoding; None: off)."""
        self.config = config
        self.proposer = proposer
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # preemptions that swapped their blocks out (the rest recompute)
        self.pricer = pricer
        self.budget_rule: Callable[[], int] | None = None  # each step's budget (--itl-target-ms: engine/token_budget.py)
        if not 0 < config.admission_ceiling <= 1:
            raise ValueError(f"admission ceiling must be in (0, 1], got {config.admission_ceiling}")
        self.ceiling_blocks = int(config.admission_ceiling * kv.num_blocks)
        self.num_ceiling_waits = 0  # steps in which the queue head waited for the ceiling
        self.num_throttled_forks = 0
        # H_prefix (eq. 2, kv-cache-management) = cached / prompt tokens at admission.
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
        # n > 1: a request's other sequences, forked off it when its prefill ends.
        self.pending_samples: dict[str, list[Request]] = {}
        self.ordered = config.scheduling != "fcfs"
        self.service = AttainedService(config.program_half_life_s) if config.scheduling == "program" else None
        self.holds = PrefillHolds() if self.ordered else None
        self.now = 0.0  # the clock of the last update (the engine's, or the simulator's)

    def reconfigure(self, **changes) -> None:
        """The step's limits changed on a live engine (calibration measures
        one chunk size after another): a new config, the ceiling as it was.
        The config itself is frozen, so what an engine was built with stays
        what its EngineConfig says."""
        if changes.get("scheduling", self.config.scheduling) != self.config.scheduling:
            raise ValueError("the scheduling policy is fixed when the scheduler is built")
        self.config = dataclasses.replace(self.config, **changes)

    @contextlib.contextmanager
    def without_drafts(self) -> Iterator[None]:
        """Steps inside decode one token a sequence, with no drafts (a
        bench's baseline beside speculation on the same engine, a test that
        reads one row of logits a step); the proposer keeps its statistics
        and drafts again after."""
        proposer, self.proposer = self.proposer, None
        try:
            yield
        finally:
            self.proposer = proposer

    def add(self, request: Request, samples: Sequence[Request] = ()) -> None:
        """Queue a request; `samples`: the other n - 1 sequences of its prompt."""
        self.waiting.append(request)
        if samples:
            self.pending_samples[request.request_id] = list(samples)

    def samples_of(self, chunk: ScheduledChunk) -> Sequence[Request]:
        """The sequences that fork off this chunk's request when this step
        ends its prefill: each samples its first token from the chunk's row."""
        if not self.pending_samples or not chunk.sample:
            return ()
        return self.pending_samples.get(chunk.request.request_id, ())

    @property
    def prefix_hit_rate(self) -> float:
        """H_prefix = sum S_match / sum S_prompt   (eq. 2, kv-cache-management)."""
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def ranking(self) -> Callable[[Request], tuple]:
        """The policy's order for this step (smaller first): priority, then
        under program scheduling the level of the service the request's
        program has attained and when the program started
        (engine/program_precedence.py)."""
        if self.service is None:
            return lambda req: (req.priority,)
        return program_ranking(self.service, self.now)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens if self.budget_rule is None else self.budget_rule()
        cap = self.config.max_prefill_chunk
        scheduled: set[str] = set()
        # LoRA: the adapters (by digest) this step runs; at most max_loras
        # fit in the slots (lora/slots.py), so a request of one more waits.
        loras: set[str] = set()
        max_loras = self.config.max_loras

        # len(all_token_ids), not the num_tokens property: this runs per
        # running request per step (the simulator's hot path).
        decodes = [r for r in self.running if len(r.all_token_ids) - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if len(r.all_token_ids) - r.num_computed_tokens > 1]
        holds = None  # priority / program scheduling: what the first decoding call's outranked ones hold back
        if self.ordered:  # the budget goes to the first in the policy's order (stable: oldest first on a tie)
            rank = self.ranking()
            decodes.sort(key=rank)
            prefills.sort(key=rank)
            if len(self.waiting) > 1:
                ranked = sorted(self.waiting, key=rank)  # stable: a preempted request stays ahead of its peers
                self.waiting.clear()
                self.waiting.extend(ranked)
            if self.waiting and len(self.running) >= self.config.max_num_seqs:
                self._preempt_for(self.waiting[0], out, rank)
            elif self.waiting and self.running:
                self._preempt_for_pool(self.waiting[0], out, rank, min(budget, cap))
            if out.preempted:
                decodes = [r for r in decodes if r.status is RequestStatus.RUNNING]
                prefills = [r for r in prefills if r.status is RequestStatus.RUNNING]
            if self.holds is not None and (holds := self.holds.step(decodes, rank, self.now)) is not None:
                prefills = [r for r in prefills if not holds.held(r)]
        running = RequestStatus.RUNNING
        block_ids = self.kv.block_ids
        allocate = self.kv.allocate_slots
        proposer = self.proposer
        if proposer is not None and decodes:
            proposer.begin_step(len(decodes), min(budget - len(decodes),
                                                  sum(r.num_tokens - r.num_computed_tokens for r in prefills)))
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req.status is not running:
                continue  # preempted earlier in this step
            if req.lora is not None and req.lora.digest not in loras:
                if len(loras) >= max_loras:
                    continue
                loras.add(req.lora.digest)
            c = req.num_computed_tokens
            n = min(len(req.all_token_ids) - c, budget, cap)
            if proposer is not None and len(req.all_token_ids) - c == 1 and not (holds and holds.outranked(req)):
                # A decode: draft after it.
                draft = self._draft(req, min(budget, cap) - 1)
                # Room for the draft's rows, else a plain decode: a draft
                # never preempts anyone.
                if draft and allocate(req.request_id, c + 1 + len(draft), None, c):
                    scheduled.add(req.request_id)
                    out.chunks.append(ScheduledChunk(req, c, 1 + len(draft), block_ids(req.request_id), draft))
                    budget -= 1 + len(draft)
                    continue
            if allocate(req.request_id, c + n, None, c) or self._preempt_until_fits(req, n, scheduled, out):
                # _add_chunk, inline: once per running request per step.
                scheduled.add(req.request_id)
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n, block_ids(req.request_id)))
                budget -= n

        # Nothing was preempted this step: a request preempted now must not be
        # re-admitted in the same step it lost its blocks.
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            if holds is not None and holds.held(req):
                break  # the rest rank after it
            if req.lora is not None and req.lora.digest not in loras:
                if len(loras) >= max_loras:
                    break  # FCFS: the head waits for a slot
                loras.add(req.lora.digest)
            hit, start = self._cached_head(req)
            n = min(req.num_tokens - start, budget, cap)
            if self.running and not self._under_ceiling(req, start + n, hit):
                self.num_ceiling_waits += 1
                break
            if not (self.kv.can_admit(req.request_id, start + n, hit, others_running=bool(self.running))
                    and self.kv.allocate_slots(req.request_id, start + n, hit, write_from=start)):
                break  # FCFS: the head waits, so big prompts are not starved
            self.waiting.popleft()
            if req.status is RequestStatus.WAITING:  # first admission, not a resume after preemption
                req.num_cached_tokens = start
                self.num_prompt_tokens += req.num_prompt_tokens
                self.num_cached_prompt_tokens += start
            req.num_computed_tokens = start
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_chunk(out, req, n, scheduled)
            budget -= n
        self.kv.release_admitted_holds()  # a resumed session's pin goes once its turn locks the same path
        out.copies = self.kv.take_copies()
        return out

    def _draft(self, req: Request, room: int) -> list[int]:
        """The proposer's draft for a decoding request, cut to the step's
        room and to what the request may still output: a draft row past
        max_tokens or the context limit would be wasted (or past the RoPE table)."""
        sp = req.sampling_params
        limit = min(room, sp.max_tokens - req.num_output_tokens - 1, req.max_total_tokens - req.num_tokens - 1)
        if limit <= 0 or (req.request_id in self.pending_samples):
            return []
        return self.proposer.propose(req, limit)

    def _under_ceiling(self, req: Request, num_tokens: int, hit) -> bool:
        """Would admitting req keep the active blocks under the ceiling?
        A match's blocks nobody holds (cold in the tree, or just promoted
        from a lower tier) count, since admitting makes them active: counted
        as free, host-tier hits were admitted past the ceiling into swap
        storms (504 preemptions against 91 in `simulate --workload mooncake
        --num-requests 1000 --num-blocks 20000 --prefix-host-cache 1TB`).
        Over it, paused state is asked to leave (the reclaimer), then other
        waiting turns' holds yield (kv/admission_hold.py)."""
        kv = self.kv
        need = max(0, kv.blocks_needed(req.request_id, num_tokens) - (len(hit.block_ids) if hit else 0))
        need += kv.cold_blocks(hit)
        over = kv.num_active_blocks + need - self.ceiling_blocks
        if over > 0:
            kv.reclaim(over, keep=hit)
            if kv.num_active_blocks + need > self.ceiling_blocks:
                kv.yield_holds(hit)
        return kv.num_active_blocks + need <= self.ceiling_blocks

    def _preempt_for(self, head: Request, out: SchedulerOutput, rank: Callable[[Request], tuple]) -> None:
        """Every slot is taken and the queue's head outranks the last in the
        policy's order that runs: that one goes back to the queue (its
        computed blocks to the prefix cache, so its recompute mostly hits),
        and the head takes its slot next step. Under program scheduling, of
        equal priorities, only past engine/program_precedence.py's service
        ratio."""
        victim = max(reversed(self.running), key=rank)  # the newest among equals
        if outranks(rank(head), rank(victim)):
            self._preempt(victim, out)

    def _cached_head(self, req: Request) -> tuple:
        """(the radix match, the first token to compute) of a waiting request:
        the cached block-aligned prefix needs no compute. Prompt logprobs need
        every prompt row's logits, which the cache does not hold: such a
        prompt is computed whole (vLLM's rule)."""
        hit = None if req.prompt_logprobs is not None and not req.prompt_logprobs_done \
            else self.kv.match(req.request_id, req.all_token_ids, req.cache_scope)
        return hit, hit.num_tokens if hit else req.num_computed_tokens

    def _preempt_for_pool(self, head: Request, out: SchedulerOutput, rank: Callable[[Request], tuple],
                          room: int) -> None:
        """A slot is free but the pool cannot hold the head's next chunk (up
        to `room` tokens), and the head outranks running requests: the last in
        the policy's order of those it outranks go back to the queue (their
        blocks to the prefix cache), one by one until the head fits; it is
        admitted next step. Of equal priorities the head waits, as FCFS."""
        while self.running:
            victim = max(reversed(self.running), key=rank)  # the newest among equals
            if head.priority >= victim.priority:
                return
            hit, start = self._cached_head(head)
            if self.kv.can_admit(head.request_id, start + min(head.num_tokens - start, room), hit):
                return
            self._preempt(victim, out)

    def _preempt_until_fits(self, req: Request, n: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """allocate_slots just failed for req: preempt the newest request not
        in this step (req itself last) and retry, until req fits or is out."""
        while True:
            victim = self._pick_victim(scheduled)
            self._preempt(victim, out)
            if victim is req:
                return False
            if self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n,
                                      write_from=req.num_computed_tokens):
                return True

    def _pick_victim(self, scheduled: set[str]) -> Request:
        """A running request not already in this step's batch: the newest, or
        with a pricer the cheapest to bring back (newest on a tie)."""
        cands = [r for r in reversed(self.running) if r.request_id not in scheduled]
        if not cands:
            raise AssertionError("pool exhausted by requests already scheduled this step")
        if self.ordered:  # the lowest priority goes first (a request may be its own victim)
            worst = max(r.priority for r in cands)
            cands = [r for r in cands if r.priority == worst]
        if self.pricer is None or len(cands) == 1:
            return cands[0]
        B = self.kv.block_size
        return min(cands, key=lambda r: self.pricer.choose(r.num_computed_tokens // B)[1])

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        _remove_identical(self.running, req)
        swap = self.pricer is not None and self.pricer.choose(req.num_computed_tokens // self.kv.block_size)[0]
        # Its computed blocks go to the prefix cache: the recompute may hit them.
        # A swap moves them down to the host tier at once; re-admission loads them back.
        if self.kv.release(req.request_id, req.all_token_ids, req.num_computed_tokens, req.cache_scope,
                           swap_out=swap, priority=self.eviction_class(req.priority)):
            self.num_swap_preemptions += 1
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _add_chunk(self, out: SchedulerOutput, req: Request, n: int, scheduled: set[str]) -> None:
        scheduled.add(req.request_id)
        out.chunks.append(
            ScheduledChunk(req, req.num_computed_tokens, n, self.kv.block_ids(req.request_id))
        )

    def update(self, out: SchedulerOutput, sampled: dict[str, int], now: float,
               accepted: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish and free.
        accepted: a drafted chunk's accepted draft tokens, which come before
        its sampled token (speculation). Returns the requests that finished
        this step."""
        finished = []
        running = RequestStatus.RUNNING
        if self.pending_samples:
            self._fork_samples(out)
        self.now = now
        if self.service is not None:  # rows computed: service attained by each chunk's program
            for chunk in out.chunks:
                req = chunk.request
                self.service.add(req.program or req.request_id, chunk.num_tokens, now, req.arrival_time)
        cache_computed = self.kv.cache_computed
        B = self.kv.block_size
        for chunk in out.chunks:
            req = chunk.request
            if req.status is not running:
                continue  # aborted while the step ran
            start = chunk.start
            end = start + chunk.num_tokens
            if chunk.draft:
                if self._update_drafted(chunk, sampled, accepted or {}, now):
                    finished.append(req)
                continue
            req.num_computed_tokens = end
            # Only a chunk that fills a block has something for the prefix
            # cache: every block before `start` was cached when the step that
            # computed it ended (or came from the cache at admission), so a
            # chunk inside one block would find nothing new (most decodes).
            if end // B != start // B:
                cache_computed(req.request_id, req.all_token_ids, end, req.cache_scope)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.append_token(token, now)
            status = req.check_stop()
            if status is not None:
                self.finish(req, status)
                finished.append(req)
        return finished

    def _update_drafted(self, chunk: ScheduledChunk, sampled: dict[str, int], accepted: dict[str, list[int]],
                        now: float) -> bool:
        """A verified draft: the K/V of the last known token and of the
        accepted draft tokens is kept, the rejected rows' slots are not
        (paged rollback: blocks past the sequence go back to the pool; the
        radix cache is offered verified blocks only). Appends the accepted
        tokens, then the target's own, stopping at the first that ends the
        request. True if it finished."""
        req = chunk.request
        acc = accepted.get(req.request_id, [])
        self.proposer.observe(req, len(chunk.draft), len(acc))
        req.num_draft_tokens += len(chunk.draft)
        req.num_accepted_draft_tokens += len(acc)
        status = None
        last = len(acc)
        for i, t in enumerate(acc + [sampled[req.request_id]]):
            req.append_token(t, now)
            status = req.check_stop(matcher=i == last)
            if status is not None:
                break  # inside the accepted tokens: the ones after it are not output
        # K/V is verified for the last known token and the accepted drafts
        # (all but the newest token, or fewer after a stop).
        req.num_computed_tokens = verified = min(chunk.start + 1 + len(acc), req.num_tokens - 1)
        if status is not None:
            self.finish(req, status)
            return True
        if verified // self.kv.block_size != chunk.start // self.kv.block_size:
            self.kv.cache_computed(req.request_id, req.all_token_ids, verified, req.cache_scope)
        self.kv.truncate(req.request_id, req.num_tokens)
        return False

    def finish(self, req: Request, status: RequestStatus) -> None:
        if self.holds is not None:
            self.holds.forget(req.request_id)
        self.pending_samples.pop(req.request_id, None)  # its other samples never start
        if self.proposer is not None:
            self.proposer.release(req)
        req.status = status
        if not _remove_identical(self.running, req):
            _remove_identical(self.waiting, req)
        self.kv.release(req.request_id, req.all_token_ids, req.num_computed_tokens, req.cache_scope,
                        priority=self.eviction_class(req.priority))

    def eviction_class(self, priority: int) -> int | None:
        """The class a request's cached blocks and paused state keep in the eviction and pressure orders
        (kv/radix_cache.py, sessions/pause_machine.py): its priority, none under FCFS."""
        return None if self.config.scheduling == "fcfs" else priority


def _remove_identical(seq: list[Request] | deque[Request], req: Request) -> bool:
    """Remove `req` itself from seq. `list.remove` would compare with the
    dataclass __eq__ (every field, token lists included) against each
    request before it: O(running) Python calls per finish."""
    for i, r in enumerate(seq):
        if r is req:
            del seq[i]
            return True
    return False
