"""Recipe loader fuzzing: whatever the file holds, ``load_recipe`` returns a valid ``Recipe`` or
raises a ``RecipeError`` naming the file (and the key, when one is at fault) — never another
exception type, and never slowly (alias bombs, deep nesting, huge numbers)."""

from __future__ import annotations

import copy
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
import robustness_tally as tally
import yaml
from hypothesis import assume, given
from hypothesis import strategies as st
from pydantic import BaseModel

from qcompile.errors import RecipeError
from qcompile.recipe import Recipe, load_recipe, recipe_from_dict

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))
SHIPPED = {p.stem: yaml.safe_load(p.read_text(encoding="utf-8")) for p in RECIPES}
SLOW_LOAD_S = 5.0   # any single load slower than this is a denial of service


def _keys(model: type[BaseModel]) -> set[str]:
    out = set()
    for name, f in model.model_fields.items():
        out.add(name)
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out |= _keys(f.annotation)
    return out


KEYS = sorted(_keys(Recipe) - {"path"})
NAMES = ["digits_cnn", "resnet18", "mlp", "histogram", "minmax", "percentile", "digits",
         "random", "npz", "x86", "qcompile", "reference", "cpu", "pt2e", "fallback", "error"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    load_recipe(RECIPES[0])   # imports the registries (torch) once, outside the timed loads
    return tmp_path_factory.mktemp("fuzz")


def _write(folder: Path, data: str | bytes, name: str = "r.yaml") -> Path:
    path = folder / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8", errors="surrogatepass")
    return path


_AT = r"(:\d+:\d+|: \S.*)?"


def load_checked(path: Path, where: str) -> Recipe | RecipeError:
    """``load_recipe`` under the fuzz contract; returns the recipe or the error."""
    t0 = time.perf_counter()
    try:
        recipe = load_recipe(path)
    except RecipeError as err:
        assert str(path) in str(err), err
        assert err.at is not None and re.fullmatch(re.escape(str(path)) + _AT, err.at,
                                                   re.S), err.at
        result: Recipe | RecipeError = err
    except Exception as err:
        tally.record_unexpected(err, where)
        raise
    else:
        assert isinstance(recipe, Recipe) and recipe.path == str(path)
        result = recipe
    assert time.perf_counter() - t0 < SLOW_LOAD_S, f"{where}: load took too long"
    return result


# ---------------------------------------------------------------------------------- strategies
huge_ints = st.one_of(st.integers(), st.integers(min_value=2**63 - 2, max_value=2**70),
                      st.sampled_from([-(2**64), 10**30, 0, -1, 1, 4096, 4097]))
floats = st.floats(allow_nan=True, allow_infinity=True)
texts = st.one_of(st.text(max_size=30), st.sampled_from(NAMES + KEYS),
                  st.text(alphabet=st.characters(codec="utf-8"), max_size=10),
                  st.just("../../etc/passwd"), st.just("a" * 300), st.just(""))
scalars = st.one_of(st.none(), st.booleans(), huge_ints, floats, texts)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.sampled_from(KEYS), texts),
                                                 inner, max_size=4)), max_leaves=12)

YAML_TOKENS = [*KEYS, *NAMES, ": ", ":", "\n", "  ", "- ", "[", "]", "{", "}", ", ", "&a ", "*a",
               "!!str ", "!!int ", "!!binary ", "!!python/object:os.system ", "'", '"', "#",
               "|\n  ", ">-\n  ", "---\n", "...\n", "? ", "<<: ", "1", "-1", "0x1F", "1e999",
               ".nan", ".inf", "~", "null", "yes", "2001-12-14", "9" * 40, "é", "\u202e",
               "\t", "%YAML 1.1\n", "\x00", "\ufeff"]
yaml_like = st.lists(st.sampled_from(YAML_TOKENS), max_size=40).map("".join)


def paths_of(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a nested dict/list document."""
    out = []
    items = data.items() if isinstance(data, dict) else enumerate(data) \
        if isinstance(data, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out += paths_of(v, (*prefix, k))
    return out


def _parent(data: Any, path: tuple) -> Any:
    for p in path[:-1]:
        data = data[p]
    return data


@st.composite
def mutated_recipe(draw) -> tuple[dict, tuple, str, Any]:  # type: ignore[no-untyped-def]
    name = draw(st.sampled_from(sorted(SHIPPED)))
    data = copy.deepcopy(SHIPPED[name])
    path = draw(st.sampled_from(paths_of(data)))
    kind = draw(st.sampled_from(["set", "delete", "unknown-key", "typo", "wrap", "set"]))
    parent = _parent(data, path)
    value: Any = None
    if kind == "set":
        value = draw(values)
        parent[path[-1]] = value
    elif kind == "delete":
        del parent[path[-1]]
    elif kind == "wrap":
        parent[path[-1]] = value = [parent[path[-1]]]
    elif isinstance(parent, dict):
        key = draw(texts) if kind == "unknown-key" else str(path[-1]) + draw(
            st.sampled_from(["z", "_", "s", " "]))
        assume(key not in parent)
        if kind == "typo":   # the error may name the new key or the missing old one
            parent[key] = value = parent.pop(path[-1])
            value = path[-1] if len(path) == 1 else None
        else:
            parent[key] = draw(values)
        path = (*path[:-1], key)
    else:
        parent[path[-1]] = value = draw(values)
        kind = "set"
    return data, path, kind, value


def _dump(data: Any) -> str:
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)


def _has_nan(v: Any) -> bool:
    if isinstance(v, float):
        return math.isnan(v)
    if isinstance(v, dict):
        return any(_has_nan(x) for x in v.values())
    return isinstance(v, list) and any(_has_nan(x) for x in v)


# ---------------------------------------------------------------------------------- properties
@tally.fuzz_settings()
@given(text=st.one_of(st.text(), yaml_like))
def test_random_yaml_text__recipe_or_recipe_error(folder, text):
    tally.example("recipe: random YAML text")
    load_checked(_write(folder, text), "random YAML text")


@tally.fuzz_settings()
@given(raw=st.one_of(st.binary(max_size=200), st.binary(max_size=20).map(
    lambda b: b"version: 1\nname: " + b)))
def test_raw_bytes__recipe_or_recipe_error(folder, raw):
    tally.example("recipe: raw bytes")
    load_checked(_write(folder, raw), "raw bytes")


@tally.fuzz_settings()
@given(doc=st.one_of(values, st.dictionaries(st.sampled_from(KEYS), values, max_size=8)))
def test_random_documents__recipe_or_recipe_error(folder, doc):
    tally.example("recipe: random documents")
    load_checked(_write(folder, _dump(doc)), "random documents")


@tally.fuzz_settings()
@given(m=mutated_recipe())
def test_mutated_shipped_recipe__error_names_the_mutated_key(folder, m):
    data, path, kind, value = m
    tally.example("recipe: mutated shipped recipes")
    path_file = _write(folder, _dump(data))
    got = load_checked(path_file, f"mutated recipe ({kind} {path})")
    if isinstance(got, RecipeError):
        # the one broken key is the one named (or its section, for cross-key rules)
        named = {str(k)[:60] for k in {path[0]} | ({value} if kind == "typo" and value else set())}
        assert any(got.at.startswith(f"{path_file}: {k}") for k in named), (kind, path, got.at)
    elif kind == "set" and not _has_nan(value) and not isinstance(value, dict):
        section: Any = got.model_dump()
        for p in path[:-1]:
            section = section[p]
        assert section[path[-1]] == value, (path, value)   # strict: nothing coerced or dropped


@tally.fuzz_settings()
@given(depth=st.integers(1, 8), width=st.integers(1, 9),   # 9^8 took 12 s before the fix
       key=st.sampled_from(["name", "description", "model.input_shapes", "calibration.options",
                            "calibration.method_options", "evaluation.options", "targets",
                            "benchmark.batch_sizes", "quantizer.skip", "model", "accuracy"]),
       as_map=st.booleans())
def test_alias_bombs__refused_quickly(folder, depth, width, key, as_map):
    tally.example("recipe: YAML anchor/alias bombs")
    lines = ["x0: &a0 " + ("{k: v}" if as_map else "[lol]")]
    for i in range(1, depth + 1):
        refs = [f"*a{i - 1}"] * width
        body = "{" + ", ".join(f"k{j}: {r}" for j, r in enumerate(refs)) + "}" if as_map else \
            "[" + ", ".join(refs) + "]"
        lines.append(f"x{i}: &a{i} {body}")
    section, _, leaf = key.rpartition(".")
    target = f"*a{depth}"
    lines += ["version: 1", "name: bomb", "model: {zoo: digits_cnn}"] if key != "name" else \
        ["version: 1", "model: {zoo: digits_cnn}"]
    lines.append(f"{section}: {{{leaf}: {target}}}" if section else f"{leaf}: {target}")
    if key == "model":
        lines.remove("model: {zoo: digits_cnn}")
    got = load_checked(_write(folder, "\n".join(lines) + "\n"), f"alias bomb at {key}")
    assert isinstance(got, RecipeError)    # x0.. are unknown keys, whatever the bomb does


@tally.fuzz_settings()
@given(depth=st.integers(1, 400), opener=st.sampled_from(["[", "{a: ", "- "]))   # limit: 64
def test_deep_nesting__refused(folder, depth, opener):
    tally.example("recipe: deep nesting")
    closer = {"[": "]", "{a: ": "}", "- ": ""}[opener]
    if opener == "- ":
        text = "".join("  " * i + "- \n" for i in range(depth))
    else:
        text = "version: 1\nname: " + opener * depth + "1" + closer * depth + "\n"
    load_checked(_write(folder, text), "deep nesting")


@tally.fuzz_settings()
@given(digits=st.integers(1, 20_000), key=st.sampled_from(   # Python int() stops at 4300
    ["version", "calibration: {batches", "accuracy: {min_sqnr_db", "model: {max_batch"]),
    kind=st.sampled_from(["int", "float", "hex", "neg"]))
def test_huge_numbers__refused(folder, digits, key, kind):
    tally.example("recipe: huge numbers")
    number = {"int": "9" * digits, "float": "1" + "0" * digits + ".5",
              "hex": "0x" + "f" * digits, "neg": "-" + "9" * digits}[kind]
    value = f"{key}: {number}}}" if "{" in key else f"{key}: {number}"
    text = "\n".join(x for x in ["version: 1" if key != "version" else "", "name: big",
                                 "model: {zoo: digits_cnn}" if "model" not in key else
                                 "", value] if x) + "\n"
    if "model" in key:
        text = text.replace("model: {max_batch", "model: {zoo: digits_cnn, max_batch")
    load_checked(_write(folder, text), f"huge number at {key}")


python_values = st.recursive(
    st.one_of(scalars, st.builds(pow, st.sampled_from([10, -10]), st.integers(4300, 6000)),
              st.binary(max_size=8),
              st.frozensets(st.integers(), max_size=3), st.just(object()), st.just(...)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                            st.dictionaries(st.one_of(st.sampled_from(KEYS), st.integers(),
                                                      st.none()), inner, max_size=3)),
    max_leaves=10)


@tally.fuzz_settings()
@given(m=mutated_recipe(), value=python_values)
def test_python_api__recipe_from_dict_takes_any_object(m, value):
    """``recipe_from_dict`` gets data from Python, not YAML: ints past the str conversion
    limit, bytes, sets, arbitrary objects, self-references."""
    data, path, _, _ = m
    tally.example("recipe: Python objects through recipe_from_dict")
    node: Any = data
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    if isinstance(value, list) and value:
        value.append(value)                     # a self-referencing list
    try:
        recipe_from_dict(data, path="api.yaml")
    except RecipeError as err:
        assert err.at is not None and err.at.startswith("api.yaml") and len(str(err)) < 3000
    except Exception as err:
        tally.record_unexpected(err, "recipe_from_dict")
        raise
