"""The adapters resident for batched execution: `--max-loras` slots, LRU.

Every adapter the server knows is held in host memory as read
(lora/adapter.py); a step can only run adapters that sit in a slot here. A
slot is a row of stacked matrices per (layer, projection):

    a   [max_loras, max_rank, in]             lora_A, zero-padded past the adapter's rank
    bt  [max_loras, out / 16, max_rank, 16]   lora_B transposed, in panels of 16 outputs
                                              (cpu_kernels.c ts_lora_rows reads them in order)
    rank int32 [max_loras]                    the adapter's r there, 0 where it adapts nothing

and a scale per slot (lora_alpha / r), so one call per projection runs every
row's adapter (lora/rows.py), as Punica's SGMV runs a segment per adapter on
one stacked weight. Each projection has such a stack in float32 and one in
bfloat16, made when first needed: an adapter whose file holds bf16 matrices
runs from the bf16 stack (exactly its values, half the bytes a step reads;
adapters trained on bf16 models are saved so), any other from float32
(float16 too: bf16 would round it). Loading an adapter into a slot copies
its matrices (on a GPU, the host-to-device copy); the step that needs it
waits for that copy only. A slot in use by the step being prepared is never
the one evicted: the scheduler admits at most max_loras distinct adapters
into one step.

On the CPU "resident" and "host" are the same memory; the slots still bound
what one step may mix and are what a GPU build would keep on the device.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from trajserve.config import ModelConfig
from trajserve.lora.adapter import LoRAAdapter
from trajserve.plan.adapters import module_shape

PRECISIONS = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class Stack:
    """One projection's stacked matrices, per precision (absent until an
    adapter of that precision adapts it), and their addresses for the C kernel."""
    fan_in: int
    fan_out: int
    a: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    bt: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    rank: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    ptrs: tuple[int, ...] = (0,) * 6  # a32, bt32, rank32, a16, bt16, rank16 (0: none)


def panels(bt: torch.Tensor) -> torch.Tensor:
    """[r, n] as [ceil(n / 16), r, 16] (zero past n): the stacks' layout of B^T."""
    r, n = bt.shape
    nb = -(-n // 16)
    return torch.nn.functional.pad(bt, (0, nb * 16 - n)).reshape(r, nb, 16).permute(1, 0, 2)


def unpanel(p: torch.Tensor, n: int) -> torch.Tensor:
    """panels' inverse: [nb, r, 16] -> [r, n]."""
    nb, r, _ = p.shape
    return p.permute(1, 0, 2).reshape(r, nb * 16)[:, :n]


class LoRASlots:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, device: torch.device | str = "cpu") -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be >= 1, got {max_loras}, {max_rank}")
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = torch.device(device)
        self.stack: dict[tuple[int, str], Stack] = {}  # made on first use per (layer, module)
        self.scale = torch.zeros(max_loras, dtype=torch.float32, device=self.device)
        self._held: list[LoRAAdapter | None] = [None] * max_loras
        self._lru: OrderedDict[str, int] = OrderedDict()  # adapter digest -> slot, least recent first
        self.num_loads = 0
        self.load_seconds = 0.0
        # The C kernel's description of a group of projections of one input
        # (lora/rows.py), kept across steps; remade when a stack is made.
        self._groups: dict[tuple, tuple[int, tuple | None]] = {}
        self._version = 0

    @staticmethod
    def max_bytes(model: ModelConfig, max_loras: int, max_rank: int) -> int:
        """The most the slots take: every projection adapted at max_rank, in
        both precisions (8.2.1's P_adapter x (4 + 2) B a slot), which the KV
        pool leaves free."""
        from trajserve.plan.adapters import MODULES, adapter_params

        return max_loras * adapter_params(model, max_rank, list(MODULES)) * 6

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

    def _tensors(self, key: tuple[int, str], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        st = self.stack.get(key)
        if st is None:
            st = self.stack[key] = Stack(*module_shape(self.config, key[1]))
        if dtype not in st.a:
            S, r = self.max_loras, self.max_rank
            st.a[dtype] = torch.zeros(S, r, st.fan_in, dtype=dtype, device=self.device)
            st.bt[dtype] = torch.zeros(S, -(-st.fan_out // 16), r, 16, dtype=dtype, device=self.device)
            st.rank[dtype] = torch.zeros(S, dtype=torch.int32, device=self.device)
            st.ptrs = tuple(t[d].data_ptr() if d in t else 0 for d in PRECISIONS for t in (st.a, st.bt, st.rank))
            self._version += 1
        return st.a[dtype], st.bt[dtype], st.rank[dtype]

    def group(self, layer: int, modules: tuple[str, ...]) -> tuple[np.ndarray, list[Stack | None], int, int] | None:
        """For cpu_kernels.c ts_lora_rows: one LoraModule row of int64 words
        per projection (its stacks' addresses and width; the caller fills in
        the output), the stacks, the words' address and the projections'
        input width; None when no slot adapts any of them."""
        got = self._groups.get((layer, modules))
        if got is not None and got[0] == self._version:
            return got[1]
        stacks = [self.stack.get((layer, m)) for m in modules]
        out = None
        if any(st is not None for st in stacks):
            words = np.zeros((len(modules), 9), dtype=np.int64)
            for i, st in enumerate(stacks):
                if st is not None:
                    words[i, :6] = st.ptrs
                    words[i, 6] = st.fan_out
            out = (words, stacks, words.ctypes.data, next(st.fan_in for st in stacks if st is not None))
        self._groups[(layer, modules)] = (self._version, out)
        return out

    def _clear(self, slot: int) -> None:
        for st in self.stack.values():
            for dtype in st.a:
                st.rank[dtype][slot] = 0
                st.a[dtype][slot].zero_()
                st.bt[dtype][slot].zero_()
        self.scale[slot] = 0.0
        self._held[slot] = None

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, over --max-lora-rank {self.max_rank}")
        t0 = time.perf_counter()
        if self._held[slot] is not None:
            self._clear(slot)
        r = adapter.rank
        dtype = adapter.dtype if adapter.dtype in PRECISIONS else torch.float32
        for key, (a, b) in adapter.weights.items():
            sa, sbt, srank = self._tensors(key, dtype)
            sa[slot, :r].copy_(a)  # exact: a bf16 adapter's values were read into float32 exactly
            sbt[slot, :, :r].copy_(panels(b.t()))
            srank[slot] = r
        self.scale[slot] = adapter.scaling
        self._held[slot] = adapter
        self._lru[adapter.digest] = slot
        self.num_loads += 1
        self.load_seconds += time.perf_counter() - t0
