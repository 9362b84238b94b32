"""LLM: the offline Python API.

    llm = LLM()                                   # embedded SmolLM2-135M
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    outs = llm.chat([{"role": "user", "content": "Hi"}])
    for delta in llm.stream("Once upon a time"): print(delta.outputs[0].delta_text, end="")
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence

from tqdm import tqdm

from trajserve.config import EngineConfig
from trajserve.engine.engine import LLMEngine
from trajserve.engine.options import config_from_args, engine_config
from trajserve.outputs import RequestOutput
from trajserve.sampling import SamplingParams

Prompt = str | list[int]
Messages = list[dict]


class LLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 prompt_logits: Callable | None = None, **options) -> None:
        """LLM(model, **options) with the engine's options as keywords
        (engine/options.py: dtype, num_blocks, block_size, host_cache='4GiB',
        disk_cache, disk_cache_dir, max_model_len, chat_template -- a Jinja
        template's text or a file's path in place of the model's own, ...),
        or LLM(config=EngineConfig(...)). prompt_logits: an observer of the
        prompt rows' logits (engine/model_runner.py ModelExecutor)."""
        if config is None:
            config = engine_config(model=model, **options)
        elif model is not None or options:
            raise TypeError("LLM takes a config or the engine's options as keywords, not both")
        self.engine = LLMEngine(config, prompt_logits=prompt_logits)
        self.tokenizer = self.engine.tokenizer
        self._sessions = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LLM:
        """The LLM of a command line parsed with engine/options.add_engine_args."""
        return cls(config=config_from_args(args))

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Run all prompts to completion in continuous batches; outputs in input order.
        `lora`: a loaded adapter's name for every prompt, or one per prompt
        (None: the base model); they run mixed in the same batches."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params(sampling_params, len(prompts))
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora names for {len(prompts)} prompts")
        # Validate everything before queuing anything: a bad prompt leaves no
        # half-submitted batch behind.
        ids = []
        try:
            for p, sp, ad in zip(prompts, params, loras):
                ids.append(self.engine.add_request(p, sp, lora=ad))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        return self.generate([self.tokenizer.encode_chat(m) for m in messages], sampling_params, use_tqdm, lora)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               lora: str | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput per step with this step's delta_text; other
        queued requests keep being served while the caller iterates."""
        rid = self.engine.add_request(prompt, sampling_params, lora=lora)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)  # no-op when finished; frees blocks if the caller stopped early

    def open_session(self, prompt: Messages | str | list[int], cache_salt: str | None = None,
                     session_id: str | None = None, lora: str | None = None):
        """An agent session (sessions/manager.py): generate a turn, pause for a
        tool (keep / host / disk / drop by the keep policy), resume with the
        observation, fork, close. `lora`: the adapter its turns run."""
        if self._sessions is None:
            from trajserve.sessions.manager import SessionManager

            self._sessions = SessionManager(self.engine)
        return self._sessions.open(prompt, cache_salt, session_id, lora)

    @property
    def sessions(self):
        """The SessionManager (None until the first open_session)."""
        return self._sessions

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter directory under `name` (checked against the base model)."""
        if self.engine.lora is None:
            self.engine.adapter(name)  # the error: LoRA is off
        self.engine.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def close(self) -> None:
        """Close every session and the engine's background threads; the
        sessions' and tiers' temporary directories go now, not when the
        garbage collector finds them. The LLM is not usable afterwards."""
        if self._sessions is not None:
            self._sessions.shutdown()
            self._sessions = None
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm, leave=False)
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            # Leaving early (a step raised, Ctrl-C): this call's requests go,
            # or they would stay in the batch and every later call would meet them.
            for rid in ids:
                if rid not in results:
                    self.engine.abort_request(rid)
        return [results[r] for r in ids]

    @staticmethod
    def _params(sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts")
        return list(sp)
