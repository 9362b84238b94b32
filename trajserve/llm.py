"""LLM: the offline Python API.

    llm = LLM()                                   # embedded SmolLM2-135M
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    outs = llm.chat([{"role": "user", "content": "Hi"}])
    for delta in llm.stream("Once upon a time"): print(delta.outputs[0].delta_text, end="")
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from tqdm import tqdm

from trajserve.config import CacheConfig, EngineConfig, SchedulerConfig
from trajserve.engine.engine import LLMEngine
from trajserve.engine.memory import parse_bytes
from trajserve.model.tokenizer import read_chat_template
from trajserve.outputs import RequestOutput
from trajserve.sampling import SamplingParams

Prompt = str | list[int]
Messages = list[dict]


class LLM:
    def __init__(self, model: str | None = None, *, device: str = "cpu", dtype: str = "auto",
                 kv_cache_memory: str | int | None = None, num_blocks: int | None = None,
                 block_size: int = 16, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 max_prefill_chunk: int | None = None, max_model_len: int | None = None,
                 memory_fraction: float = 0.25, seed: int = 0, num_threads: int | None = None,
                 enable_prefix_caching: bool = True, host_cache: str | int | None = None,
                 disk_cache: str | int | None = None, disk_cache_dir: str | None = None,
                 cpu_kernels: bool = True, chat_template: str | None = None) -> None:
        """chat_template: a Jinja chat template (its text or a file's path)
        in place of the model's own, e.g. one that renders tools."""
        template = read_chat_template(chat_template) if chat_template is not None else None  # before loading
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                            kv_cache_memory=parse_bytes(kv_cache_memory, "kv_cache_memory (--kv-cache-memory)"),
                            memory_fraction=memory_fraction, enable_prefix_caching=enable_prefix_caching,
                            host_cache_bytes=parse_bytes(host_cache, "host_cache (--kv-host-cache)") or 0,
                            disk_cache_bytes=parse_bytes(disk_cache, "disk_cache (--kv-disk-cache)") or 0,
                            disk_cache_dir=disk_cache_dir)
        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_prefill_chunk=max_num_batched_tokens if max_prefill_chunk is None else max_prefill_chunk)
        self.engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype,
                                             max_model_len=max_model_len, seed=seed,
                                             num_threads=num_threads, cpu_kernels=cpu_kernels,
                                             cache=cache, scheduler=sched))
        self.tokenizer = self.engine.tokenizer
        if template is not None:
            self.tokenizer.chat_template = template
        self._sessions = None

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run all prompts to completion in continuous batches; outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params(sampling_params, len(prompts))
        # Validate everything before queuing anything: a bad prompt leaves no
        # half-submitted batch behind.
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(p, sp))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in messages]
        return self.generate([self._encode_chat(p) for p in prompts], sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput per step with this step's delta_text; other
        queued requests keep being served while the caller iterates."""
        rid = self.engine.add_request(prompt, sampling_params)
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
                     session_id: str | None = None):
        """An agent session (engine/session.py): generate a turn, pause for a
        tool (keep / host / disk / drop by the keep policy), resume with the
        observation, fork, close."""
        if self._sessions is None:
            from trajserve.engine.session import SessionManager

            self._sessions = SessionManager(self.engine)
        return self._sessions.open(prompt, cache_salt, session_id)

    @property
    def sessions(self):
        """The SessionManager (None until the first open_session)."""
        return self._sessions

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

    def _encode_chat(self, text: str) -> list[int]:
        # The template already holds any BOS/special tokens as text.
        return self.tokenizer.encode(text, add_special_tokens=False)

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
