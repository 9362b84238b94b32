"""Lower KV tiers: host memory and disk (spec kv-cache-management "分层辅助存储").

A saved state is a run of full blocks, stored as one tensor per block,
[layers, 2 (K, V), kv_heads, block_size, head_dim], under a key chosen by
the caller (a session id and the block's index). The device pool stays the
only place attention reads from: a reload copies blocks back into freshly
allocated device blocks.

Disk blocks are written as  header | payload  where the header holds a magic
number, the payload's byte count and its CRC-32; a block whose file is
short, has another size or fails the checksum is deleted and reported
missing, never served: its tokens are recomputed instead (attention state
can always be rebuilt from tokens).
"""
from __future__ import annotations

import errno
import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

_MAGIC = b"TSKV1\0"
_HEADER = struct.Struct("<6sQI")  # magic, payload bytes, crc32
DISK_HEADER_BYTES = _HEADER.size  # what a block's file holds beyond its KV bytes


class HostKVStore:
    """Blocks in host memory under a byte cap. (On a GPU machine these would
    be pinned buffers for async DMA; here host and device are the same RAM,
    so the tier only models the capacity and the copy.)"""

    def __init__(self, byte_cap: int) -> None:
        self.byte_cap = byte_cap
        self.nbytes = 0
        self._blocks: OrderedDict[str, torch.Tensor] = OrderedDict()

    @property
    def free_bytes(self) -> int:
        return self.byte_cap - self.nbytes

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, key: str, block: torch.Tensor, copy: bool = True) -> bool:
        """copy=False: keep the caller's tensor (it must not change later)."""
        size = block.nbytes
        if key in self._blocks:
            self.discard(key)
        if size > self.free_bytes:
            return False
        self._blocks[key] = block.to("cpu", copy=True) if copy else block
        self.nbytes += size
        return True

    def get(self, key: str) -> torch.Tensor | None:
        return self._blocks.get(key)

    def oldest(self) -> str:
        """The key stored longest ago (LRU order: a stored block is never touched in place)."""
        return next(iter(self._blocks))

    def discard(self, key: str) -> None:
        b = self._blocks.pop(key, None)
        if b is not None:
            self.nbytes -= b.nbytes

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0


class DiskKVStore:
    """One file per block in `directory`, under a byte cap."""

    def __init__(self, directory: str | os.PathLike, byte_cap: int) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not os.access(self.dir, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable")
        except OSError as e:  # a bare errno would not say which flag to fix
            raise ValueError(f"the disk tier's directory {str(directory)!r} cannot be used: "
                             f"{e.strerror or e}") from None
        self.byte_cap = byte_cap
        self.nbytes = 0
        self.num_corrupt = 0
        self._sizes: dict[str, int] = {}
        self._meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

    @property
    def free_bytes(self) -> int:
        return self.byte_cap - self.nbytes

    @property
    def num_blocks(self) -> int:
        return len(self._sizes)

    @staticmethod
    def file_bytes(block: torch.Tensor) -> int:
        """Bytes one block takes on disk (header + payload)."""
        return _HEADER.size + block.nbytes

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.kv"

    def put(self, key: str, block: torch.Tensor) -> bool:
        size = self.file_bytes(block)
        if key in self._sizes:
            self.discard(key)
        if size > self.free_bytes:
            return False
        self.write_file(key, block)
        self.register(key, block)
        return True

    def write_file(self, key: str, block: torch.Tensor) -> None:
        """The I/O half of put, no bookkeeping: a writer thread runs it outside
        the owner's lock, then the owner registers the block."""
        payload = _to_bytes(block)
        tmp = self.path(key).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)))
            f.write(payload)
        os.replace(tmp, self.path(key))  # a crash mid-write never leaves a half block under the real name

    def register(self, key: str, block: torch.Tensor) -> None:
        """The bookkeeping half of put: the file of `block` is on disk under key."""
        size = self.file_bytes(block)
        self._sizes[key] = size
        self._meta[key] = (block.dtype, tuple(block.shape))
        self.nbytes += size

    def get(self, key: str) -> torch.Tensor | None:
        """The block, or None when it is missing or fails its size or
        checksum (then the file is removed and num_corrupt counts it)."""
        meta = self._meta.get(key)
        if meta is None:
            return None
        try:
            data = self.path(key).read_bytes()
        except OSError:
            return self._corrupt(key)
        if len(data) < _HEADER.size:
            return self._corrupt(key)
        magic, n, crc = _HEADER.unpack_from(data)
        payload = data[_HEADER.size:]
        dtype, shape = meta
        expect = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if magic != _MAGIC or n != len(payload) or n != expect or zlib.crc32(payload) != crc:
            return self._corrupt(key)
        return _from_bytes(payload, dtype, shape)

    def discard(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        self._meta.pop(key, None)
        if size is not None:
            self.nbytes -= size
            self.path(key).unlink(missing_ok=True)

    def _corrupt(self, key: str) -> None:
        self.num_corrupt += 1
        self.discard(key)
        return None


def _to_bytes(t: torch.Tensor) -> bytes:
    # Through uint8 so any dtype (bf16 included, which numpy lacks) round-trips bit-exactly.
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _from_bytes(payload: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
