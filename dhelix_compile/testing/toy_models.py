"""Small single-process models that exercise the compiler's capture and codegen.

Each is an ordinary ``nn.Module`` with a deterministic init (seed it before building) and
tiny default shapes, so tests on two CPU cores stay fast. The parallel reference models
(TP, SP, EP) live in :mod:`dhelix_compile.testing.models`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


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


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.fc_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A tiny GPT: token + position embeddings, a stack of blocks, a LayerNorm and an LM head."""

    def __init__(self, vocab: int = 64, dim: int = 32, n_heads: int = 4, n_layers: int = 2, max_seq: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over a ``[batch, seq, vocab]`` logits tensor."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
