"""Engine configuration records.

ModelConfig describes the architecture (what eq. 1, kv-cache-management, needs:
L, H_kv, d_head); CacheConfig sizes the paged pool; SchedulerConfig bounds each
step (token budget, chunk cap, watermark).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field


# Fields whose command-line flag is not the field's own name.
FLAGS = {"num_threads": "--threads"}
# --quantization's values (model/quant.py target_format says what each does);
# here because the option table and validation load no torch.
QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0", "q4_1")
# The C kernels' optional paths (model/cpu_kernels.py KernelPaths), "lora":
# adapters' products on the kernels at all (else torch matmuls), and
# "decode_stack": a decode step's layers in one C call (model/decode_stack.py).
KERNEL_PATHS = ("amx", "amx_kv_quant", "amx_int8", "lora_dp", "lora", "decode_stack")
# --kv-cache-dtype's values (engine/dtype.py resolve_kv_dtype says what auto becomes).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "q8_0", "q4_0")
# --rope-scaling's values: stretch a model's RoPE past its trained context (model/rope.py).
ROPE_SCALINGS = ("linear", "yarn")
# --tool-prompt's values: how tools reach a model whose chat template shows none (model/tool_prompt.py).
TOOL_PROMPTS = ("hermes",)
# --scheduling's values: the order of waiting requests and of preemption
# victims (engine/scheduler.py): arrival; priority, then arrival; priority,
# then the program's attained service (engine/attained_service.py).
SCHEDULING = ("fcfs", "priority", "program")
# --deadline-admission's values (engine/deadline.py says what each does).
DEADLINE_ADMISSION = ("refuse", "deprioritize", "off")
# --max-num-batched-tokens auto: the step's budget from --itl-target-ms
# (engine/token_budget.py), at most this many tokens.
AUTO_BUDGET_CEILING = 8192
# A request's priority: lower runs first (vLLM's direction), 0 by default.
PRIORITY_RANGE = (-1000, 1000)
# --speculative's values (engine/engine.py says what auto becomes).
SPECULATIVE = ("auto", "off", "ngram", "suffix")
# An adapter's name (the request's `model` field picks it; a metrics label):
# never a path, a format string or markup.
LORA_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"


LORA_DTYPES = ("auto", "bfloat16", "float32")


@dataclass(frozen=True, slots=True)
class MoESpec:
    """Top-k routed experts in place of the MLP (Qwen3-MoE, OLMoE): a router
    [num_experts, hidden] scores each token, softmax, the top_k experts run
    (each a SiLU MLP of expert_size), weighted by their probabilities
    (renormalised over the chosen when norm_topk_prob). `layers`: the layers
    that route; the others keep a dense MLP of intermediate_size."""
    num_experts: int
    top_k: int
    expert_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]
    shared_size: int = 0  # an always-on shared expert's intermediate size (DeepSeek, Qwen2-MoE)
    # DeepSeek's routers: "softmax" or "sigmoid" scores (V3: plus a learned
    # correction bias that picks the experts but does not weight them); the
    # chosen experts only from the best topk_group of n_group groups
    # (group_score: a group's "max" score (V2) or its best two's sum, "top2"
    # (V3)); the weights times routed_scale.
    # gpt-oss: "topk_softmax", a softmax over the top_k logits only (its router has a bias).
    scoring: str = "softmax"
    score_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    routed_scale: float = 1.0

    @classmethod
    def from_hf(cls, raw: dict, num_layers: int) -> MoESpec | None:
        """Routed experts as a config.json writes them (None: a dense model):
        num_experts (Qwen, OLMoE), num_local_experts (Mixtral, gpt-oss,
        transformers 5), n_routed_experts (DeepSeek, its first_k_dense_replace
        layers dense); Qwen's decoder_sparse_step / mlp_only_layers; experts
        of moe_intermediate_size (OLMoE: intermediate_size); a shared
        expert's size."""
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts") or 0)
        if not experts:
            return None
        top_k = int(raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 1)
        if not 1 <= top_k <= experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={experts}], got {top_k}")
        size = int(raw.get("moe_intermediate_size") or raw.get("intermediate_size") or 0)
        dense, step = set(raw.get("mlp_only_layers") or ()), int(raw.get("decoder_sparse_step") or 1)
        first = int(raw.get("first_k_dense_replace") or 0)
        routed = tuple(i for i in range(num_layers) if i >= first and i not in dense and (i + 1) % step == 0)
        shared = int(raw.get("shared_expert_intermediate_size") or 0) or int(raw.get("n_shared_experts") or 0) * size
        kind = raw.get("model_type")
        if kind == "gpt_oss":
            return cls(experts, top_k, size, False, routed, scoring="topk_softmax")
        if kind not in ("deepseek_v2", "deepseek_v3"):
            return cls(experts, top_k, size, bool(raw.get("norm_topk_prob", False)), routed, shared)
        v3 = kind == "deepseek_v3"
        method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
        if method not in methods:
            raise ValueError(f"unsupported topk_method {method!r} for {kind}; supported: {', '.join(methods)}")
        grouped = v3 or method == "group_limited_greedy"
        n_group, topk_group = (int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)) if grouped else (1, 1)
        if experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"n_group {n_group} must divide the {experts} experts and topk_group {topk_group} "
                             f"be in [1, n_group]")
        # V2's router never renormalises its top_k weights (its norm_topk_prob is unread).
        return cls(experts, top_k, size, v3 and bool(raw.get("norm_topk_prob", False)), routed, shared,
                   "sigmoid" if v3 else "softmax", v3, n_group, topk_group, "top2" if v3 else "max",
                   float(raw.get("routed_scaling_factor") or 1.0))


@dataclass(frozen=True, slots=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek V2/V3): a layer caches, per
    token, one compressed latent of kv_lora_rank values and one RoPE key of
    qk_rope_head_dim shared by every head, instead of per-head K and V;
    queries go through a q_lora_rank bottleneck (0: none). The engine's
    pool keeps that latent and RoPE key as one row (model/mla.py)."""
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0

    @classmethod
    def from_hf(cls, raw: dict) -> MLASpec | None:
        """A config.json's latent attention (None: none), DeepSeek V2 / V3's defaults where it is silent."""
        if not raw.get("kv_lora_rank"):
            return None
        return cls(int(raw["kv_lora_rank"]), int(raw.get("qk_rope_head_dim") or 64),
                   int(raw.get("qk_nope_head_dim") or 128), int(raw.get("v_head_dim") or 128),
                   int(raw.get("q_lora_rank") or 0))

    @property
    def row(self) -> int:
        """Values a token caches per layer: its latent, then its RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class WindowSpec:
    """Sliding-window layers (Gemma 3, gpt-oss, Mistral's and Qwen's
    configs): a query of `layers` attends to the latest `size` tokens (keys
    after its position - size), so those layers need to keep only them; the
    others keep the whole context. rope_theta: the window layers' own RoPE
    base (Gemma 3's local base), None: the model's."""
    size: int
    layers: tuple[int, ...]
    rope_theta: float | None = None

    @classmethod
    def from_hf(cls, raw: dict, num_layers: int) -> WindowSpec | None:
        """The window layers as a config.json writes them (None: none):
        layer_types' "sliding_attention" ones (transformers 5: Gemma 3,
        gpt-oss, Qwen), else Gemma 3's older sliding_window_pattern (each
        pattern-th layer global; 6 where a gemma3_text config omits it), else use_sliding_window (Qwen: the layers
        from max_window_layers on), else Mistral's sliding_window (every
        layer). Gemma 3's window layers' RoPE base: rope_parameters
        ["sliding_attention"] or rope_local_base_freq."""
        size = raw.get("sliding_window")
        types = raw.get("layer_types")
        if types:
            layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        elif raw.get("sliding_window_pattern") or raw.get("model_type") == "gemma3_text":
            n = int(raw.get("sliding_window_pattern") or 6)  # Gemma 3's period where its config leaves it out
            layers = tuple(i for i in range(num_layers) if (i + 1) % n)
        elif raw.get("use_sliding_window"):
            layers = tuple(range(int(raw.get("max_window_layers") or 0), num_layers))
        elif raw.get("model_type") == "mistral" and size:
            layers = tuple(range(num_layers))
        else:
            return None
        if not layers:
            return None
        if not size or int(size) < 1:
            raise ValueError(f"a config with sliding-window layers needs sliding_window >= 1, got {size!r}")
        local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
        theta = local.get("rope_theta") or raw.get("rope_local_base_freq")
        return cls(int(size), layers, float(theta) if theta else None)


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "olmoe" | "gemma3" | "deepseek2" | "gpt_oss"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # RoPE frequency scaling (model/rope.py), or None: {"rope_type": "llama3",
    # "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}, {"rope_type": "linear", "factor"}
    # or {"rope_type": "yarn", "factor", "original_max_position_embeddings",
    # and optionally beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim}.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # Qwen3: RMSNorm on each q and k head before RoPE
    qk_norm_whole: bool = False  # OLMoE: that RMSNorm over all of q's heads together (and all of k's)
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip] after the norm
    moe: MoESpec | None = None  # routed experts (None: a dense MLP in every layer)
    mla: MLASpec | None = None  # latent attention's cache (None: K and V per KV head)
    window: WindowSpec | None = None  # sliding-window layers (None: every layer keeps the whole context)
    # Gemma 3: RMSNorms scale by (1 + w) (folded into w at load); the
    # attention's and the MLP's outputs are normed before their residual adds
    # (pre_feedforward_layernorm feeds the MLP); the embedding is scaled by
    # embed_scale; queries by attn_scale instead of head_dim^-1/2; a GELU
    # (tanh) gate; logits soft-capped as cap * tanh(logits / cap).
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    hidden_act: str = "silu"  # "silu" | "gelu_tanh" | "swiglu_clamp" (gpt-oss: swiglu_alpha, swiglu_limit)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # gpt-oss: each attention head's learned sink, a logit every query's
    # softmax counts in its denominator (self_attn.sinks); its MLPs' projections carry biases.
    attn_sinks: bool = False
    mlp_bias: bool = False
    final_logit_softcap: float | None = None
    name: str = ""

    def shape_summary(self) -> str:
        """The start-up line's words for the architecture."""
        window = f", {len(self.window.layers)} of them sliding windows of {self.window.size:,} tokens" \
            if self.window else ""
        if self.mla is not None:
            m = self.mla
            return (f"{self.architecture}, {self.num_layers} layers, {self.num_heads} heads, latent attention: "
                    f"{m.kv_lora_rank} + {m.qk_rope_head_dim} RoPE values cached a token and layer")
        return (f"{self.architecture}, {self.num_layers} layers, {self.num_heads} q / {self.num_kv_heads} kv heads, "
                f"head_dim {self.head_dim}{window}")

    @property
    def kv_pool_shape(self) -> tuple[int, int, int]:
        """What the pool keeps per token and layer: (tensors, heads, values
        a row): K and V of each KV head, or MLA's one latent row."""
        return (1, 1, self.mla.row) if self.mla is not None else (2, self.num_kv_heads, self.head_dim)

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """m_token = 2 * L * H_kv * d_head * b   (eq. 1, kv-cache-management);
        with MLA, (d_latent + d_rope) * L * b: one latent and one shared RoPE
        key per token and layer (DeepSeek-V3: (512 + 64) * 61 * 2 = 70,272 B).
        A sliding-window layer counts in full here: kv_bytes() holds its cap."""
        if self.mla is not None:
            return (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim) * self.num_layers * elem_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem_bytes

    def kv_bytes(self, tokens: int, elem_bytes: int) -> int:
        """One sequence's KV bytes at `tokens` of context: eq. 1 per layer
        group, a window layer holding min(tokens, window) tokens."""
        full = self.kv_bytes_per_token(elem_bytes) * tokens
        if self.window is None:
            return full
        per_layer = self.kv_bytes_per_token(elem_bytes) // self.num_layers
        return full - per_layer * len(self.window.layers) * max(0, tokens - self.window.size)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # Pool size: an explicit block count wins, else a byte budget, else a
    # fraction of the memory that is free when the engine starts.
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    memory_fraction: float = 0.25
    # Below this share of free blocks a new request is not admitted, so the
    # running decodes keep room to grow (the spec's Pool_headroom, eq. 7).
    watermark: float = 0.01
    # Radix prefix cache: requests sharing a block-aligned prefix (same
    # system prompt, earlier turns) reuse its KV instead of recomputing it.
    enable_prefix_caching: bool = True
    # A model with sliding-window layers: a page per layer, a block's window
    # layers' pages freed once no query reads them (kv/window_pool.py).
    free_window_blocks: bool = True
    # Its lower tiers (hierarchical cache): blocks LRU evicts from the device
    # go to host memory, then disk, and load back on a hit. 0 = no tier.
    host_cache_bytes: int = 0
    disk_cache_bytes: int = 0
    disk_cache_dir: str | None = None  # None: a temporary directory
    # What the pool stores K and V in: auto (bfloat16 where AMX tiles run the
    # prefill attention, else the compute dtype), float32 or bfloat16.
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # token budget per step ("auto": see itl_target_ms)
    # Per-request chunk cap: a long prompt is cut into chunks of at most this
    # many tokens so it cannot hold the whole budget (chunked prefill).
    # None: the token budget (resolved here, the one place).
    max_prefill_chunk: int | None = None
    # Admission ceiling tau_high on U_KV (kv-cache-management "服务遥测动态"):
    # while requests and pinned paused state hold more than this share of
    # the pool, new requests wait in the queue (unless nothing runs) and
    # forks queue instead of branching at once; 1.0 turns it off.
    admission_ceiling: float = 0.88
    # Speculative decoding (trajserve/speculative/): drafts from the
    # sequence's own context (ngram) or also from finished sequences of its
    # cache_salt (suffix), verified in the batch, up to this many draft
    # tokens per sequence per step; auto: ngram where the C kernels run
    # (a verified row is the same bits as a decode step), else off.
    speculative: str = "auto"
    num_speculative_tokens: int = 8
    # LoRA (trajserve/lora/): distinct adapters one step may run (slots).
    max_loras: int = 4
    # The order of the waiting queue, of the step's budget and of preemption
    # victims (SCHEDULING): fcfs; priority (a request's priority, then
    # arrival); program (priority, then the level of the service its
    # program has attained, halving every program_half_life_s, then the
    # program's start: engine/program_precedence.py): the default, as `bench
    # programs` measured it (short agent programs' p99 about half FCFS's,
    # long programs' throughput kept: docs/benchmarks.md).
    scheduling: str = "program"
    program_half_life_s: float = 60.0
    # A request with a deadline predicted to miss it (engine/deadline.py):
    # refuse (DeadlineMiss: 429 / 503), deprioritize (queue it at the lowest
    # priority) or off (admit it as any other).
    deadline_admission: str = "refuse"
    # The share of admitted deadline requests allowed to finish late: the
    # prediction's margin is the (1 - this) quantile of how late predictions ran.
    deadline_miss_target: float = 0.02
    # The allowed inter-token latency: each step's token budget is what fits
    # in it (8.2.4's two-step rule, engine/token_budget.py), at most
    # max_num_batched_tokens; None: max_num_batched_tokens every step.
    itl_target_ms: float | None = None

    def __post_init__(self) -> None:
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"scheduling must be one of {', '.join(SCHEDULING)}, got {self.scheduling!r}")
        if self.deadline_admission not in DEADLINE_ADMISSION:
            raise ValueError(f"deadline_admission must be one of {', '.join(DEADLINE_ADMISSION)}, "
                             f"got {self.deadline_admission!r}")
        if not (isinstance(self.deadline_miss_target, (int, float)) and 0 < self.deadline_miss_target <= 0.5):
            raise ValueError(f"deadline_miss_target must be in (0, 0.5], got {self.deadline_miss_target!r}")
        if self.max_num_batched_tokens == "auto":  # --max-num-batched-tokens auto: the ITL target decides
            if self.itl_target_ms is None:
                raise ValueError("max_num_batched_tokens (--max-num-batched-tokens) auto derives each step's budget "
                                 "from the allowed inter-token latency: give itl_target_ms (--itl-target-ms)")
            object.__setattr__(self, "max_num_batched_tokens", AUTO_BUDGET_CEILING)
        if self.itl_target_ms is not None and not (isinstance(self.itl_target_ms, (int, float))
                                                   and 0 < self.itl_target_ms <= 600_000):
            raise ValueError(f"itl_target_ms (--itl-target-ms) must be a number of milliseconds in (0, 600,000], "
                             f"got {self.itl_target_ms!r}")
        if self.max_prefill_chunk is None:
            object.__setattr__(self, "max_prefill_chunk", self.max_num_batched_tokens)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # None = embedded SmolLM2-135M-Instruct
    device: str = "cpu"
    # A Jinja chat template (its text or a file's path) in place of the model's own.
    chat_template: str | None = None
    # Tools written into the system message for a template that renders none
    # (model/tool_prompt.py); None: such a template shows no tools (and the server says so).
    tool_prompt: str | None = None
    dtype: str = "auto"  # compute + KV dtype: auto | bfloat16 | float32 | float16
    # Weight matrices in a GGUF block format run as stored (model/quant.py
    # target_format): auto | none | q8_0 | q4_0 | q4_1
    quantization: str = "auto"
    max_model_len: int | None = None  # default: the model's context length (times rope_factor when scaled)
    # Stretch RoPE past the trained context (as llama.cpp's --rope-scaling and
    # vLLM's rope_scaling): "linear" or "yarn" by rope_factor; an explicit
    # opt-in, since quality past the trained length is not promised.
    rope_scaling: str | None = None
    rope_factor: float | None = None
    seed: int = 0
    num_threads: int | None = None
    # float32 on the CPU: the C kernels of model/cpu_kernels.c (else torch only)
    cpu_kernels: bool = True
    # Paths of the C kernels left off although this CPU runs them (KERNEL_PATHS):
    # what the comparisons in the benches and tests run beside the default.
    kernel_paths_off: tuple[str, ...] = ()
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # LoRA adapters (trajserve/lora/): on with enable_lora, lora_modules or
    # lora_dir. lora_modules: (name, PEFT directory) pairs loaded at start;
    # lora_dir: the operator's directory /v1/load_lora_adapter loads from
    # (by an entry's name, never a client's path).
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    lora_dir: str | None = None
    max_lora_rank: int = 16
    # The precision adapters run in: "auto" = each file's (bf16 files as
    # bf16, others float32, exactly their values); "bfloat16" rounds float
    # adapters to bf16 (vLLM runs adapters in the model's dtype), which CPUs
    # with AVX512-BF16 run on dot products; "float32" runs every one in float32.
    lora_dtype: str = "auto"

    @property
    def lora_enabled(self) -> bool:
        return bool(self.enable_lora or self.lora_modules or self.lora_dir)

    def validate(self) -> None:
        """ValueError naming the field (and its command-line flag) for a value
        the engine cannot run with: before anything is loaded or allocated
        (a negative chunk cap reached the C kernels; a zero batch budget
        scheduled nothing, for ever)."""
        def check(ok: bool, name: str, want: str, value) -> None:
            if not ok:
                flag = FLAGS.get(name, "--" + name.replace("_", "-"))
                raise ValueError(f"{name} ({flag}) must be {want}, got {value!r}")

        def count(name: str, value, allow_none: bool = False) -> None:
            ok = (allow_none and value is None) or (isinstance(value, int) and not isinstance(value, bool)
                                                    and value >= 1)
            check(ok, name, "an integer >= 1" + (" or unset" if allow_none else ""), value)

        cc, sc = self.cache, self.scheduler
        check(self.quantization in QUANTIZATIONS, "quantization", "one of " + ", ".join(QUANTIZATIONS),
              self.quantization)
        count("max_model_len", self.max_model_len, allow_none=True)
        check(isinstance(self.kernel_paths_off, tuple) and set(self.kernel_paths_off) <= set(KERNEL_PATHS),
              "kernel_paths_off", "a tuple of " + ", ".join(KERNEL_PATHS), self.kernel_paths_off)
        check(self.tool_prompt in (None, *TOOL_PROMPTS), "tool_prompt", "one of " + ", ".join(TOOL_PROMPTS),
              self.tool_prompt)
        check(self.rope_scaling in (None, *ROPE_SCALINGS), "rope_scaling", "one of " + ", ".join(ROPE_SCALINGS),
              self.rope_scaling)
        if self.rope_scaling is not None or self.rope_factor is not None:
            check(isinstance(self.rope_factor, (int, float)) and not isinstance(self.rope_factor, bool)
                  and 1 < self.rope_factor <= 64, "rope_factor", "a number in (1, 64] with --rope-scaling",
                  self.rope_factor)
            check(self.rope_scaling is not None, "rope_scaling", "linear or yarn with --rope-factor",
                  self.rope_scaling)
        count("num_threads", self.num_threads, allow_none=True)
        count("block_size", cc.block_size)
        check(cc.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", "one of " + ", ".join(KV_CACHE_DTYPES),
              cc.kv_cache_dtype)
        count("num_blocks", cc.num_blocks, allow_none=True)
        check(cc.kv_cache_memory is None or cc.kv_cache_memory > 0, "kv_cache_memory", "a size > 0",
              cc.kv_cache_memory)
        check(isinstance(cc.memory_fraction, (int, float)) and 0 < cc.memory_fraction <= 1, "memory_fraction",
              "in (0, 1]", cc.memory_fraction)
        check(0 <= cc.watermark < 1, "watermark", "in [0, 1)", cc.watermark)
        check(cc.host_cache_bytes >= 0, "kv_host_cache", "a size >= 0", cc.host_cache_bytes)
        check(cc.disk_cache_bytes >= 0, "kv_disk_cache", "a size >= 0", cc.disk_cache_bytes)
        if (cc.host_cache_bytes or cc.disk_cache_bytes) and not cc.enable_prefix_caching:
            # Accepted, the tiers would be silently absent (the engine builds them under the cache).
            raise ValueError("kv_host_cache / kv_disk_cache (--kv-host-cache / --kv-disk-cache) are tiers under "
                             "the prefix cache, which enable_prefix_caching=False (--no-prefix-caching) turns off: "
                             "drop one or the other")
        count("max_num_seqs", sc.max_num_seqs)
        count("max_num_batched_tokens", sc.max_num_batched_tokens)
        count("max_prefill_chunk", sc.max_prefill_chunk)
        check(0 < sc.admission_ceiling <= 1, "admission_ceiling", "in (0, 1]", sc.admission_ceiling)
        check(sc.speculative in SPECULATIVE, "speculative", "one of " + ", ".join(SPECULATIVE), sc.speculative)
        check(isinstance(sc.num_speculative_tokens, int) and 1 <= sc.num_speculative_tokens <= 64,
              "num_speculative_tokens", "an integer in [1, 64]", sc.num_speculative_tokens)
        check(isinstance(sc.max_loras, int) and 1 <= sc.max_loras <= 256, "max_loras", "an integer in [1, 256]",
              sc.max_loras)
        check(self.lora_dtype in LORA_DTYPES, "lora_dtype", f"one of {', '.join(LORA_DTYPES)}", self.lora_dtype)
        check(isinstance(self.max_lora_rank, int) and 1 <= self.max_lora_rank <= 512, "max_lora_rank",
              "an integer in [1, 512]", self.max_lora_rank)
        names = [n for n, _ in self.lora_modules]
        for n in names:
            check(isinstance(n, str) and re.fullmatch(LORA_NAME, n) is not None, "lora_modules",
                  f"NAME=PATH pairs with names matching {LORA_NAME}", n)
        check(len(set(names)) == len(names), "lora_modules", "pairs with distinct names", names)
