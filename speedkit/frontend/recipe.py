"""Recipes: one YAML file that says what to train and which quick wins to try.

A recipe follows LightningCLI's convention for the model, the data and the Trainer, and adds
the ladder of rungs and how to measure them::

    model:
      class_path: speedkit.demos.NaiveGPT          # any LightningModule by import path
      init_args: {size: tiny}
    data: {synthetic: tokens, batch_size: 8}       # or {class_path: ..., init_args: {...}}
    trainer: {max_steps: 50, logger: false}        # lightning.pytorch.Trainer keyword arguments
    ladder: [tf32, autocast, {name: compile, options: {mode: default}}]   # omitted: the default ladder
    measure: {steps: 10}                           # overrides configs/defaults.yaml `measure:`
    report: {formats: [json, md], title: my run}
    seed: 0

:func:`load_recipe` validates everything before any work starts (classes are imported and their
arguments checked against the constructor's signature, but nothing is built) and raises
:class:`~speedkit.errors.ConfigError` naming the offending field, e.g. ``ladder[2].options.mode``.
The ``build_*`` methods of :class:`Recipe` then construct the objects. :func:`dump_recipe` writes
a recipe back with a new ladder (the ``optimized.yaml`` of a run).

User classes are imported from the directory of the recipe file or the current directory as well
as from installed packages.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import sys
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from speedkit.config import default_ladder
from speedkit.errors import ConfigError
from speedkit.files import write_text_atomic
from speedkit.frontend.recipe_checks import _check, _import_class, _init_args, _signature
from speedkit.measure.config import MeasureConfig
from speedkit.options import describe_value as _describe
from speedkit.options import one_line as _one_line
from speedkit.options import unknown_name as _unknown

if TYPE_CHECKING:  # lightning and torch are imported only when a recipe is loaded
    import lightning.pytorch as pl

    from speedkit.rungs import Rung

TOP_LEVEL_KEYS = ("model", "data", "trainer", "ladder", "measure", "report", "seed")
SYNTHETIC_DATA = {"tokens": "speedkit.demos.SyntheticTokens", "vectors": "speedkit.demos.SyntheticVectors"}
REPORT_FORMATS = ("json", "md", "html")
REPORT_DEFAULTS: dict[str, Any] = {"formats": ["json", "md", "html"], "title": None}

#: Trainer arguments that may be given as class_path specs, and the base class each must extend
_TRAINER_OBJECTS = {
    "callbacks": "lightning.pytorch.callbacks.Callback",
    "logger": "lightning.pytorch.loggers.Logger",
    "profiler": "lightning.pytorch.profilers.Profiler",
    "strategy": "lightning.pytorch.strategies.Strategy",
    "accelerator": "lightning.pytorch.accelerators.Accelerator",
    "plugins": None,
}

_EXAMPLE = "e.g. model: {class_path: speedkit.demos.NaiveGPT, init_args: {size: tiny}}"


# -- the recipe ------------------------------------------------------------------------------


@dataclass
class ClassSpec:
    """A class named by import path and the keyword arguments to construct it with."""

    class_path: str
    cls: type
    init_args: dict[str, Any]
    #: field path of ``init_args`` in the recipe (``model.init_args``), named by :meth:`build`'s errors
    where: str = "init_args"

    def build(self) -> Any:
        """Construct the class; an exception of its constructor becomes a one-line ConfigError."""
        try:
            return self.cls(**copy.deepcopy(self.init_args))
        except Exception as exc:  # the user's constructor rejected its arguments
            raise ConfigError(self.where, f"{self.cls.__name__}(...) raised {type(exc).__name__}: {_one_line(exc)}") from None


@dataclass
class Recipe:
    """A validated recipe. Nothing in it is built until a ``build_*`` method is called."""

    #: the recipe file, or None when loaded from a mapping or text
    path: Path | None
    #: the parsed YAML mapping, untouched (written back by :func:`dump_recipe`)
    raw: dict[str, Any]
    model: ClassSpec
    #: None only when the model class defines its own ``train_dataloader``
    data: ClassSpec | None
    #: Trainer keyword arguments; class_path specs (callbacks, logger) are built by build_trainer_kwargs
    trainer: dict[str, Any]
    #: the recipe's rungs; configs/defaults.yaml ``ladder:`` where it lists none (``ladder_given`` False)
    ladder: list[Rung]
    #: configs/defaults.yaml ``measure:`` overridden by the recipe
    measure: MeasureConfig
    report: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(REPORT_DEFAULTS))
    seed: int = 0
    ladder_given: bool = True

    @property
    def processes(self) -> int | None:
        """How many processes the Trainer runs (devices per node x nodes), None where this machine
        decides it (``devices: auto`` or ``-1``)."""
        return _process_count(self.trainer)

    def build_model(self) -> pl.LightningModule:
        """A fresh model; call ``lightning.seed_everything(recipe.seed)`` first for repeatable weights."""
        return self.model.build()

    def build_datamodule(self) -> pl.LightningDataModule | None:
        """A fresh datamodule, or None when the model brings its own ``train_dataloader``."""
        return None if self.data is None else self.data.build()

    def build_trainer_kwargs(self) -> dict[str, Any]:
        """The Trainer keyword arguments, with callbacks and other class_path specs instantiated."""
        out: dict[str, Any] = {}
        for key, value in self.trainer.items():
            if isinstance(value, ClassSpec):
                out[key] = value.build()
            elif isinstance(value, list) and any(isinstance(v, ClassSpec) for v in value):
                out[key] = [v.build() if isinstance(v, ClassSpec) else copy.deepcopy(v) for v in value]
            else:
                out[key] = copy.deepcopy(value)
        return out


def embedded_default_path() -> Path:
    """The recipe shipped with speedkit and used when none is given (a tiny GPT on the CPU)."""
    return Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"


# -- loading ---------------------------------------------------------------------------------


def load_recipe(source: str | Path | dict[str, Any], overrides: Iterable[tuple[str, Any]] = ()) -> Recipe:
    """Load and fully validate a recipe from a YAML file path or an already parsed mapping.

    ``overrides`` are ``("trainer.max_steps", 50)`` pairs applied before validation (the CLI's
    ``--trainer.max_steps 50``).

    Raises:
        ConfigError: on any problem, naming the field (``measure.steps``), what was expected
            and what was found, in one line.
    """
    if isinstance(source, dict):
        return _validate(apply_overrides(copy.deepcopy(source), overrides), None)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError("recipe", f"expected a path to a YAML file or a mapping, found {type(source).__name__}")
    path = Path(source).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("recipe", f"file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError("recipe", f"expected a YAML file, found a directory: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("recipe", f"cannot read {path}: {_one_line(exc)}") from None
    return _validate(apply_overrides(_parse_yaml(text), overrides), path.resolve())


def apply_overrides(raw: dict[str, Any], overrides: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Set ``a.b.c`` keys of a parsed recipe (creating mappings on the way), LightningCLI-style."""
    for key, value in overrides:
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(f"--{key}", "expected a dotted key such as --trainer.max_steps")
        node = raw
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"--{key}", f"{where} is {_describe(child)}, not a mapping; cannot set {key}")
            node = child
        node[parts[-1]] = value
    return raw


def load_recipe_text(text: str) -> Recipe:
    """Load and validate a recipe from YAML text (``Recipe.path`` is None)."""
    return _validate(_parse_yaml(text), None)


def dump_recipe(raw: dict[str, Any], ladder_specs: list[Any], path: Path, header: str = "") -> None:
    """Write ``raw`` back as YAML with its ladder replaced by ``ladder_specs``.

    Key order and every other section are kept. ``ladder_specs`` holds rung names, ``{name, options}``
    mappings or Rung instances (written as a bare name when their options are the defaults).
    ``header`` becomes leading ``# `` comment lines. Written whole or not at all (OutputError).
    """
    from speedkit import rungs

    specs = [_rung_spec(s) for s in ladder_specs]
    rungs.make_all(specs, "ladder")  # the file written must load again
    out = {key: (specs if key == "ladder" else copy.deepcopy(value)) for key, value in raw.items()}
    out.setdefault("ladder", specs)
    body = yaml.dump(out, Dumper=_Dumper, sort_keys=False, default_flow_style=None, allow_unicode=True, width=100)
    comments = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines()) if header else ""
    write_text_atomic(path, comments + body)


# -- YAML ------------------------------------------------------------------------------------

# PyYAML follows YAML 1.1, which reads `1e-3` as a string; read (and quote) it as a float instead.
_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads 1e-3 as a float and refuses duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges may override keys on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                mark = key_node.start_mark
                raise ConfigError(
                    "recipe", f"duplicate key {key!r} at line {mark.line + 1}, column {mark.column + 1}; give each key once"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes strings _Loader would read as floats."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789"))


def _parse_yaml(text: str) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "an unknown position"
        problem = exc.problem or exc.context or "syntax error"
        raise ConfigError("recipe", f"invalid YAML at {where}: {_one_line(problem)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("recipe", f"invalid YAML: {_one_line(exc)}") from None
    if data is None:
        raise ConfigError("recipe", "the recipe is empty; expected a mapping with at least model: and ladder:")
    if not isinstance(data, dict):
        raise ConfigError("recipe", f"expected a mapping at the top level (model:, ladder:, ...), found {_describe(data)}")
    return data


# -- validation ------------------------------------------------------------------------------


def _validate(raw: dict[str, Any], path: Path | None) -> Recipe:
    from speedkit import rungs

    if not isinstance(raw, dict):
        raise ConfigError("recipe", f"expected a mapping at the top level, found {_describe(raw)}")
    for key in raw:
        if key not in TOP_LEVEL_KEYS:
            raise ConfigError(str(key), _unknown("top-level key", key, TOP_LEVEL_KEYS))
    _extend_import_path(path)

    model = _class_spec(raw.get("model"), "model", "lightning.pytorch.LightningModule", required=True)
    _check_training_step(model)
    data = _data_spec(raw.get("data"), model)
    trainer = _trainer(raw.get("trainer"))
    if "ladder" in raw and raw["ladder"] is None:
        raise ConfigError(
            "ladder",
            f"is empty; list the rungs, e.g. ladder: [{', '.join(rungs.names())}] ([] for none), "
            "or leave the key out for the default ladder",
        )
    # an empty list is valid: `speedkit fit` on an optimized.yaml where no rung paid off
    ladder = rungs.make_all(raw["ladder"] if "ladder" in raw else default_ladder(), "ladder")
    _check_compile_backend(ladder)
    measure = MeasureConfig.from_dict(raw.get("measure"))
    report = _report(raw.get("report"))
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ConfigError("seed", f"expected an integer in [0, 2**32), found {_describe(seed)}")
    return Recipe(
        path=path,
        raw=raw,
        model=model,
        data=data,
        trainer=trainer,
        ladder=ladder,
        measure=measure,
        report=report,
        seed=seed,
        ladder_given="ladder" in raw,
    )


def _check_compile_backend(ladder: list[Rung]) -> None:
    """A torch.compile backend name torch does not know fails only when the rung is applied: say so now."""
    for i, rung in enumerate(ladder):
        backend = getattr(rung.options, "backend", "inductor") if rung.name == "compile" else "inductor"
        if backend == "inductor":
            continue
        import torch

        if backend not in torch.compiler.list_backends(exclude_tags=()):  # the debugging ones too (eager, aot_eager)
            shown = sorted({"eager", "aot_eager", *torch.compiler.list_backends()})
            raise ConfigError(f"ladder[{i}].options.backend", _unknown("torch.compile backend", backend, shown))


def _extend_import_path(path: Path | None) -> None:
    """Let class_path name modules next to the recipe or in the current directory."""
    added = False
    for directory in ([str(path.parent)] if path is not None else []) + [os.getcwd()]:
        if directory not in sys.path:
            sys.path.append(directory)
            added = True
    if added or path is not None:
        importlib.invalidate_caches()  # a module written after the directory was first scanned


def _class_spec(value: Any, where: str, base: str | None, required: bool = False) -> ClassSpec:
    """Validate ``{class_path, init_args}`` (or a bare class path string) at ``where``."""
    if value is None:
        raise ConfigError(
            where, f"missing; {_EXAMPLE}" if where == "model" else "missing; expected {class_path: ..., init_args: {...}}"
        )
    if isinstance(value, str):
        value = {"class_path": value}
    if not isinstance(value, dict):
        raise ConfigError(where, f"expected a mapping {{class_path: ..., init_args: {{...}}}}, found {_describe(value)}")
    for key in value:
        if key not in ("class_path", "init_args"):
            raise ConfigError(f"{where}.{key}", _unknown("key", key, ("class_path", "init_args")))
    if "class_path" not in value:
        raise ConfigError(f"{where}.class_path", "missing; expected 'package.module.ClassName'")
    cls = _import_class(value["class_path"], f"{where}.class_path", base)
    init_args = _init_args(cls, value.get("init_args"), f"{where}.init_args")
    return ClassSpec(value["class_path"], cls, init_args, f"{where}.init_args")


def _check_training_step(model: ClassSpec) -> None:
    import lightning.pytorch as pl

    if getattr(model.cls, "training_step", None) is pl.LightningModule.training_step:
        raise ConfigError(
            "model.class_path",
            f"{model.class_path} defines no training_step; Lightning trains a "
            "LightningModule through its training_step: name a class that defines one",
        )


def _data_spec(value: Any, model: ClassSpec) -> ClassSpec | None:
    import lightning.pytorch as pl

    if value is None:
        if getattr(model.cls, "train_dataloader", None) is pl.LightningModule.train_dataloader:
            raise ConfigError(
                "data",
                f"missing, and {model.cls.__name__} defines no train_dataloader; give "
                "data: {class_path: ..., init_args: {...}} or data: {synthetic: tokens|vectors, ...}",
            )
        return None
    if not isinstance(value, dict):
        raise ConfigError(
            "data",
            f"expected {{class_path: ..., init_args: ...}} or {{synthetic: tokens|vectors, ...}}, found {_describe(value)}",
        )
    if "synthetic" not in value:
        return _class_spec(value, "data", "lightning.pytorch.LightningDataModule")
    kind = value["synthetic"]
    if "class_path" in value or "init_args" in value:
        raise ConfigError(
            "data.synthetic", "give either synthetic: ... with its arguments beside it, or class_path/init_args, not both"
        )
    if not isinstance(kind, str) or kind not in SYNTHETIC_DATA:
        raise ConfigError("data.synthetic", f"expected one of {', '.join(SYNTHETIC_DATA)}, found {_describe(kind)}")
    class_path = SYNTHETIC_DATA[kind]
    cls = _import_class(class_path, "data.synthetic", None)
    args = {k: v for k, v in value.items() if k != "synthetic"}
    return ClassSpec(class_path, cls, _init_args(cls, args, "data"), "data")


def _trainer(value: Any) -> dict[str, Any]:
    import lightning.pytorch as pl

    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError("trainer", f"expected a mapping of Trainer arguments, found {_describe(value)}")
    params, hints, _ = _signature(pl.Trainer)
    out: dict[str, Any] = {}
    for key, item in value.items():
        where = f"trainer.{key}"
        if key not in params:
            raise ConfigError(where, _unknown("Trainer argument", key, params))
        if key in _TRAINER_OBJECTS:
            base = _TRAINER_OBJECTS[key]
            if key in ("callbacks", "logger") and isinstance(item, list):
                out[key] = [_trainer_object(c, f"{where}[{i}]", base, required=True) for i, c in enumerate(item)]
                continue
            if key == "plugins" and isinstance(item, list):
                out[key] = [_trainer_object(c, f"{where}[{i}]", base) for i, c in enumerate(item)]
                continue
            out[key] = _trainer_object(item, where, base, required=key == "callbacks" and item is not None)
            if isinstance(out[key], ClassSpec):
                continue
        if key in hints:
            _check(item, hints[key], where)
        if key == "accumulate_grad_batches" and not (isinstance(item, int) and not isinstance(item, bool) and item >= 1):
            raise ConfigError(where, f"expected a number of batches per optimizer step >= 1, found {_describe(item)}")
        _check_trainer_value(key, item, where)
        out[key] = item
    _check_strategy(out)
    return out


#: the strategies (by Lightning's name) that run several processes as speedkit runs them: Lightning's
#: script launcher starts the command line again in each (DDP's ``start_method: popen``)
_LAUNCHED_DDP = ("ddp", "ddp_find_unused_parameters_false", "ddp_find_unused_parameters_true")


def _process_count(trainer: dict[str, Any]) -> int | None:
    """Devices per node x nodes, as the Trainer arguments say; None where the machine decides."""
    devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes", 1)
    if isinstance(devices, str) and devices.strip() not in ("auto", "-1"):
        text = devices.strip().strip(",")
        devices = len(text.split(",")) if "," in devices else int(text) if text.lstrip("-").isdigit() else None
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 0:
        return None
    return devices * (nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 1 else 1)


def _check_strategy(trainer: dict[str, Any]) -> None:
    """Several processes only through DDP started by Lightning's script launcher: one clear line for
    the strategies speedkit cannot run (the command would get nothing back from spawned processes)."""
    strategy = trainer.get("strategy", "auto")
    if isinstance(strategy, ClassSpec):
        from lightning.pytorch.strategies import DDPStrategy

        method = strategy.init_args.get("start_method", "popen")
        name = "ddp" if issubclass(strategy.cls, DDPStrategy) and method == "popen" else strategy.class_path
        spawned = issubclass(strategy.cls, DDPStrategy) and method != "popen"
    elif isinstance(strategy, str):
        from lightning.pytorch.strategies import StrategyRegistry

        name = strategy
        entry = dict.get(StrategyRegistry, strategy) or {}  # the registry's own get() builds the strategy
        spawned = entry.get("init_params", {}).get("start_method") in ("spawn", "fork")
    else:
        return  # a Strategy instance given in Python: Lightning judges it
    if spawned:
        raise ConfigError(
            "trainer.strategy",
            f"{name} starts its processes from this one, and what they measure and apply does not come back to "
            "speedkit's command; use strategy: ddp (Lightning starts the command again in each process)",
        )
    processes = _process_count(trainer)
    if processes is not None and processes > 1 and name not in ("auto", *_LAUNCHED_DDP):
        raise ConfigError(
            "trainer.strategy",
            f"speedkit runs several processes under DDP only, and this Trainer asks for {processes} under {name}; "
            "use strategy: ddp, or devices: 1",
        )


def _check_trainer_value(key: str, item: Any, where: str) -> None:
    """Values Lightning's Trainer takes without complaint and fails on (or trains wrong with) later."""
    if key == "accelerator" and isinstance(item, str):
        from lightning.pytorch.accelerators import AcceleratorRegistry

        names = ["auto", "gpu", *sorted(AcceleratorRegistry.available_accelerators())]
        if item not in names:
            raise ConfigError(where, _unknown("accelerator", item, names))
    elif key == "logger" and not (item is None or isinstance(item, bool)):
        raise ConfigError(
            where,
            f"expected true, false or {{class_path: ..., init_args: {{...}}}} of a Logger (or a list of "
            f"them), found {_describe(item)}",
        )
    elif key == "gradient_clip_val" and isinstance(item, (int, float)) and not isinstance(item, bool) and item < 0:
        raise ConfigError(where, f"expected a gradient norm or value >= 0 (null or 0: no clipping), found {_describe(item)}")
    elif key == "default_root_dir" and isinstance(item, str) and item:
        existing = Path(item).expanduser()
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing.exists() and not existing.is_dir():
            raise ConfigError(where, f"{existing} is a file, so {item} cannot be a folder for the Trainer's files; give a folder")


def _trainer_object(value: Any, where: str, base: str | None, required: bool = False) -> Any:
    """A class_path spec becomes a ClassSpec; other values (``logger: false``) pass through."""
    if isinstance(value, dict) and "class_path" in value or required:
        if not isinstance(value, dict):
            raise ConfigError(where, f"expected {{class_path: ..., init_args: {{...}}}}, found {_describe(value)}")
        return _class_spec(value, where, base)
    return value


def _report(value: Any) -> dict[str, Any]:
    out = copy.deepcopy(REPORT_DEFAULTS)
    if value is None:
        return out
    if not isinstance(value, dict):
        raise ConfigError("report", f"expected a mapping, found {_describe(value)}")
    for key in value:
        if key not in REPORT_DEFAULTS:
            raise ConfigError(f"report.{key}", _unknown("key", key, REPORT_DEFAULTS))
    if "formats" in value:
        formats = value["formats"]
        if not isinstance(formats, list):
            raise ConfigError(
                "report.formats", f"expected a list of formats ({', '.join(REPORT_FORMATS)}), found {_describe(formats)}"
            )
        for i, fmt in enumerate(formats):
            if fmt not in REPORT_FORMATS:
                raise ConfigError(f"report.formats[{i}]", f"expected one of {', '.join(REPORT_FORMATS)}, found {_describe(fmt)}")
        out["formats"] = list(dict.fromkeys(formats))
    if "title" in value:
        out["title"] = _check(value["title"], typing.Optional[str], "report.title")  # noqa: UP045 (a runtime type _check reads)
    return out


# -- small helpers ---------------------------------------------------------------------------


def _rung_spec(spec: Any) -> Any:
    """A ladder entry as plain YAML data: a name, or {name, options} when options differ from defaults."""
    from speedkit.rungs import Rung

    if isinstance(spec, Rung):
        options = spec.options_dict()
        return spec.name if options == type(spec)().options_dict() else {"name": spec.name, "options": options}
    return copy.deepcopy(spec)
