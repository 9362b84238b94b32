"""Top-k routed experts in place of a layer's MLP (Qwen3-MoE; config.MoESpec).

Each token's router logits (a float32 product with [num_experts, hidden])
go through a softmax; its top_k experts run, each a SiLU MLP, and their
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
    def __init__(self, spec: MoESpec, router: torch.Tensor, experts: list[Expert], fused_act: bool) -> None:
        if router.shape[0] != spec.num_experts or len(experts) != spec.num_experts:
            raise ValueError(f"a MoE layer of {spec.num_experts} experts got a router of {router.shape[0]} rows "
                             f"and {len(experts)} experts")
        self.spec, self.router, self.experts, self.fused_act = spec, router.float().contiguous(), experts, fused_act
        self.last_experts: list[int] = []  # the experts the latest call ran: what it read

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """The layer's MLP output for h [T, hidden] (not yet added to the residual)."""
        probs = torch.softmax(F.linear(h.float(), self.router), dim=-1)
        weights, chosen = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        y = torch.zeros_like(h)
        self.last_experts = chosen.unique().tolist()  # sorted: transformers' order of the sums
        for e in self.last_experts:
            rows, slot = torch.where(chosen == e)
            gate_up, down = self.experts[e]
            act = gate_up(h[rows])
            if not self.fused_act:
                inter = act.shape[-1] // 2
                act = F.silu(act[:, :inter]) * act[:, inter:]
            y.index_add_(0, rows, down(act) * weights[rows, slot, None].to(h.dtype))
        return y

    def products(self) -> list:
        return [p for pair in self.experts for p in pair]
