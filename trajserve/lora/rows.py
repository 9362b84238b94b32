"""One step's adapter products: which slot each row of the batch runs.

The base products run once for the whole batch; after each adapted
projection `add` puts every row's own low-rank product on top,

    y[i] += s B_a (A_a x[i])      a = the adapter of row i's request,

one C call per projection on the kernel path (cpu_kernels.lora_rows: row by
row, so a row's result never depends on its neighbours' adapters, as for
the base products), one pair of products per adapter present on the torch
path (its rows gathered: a grouped product over row segments). The gate and
up projections are fused with the activation on the kernel path, so their
adapter products are computed first (`gate_up_pre`) and added inside it,
before silu: silu(W_g x + s B_g A_g x) * (W_u x + s B_u A_u x), as the merged
weights would give.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trajserve.lora.slots import LoRASlots


@dataclass(slots=True)
class LoRARows:
    slots: LoRASlots
    rows: torch.Tensor  # int32 [T]: the slot of each row, -1 for the base model
    kernels: object = None  # CpuKernels, or None for the torch path

    def subset(self, idx: torch.Tensor) -> LoRARows:
        """The rows `idx` (the sampled rows of the last layer)."""
        return LoRARows(self.slots, self.rows[idx].contiguous(), self.kernels)

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, n] += every row's adapter product of x [T, in] for one
        projection (out may be a column slice of a wider output)."""
        key = (layer, module)
        a = self.slots.a.get(key)
        if a is None:
            return
        bt, rank = self.slots.bt[key], self.slots.rank[key]
        if self.kernels is not None:
            self.kernels.lora_rows(x, self.rows, a, bt, rank, out)
            return
        for s in torch.unique(self.rows[self.rows >= 0]).tolist():
            r = int(rank[s])
            if r == 0:
                continue
            idx = torch.nonzero(self.rows == s).squeeze(1)
            delta = (x.index_select(0, idx).to(a.dtype) @ a[s, :r].t()) @ bt[s, :r]
            out.index_add_(0, idx, delta.to(out.dtype))

    def adapts(self, layer: int, *modules: str) -> bool:
        return any((layer, m) in self.slots.a for m in modules)

    def gate_up_pre(self, layer: int, x: torch.Tensor, inter: int) -> torch.Tensor | None:
        """[T, 2 * inter]: the gate then up adapter products of x, or None
        when no slot adapts this layer's MLP input projections."""
        if not self.adapts(layer, "gate_proj", "up_proj"):
            return None
        pre = torch.zeros(x.shape[0], 2 * inter, dtype=torch.float32, device=x.device)
        self.add(layer, "gate_proj", x, pre[:, :inter])
        self.add(layer, "up_proj", x, pre[:, inter:])
        return pre
