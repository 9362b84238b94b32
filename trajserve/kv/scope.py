"""CacheScope: everything besides the tokens that a request's KV depends on
and the request chooses -- its tenant's cache salt and its LoRA adapter.

A block computed under one scope is never served under another: the KV
manager's namespace is (model, scope), the root of every block's chained
hash, so the radix tree, the host and disk tiers, saved session state and
the cluster's prefix directory all keep scopes apart by construction.

One value names that identity everywhere. The KV manager takes nothing else
(a bare salt, None, a tuple: TypeError), so no caller can look up a LoRA
request's blocks in the base model's namespace by passing only its salt.
(The model and the KV layout are the engine's, not the request's: the
manager and the disk format add them.)
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheScope:
    salt: str | None = None     # the tenant: requests share cached KV only within one salt
    adapter: str | None = None  # the LoRA adapter's weight digest, hex (never its name); None: the base model

    def __post_init__(self) -> None:
        if self.salt is not None and not isinstance(self.salt, str):
            raise TypeError(f"CacheScope.salt must be a str or None, got {type(self.salt).__name__}")
        if self.adapter is not None and not isinstance(self.adapter, str):
            raise TypeError(f"CacheScope.adapter must be the adapter's digest (hex) or None, "
                            f"got {type(self.adapter).__name__}")

    @classmethod
    def of(cls, salt: str | None, lora=None) -> CacheScope:
        """The scope of a request under `salt` running `lora` (an adapter with
        a .digest of its weights, or None for the base model): two versions
        of one adapter's name never share a block."""
        return cls(salt, None if lora is None else lora.digest)


def namespace_of(model_id: Hashable, scope: CacheScope) -> tuple:
    """The radix cache's namespace for scope's blocks of model_id, the root of
    their chained hashes: the KV manager's, and the cluster front end's when
    it hashes a prompt as its replicas will. A bare salt is a TypeError."""
    if type(scope) is not CacheScope:
        raise TypeError(f"the KV cache takes a CacheScope (salt + adapter), got {type(scope).__name__}: "
                        "a bare salt would name the base model's namespace")
    return (model_id, scope)
