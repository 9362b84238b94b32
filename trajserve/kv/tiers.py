"""Lower KV tiers: host memory and disk (spec kv-cache-management "分层辅助存储").

A saved state is a run of full blocks, stored as one tensor per block,
[layers, 2 (K, V), kv_heads, block_size, head_dim], under a key chosen by
the caller (the prefix cache: a block's chained hash; sessions: a counter
of their own). The device pool stays the only place attention reads from:
a reload copies blocks back into freshly allocated device blocks.

Disk blocks are files in the format of kv/block_format.py: a header that
names the model, the KV layout, the namespace and the block's chained hash,
and a checksum over header and payload. A file is named by a digest of its
key, never by a client string. Reading one back checks it against what the
caller asks for: a file that is damaged (corrupt) or holds another block
(mislabelled: renamed, restored, another engine's) is deleted, counted and
reported missing, never served: its tokens are recomputed instead
(attention state can always be rebuilt from tokens).
"""
from __future__ import annotations

import errno
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from trajserve.kv import block_format as fmt
from trajserve.kv.block_format import BlockIdentity, BlockLayout, BlockRejected
from trajserve.kv.dir_lock import LOCK_NAME, DirLock

log = logging.getLogger("trajserve")
DISK_HEADER_BYTES = fmt.HEADER_BYTES  # what a block's file holds beyond its KV bytes


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

    def keys(self) -> list[str]:
        return list(self._blocks)

    def oldest(self, skip=()) -> str | None:
        """The key stored longest ago (LRU order: a stored block is never
        touched in place), passing over the keys in `skip`; None if none is left."""
        return next((k for k in self._blocks if k not in skip), None)

    def discard(self, key: str) -> None:
        b = self._blocks.pop(key, None)
        if b is not None:
            self.nbytes -= b.nbytes

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0


class DiskKVStore:
    """One file per block in `directory`, under a byte cap. lock: hold the
    directory's lock file (a --kv-disk-dir; a scratch directory holds its own)."""

    def __init__(self, directory: str | os.PathLike, byte_cap: int, layout: BlockLayout,
                 lock: bool = True) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not os.access(self.dir, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable")
        except OSError as e:  # a bare errno would not say which flag to fix
            raise ValueError(f"the disk tier's directory {str(directory)!r} cannot be used: "
                             f"{e.strerror or e}") from None
        self._dir_lock = DirLock(self.dir) if lock else None
        self.layout = layout
        self.byte_cap = byte_cap
        self.nbytes = 0
        self.num_corrupt = 0  # damaged files rejected on the way back
        self.num_mislabelled = 0  # sound files of another block or layout rejected
        self._sizes: dict[str, int] = {}
        self._idents: dict[str, BlockIdentity] = {}  # what was written under each key

    @property
    def free_bytes(self) -> int:
        return self.byte_cap - self.nbytes

    @property
    def num_blocks(self) -> int:
        return len(self._sizes)

    @property
    def num_rejected(self) -> int:
        return self.num_corrupt + self.num_mislabelled

    @staticmethod
    def file_bytes(block: torch.Tensor) -> int:
        """Bytes one block takes on disk (header + payload)."""
        return fmt.HEADER_BYTES + block.nbytes

    def path(self, key: str) -> Path:
        return self.dir / f"{fmt.digest(key).hex()}.kv"

    def put(self, key: str, block: torch.Tensor, ident: BlockIdentity) -> bool:
        size = self.file_bytes(block)
        if key in self._sizes:
            self.discard(key)
        if size > self.free_bytes:
            return False
        self.write_file(key, block, ident)
        self.register(key, ident, size)
        return True

    def write_file(self, key: str, block: torch.Tensor, ident: BlockIdentity) -> None:
        """The I/O half of put, no bookkeeping: a writer thread runs it outside
        the owner's lock, then the owner registers the block."""
        if block.dtype != self.layout.torch_dtype or tuple(block.shape) != self.layout.shape:
            raise ValueError(f"a block of {block.dtype} {tuple(block.shape)} does not fit the store's layout "
                             f"({self.layout.dtype} {self.layout.shape})")
        payload = fmt.to_bytes(block)
        path = self.path(key)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(fmt.encode(self.layout, ident, payload))
            f.write(payload)
        os.replace(tmp, path)  # a crash mid-write never leaves a half block under the real name

    def register(self, key: str, ident: BlockIdentity, size: int | None = None) -> None:
        """The bookkeeping half of put: the file of the block is on disk under key."""
        size = self.layout.file_bytes if size is None else size
        self._sizes[key] = size
        self._idents[key] = ident
        self.nbytes += size

    def get(self, key: str, expect: BlockIdentity) -> torch.Tensor | None:
        """The block, or None when it is missing, damaged, or not the block
        `expect` names (then the file is removed and counted)."""
        if key not in self._sizes:
            return None
        try:
            data = self.path(key).read_bytes()
        except OSError:
            return self._reject(key, BlockRejected("corrupt", "unreadable"))
        try:
            if self._idents.get(key) != expect:
                raise BlockRejected("mislabelled", "the store wrote another block under this key")
            return fmt.decode(data, self.layout, expect)
        except BlockRejected as e:
            return self._reject(key, e)

    def discard(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        self._idents.pop(key, None)
        if size is not None:
            self.nbytes -= size
            self.path(key).unlink(missing_ok=True)

    def scan(self, key_of: Callable[[BlockIdentity], str]) -> list[tuple[str, BlockIdentity, int, float]]:
        """What a previous engine left in the directory: (key, identity, file
        bytes, mtime) of each block of this layout whose file carries the name
        of its key (key_of: the owner's key for an identity). Headers only:
        the payload's checksum is checked when the block is read. Temporary
        files, blocks of another model, layout or format, and misnamed files
        are removed. Nothing is registered: the owner picks what to keep."""
        found = []
        for path in self.dir.iterdir():
            if path.name.startswith(LOCK_NAME) or not path.is_file() or path.is_symlink():
                continue
            why = None
            if path.suffix != ".kv":
                why = "temporary or foreign"
            else:
                try:
                    with open(path, "rb") as f:
                        head = fmt.read_header(f.read(fmt.HEADER_BYTES))
                    st = path.stat()
                except (OSError, BlockRejected) as e:
                    why = str(e)
                else:
                    key = key_of(head.identity)
                    if head.layout != self.layout:
                        why = "another model or KV layout"
                    elif self.path(key) != path:
                        why = "misnamed"
                        self.num_mislabelled += 1
                    elif st.st_size != self.layout.file_bytes or head.payload_bytes != self.layout.payload_bytes:
                        why = "truncated"
                        self.num_corrupt += 1
                    else:
                        found.append((key, head.identity, st.st_size, st.st_mtime))
            if why is not None:
                log.debug("disk tier: removing %s (%s)", path.name, why)
                path.unlink(missing_ok=True)
        return found

    def release(self) -> None:
        """Let go of the directory's lock (the files stay)."""
        if self._dir_lock is not None:
            self._dir_lock.release()
            self._dir_lock = None

    def _reject(self, key: str, e: BlockRejected) -> None:
        if e.kind == "mislabelled":
            self.num_mislabelled += 1
        else:
            self.num_corrupt += 1
        log.warning("disk tier: rejected a block file (%s); its tokens are recomputed", e)
        self.discard(key)
        return None
