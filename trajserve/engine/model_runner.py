"""A SchedulerOutput run on the real model: the engine's Executor (engine/core.py).

    SchedulerOutput ─► ModelRunner.prepare (token layout, slots, copies)
                    ─► ModelRunner.run (LlamaModel.forward over the paged KV)
                    ─► prompt logprobs (rows of prompt tokens that asked for them)
                    ─► Sampler.sample (one row per sampled sequence) ─► ExecutorOutput

ModelRunner owns the KV tensors (one K and one V pool per layer, each
[num_blocks, kv_heads, block_size, head_dim]) and turns the scheduler's
token/block description into flat tensors; the bookkeeping is numpy on the
host, one device copy per tensor per step. ModelExecutor puts the sampler
after it.

A prompt with n > 1 samples is prefilled once: the row that ends its prefill
is sampled once more for each of its other sequences (the scheduler forks
them off it in update), so each draws its own first token from the same logits.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from trajserve.engine.core import ExecutorOutput, StepStats
from trajserve.engine.scheduler import Scheduler, SchedulerOutput
from trajserve.kv.copy_engine import CopyEngine, CopyJob, LayerPages, gather_blocks, scatter_blocks
from trajserve.lora.rows import LoRARows
from trajserve.lora.slots import LoRASlots
from trajserve.model.attention import AttentionMetadata, LayerTables, PrefillSeq
from trajserve.model.llama import LlamaModel
from trajserve.model.sampler import RowContext, Sampler, token_logprobs
from trajserve.speculative.verify import verify_drafts


@dataclass(slots=True)
class PreparedBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows whose logits the forward returns
    sample_ids: list[str]  # request of each sampled row
    # Prompt logprobs: (request, first logits row, first position, rows) per
    # chunk that computes prompt rows of a request asking for them; their
    # logits come first, then the sampled rows' (at sample_pick). None: every
    # returned row is sampled.
    prompt_spans: list[tuple] = field(default_factory=list)
    sample_pick: torch.Tensor | None = None
    copy_src: torch.Tensor | None = None  # copy-on-write: blocks to copy before the forward
    copy_dst: torch.Tensor | None = None
    # Reloads still streaming into blocks this batch reads (kv/copy_engine.py).
    loads: list[CopyJob] = field(default_factory=list)
    # The last layer's attention for the sampled rows alone (row i: sample_rows[i]);
    # None: the whole last layer (every row is sampled).
    sample_meta: AttentionMetadata | None = None
    # Speculation: sample_ids[i]'s rows start at sample_first[i] of the
    # sampled rows (a drafted sequence has 1 + k: one per draft token and
    # the one after); None: one row each.
    sample_first: list[int] | None = None
    drafts: dict[str, list[int]] = field(default_factory=dict)
    lora: LoRARows | None = None  # the adapter of each row, when any row has one


def allocate_kv_pool(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                     head_dim: int, fmt, device, tensors: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K and V per layer, [num_blocks, H_kv, B, row]: fmt a KVFormat
    (model/kv_quant.py; a q8_0 / q4_0 row is bytes) or a float torch dtype.
    tensors=1 (a latent attention's rows, ModelConfig.kv_pool_shape): one
    tensor a layer, standing as both K and V (the same object twice)."""
    from trajserve.model.kv_quant import kv_format

    f = kv_format(fmt) if isinstance(fmt, torch.dtype) else fmt
    shape = (num_blocks, num_kv_heads, block_size, f.row_elems(head_dim))
    out = []
    for _ in range(num_layers):
        k = torch.zeros(shape, dtype=f.storage, device=device)
        out.append((k, k if tensors == 1 else torch.zeros(shape, dtype=f.storage, device=device)))
    return out


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, lora: LoRASlots | None = None, lora_kernels: bool = True,
                 lp: LayerPages | None = None) -> None:
        """lp: where each layer keeps a block (a window model's pages,
        kv/window_pool.py); None: at its id, in the layer's own tensors."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = model.device
        self._in_block = np.arange(block_size)
        self.lp = lp or LayerPages(len(kv_caches))
        # Background device <-> host copies (swaps of paused sessions).
        self.copy = CopyEngine(kv_caches, self.lp)
        self.lora = lora  # the resident adapters (lora/slots.py), when LoRA is on
        self.lora_kernels = lora_kernels  # False: adapters' products as torch matmuls (--kernel-paths-off lora)

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    def prepare(self, out: SchedulerOutput) -> PreparedBatch:
        B = self.block_size
        ids, pos, slots = [], [], []
        sample_rows, sample_ids, pick = [], [], []
        prompt_spans = []
        spans, sampled = [], []  # (first row, rows, context incl. them, block table, decode?)
        row_first, drafts = [], {}
        row = 0
        for c in out.chunks:
            table = np.asarray(c.block_ids, dtype=np.int64)
            p = np.arange(c.start, c.end)
            if c.draft:  # the last known token, then the draft's (rows 1..k verify them)
                ids.append(np.asarray(c.request.all_token_ids[c.start:] + c.draft, dtype=np.int64))
            else:
                ids.append(np.asarray(c.request.all_token_ids[c.start:c.end], dtype=np.int64))
            pos.append(p)
            slots.append(table[p // B] * B + p % B)
            decode = c.num_tokens == 1
            spans.append((row, c.num_tokens, c.end, table, decode))
            row += c.num_tokens
            req = c.request
            if req.prompt_logprobs is not None and not req.prompt_logprobs_done:
                # Prompt logprobs: every row of the chunk goes on through the
                # last layer (a prompt not scored yet is computed from its
                # start, so its chunks lie inside it); each row but the
                # prompt's last scores the token after it.
                first = len(sample_rows)
                sampled.append((first, c.num_tokens, c.end, table, decode))
                prompt_spans.append((req, first, c.start, c.num_tokens - c.sample))
                sample_rows.extend(range(row - c.num_tokens, row))
                if c.sample:
                    pick.append(len(sample_rows) - 1)
                    row_first.append(len(pick) - 1)
                    sample_ids.append(req.request_id)
            elif c.draft:
                # Every row is sampled: row j gives the token after the
                # draft's first j tokens (speculative/verify.py).
                sampled.append((len(sample_rows), c.num_tokens, c.end, table, False))
                row_first.append(len(pick))
                pick.extend(range(len(sample_rows), len(sample_rows) + c.num_tokens))
                sample_rows.extend(range(row - c.num_tokens, row))
                sample_ids.append(req.request_id)
                drafts[req.request_id] = c.draft
            elif c.sample:
                # In the last layer only this row goes on: its query alone,
                # over the same context (computed as it is inside the chunk).
                sampled.append((len(sample_rows), 1, c.end, table, decode))
                row_first.append(len(pick))
                pick.append(len(sample_rows))
                sample_rows.append(row - 1)
                sample_ids.append(req.request_id)

        slots = np.concatenate(slots)
        meta = self._attention_meta(spans)
        meta.slot_block, meta.slot_offset = self._tensor(slots // B), self._tensor(slots % B)
        if meta.layer_pages is not None:
            written = self.lp.pages[slots // B].T
            if (written < 0).any():  # a token written where its layer has no page: the KV manager's bug
                raise AssertionError("a step writes K/V into a block whose window part is gone")
            meta.layer_pages.slot_block = self._tensor(np.ascontiguousarray(written))
        batch = PreparedBatch(self._tensor(np.concatenate(ids)), self._tensor(np.concatenate(pos)), meta,
                              self._tensor(np.asarray(sample_rows, dtype=np.int64)), sample_ids,
                              # every row sampled (a step of decodes only): nothing to leave out
                              sample_meta=self._attention_meta(sampled) if len(sample_rows) < row else None)
        if prompt_spans:
            batch.prompt_spans = prompt_spans
            batch.sample_pick = self._tensor(np.asarray(pick, dtype=np.int64))
        if drafts:
            batch.sample_first, batch.drafts = row_first, drafts
        if self.lora is not None and any(c.request.lora is not None for c in out.chunks):
            batch.lora = self._lora_rows(out, row)
        if out.copies:
            cp = np.asarray(out.copies, dtype=np.int64)
            batch.copy_src, batch.copy_dst = self._tensor(cp[:, 0]), self._tensor(cp[:, 1])
        if self.copy.loading:  # rare: only while a reload streams in
            batch.loads = self.copy.jobs_for([c.block_ids for c in out.chunks] + [[s for s, _ in out.copies]])
        return batch

    def _lora_rows(self, out: SchedulerOutput, num_rows: int) -> LoRARows:
        """Each row's adapter slot (-1: the base model), its adapters loaded
        into slots first (the scheduler put at most max_loras in the step)."""
        slot_of = self.lora.acquire(c.request.lora for c in out.chunks if c.request.lora is not None)
        rows = np.full(num_rows, -1, dtype=np.int32)
        row = 0
        for c in out.chunks:
            if c.request.lora is not None:
                rows[row:row + c.num_tokens] = slot_of[c.request.lora.digest]
            row += c.num_tokens
        return LoRARows(self.lora, self._tensor(rows), self.model.kernels if self.lora_kernels else None)

    def _attention_meta(self, spans: list[tuple]) -> AttentionMetadata:
        """Attention over the pool for query rows (first row, rows, context
        length incl. them, block table, decode?) per sequence; the K/V slots
        are the caller's."""
        B = self.block_size
        dec_rows, dec_ctx, dec_tables = [], [], []
        prefills: list[PrefillSeq] = []
        prefill_tables = []
        for row, n, end, table, decode in spans:
            nb = -(-end // B)
            if decode:
                dec_rows.append(row)
                dec_ctx.append(end)
                dec_tables.append(table[:nb])
            else:
                prefills.append(PrefillSeq(row, n, end, self._tensor(table[:nb])))
                prefill_tables.append(table[:nb])
        meta = AttentionMetadata(slot_block=None, slot_offset=None, decode_rows=None, pair_seq=None,
                                 pair_block=None, pair_mask=None, num_decodes=len(dec_rows), prefills=prefills)
        pages = self.lp.pages
        if pages is not None:  # each layer's pages for these block ids
            meta.layer_pages = LayerTables(None, None, None, [self._pages(pages, t) for t in prefill_tables])
        if dec_rows:
            meta.decode_rows = self._tensor(np.asarray(dec_rows, dtype=np.int64))
            nblocks = np.fromiter((len(t) for t in dec_tables), dtype=np.int64, count=len(dec_tables))
            tables = np.concatenate(dec_tables)
            if self.model.kernels is not None:  # the C kernel reads the tables as they are
                meta.dec_tables = self._tensor(tables)
                if pages is not None:
                    meta.layer_pages.dec_tables = self._pages(pages, tables)
                meta.dec_table_start = self._tensor(np.cumsum(nblocks) - nblocks)
                meta.dec_ctx = self._tensor(np.asarray(dec_ctx, dtype=np.int64))
            else:
                pair_seq = np.repeat(np.arange(len(dec_rows)), nblocks)
                # Position of each pair's first slot = its index within the sequence * B.
                starts = np.concatenate([np.arange(n) for n in nblocks]) * B
                ctx = np.repeat(np.asarray(dec_ctx, dtype=np.int64), nblocks)
                meta.pair_seq = self._tensor(pair_seq)
                meta.pair_block = self._tensor(tables)
                if pages is not None:
                    meta.layer_pages.pair_block = self._pages(pages, tables)
                pos = starts[:, None] + self._in_block[None, :]
                meta.pair_mask = self._tensor(pos < ctx[:, None])
                if self.model.windowed:  # sliding-window layers mask by position too
                    meta.pair_pos, meta.pair_ctx = self._tensor(pos), self._tensor(ctx)
        return meta

    def _pages(self, pages: np.ndarray, block_ids: np.ndarray) -> torch.Tensor:
        """[layers, n]: each layer's pages of these blocks. A block before a
        window layer's window has no page there: page 0 stands in, never
        read (the C kernels skip it, torch's attention masks it out)."""
        return self._tensor(np.ascontiguousarray(np.maximum(pages[block_ids].T, 0)))

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """pool[dst] = pool[src] in every layer. All sources are read before
        any destination is written, so a block freed and reused as a
        destination in the same step still gives its old content."""
        if self.lp.pages is not None:  # one shared K and V: every layer's pages in one copy
            k, v = self.kv_caches[0]
            ps, pd = self.lp.pages[src.cpu().numpy()].ravel(), self.lp.pages[dst.cpu().numpy()].ravel()
            keep = ps >= 0  # a source's window part always exists here (its writer holds it)
            ps, pd = self._tensor(ps[keep]), self._tensor(pd[keep])
            k.index_copy_(0, pd, k.index_select(0, ps))
            v.index_copy_(0, pd, v.index_select(0, ps))
            return
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            if v is not k:
                v.index_copy_(0, dst, v.index_select(0, src))

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor | list[torch.Tensor]:
        """KV of these blocks as [n, layers, 2, kv_heads, block_size, head_dim] on
        the host (for the host and disk tiers); in a window model's pool, a
        list where the blocks that have their window part carry it
        (copy_engine.gather_blocks)."""
        return gather_blocks(self.kv_caches, block_ids, self.lp, self.lp.with_window(block_ids))

    def write_blocks(self, block_ids: list[int], data: torch.Tensor | list[torch.Tensor]) -> None:
        """Inverse of read_blocks: load saved KV into these device blocks
        (a block's window part, where it carries one, into its window pages)."""
        scatter_blocks(self.kv_caches, block_ids, data, self.lp)

    def run(self, batch: PreparedBatch) -> torch.Tensor:
        """Float32 logits [len(batch.sample_rows), vocab]: with prompt spans,
        their rows too (take the sampled ones with batch.sample_pick)."""
        if batch.copy_src is not None:
            for job in batch.loads:  # a copy-on-write source must be whole first
                self.copy.wait_s += job.wait_layer(job.num_layers - 1)
            self.copy_blocks(batch.copy_src, batch.copy_dst)
        return self.model.forward(batch.input_ids, batch.positions, batch.meta, self.kv_caches,
                                  batch.sample_rows, self.copy.layer_barrier(batch.loads), batch.sample_meta,
                                  batch.lora)


class ModelExecutor:
    def __init__(self, runner: ModelRunner, sampler: Sampler, scheduler: Scheduler,
                 prompt_logits: Callable[[list[tuple], torch.Tensor], None] | None = None) -> None:
        """prompt_logits: shown every step's prompt rows (spans as in
        PreparedBatch.prompt_spans, and their float32 logits) before they
        become prompt logprobs: the full distributions bench kv-agreement
        compares."""
        self.runner, self.sampler, self.scheduler = runner, sampler, scheduler
        self.prompt_logits = prompt_logits
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
            if self.prompt_logits is not None:
                self.prompt_logits(batch.prompt_spans, logits)
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
