"""A search-space file (`search_spaces/*.yaml`), read and validated completely before anything starts.

    space = load_space("search_spaces/default.yaml", overrides=["budget.trials=3", "model.variant=global"])

A space file has these top-level keys (every one optional):

    name, description     the study's default name (`--name` overrides it) and one line for people
    model, data, train    the fixed run config, exactly as in a run config file (`hpsearch.config`)
    search                searched fields `<section>.<field>: {type, ...}`, with an optional `when` condition
    objectives            [{metric, mode}]; the first is the primary one (ASHA and "the best trial")
    budget                trials, max_steps, eval_every (these two set train.*), ASHA's grace_period and
                          reduction_factor, max_failures (Tune retries of a trial), time_budget_s,
                          wait_for_nodes_s (on a cluster: how long to wait for nodes that fit one trial)
    resources             per trial: workers, cpus_per_worker, gpus_per_worker (set train.*), trial_cpus (the
                          trial's own driver); max_concurrent (null: as many as the cluster fits); driver_resource
                          (a custom resource only the head has: trial drivers stay there); worker_group (auto: a
                          one-worker trial trains in its own Tune actor, others on ranks the actor keeps from trial
                          to trial, no Ray Train worker group; pool: always on kept ranks; always: Ray Train's
                          worker group per trial)
    sampler               Optuna TPE: seed, n_startup_trials, multivariate
    points_to_evaluate    configurations to try first, e.g. the paper's best

Every mistake is a one-line `ConfigError` naming the file and line, the key, and what would be valid.
"""
from __future__ import annotations

import copy
import math
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpsearch.config import RunConfig, apply_mapping, coerce, field_types, parse_override, read_yaml, set_field
from hpsearch.errors import ConfigError
from hpsearch.tune.space import WORKER_GROUPS, Budget, Objective, Param, Resources, Sampler, SearchSpace

TYPES = ("categorical", "int", "uniform", "loguniform")
PARAM_KEYS = {"categorical": ("choices",), "int": ("low", "high", "step", "log"), "uniform": ("low", "high", "step"),
              "loguniform": ("low", "high")}
OBJECTIVE_METRICS = ("score", "best_score", "loss", "extra_params", "step_time", "tokens_per_s")  # every evaluation
TASK_SCORE = re.compile(r"task/([^/]+)/score")
# budget/resources keys that are really run-config fields (one place in the file for each)
ALIASES = {"budget.max_steps": "train.max_steps", "budget.eval_every": "train.eval_every",
           "resources.workers": "train.num_workers", "resources.cpus_per_worker": "train.cpus_per_worker",
           "resources.gpus_per_worker": "train.gpus_per_worker"}
SET_PER_TRIAL = ("train.output_dir",)  # the search gives every trial its own
NOT_SEARCHABLE = (*ALIASES.values(), "train.use_gpu", *SET_PER_TRIAL)


TOP_LEVEL = ("name", "description", "model", "data", "train", "search", "objectives", "budget", "resources",
             "sampler", "points_to_evaluate")


def load_space(path: str | Path, overrides: list[str] = (), started: bool = False) -> SearchSpace:
    """Read and validate a space file (with `key=value` overrides) completely; raise ConfigError on any mistake.
    `started`: a study's own copy, on --resume: a high off its step's grid (accepted before 2026-11-27) is lowered
    to the grid, as Optuna lowered it when the study started, instead of refused."""
    data, lines = read_yaml(path)
    at = Where(str(path), lines)
    for key in data:
        if key not in TOP_LEVEL:
            raise ConfigError(f"{at(key)}: unknown key {key!r}; a space file has {', '.join(TOP_LEVEL)}")

    cfg = RunConfig()
    apply_mapping(cfg, {s: data[s] for s in ("model", "data", "train") if s in data}, at.src, lines)
    budget = read_section(Budget, data, "budget", at)
    resources = read_section(Resources, data, "resources", at)
    sampler = read_section(Sampler, data, "sampler", at)
    params = _read_params(data.get("search"), at, started)
    objectives = _read_objectives(data.get("objectives", [{"metric": "score", "mode": "max"}]), at)
    points = data.get("points_to_evaluate") or []
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise ConfigError(f"{at('points_to_evaluate')}: points_to_evaluate: expected a list of mappings "
                          "{searched field: value}")

    _apply_aliases(cfg, budget, resources, data, at)
    pinned = {}
    for text in overrides:
        key, value = parse_override(text)
        where = f"override {text!r}"
        at.overrides.update({key: where, ALIASES.get(key, key): where})
        section, _, name = key.partition(".")
        if section in ("budget", "resources", "sampler"):
            target = {"budget": budget, "resources": resources, "sampler": sampler}[section]
            set_key(target, section, name, value, where)
            if key in ALIASES:
                set_field(cfg, ALIASES[key], value, where)
        elif section in ("model", "data", "train"):
            set_field(cfg, key, value, where)
            if key in {p.name for p in params}:  # a searched field becomes fixed: it is not searched any more
                pinned[key] = cfg.flat()[key]
        else:
            raise ConfigError(f"{where}: {key!r} cannot be overridden; expected a run-config field "
                              "(model.*, data.*, train.*) or budget.*, resources.*, sampler.*")
    if resources.gpus_per_worker is not None:
        cfg.train.use_gpu = resources.gpus_per_worker > 0
    _validate_config(cfg, at)
    params = [p for p in params if p.name not in pinned]

    space = SearchSpace(str(path), str(data.get("name") or Path(path).stem), str(data.get("description") or ""),
                        cfg, params, pinned, objectives, budget, resources, sampler, points)
    _validate_params(space, at)
    _validate_points(space, at)
    _validate_budget(space, at)
    _validate_objectives(space, at)
    return space


@dataclass
class Where:
    """Where a dotted key was set: the override that set it, else `file:line` (the file when not in it)."""

    src: str
    lines: dict[str, int]
    overrides: dict[str, str] = field(default_factory=dict)

    def __call__(self, *keys: str) -> str:
        override = next((self.overrides[k] for k in keys if k in self.overrides), None)
        if override:
            return override
        line = next((self.lines[k] for k in keys if k in self.lines), None)
        return f"{self.src}:{line}" if line else self.src


def set_key(target, section: str, name: str, value: Any, where: str) -> None:
    """Set `<section>.<name>` on a settings dataclass (budget, resources, ...), typed, or a one-line ConfigError."""
    hints = typing.get_type_hints(type(target))
    if name not in hints:
        raise ConfigError(f"{where}: unknown key '{section}.{name}'; {section} has {', '.join(hints)}")
    if name == "max_concurrent" and value in ("auto", None):
        value = None
    setattr(target, name, coerce(value, hints[name], f"{where}: {section}.{name}"))


def read_section(cls, data: dict, section: str, at):
    """A settings dataclass filled from `data[section]`, every key checked (`at` names file:line)."""
    target = cls()
    values = data.get(section) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{at(section)}: {section}: expected a mapping of key: value")
    for name, value in values.items():
        set_key(target, section, name, value, at(f"{section}.{name}"))
    return target


def _apply_aliases(cfg: RunConfig, budget: Budget, resources: Resources, data: dict, at) -> None:
    for alias, target in ALIASES.items():
        section, _, name = alias.partition(".")
        value = getattr(budget if section == "budget" else resources, name)
        if value is None:
            continue
        t_section, _, t_name = target.partition(".")
        if t_name in (data.get(t_section) or {}):
            raise ConfigError(f"{at(target)}: {target} is also set by {alias} ({at(alias)}); set it in one place")
        set_field(cfg, target, value, at(alias))
    for key in (*SET_PER_TRIAL, "train.use_gpu"):
        section, _, name = key.partition(".")
        if name in (data.get(section) or {}):
            why = "every trial gets its own" if key in SET_PER_TRIAL else "resources.gpus_per_worker > 0 sets it"
            raise ConfigError(f"{at(key)}: {key} is not set in a space file ({why})")


def _validate_config(cfg: RunConfig, at) -> None:
    try:
        cfg.validate()
    except ConfigError as e:
        key = str(e).split(":", 1)[0]
        alias = next((a for a, t in ALIASES.items() if t == key), key)
        raise ConfigError(f"{at(key, alias)}: {e}") from None


def _read_params(search: Any, at, started: bool = False) -> list[Param]:
    if not search:
        raise ConfigError(f"{at('search')}: search: nothing to search; expected `<section>.<field>: {{type: ...}}` "
                          "entries")
    if not isinstance(search, dict):
        raise ConfigError(f"{at('search')}: search: expected a mapping of <section>.<field>: {{type, ...}}")
    params: list[Param] = []
    for name, spec in search.items():
        where = at(f"search.{name}")
        if not isinstance(spec, dict) or spec.get("type") not in TYPES:
            got = spec.get("type") if isinstance(spec, dict) else spec
            raise ConfigError(f"{where}: search.{name}: type {got!r}; expected a mapping with type one of "
                              f"{', '.join(TYPES)}")
        kind = spec["type"]
        allowed = ("type", *PARAM_KEYS[kind], "when")
        for key in spec:
            if key not in allowed:
                raise ConfigError(f"{at(f'search.{name}.{key}')}: search.{name}: unknown key {key!r} for type {kind}; "
                                  f"expected {', '.join(allowed)}")
        when = spec.get("when") or {}
        if not isinstance(when, dict):
            raise ConfigError(f"{at(f'search.{name}.when')}: search.{name}.when: expected a mapping "
                              "{field: value or [values]}")
        when = {k: v if isinstance(v, list) else [v] for k, v in when.items()}
        param = Param(name, kind, spec.get("choices"), spec.get("low"), spec.get("high"), spec.get("step"),
                      bool(spec.get("log", False)), when)
        _check_shape(param, lambda key, _n=name: at(f"search.{_n}.{key}", f"search.{_n}"), started)
        params.append(param)
    return params


def _check_shape(p: Param, at_key, started: bool = False) -> None:
    """The distribution on its own: choices present, bounds numbers, low < high, log needs low > 0."""
    where = lambda key: f"{at_key(key)}: search.{p.name}.{key}"
    if p.type == "categorical":
        if not isinstance(p.choices, list) or not p.choices:
            raise ConfigError(f"{where('choices')}: expected a non-empty list of values")
        if len({repr(c) for c in p.choices}) != len(p.choices):
            raise ConfigError(f"{where('choices')}: {p.choices!r} lists a value twice; expected each value once")
        if not all(c is None or isinstance(c, (bool, int, float, str)) for c in p.choices):
            raise ConfigError(f"{where('choices')}: {p.choices!r}; expected plain values (numbers, strings, booleans)")
        return
    for key in ("low", "high", "step"):
        value = getattr(p, key)
        if isinstance(value, str):  # YAML 1.1 (PyYAML) reads 1e-4 as a string (a float needs a dot: 1.0e-4), as
            try:                    # the run config's fields take it
                value = float(value)
            except ValueError:
                continue
            if math.isfinite(value):  # nan and inf stay as written: "expected a number" below
                setattr(p, key, int(value) if p.type == "int" and value == int(value) else value)
    for key in ("low", "high"):
        value = getattr(p, key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ConfigError(f"{where(key)}: {value!r}; expected a number")
        if p.type == "int" and value != int(value):
            raise ConfigError(f"{where(key)}: {value!r}; expected an integer for type int")
    if p.type == "int":
        p.low, p.high = int(p.low), int(p.high)
    if not p.low < p.high:
        raise ConfigError(f"{where('high')}: {p.high!r} is not above low {p.low!r}; expected low < high")
    if (p.log or p.type == "loguniform") and p.low <= 0:
        raise ConfigError(f"{where('low')}: {p.low!r}; a log scale needs low > 0")
    if p.step is not None:
        if not isinstance(p.step, (int, float)) or isinstance(p.step, bool) or not 0 < p.step < math.inf:
            raise ConfigError(f"{where('step')}: {p.step!r}; expected a finite number > 0")
        if p.log:
            raise ConfigError(f"{where('step')}: a step cannot be combined with log: true")
        if p.type == "int" and p.step != int(p.step):
            raise ConfigError(f"{where('step')}: {p.step!r}; expected an integer step for type int")
        steps = (p.high - p.low) / p.step
        if abs(steps - round(steps)) > 1e-9 * max(1.0, abs(steps)):  # Optuna would lower high to the grid, warning
            top = p.low + math.floor(steps + 1e-9) * p.step
            top = int(top) if p.type == "int" else float(f"{top:.12g}")
            if started:  # what the study has searched since it started
                print(f"[hpsearch.tune] {where('high')}: {p.high!r} lowered to {top!r}, on the step's grid, as Optuna "
                      "did when the study started", file=sys.stderr)
                p.high = top
                return
            raise ConfigError(f"{where('high')}: {p.high!r} is not low {p.low!r} plus a whole number of steps of "
                              f"{p.step!r}; expected high: {top!r} (or a step that divides high - low)")


def _validate_params(space: SearchSpace, at) -> None:
    """Each searched field exists, can be searched, every value of its range is a valid run config, and each
    condition can hold. A field whose condition an override rules out (`model.variant=share` for a field searched
    only when variant=global) is left out of the search, with the fields that depend on it."""
    if not space.params:
        raise ConfigError(f"{at('search')}: search: every searched field is pinned by an override; nothing to search")
    seen: dict[str, Param] = {}
    searched = {p.name for p in space.params}
    flat = space.config.flat()
    dropped: set[str] = set()
    for p in space.params:
        _check_field(p, space.config, at)
        if any(key in dropped or key in space.pinned and flat[key] not in allowed for key, allowed in p.when.items()):
            dropped.add(p.name)
            continue
        for key, allowed in p.when.items():
            _check_condition(p, key, allowed, seen, searched, flat, at)
        seen[p.name] = p
    space.params = list(seen.values())
    space.points_to_evaluate = [{k: v for k, v in point.items() if k not in dropped | set(space.pinned)}
                                for point in space.points_to_evaluate]
    _check_methods(space, at)


def _check_methods(space: SearchSpace, at) -> None:
    """Every searched model field is used by some method it can be searched under (`model.method` searched or
    fixed, narrowed by the field's `when: {model.method: [...]}`)."""
    from hpsearch.model.config import COMMON_FIELDS, METHOD_FIELDS

    method = next((p for p in space.params if p.name == "model.method"), None)
    methods = list(method.choices) if method else [space.config.model.method]
    for p in space.params:
        section, _, name = p.name.partition(".")
        if section != "model" or name in COMMON_FIELDS:
            continue
        possible = [m for m in methods if m in p.when.get("model.method", methods)]
        if not any(name in METHOD_FIELDS[m] for m in possible):
            users = [m for m, used in METHOD_FIELDS.items() if name in used]
            raise ConfigError(f"{at(f'search.{p.name}')}: search.{p.name}: no method it is searched under uses it "
                              f"({', '.join(possible)}); {name} belongs to {', '.join(users) or 'no method'}")


def _check_field(p: Param, cfg: RunConfig, at) -> None:
    where = at(f"search.{p.name}")
    section, _, name = p.name.partition(".")
    set_field(copy.deepcopy(cfg), p.name, p.extremes()[0], where)  # unknown field: one line naming valid ones
    if p.name in NOT_SEARCHABLE:
        raise ConfigError(f"{where}: search.{p.name}: cannot be searched (the study sets it: budget, resources "
                          "or the trial's own output directory)")
    tp = field_types(section)[name]
    if p.type in ("uniform", "loguniform") and float not in _options(tp):
        raise ConfigError(f"{where}: search.{p.name}: type {p.type} needs a number field; {p.name} is "
                          f"{_kind(tp)}: use type int or categorical")
    if p.type == "int" and not {int, float} & set(_options(tp)):
        raise ConfigError(f"{where}: search.{p.name}: type int needs a number field; {p.name} is {_kind(tp)}: "
                          "use type categorical")
    for value in p.extremes():
        probe = copy.deepcopy(cfg)
        try:
            set_field(probe, p.name, value, "value")
            probe.validate()
        except ConfigError as e:
            key = "choices" if p.type == "categorical" else ("low" if value == p.low else "high")
            detail = str(e).removeprefix("value: ")
            raise ConfigError(f"{at(f'search.{p.name}.{key}', f'search.{p.name}')}: search.{p.name}.{key}: "
                              f"{value!r} is not a valid value ({detail})") from None
    if p.type == "categorical":
        p.choices = [coerce(c, tp, p.name) for c in p.choices]


def _options(tp) -> tuple:
    return typing.get_args(tp) if typing.get_args(tp) else (tp,)


def _kind(tp) -> str:
    names = {int: "an integer", float: "a number", bool: "true/false", str: "a string"}
    return " or ".join(names.get(t, str(t)) for t in _options(tp) if t is not type(None))


def _check_condition(p: Param, key: str, allowed: list, seen: dict, searched: set, flat: dict, at) -> None:
    where = f"{at(f'search.{p.name}.when')}: search.{p.name}.when.{key}"
    if key == p.name:
        raise ConfigError(f"{where}: a field cannot depend on itself")
    if key in seen:
        domain = seen[key]
        never = [v for v in allowed if not domain.contains(v)]
        if never:
            valid = domain.choices if domain.type == "categorical" else f"[{domain.low}, {domain.high}]" + (
                f" in steps of {domain.step!r}" if domain.step else "")
            raise ConfigError(f"{where}: {never[0]!r} can never hold; {key} is searched over {valid}")
        return
    if key not in flat:
        raise ConfigError(f"{where}: unknown field {key!r}; expected a run-config field (e.g. model.variant)")
    if key in searched:
        raise ConfigError(f"{where}: {key} is searched after {p.name}; list it before {p.name} in search:")
    if flat[key] not in allowed:
        raise ConfigError(f"{where}: can never hold; {key} is fixed to {flat[key]!r}, so {p.name} would never be "
                          f"searched (expected {key} in {allowed!r})")


def _validate_points(space: SearchSpace, at) -> None:
    where = at("points_to_evaluate")
    names = {p.name: p for p in space.params}
    for i, point in enumerate(space.points_to_evaluate):
        for key, value in point.items():
            if key not in names:
                raise ConfigError(f"{where}: points_to_evaluate[{i}]: {key!r} is not searched; expected some of "
                                  f"{', '.join(names)}")
            if not names[key].contains(value):
                p = names[key]
                grid = f" in steps of {p.step!r}" if p.step else ""
                expected = f"one of {p.choices!r}" if p.type == "categorical" else \
                    f"a value from {p.low!r} to {p.high!r}{grid}"
                raise ConfigError(f"{where}: points_to_evaluate[{i}].{key}: {value!r} is outside the searched range; "
                                  f"expected {expected}")


def _validate_budget(space: SearchSpace, at) -> None:
    b, r, t, s = space.budget, space.resources, space.config.train, space.sampler
    checks = [
        ("budget.trials", b.trials >= 1, "an integer >= 1"),
        ("budget.reduction_factor", b.reduction_factor >= 2, "an integer >= 2"),
        ("budget.max_failures", b.max_failures >= 0, "an integer >= 0"),
        ("budget.time_budget_s", b.time_budget_s is None or b.time_budget_s > 0, "a number of seconds > 0 or null"),
        ("budget.wait_for_nodes_s", b.wait_for_nodes_s >= 0, "a number of seconds >= 0"),
        ("budget.grace_period", b.grace_period is None or 1 <= b.grace_period <= t.max_steps,
         f"an integer in [1, max_steps={t.max_steps}] or null (one evaluation)"),
        ("budget.eval_every", t.eval_every <= t.max_steps, f"at most max_steps={t.max_steps}"),
        ("resources.trial_cpus", r.trial_cpus > 0, "a number > 0 (Ray refuses 0)"),
        ("resources.max_concurrent", r.max_concurrent is None or r.max_concurrent >= 1, "an integer >= 1 or null"),
        ("resources.gpus_per_worker", t.gpus_per_worker > 0 or not t.use_gpu, "a number > 0 for GPU workers"),
        ("resources.worker_group", r.worker_group in WORKER_GROUPS, " or ".join(WORKER_GROUPS)),
        ("resources.driver_resource", r.driver_resource is None or (
            isinstance(r.driver_resource, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", r.driver_resource)
            and r.driver_resource not in ("CPU", "GPU", "memory")), "the name of a custom resource or null"),
        # Optuna's TPE seeds numpy, which takes 0 <= seed < 2**32: anything else failed once Ray had started
        ("sampler.seed", 0 <= s.seed <= 2**32 - 1, "an integer in [0, 2**32 - 1]"),
        ("sampler.n_startup_trials", s.n_startup_trials >= 0, "an integer >= 0"),
    ]
    for key, ok, expected in checks:
        if not ok:
            section, _, name = key.partition(".")
            value = getattr({"budget": b, "resources": r, "sampler": s}[section], name)
            value = getattr(t, ALIASES[key].split(".")[1]) if value is None and key in ALIASES else value
            raise ConfigError(f"{at(key)}: {key}: {value!r}; expected {expected}")


def _validate_objectives(space: SearchSpace, at) -> None:
    """A task's score names a task of the suite as the results do: its canonical name (sst2, not SST-2), and with
    the default data.tasks the tasks of the source's folder, not the synthetic names the default lists."""
    from hpsearch.data.sources import resolve_tasks

    tasks = None
    for i, objective in enumerate(space.objectives):
        m = TASK_SCORE.fullmatch(objective.metric)
        if objective.metric in OBJECTIVE_METRICS:
            continue
        tasks = tasks if tasks is not None else resolve_tasks(space.config.data)
        if not (m and m.group(1) in tasks):
            raise ConfigError(f"{at('objectives')}: objectives[{i}].metric: {objective.metric!r}; expected one of "
                              f"{', '.join(OBJECTIVE_METRICS)} or task/<task>/score for a task of the suite "
                              f"({', '.join(tasks)})")


def _read_objectives(items: Any, at) -> list[Objective]:
    where = at("objectives")
    if not isinstance(items, list) or not items or not all(isinstance(o, dict) for o in items):
        raise ConfigError(f"{where}: objectives: expected a list of {{metric: ..., mode: max|min}}, primary first")
    objectives = []
    for i, item in enumerate(items):
        unknown = set(item) - {"metric", "mode"}
        if unknown:
            raise ConfigError(f"{where}: objectives[{i}]: unknown key {sorted(unknown)[0]!r}; expected metric, mode")
        if item.get("mode") not in ("max", "min"):
            raise ConfigError(f"{where}: objectives[{i}].mode: {item.get('mode')!r}; expected max or min")
        objectives.append(Objective(str(item.get("metric")), item["mode"]))
    metrics = [o.metric for o in objectives]
    if len(set(metrics)) != len(metrics):
        raise ConfigError(f"{where}: objectives: a metric is listed twice ({', '.join(metrics)})")
    return objectives
