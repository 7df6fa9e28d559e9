"""Recipe loading: every shipped recipe loads; every malformed one fails with file, key, choices."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from qcompile.errors import RecipeError
from qcompile.recipe import load_recipe

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))
SHIPPED = {"digits_cnn", "resnet18", "resnet50", "mobilenet_v2", "efficientnet_lite0",
           "bert_encoder", "minilm", "mlp"}

MINIMAL = {"version": 1, "name": "t", "model": {"zoo": "digits_cnn"}}


def write(tmp_path: Path, data: object, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data), encoding="utf-8")
    return path


def with_key(path: str, value: object) -> dict:
    data = yaml.safe_load(yaml.safe_dump(MINIMAL))
    *parents, last = path.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return data


def test_every_model_has_a_shipped_recipe():
    assert {p.stem for p in RECIPES} >= SHIPPED


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_shipped_recipe_loads(path):
    recipe = load_recipe(path)
    assert recipe.version == 1 and recipe.path == str(path)
    assert recipe.targets


def test_minimal_recipe_gets_defaults(tmp_path):
    r = load_recipe(write(tmp_path, MINIMAL))
    assert r.calibration.method == "histogram" and r.quantizer.kind == "x86"
    assert r.targets == ["reference"]


def test_unknown_key_names_file_key_and_valid_keys(tmp_path):
    path = write(tmp_path, with_key("calibration.batchez", 3))
    with pytest.raises(RecipeError, match=re.escape(f"{path}: calibration.batchez")) as e:
        load_recipe(path)
    assert "unknown key 'batchez'" in str(e.value)
    assert "valid keys here: dataset, options, batches, batch_size" in str(e.value)


def test_unknown_top_level_key_lists_sections(tmp_path):
    with pytest.raises(RecipeError, match="valid keys here: version, name, description, model"):
        load_recipe(write(tmp_path, with_key("modle", {})))


def test_wrong_type_names_key_and_value(tmp_path):
    path = write(tmp_path, with_key("calibration.batches", "eight"))
    with pytest.raises(RecipeError, match=r"(?s)calibration\.batches.*bad value 'eight'"):
        load_recipe(path)


def test_bool_is_not_an_integer(tmp_path):
    with pytest.raises(RecipeError, match=r"(?s)calibration\.batch_size"):
        load_recipe(write(tmp_path, with_key("calibration.batch_size", True)))


def test_out_of_range_number(tmp_path):
    with pytest.raises(RecipeError, match=r"(?s)calibration\.batches.*greater than or equal to 1"):
        load_recipe(write(tmp_path, with_key("calibration.batches", 0)))


def test_unknown_model_lists_zoo_and_suggests(tmp_path):
    with pytest.raises(RecipeError, match=r"(?s)model\.zoo.*'resnet81'.*did you mean 'resnet18'"
                                          r".*valid choices: .*digits_cnn"):
        load_recipe(write(tmp_path, with_key("model.zoo", "resnet81")))


def test_unknown_method_lists_methods(tmp_path):
    with pytest.raises(RecipeError, match=r"(?s)calibration\.method.*'minmaxx'.*valid choices: "
                                          r".*minmax.*histogram"):
        load_recipe(write(tmp_path, with_key("calibration.method", "minmaxx")))


def test_unknown_dataset_lists_readers(tmp_path):
    with pytest.raises(RecipeError, match=r"(?s)evaluation\.dataset.*choices: .*sample_photos"):
        load_recipe(write(tmp_path, with_key("evaluation.dataset", "imagenet")))


def test_unknown_target_lists_targets(tmp_path):
    with pytest.raises(RecipeError, match=r"(?s)targets\.0.*'tpu'.*'reference'"):
        load_recipe(write(tmp_path, with_key("targets", ["tpu"])))


def test_missing_file_names_path_and_neighbours(tmp_path):
    write(tmp_path, MINIMAL, "real.yaml")
    with pytest.raises(RecipeError, match=r"(?s)recipe file not found: .*nope\.yaml.*real\.yaml"):
        load_recipe(tmp_path / "nope.yaml")


def test_missing_required_key(tmp_path):
    data = dict(MINIMAL)
    del data["model"]
    with pytest.raises(RecipeError, match=r"(?s): model(.|\n)*required key is missing"):
        load_recipe(write(tmp_path, data))


def test_model_needs_exactly_one_source(tmp_path):
    with pytest.raises(RecipeError, match="exactly one of 'zoo'"):
        load_recipe(write(tmp_path, with_key("model.entry", "pkg.mod:fn")))


def test_entry_needs_shapes(tmp_path):
    data = {**MINIMAL, "model": {"entry": "pkg.mod:fn"}}
    with pytest.raises(RecipeError, match="'entry' models need 'input_shapes'"):
        load_recipe(write(tmp_path, data))


def test_bad_entry_form(tmp_path):
    data = {**MINIMAL, "model": {"entry": "no_colon", "input_shapes": [[1, 4]]}}
    with pytest.raises(RecipeError, match=r"(?s)model\.entry.*'package\.module:function'"):
        load_recipe(write(tmp_path, data))


def test_unsupported_version(tmp_path):
    with pytest.raises(RecipeError, match=r"(?s): version.*unsupported recipe version 2"):
        load_recipe(write(tmp_path, {**MINIMAL, "version": 2}))


def test_invalid_yaml_names_line(tmp_path):
    path = write(tmp_path, "version: 1\nmodel: {zoo: [unclosed\n")
    with pytest.raises(RecipeError, match=rf"(?s)not valid YAML.*{re.escape(str(path))}:\d+:\d+"):
        load_recipe(path)


def test_empty_file(tmp_path):
    with pytest.raises(RecipeError, match="is empty"):
        load_recipe(write(tmp_path, ""))


def test_top_level_list(tmp_path):
    with pytest.raises(RecipeError, match="expected a mapping at the top level"):
        load_recipe(write(tmp_path, "- 1\n- 2\n"))


def test_not_utf8(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(b"version: 1\nname: \xff\xfe\n")
    with pytest.raises(RecipeError, match="not UTF-8"):
        load_recipe(path)


def test_yaml_python_tags_are_refused(tmp_path):
    path = write(tmp_path, "version: 1\nname: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(path)


def test_several_problems_are_all_named(tmp_path):
    data = with_key("calibration.batches", -1)
    data["quantizer"] = {"weights": "per_row"}
    with pytest.raises(RecipeError, match="also: ") as e:
        load_recipe(write(tmp_path, data))
    assert "quantizer.weights" in str(e.value) and "calibration.batches" in str(e.value)


def test_float_residual_stream__needs_the_qcompile_quantizer(tmp_path):
    path = write(tmp_path, with_key("quantizer.float_residual_stream", True))
    with pytest.raises(RecipeError, match=r"(?s)quantizer\.float_residual_stream.*bad value True"
                                          r".*kind 'qcompile'.*'x86'"):
        load_recipe(path)


def test_float_residual_stream__reaches_the_quantize_config(tmp_path):
    from qcompile.frontend.quantize import QuantizeConfig

    data = with_key("quantizer.float_residual_stream", True)
    data["quantizer"]["kind"] = "qcompile"
    recipe = load_recipe(write(tmp_path, data))
    config = QuantizeConfig.from_recipe(recipe)
    assert config.quantizer == "qcompile" and config.float_residual_stream
    assert not QuantizeConfig.from_recipe(load_recipe(write(tmp_path, MINIMAL, "m.yaml"))
                                          ).float_residual_stream


def test_compile_winograd__reaches_the_target_options_and_a_bad_value_is_named(tmp_path):
    from qcompile.pipeline import compile_options

    assert compile_options(load_recipe(write(tmp_path, MINIMAL, "m.yaml")), None).winograd
    off = load_recipe(write(tmp_path, with_key("compile.winograd", False)))
    assert compile_options(off, None).winograd is False
    with pytest.raises(RecipeError, match=r"(?s)compile\.winograd.*bad value 'sometimes'"):
        load_recipe(write(tmp_path, with_key("compile.winograd", "sometimes"), "b.yaml"))
