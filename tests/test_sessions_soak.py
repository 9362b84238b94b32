"""Soak test of agent sessions on the real scheduler, KV manager, tiers and
keep policy, with a stand-in model: the next token is a hash of the whole
history, and the "KV" of a slot is the token id written there. Every step
checks that each computed position's slot holds its token, so a state
restored from host or disk into the wrong block, a missed copy, or a cache
hit on stale blocks fails the test at once."""
import random
import time

import torch

from trajserve.config import ModelConfig, SchedulerConfig
from trajserve.engine.request import Request
from trajserve.engine.scheduler import Scheduler
from trajserve.engine.session import SessionManager, SessionState
from trajserve.kv.block_table import blocks_for
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.keep_policy import Decision
from trajserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from trajserve.sampling import SamplingParams

VOCAB = 500


def next_token(history) -> int:
    return hash(tuple(history)) % VOCAB


class TokenRunner:
    """Pool of [blocks, layers=1, 2, heads=1, B, d=1]-shaped slots holding token ids."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.B = block_size
        self.pool = torch.full((num_blocks, 1, 2, 1, block_size, 1), -1.0)

    def run(self, out) -> None:
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
        self.pool[torch.tensor(ids)] = data


class StandInEngine:
    """What SessionManager needs of LLMEngine, over the real control plane."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.model_config = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=8, intermediate_size=8,
                                        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1,
                                        max_position_embeddings=10**6)
        self.dtype = torch.float32
        self.kv = KVCacheManager(num_blocks, block_size, 0.0, enable_prefix_caching=True)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                   max_prefill_chunk=64), self.kv)
        self.runner = TokenRunner(num_blocks, block_size)
        self.reqs: dict[str, Request] = {}
        self.n = 0
        self.tokenizer = None  # the soak test passes token ids only

    def _validate_prompt(self, ids):
        if not ids or blocks_for(len(ids) + 1, self.kv.block_size) > self.kv.num_blocks:
            raise ValueError("prompt does not fit the pool")

    def add_request(self, ids, params, cache_salt=None):
        self._validate_prompt(ids)
        self.n += 1
        r = Request(f"r{self.n}", list(ids), params, max_total_tokens=self.kv.token_capacity, cache_salt=cache_salt)
        self.reqs[r.request_id] = r
        self.scheduler.add(r)
        return r.request_id

    def step(self):
        out = self.scheduler.schedule()
        assert not out.is_empty, "stalled"
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


def test_200_sessions_with_random_pauses_forks_and_closes(tmp_path):
    rng = random.Random(7)
    B = 4
    eng = StandInEngine(num_blocks=96, block_size=B)
    # Host room for ~2 sessions' state: offloads fall back to disk, then drop.
    block_bytes = eng.runner.pool[0].numel() * 4
    mgr = SessionManager(eng, host_bytes=40 * block_bytes, disk_dir=str(tmp_path), disk_bytes=200 * block_bytes)
    preamble = [rng.randrange(VOCAB) for _ in range(24)]
    live: list = []
    opened = pauses = 0
    while opened < 200 or live:
        op = rng.random()
        if opened < 200 and (not live or op < 0.25):
            salt = rng.choice([None, "t2"])
            s = mgr.open(preamble + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))], salt)
            opened += 1
            live.append(s)
            continue
        s = rng.choice(live)
        if s.state is SessionState.PAUSED:
            if rng.random() < 0.15:  # cancelled while its tool ran
                s.close()
                live.remove(s)
                continue
            s.resume([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 10))])
            continue
        if len(s.history) > 120 or (s.turns >= 2 and rng.random() < 0.1):
            s.close()
            live.remove(s)
        elif rng.random() < 0.08 and len(live) < 40:
            live += s.fork(rng.randrange(1, 3))
        elif s.turns and rng.random() < 0.5:
            decision = rng.choice([None, "keep", "host", "disk", "drop"])
            d = s.pause(expected_wait_s=rng.choice([0.01, 1.0, 30.0, 600.0]), tool=rng.choice(["test", "lint"]),
                        decision=decision)
            pauses += 1
            assert d.decision in Decision
            if rng.random() < 0.1:
                s.lease_deadline = time.monotonic() if s.tier is Decision.KEEP else None
                mgr.tick()
        else:
            n = rng.randrange(1, 6)
            before = list(s.history)
            out = s.generate(SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            assert out.outputs[0].token_ids == reference_reply(before, n)
        eng.kv.pool.check()
    st = mgr.metrics()
    assert sum(st["keep_decisions"].values()) == pauses + st["lease_demotions"]
    assert st["sessions"] == 0 and st["host_bytes"] == 0 and st["disk_bytes"] == 0
    assert st["swap_out_bytes"] > 0 and st["swap_in_bytes"] > 0
    assert set(st["keep_decisions"]) >= {"keep", "host", "disk", "drop"}
    assert not eng.kv.tables and not eng.reqs
    eng.kv.clear_cache()
    assert eng.kv.pool.num_free == eng.kv.num_blocks
    eng.kv.pool.check()
