"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Qwen3-MoE, OLMoE, Gemma 3, DeepSeek V2 / V3,
gpt-oss) over a paged KV cache.

The forward takes a flat batch of tokens from many sequences (decode tokens
and prefill chunks mixed) and returns hidden states only for the rows that
will be sampled, so prefill never pays for the vocabulary projection of
every prompt token.

On the CPU in float32 the layers run through the C kernels of
cpu_kernels.c (`_forward_kernels`): weight products on packed panels, fused
RMSNorm, RoPE + K/V store, paged decode and prefill attention, SiLU gate and
residual adds; matrices kept in a GGUF block format (model/quant.py) run
through quant_kernels.c. Elsewhere the plain torch forward, with any
quantized matrix dequantized at load.

Sliding-window layers (config.WindowSpec) attend to their latest tokens
only (model/attention.py), with their own RoPE table where the window
layers have their own base (Gemma 3). Gemma 3's (1 + w) norms are folded
into w at load; its norms of the attention and MLP outputs
(`attn_out_norm`, `mlp_out_norm`) run before the residual adds. DeepSeek's
latent attention (model/mla.py) takes the place of q/k/v and o; its
decode and verification rows' attention runs on mla_attention.c over the
latent rows, a prompt's longer chunks' in torch, its products on the C kernels;
gpt-oss's attention sinks, on every C attention kernel (or torch's).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from trajserve.config import ModelConfig
from trajserve.model import cpu_kernels
from trajserve.model.attention import AttentionMetadata, paged_attention, write_kv
from trajserve.model.decode_stack import DecodeStack
from trajserve.model.linear import GateUpSilu, Linear, QGateUpSilu, QLinear, QLinearParts, use_onednn
from trajserve.model.mla import LatentAttention, mla_scale
from trajserve.model.moe import MoE
from trajserve.model.quant import QuantizedWeight
from trajserve.model.rope import apply_rope, cos_sin_table

if TYPE_CHECKING:
    from trajserve.lora.rows import LoRARows


class Layer:
    __slots__ = ("qkv", "o", "mla", "gate_up", "down", "moe", "in_norm", "post_norm", "q_norm", "k_norm",
                 "attn_out_norm", "mlp_out_norm", "window", "sinks", "cos", "sin")


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], max_len: int,
                 dtype: torch.dtype, device: torch.device | str, use_cpu_kernels: bool = True,
                 kernel_paths_off: tuple[str, ...] = ()) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.attn_scale or c.head_dim ** -0.5
        self.windowed = c.window is not None

        def w(name: str, cast: torch.dtype = dtype) -> torch.Tensor:
            t = weights[name]
            if isinstance(t, QuantizedWeight):  # no kernels to run it as stored
                t = t.dequantize()
            return t.to(device=self.device, dtype=cast).contiguous()

        def norm(name: str) -> torch.Tensor:
            # Gemma's norms scale by (1 + w): the same float32 product with w folded.
            t = w(name, torch.float32)
            return t + 1.0 if c.norm_plus_one else t

        mk = use_onednn(self.device, dtype)
        self.kernels = None
        if (use_cpu_kernels and self.device.type == "cpu" and dtype == torch.float32
                and c.head_dim % 8 == 0 and c.head_dim <= 256):
            self.kernels = cpu_kernels.load()
            if self.kernels is not None and kernel_paths_off:
                self.kernels = self.kernels.without(*kernel_paths_off)

        def quantized(*names: str, one_format: bool = False) -> list[QuantizedWeight] | None:
            """The matrices as stored, if the kernels can run them. one_format:
            a fused gate|up of two formats runs together in q8_0 (the finer)."""
            parts = [weights[n] for n in names]
            if self.kernels is None or not all(isinstance(p, QuantizedWeight) for p in parts):
                return None
            if one_format and len({p.fmt for p in parts}) > 1:
                parts = [p if p.fmt == "q8_0" else QuantizedWeight.quantize(p.dequantize(), "q8_0") for p in parts]
            return parts

        def lin(*names: str, bias: tuple[str, ...] = ()) -> Linear | QLinear | QLinearParts:
            # Fused projections (q|k|v, gate|up): one matmul instead of several;
            # dispatch cost dominates at small batch. Parts of two formats (a
            # GGUF may keep v in Q8_0 or Q6_K and q, k in Q4_0 or Q4_K): one
            # product per part, each as stored, into one output.
            b = torch.cat([w(n) for n in bias]) if bias else None
            q = quantized(*names)
            if q is not None and len({p.fmt for p in q}) > 1:
                biases = [w(n) for n in bias] if bias else [None] * len(q)
                return QLinearParts([QLinear(p.pack(), pb, self.kernels) for p, pb in zip(q, biases)])
            if q is not None:
                return QLinear(QuantizedWeight.cat(q).pack(), b, self.kernels)
            wt = torch.cat([w(n) for n in names]) if len(names) > 1 else w(names[0])
            return Linear(wt, b, mk, self.kernels)

        self.norm = norm("model.norm.weight")
        self.lm_head = lin("model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight")
        # Tied: embedding rows are read out of the head's panels (float or quantized).
        self.embed_panels = None
        if c.tie_word_embeddings and isinstance(self.lm_head, QLinear):
            self.embed_panels = self.lm_head.panels
        elif quantized("model.embed_tokens.weight") and not c.tie_word_embeddings:
            self.embed_panels = weights["model.embed_tokens.weight"].pack()
        tied_packed = c.tie_word_embeddings and getattr(self.lm_head, "packed", None) is not None
        self.embed = None if tied_packed or self.embed_panels is not None else w("model.embed_tokens.weight")
        self.layers: list[Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            L = Layer()
            L.mla = None
            if c.mla is not None:
                L.qkv = L.o = None
                L.mla = self._latent_attention(p + "self_attn.", lin, norm, w)
            else:
                L.qkv = lin(*(p + f"self_attn.{x}_proj.weight" for x in "qkv"),
                            bias=tuple(p + f"self_attn.{x}_proj.bias" for x in "qkv") if c.attention_bias else ())
                # Some Llama/Qwen3 checkpoints with attention_bias also bias o_proj.
                o_bias = p + "self_attn.o_proj.bias"
                L.o = lin(p + "self_attn.o_proj.weight", bias=(o_bias,) if o_bias in weights else ())
            def mlp(m: str) -> tuple:
                """(gate|up, down) of the SiLU MLP under prefix m: on the C
                kernels gate|up returns the activation, on torch gate|up."""
                gu = quantized(m + "gate_proj.weight", m + "up_proj.weight", one_format=True)
                if c.hidden_act != "silu":  # the product only; forward applies the activation
                    biases = (m + "gate_proj.bias", m + "up_proj.bias") if c.mlp_bias else ()
                    return (lin(m + "gate_proj.weight", m + "up_proj.weight", bias=biases),
                            lin(m + "down_proj.weight", bias=(m + "down_proj.bias",) if c.mlp_bias else ()))
                elif gu is not None:
                    gate_up = QGateUpSilu(gu[0].pack(), gu[1].pack(), self.kernels)
                elif self.kernels is not None:
                    gate_up = GateUpSilu(w(m + "gate_proj.weight"), w(m + "up_proj.weight"), self.kernels)
                else:
                    gate_up = lin(m + "gate_proj.weight", m + "up_proj.weight")
                return gate_up, lin(m + "down_proj.weight")

            L.moe = None
            if c.moe is not None and i in c.moe.layers:
                L.gate_up = L.down = None
                fused = self.kernels is not None and c.hidden_act == "silu"  # gate|up returns the activation
                L.moe = MoE(c.moe, lin(p + "mlp.gate.weight", bias=(p + "mlp.gate.bias",) if c.mlp_bias else ()),
                            [mlp(p + f"mlp.experts.{e}.") for e in range(c.moe.num_experts)],
                            None if fused else functools.partial(gate_activation, config=c),
                            mlp(p + "mlp.shared_experts.") if c.moe.shared_size else None,
                            w(p + "mlp.gate.e_score_correction_bias", torch.float32) if c.moe.score_bias else None)
            else:
                L.gate_up, L.down = mlp(p + "mlp.")
            L.sinks = w(p + "self_attn.sinks", torch.float32) if c.attn_sinks else None
            L.in_norm = norm(p + "input_layernorm.weight")
            L.q_norm = norm(p + "self_attn.q_norm.weight") if c.qk_norm else None
            L.k_norm = norm(p + "self_attn.k_norm.weight") if c.qk_norm else None
            if c.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention's output
                L.attn_out_norm = norm(p + "post_attention_layernorm.weight")
                L.post_norm = norm(p + "pre_feedforward_layernorm.weight")
                L.mlp_out_norm = norm(p + "post_feedforward_layernorm.weight")
            else:
                L.post_norm = norm(p + "post_attention_layernorm.weight")
                L.attn_out_norm = L.mlp_out_norm = None
            self.layers.append(L)
        self.cos, self.sin = cos_sin_table(c.head_dim, max_len, c.rope_theta, c.rope_scaling, self.device)
        local = (cos_sin_table(c.head_dim, max_len, c.window.rope_theta, None, self.device)
                 if c.window is not None and c.window.rope_theta is not None else (self.cos, self.sin))
        windows = set(c.window.layers) if c.window is not None else set()
        for i, L in enumerate(self.layers):
            L.window = c.window.size if i in windows else 0
            L.cos, L.sin = local if i in windows else (self.cos, self.sin)
        self.embed_scale = torch.tensor(c.embed_scale, dtype=torch.float32) if c.embed_scale else None
        self.stack = DecodeStack.build(self) if "decode_stack" not in kernel_paths_off else None

    def _latent_attention(self, p: str, lin, norm, w) -> LatentAttention:
        """A DeepSeek layer's attention under prefix p: the input's products
        into q (or its bottleneck) and into the latent are one product."""
        c, m = self.config, self.config.mla
        first = p + ("q_a_proj.weight" if m.q_lora_rank else "q_proj.weight")
        return LatentAttention(m, c.num_heads, lin(first, p + "kv_a_proj_with_mqa.weight"),
                               norm(p + "q_a_layernorm.weight") if m.q_lora_rank else None,
                               lin(p + "q_b_proj.weight") if m.q_lora_rank else None,
                               norm(p + "kv_a_layernorm.weight"), w(p + "kv_b_proj.weight"),
                               lin(p + "o_proj.weight"), mla_scale(m, c.rope_scaling),
                               functools.partial(rms_norm, eps=c.rms_norm_eps, dtype=self.dtype), self.kernels)

    def products(self) -> list:
        """Every weight product of one forward (the LM head last); a MoE
        layer's: its router's and its experts' (a forward runs those its rows
        choose)."""
        out = []
        for L in self.layers:
            out += L.mla.products() if L.mla is not None else [L.qkv, L.o]
            out += [L.moe.router, *L.moe.shared_products(), *L.moe.products()] if L.moe is not None \
                else [L.gate_up, L.down]
        return out + [self.lm_head]

    def weight_formats(self) -> dict[str, int]:
        """Bytes of the products' weights by the format they run in, as a
        decode step at batch 1 reads them: of a MoE layer's experts, top_k."""
        out: dict[str, int] = {}
        moe = self.config.moe
        share = {id(p): moe.top_k / moe.num_experts for L in self.layers if L.moe is not None
                 for p in L.moe.products()} if moe is not None else {}
        for product in self.products():
            for p in product.parts if isinstance(product, QLinearParts) else [product]:
                if isinstance(p, QLinear):
                    fmt = p.panels.fmt
                elif isinstance(p, QGateUpSilu):
                    fmt = p.gate.fmt
                else:
                    fmt = str(self.dtype).removeprefix("torch.")
                out[fmt] = out.get(fmt, 0) + int(p.nbytes * share.get(id(product), 1.0))
        absorbed = sum(L.mla.absorbed_bytes for L in self.layers if L.mla is not None)
        if absorbed:  # latent attention's up-projections: plain matrices of the compute dtype
            fmt = str(self.dtype).removeprefix("torch.")
            out[fmt] = out.get(fmt, 0) + absorbed
        return out

    def _norm_qkv(self, L: Layer, qkv: torch.Tensor) -> None:
        """In place, before RoPE: Qwen3's RMSNorm of each q and k head
        (OLMoE's: of all q heads together, and all k), then OLMoE's clamp."""
        c, T = self.config, qkv.shape[0]
        if L.q_norm is not None and self.kernels is not None and not c.qk_norm_whole:  # decode_stack.c's norms
            self.kernels.rms_norm_heads(qkv, 0, c.num_heads, c.head_dim, L.q_norm, c.rms_norm_eps)
            self.kernels.rms_norm_heads(qkv, self.q_size, c.num_kv_heads, c.head_dim, L.k_norm, c.rms_norm_eps)
        elif L.q_norm is not None:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size: self.q_size + self.kv_size]
            if not c.qk_norm_whole:
                q, k = q.view(T, c.num_heads, c.head_dim), k.view(T, c.num_kv_heads, c.head_dim)
            q.copy_(self._rms(q, L.q_norm))
            k.copy_(self._rms(k, L.k_norm))
        if c.clip_qkv is not None:
            qkv.clamp_(-c.clip_qkv, c.clip_qkv)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.config.rms_norm_eps, self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sample_rows: torch.Tensor,
                before_layer: Callable[[int], None] | None = None,
                sample_meta: AttentionMetadata | None = None, lora: LoRARows | None = None) -> torch.Tensor:
        """Returns float32 logits [len(sample_rows), vocab]. `before_layer(l)`
        runs before layer l touches the KV pool: a reload still streaming in
        (kv/copy_engine.py) is waited for one layer at a time.

        `sample_meta`: the attention of the sampled rows alone (row i is
        sample_rows[i]). Given it, the last layer stores every row's K/V and
        then goes on with the sampled rows only: nothing reads the other rows'
        outputs, and a prefill chunk's last layer is ~1/30 of its work. A row's
        result does not depend on the rows beside it (the C kernels guarantee
        it bit for bit), so the logits are the same.

        `lora`: the adapter of each row (lora/rows.py); each adapted
        projection adds its rows' low-rank products to the base product."""
        if sample_meta is not None and (sample_meta.num_decodes + sum(s.q_len for s in sample_meta.prefills)
                                        != sample_rows.shape[0]):
            raise ValueError(f"sample_meta describes {sample_meta.num_decodes} decode rows and "
                             f"{len(sample_meta.prefills)} prefill spans, not the {sample_rows.shape[0]} sampled rows")
        if self.kernels is not None:
            return self._forward_kernels(input_ids, positions, meta, kv_caches, sample_rows, before_layer,
                                         sample_meta, lora)
        c = self.config
        T = input_ids.shape[0]
        x = self._scaled(self.embed[input_ids])
        tables = {}  # (cos, sin) rows of this step's positions per RoPE table
        last = len(self.layers) - 1
        for i, (L, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            h = self._rms(x, L.in_norm)
            if L.mla is not None:
                x, meta, sample_rows = self._latent_layer(i, L, h, x, positions, meta, k_cache, sample_rows,
                                                          before_layer, sample_meta, i == last)
                x = x + self._mlp(L, self._rms(x, L.post_norm))
                continue
            qkv = L.qkv(h)
            if lora is not None:
                self._lora_qkv(lora, i, h, qkv)
            self._norm_qkv(L, qkv)
            qk = qkv[:, : self.q_size + self.kv_size].view(T, c.num_heads + c.num_kv_heads, c.head_dim)
            v = qkv[:, self.q_size + self.kv_size:].view(T, c.num_kv_heads, c.head_dim)
            # One rotation for q and k heads together: half the RoPE ops.
            if id(L.cos) not in tables:
                tables[id(L.cos)] = (L.cos[positions].to(self.dtype), L.sin[positions].to(self.dtype))
            qk = apply_rope(qk, *tables[id(L.cos)])
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads:]
            if before_layer is not None:
                before_layer(i)
            write_kv(k, v, k_cache, v_cache, meta.for_layer(i))
            if i == last and sample_meta is not None:  # from here on x holds the sampled rows only
                q, x, meta = q[sample_rows], x[sample_rows], sample_meta
                lora = lora.subset(sample_rows) if lora is not None else None
                sample_rows = slice(None)
            a = paged_attention(q, k_cache, v_cache, meta.for_layer(i), self.scale, window=L.window,
                                sinks=L.sinks).reshape(x.shape[0], self.q_size)
            x = x + self._out_norm(L.o(a), L.attn_out_norm)
            if lora is not None:
                lora.add(i, ("o_proj",), a, (x,))
            h = self._rms(x, L.post_norm)
            if L.moe is not None:  # routed experts (no adapters on a MoE model: lora/manager.py)
                x = x + L.moe(h)
                continue
            gu = L.gate_up(h)
            inter = gu.shape[-1] // 2
            pre = lora.gate_up_pre(i, h, inter) if lora is not None else None
            if pre is not None:
                gu = gu + pre.to(gu.dtype)
            act = self._gate(gu)
            x = x + self._out_norm(L.down(act), L.mlp_out_norm)
            if lora is not None:
                lora.add(i, ("down_proj",), act, (x,))
        x = self._rms(x[sample_rows], self.norm)
        return self._softcap(self.lm_head(x).float())

    def _latent_layer(self, i: int, L: Layer, h: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, pool: torch.Tensor, sample_rows, before_layer,
                      sample_meta: AttentionMetadata | None, last: bool) -> tuple:
        """A latent-attention layer's attention added to x: (x, meta,
        sample_rows) for the rest of the forward (the last layer with
        sample_meta goes on with the sampled rows only)."""
        if before_layer is not None:
            before_layer(i)
        cos, sin = L.cos[positions].to(self.dtype), L.sin[positions].to(self.dtype)
        if last and sample_meta is not None:
            a = L.mla(h, cos, sin, meta, pool, sample_rows, sample_meta)
            return x[sample_rows] + a, sample_meta, slice(None)
        return x + L.mla(h, cos, sin, meta, pool), meta, sample_rows

    def _mlp(self, L: Layer, h: torch.Tensor) -> torch.Tensor:
        """The MLP's output for its normed input h (routed experts or a dense MLP), before the residual add."""
        if L.moe is not None:
            return L.moe(h)
        return L.down(L.gate_up(h) if self.kernels is not None and self.config.hidden_act == "silu"
                      else self._gate(L.gate_up(h)))

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """Embedding rows times Gemma's embed_scale (a float32 product, as transformers')."""
        return x if self.embed_scale is None else x * self.embed_scale

    def _gate(self, gu: torch.Tensor) -> torch.Tensor:
        return gate_activation(gu, self.config)

    def _out_norm(self, y: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Gemma's norm of a sublayer's output before its residual add."""
        if weight is None:
            return y
        return self.kernels.rms_norm(y, weight, self.config.rms_norm_eps) if self.kernels else self._rms(y, weight)

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _lora_qkv(self, lora: LoRARows, layer: int, h: torch.Tensor, qkv: torch.Tensor) -> None:
        """Adapter products of q, k and v into their columns of the fused output."""
        q, kv = self.q_size, self.kv_size
        lora.add(layer, ("q_proj", "k_proj", "v_proj"), h,
                 (qkv[:, :q], qkv[:, q:q + kv], qkv[:, q + kv:q + 2 * kv]))

    def _forward_kernels(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                         kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sample_rows: torch.Tensor,
                         before_layer: Callable[[int], None] | None,
                         sample_meta: AttentionMetadata | None, lora: LoRARows | None) -> torch.Tensor:
        """The forward above, float32 on the CPU, in 8 calls per layer
        instead of ~35 torch ops: x is the residual stream, updated in place."""
        c, K = self.config, self.kernels
        eps = c.rms_norm_eps
        if self.embed is not None:
            x = self.embed[input_ids]
        elif self.embed_panels is not None:
            x = K.dequant_rows(self.embed_panels, input_ids)
        else:
            x = cpu_kernels.packed_rows(self.lm_head.packed, input_ids).contiguous()
        x = self._scaled(x)
        if self.stack is not None and self.stack.runs(meta, lora, before_layer):
            # Every row's layers in one call; its last layer runs all rows
            # (sample_meta unused): a row's bits do not depend on the others.
            x = self.stack(x.contiguous(), positions, meta, kv_caches)
            return self._softcap(self.lm_head(K.rms_norm(x[sample_rows], self.norm, eps)))
        last = len(self.layers) - 1
        for i, (L, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            h = K.rms_norm(x, L.in_norm, eps)
            if L.mla is not None:  # (no adapters on a latent-attention model: lora/manager.py)
                x, meta, sample_rows = self._latent_layer(i, L, h, x, positions, meta, k_cache, sample_rows,
                                                          before_layer, sample_meta, i == last)
                x += self._mlp(L, K.rms_norm(x, L.post_norm, eps))
                continue
            qkv = L.qkv(h)
            if lora is not None:
                self._lora_qkv(lora, i, h, qkv)
            self._norm_qkv(L, qkv)
            if before_layer is not None:
                before_layer(i)
            K.rope_store(qkv, c.num_heads, c.num_kv_heads, c.head_dim, L.cos, L.sin, positions,
                         k_cache, v_cache, meta.for_layer(i).slot_block, meta.slot_offset)
            q = qkv[:, : self.q_size]
            if i == last and sample_meta is not None:  # from here on x holds the sampled rows only
                q, x, meta = q[sample_rows], x[sample_rows], sample_meta
                lora = lora.subset(sample_rows) if lora is not None else None
                sample_rows = slice(None)
            n = x.shape[0]
            a = paged_attention(q.view(n, c.num_heads, c.head_dim), k_cache, v_cache, meta.for_layer(i),
                                self.scale, self.kernels, L.window, L.sinks)
            a = a.view(n, self.q_size)
            if L.attn_out_norm is None:
                L.o(a, out=x)
            else:  # Gemma (no adapters: lora/manager.py)
                x += K.rms_norm(L.o(a), L.attn_out_norm, eps)
            if L.moe is not None:  # routed experts (no adapters on a MoE model: lora/manager.py)
                x += L.moe(K.rms_norm(x, L.post_norm, eps))
                continue
            if c.hidden_act != "silu":  # Gemma: gate|up is the product, the GELU here
                x += self._out_norm(L.down(self._gate(L.gate_up(K.rms_norm(x, L.post_norm, eps)))), L.mlp_out_norm)
                continue
            if lora is None:
                L.down(L.gate_up(K.rms_norm(x, L.post_norm, eps)), out=x)
                continue
            lora.add(i, ("o_proj",), a, (x,))
            h = K.rms_norm(x, L.post_norm, eps)
            act = L.gate_up(h, lora.gate_up_pre(i, h, c.intermediate_size))
            L.down(act, out=x)
            lora.add(i, ("down_proj",), act, (x,))
        return self._softcap(self.lm_head(K.rms_norm(x[sample_rows], self.norm, eps)))


# Module functions, not methods: a layer's parts (latent attention, experts)
# take them as partials, which hold no reference back to the model, so a
# dropped model is freed at once, not at the garbage collector's next cycle.
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm in float32 like the reference implementations, back to dtype."""
    return F.rms_norm(x.float(), weight.shape, weight, eps).to(dtype)


def gate_activation(gu: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The MLP's activation of a gate|up product: act(gate) * up."""
    c, inter = config, gu.shape[-1] // 2
    if c.hidden_act == "gelu_tanh":
        return F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:]
    if c.hidden_act == "swiglu_clamp":  # gpt-oss: clamped, a sigmoid's slope alpha, up + 1
        gate, up = gu[:, :inter].clamp(max=c.swiglu_limit), gu[:, inter:].clamp(-c.swiglu_limit, c.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * c.swiglu_alpha))
    return F.silu(gu[:, :inter]) * gu[:, inter:]
