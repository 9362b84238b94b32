"""The extended block table of a paused session: where each block lives.

Spec: kv-cache-management "异步分页换入换出": the memory manager tracks a
trajectory's page frames across tiers with residency tags (TIER_HBM,
TIER_HOST, TIER_NVME); when a copy lands, the entries are remapped to the
new tier and frame ("块表重映射"). Running requests' block tables
(kv/block_table.py) only ever hold device blocks -- attention reads the
device pool and nothing else -- so the tags live here, on the state that
moves: entry i is logical block i of the session's history.

    DEVICE  frame = a physical block id of the device pool
    HOST    frame = a key in the host store
    DISK    frame = a key in the disk store (a file with size + CRC-32)
"""
from __future__ import annotations

import enum
from collections import Counter


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class TieredBlockTable:
    __slots__ = ("tiers", "frames")

    def __init__(self, tier: Tier, frames: list[int | str]) -> None:
        self.tiers = [tier] * len(frames)
        self.frames: list[int | str] = list(frames)

    def __len__(self) -> int:
        return len(self.frames)

    def remap(self, start: int, tier: Tier, frames: list[int | str]) -> None:
        """Entries [start, start + len(frames)) now live in `tier` at `frames`."""
        end = start + len(frames)
        if start < 0 or end > len(self.frames):
            raise IndexError(f"remap [{start}, {end}) outside a table of {len(self.frames)} blocks")
        self.tiers[start:end] = [tier] * len(frames)
        self.frames[start:end] = frames

    def truncate(self, n: int) -> None:
        """Keep the first n entries (the rest were lost: missing or corrupt)."""
        del self.tiers[n:]
        del self.frames[n:]

    def frames_in(self, tier: Tier) -> list[tuple[int, int | str]]:
        """(logical index, frame) of every entry in `tier`."""
        return [(i, f) for i, (t, f) in enumerate(zip(self.tiers, self.frames)) if t is tier]

    def counts(self) -> dict[str, int]:
        c = Counter(t.value for t in self.tiers)
        return {t.value: c.get(t.value, 0) for t in Tier}
