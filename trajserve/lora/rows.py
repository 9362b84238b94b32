"""One step's adapter products: which slot each row of the batch runs.

The base products run once for the whole batch; after each adapted
projection `add` puts every row's own low-rank product on top,

    y[i] += s B_a (A_a x[i])      a = the adapter of row i's request,

one C call per group of projections of one input on the kernel path
(cpu_kernels.c ts_lora_rows: rows of one adapter in tiles that share each
weight load; a row's result never depends on its neighbours' adapters, as
for the base products), one pair of products per adapter present on the
torch path (its rows gathered: a grouped product over row segments). The gate and
up projections are fused with the activation on the kernel path, so their
adapter products are computed first (`gate_up_pre`) and added inside it,
before silu: silu(W_g x + s B_g A_g x) * (W_u x + s B_u A_u x), as the merged
weights would give.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trajserve.lora.slots import LoRASlots, unpanel


@dataclass(slots=True)
class LoRARows:
    slots: LoRASlots
    rows: torch.Tensor  # int32 [T]: the slot of each row, -1 for the base model
    kernels: object = None  # CpuKernels, or None for the torch path
    _order: torch.Tensor | None = None  # the rows grouped by slot (the C kernel's tiles)
    # What every C call of this step passes besides its input and outputs,
    # taken once: ~120 calls a step, whose Python side was a fifth of their time.
    _call: object = None
    _fixed: tuple = ()
    _pre: torch.Tensor | None = None  # gate_up_pre's buffer, reused layer after layer

    def __post_init__(self) -> None:
        # Checked once a step: each projection's call below passes pointers.
        r = self.rows
        if r.dtype != torch.int32 or r.dim() != 1 or not r.is_contiguous():
            raise ValueError(f"LoRA rows must be a contiguous int32 vector, got {r.dtype} {tuple(r.shape)}")
        if r.numel() and int(r.max()) >= self.slots.max_loras:
            raise IndexError(f"a row names slot {int(r.max())}; there are {self.slots.max_loras}")
        if self.kernels is not None:
            self._order = torch.sort(r, stable=True).indices.to(torch.int32)
            self._call = self.kernels.lib.ts_lora_rows
            self._fixed = (self._order.data_ptr(), r.data_ptr(), self.slots.scale.data_ptr(), self.kernels.threads())

    def subset(self, idx: torch.Tensor) -> LoRARows:
        """The rows `idx` (the sampled rows of the last layer)."""
        return LoRARows(self.slots, self.rows[idx].contiguous(), self.kernels)

    def add(self, layer: int, modules: tuple[str, ...], x: torch.Tensor, outs: tuple[torch.Tensor, ...],
            overwrite: bool = False) -> None:
        """outs[i] [T, n_i] += every row's adapter product of x [T, in] for
        projection modules[i] (projections of one input, q/k/v or gate/up, in
        one call; an output may be a column slice of a wider tensor); with
        `overwrite`, out = those products (0 in rows without one)."""
        if self.kernels is None:
            for module, out in zip(modules, outs):
                self._add_torch(layer, module, x, out, overwrite)
            return
        group = self.slots.group(layer, modules)
        if group is None:
            if overwrite:
                for out in outs:
                    out.zero_()
            return
        words, stacks, words_ptr, fan_in = group
        m = self.rows.shape[0]
        if x.shape != (m, fan_in) or x.stride(1) != 1 or x.dtype != torch.float32:
            raise ValueError(f"LoRA {modules}: input {tuple(x.shape)} {x.dtype} for {m} rows of {fan_in} features")
        for i, (st, out) in enumerate(zip(stacks, outs)):
            if st is None:
                if overwrite:
                    out.zero_()
                continue
            if out.shape != (m, st.fan_out) or out.stride(1) != 1 or out.dtype != torch.float32:
                raise ValueError(f"LoRA {modules[i]}: output {tuple(out.shape)} {out.dtype} for {m} rows of "
                                 f"{st.fan_out}")
            words[i, 7] = out.data_ptr()
            words[i, 8] = out.stride(0)
        order, slot, scale, threads = self._fixed
        if self._call(x.data_ptr(), m, fan_in, x.stride(0), order, slot, scale, words_ptr, len(modules),
                      self.slots.max_rank, overwrite, self.kernels.lora_dp, threads):
            raise MemoryError(f"LoRA {modules}: no memory for the tile list of {m} rows")

    def _add_torch(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor, overwrite: bool) -> None:
        """The same on torch: per adapter, its rows gathered, two matmuls."""
        if overwrite:
            out.zero_()
        st = self.slots.stack.get((layer, module))
        if st is None:
            return
        for s in torch.unique(self.rows[self.rows >= 0]).tolist():
            for dtype, rank in st.rank.items():
                r = int(rank[s])
                if r:
                    idx = torch.nonzero(self.rows == s).squeeze(1)
                    u = (x.index_select(0, idx).float() @ st.a[dtype][s, :r].float().t()) * self.slots.scale[s]
                    out.index_add_(0, idx, (u @ unpanel(st.bt[dtype][s, :, :r], st.fan_out).float()).to(out.dtype))

    def gate_up_pre(self, layer: int, x: torch.Tensor, inter: int) -> torch.Tensor | None:
        """[T, 2 * inter]: the gate then up adapter products of x, or None
        when no slot adapts this layer's MLP input projections."""
        st = self.slots.stack
        if (layer, "gate_proj") not in st and (layer, "up_proj") not in st:
            return None
        pre = self._pre
        if pre is None or pre.shape != (x.shape[0], 2 * inter):  # every layer's is consumed before the next
            pre = self._pre = torch.empty(x.shape[0], 2 * inter, dtype=torch.float32, device=x.device)
        self.add(layer, ("gate_proj", "up_proj"), x, (pre[:, :inter], pre[:, inter:]), overwrite=True)
        return pre
