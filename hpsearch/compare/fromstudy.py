"""`--from-study NAME`: each method's best configuration from a finished study in the storage path.

A study keeps, per trial that ran its whole budget, `trials/<id>/config.yaml` (its full run config) and
`trials/<id>/metrics.jsonl` (every evaluation; the last line the final report with `best_score`). For every method
of the spec, the candidates are the study's finished trials of the same `model.method` that agree with the fields
the method (or a command-line override) sets itself among the study's searched ones, and with every `model.*` word
or flag the method itself sets, searched or fixed by the study (a `hyperprompt-share` entry takes the best `share`
trial, never a `global` one, also from a study of global trials only). A value for a field the study searched
continuously (uniform, loguniform: a learning rate) is kept, never matched: no trial has exactly it; a shared
override of a field the study did not search (model.backbone) is kept too. The best candidate by `best_score` (the
validation score of the checkpoint the trial delivers) gives its values of the fields the study searched. What the
method sets itself and what a command-line override sets are kept, and so are the spec's data, budget and resources:
only the searched fields travel. A method without a candidate keeps the spec's configuration (the table's notes say
which fields no trial matched).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from hpsearch.compare.spec import SET_BY_COMPARISON, Spec
from hpsearch.config import RunConfig, load_config, read_yaml, set_field
from hpsearch.errors import ConfigError
from hpsearch.tune.study import SPACE_COPY, STATE_FILE


@dataclass
class StudyTrial:
    trial_id: str
    config: RunConfig
    best_score: float


def study_dir(storage_path, name: str) -> Path:
    """The finished study's local folder (from a bucket: its local mirror, refreshed with the study's state, space
    copy and exports)."""
    from hpsearch.tune.prepare import study_folder
    from hpsearch.tune.storage import open_storage

    storage = open_storage(str(storage_path)) if isinstance(storage_path, (str, Path)) else storage_path
    where = study_folder(storage, name, "--from-study")
    storage.pull(name, STATE_FILE, SPACE_COPY)
    storage.pull_each(name, "trials", "config.yaml", "metrics.jsonl", "FAILED")  # what finished_trials reads
    if not (where / STATE_FILE).is_file():
        root = where.parent
        studies = sorted(p.name for p in root.iterdir() if (p / STATE_FILE).is_file()) if root.is_dir() else []
        known = f"studies there: {', '.join(studies)}" if studies else "there is no study there"
        raise ConfigError(f"--from-study {name}: no study '{name}' in {root} ({STATE_FILE} missing); {known} "
                          "(--storage-path names the folder)")
    return where


def searched_fields(where: Path) -> dict[str, str]:
    """{run-config field: its distribution's type} the study searched (its copy of the space file's `search:`)."""
    data, _ = read_yaml(where / SPACE_COPY)
    search = data.get("search") or {}
    if not isinstance(search, dict):
        return {}
    return {str(k): str(v.get("type", "")) if isinstance(v, dict) else "" for k, v in search.items()}


CONTINUOUS = ("uniform", "loguniform")  # no trial has exactly a value given for such a field


def finished_trials(where: Path) -> list[StudyTrial]:
    """The study's trials that ran the whole budget and exported their model, with their best_score."""
    out = []
    trials = where / "trials"
    for folder in sorted(trials.iterdir()) if trials.is_dir() else []:
        config, metrics = folder / "config.yaml", folder / "metrics.jsonl"
        if not config.is_file() or not metrics.is_file() or (folder / "FAILED").exists():
            continue
        final = _final_report(metrics)
        score = final.get("best_score", final.get("score")) if final else None
        if not isinstance(score, (int, float)) or not math.isfinite(score):
            continue
        try:
            cfg = load_config(config)
        except ConfigError as e:
            raise ConfigError(f"--from-study {where.name}: trial {folder.name}'s config.yaml does not load here "
                              f"({e})") from None
        out.append(StudyTrial(folder.name, cfg, float(score)))
    return out


def _final_report(path: Path) -> dict | None:
    final = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(record, dict) and "test_score" in record:
            final = record
    return final


def apply_best(spec: Spec, storage_path: str | Path, name: str) -> list[str]:
    """Give each method of `spec` its best configuration from study `name` (in place); returns notes."""
    where = study_dir(storage_path, name)
    trials = finished_trials(where)
    if not trials:
        raise ConfigError(f"--from-study {name}: no trial of study '{name}' ran its whole budget ({where}/trials/"
                          "*/config.yaml); finish or resume the study first")
    kinds = {k: t for k, t in searched_fields(where).items() if k not in SET_BY_COMPARISON}
    searched = list(kinds)
    notes, applied = [], 0
    for method in spec.methods:
        own = set(method.fields) | spec.pinned
        wanted = method.config.flat()
        # what a candidate must agree with: a searched field the method or an override sets, unless continuous; a
        # model word or flag the method itself sets (its variant), searched or not
        identity = {k for k in own if k != "model.method" and (
            (k in kinds and kinds[k] not in CONTINUOUS)
            or (k in method.fields and k.startswith("model.") and isinstance(wanted[k], (str, bool))))}
        same_method = [t for t in trials if t.config.model.method == method.method]
        candidates = [t for t in same_method if all(t.config.flat()[k] == wanted[k] for k in identity)]
        if not candidates:
            fields = ", ".join(f"{k}={wanted[k]}" for k in sorted(identity))
            notes.append(f"{method.label}: study '{name}' has no finished trial of this configuration "
                         f"({len(same_method)} of method {method.method}"
                         + (f", none with {fields})" if same_method and fields else ")")
                         + "; the spec's configuration is used")
            continue
        best = max(candidates, key=lambda t: t.best_score)
        taken = {k: best.config.flat()[k] for k in searched
                 if k not in own and not k.startswith("data.") and k in best.config.flat()}
        for key, value in taken.items():
            set_field(method.config, key, value, f"--from-study {name} (trial {best.trial_id})")
        try:
            method.config.validate()
        except ConfigError as e:
            raise ConfigError(f"--from-study {name}: trial {best.trial_id}'s values do not fit {method.label} "
                              f"({e})") from None
        method.fields.update(taken)
        method.origin = f"study {name}, trial {best.trial_id} (best_score {best.best_score:.2f})"
        shown = ", ".join(f"{k}={v}" for k, v in taken.items())
        notes.append(f"{method.label}: from study '{name}' trial {best.trial_id} (best_score {best.best_score:.2f}"
                     f" of {len(candidates)} candidates): {shown or 'no searched field to take'}")
        applied += 1
    if not applied:
        methods = sorted({t.config.model.method for t in trials})
        raise ConfigError(f"--from-study {name}: none of the spec's methods has a finished trial in study '{name}' "
                          f"that agrees with its own model fields (the study's trials are of method "
                          f"{', '.join(methods)}): " + "; ".join(notes))
    spec.sweep_entries()  # the sweep's values still valid on the new configurations
    return notes
