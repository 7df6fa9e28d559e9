"""``sentences``: real English prose from the Python reference manual shipped with CPython.

``pydoc_data.topics`` holds the text ``help()`` shows (the language reference, about 460 000
characters) and is part of every Python installation. Paragraphs that are indented (code,
grammar) are skipped; the rest is cut into sentences, and those with code-like characters or
outside 5–40 words are dropped. The result is deterministic for a given Python version.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache

import torch

from calibration.protocol import Batch, InputSpec
from calibration.readers._base import (
    SPLITS,
    batched,
    cast_inputs,
    check_batching,
    check_split,
    describe,
    kind_mismatch,
)
from qcompile.errors import DatasetError

FITS = "token models (kind 'tokens': input_ids and optionally attention_mask, (N, seq_len))"
MIN_WORDS, MAX_WORDS = 5, 40
_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_CODE = re.compile(r"::=|>>>|[{}\[\]\\;=<>|@`~^#$]|\b\w+\(|\w_\w|__|\bversion \d")


def load_sentences(split: str) -> list[str]:
    """The sentences of ``split``: even positions for calibration, odd for evaluation."""
    check_split(SentencesReader.name, split)
    return list(_all_sentences()[SPLITS.index(split) :: 2])


@cache
def _all_sentences() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    seen: dict[str, None] = {}  # insertion-ordered set: deduplicate, keep first occurrence
    for key in sorted(topics):
        for sentence in _sentences(topics[key]):
            seen.setdefault(sentence)
    return tuple(seen)


def _sentences(text: str) -> Iterator[str]:
    for paragraph in _PARAGRAPH.split(text):
        lines = paragraph.split("\n")
        if any(line.startswith((" ", "\t")) for line in lines):
            continue  # code samples and grammar rules are indented
        joined = " ".join(line.strip() for line in lines)
        for sentence in _SENTENCE_END.split(joined):
            if _is_prose(sentence.strip()):
                yield sentence.strip()


def _is_prose(sentence: str) -> bool:
    return (
        sentence[:1].isupper()
        and sentence.endswith(".")
        and not _CODE.search(sentence)
        and MIN_WORDS <= len(sentence.split()) <= MAX_WORDS
    )


class SentencesReader:
    """Sentences tokenised with the model's ``spec.tokenizer`` to ``seq_len`` tokens.

    Yields ``(input_ids, attention_mask)`` (or ``(input_ids,)`` for one-input models); no labels.
    Calibration and evaluation are disjoint halves of the sentences (≥ 200 each).
    """

    name = "sentences"

    def num_samples(self, split: str) -> int | None:
        """Sentences in ``split``."""
        return len(load_sentences(split))

    def batches(
        self, spec: InputSpec, *, batch_size: int, num_batches: int | None, split: str
    ) -> Iterator[Batch]:
        """Tokenised batches of ``split``'s sentences in their fixed order."""
        check_token_request(self.name, spec, split, batch_size, num_batches)
        texts = load_sentences(split)
        if num_batches is not None:
            texts = texts[: batch_size * num_batches]
        yield from batched(tokenize_texts(self.name, spec, texts), None, batch_size, num_batches)


def check_token_request(
    reader: str, spec: InputSpec, split: str, batch_size: int, num_batches: int | None
) -> None:
    """Raise a DatasetError unless ``split`` and the batching are valid and ``spec`` is a token
    model with a tokenizer."""
    check_split(reader, split)
    check_batching(reader, batch_size, num_batches)
    if spec.kind != "tokens" or len(spec.shapes) not in (1, 2) or len(spec.shapes[0]) != 2:
        raise kind_mismatch(reader, spec, FITS)
    if spec.tokenizer is None:
        raise DatasetError(
            f"dataset {reader!r} needs the model's tokenizer",
            at=f"dataset reader {reader!r}, model takes {describe(spec)}",
            why="InputSpec.tokenizer is None, so text cannot become token ids",
            next="set InputSpec.tokenizer to a function (texts, seq_len) -> (ids, mask)",
        )


def tokenize_texts(reader: str, spec: InputSpec, texts: list[str]) -> tuple[torch.Tensor, ...]:
    """``texts`` through the spec's tokenizer (checked by :func:`check_token_request` first), padded
    and truncated to the spec's ``seq_len``, cast to its dtypes."""
    seq_len = spec.shapes[0][1]
    ids, mask = spec.tokenizer(texts, seq_len)  # type: ignore[misc]
    for name, t in (("input_ids", ids), ("attention_mask", mask)):
        if tuple(t.shape) != (len(texts), seq_len):
            raise DatasetError(
                f"the tokenizer returned {name} of shape {tuple(t.shape)}, "
                f"expected {(len(texts), seq_len)}",
                at=f"dataset reader {reader!r}, model takes {describe(spec)}",
                why="InputSpec.tokenizer must pad and truncate every text to seq_len tokens",
                next="call the tokenizer with padding='max_length', truncation=True, "
                "max_length=seq_len",
            )
    return cast_inputs((ids, mask)[: len(spec.shapes)], spec)
