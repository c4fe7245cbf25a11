"""Small single-process models that exercise the compiler's capture and codegen.

Each is an ordinary ``nn.Module`` with a deterministic init (seed it before building) and
tiny default shapes, so tests on two CPU cores stay fast. ``GPT`` and ``Block`` are
:mod:`dhelix_compile.models.gpt`'s, re-exported here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dhelix_compile.models.gpt import GPT, Block

__all__ = ["GPT", "MLP", "BatchNormNet", "Block", "ConvNet", "GraphBreakNet", "InPlaceNet", "lm_loss"]


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32, out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ConvNet(nn.Module):
    def __init__(self, channels: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


class BatchNormNet(nn.Module):
    """Updates running statistics (buffers) in training: a mutation AOTAutograd must keep."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.out = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.bn(self.fc(x))))


class InPlaceNet(nn.Module):
    """In-place activations and an in-place add on an intermediate."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h.add_(x)
        h.relu_()
        y = self.fc2(h)
        return y.mul_(0.5)


class GraphBreakNet(nn.Module):
    """A data-dependent Python branch: Dynamo breaks the graph and compiles two pieces."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)
        self.fc3 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if h.sum() > 0:  # data-dependent: not traceable into one graph
            h = self.fc2(h)
        else:
            h = self.fc3(h)
        return h * 2


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over a ``[batch, seq, vocab]`` logits tensor."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
