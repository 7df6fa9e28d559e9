"""``word_similarity``: word pairs with human similarity scores, for a task metric on embeddings.

SimLex-999 (999 pairs, scored for similarity, not relatedness) and WordSimilarity-353 (353 pairs)
ship as test data inside the ``gensim`` package; the files are read directly, gensim is never
imported. Each pair becomes two consecutive samples (the two words, tokenised like sentences), and
each sample's label is ``(pair index, human score)``, so a model's embeddings give the Spearman
correlation between the cosine of each pair and the human scores
(:func:`qcompile.accuracy.metrics.pair_spearman`). Calibration and evaluation are disjoint
halves of the pairs: even pair indices calibrate, odd ones evaluate.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import torch

from calibration.protocol import Batch, InputSpec
from calibration.readers._base import SPLITS, batched, check_split
from calibration.readers.sentences import check_token_request, tokenize_texts
from qcompile.errors import DatasetError

BENCHMARKS = {"simlex999": "simlex999.txt", "wordsim353": "wordsim353.tsv"}
Pair = tuple[str, str, float]


def benchmark_path(benchmark: str) -> Path:
    """The benchmark's file inside the installed ``gensim`` package (not imported)."""
    found = importlib.util.find_spec("gensim")
    if found is None or not found.submodule_search_locations:
        raise DatasetError(
            f"dataset 'word_similarity' needs the {benchmark} file shipped by gensim",
            at="dataset reader 'word_similarity'",
            why="the gensim package is not installed",
            next="pip install gensim==4.4.0 (bash scripts/setup.sh installs it)",
        )
    path = Path(found.submodule_search_locations[0]) / "test" / "test_data" / BENCHMARKS[benchmark]
    if not path.is_file():
        raise DatasetError(
            f"the {benchmark} file is missing from the installed gensim",
            at=str(path),
            why="this gensim build ships without its test data",
            next="reinstall gensim==4.4.0 from its wheel",
        )
    return path


@cache
def load_pairs(benchmark: str) -> tuple[Pair, ...]:
    """Every ``(word_1, word_2, human_score)`` of ``benchmark``, in file order."""
    path = benchmark_path(benchmark)
    pairs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        try:
            pairs.append((fields[0], fields[1], float(fields[2])))
        except (IndexError, ValueError) as err:
            raise DatasetError(
                f"cannot read line {n} of {benchmark}",
                at=f"{path}:{n}",
                why=f"expected 'word<TAB>word<TAB>score', got {line[:60]!r} ({err})",
                next="reinstall gensim==4.4.0; the file is damaged",
            ) from err
    return tuple(pairs)


class WordSimilarityReader:
    """Word pairs of a similarity benchmark, tokenised with the model's ``spec.tokenizer``.

    Yields ``(input_ids, attention_mask)`` with the two words of pair *i* as consecutive samples
    and labels ``(N, 2)`` float64: pair index, human score. ``num_batches`` counts batches of
    samples (two per pair).
    """

    name = "word_similarity"

    def __init__(self, *, benchmark: str = "simlex999") -> None:
        if benchmark not in BENCHMARKS:
            raise DatasetError(
                f"unknown word-similarity benchmark {benchmark!r}",
                at="dataset reader 'word_similarity', option 'benchmark'",
                why=f"valid benchmarks: {', '.join(BENCHMARKS)}",
                next="use one of those names",
            )
        self.benchmark = benchmark

    def pairs(self, split: str) -> list[tuple[int, Pair]]:
        """``(pair index, pair)`` of ``split``: even indices calibrate, odd ones evaluate."""
        check_split(self.name, split)
        return list(enumerate(load_pairs(self.benchmark)))[SPLITS.index(split) :: 2]

    def num_samples(self, split: str) -> int | None:
        """Samples (two per pair) in ``split``."""
        return 2 * len(self.pairs(split))

    def batches(
        self, spec: InputSpec, *, batch_size: int, num_batches: int | None, split: str
    ) -> Iterator[Batch]:
        """Tokenised batches of ``split``'s words, pairs kept in file order."""
        check_token_request(self.name, spec, split, batch_size, num_batches)
        pairs = self.pairs(split)
        if num_batches is not None:
            pairs = pairs[: (batch_size * num_batches + 1) // 2]
        texts = [word for _, (a, b, _) in pairs for word in (a, b)]
        labels = torch.tensor(
            [(i, score) for i, (_, _, score) in pairs for _ in range(2)], dtype=torch.float64
        ).reshape(-1, 2)
        yield from batched(tokenize_texts(self.name, spec, texts), labels, batch_size, num_batches)
