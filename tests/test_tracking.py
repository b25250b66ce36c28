"""The MLflow store: two studies starting together on a new sqlite file both get their parent run."""
from __future__ import annotations

import subprocess
import sys

import pytest
from mlflow import MlflowClient

CREATE = """
import sys
from hpsearch.tracking import StudyRun
run = StudyRun.create(sys.argv[1], sys.argv[2], space_path="space.yaml", space_text="name: x\\n", command="c",
                      params={"trials": 1})
run.finish()
"""


def test_two_studies_on_a_new_sqlite_file(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    procs = [subprocess.Popen([sys.executable, "-c", CREATE, uri, name], stderr=subprocess.PIPE, text=True)
             for name in ("one", "two")]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-1500:] for e in errors]
    client = MlflowClient(uri)
    for name in ("one", "two"):
        experiment = client.get_experiment_by_name(f"hpsearch/{name}")  # beside MLflow's own Default
        assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens on runs
        (run,) = client.search_runs([experiment.experiment_id])
        assert run.info.status == "FINISHED"


def test_a_study_saved_when_the_callback_lived_in_tracking_still_resumes():
    """Tune pickles the study's callbacks into its state (tuner.pkl); a study saved before the callback moved to
    hpsearch.tune.trialruns names it `hpsearch.tracking.TrialRuns`, and `--resume` unpickles that name."""
    import pickle

    from hpsearch.tune.trialruns import TrialRuns

    callback = TrialRuns("sqlite:///x.db", "1", "parent", "study", trial_config=dict, outcome=max)
    new = pickle.dumps(callback, protocol=0)
    assert b"hpsearch.tune.trialruns\nTrialRuns\n" in new
    old = new.replace(b"hpsearch.tune.trialruns\nTrialRuns\n", b"hpsearch.tracking\nTrialRuns\n")
    restored = pickle.loads(old)
    assert type(restored) is TrialRuns
    assert (restored.tracking_uri, restored.parent_run_id, restored.study) == ("sqlite:///x.db", "parent", "study")
    import hpsearch.tracking
    with pytest.raises(AttributeError):
        hpsearch.tracking.NoSuchName  # noqa: B018
