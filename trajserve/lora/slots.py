"""The adapters resident for batched execution: `--max-loras` slots, LRU.

Every adapter the server knows is held in host memory as read
(lora/adapter.py); a step can only run adapters that sit in a slot here. A
slot is a row of stacked matrices per (layer, projection):

    a[(layer, module)]   [max_loras, max_rank, in]    lora_A, zero-padded past the adapter's rank
    bt[(layer, module)]  [max_loras, max_rank, out]   (s B)^T: lora_B transposed, its scale folded in
    rank[(layer, module)] int32 [max_loras]           the adapter's r there, 0 where it adapts nothing

so one call per projection runs every row's adapter (lora/rows.py), as
Punica's SGMV runs a segment per adapter on one stacked weight. Loading an
adapter into a slot copies its matrices (on a GPU this would be the
host-to-device copy); the step that needs it waits for that copy only. A
slot in use by the step being prepared is never the one evicted: the
scheduler admits at most max_loras distinct adapters into one step.

On the CPU "resident" and "host" are the same memory; the slots still bound
what one step may mix and are what a GPU build would keep on the device.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

import torch

from trajserve.config import ModelConfig
from trajserve.lora.adapter import LoRAAdapter
from trajserve.plan.adapters import MODULES, module_shape


class LoRASlots:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, device: torch.device | str = "cpu") -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be >= 1, got {max_loras}, {max_rank}")
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = torch.device(device)
        # Allocated on first use per (layer, module): an adapter on q and v
        # only never pays for seven projections' stacks.
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.bt: dict[tuple[int, str], torch.Tensor] = {}
        self.rank: dict[tuple[int, str], torch.Tensor] = {}
        self._held: list[LoRAAdapter | None] = [None] * max_loras
        self._lru: OrderedDict[str, int] = OrderedDict()  # adapter digest -> slot, least recent first
        self.num_loads = 0
        self.load_seconds = 0.0

    def slot_of(self, adapter: LoRAAdapter) -> int | None:
        return self._lru.get(adapter.digest)

    @property
    def resident(self) -> list[LoRAAdapter]:
        return [a for a in self._held if a is not None]

    def acquire(self, adapters: Iterable[LoRAAdapter]) -> dict[str, int]:
        """Slots for the adapters of one step (at most max_loras distinct):
        resident ones are touched, missing ones loaded into free or least
        recently used slots not needed by this step. {digest: slot}."""
        need = {a.digest: a for a in adapters}
        if len(need) > self.max_loras:
            raise ValueError(f"a step mixes {len(need)} adapters; at most --max-loras {self.max_loras} fit")
        out = {}
        for digest, adapter in need.items():
            slot = self._lru.get(digest)
            if slot is None:
                slot = self._free_slot(need)
                self._load(slot, adapter)
            self._lru.move_to_end(digest)
            out[digest] = slot
        return out

    def evict(self, adapter: LoRAAdapter) -> None:
        """Empty the adapter's slot (an unload)."""
        slot = self._lru.pop(adapter.digest, None)
        if slot is not None:
            self._clear(slot)

    def _free_slot(self, keep: dict[str, LoRAAdapter]) -> int:
        for s, held in enumerate(self._held):
            if held is None:
                return s
        for digest, s in self._lru.items():  # least recently used first
            if digest not in keep:
                del self._lru[digest]
                return s
        raise AssertionError("no slot free: more adapters than slots in one step")

    def _stacks(self, key: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if key not in self.a:
            fan_in, fan_out = module_shape(self.config, key[1])
            S, r = self.max_loras, self.max_rank
            self.a[key] = torch.zeros(S, r, fan_in, device=self.device)
            self.bt[key] = torch.zeros(S, r, fan_out, device=self.device)
            self.rank[key] = torch.zeros(S, dtype=torch.int32, device=self.device)
        return self.a[key], self.bt[key], self.rank[key]

    def _clear(self, slot: int) -> None:
        for key, rank in self.rank.items():
            rank[slot] = 0
            self.a[key][slot].zero_()
            self.bt[key][slot].zero_()
        self._held[slot] = None

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, over --max-lora-rank {self.max_rank}")
        t0 = time.perf_counter()
        if self._held[slot] is not None:
            self._clear(slot)
        r = adapter.rank
        for key, (a, b) in adapter.weights.items():
            sa, sbt, srank = self._stacks(key)
            sa[slot, :r].copy_(a)
            sbt[slot, :r].copy_((adapter.scaling * b).t())
            srank[slot] = r
        self._held[slot] = adapter
        self._lru[adapter.digest] = slot
        self.num_loads += 1
        self.load_seconds += time.perf_counter() - t0

    def modules(self, layer: int) -> list[str]:
        """The projections of `layer` some slot has ever adapted (in MODULES order)."""
        return [m for m in MODULES if (layer, m) in self.a]
