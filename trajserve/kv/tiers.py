"""Lower KV tiers: host memory and disk (spec kv-cache-management "分层辅助存储").

A saved state is a run of full blocks, stored as one tensor per block,
[layers, 2 (K, V), kv_heads, block_size, head_dim] (a latent attention's:
[layers, 1, 1, block_size, its row]), under a key chosen by
the caller (the prefix cache: a block's chained hash; sessions: a counter
of their own). The device pool stays the only place attention reads from:
a reload copies blocks back into freshly allocated device blocks.

Disk blocks are files in the format below: a header that names the model,
the KV layout, the namespace and the block's chained hash, and a checksum
over header and payload. A file is named by a digest of its
key, never by a client string. Reading one back checks it against what the
caller asks for: a file that is damaged (corrupt) or holds another block
(mislabelled: renamed, restored, another engine's) is deleted, counted and
reported missing, never served: its tokens are recomputed instead
(attention state can always be rebuilt from tokens).

The on-disk format of one KV block, and what names it.

A block file is  header | payload.  The header says what the payload is,
in full, so a file read back is checked for being the block that was asked
for, not only for being undamaged (DESIGN.md's invariant: size, checksum and
identity):

    magic "TSKVBLK\\0", format version, header length
    model       16-byte fingerprint of the weights (model/fingerprint.py)
    namespace   16-byte digest of the cache namespace (model id, cache_salt)
    block hash  the block's chained hash (radix_cache.chain_hash: its tokens
                and every token before it, under the namespace)
    dtype, shape  the KV layout [layers, 2 (K, V), kv_heads, block_size, head_dim] (MLA: [layers, 1, 1, ...];
                  a window model's block: its global layers, then its window layers when it carries them)
    payload bytes, then a checksum over the header before it and the payload

Checksum: xxh3-64 (the `xxhash` package). It is 64 bits where CRC-32 is 32,
so a damaged block passes by chance with odds of 2^-64, not 2^-32, and it
ran at 21 GB/s on a 737 KB block here against 2.0 GB/s for zlib.crc32 (and
15.5 for CRC-32C): checking a block costs less than reading it. It guards
against damage, not against an adversary who can write the directory; the
identity fields guard against honest mix-ups (files renamed, restored from a
backup, another engine's blocks), and a mismatch is rejected and counted.

No client string is stored or becomes a file name: namespaces are digests,
file names are digests of the store's own keys (DiskKVStore).
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable

import torch
import xxhash

from trajserve.kv.dir_lock import LOCK_NAME, DirLock

MAGIC = b"TSKVBLK\0"
VERSION = 2
_MAX_DIMS = 6
# magic, version, header bytes, model, namespace, block hash, dtype, ndim, dims
_BODY = struct.Struct(f"<8sHH16s16s16s12sB3x{_MAX_DIMS}IQ")
_SUM = struct.Struct("<Q")
HEADER_BYTES = _BODY.size + _SUM.size

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "uint8": torch.uint8, "int64": torch.int64,  # int64: the tests' token-id stand-in blocks
           # quantized rows (model/kv_quant.py): named, so never confused; "+h32": groups rotated before quantizing,
           # the plain names those of blocks written before (read, and refused as another layout)
           "q8_0+h32": torch.uint8, "q4_0+h32": torch.uint8, "q8_0": torch.uint8, "q4_0": torch.uint8}


def digest(value: bytes | str) -> bytes:
    """16 bytes that name a value (BLAKE2b), for namespaces and file names."""
    return hashlib.blake2b(value.encode() if isinstance(value, str) else value, digest_size=16).digest()


def namespace_digest(namespace: Hashable) -> bytes:
    # The radix cache's own namespace hash: the root of every block's chained hash.
    from trajserve.kv.radix_cache import namespace_hash

    return namespace_hash(namespace)


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """What every block of one engine shares: the model and the KV layout."""
    model: bytes  # 16-byte fingerprint
    dtype: str  # "float32", "bfloat16", ...
    shape: tuple[int, ...]  # one block: [layers, 2, kv_heads, block_size, head_dim] (MLA: [layers, 1, 1, block_size, row])

    @classmethod
    def of(cls, model: bytes, dtype: torch.dtype | str, shape: tuple[int, ...]) -> BlockLayout:
        """dtype: a torch dtype or a pool format's name (q8_0, q4_0: bytes,
        their rows' length the shape's last dimension)."""
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"no disk format for KV dtype {name}")
        if len(shape) > _MAX_DIMS:
            raise ValueError(f"a block has at most {_MAX_DIMS} dimensions, got {shape}")
        return cls(bytes(model)[:16].ljust(16, b"\0"), name, tuple(int(d) for d in shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def payload_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes


@dataclass(frozen=True, slots=True)
class BlockIdentity:
    """Which block a file must hold: its namespace and chained hash."""
    namespace: bytes  # namespace_digest(...)
    block_hash: bytes  # radix_cache.chain_hash(...)


class BlockRejected(Exception):
    """A file that is not the block asked for. kind: "corrupt" (damaged,
    truncated, not a block file) or "mislabelled" (a sound block of another
    identity or layout)."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(f"{kind}: {why}")
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Header:
    layout: BlockLayout
    identity: BlockIdentity
    payload_bytes: int


def encode(layout: BlockLayout, identity: BlockIdentity, payload: bytes) -> bytes:
    """The header for payload (write it, then the payload)."""
    dims = list(layout.shape) + [0] * (_MAX_DIMS - len(layout.shape))
    body = _BODY.pack(MAGIC, VERSION, HEADER_BYTES, layout.model, identity.namespace,
                      identity.block_hash[:16].ljust(16, b"\0"), layout.dtype.encode(), len(layout.shape),
                      *dims, len(payload))
    h = xxhash.xxh3_64(body)
    h.update(payload)
    return body + _SUM.pack(h.intdigest())


def read_header(head: bytes) -> Header:
    """Parse a header (the file's first HEADER_BYTES); BlockRejected if it is none."""
    if len(head) < HEADER_BYTES:
        raise BlockRejected("corrupt", f"{len(head)} bytes, shorter than a header")
    magic, version, hbytes, model, ns, bh, dtype, ndim, *rest = _BODY.unpack_from(head)
    dims, payload = rest[:_MAX_DIMS], rest[_MAX_DIMS]
    if magic != MAGIC:
        raise BlockRejected("corrupt", "not a trajserve block file")
    if version != VERSION or hbytes != HEADER_BYTES:
        raise BlockRejected("mislabelled", f"format version {version}, this engine writes {VERSION}")
    name = dtype.rstrip(b"\0").decode("ascii", "replace")
    if name not in _DTYPES or ndim > _MAX_DIMS:
        raise BlockRejected("corrupt", "unknown dtype or shape")
    layout = BlockLayout(model, name, tuple(dims[:ndim]))
    return Header(layout, BlockIdentity(ns, bh), payload)


def decode(data: bytes, layout: BlockLayout | tuple[BlockLayout, ...], expect: BlockIdentity) -> torch.Tensor:
    """The block in data, if it is exactly the one asked for, in a layout
    the reader takes (one, or several: a window model's block with or
    without its window part); else BlockRejected."""
    layouts = (layout,) if isinstance(layout, BlockLayout) else layout
    head = read_header(data)
    payload = memoryview(data)[HEADER_BYTES:]
    if head.payload_bytes != len(payload):
        raise BlockRejected("corrupt", f"{len(payload)} payload bytes, the header says {head.payload_bytes}")
    h = xxhash.xxh3_64(memoryview(data)[:_BODY.size])
    h.update(payload)
    if _SUM.unpack_from(data, _BODY.size)[0] != h.intdigest():
        raise BlockRejected("corrupt", "checksum mismatch")
    if head.layout not in layouts:
        raise BlockRejected("mislabelled", "another model or KV layout")
    layout = head.layout
    if head.identity != expect:
        raise BlockRejected("mislabelled", "another block (namespace or chained hash)")
    if len(payload) != layout.payload_bytes:
        raise BlockRejected("corrupt", "payload size does not match the layout")
    if not payload:  # a layout of no values (a model whose every layer is a window layer carries none)
        return torch.empty(layout.shape, dtype=layout.torch_dtype)
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw.view(layout.torch_dtype).reshape(layout.shape)


def to_bytes(t: torch.Tensor) -> bytes:
    # Through uint8 so any dtype (bf16 included, which numpy lacks) round-trips bit-exactly.
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


DISK_HEADER_BYTES = HEADER_BYTES  # what a block's file holds beyond its KV bytes
log = logging.getLogger("trajserve")


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

    def in_lru_order(self) -> Iterator[str]:
        """The keys, stored longest ago first (a stored block is never touched in place)."""
        return iter(self._blocks)

    def discard(self, key: str) -> None:
        b = self._blocks.pop(key, None)
        if b is not None:
            self.nbytes -= b.nbytes

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0


class DiskKVStore:
    """One file per block in `directory`, under a byte cap. lock: hold the
    directory's lock file (a --kv-disk-dir; a scratch directory holds its own).
    window_layout: a window model's block that carries its window part (its
    global layers, then its window layers; `layout` has the global ones only):
    the header's shape says which of the two a file holds."""

    def __init__(self, directory: str | os.PathLike, byte_cap: int, layout: BlockLayout,
                 lock: bool = True, window_layout: BlockLayout | None = None) -> None:
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
        self.layouts = (layout,) if window_layout is None else (layout, window_layout)
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
        return HEADER_BYTES + block.nbytes

    def path(self, key: str) -> Path:
        return self.dir / f"{digest(key).hex()}.kv"

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
        layout = next((lay for lay in self.layouts
                       if block.dtype == lay.torch_dtype and tuple(block.shape) == lay.shape), None)
        if layout is None:
            raise ValueError(f"a block of {block.dtype} {tuple(block.shape)} does not fit the store's layouts "
                             f"({', '.join(f'{lay.dtype} {lay.shape}' for lay in self.layouts)})")
        payload = to_bytes(block)
        path = self.path(key)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(encode(layout, ident, payload))
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
            return decode(data, self.layouts, expect)
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
                        head = read_header(f.read(HEADER_BYTES))
                    st = path.stat()
                except (OSError, BlockRejected) as e:
                    why = str(e)
                else:
                    key = key_of(head.identity)
                    if head.layout not in self.layouts:
                        why = "another model or KV layout"
                    elif self.path(key) != path:
                        why = "misnamed"
                        self.num_mislabelled += 1
                    elif st.st_size != head.layout.file_bytes or head.payload_bytes != head.layout.payload_bytes:
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
