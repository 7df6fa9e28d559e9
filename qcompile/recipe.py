"""Recipes: versioned, strict YAML files that say what to quantize, how, and what must hold.

The schema is a set of pydantic models with ``extra="forbid"``; every validation failure becomes a
:class:`RecipeError` naming the file, the key path (``calibration.method``), the bad value and the
valid choices. Files are read with PyYAML's ``SafeLoader`` only (plain data, no tags that build
objects), after a nesting-depth check, refusing duplicate keys.
"""

from __future__ import annotations

import difflib
import inspect
import re
import reprlib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from qcompile.errors import RecipeError

RECIPE_VERSION = 1
TARGETS = ("pt2e", "reference", "cpu", "cuda", "rocm", "vulkan", "ort")
PEERS = ("eager_fp32", "inductor_fp32", "pt2e_inductor_int8", "ort_fp32", "ort_int8",
         "ort_int8_dynamic", "iree_qdq", "qcompile", "qcompile_stock")
# qcompile_stock (cpu with the stock conv lowering, no VNNI microkernel) only when asked for
DEFAULT_PEERS = PEERS[:-1]
MAX_RECIPE_BYTES = 1 << 20
MAX_NESTING = 64        # recipes nest 3 deep; PyYAML's composer recurses once per level
# recipe names become folder names (out/<name>): one portable path component
_NAME = re.compile(r"\w[\w.+-]*")


def _one_of(choices: Any) -> AfterValidator:
    """A validator checking a name against ``choices()`` (looked up late: the registries import
    torch, and the recipe module should stay cheap to import)."""

    def check(name: str) -> str:
        valid = tuple(choices())
        if name not in valid:
            raise ValueError(_choices_message(name, valid))
        return name

    return AfterValidator(check)


def _zoo_names() -> tuple[str, ...]:
    from qcompile import zoo

    return zoo.names()


def _reader_names() -> tuple[str, ...]:
    import calibration

    return tuple(calibration.reader_names())


def _method_names() -> tuple[str, ...]:
    from calibration.methods import METHODS

    return tuple(METHODS)


def _max_seq_len() -> int:
    from qcompile.zoo.minilm import MAX_SEQ_LEN

    return MAX_SEQ_LEN


ZooName = Annotated[str, _one_of(_zoo_names)]
DatasetName = Annotated[str, _one_of(_reader_names)]
MethodName = Annotated[str, _one_of(_method_names)]


class _Strict(BaseModel):
    # NaN and infinities are no thresholds or sizes: a NaN threshold would fail (or pass) silently
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ModelSection(_Strict):
    zoo: ZooName | None = None
    entry: str | None = Field(default=None, description="'package.module:function' -> nn.Module")
    input_shapes: list[list[int]] | None = None
    input_dtypes: list[Literal["float32", "int64"]] | None = None
    seq_len: int | None = Field(default=None, ge=1, le=4096)
    seq_lens: list[Annotated[int, Field(ge=1)]] | None = Field(
        default=None, min_length=1, max_length=16,
        description="token models: the sequence lengths compiled (shorter inputs are padded to "
                    "the next one); seq_len, the calibration length, is added (default: the "
                    "longest)")
    dynamic_batch: bool = False
    max_batch: int = Field(default=64, ge=1, le=4096)

    @field_validator("entry")
    @classmethod
    def _entry_form(cls, entry: str | None) -> str | None:
        if entry is not None and (entry.count(":") != 1 or not all(entry.split(":"))):
            raise ValueError(f"expected 'package.module:function', got {_shown(entry)}")
        return entry

    @field_validator("seq_len")
    @classmethod
    def _token_models_only(cls, seq_len: int | None, info: ValidationInfo) -> int | None:
        from qcompile.zoo import TOKEN_MODELS

        zoo = info.data.get("zoo")
        if seq_len is not None and zoo not in TOKEN_MODELS:
            raise ValueError(f"only the zoo token models ({', '.join(TOKEN_MODELS)}) take a "
                             f"seq_len; this model is {zoo or info.data.get('entry')!r}")
        return seq_len

    @field_validator("seq_lens")
    @classmethod
    def _token_lengths(cls, lengths: list[int] | None, info: ValidationInfo
                       ) -> list[int] | None:
        from qcompile.zoo import TOKEN_MODELS

        zoo = info.data.get("zoo")
        if lengths is None:
            return None
        if zoo not in TOKEN_MODELS:
            raise ValueError(f"only the zoo token models ({', '.join(TOKEN_MODELS)}) take "
                             f"seq_lens; this model is {zoo or info.data.get('entry')!r}")
        if too_long := [n for n in lengths if n > _max_seq_len()]:
            raise ValueError(f"length {too_long[0]} is longer than {zoo!r} can take: it has "
                             f"learned positions for {_max_seq_len()} tokens; use lengths "
                             f"<= {_max_seq_len()}")
        if twice := sorted({n for n in lengths if lengths.count(n) > 1}):
            raise ValueError(f"length {twice[0]} appears twice; list each length once")
        return lengths

    @property
    def calibration_seq_len(self) -> int | None:
        """The length a token model is calibrated and evaluated at: ``seq_len``, else the
        longest of ``seq_lens`` (None: the zoo's default)."""
        if self.seq_len is not None or not self.seq_lens:
            return self.seq_len
        return max(self.seq_lens)

    @property
    def compiled_seq_lens(self) -> tuple[int, ...]:
        """``seq_lens`` with the calibration length added, ascending (empty without)."""
        if not self.seq_lens:
            return ()
        return tuple(sorted({*self.seq_lens, self.calibration_seq_len or 0}))

    @field_validator("input_shapes")
    @classmethod
    def _positive_dims(cls, shapes: list[list[int]] | None) -> list[list[int]] | None:
        for shape in shapes or ():
            if not shape or any(d < 1 or d > 1 << 20 for d in shape):
                raise ValueError(f"every shape needs dims in 1..{1 << 20}, got {_shown(shape)}")
        return shapes

    @model_validator(mode="after")
    def _one_calibration_length(self) -> ModelSection:
        if self.seq_lens and self.input_shapes is not None:
            raise ValueError("with 'seq_lens', give the calibration length as 'seq_len', not "
                             "through 'input_shapes' (drop input_shapes)")
        if self.seq_lens and self.seq_len is not None and self.seq_len > _max_seq_len():
            raise ValueError(f"seq_len {self.seq_len} is longer than the {_max_seq_len()} "
                             f"learned positions of {self.zoo!r}; seq_lens takes lengths <= "
                             f"{_max_seq_len()}")
        return self

    @model_validator(mode="after")
    def _dtypes_fit_shapes(self) -> ModelSection:
        if self.input_dtypes is not None and (self.input_shapes is None or len(
                self.input_dtypes) != len(self.input_shapes)):
            raise ValueError(f"'input_dtypes' needs one dtype per entry of 'input_shapes' (got "
                             f"{len(self.input_dtypes)} dtypes for "
                             f"{len(self.input_shapes or [])} shapes)")
        return self


class QuantizerSection(_Strict):
    kind: Literal["x86", "qcompile"] = "x86"
    weights: Literal["per_channel_symmetric", "per_tensor_symmetric"] = "per_channel_symmetric"
    activations: Literal["per_tensor_affine", "per_tensor_symmetric"] = "per_tensor_affine"
    skip: list[str] = Field(default_factory=list, description="module names kept in float")
    float_residual_stream: bool = Field(
        default=False, description="kind qcompile only: keep a transformer's residual stream "
                                   "(the sums feeding a LayerNorm and its output) in float")

    @field_validator("float_residual_stream")
    @classmethod
    def _own_quantizer_only(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("kind") != "qcompile":
            raise ValueError(f"only quantizer kind 'qcompile' can keep a float residual "
                             f"stream, the kind here is {info.data.get('kind')!r}; set "
                             f"'kind: qcompile' or drop the key")
        return value


class CalibrationSection(_Strict):
    dataset: DatasetName | None = None
    options: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    batches: int = Field(default=8, ge=1, le=100_000)
    batch_size: int = Field(default=8, ge=1, le=4096)
    method: MethodName = "histogram"
    method_options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("options")
    @classmethod
    def _reader_options(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        return _check_reader_options(info.data.get("dataset"), options)

    @field_validator("method_options")
    @classmethod
    def _method_options(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        method = info.data.get("method")
        if method is not None:   # an unknown method is reported on its own key
            from calibration.methods import check_method_options

            try:
                check_method_options(method, options)
            except RecipeError as err:
                raise ValueError(f"{err.what}; {err.why}") from None
        return options


class EvaluationSection(_Strict):
    dataset: DatasetName | None = None
    options: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    batches: int | None = Field(default=None, ge=1, le=100_000)
    batch_size: int = Field(default=16, ge=1, le=4096)

    @field_validator("options")
    @classmethod
    def _reader_options(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        return _check_reader_options(info.data.get("dataset"), options)


def _check_reader_options(dataset: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """Option names of the dataset reader, the required ones present (values are the reader's to
    check). Without a dataset the model's default one reads them: known once the model is built."""
    if dataset is None:
        return options
    import calibration

    valid = calibration.reader_options(dataset)
    if unknown := [k for k in options if k not in valid]:
        raise ValueError(f"unknown option {_shown(unknown[0])} for dataset {dataset!r}; valid "
                         f"options: {', '.join(valid) or 'none'}")
    if missing := [k for k, d in valid.items() if d is inspect.Parameter.empty
                   and k not in options]:
        raise ValueError(f"dataset {dataset!r} needs option {missing[0]!r} (options: "
                         f"{', '.join(valid)})")
    return options


class AccuracySection(_Strict):
    min_sqnr_db: float | None = None
    min_cosine: float | None = Field(default=None, ge=-1.0, le=1.0)
    min_top1_agreement: float | None = Field(default=None, ge=0.0, le=1.0)
    min_top5_agreement: float | None = Field(default=None, ge=0.0, le=1.0)
    max_abs_error: float | None = Field(default=None, ge=0.0)
    min_task_metric: float | None = None
    max_task_metric_drop: float | None = Field(default=None, ge=0.0)


class BenchmarkSection(_Strict):
    peers: list[Literal[PEERS]] = Field(default_factory=lambda: list(DEFAULT_PEERS))  # type: ignore[valid-type]
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 8])
    warmup: int = Field(default=3, ge=0, le=1000)
    repeats: int = Field(default=20, ge=1, le=100_000)


class CompileSection(_Strict):
    batch_sizes: list[Annotated[int, Field(ge=1, le=4096)]] | None = Field(
        default=None, min_length=1, max_length=16,
        description="batch sizes compiled into modules (default: 1, the evaluation batch and "
                    "the benchmark batches); other batches run in pieces")
    float_ops: Literal["fallback", "error"] = "fallback"
    keep_dir: str | None = Field(default=None, description="where a failed compile saves its IR")
    ukernel_convs: bool | None = Field(
        default=None, description="cpu: conv chains on the AVX-512 VNNI microkernel (default: "
                                  "when the host has VNNI and gcc)")
    winograd: bool = Field(
        default=True, description="cpu: 3x3 stride-1 conv chains on the microkernel as exact "
                                  "integer Winograd F(4x4, 3x3) where it fits (bit-exact); "
                                  "false: the direct kernel")


class Recipe(_Strict):
    version: int
    name: str = Field(min_length=1, max_length=200)
    description: str = ""
    model: ModelSection
    quantizer: QuantizerSection = QuantizerSection()
    calibration: CalibrationSection = CalibrationSection()
    evaluation: EvaluationSection = EvaluationSection()
    targets: list[Literal[TARGETS]] = Field(default_factory=lambda: ["reference"], min_length=1)  # type: ignore[valid-type]
    accuracy: AccuracySection = AccuracySection()
    benchmark: BenchmarkSection = BenchmarkSection()
    compile: CompileSection = CompileSection()
    path: str = Field(default="<memory>", exclude=True)

    @field_validator("name")
    @classmethod
    def _portable_name(cls, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError("a recipe name is a folder name (out/<name>): letters, digits and "
                             "'_', '-', '.', '+', starting with a letter or digit")
        return name

    @field_validator("version")
    @classmethod
    def _supported_version(cls, version: int) -> int:
        if version != RECIPE_VERSION:
            raise ValueError(f"unsupported recipe version {_shown(version)}; this qcompile reads "
                             f"version {RECIPE_VERSION}")
        return version

    @field_validator("evaluation")
    @classmethod
    def _evaluation_options(cls, e: EvaluationSection, info: ValidationInfo) -> EvaluationSection:
        calibration = info.data.get("calibration")
        if e.dataset is None and calibration is not None:   # evaluation reads that dataset too
            _check_reader_options(calibration.dataset, e.options)
        return e

    @field_validator("model")
    @classmethod
    def _one_model_source(cls, model: ModelSection) -> ModelSection:
        if (model.zoo is None) == (model.entry is None):
            raise ValueError("give exactly one of 'zoo' (a zoo model name) or 'entry' "
                             "('package.module:function')")
        if model.entry is not None and model.input_shapes is None:
            raise ValueError("'entry' models need 'input_shapes' (e.g. [[1, 3, 224, 224]])")
        return model


def _choices_message(value: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(str(value)[:200], list(choices), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown name {_shown(value)}{hint}; valid choices: {', '.join(choices)}"


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 3, 60, 40, 60
_REPR.maxtuple = _REPR.maxlist = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 4


def _shown(value: Any, limit: int = 80) -> str:
    """A bounded ``repr``: a recipe value may be a shared alias structure of astronomical size
    (a YAML "billion laughs") or an int beyond Python's str conversion limit."""
    try:
        text = _REPR.repr(value)
    except ValueError:   # only ints past the conversion limit make repr raise
        text = f"<a {type(value).__name__} holding an integer too long to print>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe file; every failure is a :class:`RecipeError`."""
    path = Path(path)
    data = _read_yaml(path)
    return recipe_from_dict(data, path=str(path))


def recipe_from_dict(data: Any, *, path: str = "<memory>") -> Recipe:
    """Validate already-parsed recipe data (``path`` names the source in error messages)."""
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path}: expected a mapping at the top level",
                          at=path, why=f"the document is a {type(data).__name__}",
                          next="start from one of the shipped recipes in recipes/")
    if "path" in data:   # a field, but qcompile's to fill: never read from the file
        raise RecipeError(f"recipe {path}: invalid value at 'path'", at=f"{path}: path",
                          why="unknown key 'path'; valid keys here: " + ", ".join(
                              k for k in Recipe.model_fields if k != "path"),
                          next="remove the key; a recipe's path is where it was read from")
    try:
        return Recipe.model_validate({**data, "path": path})
    except ValidationError as err:
        raise _recipe_error(err, path, data) from None
    except RecursionError:
        raise RecipeError(f"recipe {path}: nested too deeply", at=path,
                          why="the document nests beyond what a recipe can hold",
                          next="flatten the recipe; see recipes/ for the schema") from None


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        near = sorted(p.name for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        raise RecipeError(f"recipe file not found: {path}", at=str(path),
                          why="no such file" + (f"; recipes there: {', '.join(near)}" if near
                                                else ""),
                          next="pass the path of a recipe YAML file, e.g. recipes/digits_cnn.yaml")
    if path.stat().st_size > MAX_RECIPE_BYTES:
        raise RecipeError(f"recipe {path} is too large", at=str(path),
                          why=f"{path.stat().st_size} bytes; recipes are at most "
                              f"{MAX_RECIPE_BYTES} bytes", next="check that this is a recipe file")
    try:
        data = _parse_yaml(path, path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise RecipeError(f"recipe {path} is not UTF-8 text", at=str(path), why=str(err),
                          next="save the recipe as UTF-8") from None
    except OSError as err:
        raise RecipeError(f"cannot read recipe {path}", at=str(path),
                          why=f"{type(err).__name__}: {err.strerror or err}",
                          next="check the file's permissions") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise RecipeError(f"recipe {path} is not valid YAML", at=where,
                          why=str(getattr(err, "problem", None) or err),
                          next="fix the YAML syntax at that line") from None
    except (ValueError, RecursionError) as err:
        # PyYAML's int() of a number beyond Python's 4300-digit limit; nesting past the stack
        raise RecipeError(f"recipe {path} holds a value no recipe can hold", at=str(path),
                          why=f"{type(err).__name__}: {str(err)[:160]}",
                          next="check the file: numbers of thousands of digits or nesting "
                               "thousands deep are no recipe") from None
    if data is None:
        raise RecipeError(f"recipe {path} is empty", at=str(path), why="the file holds no data",
                          next="start from one of the shipped recipes in recipes/")
    return data


def _parse_yaml(path: Path, text: str) -> Any:
    """``yaml.safe_load`` (PyYAML's SafeLoader: plain data only), after two checks it lacks:
    nesting depth (scanned without recursion) and duplicate keys (on the composed nodes)."""
    _check_nesting(path, text)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicate_keys(path, node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


_OPEN = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken, yaml.FlowMappingStartToken,
         yaml.FlowSequenceStartToken)
_CLOSE = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)


def _check_nesting(path: Path, text: str) -> None:
    depth = 0
    for token in yaml.scan(text, Loader=yaml.SafeLoader):
        depth += isinstance(token, _OPEN) - isinstance(token, _CLOSE)
        if depth > MAX_NESTING:
            mark = token.start_mark
            raise RecipeError(f"recipe {path} nests too deeply",
                              at=f"{path}:{mark.line + 1}:{mark.column + 1}",
                              why=f"more than {MAX_NESTING} levels of mappings and lists",
                              next="a recipe nests a few levels; see recipes/ for the schema")


def _check_duplicate_keys(path: Path, root: yaml.Node | None) -> None:
    """PyYAML keeps the last of two equal keys silently; a strict recipe refuses them. Walks the
    node graph once per node (aliases share nodes, so an alias bomb stays linear here)."""
    seen: set[int] = set()
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: set[str] = set()
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value in keys:
                    mark = key.start_mark
                    raise RecipeError(f"recipe {path}: duplicate key {_shown(key.value)}",
                                      at=f"{path}:{mark.line + 1}:{mark.column + 1}",
                                      why="a key appears twice in one mapping (YAML would keep "
                                          "the last one silently)",
                                      next="keep one of the two")
                if isinstance(key, yaml.ScalarNode):
                    keys.add(key.value)
                stack += [key, value]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def _recipe_error(err: ValidationError, path: str, data: Any) -> RecipeError:
    problems = [_describe(e, data) for e in err.errors()]
    first_key, first_why = problems[0]
    more = "" if len(problems) == 1 else "; also: " + "; ".join(
        f"{k}: {w}" for k, w in problems[1:4])
    return RecipeError(f"recipe {path}: invalid value at '{first_key}'",
                       at=f"{path}: {first_key}", why=first_why + more,
                       next="fix that key; the schema is in qcompile/recipe.py and the shipped "
                            "recipes in recipes/ are examples")


def _describe(error: Any, data: Any) -> tuple[str, str]:
    loc = [str(p)[:60] for p in error["loc"]]
    key = ".".join(loc) or "<top>"
    kind = error["type"]
    if kind == "extra_forbidden":
        parent = _section_model(loc[:-1])
        keys = [k for k in parent.model_fields if k != "path"] if parent else []
        close = difflib.get_close_matches(loc[-1], keys, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return key, f"unknown key {_shown(loc[-1])}{hint}; valid keys here: " + (
            ", ".join(keys) or "?")
    if kind == "missing":
        return key, "required key is missing"
    msg = error["msg"].removeprefix("Value error, ")
    return key, f"bad value {_shown(error.get('input'))}: {msg[:300]}"


def _section_model(loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Recipe
    for part in loc:
        field = model.model_fields.get(part) if model else None
        ann = field.annotation if field else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model
