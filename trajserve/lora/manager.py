"""The engine's adapters: names, host copies, slots and per-adapter counts.

    load(name, dir)        the operator's directory (--lora-modules): read, checked, held in host memory
    read_named(name, entry), add(adapter)
                           POST /v1/load_lora_adapter: `entry` must be the name of a subdirectory
                           of --lora-dir as listed there (the client's string is compared with
                           the listing, never joined into a path); read off the engine thread,
                           added on it
    unload(name)           no new request can name it; requests already running finish with the
                           adapter they started with (they hold its weights, so they never get
                           the base model's tokens or another adapter's); its cached KV is dropped
    get(name)              the adapter a request's `model` field names (ValueError naming it)

An adapter's identity is the digest of its files (lora/adapter.py), not its
name: the cache namespace of its requests carries the digest, so a name
unloaded and loaded again with other weights can never hit the old KV, and
two names for the same files share it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from trajserve.config import LORA_NAME, ModelConfig
from trajserve.kv.scope import CacheScope
from trajserve.lora.adapter import AdapterError, LoRAAdapter, load_adapter
from trajserve.lora.slots import LoRASlots


@dataclass(slots=True)
class AdapterCounts:
    """Per adapter, for /metrics and engine.metrics()."""
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0


def check_name(name: object) -> str:
    if not isinstance(name, str) or re.fullmatch(LORA_NAME, name) is None:
        raise AdapterError(f"lora_name must match {LORA_NAME} (letters, digits, '.', '_', '-'; at most 64), "
                           f"got {str(name)[:80]!r}")
    return name


class LoRAManager:
    def __init__(self, model: ModelConfig, max_loras: int, max_rank: int, lora_dir: str | None = None,
                 device="cpu", run_dtype: str = "auto") -> None:
        if model.mla is not None:  # no q/k/v projections for an adapter's q_proj, k_proj, v_proj
            raise ValueError(f"LoRA adapters on a {model.architecture} model are not supported (latent attention); "
                             "serve it without --enable-lora / --lora-modules")
        if model.moe is not None:  # its MLPs are experts: an adapter's gate/up/down have no one place to go
            raise ValueError("LoRA adapters on a mixture-of-experts model are not supported (its MLPs are routed "
                             "experts); serve it without --enable-lora / --lora-modules")
        if model.sandwich_norms:  # its attention and MLP outputs are normed before the residual: not wired
            raise ValueError(f"LoRA adapters on a {model.architecture} model are not supported; serve it without "
                             "--enable-lora / --lora-modules")
        self.model = model
        self.max_rank = max_rank
        self.run_dtype = run_dtype  # --lora-dtype (lora/adapter.py load_adapter)
        self.lora_dir = Path(lora_dir).resolve() if lora_dir else None
        if self.lora_dir is not None and not self.lora_dir.is_dir():
            raise ValueError(f"lora_dir (--lora-dir) {lora_dir!r} is not a directory")
        self.slots = LoRASlots(model, max_loras, max_rank, device)
        self.adapters: dict[str, LoRAAdapter] = {}
        self.counts: dict[str, AdapterCounts] = {}
        # Every cache scope an adapter's requests used (request.py
        # cache_scope): what unload drops from the prefix cache and tiers.
        self.scopes: dict[str, set[CacheScope]] = {}
        self.in_flight: dict[str, LoRAAdapter] = {}  # request id -> its adapter, until it finishes

    @classmethod
    def from_config(cls, config, model: ModelConfig, device) -> LoRAManager:
        """The engine's: EngineConfig's lora fields, --lora-modules loaded."""
        m = cls(model, config.scheduler.max_loras, config.max_lora_rank, config.lora_dir, device, config.lora_dtype)
        for name, path in config.lora_modules:
            m.load(name, path)
        return m

    def summary(self) -> str:
        """The engine's start-up line."""
        return (f"LoRA: {len(self.adapters)} adapters loaded ({', '.join(sorted(self.adapters)) or 'none'}), "
                f"--max-loras {self.slots.max_loras} resident, --max-lora-rank {self.max_rank}, --lora-dtype "
                f"{self.run_dtype} (slots up to "
                f"{LoRASlots.max_bytes(self.model, self.slots.max_loras, self.max_rank) / 2**20:,.0f} MiB, kept out "
                f"of the KV pool)"
                f"{f', --lora-dir {self.lora_dir}' if self.lora_dir else ''}")

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        self._check_free(name)
        return self.add(load_adapter(path, name, self.model, self.max_rank, self.run_dtype))

    def _check_free(self, name: str) -> None:
        check_name(name)
        if name in self.adapters:
            raise AdapterError(f"lora_name {name!r}: an adapter of that name is already loaded; unload it first")

    def read_named(self, name: str, entry: str | None = None) -> LoRAAdapter:
        """Read (not add) an adapter from --lora-dir: the subdirectory listed
        there whose name equals `entry` (default: `name`). Touches no state:
        safe off the engine thread."""
        self._check_free(name)
        if self.lora_dir is None:
            raise AdapterError("loading adapters at run time needs --lora-dir (the directory they are read from)")
        entry = name if entry is None else entry
        listed = {e.name: e for e in os.scandir(self.lora_dir) if e.is_dir(follow_symlinks=False)}
        if not isinstance(entry, str) or entry not in listed:
            raise AdapterError(f"lora_path must name an adapter directory in --lora-dir ({len(listed)} there), "
                               f"got {str(entry)[:80]!r}")
        return load_adapter(Path(listed[entry].path), name, self.model, self.max_rank, self.run_dtype)

    def add(self, adapter: LoRAAdapter) -> LoRAAdapter:
        self._check_free(adapter.name)
        self.adapters[adapter.name] = adapter
        self.counts.setdefault(adapter.name, AdapterCounts())
        return adapter

    def unload(self, name: str) -> tuple[LoRAAdapter, set[CacheScope]]:
        """Forget `name`; returns it and the cache scopes its requests used."""
        adapter = self.get(name)
        del self.adapters[name]
        if not any(a.digest == adapter.digest for a in self.adapters.values()):
            self.slots.evict(adapter)  # a running request reloads it into a slot if it still needs it
            scopes = self.scopes.pop(adapter.digest, set())
        else:
            scopes = set()  # the same files under another name: its cache stays valid
        return adapter, scopes

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise AdapterError(f"no LoRA adapter named {str(name)[:80]!r} (loaded: {loaded})")
        return adapter

    def resolve(self, lora: str | LoRAAdapter) -> LoRAAdapter:
        """A name, or an adapter object still loaded or held by a request in flight."""
        if isinstance(lora, str):
            return self.get(lora)
        if lora.digest not in {a.digest for a in self.adapters.values()} and not any(
                a is lora for a in self.in_flight.values()):
            raise AdapterError(f"lora: adapter {lora.name!r} is not loaded")
        return lora

    def used(self, request_id: str, adapter: LoRAAdapter, scope: CacheScope, prompt_tokens: int) -> None:
        """A request (or a fork: prompt_tokens 0) of `adapter` was queued under `scope`."""
        self.in_flight[request_id] = adapter
        self.scopes.setdefault(adapter.digest, set()).add(scope)
        c = self.counts.setdefault(adapter.name, AdapterCounts())
        c.requests += 1
        c.prompt_tokens += prompt_tokens

    def finished(self, outputs) -> None:
        """Count the finished RequestOutputs of adapters' requests."""
        for out in outputs:
            adapter = self.in_flight.pop(out.request_id, None)
            if adapter is not None:
                c = self.counts.setdefault(adapter.name, AdapterCounts())
                c.cached_tokens += out.num_cached_tokens
                c.generation_tokens += sum(len(o.token_ids) for o in out.outputs)

    def metrics(self) -> dict:
        return {"max_loras": self.slots.max_loras, "max_lora_rank": self.max_rank,
                "loaded": sorted(self.adapters), "resident": [a.name for a in self.slots.resident],
                "slot_loads": self.slots.num_loads, "slot_load_seconds": self.slots.load_seconds,
                "adapters": {n: {"requests": c.requests, "prompt_tokens": c.prompt_tokens,
                                 "cached_tokens": c.cached_tokens, "generation_tokens": c.generation_tokens}
                             for n, c in sorted(self.counts.items())}}
