"""Byte sizes on the command line and in tables.

The spec mixes decimal (GB) and binary (GiB) units from one worked example to
the next, so every size here says which it is; nothing is silently rounded.
"""
from __future__ import annotations

import math

_UNITS = {
    "tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10,
    "tb": 10**12, "gb": 10**9, "mb": 10**6, "kb": 10**3, "b": 1,
}


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """'80GiB', '4.5GB', '512MiB', '1e9' or a number -> bytes."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = text.strip().lower().replace("_", "")
        mult = 1
        for unit, m in _UNITS.items():  # longest suffixes first: 'gib' before 'b'
            if s.endswith(unit):
                s, mult = s[: -len(unit)], m
                break
        try:
            value = float(s) * mult
        except ValueError:
            raise ValueError(f"{what} {text!r} is not a size; use e.g. 80GiB, 4.5GB, 512MiB or a byte count") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite size >= 0, got {text!r}")
    return int(round(value))


def parse_seconds(text: str, what: str, high: float = math.inf) -> float:
    """'7s', '7' or '0.5s' -> seconds, > 0 and <= high (NaN refused)."""
    try:
        value = float(text.strip().lower().removesuffix("s"))
    except ValueError:
        raise ValueError(f"{what} must be a time in seconds, as 7 or 7s; got {text!r}") from None
    if not (0 < value <= high):
        raise ValueError(f"{what} must be > 0 s" + (f" and <= {high:g}" if math.isfinite(high) else "")
                         + f", got {text!r}")
    return value


def gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def kib(n: float) -> str:
    return f"{n / 2**10:,.1f} KiB"


def seconds(t: float | None) -> str:
    if t is None:
        return "n/a"
    if t < 1e-3:
        return f"{t * 1e6:.0f} us"
    if t < 1:
        return f"{t * 1e3:.1f} ms"
    return f"{t:.2f} s"
