"""The activations of MLPs without a gate (one `up_proj`, then `down_proj`), as transformers computes
them: Arcee's and Nemotron's squared ReLU, and Apertus's xIELU (Huang et al., 2024), whose two
slopes are learned per layer and stored in the checkpoint under the MLP's `act_fn`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.model.linear import frozen


class SquaredReLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


class XIELU(nn.Module):
    """x > 0: a_p x^2 + beta x; else (expm1(min(x, eps)) - x) a_n + beta x, with a_p =
    softplus(alpha_p) and a_n = beta + softplus(alpha_n). The checkpoint holds all four (beta and
    eps as constants: frozen parameters here, so they load by name)."""

    def __init__(self):
        super().__init__()
        self.alpha_p, self.alpha_n = nn.Parameter(torch.empty(1)), nn.Parameter(torch.empty(1))
        self.beta, self.eps = frozen(dtype=torch.get_default_dtype()), frozen(dtype=torch.get_default_dtype())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x)


UNGATED = {"relu2": SquaredReLU, "xielu": XIELU}  # hidden_act -> the activation of an MLP without a gate
