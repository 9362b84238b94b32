"""The engine's Executor (engine/core.py): the model runner and the sampler.

    SchedulerOutput ─► ModelRunner.prepare (token layout, slots, copies)
                    ─► ModelRunner.run (LlamaModel.forward over the paged KV)
                    ─► prompt logprobs (rows of prompt tokens that asked for them)
                    ─► Sampler.sample (one row per sampled sequence) ─► ExecutorOutput

A prompt with n > 1 samples is prefilled once: the row that ends its prefill
is sampled once more for each of its other sequences (the scheduler forks
them off it in update), so each draws its own first token from the same logits.
"""
from __future__ import annotations

import time

import torch

from trajserve.engine.core import ExecutorOutput, StepStats
from trajserve.engine.model_runner import ModelRunner
from trajserve.engine.scheduler import Scheduler, SchedulerOutput
from trajserve.model.sampler import RowContext, Sampler, token_logprobs
from trajserve.speculative.verify import verify_drafts


class ModelExecutor:
    def __init__(self, runner: ModelRunner, sampler: Sampler, scheduler: Scheduler) -> None:
        self.runner, self.sampler, self.scheduler = runner, sampler, scheduler
        self._cuda = runner.device.type == "cuda"

    def execute(self, sched: SchedulerOutput) -> ExecutorOutput:
        t1 = time.perf_counter()
        batch = self.runner.prepare(sched)
        t2 = time.perf_counter()
        logits = self.runner.run(batch)
        if self._cuda:
            torch.cuda.synchronize(self.runner.device)
        t3 = time.perf_counter()
        if batch.prompt_spans:
            self._prompt_logprobs(batch.prompt_spans, logits)
            logits = logits[batch.sample_pick]
        by_id = {c.request.request_id: c.request for c in sched.chunks}
        ids = batch.sample_ids
        first = batch.sample_first
        if first is not None:  # drafted sequences have 1 + k rows: round 0 samples each one's first
            all_logits, logits = logits, logits[first]
        if self.scheduler.pending_samples:
            logits, ids = self._with_samples(sched, logits, ids, by_id)
        params = [by_id[r].sampling_params for r in ids]
        contexts = [RowContext(by_id[r].all_token_ids, by_id[r].num_prompt_tokens, by_id[r].matcher)
                    if p.adjusts_logits or by_id[r].matcher is not None else None for r, p in zip(ids, params)]
        tokens, logprobs = self.sampler.sample(logits, ids, params, contexts)
        accepted = accepted_lps = None
        if first is not None:
            accepted, accepted_lps = verify_drafts(self.sampler, all_logits, first, ids, by_id, batch.drafts,
                                                   tokens, logprobs)
        t4 = time.perf_counter()
        return ExecutorOutput(ids, tokens, logprobs, accepted=accepted, accepted_logprobs=accepted_lps,
                              stats=StepStats(prepare=t2 - t1, forward=t3 - t2, sample=t4 - t3))

    @staticmethod
    def _prompt_logprobs(spans: list[tuple], logits: torch.Tensor) -> None:
        """Each prompt row's logits score the prompt token after it (its
        logprob, top-k and rank), filed at that token's position."""
        for req, first, start, n in spans:
            end = start + 1 + n
            req.prompt_logprobs[start + 1:end] = token_logprobs(
                logits[first:first + n].cpu(), req.all_token_ids[start + 1:end],
                req.sampling_params.prompt_logprobs, with_rank=True)
            if end == req.num_prompt_tokens:
                req.prompt_logprobs_done = True

    def _with_samples(self, sched: SchedulerOutput, logits: torch.Tensor, ids: list[str],
                      by_id: dict) -> tuple[torch.Tensor, list[str]]:
        """n > 1: rows for the sequences that fork off a prefill ending now,
        each a copy of its parent's row, sampled with the child's own
        parameters (seed) and constraint; its tokens so far are the prompt."""
        rows, out_ids = list(range(len(ids))), list(ids)
        chunks = {c.request.request_id: c for c in sched.chunks}
        for i, rid in enumerate(ids):
            for child in self.scheduler.samples_of(chunks[rid]):
                by_id[child.request_id] = child
                rows.append(i)
                out_ids.append(child.request_id)
        if len(rows) == len(ids):
            return logits, ids
        return logits[rows], out_ids
