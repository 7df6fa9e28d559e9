"""Tiny models shared by several test files (a module of its own: test files in sub-folders
have conftest modules of their own, so ``from conftest import ...`` is ambiguous)."""

from __future__ import annotations

import torch
from torch import nn


class TinyCNN(nn.Module):
    """conv-bn-relu, residual conv + add + relu, pool, flatten, linear: the CNN chain shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)
        self.unused = nn.Linear(8, 8)  # dead code: never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.conv2(y) + y)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


class TinyTokenModel(nn.Module):
    """A one-layer BERT-style encoder (hidden 32, 2 heads, 64 positions) over (input_ids,
    attention_mask): per-token states (N, S, 32) and their mask-weighted mean (N, 32)."""

    def __init__(self, vocab: int = 100, hidden: int = 32, positions: int = 64) -> None:
        from qcompile.zoo.bert import MASKED, SelfAttention

        super().__init__()
        torch.manual_seed(0)
        self.masked = MASKED
        self.words = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(positions, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.attention = SelfAttention(hidden, 2)
        self.ffn_in, self.ffn_out = nn.Linear(hidden, 64), nn.Linear(64, hidden)
        # Hugging Face's BERT slices a position-id buffer to the input's length
        self.register_buffer("position_ids", torch.arange(positions)[None, :], persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self.position_ids[:, :input_ids.shape[1]]
        x = self.norm(self.words(input_ids) + self.positions(pos))
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * self.masked
        x = x + self.attention(x, bias)
        x = x + self.ffn_out(nn.functional.gelu(self.ffn_in(x)))
        weights = attention_mask.unsqueeze(-1).to(x.dtype)
        return x, (x * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def token_batches(n: int, length: int, *, batch: int = 4, seed: int = 0
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of random word ids, each row padded (id 0, mask 0) after a random number
    of real tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 100, (batch, length), generator=gen)
        real = torch.randint(1, length + 1, (batch, 1), generator=gen)
        mask = (torch.arange(length)[None, :] < real).to(torch.int64)
        out.append((ids * mask, mask))
    return out
