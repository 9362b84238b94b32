"""What LLMEngine.invalidate drops: the stale prefix as token ids, and every
cache scope its text reached."""
from __future__ import annotations

from trajserve.kv.scope import CacheScope


def stale_prefix(tokenizer, prefix_tokens: str | list[int] | None) -> list[int] | None:
    """prefix_tokens as token ids (None: a whole namespace), or a ValueError.

    A text prefix is encoded on its own, and its last token may differ from
    the same text's inside a longer prompt (BPE merges across the boundary:
    "cat " alone ends in " ", inside "cat food" it does not). So a text
    prefix drops what follows all but its last token: a little more than
    asked, never less (serving stale KV is the fault to avoid). Token ids
    are matched exactly."""
    if prefix_tokens is None:
        return None
    if isinstance(prefix_tokens, str):
        ids = tokenizer.encode(prefix_tokens)[:-1]  # as add_request encodes text
        if not ids:
            raise ValueError("invalidate: a text prefix needs at least 2 tokens (its last one is uncertain at "
                             "the boundary); pass token ids, or cache_salt alone for a whole namespace")
        return ids
    if not isinstance(prefix_tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prefix_tokens):
        raise ValueError(f"invalidate: prefix_tokens must be text or a list of token ids, "
                         f"got {type(prefix_tokens).__name__}")
    if not prefix_tokens:
        raise ValueError("invalidate: the prefix is empty; to drop a whole namespace pass "
                         "cache_salt alone (prefix_tokens=None)")
    return prefix_tokens


def scopes_of_salt(salt: str | None, lora) -> set[CacheScope]:
    """The salt's scope on the base model and on every adapter its requests
    ran (lora: the engine's LoRAManager or None): KV derived from the same
    text under each."""
    scopes = {CacheScope(salt)}
    if lora is not None:
        scopes.update(sc for used in lora.scopes.values() for sc in used if sc.salt == salt)
    return scopes
