"""Top-k routed experts in place of a layer's MLP (Qwen3-MoE, OLMoE,
DeepSeek V2 / V3, gpt-oss; config.MoESpec).

Each token's router logits (a product with [num_experts, hidden]) go
through a float32 softmax (DeepSeek V3: a sigmoid, its correction bias added
for the choice only; DeepSeek: the choice limited to the best groups of
experts; gpt-oss: a softmax over the top_k logits alone); its top_k experts
run, each a gated MLP (SiLU; gpt-oss's clamped SwiGLU), and their outputs add up
weighted by those scores (renormalised over the chosen ones when
norm_topk_prob, times DeepSeek's routed_scale), as transformers computes
it, expert by expert in ascending order; a shared expert (DeepSeek) adds
its MLP's output to every token's. Only the experts some row of the batch chose are
run at all, so a decode step at batch 1 reads top_k experts' weights per
layer, not num_experts': on the C kernels, the experts' matrices are packed
products (float or a block format, model/linear.py) like a dense MLP's.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from trajserve.config import MoESpec

# An expert's MLP: (gate|up, down). On the C kernels gate|up returns the
# activation silu(gate) * up; on torch it returns gate|up, activated here.
Expert = tuple[Callable, Callable]


def route(spec: MoESpec, logits: torch.Tensor,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [T, top_k] of router logits [T, num_experts], as
    transformers routes them: bias is DeepSeek V3's correction (choice only)."""
    if spec.scoring == "topk_softmax":  # gpt-oss: the chosen logits' softmax
        top, chosen = torch.topk(logits.float(), spec.top_k, dim=-1)
        return torch.softmax(top, dim=-1), chosen
    scores = torch.sigmoid(logits.float()) if spec.scoring == "sigmoid" else torch.softmax(logits.float(), dim=-1)
    choice = scores if bias is None else scores + bias
    if spec.n_group > 1:  # only the experts of the best topk_group groups can be chosen
        grouped = choice.view(choice.shape[0], spec.n_group, spec.num_experts // spec.n_group)
        g = grouped.amax(dim=-1) if spec.group_score == "max" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(g).scatter_(1, torch.topk(g, spec.topk_group, dim=-1)[1], 1.0).bool()
        hidden = ~keep.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)
        # V2 zeroes the other groups' softmax scores, V3 rules its biased ones out.
        choice = choice.masked_fill(hidden, float("-inf") if spec.scoring == "sigmoid" else 0.0)
    if bias is None:
        weights, chosen = torch.topk(choice, spec.top_k, dim=-1)
    else:  # the bias picks, the scores weigh
        chosen = torch.topk(choice, spec.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
    if spec.routed_scale != 1.0:
        weights = weights * spec.routed_scale
    return weights, chosen


class MoE:
    def __init__(self, spec: MoESpec, router: Callable, experts: list[Expert],
                 act: Callable[[torch.Tensor], torch.Tensor] | None,
                 shared: Expert | None = None, bias: torch.Tensor | None = None) -> None:
        """router: the [num_experts, hidden] product (model/linear.py; on the C
        kernels a row's logits are the same bits whatever rows are beside it,
        so a row routes as it would alone). act: the activation of a gate|up
        product (None: gate|up returns it, the C kernels' fused SiLU); shared: the shared expert's MLP;
        bias: DeepSeek V3's correction of the scores, float32 [num_experts]."""
        if len(experts) != spec.num_experts:
            raise ValueError(f"a MoE layer of {spec.num_experts} experts got {len(experts)}")
        self.spec, self.router, self.experts, self.act = spec, router, experts, act
        self.shared, self.bias = shared, bias
        self.last_experts: list[int] = []  # the experts the latest call ran: what it read

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """The layer's MLP output for h [T, hidden] (not yet added to the residual)."""
        y = self._routed(h)
        return y if self.shared is None else y + self._run(self.shared, h)

    def _routed(self, h: torch.Tensor) -> torch.Tensor:
        weights, chosen = route(self.spec, self.router(h), self.bias)
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
        return self._run(self.experts[e], h)

    def _run(self, mlp: Expert, h: torch.Tensor) -> torch.Tensor:
        gate_up, down = mlp
        act = gate_up(h)
        return down(act if self.act is None else self.act(act))

    def products(self) -> list:
        """The routed experts' products (the shared expert's: shared_products)."""
        return [p for pair in self.experts for p in pair]

    def shared_products(self) -> list:
        return list(self.shared) if self.shared is not None else []
