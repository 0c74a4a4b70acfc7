"""Experiment grids: `ako sweep experiments/<name>.toml`.

A sweep file names a runtime, settings shared by every cell, the axes of a grid and the arms
being compared:

    runtime = "simulate"            # or "train" (the distributed runtime on this machine)
    [base]                          # any `ako train`/`ako simulate` setting, as in --config
    dataset = "fashion-mnist"
    target_accuracy = 0.85
    [grid]                          # every combination of these is run for every arm
    bandwidth = ["1Gbit", "100Mbit"]
    seed = [0, 1, 2]
    [grid.straggler]                # a table names its values: label = value
    none = []
    "4" = ["rank=3,factor=4"]
    [grid.workers]                  # a value that is a table sets several settings at once
    "4" = {workers = 4, batch_size = 128}
    "8" = {workers = 8, batch_size = 64}
    [[arm]]                         # the compared configurations: a name and their settings
    name = "ps-2"
    strategy = "bsp"
    servers = 2
    [report]                        # what `ako report` measures (optional)
    target = 0.85                   # time to this accuracy (default: base target, else 0.85)
    budget = 3.0                    # also the accuracy at this many seconds

Each cell runs as its own `ako simulate|train` process, its run directory under
`<sweep dir>/cells/<cell>/` (`ako.experiments.runner`). A cell is finished when its run wrote
summary.json with the settings the file gives now; running the sweep again runs only the others
(resumable).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ako.config import FIELDS, USER_FUNCTIONS, ConfigError, TrainConfig, parse_target, underscored, validate
from ako.run.imports import import_factory, is_spec

RUNTIMES = ("simulate", "train")
MAX_CELLS = 10_000
_NAME = re.compile(r"[\w+=,-][\w.+=,-]{0,99}")  # sweep and arm names: safe in a file name
_SECTIONS = {"name", "runtime", "base", "grid", "arm", "report"}
_REPORT_KEYS = {"target", "budget"}
_RESERVED = ("out_dir", "progress", "resume")  # the sweep decides these for each cell
EXIT_BAD_INPUT = 2


@dataclass(frozen=True)
class Cell:
    """One run of the grid: an arm at one label per axis (seed included)."""

    arm: str
    labels: tuple[tuple[str, str], ...]  # (axis, label) in the file's axis order
    settings: dict  # TrainConfig values: base, then the axes' values, then the arm's
    runtime: str  # "simulate" or "train"

    @property
    def name(self) -> str:
        """The cell's directory name, e.g. "arm=ps-2,workers=16,seed=1"."""
        return safe_name(",".join([f"arm={self.arm}", *(f"{axis}={label}" for axis, label in self.labels)]))

    def label(self, axis: str) -> str | None:
        """This cell's label on `axis`, or None when there is no such axis."""
        return dict(self.labels).get(axis)


@dataclass
class Sweep:
    """A parsed sweep file. axes: axis -> {label: value}; arms: name -> settings."""

    name: str
    runtime: str
    base: dict
    axes: dict[str, dict[str, object]]
    arms: dict[str, dict]
    report: dict
    text: str  # the file as written, kept beside the results

    def cells(self) -> list[Cell]:
        """Every cell, seeds outermost, so an interrupted sweep has whole grids for its first seeds."""
        order = sorted(self.axes, key=lambda axis: axis != "seed")
        cells = []
        for combo in itertools.product(*(self.axes[axis].items() for axis in order)):
            chosen = dict(zip(order, combo))
            for arm, arm_settings in self.arms.items():
                settings = dict(self.base)
                for axis in order:
                    value = chosen[axis][1]
                    settings.update(value if isinstance(value, dict) else {axis: value})
                settings.update(arm_settings)
                labels = tuple((a, chosen[a][0]) for a in self.axes)
                cells.append(Cell(arm, labels, settings, self.runtime))
        return cells


def load_sweep(path: str | os.PathLike) -> Sweep:
    """Read and check a sweep file: every cell's settings are validated here, so a bad value
    fails before anything runs. Raises ConfigError naming the file and the bad key or value."""
    path = Path(path)
    try:
        text = path.read_text()
        data = tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"sweep file {str(path)!r} not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"sweep file {str(path)!r}: {e}") from None
    if not any(data.get(section) for section in ("base", "grid", "arm")):  # it ran one cell of ako's defaults
        raise ConfigError(f"sweep file {str(path)!r}: sets no cells; give [base] settings, [grid] axes or [[arm]]s (docs/experiments.md)")
    try:
        sweep = _parse(data, text, default_name=re.sub(r"[^\w.+=,-]", "_", path.stem).lstrip(".") or "sweep")
        tried: set[tuple] = set()
        for cell in sweep.cells():
            _check_cell(cell, tried)
    except ConfigError as e:
        raise ConfigError(f"sweep file {str(path)!r}: {e}") from None
    return sweep


def _parse(data: dict, text: str, default_name: str) -> Sweep:
    unknown = sorted(set(data) - _SECTIONS)
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r}; allowed: {', '.join(sorted(_SECTIONS))}")
    runtime = data.get("runtime", "simulate")
    if runtime not in RUNTIMES:
        raise ConfigError(f"runtime {runtime!r}: choose simulate or train")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"name {name!r}: must be letters, digits and . _ + = , - (not starting with .), at most 100")
    base = _settings("base", data.get("base", {}))
    axes = {axis: _axis(axis, values) for axis, values in _table("grid", data.get("grid", {})).items()}
    arms = _arms(data.get("arm", []), base)
    _check_overlaps(axes, arms)
    report = _report(data.get("report", {}))
    sweep = Sweep(name, runtime, base, axes, arms, report, text)
    _check_size(sweep)
    return sweep


def _check_overlaps(axes: dict, arms: dict) -> None:
    """No setting may be given by two axes, or by an axis and an arm: one would hide the other."""
    owner: dict[str, str] = {}
    for axis, values in axes.items():
        for key in {k for v in values.values() for k in (v if isinstance(v, dict) else [axis])}:
            if owner.setdefault(key, axis) != axis:
                raise ConfigError(f"grid {axis} sets {key!r}, which grid {owner[key]} sets too")
    for arm, settings in arms.items():
        both = sorted(set(settings) & set(owner))
        if both:
            raise ConfigError(f"arm {arm!r} sets {both[0]!r}, which is also an axis of the grid")


def _report(value) -> dict:
    report = _table("report", value)
    if set(report) - _REPORT_KEYS:
        raise ConfigError(f"report: unknown key {sorted(set(report) - _REPORT_KEYS)[0]!r}; allowed: budget, target")
    limits = {"target": (1.0, "a number > 0 and <= 1, or a bound like loss<=0.3"), "budget": (1e9, "a number > 0 and <= 1e9 (seconds)")}
    for key, value in report.items():
        if key == "target" and isinstance(value, str):
            parse_target(value)
            continue
        high, allowed = limits[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
            raise ConfigError(f"report {key} {value!r}: must be {allowed}")
    return report


def _check_size(sweep: Sweep) -> None:
    """At most MAX_CELLS cells, each with a directory name of its own."""
    count = len(sweep.arms) * math.prod(len(v) for v in sweep.axes.values())
    if count > MAX_CELLS:
        raise ConfigError(f"the grid has {count} cells; at most {MAX_CELLS} are allowed")
    seen: dict[str, Cell] = {}
    for cell in sweep.cells():
        if len(cell.name.encode()) > 200:
            raise ConfigError(f"cell {cell.name[:60]}...: its name is longer than 200 bytes; use shorter labels")
        other = seen.setdefault(cell.name, cell)
        if other is not cell:
            raise ConfigError(f"cells {_describe(other)} and {_describe(cell)} would share the directory {cell.name!r}; rename one")


def _describe(cell: Cell) -> str:
    return ",".join([f"arm={cell.arm!r}", *(f"{a}={v!r}" for a, v in cell.labels)])


def _table(where: str, value) -> dict:
    """A TOML table with `batch-size` read as `batch_size` (both at once is an error)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be a table")
    return underscored(where, value)


def _settings(where: str, value) -> dict:
    """A table of TrainConfig settings; the sweep's own keys are refused."""
    settings = _table(where, value)
    for key in settings:
        if key not in FIELDS:
            raise ConfigError(f"{where}: unknown setting {key!r}; allowed: {', '.join(FIELDS)}")
        if key in _RESERVED:
            raise ConfigError(f"{where}: {key!r} is set by the sweep for each cell")
    return settings


def _axis(axis: str, values) -> dict[str, object]:
    """label -> value: a list's values are their own labels; a table gives them."""
    if axis not in FIELDS or axis in _RESERVED:
        allowed = ", ".join(f for f in FIELDS if f not in _RESERVED)
        raise ConfigError(f"grid: unknown axis {axis!r}; allowed: {allowed}")
    if isinstance(values, dict):
        labelled = {str(label): value for label, value in values.items()}
    elif isinstance(values, list):
        labelled = {_label(value): value for value in values}
        if len(labelled) < len(values):
            raise ConfigError(f"grid {axis}: a value is listed twice in {values!r}")
    else:
        raise ConfigError(f"grid {axis} {values!r}: must be a list of values or a table of label = value")
    if not labelled:
        raise ConfigError(f"grid {axis}: has no values")
    for label, value in labelled.items():
        if isinstance(value, dict):
            labelled[label] = _settings(f"grid {axis} {label!r}", value)
    return labelled


def safe_name(text: str) -> str:
    """`text` with what a file name cannot hold, or should not (/ NUL whitespace |), as _."""
    return re.sub(r"[/\x00\s|]", "_", text)


def _label(value) -> str:
    if isinstance(value, list):
        return "+".join(map(str, value)) or "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _arms(value, base: dict) -> dict[str, dict]:
    """name -> settings; with no [[arm]], one arm: the base's strategy."""
    if not isinstance(value, list):
        raise ConfigError("arm: must be an array of tables, [[arm]]")
    if not value:
        return {str(base.get("strategy", TrainConfig.strategy)): {}}
    arms = {}
    for i, table in enumerate(value):
        table = dict(_table(f"arm {i + 1}", table))
        name = table.pop("name", table.get("strategy"))
        if name is None:
            raise ConfigError(f"arm {i + 1}: needs a name (or a strategy)")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(f"arm {i + 1} name {name!r}: must be letters, digits and . _ + = , - (not starting with .), at most 100")
        if name in arms:
            raise ConfigError(f"arm {name!r}: two arms have this name")
        arms[name] = _settings(f"arm {name!r}", table)
    return arms


def _check_cell(cell: Cell, tried: set[tuple]) -> None:
    """Raise ConfigError for a cell whose settings are bad, or whose user's functions (model,
    data set, loss... by `module:factory` name) cannot be imported, or raise when called: the
    job's checks (`Job.check`: the data loaded, the model built, a training step and an
    evaluation tried) run once for each combination of those names (`tried`), before the
    sweep writes anything."""
    from ako.data import DataError
    from ako.run.job import Job

    try:
        config = validate(TrainConfig(**cell.settings), simulated=cell.runtime == "simulate")
        names = tuple(getattr(config, name) for name in ("model", "dataset", *USER_FUNCTIONS))
        for name, value in zip(("model", "dataset", *USER_FUNCTIONS), names):  # the user's own, by name: importable?
            if is_spec(value):
                import_factory(name, value)
        if any(map(is_spec, names)) and (names, config.data_dir) not in tried:
            tried.add((names, config.data_dir))
            Job(config).check(out_dir=False)  # the factories called: one that raises fails here, not in the sweep
    except (ConfigError, DataError) as e:
        raise ConfigError(f"cell {cell.name}: {e}") from None
    except TypeError as e:  # a value TrainConfig cannot even hold
        raise ConfigError(f"cell {cell.name}: {e}") from None
