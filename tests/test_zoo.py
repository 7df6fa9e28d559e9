"""The model zoo: names, errors, shapes, determinism, real weights and the digits CNN's cache."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from qcompile.errors import ModelError
from qcompile.zoo import ZooModel, build, digits_cnn, names

ALL = (
    "resnet18",
    "resnet50",
    "mobilenet_v2",
    "efficientnet_lite0",
    "bert_encoder",
    "minilm",
    "mlp",
    "digits_cnn",
)
SHORT = 16  # seq_len for the token models: enough to test them, cheap to run
OUTPUT_SHAPES = {
    "digits_cnn": (1, 10),
    "mlp": (1, 1024),
    "mobilenet_v2": (1, 1000),
    "resnet18": (1, 1000),
    "resnet50": (1, 1000),
    "efficientnet_lite0": (1, 1000),
    "minilm": (1, 384),
    "bert_encoder": (1, SHORT, 768),
}
CAT_CLASSES = range(281, 286)  # tabby, tiger cat, Persian, Siamese, Egyptian cat
CUP_CLASSES = {504, 967, 968}  # coffee mug, espresso, cup


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the digits CNN's trained weights out of the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QCOMPILE_CACHE_DIR", str(tmp_path_factory.mktemp("qcompile-cache")))
        yield


@functools.cache
def built(name: str) -> ZooModel:
    """One build per model for the whole file (token models at ``SHORT`` tokens)."""
    return build(name, seq_len=SHORT if name in ("bert_encoder", "minilm") else None)


def run(model: ZooModel, *inputs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.module(*(inputs or model.example_inputs()))


def test_names__lists_the_eight_models():
    assert sorted(names()) == sorted(ALL)


def test_build__unknown_name_suggests_closest_and_lists_valid_names():
    with pytest.raises(
        ModelError,
        match=r"unknown zoo model 'resnet19'(.|\n)*valid names: "
        r"resnet18, resnet50(.|\n)*did you mean 'resnet18'",
    ):
        build("resnet19")


def test_build__seq_len_only_for_token_models():
    with pytest.raises(ModelError, match=r"'resnet18' takes no seq_len(.|\n)*bert_encoder, minilm"):
        build("resnet18", seq_len=32)


def test_build__seq_len_beyond_positions_is_an_error():
    with pytest.raises(ModelError, match="seq_len 513 is too long for zoo model 'bert_encoder'"):
        build("bert_encoder", seq_len=513)


@pytest.mark.parametrize("name", ALL)
def test_build__runs_with_expected_shape_and_finite_output(name):
    model = built(name)
    assert model.name == name and not model.module.training
    assert all(s[0] == 1 for s in model.spec.shapes)
    out = run(model)
    assert tuple(out.shape) == OUTPUT_SHAPES[name]
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert 0.01 < out.std().item() < 20.0  # neither vanished nor exploded


@pytest.mark.parametrize("name", ["digits_cnn", "mlp", "resnet18", "minilm"])
def test_example_inputs__follow_the_spec_at_any_batch(name):
    model = built(name)
    inputs = model.example_inputs(3)
    spec = model.spec.with_batch(3)
    assert [tuple(x.shape) for x in inputs] == list(spec.shapes)
    assert [x.dtype for x in inputs] == list(spec.dtypes)
    assert all(torch.equal(a, b) for a, b in zip(inputs, model.example_inputs(3), strict=True))


def test_example_inputs__tokens_are_in_vocabulary_with_full_mask():
    ids, mask = built("bert_encoder").example_inputs(2)
    assert ids.dtype == mask.dtype == torch.int64
    assert ids.min() >= 0 and ids.max() < 30522
    assert bool((mask == 1).all())


@pytest.mark.parametrize("name", ["mlp", "resnet18", "bert_encoder"])
def test_build__is_deterministic_and_leaves_global_rng_alone(name):
    kwargs = {"seq_len": SHORT} if name == "bert_encoder" else {}
    torch.manual_seed(42)
    before = torch.get_rng_state()
    first = build(name, **kwargs)
    assert torch.equal(torch.get_rng_state(), before)
    second = build(name, **kwargs)
    assert torch.equal(run(first), run(second))


def test_token_models__tokenizer_pads_and_truncates_to_seq_len():
    ids, mask = built("minilm").spec.tokenizer(["A man is playing a guitar.", "word " * 40], 16)
    assert ids.shape == mask.shape == (2, 16) and ids.dtype == mask.dtype == torch.int64
    assert ids[0, 0].item() == 101 and mask[0].sum().item() == 9 and mask[1].sum().item() == 16


def test_digits_cnn__held_out_accuracy():
    assert digits_cnn.accuracy(built("digits_cnn").module) >= 0.97


def test_digits_cnn__second_build_uses_the_cache(monkeypatch):
    built("digits_cnn")  # trained and cached once

    def no_training(*args, **kwargs):
        raise AssertionError("digits_cnn retrained although its weights are cached")

    monkeypatch.setattr(digits_cnn, "train", no_training)
    assert digits_cnn.accuracy(build("digits_cnn").module) >= 0.97


def test_digits_cnn__corrupt_cache_is_retrained_and_replaced(tmp_path, monkeypatch):
    trained = built("digits_cnn").module.state_dict()
    calls = []

    def fake_train(*args, **kwargs):  # the recovery logic is under test, not the training
        calls.append(args)
        return trained

    monkeypatch.setenv("QCOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(digits_cnn, "train", fake_train)
    path = digits_cnn.cache_path()
    assert path.parent == tmp_path
    path.write_bytes(b"not a torch file")
    model = build("digits_cnn")
    assert len(calls) == 1
    assert digits_cnn.accuracy(model.module) >= 0.97
    state = torch.load(path, map_location="cpu", weights_only=True)  # replaced by a good file
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind


def test_digits_cnn__training_is_reproducible():
    short = {**digits_cnn.HYPER, "epochs": 2}
    first, second = digits_cnn.train(short), digits_cnn.train(short)
    assert all(torch.equal(first[k], second[k]) for k in first)


def _photo(model: ZooModel, image: np.ndarray) -> torch.Tensor:
    """HWC uint8 photo -> resize short side to 256, centre-crop 224, normalise with the spec."""
    x = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255.0
    h, w = x.shape[2:]
    x = torch.nn.functional.interpolate(
        x,
        size=(round(h * 256 / min(h, w)), round(w * 256 / min(h, w))),
        mode="bilinear",
        antialias=True,
    )
    top, left = (x.shape[2] - 224) // 2, (x.shape[3] - 224) // 2
    x = x[:, :, top : top + 224, left : left + 224]
    mean = torch.tensor(model.spec.mean).view(1, 3, 1, 1)
    return (x - mean) / torch.tensor(model.spec.std).view(1, 3, 1, 1)


def test_efficientnet_lite0__real_weights_recognise_photos():
    import skimage.data

    model = built("efficientnet_lite0")
    cat = run(model, _photo(model, skimage.data.chelsea()))
    coffee = run(model, _photo(model, skimage.data.coffee()))
    assert cat.argmax().item() in CAT_CLASSES
    assert CUP_CLASSES & set(coffee.topk(5).indices[0].tolist())


def test_minilm__similar_sentences_embed_closer():
    model = built("minilm")
    ids, mask = model.spec.tokenizer(
        [
            "A man is playing a guitar.",
            "A person plays an instrument.",
            "The stock market fell today.",
        ],
        32,
    )
    emb = run(model, ids, mask)
    cos = torch.nn.functional.cosine_similarity
    assert cos(emb[0], emb[1], dim=0) > cos(emb[0], emb[2], dim=0) + 0.3


def test_minilm__embedding_ignores_padding():
    model = built("minilm")
    short = run(model, *model.spec.tokenizer(["A man is playing a guitar."], 12))
    long = run(model, *model.spec.tokenizer(["A man is playing a guitar."], 24))
    torch.testing.assert_close(short, long, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["digits_cnn", "mlp"])
def test_small_models__export_with_dynamic_batch_and_quantize_with_pt2e(name):
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    model = built(name)
    inputs = model.example_inputs(2)  # batch 1 would be specialised away by torch.export
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model.module, inputs, dynamic_shapes=({0: batch},))
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(ep.module(), quantizer)
    prepared(*inputs)
    converted = convert_pt2e(prepared)
    out, ref = converted(*model.example_inputs(5)), run(model, *model.example_inputs(5))
    assert out.shape == ref.shape
    assert 10 * torch.log10(ref.pow(2).mean() / (out - ref).pow(2).mean()) > 20.0  # SQNR, dB


def test_zoo_model__module_is_float32_on_cpu():
    for name in ("digits_cnn", "efficientnet_lite0", "minilm"):
        params = list(built(name).module.parameters())
        assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params)


def test_cache_dir__defaults_under_home(monkeypatch):
    from qcompile.zoo._common import cache_dir

    monkeypatch.delenv("QCOMPILE_CACHE_DIR", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "qcompile"
