"""EngineHost: everything of the engine the sessions package uses, written
down. LLMEngine (engine/engine.py) is one; a session manager, its offload and
the start-up calibration touch nothing else of it, so what a session needs
from an engine is read here, not found by reading the manager."""
from __future__ import annotations

from typing import Protocol

from trajserve.config import EngineConfig
from trajserve.engine.step_hooks import StepHooks
from trajserve.kv.tiers import BlockLayout
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.cost_rates import CostRates
from trajserve.kv.lower_tiers import LowerTiers
from trajserve.outputs import RequestOutput
from trajserve.sampling import SamplingParams


class Runner(Protocol):
    """The engine's model runner, as far as saving and loading KV goes."""
    copy: object  # kv/copy_engine.py CopyEngine: saves and loads off the engine thread

    def read_blocks(self, block_ids: list[int]): ...

    def write_blocks(self, block_ids: list[int], data) -> None: ...


class Scheduler(Protocol):
    ceiling_blocks: int  # tau_high in blocks: the pause machine moves kept state above it


class StepStats(Protocol):
    num_seqs: int


class EngineHost(Protocol):
    # What it is
    config: EngineConfig              # the scheduler's admission ceiling
    block_bytes: int                  # a block's KV, every layer: what the keep policy prices
    block_layout: BlockLayout         # a block's bytes, in memory and on disk
    window_layout: BlockLayout | None  # a window model's block with its window part (kv/window_parts.py)
    max_model_len: int
    tokenizer: object                 # encode(): a resumed session's observation

    # Its parts a session works through
    kv: KVCacheManager                # paths, holds, imports, the reclaimer
    runner: Runner                    # block copies
    scheduler: Scheduler
    lower: LowerTiers | None          # the prefix cache's tiers, shared with saved sessions when set
    rates: CostRates                  # measured once, priced by the keep policy and preemption alike
    step_hooks: StepHooks             # the manager's tick around every step
    last_step: StepStats

    # Running a turn
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    cache_salt: str | None = None, lora=None) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None: ...

    def has_unfinished_requests(self) -> bool: ...

    def validate_prompt(self, ids: list[int]) -> None: ...

    def adapter(self, lora): ...

    def invalidate(self, prefix_tokens=None, cache_salt: str | None = None) -> int: ...
