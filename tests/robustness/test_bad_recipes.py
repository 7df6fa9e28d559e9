"""Hand-written bad recipes: each fails with a ``RecipeError`` (or the model/dataset error of a
later stage) naming the file and the key, and through the CLI exits 2 with the message alone: no
traceback, nothing written to the ``--out`` folder."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import robustness_tally as tally
from typer.testing import CliRunner

from qcompile.cli import app
from qcompile.errors import QCompileError, RecipeError
from qcompile.recipe import MAX_RECIPE_BYTES, load_recipe

BASE = "version: 1\nname: bad\nmodel: {zoo: digits_cnn}\n"
cli = CliRunner()

# (id, file text, what the error names: a key path or a phrase)
BAD = [
    ("empty-file", "", "is empty"),
    ("only-comments", "# nothing here\n", "is empty"),
    ("top-level-list", "- version: 1\n", "expected a mapping"),
    ("top-level-scalar", "recipe\n", "expected a mapping"),
    ("version-2", BASE.replace("version: 1", "version: 2"), ": version"),
    ("version-string", BASE.replace("version: 1", "version: '1'"), ": version"),
    ("version-missing", BASE.replace("version: 1\n", ""), ": version"),
    ("name-missing", BASE.replace("name: bad\n", ""), ": name"),
    ("name-escapes-out-folder", BASE.replace("name: bad", "name: ../../escape"), ": name"),
    ("name-absolute-path", BASE.replace("name: bad", "name: /tmp/x"), ": name"),
    ("model-missing", "version: 1\nname: bad\n", ": model"),
    ("zoo-typo", BASE.replace("digits_cnn", "digits_cnm"), ": model.zoo"),
    ("zoo-and-entry", BASE.replace("{zoo: digits_cnn}", "{zoo: mlp, entry: 'a.b:c'}"),
     ": model"),
    ("entry-without-shapes", BASE.replace("{zoo: digits_cnn}", "{entry: 'a.b:c'}"), ": model"),
    ("entry-without-colon", BASE.replace("{zoo: digits_cnn}",
                                         "{entry: a.b, input_shapes: [[1, 4]]}"),
     ": model.entry"),
    ("zero-dim-shape", BASE.replace("{zoo: digits_cnn}", "{zoo: digits_cnn, input_shapes: "
                                                         "[[1, 0, 8, 8]]}"),
     ": model.input_shapes"),
    ("dtypes-without-shapes", BASE.replace("{zoo: digits_cnn}", "{zoo: mlp, input_dtypes: "
                                                                "[int64]}"), ": model"),
    ("seq-len-on-a-cnn", BASE.replace("{zoo: digits_cnn}", "{zoo: digits_cnn, seq_len: 16}"),
     ": model.seq_len"),
    ("max-batch-zero", BASE.replace("{zoo: digits_cnn}", "{zoo: digits_cnn, max_batch: 0}"),
     ": model.max_batch"),
    ("quantizer-kind", BASE + "quantizer: {kind: avx512}\n", ": quantizer.kind"),
    ("float-residual-on-x86", BASE + "quantizer: {kind: x86, float_residual_stream: true}\n",
     ": quantizer.float_residual_stream"),
    ("skip-not-a-list", BASE + "quantizer: {skip: conv1}\n", ": quantizer.skip"),
    ("method-typo", BASE + "calibration: {method: histogramm}\n", ": calibration.method"),
    ("batches-zero", BASE + "calibration: {batches: 0}\n", ": calibration.batches"),
    ("batches-infinite", BASE + "calibration: {batches: .inf}\n", ": calibration.batches"),
    ("batches-float", BASE + "calibration: {batches: 8.0}\n", ": calibration.batches"),
    ("batches-bool", BASE + "calibration: {batches: true}\n", ": calibration.batches"),
    ("method-option-unknown", BASE + "calibration: {method: histogram, method_options: "
                                     "{binz: 64}}\n", ": calibration.method_options"),
    ("method-option-range", BASE + "calibration: {method: percentile, method_options: "
                                   "{percentile: 200}}\n", ": calibration.method_options"),
    ("dataset-option-unknown", BASE + "calibration: {dataset: digits, options: {sead: 1}}\n",
     ": calibration.options"),
    ("npz-without-path", BASE + "calibration: {dataset: npz}\n", ": calibration.options"),
    ("evaluation-dataset", BASE + "evaluation: {dataset: imagenet}\n", ": evaluation.dataset"),
    ("evaluation-option-of-calibration-dataset",
     BASE + "calibration: {dataset: random}\nevaluation: {options: {sed: 1}}\n", ": evaluation"),
    ("targets-empty", BASE + "targets: []\n", ": targets"),
    ("targets-unknown", BASE + "targets: [gpu]\n", ": targets.0"),
    ("targets-string", BASE + "targets: reference\n", ": targets"),
    ("cosine-above-one", BASE + "accuracy: {min_cosine: 2}\n", ": accuracy.min_cosine"),
    ("threshold-nan", BASE + "accuracy: {min_sqnr_db: .nan}\n", ": accuracy.min_sqnr_db"),
    ("peer-unknown", BASE + "benchmark: {peers: [tensorrt]}\n", ": benchmark.peers.0"),
    ("compile-batches-empty", BASE + "compile: {batch_sizes: []}\n", ": compile.batch_sizes"),
    ("float-ops-policy", BASE + "compile: {float_ops: ignore}\n", ": compile.float_ops"),
    ("unknown-section", BASE + "calibraton: {batches: 2}\n", ": calibraton"),
    ("unknown-key-lookalike", BASE + "calibration: {b\u0430tches: 2}\n",
     "did you mean 'batches'"),
    ("path-key", BASE + "path: /etc/passwd\n", ": path"),
    ("duplicate-key", BASE + "calibration: {batches: 2, batches: 200}\n", ":4:"),
    ("duplicate-section", BASE + "targets: [pt2e]\ntargets: [cpu]\n", ":5:"),
    ("tab-indent", "version: 1\nmodel:\n\tzoo: mlp\n", "not valid YAML"),
    ("python-tag", "version: !!python/object/apply:os.system ['true']\n", "not valid YAML"),
    ("two-documents", BASE + "---\n" + BASE, "not valid YAML"),
    ("huge-int", BASE.replace("version: 1", "version: " + "9" * 5000), "no recipe can hold"),
    ("deep-nesting", BASE + "description: " + "[" * 500 + "]" * 500 + "\n", "nests too deeply"),
    ("deep-nesting-20000", BASE + "description: " + "{a: " * 20_000 + "1" + "}" * 20_000 + "\n",
     "nests too deeply"),
    ("alias-bomb", "a: &a [x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 8)}]\n"
        for i in range(8)) + BASE + "description: *i\n", ": "),
]
BAD_BYTES = [
    ("latin-1", b"version: 1\nname: caf\xe9\n", "not UTF-8"),
    ("utf-16", "version: 1\n".encode("utf-16"), "not UTF-8"),
    ("too-large", b"# " + b"x" * MAX_RECIPE_BYTES + b"\n", "too large"),
]


def _write(folder: Path, case_id: str, data: str | bytes) -> Path:
    path = folder / f"{case_id}.yaml"
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


@pytest.mark.parametrize("case_id, data, names", BAD + BAD_BYTES, ids=[c[0] for c in
                                                                      BAD + BAD_BYTES])
def test_bad_recipe__recipe_error_names_file_and_key(tmp_path, case_id, data, names):
    path = _write(tmp_path, case_id, data)
    try:
        with pytest.raises(RecipeError) as err:
            load_recipe(path)
    except BaseException as unexpected:
        tally.record_unexpected(unexpected, f"bad recipe {case_id}")
        raise
    tally.case("bad-recipe cases", case_id)
    assert str(path) in str(err.value) and err.value.at.startswith(str(path))
    assert names in err.value.at or names in str(err.value), str(err.value)
    assert len(str(err.value).splitlines()) <= 6 and len(str(err.value)) < 1500


def test_missing_and_unreadable_recipe_files(tmp_path, monkeypatch):
    for case_id, path in [("no-such-file", tmp_path / "none.yaml"), ("a-directory", tmp_path)]:
        with pytest.raises(RecipeError, match="not found"):
            load_recipe(path)
        tally.case("bad-recipe cases", case_id)
    path = _write(tmp_path, "locked", BASE)

    def denied(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", denied)   # root reads any file: simulate the denial
    with pytest.raises(RecipeError, match="(?s)cannot read recipe .*Permission denied"):
        load_recipe(path)
    tally.case("bad-recipe cases", "permission-denied")


def _assert_cli_refuses(args: list[str], out: Path, message: str) -> None:
    result = cli.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception   # not a crash
    assert "Traceback" not in result.output
    assert result.output.startswith("qcompile: error: "), result.output
    assert re.search(message, result.output), result.output
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


CLI_CASES = [c for c in BAD if c[0] in {
    "empty-file", "version-2", "name-escapes-out-folder", "zoo-typo", "seq-len-on-a-cnn",
    "batches-infinite", "method-option-range", "npz-without-path", "targets-unknown",
    "duplicate-key", "python-tag", "huge-int", "deep-nesting", "alias-bomb", "path-key"}]


@pytest.mark.parametrize("command", ["run", "check", "compile", "inspect"])
@pytest.mark.parametrize("case_id, data, names", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_recipe__cli_exits_2_without_traceback_or_output(tmp_path, command, case_id, data,
                                                             names):
    path = _write(tmp_path, case_id, data)
    out = tmp_path / "out"
    args = {"run": ["run", str(path), "--out", str(out), "-q"],
            "check": ["check", str(path), "--out", str(out), "-q"],
            "compile": ["compile", str(path), "-o", str(out / "m.qca"), "-q"],
            "inspect": ["inspect", str(path), "--dump-ir", str(out)]}[command]
    _assert_cli_refuses(args, out, re.escape(str(path)))


# failures only a later stage can see: the model, the dataset, the command line
LATE = [
    ("shapes-do-not-fit-model", BASE.replace("{zoo: digits_cnn}", "{zoo: digits_cnn, "
                                             "input_shapes: [[1, 8, 8]]}"),
     r"model\.input_shapes does not fit"),
    ("entry-not-importable", BASE.replace("{zoo: digits_cnn}", "{entry: 'no_such_pkg.m:f', "
                                          "input_shapes: [[1, 4]]}"),
     r"cannot load model entry .*\n  at: .*: model\.entry"),
    ("npz-folder-missing", BASE.replace("{zoo: digits_cnn}", "{zoo: mlp}") +
     "calibration: {dataset: npz, options: {path: /nonexistent/npz}}\n",
     r"npz folder not found: /nonexistent/npz"),
]


@pytest.mark.parametrize("case_id, data, message", LATE, ids=[c[0] for c in LATE])
def test_recipe_failing_after_load__cli_exits_2_with_the_key(tmp_path, case_id, data, message):
    path = _write(tmp_path, case_id, data)
    out = tmp_path / "out"
    _assert_cli_refuses(["run", str(path), "--out", str(out), "-q"], out, message)
    tally.case("bad-recipe cases", case_id)


def test_unknown_target_on_the_command_line(tmp_path):
    path = _write(tmp_path, "ok", BASE)
    out = tmp_path / "out"
    _assert_cli_refuses(["run", str(path), "--target", "gpu", "--out", str(out)], out,
                        "unknown target 'gpu'")
    tally.case("bad-recipe cases", "cli-unknown-target")


def test_every_error_class_exits_2_by_default():
    assert all(c.exit_code == 2 for c in QCompileError.__subclasses__()
               if c.__name__ != "AccuracyError")
