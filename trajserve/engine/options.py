"""The engine's options, declared once. Each row names an EngineConfig field
a user sets, the keyword the Python API takes for it (`LLM(host_cache=...)`),
its command-line flag and help; defaults are the config dataclasses' own.
The CLI's engine argument group (add_engine_args), LLM's keywords
(engine_config) and the bench / serve / simulate commands all read this
table, so an option and its default cannot drift apart between them.
Loads no torch: `trajserve plan --help` builds its parser from here."""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from trajserve.config import (DEADLINE_ADMISSION, KERNEL_PATHS, KV_CACHE_DTYPES, LORA_DTYPES, QUANTIZATIONS,
                              ROPE_SCALINGS, SCHEDULING, SPECULATIVE, TOOL_PROMPTS, CacheConfig, EngineConfig,
                              SchedulerConfig)
from trajserve.units import parse_bytes

_UNSET = object()


@dataclass(frozen=True, slots=True)
class Option:
    name: str                     # the keyword and the argparse dest
    field: str                    # "block_size" on EngineConfig, "cache.block_size" on a part of it
    flag: str
    help: str
    type: Callable | None = None  # argparse's; None with a bool default: an on/off switch
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    size: bool = False            # bytes: '4GiB', '512MB' or a number
    nargs: str | None = None      # argparse's (a list of values)
    default: object = _UNSET      # the keyword's default where it is not the field's (None: "derived")

    def field_default(self):
        part, _, name = self.field.rpartition(".")
        owner = {"": EngineConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}[part]
        f = next(f for f in dataclasses.fields(owner) if f.name == name)
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()

    @property
    def keyword_default(self):
        if self.default is not _UNSET:
            return self.default
        d = self.field_default()
        return None if self.size and not d else d  # a size of 0 (no tier) is "unset" to a user


def _budget(text: str) -> int | str:
    """--max-num-batched-tokens: a count, or auto."""
    return "auto" if text == "auto" else int(text)


OPTIONS: tuple[Option, ...] = (
    Option("model", "model", "--model", "GGUF file or Hugging Face model directory "
           "(default: the embedded SmolLM2-135M-Instruct)"),
    Option("device", "device", "--device", "cpu | cuda | cuda:N"),
    Option("chat_template", "chat_template", "--chat-template",
           "a Jinja chat template (a file, or the template itself) in place of the model's, e.g. one that "
           "renders tools", metavar="FILE_OR_TEXT"),
    Option("tool_prompt", "tool_prompt", "--tool-prompt",
           "for a chat template that renders no tools (SmolLM2's): write a request's tools into the system "
           "message in this form (hermes: JSON signatures in <tools>, calls in <tool_call>); without it such a "
           "template shows no tools, and the server says so in the reply", choices=TOOL_PROMPTS),
    Option("dtype", "dtype", "--dtype", "auto: float32 with the C kernels on a CPU that builds them (else "
           "bfloat16 with AVX-512 BF16/AMX, else float32), bfloat16 on CUDA",
           choices=("auto", "bfloat16", "float32", "float16")),
    Option("quantization", "quantization", "--quantization",
           "weights run in a block format by the C kernels: auto (a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K as stored, "
           "other quantized types as q8_0, float as float), none (dequantize to --dtype), or q8_0/q4_0/q4_1 (the "
           "decoder's matrices quantized at load)", choices=QUANTIZATIONS),
    Option("kv_cache_dtype", "cache.kv_cache_dtype", "--kv-cache-dtype",
           "what the KV pool stores: auto (bfloat16 where the C kernels run prefill attention on AMX tiles, "
           "else as --dtype), float32, bfloat16 (half the bytes; K/V, queries and probabilities rounded to "
           "bf16 in attention), q8_0 or q4_0 (34 / 18 bytes per 32 values, as llama.cpp's --cache-type-k/v: "
           "1.9x / 3.6x the tokens of bf16; each group of 32 rotated before it is quantized, rows dequantized "
           "in attention)", choices=KV_CACHE_DTYPES),
    Option("kv_cache_memory", "cache.kv_cache_memory", "--kv-cache-memory",
           "KV pool budget, e.g. 2GiB (default: --memory-fraction of free memory)", size=True),
    Option("memory_fraction", "cache.memory_fraction", "--memory-fraction",
           "share of the memory free at start-up the KV pool takes, without --kv-cache-memory", type=float),
    Option("num_blocks", "cache.num_blocks", "--num-blocks", "KV pool size in blocks (overrides memory)",
           type=int),
    Option("block_size", "cache.block_size", "--block-size",
           "tokens per KV block (the prefix cache shares whole blocks)", type=int),
    Option("enable_prefix_caching", "cache.enable_prefix_caching", "--no-prefix-caching",
           "disable the radix prefix cache"),
    Option("free_window_blocks", "cache.free_window_blocks", "--no-free-window-blocks",
           "a model with sliding-window layers keeps every layer of every block (by default a block's window "
           "layers' K and V are freed once no query reads them)"),
    Option("watermark", "cache.watermark", "--watermark",
           "below this share of free blocks no new request is admitted, so running decodes keep room to grow "
           "(Pool_headroom, kv-cache-management eq. 7)", type=float),
    Option("host_cache", "cache.host_cache_bytes", "--kv-host-cache",
           "host-memory tier of the prefix cache, e.g. 4GiB: blocks evicted from the KV pool wait there and "
           "load back on a hit (default: none)", metavar="BYTES", size=True),
    Option("disk_cache", "cache.disk_cache_bytes", "--kv-disk-cache",
           "disk tier below it (blocks the host tier pushes out; each file carries its identity and a "
           "checksum)", metavar="BYTES", size=True),
    Option("disk_cache_dir", "cache.disk_cache_dir", "--kv-disk-dir",
           "directory of the disk tier, kept across restarts and locked against a second engine "
           "(default: a temporary one)"),
    Option("max_num_seqs", "scheduler.max_num_seqs", "--max-num-seqs", "sequences running at once", type=int),
    Option("max_num_batched_tokens", "scheduler.max_num_batched_tokens", "--max-num-batched-tokens",
           "token budget per step; auto: each step's budget is what fits in --itl-target-ms (8.2.4's rule, "
           "fitted to this engine's steps), at most 8,192", type=_budget),
    Option("itl_target_ms", "scheduler.itl_target_ms", "--itl-target-ms",
           "the allowed time between a request's tokens: each step takes at most the tokens that fit in it, "
           "up to --max-num-batched-tokens", type=float, metavar="MS"),
    Option("max_prefill_chunk", "scheduler.max_prefill_chunk", "--max-prefill-chunk",
           "per-request chunk cap (default: the token budget, --max-num-batched-tokens)", type=int, default=None),
    Option("admission_ceiling", "scheduler.admission_ceiling", "--admission-ceiling",
           "tau_high: admit while active U_KV stays below it (kv-cache-management, eq. 8); a session's kept "
           "state moves down a tier above it", type=float),
    Option("scheduling", "scheduler.scheduling", "--scheduling",
           "the order of waiting requests and of preemption victims: fcfs (arrival), priority (a request's "
           "priority field, lower first, then arrival) or program (priority, then the least service its "
           "program, a session or conversation, has attained, in levels that double, then the program's "
           "start: short agent programs first)", choices=SCHEDULING),
    Option("program_half_life_s", "scheduler.program_half_life_s", "--program-half-life-s",
           "under --scheduling program: seconds in which a program's attained service halves", type=float),
    Option("deadline_admission", "scheduler.deadline_admission", "--deadline-admission",
           "a request with a deadline (deadline_ms, x-trajserve-deadline-ms) that this engine's fitted step "
           "times predict it would miss: refuse (429 when the load is the cause, 503 when an idle engine "
           "would miss it too), deprioritize (queue it at the lowest priority) or off",
           choices=DEADLINE_ADMISSION),
    Option("deadline_miss_target", "scheduler.deadline_miss_target", "--deadline-miss-target",
           "the share of admitted requests with a deadline allowed to finish late (0.02: a prediction "
           "is multiplied by the 98th percentile of how late this engine's predictions have run)", type=float),
    Option("speculative", "scheduler.speculative", "--speculative",
           "speculative decoding: ngram (drafts from the sequence's own context: prompt lookup), suffix "
           "(also from finished sequences of the same cache_salt) or off; drafts are verified in the batch, "
           "so greedy output is unchanged and sampling keeps the model's distribution. auto: ngram where the "
           "C kernels run (a verified row is the same bits as a decode step), else off",
           choices=SPECULATIVE),
    Option("num_speculative_tokens", "scheduler.num_speculative_tokens", "--num-speculative-tokens",
           "most draft tokens per sequence per step (the length is chosen per step by the measured "
           "acceptance and step cost, 8.5.4)", type=int),
    Option("enable_lora", "enable_lora", "--enable-lora",
           "serve LoRA adapters on the base model (on by itself with --lora-modules or --lora-dir)"),
    Option("lora_modules", "lora_modules", "--lora-modules",
           "PEFT adapters loaded at start, as NAME=DIR; a request picks one by its model field (vLLM's flag)",
           metavar="NAME=DIR", nargs="+"),
    Option("lora_dir", "lora_dir", "--lora-dir",
           "directory whose adapter subdirectories POST /v1/load_lora_adapter may load, by name (no client "
           "path is ever opened)", metavar="DIR"),
    Option("max_loras", "scheduler.max_loras", "--max-loras",
           "adapters resident at once: a step runs at most this many distinct adapters; the rest wait in host "
           "memory and are loaded on demand (LRU)", type=int),
    Option("max_lora_rank", "max_lora_rank", "--max-lora-rank", "largest adapter rank accepted", type=int),
    Option("lora_dtype", "lora_dtype", "--lora-dtype",
           "precision adapters run in: auto = each file's (bf16 files as bf16, others float32, exactly); "
           "bfloat16 rounds float adapters to bf16 (as vLLM runs them in the model's dtype; CPUs with "
           "AVX512-BF16 run bf16 adapters on dot products); float32", choices=LORA_DTYPES),
    Option("max_model_len", "max_model_len", "--max-model-len",
           "context limit, prompt + output (default: the model's, times --rope-factor with --rope-scaling)",
           type=int),
    Option("rope_scaling", "rope_scaling", "--rope-scaling",
           "stretch RoPE past the trained context by --rope-factor (as llama.cpp and vLLM): yarn (long "
           "wavelengths interpolated, short ones kept) or linear (all positions divided); quality past the "
           "trained length is not promised", choices=ROPE_SCALINGS),
    Option("rope_factor", "rope_factor", "--rope-factor",
           "--rope-scaling's factor: the context grows to this many times the trained one", type=float),
    Option("seed", "seed", "--seed", "the engine's seed for requests that give none", type=int),
    Option("num_threads", "num_threads", "--threads", "torch CPU threads (default: torch's)", type=int),
    Option("cpu_kernels", "cpu_kernels", "--no-cpu-kernels",
           "float32 on the CPU: torch ops only, not the C kernels built on first use"),
    Option("kernel_paths_off", "kernel_paths_off", "--kernel-paths-off",
           "leave these paths of the C kernels off although this CPU runs them (for comparisons): amx (bf16 "
           "attention on tiles), amx_kv_quant (q8_0 / q4_0 pools' attention on tiles), amx_int8 (quantized "
           "products on tiles), lora_dp (bf16 adapters on AVX512-BF16), lora (adapters on the kernels at all), "
           "decode_stack (a decode step's layers in one C call)",
           choices=KERNEL_PATHS, nargs="+"),
)
BY_NAME = {o.name: o for o in OPTIONS}


def add_engine_args(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None,
                    defaults: dict | None = None, helps: dict | None = None) -> argparse._ArgumentGroup:
    """The engine's flags, in an "engine" group: all of them, or the rows
    named in `only` (the simulator's engine options), with another command's
    defaults and help where it models another machine."""
    g = p.add_argument_group("engine")
    for o in OPTIONS if only is None else [BY_NAME[n] for n in only]:
        d = (defaults or {}).get(o.name, o.keyword_default)
        o = dataclasses.replace(o, help=(helps or {}).get(o.name, o.help))
        if isinstance(d, bool):  # switches turn a default on off (--no-prefix-caching)
            g.add_argument(o.flag, dest=o.name, action="store_false" if d else "store_true", help=o.help)
        else:
            g.add_argument(o.flag, dest=o.name, default=d, type=o.type, choices=o.choices, metavar=o.metavar,
                           nargs=o.nargs, help=o.help)
    return g


def engine_config(**options) -> EngineConfig:
    """An EngineConfig from the API's keywords (any subset of OPTIONS' names;
    sizes as '4GiB' or bytes). TypeError for a name that is not an option."""
    unknown = sorted(set(options) - BY_NAME.keys())
    if unknown:
        raise TypeError(f"unknown engine option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                        f"the options are {', '.join(BY_NAME)}")
    parts: dict[str, dict] = {"": {}, "cache": {}, "scheduler": {}}
    for o in OPTIONS:
        value = options.get(o.name, o.keyword_default)
        if o.size:  # unset is the field's own default (None: no budget, 0: no tier)
            value = o.field_default() if value is None else parse_bytes(value, f"{o.name} ({o.flag})")
        part, _, name = o.field.rpartition(".")
        parts[part][name] = value
    parts[""]["lora_modules"] = lora_pairs(parts[""]["lora_modules"])
    parts[""]["kernel_paths_off"] = tuple(parts[""]["kernel_paths_off"] or ())
    return EngineConfig(**parts[""], cache=CacheConfig(**parts["cache"]),
                        scheduler=SchedulerConfig(**parts["scheduler"]))


def lora_pairs(value) -> tuple[tuple[str, str], ...]:
    """--lora-modules NAME=DIR ... (or the keyword's {name: dir} or
    [(name, dir)]) as (name, dir) pairs; names are checked by EngineConfig.validate."""
    if not value:
        return ()
    if isinstance(value, dict):
        return tuple((str(k), str(v)) for k, v in value.items())
    out = []
    for item in value:
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules (--lora-modules) takes NAME=DIR pairs, got {item!r}")
            out.append((name, path))
        else:
            name, path = item
            out.append((str(name), str(path)))
    return tuple(out)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of a command line that add_engine_args parsed."""
    return engine_config(**{o.name: getattr(args, o.name) for o in OPTIONS})
