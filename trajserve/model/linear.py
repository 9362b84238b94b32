"""Linear layers with the fastest CPU matmul torch offers here.

On CPU in float32, oneDNN's linear (the op torch's inductor emits,
`mkldnn._linear_pointwise`, fed plain dense tensors) beats the MKL sgemm
behind F.linear on this project's shapes: measured on the 2-core AVX2 EPYC,
a full SmolLM2 pass of weight matmuls took 32 vs 45 ms at batch 1 and 65 vs
122 ms at batch 16 (MKL's M=1 path reads weights at ~10 GB/s, half the
machine's bandwidth). Elsewhere (CUDA, bf16), or if the op is missing,
plain F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
    __slots__ = ("weight", "bias", "onednn")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool) -> None:
        self.weight = weight.contiguous()
        self.bias = bias
        self.onednn = onednn

    @property
    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return _ONEDNN(x.contiguous(), self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
