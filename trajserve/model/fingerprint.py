"""A model's identity for KV blocks that outlive the process (the disk tier).

KV state is a function of the weights, so a block written by one model
must never be read by another, even one with the same architecture and
file name (a fine-tune, a requantized file). Hashing every weight at each
start-up would cost seconds per GB; the fingerprint instead hashes each
weight file's size, its first MiB (a GGUF's metadata and tensor table, a
safetensors header) and 16 evenly spread 64 KiB samples of its data, plus
config.json for a Hugging Face directory: two files that differ in any
tensor differ there with near certainty, and the same file under another
path gets the same fingerprint. Files up to 2 MiB are hashed whole.
The same file run in other weight formats (--quantization) computes other
K/V: `variant` names them and enters the hash.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

_HEAD = 1 << 20
_SAMPLES = 16
_SAMPLE = 64 << 10


def _file_into(h, path: Path, named: bool) -> None:
    size = path.stat().st_size
    h.update(f"{path.name if named else ''}:{size}\n".encode())
    with open(path, "rb") as f:
        if size <= 2 * _HEAD:
            h.update(f.read())
            return
        h.update(f.read(_HEAD))
        step = (size - _HEAD) // _SAMPLES
        for i in range(_SAMPLES):
            f.seek(_HEAD + i * step)
            h.update(f.read(_SAMPLE))


def model_fingerprint(path: str | os.PathLike, variant: str = "") -> bytes:
    """16 bytes naming the weights at path (a .gguf file or an HF directory)
    as executed (`variant`: "" for float weights)."""
    p = Path(path)
    h = hashlib.blake2b(digest_size=16)
    if variant:
        h.update(f"variant:{variant}\n".encode())
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix == ".safetensors" or f.name == "config.json")
        for f in files:
            _file_into(h, f, named=True)
    else:
        _file_into(h, p, named=False)
    return h.digest()
