"""A stand-in engine for session tests: the real scheduler, KV manager and
tiers, with a model whose next token is a hash of the whole history and
whose "KV" of a slot is the token id written there. Every step checks that
each computed position's slot holds its token, so a state restored into the
wrong block, a missed copy, or a cache hit on stale blocks fails at once."""
import time

import torch

from trajserve.config import EngineConfig, ModelConfig, SchedulerConfig
from trajserve.engine.engine import StepStats
from trajserve.engine.scheduler import Scheduler
from trajserve.engine.step_hooks import StepHooks
from trajserve.kv.tiers import BlockLayout
from trajserve.kv.block_table import blocks_for
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.copy_engine import CopyEngine
from trajserve.kv.cost_rates import CostRates
from trajserve.model.kv_quant import FORMATS
from trajserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from trajserve.request import Request

VOCAB = 500


def next_token(history) -> int:
    return hash(tuple(history)) % VOCAB


class TokenRunner:
    """Pool of [blocks, layers=1, 2, heads=1, B, d=1]-shaped slots holding token ids."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.B = block_size
        self.pool = torch.full((num_blocks, 1, 2, 1, block_size, 1), -1.0)
        # The real copy engine over views of the pool (one layer: K and V slots).
        self.copy = CopyEngine([(self.pool[:, 0, 0], self.pool[:, 0, 1])])

    def run(self, out) -> None:
        # As the model runner does: a batch reading blocks still loading waits for them.
        for job in self.copy.jobs_for([c.block_ids for c in out.chunks] + [[s for s, _ in out.copies]]):
            job.wait()
        if out.copies:
            src = torch.tensor([s for s, _ in out.copies])
            dst = torch.tensor([d for _, d in out.copies])
            self.pool[dst] = self.pool[src].clone()
        for c in out.chunks:
            toks = c.request.all_token_ids
            for p in range(c.start):  # what attention would read: the cached prefix
                got = self.pool[c.block_ids[p // self.B], 0, 0, 0, p % self.B, 0].item()
                assert got == toks[p], f"{c.request.request_id}: slot of position {p} holds {got}, not {toks[p]}"
            for p in range(c.start, c.end):
                self.pool[c.block_ids[p // self.B], 0, :, 0, p % self.B, 0] = toks[p]

    def read_blocks(self, ids):
        return self.pool[torch.tensor(ids)].clone()

    def write_blocks(self, ids, data):
        self.pool[torch.tensor(ids)] = torch.stack(data) if isinstance(data, list) else data


class StandInEngine:
    """What SessionManager needs of LLMEngine, over the real control plane."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.model_config = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=8, intermediate_size=8,
                                        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1,
                                        max_position_embeddings=10**6)
        self.dtype = self.kv_dtype = torch.float32
        self.kv_format = FORMATS["float32"]
        self.block_layout = BlockLayout.of(b"stand-in", torch.float32, (1, 2, 1, block_size, 1))
        self.block_bytes = self.block_layout.payload_bytes
        self.window_layout = None  # no window layers
        self.kv = KVCacheManager(num_blocks, block_size, 0.0, enable_prefix_caching=True)
        self.lower = None  # no prefix-cache tiers: a session manager brings its own
        self.config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                             max_prefill_chunk=64))
        self.scheduler = Scheduler(self.config.scheduler, self.kv)
        self.last_step = StepStats()
        self.runner = TokenRunner(num_blocks, block_size)
        self.rates = CostRates(prefill_tokens_per_s=300.0, host_bytes_per_s=5e9, disk_bytes_per_s=1e9)
        self.reqs: dict[str, Request] = {}
        self.n = 0
        self.tokenizer = None  # the soak test passes token ids only
        self.step_hooks = StepHooks()

    def validate_prompt(self, ids):
        if not ids or blocks_for(len(ids) + 1, self.kv.block_size) > self.kv.num_blocks:
            raise ValueError("prompt does not fit the pool")

    def adapter(self, lora):
        if lora is not None:
            raise ValueError("the stand-in serves no LoRA adapters")
        return None

    def add_request(self, ids, params, cache_salt=None, lora=None):
        self.adapter(lora)
        self.validate_prompt(ids)
        self.n += 1
        r = Request(f"r{self.n}", list(ids), params, max_total_tokens=self.kv.token_capacity, cache_salt=cache_salt)
        self.reqs[r.request_id] = r
        self.scheduler.add(r)
        return r.request_id

    def has_unfinished_requests(self):
        return self.scheduler.has_unfinished()

    def step(self):
        return self.step_hooks.around(self._step)

    def _step(self):
        out = self.scheduler.schedule()
        self.last_step = StepStats(num_seqs=len(out.chunks))
        if out.is_empty:
            return []  # the session manager drops forced-kept state, or this is a stall
        self.runner.run(out)
        sampled = {c.request.request_id: next_token(c.request.all_token_ids) for c in out.chunks if c.sample}
        done = self.scheduler.update(out, sampled, time.monotonic())
        outs = []
        for r in done:
            del self.reqs[r.request_id]
            outs.append(RequestOutput(r.request_id, None, r.prompt_token_ids,
                                      [CompletionOutput(0, "", r.output_token_ids, r.status.value)], True,
                                      RequestMetrics(0.0, ttft=0.01), num_cached_tokens=r.num_cached_tokens))
        return outs


def reference_reply(history, n):
    h = list(history)
    for _ in range(n):
        h.append(next_token(h))
    return h[len(history):]
