"""The study's Optuna record in a database: `optuna.storages.RDBStorage`, one Optuna study per hpsearch study.

Default: a sqlite file `optuna.db` beside a sqlite MLflow store (`sqlite:///…/mlflow.db`), else in the local storage
path (beside the studies), else (a bucket) in the working directory; `--optuna-storage URL` takes any SQLAlchemy URL
(`postgresql://…`, `mysql+pymysql://…`). The Optuna study's name is the study's name, so
`optuna.load_study(study_name=NAME, storage=URL)` reads every trial (COMPLETE, PRUNED for ASHA-stopped, FAIL) with
its params and intermediate values, `optuna-dashboard URL` shows it live, and `--resume` continues the same Optuna
study (Ray's saved searcher holds the storage by its URL).
"""
from __future__ import annotations

import sys
from pathlib import Path

from hpsearch.errors import ConfigError

FILE_NAME = "optuna.db"


def default_url(tracking_uri: str, storage_folder: Path | None = None) -> str:
    """Beside a sqlite MLflow store; else in the studies' local folder (`storage_folder`, the storage path: a
    `ray job`'s working directory is a copy the next cluster does not have); else (a bucket) the working
    directory."""
    if tracking_uri.startswith("sqlite:///"):
        return f"sqlite:///{Path(tracking_uri.removeprefix('sqlite:///')).parent / FILE_NAME}"
    return f"sqlite:///{(storage_folder or Path.cwd()).resolve() / FILE_NAME}"


def resolve_url(url: str) -> str:
    """A relative sqlite path made absolute (Ray runs elsewhere; the state file keeps the URL)."""
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        return f"sqlite:///{Path(url.removeprefix('sqlite:///')).expanduser().resolve()}"
    return url


def sqlite_file(url: str | None) -> Path | None:
    """The database file of a sqlite URL as SQLAlchemy reads it (a query string such as ?timeout=30 is no part of
    it); None for another database or an in-memory one."""
    if not url or not url.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(url).database
    return Path(database) if database and database != ":memory:" else None


def missing_sqlite_file(url: str | None) -> str | None:
    """The database file of a sqlite URL when it does not exist, else None."""
    path = sqlite_file(url)
    return str(path) if path is not None and not path.is_file() else None


def open_storage(url: str):
    """The RDBStorage at `url` (tables created once, under a file lock for sqlite); a one-line ConfigError when
    it cannot be opened."""
    import logging

    import optuna

    for name in ("alembic", "optuna"):
        logging.getLogger(name).setLevel(logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = sqlite_file(url)
    try:
        if path is not None:
            import fcntl

            if not path.parent.is_dir():
                raise OSError(f"folder {path.parent} does not exist")
            with open(f"{path}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 30}})
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
        return optuna.storages.RDBStorage(url)
    except Exception as e:  # SQLAlchemy's errors, a missing driver, a folder that is not there or not writable
        reason = " ".join(str(e).split())[:200]
        raise ConfigError(f"--optuna-storage {url}: cannot be opened ({type(e).__name__}: {reason}); expected a "
                          "SQLAlchemy URL whose database can be created or reached, e.g. sqlite:///path/optuna.db"
                          ) from None


def recorded_studies(url: str) -> set[str]:
    """The study names the storage holds (a sqlite file that does not exist yet holds none and is not created)."""
    if missing_sqlite_file(url):
        return set()
    return {s.study_name for s in open_storage(url).get_all_studies()}


def fail_lost_trials(url: str, study_name: str, say=print) -> int:
    """At a study's end: its Optuna trials still RUNNING are ones Tune lost (the driver was killed after asking for
    them, before Tune saved that it had; Tune ran the study on without them): marked FAIL. Returns how many. A
    database that cannot be reached then is said in one line (the study's report and prune go on); -1."""
    import optuna

    try:
        study = optuna.load_study(study_name=study_name, storage=open_storage(url))
        lost = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        for trial in lost:
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    except Exception as e:  # ConfigError from open_storage, SQLAlchemy's errors, a study deleted meanwhile
        reason = " ".join(str(e).split())[:500]  # a ConfigError names the URL
        say(f"[hpsearch.tune] the Optuna study {study_name}'s lost trials were not marked FAIL (trials RUNNING "
            f"there were not run): {reason}")
        return -1
    return len(lost)


def dashboard_command(url: str) -> str:
    """The command that serves this storage on 127.0.0.1 (the `dashboard` extra installs optuna-dashboard)."""
    from hpsearch.cli import redacted

    exe = Path(sys.executable).parent / "optuna-dashboard"
    return f"{exe if exe.is_file() else 'optuna-dashboard'} {redacted(url)} --host 127.0.0.1 --port 8080"
