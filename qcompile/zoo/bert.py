"""A 4-layer BERT-base-style encoder (hidden 768, 12 heads, FFN 3072), seeded random init.

Written out op by op (q/k/v Linear, matmul, softmax, additive mask bias, GELU, post-LayerNorm) so
the exported graph holds exactly the matmul chains the compiler is meant to keep in int8.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qcompile.zoo import ZooModel
from qcompile.zoo._common import DEFAULT_SEQ_LEN, seeded
from qcompile.zoo.minilm import MAX_SEQ_LEN, check_seq_len, token_spec

VOCAB, HIDDEN, HEADS, FFN, LAYERS = 30522, 768, 12, 3072, 4
LN_EPS = 1e-12
MASKED = -10000.0  # additive bias of padded keys: softmax weight ~ e^-10000 = 0, yet finite


class SelfAttention(nn.Module):
    """Multi-head scaled dot-product self-attention with an additive key bias."""

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        n, s, _ = x.shape
        return x.view(n, s, self.heads, self.head_dim).transpose(1, 2)  # N, heads, S, head_dim

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + bias
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.out(ctx.transpose(1, 2).reshape(x.shape))


class EncoderLayer(nn.Module):
    """x = LN(x + attn(x)); x = LN(x + FFN(x)) with FFN = Linear -> GELU -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = SelfAttention()
        self.attention_norm = nn.LayerNorm(HIDDEN, eps=LN_EPS)
        self.ffn_in = nn.Linear(HIDDEN, FFN)
        self.ffn_out = nn.Linear(FFN, HIDDEN)
        self.ffn_norm = nn.LayerNorm(HIDDEN, eps=LN_EPS)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x, bias))
        return self.ffn_norm(x + self.ffn_out(nn.functional.gelu(self.ffn_in(x))))


class BertEncoder(nn.Module):
    """Word + learned position embeddings, LayerNorm, ``LAYERS`` post-LN encoder layers."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(MAX_SEQ_LEN, HIDDEN)
        self.embedding_norm = nn.LayerNorm(HIDDEN, eps=LN_EPS)
        self.layers = nn.ModuleList(EncoderLayer() for _ in range(layers))
        self.apply(_init_bert)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.embedding_norm(x)
        # (N, S) 1/0 mask -> (N, 1, 1, S) additive bias on the attention scores of every head
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * MASKED
        for layer in self.layers:
            x = layer(x, bias)
        return x


def _init_bert(m: nn.Module) -> None:
    """BERT's init: weights N(0, 0.02), biases 0, LayerNorm scale 1."""
    if isinstance(m, nn.Linear | nn.Embedding):
        nn.init.normal_(m.weight, 0.0, 0.02)
    if isinstance(m, nn.Linear):
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def build(seq_len: int | None = None) -> ZooModel:
    """The 4-layer encoder: (input_ids, attention_mask) (N, seq_len) -> (N, seq_len, 768)."""
    seq_len = seq_len or DEFAULT_SEQ_LEN
    check_seq_len("bert_encoder", seq_len)
    with seeded():
        module = BertEncoder().eval()
    return ZooModel(
        name="bert_encoder",
        module=module,
        spec=token_spec(seq_len),
        task="embedding",
        default_dataset="sentences",
        description="4-layer BERT-base-style encoder (768, 12 heads), random init",
    )
