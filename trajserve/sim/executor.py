"""The simulator's executor: what it puts where the engine has its model.

CostModelRunner receives the same SchedulerOutput as the engine's
ModelRunner and, instead of running the model, returns how long the step
would take (sim/cost_model.py); CostModelExecutor is the Executor of
engine/core.py around it, which the simulator's EngineCore steps."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trajserve.engine.core import ExecutorOutput, StepStats
from trajserve.engine.scheduler import SchedulerOutput
from trajserve.plan.flops import causal_pairs
from trajserve.sim.cost_model import CostModel, StepCost


@dataclass(slots=True)
class RunnerStats:
    steps: int = 0
    busy_s: float = 0.0
    compute_bound_steps: int = 0
    compute_s: float = 0.0     # sum over steps of the compute term
    memory_s: float = 0.0      # ... of the memory term
    overhead_s: float = 0.0
    copy_s: float = 0.0
    transfer_s: float = 0.0
    tokens: int = 0
    flops: float = 0.0


class CostModelRunner:
    def __init__(self, cost: CostModel, block_size: int) -> None:
        self.cost = cost
        self.block_size = block_size
        self.stats = RunnerStats()
        self.last = StepCost()
        # Chunks that reached their request's last token in the last step: the
        # rows a model would sample (the simulator gives them their token).
        self.sampled: list = []

    def execute(self, out: SchedulerOutput, transfers: Sequence[tuple[int, str]] = ()) -> float:
        """Seconds the step takes. `transfers`: (blocks, "host" | "nvme") tier
        moves that must finish before the forward (a keep policy's reloads)."""
        n = pairs = kv = 0
        rows = self.sampled = []
        drafted = 0
        for c in out.chunks:
            k, h = c.num_tokens, c.start
            n += k
            pairs += causal_pairs(k, h)
            kv += h + k
            if c.sample:  # chunk reaches the end: its logits are sampled
                rows.append(c)
                drafted += len(c.draft)  # a verified draft: a row of logits per draft token too
        step = self.cost.step(n, pairs, kv, len(out.chunks), len(rows) + drafted, len(out.copies), self.block_size)
        extra = sum(self.cost.transfer_time(b, self.block_size, link) for b, link in transfers)
        st = self.stats
        st.steps += 1
        st.compute_bound_steps += step.compute_bound
        st.compute_s += step.compute_s
        st.memory_s += step.memory_s
        st.overhead_s += step.overhead_s
        st.copy_s += step.copy_s
        st.transfer_s += extra
        st.tokens += n
        st.flops += step.flops
        total = step.total_s + extra
        st.busy_s += total
        self.last = step
        return total


class CostModelExecutor:
    """The simulator's Executor (engine/core.py): the step's duration from the
    cost model, after any KV copy the engine thread is still running (a keep
    policy's saves and reloads, sim/pauses.py), and a token for each sampled
    row: the replayed output where the call has one, else a fresh id (so the
    next turn's prompt, which repeats it, hits the cache as a real one would)."""

    def __init__(self, runner: CostModelRunner, tokens, pauses=None, prefix_tiers=None, drafts=None) -> None:
        self.runner, self.tokens, self.pauses, self.prefix_tiers = runner, tokens, pauses, prefix_tiers
        self.drafts = drafts  # speculation (sim/speculation.py SimDrafts), or None
        self.forced: dict[str, list[int]] = {}  # request id -> the output to replay
        self.now = 0.0      # the clock when the step is scheduled (set by the simulator)
        self.started = 0.0  # when the forward began (after the copies it waited for)

    def execute(self, out: SchedulerOutput) -> ExecutorOutput:
        start, pauses = self.now, self.pauses
        if pauses is not None and pauses.copy_free_at > start:
            # The engine thread is still copying KV between tiers.
            pauses.stats.copy_wait_s += pauses.copy_free_at - start
            start = pauses.copy_free_at
        self.started = start
        tiers = self.prefix_tiers
        step_s = self.runner.execute(out, tiers.transfers() if tiers is not None else ())
        end = start + step_s
        chunks, forced = self.runner.sampled, self.forced
        drafts = self.drafts
        ids = [c.request.request_id for c in chunks]
        stats = StepStats(forward=step_s)  # what the proposer's step cost reads (engine/core.py)
        if not forced and drafts is None:  # the hot path of long replays: one call for every token
            tok = self.tokens.reserve(len(chunks))
            return ExecutorOutput(ids, list(range(tok, tok - len(chunks), -1)), end=end, stats=stats)
        # A drafted chunk's accepted draft tokens come first (sim/speculation.py
        # draws how many), then its last token, like every sampled row's.
        accepted = {c.request.request_id: drafts.draw_accepted(len(c.draft)) for c in chunks if c.draft} \
            if drafts is not None else {}
        fresh, tokens, acc_tokens = self.tokens.fresh_one, [], {}
        for c in chunks:
            req = c.request
            k = accepted.get(req.request_id, 0)
            outs = forced.get(req.request_id) if forced else None
            n = req.num_output_tokens
            new = [outs[n + i] if outs is not None and n + i < len(outs) else fresh() for i in range(k + 1)]
            if k:
                acc_tokens[req.request_id] = new[:k]
            tokens.append(new[k])
        return ExecutorOutput(ids, tokens, end=end, accepted=acc_tokens or None, stats=stats)
