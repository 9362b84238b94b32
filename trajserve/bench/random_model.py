"""`trajserve bench random-model`: a GGUF of a real model's shape with random
weights, for speed runs where no model hub can be reached.

    trajserve bench random-model --shape smollm2-1.7b --out /tmp/smollm2-1.7b-f16.gguf
    llama-quantize /tmp/smollm2-1.7b-f16.gguf /tmp/smollm2-1.7b-q4_k_m.gguf Q4_K_M
    trajserve bench throughput --model /tmp/smollm2-1.7b-q4_k_m.gguf
    trajserve bench random-model --shape gemma-3-1b --layers 6 --type q8_0 --out /tmp/gemma-3-1b-6.gguf
    trajserve bench random-model --shape gemma-3-1b --layers 6 --type q8_0 --all-global --out /tmp/global-6.gguf

The shape is a catalog model's (trajserve/plan/catalog.toml: layers, heads,
widths, vocabulary, tied embeddings); the weights are N(0, 0.02) (norms 1),
so the bytes a step reads and the work it does are the real model's, not
its text. The tokenizer is the embedded SmolLM2's, padded with unused
tokens to the shape's vocabulary, so both trajserve and llama.cpp load the
file. --type writes f16 (what llama.cpp's quantizer starts from, for K-quant
files), f32, or a block format the gguf package writes (q8_0, q4_0, q4_1).
A Gemma 3 shape is written as llama.cpp's `gemma3` architecture: its
window and per-layer pattern, the sandwich and query-key norms;
--all-global writes its twin, every layer global (the same bytes a token,
no window to free blocks behind), for comparisons at equal pool bytes.
A gpt-oss shape is written as llama.cpp's `gpt-oss`: biased attention
and experts, a sink per head, windows in every other layer; --experts
mxfp4 stores the experts as the release ships them (the rest as --type).

    trajserve bench random-model --shape gpt-oss-20b --layers 2 --type q8_0 --experts mxfp4 --out /tmp/oss.gguf
"""
from __future__ import annotations

import argparse
from pathlib import Path

from trajserve.config import ModelConfig

TYPES = ("f16", "f32", "q8_0", "q4_0", "q4_1")  # gguf and numpy load when a file is written


def add_parser(sub) -> None:
    r = sub.add_parser("random-model", help="write a GGUF of a real model's shape with random weights (speed runs)")
    r.add_argument("--shape", required=True, help="a catalog model: smollm2-1.7b, llama-3.2-3b, qwen3-8b, "
                                                  "qwen3-30b-a3b (routed experts), ...")
    r.add_argument("--out", required=True, help="the .gguf file to write")
    r.add_argument("--type", choices=tuple(TYPES), default="f16", help="how the matrices are stored")
    r.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (tests, quick runs)")
    r.add_argument("--context", type=int, default=8192, help="the context length the file declares")
    r.add_argument("--all-global", action="store_true",
                   help="a shape with sliding-window layers (gemma-3-*): every layer global instead")
    r.add_argument("--experts", choices=("as-type", "mxfp4"), default="as-type",
                   help="a MoE shape's experts: as --type, or MXFP4 (gpt-oss's release format)")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=run)


def _tokenizer_fields(vocab_size: int) -> list[tuple]:
    """The embedded model's tokenizer metadata (key, value, type, item type),
    its token list padded to vocab_size."""
    import gguf

    from trajserve.model.loader import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            pad = vocab_size - len(value)
            if pad < 0:
                raise ValueError(f"the shape's vocabulary ({vocab_size:,}) is smaller than the tokenizer's "
                                 f"({len(value):,})")
            value = list(value) + {"tokenizer.ggml.tokens": [f"<|unused_{i}|>" for i in range(pad)],
                                   "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * pad,
                                   "tokenizer.ggml.scores": [0.0] * pad}[key]
        out.append((key, value, vtype, sub))
    return out


def write_random_gguf(cfg: ModelConfig, out: Path, kind: str = "f16", seed: int = 0,
                      experts: str = "as-type") -> int:
    """Write the file; returns its size in bytes."""
    import gguf
    import numpy as np

    if cfg.moe is not None and cfg.moe.layers != tuple(range(cfg.num_layers)):
        raise ValueError("a random MoE file routes every layer (llama.cpp's qwen3moe graph)")
    gemma, oss = cfg.architecture == "gemma3", cfg.architecture == "gpt_oss"
    arch = ("gemma3" if gemma else "gpt-oss" if oss else "qwen3moe" if cfg.moe is not None
            else "qwen3" if cfg.qk_norm else "llama")
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"random {cfg.name or arch}")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if oss:  # windows in every other layer from the first: llama.cpp's rule for gpt-oss
        w.add_sliding_window(cfg.window.size)
    if gemma:  # the window and which layers have it (none: the all-global twin)
        window = cfg.window.layers if cfg.window is not None else ()
        w.add_sliding_window(cfg.window.size if cfg.window is not None else 0)
        w.add_array(f"{arch}.attention.sliding_window_pattern", [i in window for i in range(cfg.num_layers)])
    if cfg.moe is not None:
        w.add_expert_count(cfg.moe.num_experts)
        w.add_expert_used_count(cfg.moe.top_k)
        w.add_expert_feed_forward_length(cfg.moe.expert_size)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                     "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[kind])
    for key, value, vtype, sub in _tokenizer_fields(cfg.vocab_size):
        w.add_key_value(key, value, vtype, sub)
    rng = np.random.default_rng(seed)

    def matrix(name: str, rows: int, cols: int, stack: int = 0) -> None:
        shape = (stack, rows, cols) if stack else (rows, cols)  # stack: experts' matrices in one tensor
        a = (rng.standard_normal(shape, dtype=np.float32) * 0.02)
        if stack and experts == "mxfp4":
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.MXFP4),
                         raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        elif kind == "f16":
            w.add_tensor(name, a.astype(np.float16))
        elif kind == "f32":
            w.add_tensor(name, a)
        else:
            qtype = gguf.GGMLQuantizationType[kind.upper()]
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    def bias(name: str, *shape: int) -> None:
        w.add_tensor(name, rng.standard_normal(shape, dtype=np.float32) * 0.02)

    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    matrix("token_embd.weight", cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", h)
        matrix(p + "attn_q.weight", q, h)
        matrix(p + "attn_k.weight", kv, h)
        matrix(p + "attn_v.weight", kv, h)
        matrix(p + "attn_output.weight", h, q)
        if oss:  # q/k/v/o biases, a sink per head; the norm before the experts is post_attention_norm
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv), ("attn_output", h)):
                bias(p + name + ".bias", n)
            bias(p + "attn_sinks.weight", cfg.num_heads)
        if cfg.qk_norm or gemma:
            norm(p + "attn_q_norm.weight", cfg.head_dim)
            norm(p + "attn_k_norm.weight", cfg.head_dim)
        if gemma:  # Gemma's sandwich: norms on the attention's and the MLP's outputs too
            norm(p + "post_attention_norm.weight", h)
            norm(p + "post_ffw_norm.weight", h)
        norm(p + ("post_attention_norm.weight" if oss else "ffn_norm.weight"), h)
        if cfg.moe is not None:  # the router (float, as llama.cpp's converter keeps it), then the experts
            e, inter = cfg.moe.num_experts, cfg.moe.expert_size
            w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((e, h), dtype=np.float32) * 0.02)
            matrix(p + "ffn_gate_exps.weight", inter, h, e)
            matrix(p + "ffn_up_exps.weight", inter, h, e)
            matrix(p + "ffn_down_exps.weight", h, inter, e)
            if oss:  # the router's and each expert's biases
                bias(p + "ffn_gate_inp.bias", e)
                for name, n in (("ffn_gate_exps", inter), ("ffn_up_exps", inter), ("ffn_down_exps", h)):
                    bias(p + name + ".bias", e, n)
            continue
        matrix(p + "ffn_gate.weight", cfg.intermediate_size, h)
        matrix(p + "ffn_up.weight", cfg.intermediate_size, h)
        matrix(p + "ffn_down.weight", h, cfg.intermediate_size)
    norm("output_norm.weight", h)
    if not cfg.tie_word_embeddings:
        matrix("output.weight", cfg.vocab_size, h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out.stat().st_size


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from trajserve.plan.catalog import get_model

    spec = get_model(args.shape)
    cfg = spec.config
    layers = cfg.num_layers if args.layers is None else args.layers
    moe = dataclasses.replace(cfg.moe, layers=tuple(range(layers))) if cfg.moe is not None else None
    window = cfg.window
    if args.all_global and cfg.architecture != "gemma3":
        raise ValueError(f"--all-global: for a Gemma 3 shape (gemma-3-*), not {spec.name}")
    if window is not None:
        window = None if args.all_global else dataclasses.replace(
            window, layers=tuple(i for i in window.layers if i < layers))
    cfg = dataclasses.replace(cfg, max_position_embeddings=args.context, num_layers=layers, moe=moe, window=window)
    if args.experts != "as-type" and cfg.moe is None:
        raise ValueError(f"--experts {args.experts}: {spec.name} has no experts")
    size = write_random_gguf(cfg, Path(args.out), args.type, args.seed, args.experts)
    kinds = (f", {len(cfg.window.layers)} window layers of {cfg.window.size}" if cfg.window is not None else
             ", every layer global" if args.all_global else "")
    print(f"wrote {args.out}: {spec.name}'s shape ({cfg.num_layers} layers{kinds}, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size:,}), random {args.type} weights, {size / 2**30:.2f} GiB")
    return 0
