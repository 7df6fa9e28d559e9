"""Token models compiled at several sequence lengths (recipe ``model.seq_lens``): recipe checks,
the dynamic-length export, padding to a compiled length on targets reference and cpu, the
too-long input, and ``.qca`` artifacts holding every (length, batch) module."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
from tiny_models import TinyTokenModel, token_batches
from torch import nn

import qcompile
from qcompile.codegen.target import CompileOptions
from qcompile.errors import ArtifactError, CompileError, InputError, ModelError, RecipeError
from qcompile.frontend.quantize import QuantizeConfig, QuantizedModel, quantize
from qcompile.recipe import recipe_from_dict
from qcompile.runtime.seq_lens import compiled_length, seq_dims
from qcompile.targets import compile_quantized

LENGTHS = (8, 16)          # calibrated at 16
CPU = CompileOptions(batch_sizes=(1, 2), analyze=False)


def _recipe(**model: object) -> object:
    return recipe_from_dict({"version": 1, "name": "t", "model": {"zoo": "minilm", **model}})


# -- recipe -------------------------------------------------------------------------------------

def test_recipe__seq_len_is_added_and_defaults_to_the_longest():
    assert _recipe(seq_lens=[32, 16]).model.compiled_seq_lens == (16, 32)
    assert _recipe(seq_lens=[32, 16]).model.calibration_seq_len == 32
    assert _recipe(seq_lens=[16, 32], seq_len=64).model.compiled_seq_lens == (16, 32, 64)
    assert _recipe(seq_len=64).model.compiled_seq_lens == ()
    assert QuantizeConfig.from_recipe(_recipe(seq_lens=[16, 128])).seq_lens == (16, 128)


@pytest.mark.parametrize(("model", "match"), [
    ({"zoo": "resnet18", "seq_lens": [16]},
     r"model.seq_lens(.|\n)*only the zoo token models \(bert_encoder, minilm\) take seq_lens"),
    ({"seq_lens": [16, 513]}, r"length 513 is longer than 'minilm' can take(.|\n)*<= 512"),
    ({"seq_lens": [16, 32, 16]}, "length 16 appears twice"),
    ({"seq_lens": []}, r"model.seq_lens(.|\n)*at least 1 item"),
    ({"seq_lens": [0, 16]}, r"model.seq_lens.0(.|\n)*greater than or equal to 1"),
    ({"seq_lens": [16], "seq_len": 600}, "seq_len 600 is longer than the 512 learned positions"),
    ({"seq_lens": [16], "input_shapes": [[1, 16], [1, 16]]},
     "give the calibration length as 'seq_len', not through 'input_shapes'"),
])
def test_recipe__bad_seq_lens_are_refused(model, match):
    with pytest.raises(RecipeError, match=match):
        _recipe(**model)


# -- quantize -----------------------------------------------------------------------------------

def _quantize(lengths: tuple[int, ...] = LENGTHS, model: nn.Module | None = None,
              length: int = 16) -> QuantizedModel:
    cal = token_batches(4, length)
    config = QuantizeConfig(quantizer="qcompile", seq_lens=lengths)
    return quantize(model or TinyTokenModel().eval(), cal[0], cal, config)


def test_quantize__seq_lens_need_a_token_model():
    x = (torch.randn(2, 16),)
    with pytest.raises(ModelError, match=r"seq_lens needs a token model taking \(input_ids, "
                                         r"attention_mask\)(.|\n)*drop seq_lens"):
        quantize(nn.Linear(16, 4), x, [x], QuantizeConfig(seq_lens=(8, 16)))


def test_quantize__example_length_must_be_compiled():
    with pytest.raises(ModelError, match=r"length 16, not one of seq_lens \[8, 32\](.|\n)*add 16"):
        _quantize((8, 32))


@pytest.fixture(scope="module")
def quantized() -> QuantizedModel:
    return _quantize()


@pytest.fixture(scope="module")
def reference(quantized):
    return compile_quantized(quantized, "reference")


@pytest.fixture(scope="module")
def cpu(quantized):
    return compile_quantized(quantized, "cpu", CPU)


def test_quantize__exports_a_dynamic_length(quantized):
    assert quantized.seq_lens == LENGTHS and quantized.seq_why is None and quantized.dynamic_batch


# -- running ------------------------------------------------------------------------------------

def _tokens(length: int, batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batches(1, length, batch=batch, seed=length)[0]


@pytest.mark.parametrize("length", [3, 8, 11, 16])
def test_cpu__equals_reference_at_every_length(cpu, reference, length):
    x = _tokens(length)     # batch 3: pieces of 2 and 1
    got, want = cpu(*x), reference(*x)
    assert got[0].shape == (3, length, 32) and got[1].shape == (3, 32)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("length", [3, 11])
def test_reference__padded_length_matches_pt2e_and_float(quantized, reference, length):
    x = _tokens(length)
    got, pt2e, flt = reference(*x), quantized.module(*x), quantized.float_module(*x)
    for g, p, f in zip(got, pt2e, flt, strict=True):
        assert g.shape == f.shape
        assert (g - p).abs().max() < 0.05            # PT2E itself runs the length unpadded
        assert torch.nn.functional.cosine_similarity(g.flatten(), f.flatten(), 0) > 0.99


def test_reference__padding_leaves_outputs_unchanged(reference):
    """Length 5 run at 8 and at 16: the int8 softmax gives the masked keys weight 0."""
    x = _tokens(5)
    padded = [torch.nn.functional.pad(t, (0, 3)) for t in x]
    at8, at16 = reference(*x), reference.runner.runners[16](*[
        torch.nn.functional.pad(t, (0, 11)) for t in x])
    at8_direct = reference.runner.runners[8](*padded)
    assert torch.equal(at8[1], at16[1]) and torch.equal(at8[0], at16[0][:, :5])
    assert torch.equal(at8[0], at8_direct[0][:, :5])


def test_calibration_length__equals_a_model_compiled_for_that_length_alone(reference, cpu):
    alone = _quantize(())
    x = _tokens(16)
    want = compile_quantized(alone, "reference")(*x)
    for got in (reference(*x), cpu(*x),
                compile_quantized(alone, "cpu", CompileOptions(batch_sizes=(1,),
                                                               analyze=False))(*x)):
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


def test_too_long_input_is_refused(cpu, reference, quantized):
    for model in (cpu, reference, compile_quantized(quantized, "pt2e")):
        with pytest.raises(InputError, match=r"sequence length 17 exceeds the longest compiled "
                                             r"length 16 \(compiled lengths: 8, 16\)(.|\n)*"
                                             r"truncate the inputs to 16 tokens"):
            model(*_tokens(17))


def test_inputs_of_two_lengths_are_refused(cpu):
    ids, _ = _tokens(8)
    with pytest.raises(InputError, match=r"different sequence lengths \[8, 6\]"):
        cpu(ids, torch.ones(3, 6, dtype=torch.int64))


def test_report_lists_the_lengths(cpu, reference):
    assert cpu.report["compile"]["seq_lens"] == [8, 16]
    assert cpu.report["compile"]["per_seq_len"]["8"]["batch_sizes"] == [1, 2]
    assert reference.report["seq_lens"]["compiled"] == [8, 16]
    assert reference.report["seq_lens"]["output_seq_dims"] == [1, None]
    assert cpu.signature[0].describe() == "input_0: int64[1..64, 1..16]"


def test_seq_dims__only_a_dimension_equal_to_the_length_is_sliced():
    assert seq_dims({8: [(1, 8, 32), (1, 32)], 16: [(1, 16, 32), (1, 32)]}) == (1, None)
    with pytest.raises(CompileError, match=r"output 0 changes shape with the sequence length in a"
                                           r" way padding cannot undo(.|\n)*8: \[1, 256\]"):
        seq_dims({8: [(1, 256)], 16: [(1, 512)]})
    assert compiled_length((8, 16, 32), 9) == 16 and compiled_length((8, 16), 8) == 8


# -- export refusing a dynamic length -----------------------------------------------------------

class LengthBranch(TinyTokenModel):
    """Python control flow on the length: torch.export cannot keep it symbolic."""

    def forward(self, input_ids, attention_mask):
        x, pooled = super().forward(input_ids, attention_mask)
        return (x, pooled * 2) if input_ids.shape[1] > 12 else (x, pooled)


def test_static_fallback__compiles_the_calibration_length_and_says_why():
    q = _quantize(model=LengthBranch().eval())
    assert q.seq_lens == (16,) and "torch.export refused a dynamic sequence length" in q.seq_why
    model = compile_quantized(q, "reference")
    assert model.report["seq_lens"]["compiled"] == [16]
    assert "refused" in model.report["seq_lens"]["why_one"]
    with pytest.raises(InputError, match=r"shape is \[3, 8\], expected \[batch, 16\]"):
        model(*_tokens(8))


# -- artifacts ----------------------------------------------------------------------------------

def test_artifact__round_trip_with_every_length(cpu, tmp_path):
    path = cpu.save(tmp_path / "tokens.qca")
    with zipfile.ZipFile(path) as z:
        meta = json.loads(z.read("meta.json"))
        assert sorted(z.namelist()) == ["meta.json", "s16.b1.vmfb", "s16.b2.vmfb",
                                        "s8.b1.vmfb", "s8.b2.vmfb"]
    assert meta["format_version"] == 2 and meta["seq_lens"] == [8, 16]
    loaded = qcompile.load(path)
    for length in (5, 8, 16):
        x = _tokens(length)
        for g, w in zip(loaded(*x), cpu(*x), strict=True):
            assert torch.equal(g, w)
    with pytest.raises(InputError, match="exceeds the longest compiled length 16"):
        loaded(*_tokens(20))


def _edit_meta(src, dst, **changes):
    with zipfile.ZipFile(src) as z:
        members = {n: z.read(n) for n in z.namelist()}
    meta = json.loads(members["meta.json"])
    for key, value in changes.items():
        if callable(value):
            value(meta)
        else:
            meta[key] = value
    members["meta.json"] = json.dumps(meta).encode()
    with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_STORED) as z:
        for n, data in members.items():
            z.writestr(n, data)
    return dst


@pytest.mark.parametrize(("changes", "match"), [
    ({"format_version": 1}, "a version 1 artifact lists seq_lens"),
    ({"seq_lens": [8]}, "lists its sequence lengths wrongly"),
    ({"calibration_seq_len": 12}, "lists its sequence lengths wrongly"),
    ({"edit": lambda m: m["outputs"][0].update(seq_dim=2)},
     r"an output's seq_dim 2 is no dimension of length 16"),
    ({"edit": lambda m: m["outputs"][1].update(seq_dim=None) or m["outputs"][0].update(
        seq_dim=None)}, r"s8.b1.vmfb takes"),
])
def test_artifact__edited_length_metadata_is_refused(cpu, tmp_path, changes, match):
    good = cpu.save(tmp_path / "good.qca")
    edit = changes.pop("edit", None)
    bad = _edit_meta(good, tmp_path / "bad.qca", **changes, **({"_": edit} if edit else {}))
    with pytest.raises(ArtifactError, match=match):
        qcompile.load(bad)


# -- other targets and the run report -----------------------------------------------------------

def test_ort__pads_like_the_reference(quantized, reference):
    from qcompile.targets import unavailable_reason

    if why := unavailable_reason("ort"):
        pytest.skip(why)
    ort = compile_quantized(quantized, "ort", CPU)
    assert ort.report["compile"]["seq_lens"] == [8, 16]
    x = _tokens(5)
    for g, w in zip(ort(*x), reference(*x), strict=True):
        assert g.shape == w.shape and (g - w).abs().max() < 1e-4   # float islands: last bits


def test_cuda_interpreted__pads_like_the_reference(quantized, reference):
    from qcompile.codegen.triton.target import CudaOptions, compile_cuda, unavailable_reason
    from qcompile.targets.seq_lens import compile_seq_lens

    if why := unavailable_reason(True):
        pytest.skip(why)
    model = compile_seq_lens(quantized, "cuda", lambda q, o: compile_cuda(
        q, o, CudaOptions(interpret=True)), CPU)
    x = _tokens(5)
    for g, w in zip(model(*x), reference(*x), strict=True):
        assert torch.equal(g, w)


def test_run_report__every_length_checked_against_the_reference(cpu):
    from qcompile.pipeline import seq_len_exactness
    from qcompile.report.writer import _seq_lens

    got = seq_len_exactness(cpu.runner, _tokens(16))
    assert list(got) == ["8"] and got["8"]["mismatched"] == 0 and got["8"]["total"] > 0
    assert _seq_lens({"seq_lens": [8, 16]}) == ", sequence lengths [8, 16]"
