"""Everything a study needs before Ray or MLflow start, validated (`prepare`), and the names of studies: the next
free one, the newest, a study's folder, and claiming a name so that two starts never share one (`claim`). A mistake
is a one-line `ConfigError` (exit code 2 from the command). `hpsearch.compare` shares the names and the checks.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
from pathlib import Path

from hpsearch.cli import redacted
from hpsearch.config import absolute_paths, read_yaml
from hpsearch.errors import ConfigError
from hpsearch.tune.spacefile import load_space
from hpsearch.tune.storage import Storage, open_storage
from hpsearch.tune.study import SPACE_COPY, STATE_FILE, Study, load_state

DEFAULT_SPACE = Path(__file__).resolve().parents[2] / "search_spaces" / "default.yaml"


def prepare(args: argparse.Namespace) -> tuple[Study, dict]:
    """Everything a study needs, validated, before Ray or MLflow start: (study, state to save)."""
    from hpsearch.tracking import DEFAULT_TRACKING_URI, check_experiment_active, resolve_tracking_uri, store_folder
    from hpsearch.tune import optuna_store

    if args.num_samples is not None and args.num_samples < 1:
        raise ConfigError(f"--num-samples: {args.num_samples}; expected an integer >= 1")
    if args.system_metrics is not None and not 0.5 <= args.system_metrics <= 3600:
        raise ConfigError(f"--system-metrics: {args.system_metrics:g}; expected seconds between samples in [0.5, 3600]")
    overrides = list(args.overrides) + ([f"budget.trials={args.num_samples}"] if args.num_samples else [])
    space_path = Path(args.space) if args.space else DEFAULT_SPACE
    uri = resolve_tracking_uri(args.tracking_uri) if args.tracking_uri else None
    optuna_url = optuna_store.resolve_url(args.optuna_storage) if args.optuna_storage else None
    storage = open_storage(args.storage_path)
    if args.resume:
        name = args.name or latest_study(storage, space_name(space_path))
        study_dir = study_folder(storage, name)
        storage.pull(name, STATE_FILE, SPACE_COPY)  # from the bucket, when the study lives in one
        if args.space and not space_path.is_file():
            raise ConfigError(f"--space {args.space}: no such file; drop --space (--resume continues with the "
                              "study's own copy)")
        if storage.exists(name) and not storage.exists(name, STATE_FILE):  # claimed by a start under way or killed
            raise ConfigError(f"--resume: the study '{name}' in {storage.uri} saved no state yet (a start of it under "
                              "way, or stopped before it saved one): nothing to resume; if none is running, remove "
                              f"{storage.remote_path(name) if storage.remote else study_dir} and start it without "
                              "--resume")
        state = load_state(study_dir)
        if args.space and space_path.read_text() != state["space_text"]:
            raise ConfigError(f"--space {args.space}: differs from the space study '{name}' started with; --resume "
                              "continues with the study's own copy (drop --space, or start a new --name)")
        if overrides and overrides != state["overrides"]:
            raise ConfigError(f"--resume: overrides {overrides} differ from the study's {state['overrides']}; drop "
                              "them (the study keeps its own) or start a new --name")
        if uri and uri != state["tracking_uri"]:
            raise ConfigError(f"--tracking-uri: the study tracks to {redacted(state['tracking_uri'])}; drop "
                              "--tracking-uri")
        resolve_tracking_uri(state["tracking_uri"])  # still reachable and writable
        if optuna_url and optuna_url != state.get("optuna_storage"):
            raise ConfigError(f"--optuna-storage: the study records to {state.get('optuna_storage') or 'memory'}; "
                              "drop --optuna-storage")
        missing = optuna_store.missing_sqlite_file(state.get("optuna_storage"))
        if missing:  # an empty database made here would hold none of the searcher's trials
            raise ConfigError(f"--resume: the study's Optuna record {state['optuna_storage']} is missing ({missing} "
                              "is not on this machine: a study in a bucket tracking to an MLflow server keeps it in "
                              "the first machine's working directory); put that file there, then --resume")
        space = load_space(study_dir / SPACE_COPY, state["overrides"], started=True)
    else:
        space = load_space(space_path, overrides)
        uri = uri or resolve_tracking_uri(DEFAULT_TRACKING_URI)
        optuna_url = optuna_url or optuna_store.default_url(uri, None if storage.remote else storage.local_root)
        recorded = optuna_store.recorded_studies(optuna_url)  # nothing created yet
        name = args.name or next_free_study(storage, space.name, recorded)
        study_dir = study_folder(storage, name)
        if storage.exists(name):
            where = study_dir if not storage.remote else storage.remote_path(name)
            if not storage.exists(name, STATE_FILE):  # claimed by a start still under way, or killed before it saved
                raise ConfigError(f"--name {name}: {where} holds a study that saved no state yet (a start of it "
                                  "under way, or stopped before it saved one): if none is running, remove that "
                                  "folder to start it again, or choose another --name")
            raise ConfigError(f"--name {name}: a study of that name already exists in {where}; add --resume to "
                              "continue it, or choose another --name")
        if name in recorded:  # Optuna would append this study's trials to the old one's
            raise ConfigError(f"--name {name}: the Optuna storage {optuna_url} already holds a study of that name; "
                              "choose another --name or --optuna-storage")
        state = {"name": name, "space_path": str(space_path), "space_text": space_path.read_text(),
                 "overrides": overrides, "tracking_uri": uri, "optuna_storage": optuna_url,
                 "system_metrics": args.system_metrics}
    absolute_paths(space.config)
    check_data(space.config, {p.name for p in space.params})
    check_backbone(space.config, space.params)
    if not os.environ.get("RAY_ADDRESS"):  # a private local Ray: this machine is the whole cluster
        check_fits(space)
    else:  # a cluster to join: it must answer
        from hpsearch.train.launch import check_ray_address
        check_ray_address()
    check_experiment_active(state["tracking_uri"], name)
    storage.check_writable()  # after the checks that write nothing: it creates the storage's folder
    made = store_folder(state["tracking_uri"])  # and the MLflow store's (the Optuna database may go beside it)
    if state.get("optuna_storage"):  # creates the database (its tables) when it is new
        try:
            optuna_store.open_storage(state["optuna_storage"])
        except ConfigError:
            if made:  # the store's new folder, which this command made a moment ago: nothing is left behind
                shutil.rmtree(made, ignore_errors=True)
            raise
    if not args.resume:  # last: the name is this study's from now on (Storage.claim)
        name, study_dir = claim(storage, name, study_dir, args.name is None, space.name, recorded)
        state["name"] = name
    return Study(name, study_dir, space, state.get("optuna_storage"), storage=storage), state


def claim(storage: Storage, name: str, study_dir: Path, free_to_rename: bool, base: str, recorded: set[str],
           then: str = "add --resume to continue it, or choose another --name") -> tuple[str, Path]:
    """Take the study's name (`Storage.claim`), failing if another start has it; without --name the next free
    name is taken instead."""
    while not storage.claim(name):
        if not free_to_rename:
            raise ConfigError(f"--name {name}: a study of that name has just started in "
                              f"{storage.remote_path(name) if storage.remote else study_dir}; {then}")
        name = next_free_study(storage, base, recorded)
        study_dir = study_folder(storage, name)
    return name, study_dir


def space_name(path: Path) -> str:
    data, _ = read_yaml(path)
    return str(data.get("name") or path.stem)


def numbered(storage: str | Storage, base: str) -> list[tuple[int, str]]:
    """Existing studies named `base`, `base-2`, `base-3`, ... as (number, name)."""
    storage = open_storage(storage) if isinstance(storage, str) else storage
    names = storage.names()
    found = [(1, base)] if base in names else []
    found += [(int(n.rsplit("-", 1)[1]), n) for n in names if re.fullmatch(re.escape(base) + r"-\d+", n)]
    return sorted(found)


def next_free_study(storage_path: str | Storage, base: str, recorded: set[str] = frozenset()) -> str:
    """Without --name, a new study never collides: `default`, then `default-2`, `default-3`, ... (also skipping
    names the Optuna storage already holds)."""
    taken = numbered(storage_path, base)
    n = taken[-1][0] + 1 if taken else 1
    while (base if n == 1 else f"{base}-{n}") in recorded:
        n += 1
    return base if n == 1 else f"{base}-{n}"


def latest_study(storage_path: str | Storage, base: str) -> str:
    """`--resume` without --name continues the newest study of the space's name."""
    taken = numbered(storage_path, base)
    return taken[-1][1] if taken else base


def study_folder(storage: str | Storage, name: str, given_by: str = "--name") -> Path:
    """The study's local folder (with a bucket: its local mirror); `given_by`: where the name came from, for the
    message when it is no plain name."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ConfigError(f"{given_by} {name!r}: expected a plain name (letters, digits, '.', '-' and '_')")
    return (open_storage(storage) if isinstance(storage, str) else storage).study_dir(name)


def check_data(cfg, searched: set[str] = frozenset()) -> None:
    """Local data must load here, before any trial (the hub is left to the trials: it downloads), and its targets
    fit the config's lengths (`config.check_run_data`) unless a field they depend on is `searched`: each trial
    checks its own then."""
    from hpsearch.config import TARGET_FIELDS, check_run_data
    check_run_data(cfg, hub=False, targets=not searched & set(TARGET_FIELDS))


def check_backbone(cfg, searched: list | None = None) -> None:
    """A local backbone folder must be a checkpoint (a hub id is left to the trials: it downloads), and one this
    library pretrained must not have trained on the rows this suite validates on: the fixed config's, and each
    value of a searched `model.backbone` (`searched`: the space's params)."""
    from hpsearch.model import check_backbone_width, check_local_backbone
    from hpsearch.model.config import WIDTH_FIELDS
    from hpsearch.pretrain.corpus import check_backbone_corpus
    choices = next((p.choices or [] for p in searched or [] if p.name == "model.backbone"), [])
    for backbone in dict.fromkeys([cfg.model.backbone, *choices]):
        check_local_backbone(backbone)
        check_backbone_corpus(backbone, cfg.data)
    if not {p.name for p in searched or []} & set(WIDTH_FIELDS):  # else each trial checks its own combination
        check_backbone_width(cfg.model)


def check_fits(space) -> None:
    """A trial that can never be placed on this machine (a private local Ray) would wait forever (Tune's warning
    about it is silenced): say so before Ray starts (`launch.shortfall`)."""
    from hpsearch.train.launch import RAY_COUNTS, local_resources, shortfall
    from hpsearch.tune.cluster import trial_resources

    t, needs = space.config.train, trial_resources(space)
    driver = space.resources.driver_resource
    if driver and local_resources(gpus="GPU" in needs).get(driver, 0.0) < 1:
        raise ConfigError(f"resources.driver_resource: {driver}: a private local Ray has no such resource, so no "
                          "trial could start; set it only for a cluster whose head offers it (RAY_ADDRESS)")
    short = shortfall(needs)
    if short:
        kind, need, have, as_ray_counts = short
        per_worker = t.cpus_per_worker if kind == "CPU" else t.gpus_per_worker
        extra = f" + {space.resources.trial_cpus} for the trial's driver" if kind == "CPU" else ""
        raise ConfigError(f"resources: one trial needs {need:g} {kind} ({t.num_workers} workers x {per_worker:g}"
                          f"{extra}) but this machine has {have:g}{RAY_COUNTS if as_ray_counts else ''}; lower "
                          f"resources.workers or resources.{'cpus' if kind == 'CPU' else 'gpus'}_per_worker")
