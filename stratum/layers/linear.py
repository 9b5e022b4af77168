"""Linear kernels. Every projection in the model is a `Linear` whose weight format is swappable."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ W.T + b with a dense weight [out, in] in the model's dtype, or, when the checkpoint's
    quantized blocks are held instead (`quantized`: any object with `matmul(x [M, in]) -> [M, out]`
    and `nbytes`, see kernels.quant), on them for every batch: the dense weight is then empty.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.quantized = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in], any float dtype. Returns [T, out] in the weight's dtype: the matmul runs there,
        and adding the result to the fp32 residual stream promotes it back."""
        w = self.weight
        x = x.to(w.dtype)
        if self.quantized is not None:
            y = self.quantized.matmul(x).to(w.dtype)
            return y if self.bias is None else y + self.bias
        return F.linear(x, w, self.bias)
