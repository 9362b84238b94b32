"""Top-k routed experts in place of a layer's MLP (Qwen3-MoE; config.MoESpec).

Each token's router logits (a product with [num_experts, hidden]) go
through a float32 softmax; its top_k experts run, each a SiLU MLP, and their
outputs add up weighted by those probabilities (renormalised over the
chosen ones when norm_topk_prob), as transformers computes it, expert by
expert in ascending order. Only the experts some row of the batch chose are
run at all, so a decode step at batch 1 reads top_k experts' weights per
layer, not num_experts': on the C kernels, the experts' matrices are packed
products (float or a block format, model/linear.py) like a dense MLP's.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from trajserve.config import MoESpec

# An expert's MLP: (gate|up, down). On the C kernels gate|up returns the
# activation silu(gate) * up; on torch it returns gate|up, activated here.
Expert = tuple[Callable, Callable]


class MoE:
    def __init__(self, spec: MoESpec, router: Callable, experts: list[Expert], fused_act: bool) -> None:
        """router: the [num_experts, hidden] product (model/linear.py; on the C
        kernels a row's logits are the same bits whatever rows are beside it,
        so a row routes as it would alone)."""
        if len(experts) != spec.num_experts:
            raise ValueError(f"a MoE layer of {spec.num_experts} experts got {len(experts)}")
        self.spec, self.router, self.experts, self.fused_act = spec, router, experts, fused_act
        self.last_experts: list[int] = []  # the experts the latest call ran: what it read

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """The layer's MLP output for h [T, hidden] (not yet added to the residual)."""
        probs = torch.softmax(self.router(h).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        y = torch.zeros_like(h)
        if h.shape[0] == 1:  # a decode row alone: no gathers (a quarter of a layer's time), the same sums
            pairs = sorted(zip(chosen[0].tolist(), weights[0].tolist()))  # in the same ascending order
            self.last_experts = [e for e, _ in pairs]
            for e, weight in pairs:
                y += self._expert(e, h) * weight
            return y
        self.last_experts = chosen.unique().tolist()  # sorted: transformers' order of the sums
        for e in self.last_experts:
            rows, slot = torch.where(chosen == e)
            y.index_add_(0, rows, self._expert(e, h[rows]) * weights[rows, slot, None].to(h.dtype))
        return y

    def _expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.experts[e]
        act = gate_up(h)
        if not self.fused_act:
            inter = act.shape[-1] // 2
            act = F.silu(act[:, :inter]) * act[:, inter:]
        return down(act)

    def products(self) -> list:
        return [p for pair in self.experts for p in pair]
