"""LLMEngine: requests in, RequestOutputs out, over one EngineCore.

step(): the step hooks (engine/step_hooks.py: a session manager's housekeeping) around
EngineCore.step (engine/core.py: schedule -> the model executor, engine/model_runner.py ->
update), then engine/output_processor.py turns the sampled tokens into RequestOutputs. This
module builds the pieces (model, KV pool, tiers, scheduler, sampler) from an EngineConfig and
owns the request API: add, fork, abort, validation.

The engine is single-threaded and synchronous; callers (LLM, the server)
add requests and call step() until nothing is left. Only copies of paused
session state run beside it, on the runner's copy engine (kv/copy_engine.py).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from trajserve.config import EngineConfig
from trajserve.engine.core import EngineCore, StepStats
from trajserve.engine.deadline import DeadlineAdmission
from trajserve.engine.dtype import resolve_dtype, resolve_kv_dtype, resolve_quantization
from trajserve.engine.invalidation import scopes_of_salt, stale_prefix
from trajserve.engine.memory import bytes_per_block, num_blocks_for
from trajserve.engine.model_runner import ModelExecutor, ModelRunner, allocate_kv_pool
from trajserve.engine.output_processor import OutputProcessor, RequestGroup
from trajserve.engine.request_checks import RequestChecks
from trajserve.engine.scheduler import Scheduler
from trajserve.engine.startup_line import startup_line
from trajserve.engine.token_budget import ITLBudget
from trajserve.engine.step_hooks import StepHooks
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.copy_engine import LayerPages
from trajserve.kv.cost_rates import CostRates
from trajserve.kv.lower_tiers import LowerTiers
from trajserve.kv.preemption import PreemptionPricer
from trajserve.kv.tiers import BlockLayout
from trajserve.lora.manager import LoRAManager
from trajserve.lora.slots import LoRASlots
from trajserve.model.fingerprint import model_fingerprint
from trajserve.model.llama import LlamaModel
from trajserve.model.loader import default_model_path, load_weights
from trajserve.model.quant import STORED_FORMATS
from trajserve.model.rope import stretched_rope
from trajserve.model.sampler import Sampler
from trajserve.model.tokenizer import IncrementalDetokenizer, load_tokenizer, read_chat_template
from trajserve.outputs import CompletionOutput, RequestOutput
from trajserve.request import Request, RequestStatus, check_priority
from trajserve.sampling import SamplingParams
from trajserve.speculative.proposer import DraftProposer, SpecConfig, resolve_speculative
from trajserve.structured import GrammarCompiler

log = logging.getLogger("trajserve")


class LLMEngine(RequestChecks):
    def __init__(self, config: EngineConfig | None = None, proposer: DraftProposer | None = None,
                 prompt_logits: Callable | None = None) -> None:
        """Resolve what `auto` means here, load the model, build the rest around it: each step reads
        only what the ones before settled. proposer: drafts in place of --speculative's (the tests'
        adversarial ones); prompt_logits: the executor's observer (engine/model_runner.py)."""
        self.config = config = config or EngineConfig()
        config.validate()
        why: dict[str, str] = {}  # each resolved choice's reason, for the start-up line
        self._resolve(config, why)
        self._load(config, why)
        self._build(config, why, proposer, prompt_logits)

    def _resolve(self, config: EngineConfig, why: dict[str, str]) -> None:
        """Device, threads, dtype, quantization, tokenizer and chat template."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        try:
            self.device = torch.device(config.device)
        except RuntimeError:
            raise ValueError(f"device must be cpu or cuda[:N], got {config.device!r}") from None
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {config.device!r}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch sees no CUDA device")
        # Read and compiled before anything loads: a bad template stops start-up with its line.
        template = read_chat_template(config.chat_template) if config.chat_template is not None else None
        self.dtype, why["dtype"] = resolve_dtype(config.dtype, self.device, config.cpu_kernels)
        self.model_path = config.model or default_model_path()
        self.tokenizer = load_tokenizer(self.model_path)
        if template is not None:
            self.tokenizer.chat_template = template
        self.tokenizer.tool_prompt = config.tool_prompt
        self.quantization, why["quantization"] = resolve_quantization(config.quantization, self.dtype,
                                                                      self.device, config.cpu_kernels)

    def _load(self, config: EngineConfig, why: dict[str, str]) -> None:
        """The weights (as stored where the kernels run them) and the model."""
        requantized: dict[str, int] = {}
        self.model_config, weights = load_weights(self.model_path, self.dtype, self.device, self.quantization,
                                                  requantized)
        if requantized:  # said in the start-up line: what did not run as stored
            why["quantization"] += "; quantized at load: " + ", ".join(f"{k} x{n}"
                                                                       for k, n in sorted(requantized.items()))
        if config.rope_scaling is not None:
            trained = self.model_config.max_position_embeddings
            self.model_config = stretched_rope(self.model_config, config.rope_scaling, config.rope_factor)
            why["rope"] = (f"\nRoPE: {config.rope_scaling} x{config.rope_factor:g} (--rope-scaling), context "
                           f"{trained:,} -> {self.model_config.max_position_embeddings:,} tokens: quality past "
                           f"the trained {trained:,} is not promised")
        mc = self.model_config
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            # As vLLM: positions past the trained context would be garbage, not a longer context.
            raise ValueError(f"max_model_len (--max-model-len) {config.max_model_len:,} is over the model's "
                             f"context of {mc.max_position_embeddings:,} tokens (--rope-scaling and --rope-factor "
                             f"stretch it, at a cost in quality)")
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.model = LlamaModel(mc, weights, self.max_model_len, self.dtype, self.device,
                                use_cpu_kernels=config.cpu_kernels, kernel_paths_off=config.kernel_paths_off)
        del weights

    def _build(self, config: EngineConfig, why: dict[str, str], proposer: DraftProposer | None,
               prompt_logits: Callable | None) -> None:
        """The KV pool and its manager, tiers, adapters, runner, scheduler, sampler and the step's core."""
        mc = self.model_config
        cc = config.cache
        # kv_format: what a pool row is (model/kv_quant.py); kv_dtype: the pool tensors' dtype (uint8 for q8_0 / q4_0).
        pools, pool_heads, row = mc.kv_pool_shape  # K and V per KV head, or a latent row
        if mc.mla is not None and cc.kv_cache_dtype not in ("auto", str(self.dtype).removeprefix("torch.")):
            raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) {cc.kv_cache_dtype} is not supported for latent "
                             f"attention ({mc.architecture}: rows of {row} values); supported: auto, the compute dtype")
        self.kv_format, why["kv"] = resolve_kv_dtype(cc.kv_cache_dtype, self.dtype, self.model.kernels,
                                                     row, cc.block_size, mc.num_heads // pool_heads)
        self.kv_dtype = self.kv_format.storage
        lora_bytes = LoRASlots.max_bytes(mc, config.scheduler.max_loras, config.max_lora_rank)  # kept free
        self.num_blocks = num_blocks_for(cc, mc, self.kv_format, self.device, lora_bytes if config.lora_enabled else 0)
        # Window layers' blocks freed as queries leave them (kv/window_pool.py): a page per layer,
        # one K and one V tensor every layer reads through its own page table.
        paged = mc.window is not None and cc.free_window_blocks
        self.kv = KVCacheManager(self.num_blocks, cc.block_size, cc.watermark,
                                 enable_prefix_caching=cc.enable_prefix_caching, model_id=self.model_path,
                                 window=(mc.window.size, mc.num_layers, mc.window.layers) if paged else None)
        self.kv.prefill_chunk_tokens = config.scheduler.max_prefill_chunk  # a window pool's longest sequence
        kv_caches = allocate_kv_pool(1 if paged else mc.num_layers, self.num_blocks * (mc.num_layers if paged else 1),
                                     cc.block_size, pool_heads, row, self.kv_format, self.device, tensors=pools)
        lp = None
        if paged:
            kv_caches = kv_caches * mc.num_layers
            lp = LayerPages(mc.num_layers, self.kv.page_map(), [i for i in range(mc.num_layers)
                                                                 if i not in set(mc.window.layers)])
        self.lora = LoRAManager.from_config(config, mc, self.device) if config.lora_enabled else None  # adapters
        self.runner = ModelRunner(self.model, kv_caches, cc.block_size, self.lora.slots if self.lora else None,
                                  lora_kernels="lora" not in config.kernel_paths_off, lp=lp)
        self.block_bytes = bytes_per_block(mc, cc.block_size, self.kv_format)  # a block's KV, every layer
        # What every block written to disk says it is (kv/tiers.py).
        formats = self.model.weight_formats()
        quantized = sorted(f for f in formats if f in STORED_FORMATS)
        # A stretched RoPE stores other keys: blocks on disk must not pass for the unstretched model's.
        rope = f";rope={config.rope_scaling}x{config.rope_factor:g}" if config.rope_scaling else ""
        fingerprint = model_fingerprint(self.model_path, ",".join(quantized) + rope)
        dims = (pools, pool_heads, cc.block_size, self.kv_format.row_elems(row))
        self.block_layout = BlockLayout.of(fingerprint, self.kv_format.disk_name,
                                           (len(lp.carried) if lp else mc.num_layers, *dims))
        # A window model's block saved with its window part: every layer, the global ones first.
        self.window_layout = BlockLayout.of(fingerprint, self.kv_format.disk_name, (mc.num_layers, *dims)) if lp else None
        self.lower = None
        if (cc.host_cache_bytes or cc.disk_cache_bytes) and cc.enable_prefix_caching:
            self.lower = LowerTiers(self.runner.read_blocks, self.runner.write_blocks, cc.host_cache_bytes,
                                    cc.disk_cache_bytes, cc.disk_cache_dir, layout=self.block_layout,
                                    window_layout=self.window_layout)
            self.kv.attach_lower_tiers(self.lower)
        # What the keep policy and preemption price with; a session manager
        # calibrates it and feeds real prefills and copies in.
        self.rates = CostRates(prefill_tokens_per_s=300.0, host_bytes_per_s=5e9, disk_bytes_per_s=1e9)
        pricer = None
        if self.lower is not None:  # a host tier to swap preempted blocks to
            host, block_bytes = self.lower.host, self.block_bytes
            pricer = PreemptionPricer(self.rates, block_bytes, cc.block_size,
                                      lambda n: n * block_bytes <= host.byte_cap)
        sc = config.scheduler
        self.speculative, why["speculative"] = resolve_speculative(sc.speculative, self.model.kernels is not None)
        if proposer is not None:
            self.speculative, why["speculative"] = proposer.config.method, "a proposer passed to the engine"
        elif self.speculative != "off":
            proposer = DraftProposer(SpecConfig(self.speculative, sc.num_speculative_tokens))
        self.proposer = proposer
        self.scheduler = Scheduler(sc, self.kv, pricer, self.proposer)
        # Requests with a deadline are priced before they queue (engine/deadline.py).
        self.deadlines = DeadlineAdmission(self.scheduler, self.kv, sc.deadline_admission, sc.deadline_miss_target)
        if sc.itl_target_ms is not None:  # each step's budget from the allowed ITL (engine/token_budget.py)
            self.scheduler.budget_rule = ITLBudget(self.scheduler, self.deadlines.steps, sc.itl_target_ms / 1e3,
                                                   self.deadlines.cached)
        self.sampler = Sampler(config.seed)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)  # structured outputs
        self.closed = False  # close(): its copy threads are gone, so no new work
        self.step_hooks = StepHooks()  # a session manager's housekeeping around each step
        # Groups, detokenizers, stop strings, latency samples (output_processor.py). The stop callback
        # holds the scheduler, not the engine: no cycle back to it, so dropping the engine frees its
        # pool at once (a cycle waits for the garbage collector, which large tensors do not prompt).
        finish = self.scheduler.finish
        self.outputs = OutputProcessor(lambda seq: finish(seq, RequestStatus.FINISHED_STOPPED), self.sampler.release)
        self.core = EngineCore(self.scheduler, ModelExecutor(self.runner, self.sampler, self.scheduler, prompt_logits))
        self._ids = itertools.count()
        self.last_step = StepStats()
        self.last_schedule = None  # the last step's SchedulerOutput (None: it ran nothing)
        self.startup_summary = startup_line(self, formats, why)
        log.info(self.startup_summary)

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None, lora=None,
                    priority: int = 0, program: str | None = None, deadline_s: float | None = None) -> str:
        """Validate and queue. Raises ValueError (naming the limit) before
        anything is allocated; requests already in flight are unaffected.
        `lora`: a loaded adapter's name (or LoRAAdapter) to run the request
        with; None for the base model. `priority` (lower first) and `program`
        (the session or conversation it is a call of) order it under
        --scheduling priority / program. `deadline_s`: seconds from now by
        which it must finish; one predicted to miss it raises DeadlineMiss
        (or queues at the lowest priority: --deadline-admission)."""
        if self.closed:
            raise RuntimeError("this engine is closed (LLM.close / LLMEngine.close): make a new one")
        check_priority(priority)
        adapter = self.adapter(lora)
        params = params or SamplingParams()
        self._validate_params(params)
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        self.validate_prompt(ids)
        if params.n > 1:
            self._check_n_fits(len(ids), params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.groups:
            raise ValueError(f"request_id {rid!r} is already in flight")
        seq_ids = [rid] if params.n == 1 else [f"{rid}#{i}" for i in range(params.n)]
        # Sequence ids key block tables: "a#0" of an n>1 request must not meet a request named "a#0".
        clash = next((s for s in seq_ids if s in self.outputs.seq_to_group), None)
        if clash is not None:
            raise ValueError(f"request_id {rid!r}: sequence id {clash!r} is already in flight")
        cap = min(self.max_model_len, self.kv.token_capacity)
        now = time.monotonic()
        matcher = self._matcher(params)  # a constraint that does not compile fails here, before queuing
        seqs = [Request(sid, ids, self._seq_params(params, i), cap,
                        frozenset(self.tokenizer.eos_token_ids), arrival_time=now, cache_salt=cache_salt,
                        matcher=matcher.deep_copy() if matcher is not None and i else matcher, lora=adapter,
                        priority=priority, program=program)
                for i, sid in enumerate(seq_ids)]
        admitted = self.deadlines.admit(seqs[0], deadline_s)  # DeadlineMiss before anything is queued
        for r in seqs:
            r.priority = admitted
        if adapter is not None:
            self.lora.used(rid, adapter, seqs[0].cache_scope, len(ids))
        if params.prompt_logprobs is not None:  # the request's, so its first sequence's only
            seqs[0].prompt_logprobs = [None] * len(ids)
            seqs[0].prompt_logprobs_done = len(ids) == 1
        self.outputs.add(RequestGroup(rid, text, ids, seqs, [CompletionOutput(i) for i in range(params.n)], now,
                                      [0] * params.n,
                                      [IncrementalDetokenizer(self.tokenizer) for _ in range(params.n)]))
        # n > 1: the prompt is prefilled once; its other sequences fork off it then.
        self.scheduler.add(seqs[0], samples=seqs[1:])
        return rid

    def fork(self, request_id: str, n: int = 1, params: SamplingParams | None = None) -> list[str]:
        """Branch an in-flight request into n new requests that continue from
        its tokens so far, sharing its KV blocks copy-on-write (spec
        "通过写时复制分支实现零复制审慎推理"). The parent goes on; each child is
        an ordinary request (its own id, output, abort) whose output starts
        with the parent's tokens so far. `params` default to the parent's; a
        seed is varied per child as for n > 1."""
        group = self.groups.get(request_id)
        if group is None:
            raise ValueError(f"fork: no request {request_id!r} in flight")
        if len(group.seqs) != 1:
            raise ValueError(f"fork: request {request_id!r} has n={len(group.seqs)} sequences; "
                             "fork works on n=1 requests")
        if n < 1:
            raise ValueError(f"fork: n must be >= 1, got {n}")
        parent, pcomp = group.seqs[0], group.completions[0]
        params = params or parent.sampling_params
        self._validate_params(params)
        if params.n != 1:
            raise ValueError(f"fork: child params must have n=1, got n={params.n}")
        now = time.monotonic()
        if params.structured is not None and params.structured == parent.sampling_params.structured:
            matcher = parent.matcher  # copied per child below: at the parent's place in the constraint
        else:
            matcher = self._matcher(params)
            if matcher is not None and not matcher.consume_tokens(pcomp.token_ids):
                raise ValueError("fork: the parent's output so far does not fit the child's structured output")
        children, ids = [], []
        for j in range(n):
            cid = f"{request_id}.fork{next(self._ids)}"
            child = Request(cid, parent.prompt_token_ids, self._seq_params(params, j + 1),
                            parent.max_total_tokens, parent.eos_token_ids, arrival_time=now,
                            cache_salt=parent.cache_salt, priority=parent.priority, program=parent.program,
                            first_token_time=parent.first_token_time,
                            last_token_time=parent.last_token_time,
                            matcher=matcher.deep_copy() if matcher is not None else None, lora=parent.lora)
            if parent.lora is not None:
                self.lora.used(cid, parent.lora, child.cache_scope, 0)
            detok = IncrementalDetokenizer(self.tokenizer)
            detok.extend(pcomp.token_ids)
            comp = CompletionOutput(0, pcomp.text, list(pcomp.token_ids), logprobs=(
                list(pcomp.logprobs) if pcomp.logprobs is not None else None))
            self.outputs.add(RequestGroup(cid, group.prompt, group.prompt_token_ids, [child], [comp], now,
                                          list(group.stop_scan), [detok]))
            children.append(child)
            ids.append(cid)
        self.scheduler.fork(parent, children)
        return ids

    # ------------------------------------------------------------------- LoRA
    def adapter(self, lora):
        """The LoRAAdapter a request names (or a session holds); None: the base model."""
        if lora is not None and self.lora is None:
            raise ValueError("lora: this engine serves no LoRA adapters (start it with --lora-modules, "
                             "--lora-dir or --enable-lora)")
        return None if lora is None else self.lora.resolve(lora)

    def unload_lora(self, name: str) -> int:
        """New requests cannot name it; running ones finish with it; its
        cached KV (every tier) is dropped. Returns the blocks dropped."""
        if self.lora is None:
            self.adapter(name)  # the error: LoRA is off
        _, scopes = self.lora.unload(name)
        return sum(self.kv.invalidate(None, scope) for scope in scopes)

    @staticmethod
    def _seq_params(params: SamplingParams, i: int) -> SamplingParams:
        """Each of n seeded samples draws from its own stream (else all n are
        one sample repeated); sample 0 keeps the seed, so it matches n=1."""
        if i == 0 or params.seed is None:
            return params
        return dataclasses.replace(params, seed=hash((params.seed, i)) & 0x7FFF_FFFF)

    def _matcher(self, params: SamplingParams):
        """The structured output's matcher at the start of the output, or None."""
        return None if params.structured is None else self.grammars.matcher(params.structured)

    def prepare_structured(self, params: SamplingParams) -> None:
        """Compile params' structured output now, from any thread (ValueError if
        it does not compile): add_request then copies the compiled matcher
        instead of compiling on the engine thread, where every other request
        would wait for it."""
        if params.structured is not None:
            self.grammars.compile(params.structured)

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Stop a request and free its blocks. Returns its final output
        (the choices still running end with finish_reason `reason`; those
        already finished keep theirs), or None for an unknown or finished one."""
        group = self.groups.pop(request_id, None)
        if self.lora is not None:
            self.lora.in_flight.pop(request_id, None)
        if group is None:
            return None
        stopped = False
        for comp, s in zip(group.completions, group.seqs):
            if not s.status.finished:
                self.scheduler.finish(s, RequestStatus.FINISHED_ABORTED)
                comp.finish_reason = reason
                stopped = True
            self.outputs.release(s)
        return self.outputs.output(group, True, time.monotonic()) if stopped else None

    def abort_in_flight(self) -> dict[str, RequestOutput | None]:
        """Abort every request that has left the waiting queue (it may have
        been in a step that failed); those still waiting are kept. Returns
        the ids aborted, with their final outputs (stopped choices: "error")."""
        waiting = {s.request_id for s in self.scheduler.waiting}
        ids = [rid for rid, g in self.groups.items()
               if any(s.request_id not in waiting and not s.status.finished for s in g.seqs)]
        return {rid: self.abort_request(rid, "error") for rid in ids}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.groups)

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> execute -> sample -> update, inside the step hooks (engine/step_hooks.py)."""
        return self.step_hooks.around(self._step)

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        rec = self.core.step()
        if rec is None:
            self.last_step, self.last_schedule = StepStats(schedule=time.perf_counter() - t0), None
            return []
        t = time.perf_counter()
        outputs = self.outputs.process(rec.result.ids, rec.result.logprobs, rec.end, rec.result.accepted_logprobs)
        if self.lora is not None and self.lora.in_flight:
            self.lora.finished([o for o in outputs if o.finished])
        rec.stats.update += time.perf_counter() - t
        self.last_step, self.last_schedule = rec.stats, rec.sched  # what ran, for a caller that times steps
        self.deadlines.observe_step(rec.sched.chunks, rec.stats.total)
        for r in rec.finished:
            self.deadlines.observe_finished(r, rec.end)
        return outputs

    @property
    def groups(self) -> dict[str, RequestGroup]:
        """The requests in flight, by id (output_processor.py)."""
        return self.outputs.groups

    def close(self) -> None:
        """Stop the background copy threads: queued disk writes of the prefix
        cache's tiers land, its temporary directory goes (a --kv-disk-dir
        keeps its files, and gets the device and host tiers' blocks first,
        so the next engine on it starts warm). Call once no step runs (the
        server: after its engine thread has stopped)."""
        if self.closed:
            return
        self.closed = True
        if self.lower is not None:
            if self.lower.persistent:
                n = self.lower.persist(self.kv.cached_paths())
                log.info("prefix cache: %d blocks written to the disk tier for the next start", n)
            self.lower.close()
        self.runner.copy.shutdown()

    # ----------------------------------------------------------------- metrics
    def invalidate(self, prefix_tokens: str | list[int] | None = None, cache_salt: str | None = None) -> int:
        """Drop cached state under a token prefix (or, with no prefix, a whole
        salt's namespace), on the base model and every adapter: when a file an
        agent read changes, KV derived from its old text must not be served.
        The prefix ends with the first stale token: the cached paths through
        it lose the block holding that token and everything after it; what
        comes before stays (engine/invalidation.py: a text prefix drops a
        little more). Returns the blocks dropped."""
        ids = stale_prefix(self.tokenizer, prefix_tokens)
        return sum(self.kv.invalidate(ids, scope) for scope in scopes_of_salt(cache_salt, self.lora))

    def metrics(self) -> dict:
        kv = self.kv.stats()
        prefix = self.kv.prefix_stats()
        return {
            "U_KV": self.kv.usage(),
            "U_KV_active": self.kv.active_usage(),
            "H_prefix": self.scheduler.prefix_hit_rate,
            "cached_blocks": prefix.cached_blocks if prefix else 0,
            "evicted_blocks": prefix.evicted_blocks if prefix else 0,
            "num_blocks": kv.num_blocks,
            "free_blocks": kv.free_blocks,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "swap_preemptions": self.scheduler.num_swap_preemptions,
            "cow_copies": kv.cow_copies,
            "admission_ceiling": self.config.scheduler.admission_ceiling,
            "ceiling_waits": self.scheduler.num_ceiling_waits,
            "throttled_forks": self.scheduler.num_throttled_forks,
            "reclaimed_blocks": kv.reclaimed_blocks,
            # Hierarchical prefix cache: blocks LRU moved down, and loaded back on a hit.
            "spilled_blocks": prefix.spilled_blocks if prefix else 0,
            "promoted_blocks": kv.promoted_blocks,
            # Prefix-hit tokens recomputed because a window layer's part was gone (kv/window_parts.py).
            "window_recomputed_tokens": self.kv.num_window_recomputed_tokens,
            "lower_tiers": self.lower.metrics() if self.lower is not None else None,
            "speculative": self.proposer.metrics() if self.proposer is not None else None,
            "lora": self.lora.metrics() if self.lora is not None else None,
            **_percentiles("ttft", self.outputs.ttfts),
            **_percentiles("itl", self.outputs.itls),
        }


def _percentiles(name: str, xs: deque[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 in seconds over the window (None before any sample)."""
    if not xs:
        return {f"{name}_p{q}_s": None for q in (50, 90, 99)}
    v = np.percentile(np.fromiter(xs, float, len(xs)), [50, 90, 99])
    return {f"{name}_p50_s": float(v[0]), f"{name}_p90_s": float(v[1]), f"{name}_p99_s": float(v[2])}
