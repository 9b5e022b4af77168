"""Linear kernels. Every projection in the model is a `Linear` whose weight format is swappable."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ W.T + b with a dense weight [out, in] in the model's dtype.

    When an int4 copy is attached, batches of at most `int4_max_tokens` rows run on it instead: the
    packed kernel wins where the matmul is bound by reading weights (decode), the dense one where it
    is bound by compute (large batches, prefill). The crossover is measured at start-up (layers.kernels).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.int4 = None
        self.int4_max_tokens = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in], any float dtype. Returns [T, out] in the weight's dtype: the matmul runs there,
        and adding the result to the fp32 residual stream promotes it back."""
        w = self.weight
        x = x.to(w.dtype)
        if self.int4 is not None and x.shape[0] <= self.int4_max_tokens:
            y = self.int4.matmul(x)
            return y if self.bias is None else y + self.bias
        return F.linear(x, w, self.bias)
