"""Linear layers with the fastest CPU matmul torch offers here.

On CPU in float32, oneDNN's linear (the op torch's inductor emits,
`mkldnn._linear_pointwise`, fed plain dense tensors) beats the MKL sgemm
behind F.linear on this project's shapes: measured on the 2-core AVX2 EPYC,
a full SmolLM2 pass of weight matmuls took 32 vs 45 ms at batch 1 and 65 vs
122 ms at batch 16 (MKL's M=1 path reads weights at ~10 GB/s, half the
machine's bandwidth). With the C kernels of cpu_kernels.c (float32 CPU,
the default where they build) their packed product replaces both. Elsewhere
(CUDA, bf16), or if the op is missing, plain F.linear. Matrices kept in a
GGUF block format run through quant_kernels.c (QLinear, QGateUpSilu).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trajserve.model.cpu_kernels import pack, pack_gate_up


def _onednn_linear():
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return None
    try:  # the op is internal to torch: check it works before relying on it
        x, w, b = torch.ones(2, 3), torch.ones(4, 3), torch.ones(4)
        if not torch.equal(op(x, w, b, "none", [], ""), F.linear(x, w, b)):
            return None
    except (RuntimeError, TypeError):
        return None
    return op


_ONEDNN = _onednn_linear()


def use_onednn(device: torch.device, dtype: torch.dtype) -> bool:
    return _ONEDNN is not None and device.type == "cpu" and dtype == torch.float32


class Linear:
    """y = x W^T + b. With CpuKernels the weight is kept only as packed
    panels (cpu_kernels.pack) and every batch size runs the C product."""

    __slots__ = ("weight", "packed", "bias", "onednn", "kernels", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool, kernels=None) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.onednn = onednn
        self.kernels = kernels
        self.weight = None if kernels is not None else weight.contiguous()
        self.packed = pack(weight) if kernels is not None else None

    @property
    def nbytes(self) -> int:
        """Bytes one product reads (the packed panels include their padding)."""
        w = self.packed if self.packed is not None else self.weight
        n = w.numel() * w.element_size()
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T + b; with `out` (the residual stream) the product is added
        into it in place and `out` returned."""
        if self.kernels is not None:
            return self.kernels.linear(x, self.packed, self.out_features, self.bias, out)
        if self.onednn:
            y = _ONEDNN(x.contiguous(), self.weight, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if out is None else out.add_(y)


class GateUpSilu:
    """silu(x gate^T) * (x up^T) in one C call over pack_gate_up panels."""

    __slots__ = ("packed", "inter", "kernels")

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, kernels) -> None:
        self.packed = pack_gate_up(gate, up)
        self.inter = gate.shape[0]
        self.kernels = kernels

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def __call__(self, x: torch.Tensor, pre: torch.Tensor | None = None) -> torch.Tensor:
        """pre: LoRA deltas [m, 2 * inter] of gate | up, added before silu."""
        return self.kernels.gate_up_silu(x, self.packed, self.inter, pre)


class QLinear:
    """y = x W^T + b with W in a block format (model/quant.py QuantizedPanels)."""

    __slots__ = ("panels", "bias", "kernels", "out_features")

    def __init__(self, panels, bias: torch.Tensor | None, kernels) -> None:
        self.panels = panels
        self.bias = bias
        self.kernels = kernels
        self.out_features = panels.shape[0]

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.qlinear(x, self.panels, self.bias, out)


class QLinearParts:
    """Fused rows of several block formats (a Q4_K_M file keeps v in Q6_K
    beside q and k in Q4_K): each part's product written into its columns of
    one output, every part in its own format."""

    __slots__ = ("parts", "spans", "out_features")

    def __init__(self, parts: list[QLinear]) -> None:
        self.parts = parts
        edges = [0]
        for p in parts:
            edges.append(edges[-1] + p.out_features)
        self.spans = list(zip(edges, edges[1:]))
        self.out_features = edges[-1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = out if out is not None else torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
        for (a, b), p in zip(self.spans, self.parts):
            if out is not None:
                p.kernels.qlinear(x, p.panels, p.bias, y[:, a:b])
            else:
                p.kernels.qlinear(x, p.panels, p.bias, into=y[:, a:b])
        return y


class QGateUpSilu:
    """silu(x gate^T) * (x up^T), gate and up in one block format."""

    __slots__ = ("gate", "up", "kernels")

    def __init__(self, gate, up, kernels) -> None:
        self.gate, self.up, self.kernels = gate, up, kernels

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes

    def __call__(self, x: torch.Tensor, pre: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.qgate_up_silu(x, self.gate, self.up, pre)
