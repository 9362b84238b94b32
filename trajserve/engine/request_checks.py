"""What an engine checks of a request before queuing it: its sampling
parameters against the vocabulary, its prompt against the context and the
pool, n sequences against the pool (a mixin of LLMEngine: it reads the
engine's model config, max_model_len and KV manager)."""
from __future__ import annotations

from trajserve.kv.block_table import blocks_for
from trajserve.sampling import SamplingParams


class RequestChecks:
    def _validate_params(self, params: SamplingParams) -> None:
        params.validate()
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:  # it could never be sampled: a stop that silently never fires
            raise ValueError(f"stop_token_ids token id {bad} is outside the vocabulary [0, {vocab})")

    def validate_prompt(self, ids: list[int]) -> None:
        """ValueError naming the limit for a prompt the engine cannot take
        (empty, a token outside the vocabulary, over the context or the pool)."""
        if not ids:
            raise ValueError("prompt is empty: at least 1 token is required")
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise ValueError(f"prompt token ids must be integers, got {bad!r}")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids):,} tokens; the context limit max_model_len is {self.max_model_len:,} "
                f"(prompt + at least 1 generated token)")
        need = blocks_for(len(ids) + 1, self.kv.block_size) + self.kv.watermark_blocks
        if need > self.kv.sequence_blocks:
            raise ValueError(
                f"prompt has {len(ids):,} tokens, more than the whole KV pool holds: "
                f"{self.kv.sequence_blocks:,} blocks x {self.kv.block_size} tokens = {self.kv.token_capacity:,} "
                f"tokens (less a watermark of {self.kv.watermark_blocks} blocks)")

    def max_tokens_within_pool(self, prompt_len: int, n: int) -> int:
        """The largest max_tokens with which n sequences over a prompt of
        prompt_len tokens fit in the pool at once (they share the prompt's
        full blocks; each has its own tail and output). 0: none fits."""
        B = self.kv.block_size
        shared = prompt_len // B
        # One sequence may grow to the pool's sequence_blocks (a window pool's: past its whole blocks);
        # n of them share whole blocks.
        per_seq = ((self.kv.sequence_blocks if n == 1 else self.kv.num_blocks) - self.kv.watermark_blocks - shared) // n
        return max(0, (shared + per_seq) * B - prompt_len)

    def _check_n_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """n sequences that cannot all be held at once never finish: each
        preempts the others over and over (n=128 x 512 tokens on a 64-block
        pool preempted 249 times in 45 s). Refused up front, naming the limit."""
        cap = min(self.max_model_len, self.kv.token_capacity)
        want = min(params.max_tokens, cap - prompt_len)
        fit = self.max_tokens_within_pool(prompt_len, params.n)
        if want > fit:
            raise ValueError(
                f"n is {params.n}: that many sequences of up to {want:,} new tokens each (max_tokens) over a "
                f"{prompt_len:,}-token prompt need more than the KV pool's {self.kv.num_blocks:,} blocks x "
                f"{self.kv.block_size} tokens at once; with this n, max_tokens can be at most {fit:,}"
                + (" (lower n)" if fit == 0 else ""))
