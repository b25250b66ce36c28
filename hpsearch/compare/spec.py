"""A comparison spec (`search_spaces/compare-*.yaml`), read and validated completely before anything starts.

    spec = load_spec("search_spaces/compare-synthetic.yaml", ["seeds=2", "budget.max_steps=100"])

Top-level keys (all optional but `methods`):

    name, description     the comparison's default name (`--name` overrides it) and one line for people
    model, data, train    the run config every method shares, as in a run config file (not model.method)
    methods               label: {method: <a method of hpsearch.model>, <section>.<field>: value, ...}; the fields
                          a method sets itself (model.* it uses, train.* such as its learning rate; written dotted
                          or as nested model:/train: mappings). Every method trains on the same data and budget.
    references            labels the others are compared with, seed by seed; the first is the cost baseline (step
                          and generation time ratios). Default: the MTL method and HyperPrompt-Global, if present
    seeds                 N (seeds 0 .. N-1) or a list; each seed sets train.seed and data.seed
    sweep                 {method: <label>, field: <section>.<field>, values: [...]}: that method again at each
                          value (every seed), e.g. the prompt length (the paper's Fig. 4)
    budget                max_steps, eval_every (set train.*), max_failures (Tune retries of a trial)
    resources             per trial, as in a space file: workers, cpus_per_worker, gpus_per_worker, trial_cpus,
                          max_concurrent, worker_group
    stats                 interval (t | bootstrap), confidence, resamples, bootstrap_method, seed
    probe                 after training: rows_per_task (validation rows per task for generation time and attention
                          statistics), reps (timed repetitions; the fastest counts)

Overrides: `model.*`, `data.*`, `train.*` (the shared config), `methods.<label>.<section>.<field>` (one method),
`budget.*`, `resources.*`, `stats.*`, `probe.*`, `seeds`. Every mistake is a one-line ConfigError naming the file
and line (or the override), the key, and what would be valid.
"""
from __future__ import annotations

import copy
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpsearch.config import RunConfig, apply_mapping, coerce, parse_override, read_yaml, set_field
from hpsearch.errors import ConfigError
from hpsearch.tune.space import WORKER_GROUPS, Resources
from hpsearch.tune.spacefile import Where, read_section, set_key

TOP_LEVEL = ("name", "description", "model", "data", "train", "methods", "references", "seeds", "sweep", "budget",
             "resources", "stats", "probe")
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+-]{0,63}")  # also in MLflow's names (at most 250 characters)
INTERVALS = ("t", "bootstrap")
# a bootstrap over fewer seeds covers far less than its confidence: of a stated 95 %, 54 % at 2 seeds, 71 % at 3,
# 85 % at 5 and 90 % at 10 (normal scores, 200-300 simulated comparisons each), where the t interval keeps 93-98 %
BOOTSTRAP_MIN_SEEDS = 10
BOOTSTRAP_METHODS = ("BCa", "percentile", "basic")
# run-config fields the comparison sets itself, and where to set them instead
SET_BY_COMPARISON = {
    "train.seed": "the seeds set it: seeds:", "data.seed": "the seeds set it: seeds:",
    "train.output_dir": "every trial gets its own", "train.max_steps": "set budget.max_steps",
    "train.eval_every": "set budget.eval_every", "train.num_workers": "set resources.workers",
    "train.cpus_per_worker": "set resources.cpus_per_worker", "train.gpus_per_worker": "set resources.gpus_per_worker",
    "train.use_gpu": "resources.gpus_per_worker > 0 sets it", "model.method": "set per method under methods:",
}
ALIASES = {"budget.max_steps": "train.max_steps", "budget.eval_every": "train.eval_every",
           "resources.workers": "train.num_workers", "resources.cpus_per_worker": "train.cpus_per_worker",
           "resources.gpus_per_worker": "train.gpus_per_worker"}


@dataclass
class Budget:
    max_steps: int | None = None        # -> train.max_steps (every method, every seed)
    eval_every: int | None = None       # -> train.eval_every
    max_failures: int = 1               # Tune retries of a failed trial


@dataclass
class Stats:
    interval: str = "t"                 # t (Student-t over seeds) | bootstrap (scipy.stats.bootstrap, seeded)
    confidence: float = 0.95
    resamples: int = 9999               # bootstrap only
    bootstrap_method: str = "BCa"       # BCa | percentile | basic
    seed: int = 0                       # the bootstrap's random state


@dataclass
class Probe:
    rows_per_task: int = 16             # validation rows per task, the same rows for every trial
    reps: int = 3                       # timed generation passes after one warm-up; the fastest counts


@dataclass
class Method:
    """One row of the comparison: a label, its method and its full run config (seed and output dir unset)."""

    label: str
    method: str
    fields: dict[str, Any]              # the run-config fields the entry sets itself (dotted)
    config: RunConfig
    origin: str = "spec"                # or the study trial its configuration came from (--from-study)
    parent: str | None = None           # a sweep entry: the label it varies
    sweep_value: Any = None


@dataclass
class Sweep:
    method: str                         # a label
    field: str                          # <section>.<field>
    values: list


@dataclass
class Spec:
    path: str
    text: str
    name: str
    description: str
    config: RunConfig                   # the shared config (budget and resources applied)
    methods: list[Method]
    references: list[str]
    seeds: list[int]
    sweep: Sweep | None
    budget: Budget
    resources: Resources
    stats: Stats
    probe: Probe
    pinned: set[str] = field(default_factory=set)  # shared fields an override set (--from-study keeps them)
    notes: list[str] = field(default_factory=list)

    @property
    def baseline(self) -> str:
        return self.references[0]

    def method(self, label: str) -> Method:
        return next(m for m in self.methods if m.label == label)

    def entries(self) -> list[Method]:
        """Every configuration the grid runs: the methods, then the sweep's other values of its method."""
        return self.methods + self.sweep_entries()

    def sweep_entries(self) -> list[Method]:
        if not self.sweep:
            return []
        base = self.method(self.sweep.method)
        own = base.config.flat()[self.sweep.field]
        out = []
        for value in self.sweep.values:
            if value == own:
                continue
            cfg = copy.deepcopy(base.config)
            set_field(cfg, self.sweep.field, value, f"sweep.{self.sweep.field}")
            cfg.validate()
            label = f"{base.label}@{self.sweep.field.split('.', 1)[1]}={value}"
            out.append(Method(label, base.method, {**base.fields, self.sweep.field: value}, cfg, base.origin,
                              base.label, value))
        return out

    def entry(self, label: str) -> Method:
        return next(m for m in self.entries() if m.label == label)


# ---- reading ------------------------------------------------------------------------------------------------------
def load_spec(path: str | Path, overrides: typing.Iterable[str] = ()) -> Spec:
    """Read and validate a comparison spec (with `key=value` overrides); raise ConfigError on any mistake."""
    from hpsearch.model.config import METHODS  # the registry's names (tested equal), without importing torch

    data, lines = read_yaml(path)
    at = Where(str(path), lines)
    for key in data:
        if key not in TOP_LEVEL:
            raise ConfigError(f"{at(key)}: unknown key {key!r}; a comparison spec has {', '.join(TOP_LEVEL)}")
    shared = {s: data[s] for s in ("model", "data", "train") if data.get(s) is not None}
    for section, values in shared.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{at(section)}: section {section!r} must be a mapping of field: value")
        for name in values:
            _not_set_by_comparison(f"{section}.{name}", at(f"{section}.{name}"))
    cfg = RunConfig()
    apply_mapping(cfg, shared, at.src, lines)
    sections = {"budget": read_section(Budget, data, "budget", at),
                "resources": read_section(Resources, data, "resources", at),
                "stats": read_section(Stats, data, "stats", at), "probe": read_section(Probe, data, "probe", at)}
    raw = _read_methods(data.get("methods"), at, METHODS)
    seeds, seeds_at = data.get("seeds", 3), at("seeds")

    pinned: set[str] = set()
    for text in overrides:
        key, value = parse_override(text)
        where = f"override {text!r}"
        at.overrides.update({key: where, ALIASES.get(key, key): where})
        head, _, rest = key.partition(".")
        if head in sections:
            set_key(sections[head], head, rest, value, where)
        elif key == "seeds":
            seeds, seeds_at = _override_seeds(value, where), where
        elif head == "methods":
            label, _, name = rest.partition(".")
            if label not in raw:
                raise ConfigError(f"{where}: no method {label!r} in the spec; its methods: {', '.join(raw)}")
            _add_method_field(raw[label], name, value, where, METHODS, f"methods.{label}")
        elif head in ("model", "data", "train"):
            _not_set_by_comparison(key, where)
            set_field(cfg, key, value, where)
            pinned.add(key)
            owners = [label for label, entry in raw.items() if key in entry["fields"]]
            if owners:
                raise ConfigError(f"{where}: {key} is set by method {owners[0]} itself, which would keep its own "
                                  f"value; override it with methods.{owners[0]}.{key}={value}")
        else:
            raise ConfigError(f"{where}: {key!r} cannot be overridden; expected model.*, data.*, train.*, "
                              "methods.<label>.<section>.<field>, budget.*, resources.*, stats.*, probe.* or seeds")

    budget, resources = sections["budget"], sections["resources"]
    for alias, target in ALIASES.items():
        section, _, name = alias.partition(".")
        value = getattr(budget if section == "budget" else resources, name)
        if value is not None:
            set_field(cfg, target, value, at(alias))
    if resources.gpus_per_worker is not None:
        cfg.train.use_gpu = resources.gpus_per_worker > 0
    _validate(cfg, at)

    methods = [_build_method(label, entry, cfg, at) for label, entry in raw.items()]
    spec = Spec(str(path), Path(path).read_text(encoding="utf-8"), str(data.get("name") or Path(path).stem),
                str(data.get("description") or ""), cfg, methods, [], _read_seeds(seeds, seeds_at), None, budget,
                resources, sections["stats"], sections["probe"], pinned)
    spec.references = _read_references(data.get("references"), spec, at)
    spec.sweep = _read_sweep(data.get("sweep"), spec, at)
    _check_metric_names(spec, at)
    _validate_sections(spec, at)
    if len(spec.seeds) < 3:
        spec.notes.append(f"{len(spec.seeds)} seed(s): intervals over fewer than 3 seeds are wide or undefined")
    return spec


def _not_set_by_comparison(key: str, where: str) -> None:
    if key in SET_BY_COMPARISON:
        raise ConfigError(f"{where}: {key} is not set here ({SET_BY_COMPARISON[key]})")


def _read_methods(methods: Any, at, registry: tuple[str, ...]) -> dict[str, dict]:
    """{label: {"method": str, "fields": {dotted: value}, "at": {dotted: where}}}, each key checked."""
    if not methods or not isinstance(methods, dict):
        raise ConfigError(f"{at('methods')}: methods: expected a mapping of label: {{method: <one of "
                          f"{', '.join(registry)}>, <section>.<field>: value, ...}}")
    raw: dict[str, dict] = {}
    for label, entry in methods.items():
        where = at(f"methods.{label}")
        if not isinstance(label, str) or not LABEL.fullmatch(label):
            raise ConfigError(f"{where}: methods: label {label!r}; expected up to 64 letters, digits, '_', '+' "
                              "and '-'")
        if not isinstance(entry, dict) or "method" not in entry:
            raise ConfigError(f"{where}: methods.{label}: expected a mapping with `method: <one of "
                              f"{', '.join(registry)}>` and the fields it sets")
        item = {"method": None, "fields": {}, "at": {}}
        _add_method_field(item, "method", entry["method"], at(f"methods.{label}.method"), registry,
                          f"methods.{label}")
        for key, value in entry.items():
            if key == "method":
                continue
            if key in ("model", "train", "data") and isinstance(value, dict):
                for name, v in value.items():
                    _add_method_field(item, f"{key}.{name}", v, at(f"methods.{label}.{key}.{name}"), registry,
                                      f"methods.{label}")
            else:
                _add_method_field(item, str(key), value, at(f"methods.{label}.{key}"), registry, f"methods.{label}")
        raw[label] = item
    return raw


def _add_method_field(item: dict, key: str, value: Any, where: str, registry: tuple[str, ...], prefix: str) -> None:
    """Check one field a method sets (`prefix`: how messages name the entry) and record it in `item`."""
    from hpsearch.model.config import COMMON_FIELDS, METHOD_FIELDS

    if key == "method":
        if value not in registry:
            raise ConfigError(f"{where}: {prefix}.method: {value!r} is not a method; expected one of "
                              f"{', '.join(registry)} (hpsearch.model.METHOD_CLASSES)")
        item["method"] = value
        return
    section, _, name = key.partition(".")
    if section == "data":
        raise ConfigError(f"{where}: {prefix}.{key}: not set per method (every method trains on the same "
                          "data); set it in the top-level data: section")
    if section not in ("model", "train") or not name:
        raise ConfigError(f"{where}: {prefix}: unknown key {key!r}; expected method and <section>.<field> "
                          "with section model or train")
    _not_set_by_comparison(key, where)
    set_field(RunConfig(), key, value, where)  # an unknown field or a bad value: one line naming the valid ones
    if section == "model":
        used = (*COMMON_FIELDS, *METHOD_FIELDS.get(item["method"], ()))
        if name not in used:
            raise ConfigError(f"{where}: {prefix}.{key}: method {item['method']} does not use {name}; its "
                              f"model fields: {', '.join(f for f in used if f != 'method')}")
    item["fields"][key] = value
    item["at"][key] = where


def _build_method(label: str, entry: dict, shared: RunConfig, at) -> Method:
    from hpsearch.model.config import METHODS

    cfg = copy.deepcopy(shared)
    cfg.model.method = entry["method"]
    for key, value in entry["fields"].items():  # again: an override may have changed the method
        _add_method_field({"method": entry["method"], "fields": {}, "at": {}}, key, value, entry["at"][key],
                          METHODS, f"methods.{label}")
        set_field(cfg, key, value, entry["at"][key])
    try:
        cfg.validate()
    except ConfigError as e:
        key = str(e).split(":", 1)[0]
        raise ConfigError(f"{entry['at'].get(key) or at(key, f'methods.{label}')}: methods.{label}: {e}") from None
    return Method(label, entry["method"], {"model.method": entry["method"], **entry["fields"]}, cfg)


def _validate(cfg: RunConfig, at) -> None:
    try:
        cfg.validate()
    except ConfigError as e:
        key = str(e).split(":", 1)[0]
        alias = next((a for a, t in ALIASES.items() if t == key), key)
        raise ConfigError(f"{at(alias, key)}: {e}") from None


def _override_seeds(value: str, where: str) -> Any:
    try:
        return int(value)
    except ValueError:
        return [v.strip() for v in value.split(",") if v.strip()]


MAX_SEEDS = 1000                       # trials: methods x seeds
MAX_SEED = 2 ** 32 - 1                 # numpy's seeds (torch takes larger ones)


def metric_name(text: str) -> str:
    """MLflow metric names take letters, digits, `_ - . / :` and spaces."""
    return re.sub(r"[^\w\-./: ]", "_", text)


def _check_metric_names(spec: Spec, at) -> None:
    """Two rows whose labels give one MLflow metric name (`a+b`, `a_b`) would log over each other."""
    seen: dict[str, str] = {}
    for m in spec.entries():
        other = seen.setdefault(metric_name(m.label), m.label)
        if other != m.label:
            raise ConfigError(f"{at(f'methods.{m.parent or m.label}')}: methods: labels {other!r} and {m.label!r} "
                              f"are one MLflow metric name ({metric_name(m.label)!r}); rename one")


def _read_seeds(seeds: Any, where: str) -> list[int]:
    expected = (f"an integer from 1 to {MAX_SEEDS} (seeds 0 .. N-1; 3 or more for an interval) or a list of at "
                f"most {MAX_SEEDS} distinct integers from 0 to {MAX_SEED}")
    if isinstance(seeds, bool):
        raise ConfigError(f"{where}: seeds: {seeds!r}; expected {expected}")
    if isinstance(seeds, int):
        if not 1 <= seeds <= MAX_SEEDS:
            raise ConfigError(f"{where}: seeds: {seeds}; expected {expected}")
        return list(range(seeds))
    if isinstance(seeds, list) and seeds:
        try:
            values = [coerce(s, int, f"{where}: seeds") for s in seeds]
        except ConfigError:
            raise ConfigError(f"{where}: seeds: {seeds!r}; expected {expected}") from None
        if all(0 <= v <= MAX_SEED for v in values) and len(set(values)) == len(values) <= MAX_SEEDS:
            return values
    raise ConfigError(f"{where}: seeds: {seeds!r}; expected {expected}")


def _read_references(refs: Any, spec: Spec, at) -> list[str]:
    labels = [m.label for m in spec.methods]
    if refs is None:
        mtl = [m.label for m in spec.methods if m.method == "mtl"][:1]
        hp = [m.label for m in spec.methods if m.method == "hyperprompt" and m.config.model.variant == "global"][:1]
        return (mtl + hp) or labels[:1]
    refs = [refs] if isinstance(refs, str) else refs
    if not isinstance(refs, list) or not refs:
        raise ConfigError(f"{at('references')}: references: {refs!r}; expected a list of method labels (the first "
                          "is the cost baseline)")
    for ref in refs:
        if ref not in labels:
            raise ConfigError(f"{at('references')}: references: {ref!r} is not a method of this spec; expected some "
                              f"of {', '.join(labels)}")
    if len(set(refs)) != len(refs):
        raise ConfigError(f"{at('references')}: references: {refs!r} lists a method twice")
    return list(refs)


def _read_sweep(sweep: Any, spec: Spec, at) -> Sweep | None:
    if sweep is None:
        return None
    if not isinstance(sweep, dict):
        raise ConfigError(f"{at('sweep')}: sweep: expected {{method: <label>, field: <section>.<field>, values: "
                          "[...]}")
    for key in sweep:
        if key not in ("method", "field", "values"):
            raise ConfigError(f"{at(f'sweep.{key}')}: sweep: unknown key {key!r}; expected method, field, values")
    labels = [m.label for m in spec.methods]
    label, key, values = sweep.get("method"), sweep.get("field"), sweep.get("values")
    if label not in labels:
        raise ConfigError(f"{at('sweep.method', 'sweep')}: sweep.method: {label!r}; expected one of the methods' "
                          f"labels: {', '.join(labels)}")
    method = spec.method(label)
    where = at("sweep.field", "sweep")
    if not isinstance(key, str):
        raise ConfigError(f"{where}: sweep.field: {key!r}; expected <section>.<field>, e.g. "
                          "model.prompt_length_encoder")
    from hpsearch.model.config import METHODS

    item = {"method": method.method, "fields": {}, "at": {}}
    where_values = at("sweep.values", "sweep")
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where_values}: sweep.values: {values!r}; expected a non-empty list of values")
    out = []
    for value in values:
        if value is None:  # the rows are ordered, plotted and labelled by their value: each needs one
            raise ConfigError(f"{where_values}: sweep.values: {values!r} has a null; expected each value written "
                              "out (for the default, its value)")
        _add_method_field(item, key, value, where, METHODS, "sweep")
        probe = copy.deepcopy(method.config)
        set_field(probe, key, value, where_values)
        try:
            probe.validate()
        except ConfigError as e:
            raise ConfigError(f"{where_values}: sweep.values: {value!r} is not a valid value ({e})") from None
        out.append(probe.flat()[key])
    if len(set(map(repr, out))) != len(out):
        raise ConfigError(f"{where_values}: sweep.values: {values!r} lists a value twice")
    own = method.config.flat()[key]  # the method's own row is one of the sweep's: ordered among the values
    if own is None:
        raise ConfigError(f"{where}: sweep.field: {key} is unset in method {label} (its default, null, is the "
                          f"backbone's own value); set it in the method ({label}: {{{key}: ...}}) so its row has a "
                          "value among the sweep's")
    kinds = {_kind(v) for v in [own, *out]}
    if len(kinds) > 1:
        raise ConfigError(f"{where_values}: sweep.values: {values!r} and method {label}'s own {key}, {own!r}, are "
                          f"not of one kind ({' and '.join(sorted(kinds))}); expected values that can be ordered "
                          "with it")
    return Sweep(label, key, out)


def _kind(value) -> str:
    return "true/false" if isinstance(value, bool) else "numbers" if isinstance(value, (int, float)) else "strings"


def _validate_sections(spec: Spec, at) -> None:
    b, r, s, p, t = spec.budget, spec.resources, spec.stats, spec.probe, spec.config.train
    checks = [
        ("budget.max_failures", b.max_failures >= 0, "an integer >= 0"),
        ("budget.eval_every", t.eval_every <= t.max_steps, f"at most max_steps={t.max_steps}"),
        ("resources.trial_cpus", r.trial_cpus > 0, "a number > 0 (Ray refuses 0)"),
        ("resources.max_concurrent", r.max_concurrent is None or r.max_concurrent >= 1, "an integer >= 1 or null"),
        ("resources.gpus_per_worker", t.gpus_per_worker > 0 or not t.use_gpu, "a number > 0 for GPU workers"),
        ("resources.worker_group", r.worker_group in WORKER_GROUPS, " or ".join(WORKER_GROUPS)),
        ("stats.interval", s.interval in INTERVALS, " or ".join(INTERVALS)),
        ("stats.interval", s.interval != "bootstrap" or len(spec.seeds) >= BOOTSTRAP_MIN_SEEDS,
         f"t with {len(spec.seeds)} seeds: a bootstrap needs at least {BOOTSTRAP_MIN_SEEDS} (over fewer it covers far "
         "less than its confidence: 71 % of a stated 95 % at 3 seeds), or more seeds"),
        ("stats.confidence", 0 < s.confidence < 1, "a number in (0, 1), e.g. 0.95"),
        ("stats.resamples", s.resamples >= 100, "an integer >= 100"),
        ("stats.bootstrap_method", s.bootstrap_method in BOOTSTRAP_METHODS, ", ".join(BOOTSTRAP_METHODS)),
        ("stats.seed", s.seed >= 0, "an integer >= 0"),
        ("probe.rows_per_task", p.rows_per_task >= 1, "an integer >= 1"),
        ("probe.reps", p.reps >= 1, "an integer >= 1"),
    ]
    for key, ok, expected in checks:
        if not ok:
            section, _, name = key.partition(".")
            target = {"budget": b, "resources": r, "stats": s, "probe": p}[section]
            value = getattr(target, name)
            if value is None and key in ALIASES:
                value = getattr(t, ALIASES[key].split(".")[1])
            raise ConfigError(f"{at(key)}: {key}: {value!r}; expected {expected}")
