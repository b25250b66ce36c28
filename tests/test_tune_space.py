"""Search spaces: the shipped files load; every mistake is one line naming file:line (or the override) and what
is valid, raised before Ray starts; the define-by-run space honours conditions; the pieces of the study logic
that need no cluster (concurrency, pruned trials, the analysis study)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest

from hpsearch.errors import ConfigError, UserError
from hpsearch.tune.spacefile import load_space

ROOT = Path(__file__).resolve().parents[1]
SPACES = ROOT / "search_spaces"

BASE = """\
name: t
search:
  model.variant: {type: categorical, choices: [share, sep, global]}
  model.layer_task_dim: {type: int, low: 8, high: 64, step: 8, when: {model.variant: global}}
  train.lr: {type: loguniform, low: 1.0e-4, high: 1.0e-2}
budget:
  max_steps: 40
  eval_every: 20
"""


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("name", ["default", "paper", "glue-local"])
def test_shipped_spaces_load(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # glue-local reads ../shared/data/glue relative to the checkout
    space = load_space(SPACES / f"{name}.yaml")
    names = [p.name for p in space.params]
    assert {"model.variant", "train.lr"} <= set(names)
    assert space.budget.trials >= 6 and space.primary.metric == "score"
    if name == "paper":
        assert space.config.model.backbone == "google/t5-v1_1-base" and space.config.train.use_gpu  # C4 only
        assert space.param("model.prompt_length_encoder").low == 1
        assert space.param("model.prompt_length_encoder").high == 64
        assert space.multi_objective
    elif name == "glue-local":  # the backbone python -m hpsearch.pretrain makes
        assert space.config.model.backbone == "runs/pretrain/backbone" and not space.config.train.use_gpu
    else:
        assert space.config.model.backbone == "t5-tiny" and not space.config.train.use_gpu


def test_default_space_shape():
    space = load_space(SPACES / "default.yaml")
    t = space.config.train
    assert (t.num_workers, t.cpus_per_worker, space.resources.trial_cpus) == (2, 0.9, 0.1)
    assert space.param("model.layer_task_dim").when == {"model.variant": ["global"]}
    assert space.param("model.prompt_length_encoder").when == {"model.placement": ["encoder", "both"]}
    assert t.max_steps == space.budget.max_steps and t.eval_every == space.budget.eval_every


@pytest.mark.parametrize("text,match", [
    (BASE + "serach: {}\n", r"space.yaml:9: unknown key 'serach'; a space file has name, description"),
    (BASE.replace("model.variant:", "model.varient:"), r"space.yaml:3: unknown field 'model.varient'"),
    (BASE.replace("step: 8", "stp: 8"), r"space.yaml:4: search.model.layer_task_dim: unknown key 'stp' for type int"),
    (BASE.replace("type: loguniform", "type: normal"), r"space.yaml:5: search.train.lr: type 'normal'; expected"),
    (BASE.replace("low: 8, high: 64", "low: 64, high: 8"), r"space.yaml:4: search.model.layer_task_dim.high: 8 is "
                                                          r"not above low 64"),
    (BASE.replace("low: 1.0e-4", "low: 0"), r"space.yaml:5: search.train.lr.low: 0; a log scale needs low > 0"),
    (BASE.replace("high: 1.0e-2", "high: 2.0"), r"space.yaml:5: search.train.lr.high: 2.0 is not a valid value "
                                                r"\(train.lr: 2.0 is out of range; expected 0 < lr < 1\)"),
    (BASE.replace("high: 64", "high: 5000"), r"space.yaml:4: search.model.layer_task_dim.high: 5000 is not a valid"),
    (BASE.replace("sep, global]", "globl]"), r"space.yaml:3: search.model.variant.choices: 'globl' is not a valid"),
    (BASE.replace("type: int, low: 8, high: 64, step: 8", "type: uniform, low: 8, high: 64"),
     r"space.yaml:4: search.model.layer_task_dim: type uniform needs a number field; .* use type int"),
    (BASE.replace("when: {model.variant: global}", "when: {model.varient: global}"),
     r"space.yaml:4: search.model.layer_task_dim.when.model.varient: unknown field"),
    (BASE.replace("when: {model.variant: global}", "when: {model.variant: globl}"),
     r"space.yaml:4: .*when.model.variant: 'globl' can never hold; model.variant is searched over"),
    (BASE.replace("  train.lr: {type: loguniform", "  model.bottleneck: {type: int, low: 8, high: 32, when: "
                  "{model.layer_task_dim: 12}}\n  train.lr: {type: loguniform"),
     r"space.yaml:5: .*when.model.layer_task_dim: 12 can never hold; model.layer_task_dim is searched over \[8, 64\] "
     r"in steps of 8"),
    (BASE.replace("when: {model.variant: global}", "when: {train.lr: 0.5}"),
     r"space.yaml:4: .*when.train.lr: train.lr is searched after model.layer_task_dim; list it before"),
    ("model:\n  variant: share\n" + BASE.replace("  model.variant: {type: categorical, choices: [share, sep, "
                                                 "global]}\n", ""),
     r"space.yaml:5: .*when.model.variant: can never hold; model.variant is fixed to 'share'"),
    (BASE + "objectives:\n  - {metric: acc, mode: max}\n",
     r"space.yaml:9: objectives\[0\].metric: 'acc'; expected one of score, best_score, loss"),
    (BASE + "objectives:\n  - {metric: score, mode: up}\n", r"space.yaml:9: objectives\[0\].mode: 'up'; expected max"),
    (BASE + "  grace_period: 100\n", r"space.yaml:9: budget.grace_period: 100; expected an integer in \[1, "
                                     r"max_steps=40\]"),
    (BASE + "  reduction_factor: 1\n", r"space.yaml:9: budget.reduction_factor: 1; expected an integer >= 2"),
    (BASE + "  trails: 3\n", r"space.yaml:9: unknown key 'budget.trails'; budget has trials, max_steps"),
    (BASE + "train:\n  max_steps: 30\n", r"space.yaml:10: train.max_steps is also set by budget.max_steps "
                                         r"\(.*space.yaml:7\); set it in one place"),
    (BASE + "train:\n  output_dir: x\n", r"space.yaml:10: train.output_dir is not set in a space file"),
    (BASE.replace("train.lr:", "train.num_workers:").replace("type: loguniform, low: 1.0e-4, high: 1.0e-2",
                                                             "type: categorical, choices: [1, 2]"),
     r"space.yaml:5: search.train.num_workers: cannot be searched"),
    (BASE + "points_to_evaluate:\n  - {model.layer_task_dim: 100}\n",
     r"space.yaml:9: points_to_evaluate\[0\].model.layer_task_dim: 100 is outside the searched range"),
    # off the step grid: Optuna would train it, and the report's rebuilt study then refused it (a traceback at the
    # end of every run and --resume)
    (BASE + "points_to_evaluate:\n  - {model.variant: global, model.layer_task_dim: 12}\n",
     r"space.yaml:9: points_to_evaluate\[0\].model.layer_task_dim: 12 is outside the searched range; expected a "
     r"value from 8 to 64 in steps of 8$"),
    # strings PyYAML leaves (nan, 1e999) and a step that is no finite number: one line, not a traceback
    (BASE.replace("high: 64", "high: nan"), r"space.yaml:4: search.model.layer_task_dim.high: 'nan'; expected a "
                                            r"number"),
    (BASE.replace("high: 64", "high: 1e999"), r"space.yaml:4: search.model.layer_task_dim.high: '1e999'; expected"),
    (BASE.replace("step: 8", "step: .nan"), r"space.yaml:4: search.model.layer_task_dim.step: nan; expected a finite "
                                            r"number > 0"),
    (BASE.replace("step: 8", "step: .inf"), r"space.yaml:4: search.model.layer_task_dim.step: inf; expected a finite"),
    # a high off the step grid: Optuna would lower it to 56, warning, and refuse a point at 60 in the report
    (BASE.replace("high: 64", "high: 60"), r"space.yaml:4: search.model.layer_task_dim.high: 60 is not low 8 plus a "
                                           r"whole number of steps of 8; expected high: 56"),
    (BASE.replace("type: loguniform, low: 1.0e-4, high: 1.0e-2", "type: uniform, low: 0.001, high: 0.0105, "
                  "step: 0.002"), r"space.yaml:5: search.train.lr.high: 0.0105 is not low 0.001 plus a whole "
                                  r"number of steps of 0.002; expected high: 0.009 "),
    (BASE + "points_to_evaluate:\n  - {model.varient: share}\n",
     r"space.yaml:9: points_to_evaluate\[0\]: 'model.varient' is not searched; expected some of model.variant"),
    ("name: t\nsearch: {}\n", r"space.yaml:2: search: nothing to search"),
    (BASE + "resources:\n  trial_cpus: 0\n", r"space.yaml:10: resources.trial_cpus: 0.0; expected a number > 0"),
    (BASE + "sampler:\n  seed: -1\n", r"space.yaml:10: sampler.seed: -1; expected an integer in \[0, 2\*\*32 - 1\]"),
    (BASE + "sampler:\n  seed: 4294967296\n", r"space.yaml:10: sampler.seed: 4294967296; expected an integer in"),
    (BASE + "sampler:\n  n_startup_trials: -5\n",
     r"space.yaml:10: sampler.n_startup_trials: -5; expected an integer >= 0"),
    (BASE + "resources:\n  worker_group: never\n",
     r"space.yaml:10: resources.worker_group: 'never'; expected auto or always or pool"),
    (BASE.replace("train.lr:", "train.lr: [1"), r"space.yaml:\d: malformed YAML"),
])
def test_bad_space_is_one_line_error_with_line(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=match) as e:
        load_space(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,match", [
    (["budget.trials=0"], r"override 'budget.trials=0': budget.trials: 0; expected an integer >= 1"),
    (["model.variant=middle"], r"override 'model.variant=middle': model.variant: 'middle' is not one of"),
    (["search.train.lr=3"], r"override 'search.train.lr=3': 'search.train.lr' cannot be overridden"),
    (["budget.max_steps=10"], r"override 'budget.max_steps=10': budget.grace_period|budget.eval_every: 20; expected"),
])
def test_bad_override_names_the_override(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_space(write(tmp_path, BASE), overrides)


def test_overrides_pin_searched_fields_and_set_budget(tmp_path):
    space = load_space(write(tmp_path, BASE), ["train.lr=0.001", "budget.trials=3", "resources.workers=1",
                                               "data.temperature=2"])
    assert [p.name for p in space.params] == ["model.variant", "model.layer_task_dim"]
    assert space.pinned == {"train.lr": 0.001} and space.config.train.lr == 0.001
    assert space.budget.trials == 3 and space.config.train.num_workers == 1 and space.config.data.temperature == 2
    # pinning the variant to share leaves out layer_task_dim (searched only for global) and the point's variant
    default = load_space(SPACES / "default.yaml", ["model.variant=share"])
    assert "model.variant" not in default.points_to_evaluate[0] and default.config.model.variant == "share"
    assert "model.layer_task_dim" not in [p.name for p in default.params]
    assert "model.layer_task_dim" not in str(default.define_by_run().params)


def test_define_by_run_draws_conditional_fields_only_when_active(tmp_path):
    space = load_space(write(tmp_path, BASE))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    space_fn = space.define_by_run()
    seen = set()
    for _ in range(30):
        trial = study.ask()
        space_fn(trial)
        params = trial.params
        seen.add(params["model.variant"])
        assert ("model.layer_task_dim" in params) == (params["model.variant"] == "global")
        assert 1e-4 <= params["train.lr"] <= 1e-2
        cfg = space.trial_config(params)  # every draw is a valid run config
        assert cfg.model.variant == params["model.variant"]
        study.tell(trial, 0.0)
    assert seen == {"share", "sep", "global"}


def test_bad_space_exits_2_before_ray_starts(tmp_path):
    path = write(tmp_path, BASE.replace("high: 64", "high: 5000"))
    out = subprocess.run([sys.executable, "-m", "hpsearch.tune", "--space", str(path), "--storage-path",
                          str(tmp_path / "runs"), "--tracking-uri", f"sqlite:///{tmp_path}/m.db"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"error: {path}:4: search.model.layer_task_dim.high: 5000")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "m.db").exists()


def test_resume_without_a_study_and_a_second_start_are_one_line_errors(tmp_path):
    args = [sys.executable, "-m", "hpsearch.tune", "--storage-path", str(tmp_path / "runs"), "--name", "s1"]
    out = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--resume: no study 's1' in" in out.stderr and "Traceback" not in out.stderr
    # a folder without a state (a start killed before it saved one): neither command sends the user to the other
    (tmp_path / "runs" / "s1").mkdir(parents=True)
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr == f"error: --name s1: {tmp_path / 'runs' / 's1'} holds a study that " \
        "saved no state yet (a start of it under way, or stopped before it saved one): if none is running, remove " \
        "that folder to start it again, or choose another --name\n", out.stderr
    out = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr == f"error: --resume: the study 's1' in {tmp_path / 'runs'} saved no " \
        "state yet (a start of it under way, or stopped before it saved one): nothing to resume; if none is " \
        f"running, remove {tmp_path / 'runs' / 's1'} and start it without --resume\n", out.stderr
    (tmp_path / "runs" / "s1" / "hpsearch-study.json").write_text("{}")
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "a study of that name already exists" in out.stderr


def test_without_a_name_a_new_study_is_numbered_and_resume_takes_the_newest(tmp_path):
    from hpsearch.tune.cli import parse_args, prepare
    from hpsearch.tune.prepare import claim

    runs = tmp_path / "runs"
    store = ["--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"]  # not the default, ./mlflow.db where pytest runs
    first, _ = prepare(parse_args([*store, "--storage-path", str(runs)]))
    assert first.name == "default" and (runs / "default").is_dir()  # the name is claimed before Ray starts
    # a second study started at the same moment (the first has not saved its state yet): the next name, not the
    # same folder and Optuna study (found by an independent review); with --name, one line
    second, _ = prepare(parse_args([*store, "--storage-path", str(runs), "train.lr=2e-3"]))
    assert second.name == "default-2" and second.dir != first.dir
    named, _ = prepare(parse_args([*store, "--storage-path", str(runs), "--name", "s1"]))
    with pytest.raises(UserError, match=r"--name s1: .* holds a study that saved no state yet \(a start"):
        prepare(parse_args([*store, "--storage-path", str(runs), "--name", "s1"]))
    # both past that check at once: the second to create the folder stops
    with pytest.raises(UserError, match="--name s1: a study of that name has just started in"):
        claim(named.storage, "s1", named.dir, False, "default", set())
    again, _ = prepare(parse_args([*store, "--storage-path", str(runs)]))
    assert again.name == "default-3"
    with pytest.raises(UserError, match="the study 'default-3' .* saved no state yet"):  # the newest; no state here
        prepare(parse_args([*store, "--storage-path", str(runs), "--resume"]))



def test_a_deleted_experiment_and_a_missing_space_on_resume_are_one_line_before_anything_starts(tmp_path):
    """Found by an independent review: a study's MLflow experiment deleted in the UI failed in MLflow after Ray had
    started; `--resume --space <no such file>` was a FileNotFoundError traceback."""
    from mlflow.tracking import MlflowClient

    from hpsearch.tune.cli import parse_args, prepare

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    client.delete_experiment(client.create_experiment("hpsearch/gone"))
    args = ["--storage-path", str(tmp_path / "runs"), "--tracking-uri", uri]
    with pytest.raises(UserError, match=r"^MLflow experiment hpsearch/gone is deleted in sqlite:///.*: restore it "
                                        r"\(MLFLOW_TRACKING_URI=.* mlflow experiments restore --experiment-id 1\) "
                                        r"or choose another --name$"):
        prepare(parse_args([*args, "--name", "gone"]))
    assert not (tmp_path / "runs" / "gone").exists()  # nothing claimed
    prepare(parse_args([*args, "--name", "kept"]))
    for missing in (tmp_path / "no-such.yaml", tmp_path):
        with pytest.raises(UserError, match=rf"^--space {missing}: no such file; drop --space"):
            prepare(parse_args([*args, "--name", "kept", "--resume", "--space", str(missing)]))


def test_a_trial_that_fits_the_host_but_not_the_containers_cpu_limit_is_one_line(tmp_path, monkeypatch):
    """A private Ray offers the CPUs Ray counts: a container's limit, whole CPUs only. The check counted
    os.cpu_count(), so a trial of 1.9 CPU passed under a 1.5-CPU limit (Ray offers 1) and waited forever, Tune's
    warning silenced (found by an independent review). Ray's own cgroup reading is made to see a 1.5-CPU limit."""
    import ray._private.utils as ray_utils

    from hpsearch.tune.prepare import check_fits

    space = load_space(write(tmp_path, BASE))  # 2 workers x 0.9 CPU + 0.1 for the trial's driver
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(ray_utils.multiprocessing, "cpu_count", lambda: 4)
    check_fits(space)  # fits the host's 4
    monkeypatch.setattr(ray_utils, "_get_docker_cpus", lambda *a, **k: 1.5)
    with pytest.raises(UserError, match=r"one trial needs 1.9 CPU \(2 workers x 0.9 \+ 0.1 for the trial's driver\) "
                                        r"but this machine has 1 \(as Ray counts them: a container's CPU limit"):
        check_fits(space)


def test_the_time_budget_counts_while_the_driver_runs_and_stops_the_searcher(monkeypatch, tmp_path):
    """The budget's clock ticks at each report (and each loop of Tune's); a study restored by `--resume` goes on with
    what was left, not counting the time it was down; once spent, running trials stop at their next report and the
    searcher starts no new trial."""
    import pickle
    import time

    from ray.tune.search import Searcher

    from hpsearch.tune.searcher import TimeBudget
    from hpsearch.tune.study import make_searcher

    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    stopper = TimeBudget(10)
    assert stopper.stop_all() is False and not stopper("t1", {})
    now[0] += 6
    assert not stopper("t1", {})
    restored = pickle.loads(pickle.dumps(stopper))  # Tune's saved state; the driver is down for a while
    now[0] += 1000
    assert not restored("t1", {})  # 4 s left
    now[0] += 5
    assert restored("t1", {}) and restored.stop_all() is False  # a trial stops; the study ends when they have
    space = load_space(write(tmp_path, BASE))
    space.budget.time_budget_s = 10
    searcher = make_searcher(space)
    assert isinstance(searcher.suggest("a"), dict)
    now[0] += 11
    assert searcher.suggest("b") == Searcher.FINISHED

# ---- study logic without a cluster ------------------------------------------------------------------------------
def test_concurrency_follows_resources(tmp_path):
    from hpsearch.tune.cluster import concurrency

    space = load_space(write(tmp_path, BASE))  # 2 workers x 0.9 CPU + 0.1 for the trial's driver
    # null: what fits (the limit too on a machine of its own)
    assert concurrency(space, {"CPU": 2.0}) == (1, 1)
    assert concurrency(space, {"CPU": 8.0}) == (4, 4)
    assert concurrency(space, {"CPU": 1.0}) == (1, 1)  # waits for the autoscaler rather than never starting
    gpu = load_space(write(tmp_path, BASE + "resources:\n  workers: 2\n  gpus_per_worker: 1\n  cpus_per_worker: 4\n"))
    assert gpu.config.train.use_gpu
    assert concurrency(gpu, {"CPU": 64.0, "GPU": 8.0}) == (4, 4)
    # on a cluster that may grow, no limit: Tune's one pending trial is the demand its autoscaler adds nodes for
    assert concurrency(gpu, {"CPU": 8.0}, grows=True) == (None, 1)
    capped = load_space(write(tmp_path, BASE + "resources:\n  max_concurrent: 2\n"))
    assert concurrency(capped, {"CPU": 64.0}) == (2, 2)
    assert concurrency(capped, {"CPU": 2.0}, grows=True) == (2, 2)
    # a trial that launches Ray Train's worker group asks Tune for its driver's bundle alone, which places at once:
    # without a limit every trial would start together
    group = load_space(write(tmp_path, BASE + "resources:\n  worker_group: always\n"))
    assert concurrency(group, {"CPU": 8.0}, grows=True) == (4, 4)


def test_a_one_worker_trial_is_one_bundle_in_its_own_actor_unless_told(tmp_path):
    """One worker (worker_group auto): the trial's actor is the worker, one bundle holding the driver's CPU slice and
    the worker's resources; `always`, several workers or a driver resource: the driver's bundle, then the workers'."""
    from hpsearch.tune.cluster import in_process, trial_bundles, trial_resources

    def space(resources):
        return load_space(write(tmp_path, BASE + "resources:\n" + "".join(f"  {k}: {v}\n"
                                                                          for k, v in resources.items())))
    one = space({"workers": 1, "cpus_per_worker": 2, "trial_cpus": 0.5})
    assert in_process(one) and trial_bundles(one) == [{"CPU": 2.5}]
    gpu = space({"workers": 1, "cpus_per_worker": 4, "gpus_per_worker": 1})
    assert trial_bundles(gpu) == [{"CPU": 4.1, "GPU": 1}]
    always = space({"workers": 1, "cpus_per_worker": 2, "trial_cpus": 0.5, "worker_group": "always"})
    assert not in_process(always) and trial_bundles(always) == [{"CPU": 0.5}, {"CPU": 2.0}]
    assert trial_resources(always) == trial_resources(one) == {"CPU": 2.5}
    pinned = space({"workers": 1, "driver_resource": "hpsearch_driver"})
    assert not in_process(pinned) and trial_bundles(pinned) == [{"CPU": 0.1, "hpsearch_driver": 1.0}, {"CPU": 0.9}]
    two = space({"workers": 2})
    assert not in_process(two) and len(trial_bundles(two)) == 3


def test_a_trial_on_kept_ranks_asks_for_every_bundle_and_reuses_its_actor(tmp_path):
    """`worker_group: pool` (or `auto` with several workers): the trial's Tune actor asks for its own bundle and one
    per rank (its ranks start in those), Tune reuses it; with `always` the actor asks for its first bundle only (Ray
    Train places its workers)."""
    from hpsearch.tune.cluster import in_process, pooled, trial_placement, uses_ray_train
    from hpsearch.tune.study import Study

    def space(extra):
        return load_space(write(tmp_path, BASE + "resources:\n  workers: 2\n  cpus_per_worker: 1\n" + extra))
    pool = space("  worker_group: pool\n  driver_resource: hpsearch_driver\n")
    assert pooled(pool) and not in_process(pool)
    assert trial_placement(pool).bundles == [{"CPU": 0.1, "hpsearch_driver": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert Study("s", tmp_path / "s", pool).reuses_actors
    assert pooled(space("  worker_group: auto\n"))  # the default, with several workers
    group = space("  worker_group: always\n")
    assert not pooled(group) and trial_placement(group).bundles == [{"CPU": 0.1}]
    assert not Study("s", tmp_path / "s", group).reuses_actors
    # only Ray Train's worker group needs a private Ray's dashboard (launch.init_ray)
    assert uses_ray_train(group) and not uses_ray_train(pool) and not uses_ray_train(space("  worker_group: auto\n"))
    one = load_space(write(tmp_path, BASE + "resources:\n  workers: 1\n"))
    assert in_process(one) and not uses_ray_train(one)


def test_a_kept_rank_on_a_node_that_does_not_see_the_storage_fails_the_trial_in_one_line(tmp_path):
    """Ray Train's check, on kept ranks: the trial's thread marks the trial's folder, and a rank whose node does not
    see it (here: each node's own disk, as a local storage path is on a cluster) fails with one line that a retry
    would repeat, instead of storing its part of every checkpoint where no other rank reads it."""
    from pyarrow import fs

    from hpsearch.errors import UserError
    from hpsearch.tune.rankpool import check_shared, mark_shared
    from hpsearch.tune.study import deterministic

    disk = lambda node: fs.SubTreeFileSystem(str((tmp_path / node).resolve()), fs.LocalFileSystem())
    for node in ("head", "worker"):
        (tmp_path / node).mkdir()
    mark_shared(disk("head"), "study/train/t1")
    check_shared(disk("head"), "study/train/t1", 0)  # a rank beside the trial's thread (or on shared storage)
    with pytest.raises(UserError, match=r"rank 1 on node \S+ does not see study/train/t1.*bucket") as e:
        check_shared(disk("worker"), "study/train/t1", 1)
    assert deterministic(f"hpsearch.errors.UserError: {e.value}")  # the trial fails once, not retried
    check_shared(disk("head"), "study/train/t1", 1)  # the marker stays for every trial on that folder
    with pytest.raises(UserError):
        check_shared(disk("head"), "study/train/t2", 1)  # each trial's own folder


def test_autoscaler_verdict_needs_rounds_after_the_request_that_launch_nothing():
    """The autoscaler's reports (Ray's `__autoscaling_status` record) decide early only when several of its rounds
    after the request launched, started and lost no node; a launch, a pending node or a failure means: keep waiting."""
    from hpsearch.tune.cluster import autoscaler_adds_nothing

    idle = {"pending_launches": {}, "pending_nodes": [], "failed_nodes": [], "active_nodes": {"head": 1}}
    status = lambda t, **report: {"time": t, "autoscaler_report": {**idle, **report}}
    rounds: dict = {}
    assert autoscaler_adds_nothing(100.0, status(95.0), rounds) is None  # from before the request: not counted
    assert autoscaler_adds_nothing(100.0, status(100.0), rounds) is None  # the round the request came after
    assert autoscaler_adds_nothing(100.0, status(105.0), rounds) is None
    assert autoscaler_adds_nothing(100.0, status(105.0), rounds) is None  # the same round read twice
    assert autoscaler_adds_nothing(100.0, status(110.0), rounds) is None
    assert autoscaler_adds_nothing(100.0, None, rounds) is None  # no report this time
    assert "3 of its rounds" in autoscaler_adds_nothing(100.0, status(115.0), rounds)
    for busy in ({"pending_launches": {"worker": 1}}, {"pending_nodes": [["10.0.0.2", "worker", "setting-up"]]},
                 {"failed_nodes": [["10.0.0.3", "worker"]]}):
        rounds = {}
        for t in (105.0, 110.0, 115.0, 120.0):
            report = busy if t == 110.0 else {}
            assert autoscaler_adds_nothing(100.0, status(t, **report), rounds) is None, busy
    # a node lost before the request stays in every report (Ray keeps its failures): not a sign of work for us
    lost = {"failed_nodes": [["10.0.0.3", "worker"]]}
    rounds = {}
    assert [autoscaler_adds_nothing(100.0, status(t, **lost), rounds, failed_before=[("10.0.0.3", "worker")])
            for t in (105.0, 110.0)] == [None, None]
    assert "3 of its rounds" in autoscaler_adds_nothing(100.0, status(115.0, **lost), rounds,
                                                        failed_before=[["10.0.0.3", "worker"]])
    rounds = {}  # no autoscaler report at all (no autoscaler, or its v2 that keeps none here): the wait decides
    assert all(autoscaler_adds_nothing(0.0, {"time": t}, rounds) is None for t in range(1, 10))


def test_searcher_records_asha_stopped_trials_as_pruned(tmp_path):
    from optuna.trial import TrialState

    from hpsearch.tune.study import make_searcher

    space = load_space(write(tmp_path, BASE))
    assert space.config.train.max_steps == 40
    searcher = make_searcher(space)
    # as Tune calls a searcher: a result its scheduler (or stopper) stops the trial on never reaches
    # `on_trial_result`, only `on_trial_complete`; a trial that ends by itself reports its last result as ever
    for trial_id, steps, stopped in (("a", 40, False), ("b", 20, True), ("c", 30, True)):
        searcher.suggest(trial_id)
        for step in range(10, steps + 1, 10):  # the score peaks at step 10, then falls
            result = {"score": 0.7 - step / 100, "best_score": {"a": 0.5, "b": 0.45, "c": 0.4}[trial_id] + step / 1000,
                      "step": step, "training_iteration": step // 10}
            if not (stopped and step == steps):
                searcher.on_trial_result(trial_id, result)
        searcher.on_trial_complete(trial_id, result)
    trials = searcher._ot_study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.PRUNED, TrialState.PRUNED]
    assert trials[0].value == pytest.approx(0.54)  # Optuna is told the best-validation score, not the last
    # a stopped trial's intermediate values end with the result it was stopped on (TPE ranks it by them)
    assert trials[1].intermediate_values == pytest.approx({1: 0.46, 2: 0.47})
    assert trials[2].intermediate_values == pytest.approx({1: 0.41, 2: 0.42, 3: 0.43})


def test_the_default_optuna_database_is_beside_the_mlflow_store_or_the_studies(tmp_path, monkeypatch):
    """A cluster's study tracks to an MLflow server and runs as a `ray job`, whose working directory is a copy the
    next cluster does not have: its Optuna record goes beside the studies (shared storage), where --resume finds it."""
    from hpsearch.tune.optuna_store import default_url

    assert default_url(f"sqlite:///{tmp_path}/db/mlflow.db", tmp_path / "runs") == f"sqlite:///{tmp_path}/db/optuna.db"
    assert default_url("http://127.0.0.1:5000", tmp_path / "runs") == f"sqlite:///{tmp_path}/runs/optuna.db"
    monkeypatch.chdir(tmp_path)
    assert default_url("http://127.0.0.1:5000") == f"sqlite:///{tmp_path}/optuna.db"  # a bucket's study
    # (a study against a real MLflow server records this: tests/test_tune_servers.py)


def test_optuna_study_lives_in_its_database_and_a_restored_searcher_continues_it(tmp_path):
    from optuna.trial import TrialState

    from hpsearch.tune.study import make_searcher

    url = f"sqlite:///{tmp_path}/optuna.db"
    space = load_space(write(tmp_path, BASE))
    searcher = make_searcher(space, url, "s1")
    for trial_id, steps, error in (("a", 40, False), ("b", 20, False), ("c", 20, True)):
        searcher.suggest(trial_id)
        for step in range(20, steps + 1, 20):
            result = {"score": 0.7 - step / 100, "best_score": 0.5, "step": step, "training_iteration": step // 20}
            searcher.on_trial_result(trial_id, result)
        searcher.on_trial_complete(trial_id, None if error else result, error=error)
    searcher.save(str(tmp_path / "searcher.pkl"))  # what Tune keeps for a resume
    restored = make_searcher(space, url, "s1")
    restored.restore(str(tmp_path / "searcher.pkl"))
    restored.suggest("d")
    restored.on_trial_complete("d", {"score": 0.6, "best_score": 0.6, "step": 40, "training_iteration": 2})
    # another process reads the study back from the database alone
    study = optuna.load_study(study_name="s1", storage=url)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL,
                                               TrialState.COMPLETE]
    assert study.trials[0].value == 0.5 and study.trials[3].value == 0.6
    assert study.trials[0].intermediate_values == {1: 0.5, 2: 0.5}  # best_score so far, per evaluation
    assert study.trials[1].intermediate_values == {1: pytest.approx(0.5)}
    assert all("model.variant" in t.params and "train.lr" in t.params for t in study.trials)
    assert [s.study_name for s in optuna.get_all_study_summaries(url)] == ["s1"]


ACTOR_READS_CHECKPOINTS = """
import sys
from pathlib import Path
from pyarrow import fs
import hpsearch.tune.inprocess, hpsearch.tune.rankpool, hpsearch.tune.study
from hpsearch.train import checkpoints
folder = Path(sys.argv[1]) / "checkpoint_000001"
folder.mkdir()
checkpoints.write_report(folder, {"step": 20})
for rank in (0, 1):
    checkpoints.write_manifest(folder, rank)
print(checkpoints.newest_unreported(fs.LocalFileSystem(), sys.argv[1], 2, None)[0][0],
      checkpoints.read_report(folder)["step"], "torch" in sys.modules)
"""


RANK_IMPORTS = """
import sys
import hpsearch.train.loop, hpsearch.train.rendezvous, hpsearch.tune.rankpool
from hpsearch.train.ops import import_deepspeed
import_deepspeed()
print(sorted(m for m in sys.modules if m == "ray.train" or m.startswith("ray.train.")))
"""


def test_a_kept_rank_imports_what_it_trains_with_and_not_ray_train():
    """A kept rank joins its process group through rendezvous.py (Ray Train's backend that does the same is in
    torchconfig.py): importing what a rank runs brings no Ray Train module (0.7 s of each rank's start)."""
    proc = subprocess.run([sys.executable, "-c", RANK_IMPORTS], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_a_trials_actor_drives_kept_ranks_without_importing_torch(tmp_path):
    """The trial's Tune actor only hands reports and checkpoint pointers between its ranks and Tune: importing what it
    runs and reading the checkpoints' reports does not import torch (1 s and 180 MB of each trial actor here, on the
    head node where a cluster keeps the trials' actors)."""
    proc = subprocess.run([sys.executable, "-c", ACTOR_READS_CHECKPOINTS, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["20", "20", "False"]


def test_a_trial_in_its_own_actor_frees_memory_before_and_after_it_trains(monkeypatch):
    """The wiring of `free_trial_memory` (its effect: tests/test_train.py): a reused actor never holds two trials'
    engines, nor the last one's while it waits; it keeps random backbones before the trial builds (their effect:
    tests/test_model.py)."""
    import hpsearch.model.backbones as backbones
    import hpsearch.train.loop as loop
    import hpsearch.tune.inprocess as inprocess
    from hpsearch.config import load_config
    from hpsearch.tune.study import _train_in_this_actor

    calls = []
    monkeypatch.setattr(inprocess, "free_trial_memory", lambda: calls.append("free"))
    monkeypatch.setattr(backbones, "keep_random_backbones", lambda: calls.append("keep"))
    monkeypatch.setattr(inprocess, "TuneSession", lambda path, filesystem: f"session at {path}")
    monkeypatch.setattr(loop, "train_loop", lambda config, session: calls.append(session))
    _train_in_this_actor(load_config(None, []), "/study/train/t1", None, None, None)
    assert calls == ["free", "keep", "session at /study/train/t1", "free"]  # all before the trial builds



@pytest.mark.parametrize("objectives", [1, 2])
def test_a_searcher_restored_from_before_a_trial_was_told_does_not_tell_it_again(tmp_path, objectives):
    """Optuna writes a trial's end at once; Tune saves the searcher every 10 s or more. A driver killed in between
    restores a searcher that takes the finished trial for running, Tune runs it again, and its results and its end
    reached Optuna a second time: `UpdateFinishedTrialError`, "Cannot tell a PRUNED trial", and every `--resume`
    ended there (found by an independent review). The storage's word is taken: nothing is told twice."""
    from optuna.trial import TrialState

    from hpsearch.tune.study import make_searcher

    url = f"sqlite:///{tmp_path}/optuna.db"
    space = load_space(write(tmp_path, BASE))
    space.objectives = space.objectives[:objectives]
    result = lambda step: {"score": 0.5, "best_score": 0.5, "loss": 1.0, "step": step, "training_iteration": step // 20}
    for ends in ("pruned", "complete"):
        searcher = make_searcher(space, url, f"s-{ends}")
        searcher.suggest("t1")
        searcher.on_trial_result("t1", result(20))
        searcher.save(str(tmp_path / "searcher.pkl"))  # Tune's last save before the kill
        last = result(20 if ends == "pruned" else 40)  # ASHA stopped it at 20 (max_steps 40), or it ran through
        searcher.on_trial_result("t1", last)
        searcher.on_trial_complete("t1", last)
        restored = make_searcher(space, url, f"s-{ends}")  # --resume
        restored.restore(str(tmp_path / "searcher.pkl"))
        restored.on_trial_result("t1", last)  # the trial, run again, reports again
        restored.on_trial_complete("t1", last)
        restored.suggest("t2")  # and the study goes on
        restored.on_trial_complete("t2", result(40))
        study = optuna.load_study(study_name=f"s-{ends}", storage=url)
        first = TrialState.PRUNED if ends == "pruned" else TrialState.COMPLETE
        assert [t.state for t in study.trials] == [first, TrialState.COMPLETE], ends

def test_a_kept_rank_frees_memory_before_and_after_each_trial(monkeypatch):
    """The wiring of `free_trial_memory` and `keep_random_backbones` on a kept rank (as in a
    trial's own actor, above)."""
    import hpsearch.model.backbones as backbones
    import hpsearch.train.loop as loop
    import hpsearch.tune.inprocess as inprocess
    import hpsearch.tune.rankpool as rankpool

    calls = []
    for module in (inprocess, rankpool):
        monkeypatch.setattr(module, "free_trial_memory", lambda: calls.append("free"))
    monkeypatch.setattr(backbones, "keep_random_backbones", lambda: calls.append("keep"))
    monkeypatch.setattr(rankpool, "PoolSession", lambda rank, token, path, filesystem, taken: f"{token} at {path}")
    monkeypatch.setattr(loop, "train_loop", lambda config, session: calls.append(session))
    rank = rankpool.Rank()
    rank.rank = 1
    assert rank.run("t1", {}, "/study/train/t1", None, None) == "done"
    assert calls == ["free", "keep", "t1 at /study/train/t1", "free"]  # all before the trial builds



def test_a_kept_rank_trains_on_its_own_gpu_in_the_thread_that_runs_the_loop(monkeypatch):
    """CUDA's current device is per thread and a kept rank is a threaded actor: the device `join` set (in its call's
    thread) did not hold in the thread of the next call, `run`, where the loop trains, so every rank of a node
    trained on its first GPU. No GPU here: torch.cuda.set_device is recorded with its thread, and the thread the
    loop runs in must have set this rank's device."""
    import threading

    import torch

    import hpsearch.train.loop as loop
    import hpsearch.train.rendezvous as rendezvous
    import hpsearch.tune.rankpool as rankpool

    current, calls = threading.local(), []  # the device per thread, as CUDA keeps it
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(current, "device", d) or calls.append(d))
    monkeypatch.setattr(rendezvous, "join_process_group", lambda *a: None)
    monkeypatch.setattr(rankpool, "PoolSession", lambda *a: None)
    monkeypatch.setattr(rankpool, "free_trial_memory", lambda: None)
    monkeypatch.setattr(rankpool, "start_reused_trial", lambda: None)
    trained_on = []
    monkeypatch.setattr(loop, "train_loop", lambda config, session: trained_on.append(
        getattr(current, "device", 0)))  # what torch.cuda.current_device() would give there
    for var in ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        monkeypatch.setenv(var, "")
    rank = rankpool.Rank()
    in_thread = lambda f: (t := threading.Thread(target=f)).start() or t.join()
    in_thread(lambda: rank.join("nccl", 3, 4, "127.0.0.1", 1, (1, 2, 1, 2), ["4", "5"], 60))
    in_thread(lambda: rank.run("t1", {}, "/study/train/t1", None, None))
    assert trained_on == [1]  # local rank 1: the second of the node's two GPUs (CUDA_VISIBLE_DEVICES=4,5)
    cpu = rankpool.Rank()  # CPU ranks never touch CUDA
    calls.clear()
    in_thread(lambda: cpu.join("gloo", 0, 1, "127.0.0.1", 1, (0, 1, 0, 1), [], 60))
    in_thread(lambda: cpu.run("t2", {}, "/study/train/t2", None, None))
    assert calls == [] and trained_on == [1, 0]

def test_lost_optuna_trials_are_failed_at_the_end_and_an_unreachable_database_is_one_line(tmp_path):
    from optuna.trial import TrialState

    from hpsearch.tune.optuna_store import fail_lost_trials
    from hpsearch.tune.study import make_searcher

    url = f"sqlite:///{tmp_path}/optuna.db"
    searcher = make_searcher(load_space(write(tmp_path, BASE)), url, "s1")
    for trial_id in ("a", "b"):
        searcher.suggest(trial_id)
    searcher.on_trial_complete("a", {"score": 0.6, "best_score": 0.6, "step": 40, "training_iteration": 2})
    assert fail_lost_trials(url, "s1") == 1  # "b" was asked for and never told: Tune lost it
    assert [t.state for t in optuna.load_study(study_name="s1", storage=url).trials] == [TrialState.COMPLETE,
                                                                                         TrialState.FAIL]
    said = []
    gone = f"sqlite:///{tmp_path}/no-such-folder/optuna.db"
    assert fail_lost_trials(gone, "s1", said.append) == -1
    assert len(said) == 1 and "\n" not in said[0] and gone in said[0] and "no-such-folder does not exist" in said[0]


def test_a_full_disk_is_one_line_that_says_whether_resume_helps(tmp_path, monkeypatch):
    """The study's run is ended FAILED either way. A disk that filled under Tune (trials left): `--resume` continues.
    Every trial failed on it (the report's ending): run again, and that line is not replaced by the `--resume` one
    when the disk is still full."""
    import errno
    import shutil
    from types import SimpleNamespace

    import hpsearch.tune.cli as cli

    study = SimpleNamespace(name="s", storage_path=tmp_path / "runs", storage=SimpleNamespace(remote=False),
                            dir=tmp_path / "runs" / "s")
    ended = []
    parent = SimpleNamespace(finish=lambda status, over=False: ended.append(status))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=0))  # still full

    def stops_with(error):
        def run(*args):
            raise error
        monkeypatch.setattr(cli, "_run", run)
        with pytest.raises(UserError) as caught:
            cli._run_and_end(study, parent, make_tuner=lambda: None)
        return str(caught.value)

    said = stops_with(OSError(errno.ENOSPC, "No space left on device"))
    assert said == (f"no space left on device under {tmp_path / 'runs'}; free space there, then continue with: "
                    f"python -m hpsearch.tune --name s --storage-path {tmp_path / 'runs'} --resume")
    said = stops_with(cli._no_space(study, resume=False))
    assert said.endswith("free space there, then run the study again (--resume does not retry failed trials)")
    assert ended == ["FAILED", "FAILED"]
    # the study's state could not be saved, or Tune's not restored, after its MLflow run was made: ended, not left
    # RUNNING (found by an independent review)
    monkeypatch.setattr(cli, "_run", lambda *a: pytest.fail("no tuner: nothing runs"))
    with pytest.raises(UserError, match="no space left on device"):
        cli._run_and_end(study, parent, make_tuner=lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(KeyboardInterrupt):
        cli._run_and_end(study, parent, make_tuner=lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert ended == ["FAILED", "FAILED", "FAILED", "KILLED"]


def test_optuna_dashboard_serves_the_study_on_loopback(tmp_path):
    import json
    import socket
    import time
    import urllib.request

    url = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="served", storage=url)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).parent / "optuna-dashboard"
    proc = subprocess.Popen([str(exe), url, "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline, body = time.time() + 60, None
        while time.time() < deadline and body is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as r:
                    body = json.loads(r.read())
            except OSError:
                time.sleep(0.5)
        assert body is not None, "optuna-dashboard did not answer"
        (summary,) = body["study_summaries"]
        assert summary["study_name"] == "served"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_method_is_a_searched_axis_with_its_own_fields():
    space = load_space(SPACES / "methods.yaml")
    assert space.param("model.method").choices == ["mtl", "hyperprompt", "prompt_tuning", "adapter", "hyperformer",
                                                   "prefix", "lora", "mam", "pha"]
    seen = {}
    for method in space.param("model.method").choices:  # each method draws only its own fields
        trial = optuna.trial.FixedTrial({"model.method": method, "model.variant": "global", "model.placement": "both",
                                         "model.prompt_length_encoder": 4, "model.prompt_length_decoder": 2,
                                         "model.bottleneck": 8, "model.prompt_length": 8, "model.prompt_init": "vocab",
                                         "model.adapter_sites": "ffn", "model.reduction_factor": 4,
                                         "model.lora_rank": 4, "model.mam_scale": 2.0,
                                         "model.adapter_insertion": "parallel", "model.adapter_scale": 4.0,
                                         "model.pha_loss_weight": 0.3})
        space.define_by_run()(trial)
        seen[method] = set(trial.params)
        cfg = space.trial_config(trial.params)
        assert {f"model.{f}" for f in cfg.model.active_fields()} >= seen[method] - {"model.method"}
    assert seen["mtl"] == {"model.method"}
    assert seen["prompt_tuning"] == {"model.method", "model.prompt_length", "model.prompt_init"}
    assert seen["adapter"] == {"model.method", "model.bottleneck", "model.adapter_sites", "model.adapter_insertion",
                               "model.adapter_scale"}
    assert "model.variant" in seen["hyperprompt"] and "model.prompt_length" not in seen["hyperprompt"]
    assert seen["prefix"] == {"model.method", "model.prompt_length"}
    assert seen["lora"] == {"model.method", "model.lora_rank"}
    assert seen["mam"] == {"model.method", "model.bottleneck", "model.mam_scale"}
    assert seen["pha"] == {"model.method", "model.bottleneck", "model.pha_loss_weight"}
    assert len(space.points_to_evaluate) == len(space.param("model.method").choices)  # every method once first


@pytest.mark.parametrize("text,match", [
    ("""\
     name: t
     search:
       model.method: {type: categorical, choices: [mtl, adapter]}
       model.variant: {type: categorical, choices: [share, sep]}
     """, r"space.yaml:4: search.model.variant: no method it is searched under uses it \(mtl, adapter\); variant "
         r"belongs to hyperprompt"),
    ("""\
     name: t
     search:
       model.method: {type: categorical, choices: [mtl, adapter, prompt_tuning]}
       model.prompt_length: {type: int, low: 1, high: 8, when: {model.method: [mtl, adapter]}}
     """, r"search.model.prompt_length: no method it is searched under uses it \(mtl, adapter\)"),
    ("""\
     name: t
     model: {method: mtl}
     search:
       model.bottleneck: {type: categorical, choices: [8, 16]}
     """, r"search.model.bottleneck: no method it is searched under uses it \(mtl\); bottleneck belongs to "
         r"hyperprompt, adapter"),
])
def test_a_field_no_chosen_method_uses_is_an_error(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_space(write(tmp_path, text))


def test_a_retried_trial_is_said_once_as_restarted_not_started_again(capsys):
    from types import SimpleNamespace

    from hpsearch.tune.progress import TrialEvents

    events = TrialEvents(2, 20, 1, lambda result, failed: "failed" if failed else "complete")
    trial = SimpleNamespace(trial_id="t1", config={"train.lr": 0.001}, last_result={}, error_file=None)
    events.on_trial_start(0, [], trial)
    events.on_trial_start(0, [], trial)  # Tune's retry after a failure
    other = SimpleNamespace(trial_id="t2", config={"train.lr": 0.002}, last_result={}, error_file=None)
    events.on_trial_start(0, [], other)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[hpsearch.tune] trial t1 started (1/2): train.lr=0.001",
                     "[hpsearch.tune] trial t1 restarted after a failure (from its last checkpoint, if any)",
                     "[hpsearch.tune] trial t2 started (2/2): train.lr=0.002"]


def test_a_resume_after_the_report_was_logged_only_ends_what_the_end_left(tmp_path, capsys):
    """The driver stopped after logging the report, before ending the runs (or pushing the report to a bucket): a
    --resume ends the study's MLflow run as the report says, logs nothing again and starts no Ray."""
    from mlflow import MlflowClient

    from hpsearch.tracking import StudyRun
    from hpsearch.tune import cli
    from hpsearch.tune.study import Study, load_state

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    space = load_space(write(tmp_path, BASE))
    parent = StudyRun.create(uri, "s", space_path=str(space.path), space_text="x", command="c", params={})
    parent.log_report({"best_score": 70.0}, {}, {"summary.txt": "s"}, tmp_path / "none")
    study = Study("s", tmp_path / "runs" / "s", space)
    study.save_state({"name": "s", "space_text": "x", "overrides": [], "tracking_uri": uri,
                      "parent_run_id": parent.run_id,
                      "finished": {"outcome": "report logged", "code": 0, "status": "FINISHED", "ended": False}})
    client = MlflowClient(uri)
    assert client.get_run(parent.run_id).info.status == "RUNNING"
    assert cli._already_finished(study, load_state(study.dir)) == 0
    run = client.get_run(parent.run_id)
    assert run.info.status == "FINISHED" and len(client.get_metric_history(parent.run_id, "best_score")) == 1
    assert load_state(study.dir)["finished"]["ended"] is True
    assert "study 's' already finished (report logged): nothing to resume" in capsys.readouterr().out
    end = run.info.end_time
    assert cli._already_finished(study, load_state(study.dir)) == 0  # again: nothing left to do
    assert client.get_run(parent.run_id).info.end_time == end


def test_a_study_started_with_a_high_off_the_grid_still_resumes(tmp_path, capsys):
    """Before 2026-11-27 a high off the step's grid was accepted (Optuna lowered it): such a study's own copy
    loads on --resume with the high Optuna used, and a new study is refused."""
    path = write(tmp_path, BASE.replace("high: 64", "high: 60"))
    with pytest.raises(ConfigError, match="is not low 8 plus a whole number of steps of 8"):
        load_space(path)
    assert load_space(path, started=True).param("model.layer_task_dim").high == 56
    assert "search.model.layer_task_dim.high: 60 lowered to 56" in capsys.readouterr().err


def test_a_point_is_in_the_space_exactly_when_optuna_takes_it(tmp_path):
    """`Param.contains` (points_to_evaluate) agrees with Optuna's `create_trial`, which the report's rebuilt study
    applies: on the bounds and the step grid, for int and float steps."""
    text = BASE.replace("type: loguniform, low: 1.0e-4, high: 1.0e-2", "type: uniform, low: 0.001, high: 0.009, "
                                                                       "step: 0.002")
    space = load_space(write(tmp_path, text))
    cases = {"model.layer_task_dim": [8, 12, 16, 56, 60, 64, 72, 0, 16.0],
             "train.lr": [0.001, 0.002, 0.003, 0.007, 0.009, 0.0091, 0.011, 0.0]}
    for name, values in cases.items():
        param = space.param(name)
        for value in values:
            try:
                optuna.trial.create_trial(params={name: value}, distributions={name: param.distribution()}, value=0)
                taken = True
            except ValueError:
                taken = False
            assert param.contains(value) == taken, (name, value, taken)


def test_a_failed_state_write_leaves_the_last_state_resumable(tmp_path, monkeypatch):
    """The study's state is replaced whole: a write that fails half-way (a full disk, here the flush to the disk
    failing) leaves the state saved before, which --resume reads, and no temporary file."""
    import errno

    from hpsearch.tune import study as study_module
    from hpsearch.tune.study import Study, load_state

    space_path = write(tmp_path, BASE)
    study = Study("s", tmp_path / "runs" / "s", load_space(space_path))
    study.save_state({"name": "s", "overrides": [], "tracking_uri": "sqlite:///m.db", "parent_run_id": "r",
                      "space_text": space_path.read_text(), "elapsed_s": 1.0})

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(study_module.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        study.update_state(elapsed_s=2.0, notes="x" * 100_000)
    monkeypatch.undo()
    assert load_state(study.dir)["elapsed_s"] == 1.0
    assert sorted(p.name for p in study.dir.iterdir()) == ["hpsearch-study.json", "space.yaml"]
    assert study.update_state(elapsed_s=3.0)["elapsed_s"] == 3.0 and load_state(study.dir)["elapsed_s"] == 3.0


def test_resume_keeps_the_studys_own_space_and_overrides_and_a_recorded_optuna_study_is_not_appended_to(tmp_path):
    """--resume continues with the study's own copy of its space and its overrides (others are one line naming
    what differs); a new study never appends its trials to an Optuna study of the same name."""
    from hpsearch.tune import optuna_store
    from hpsearch.tune.cli import parse_args, prepare

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = ["--storage-path", str(tmp_path / "runs"), "--tracking-uri", uri]
    space_path = write(tmp_path, BASE)
    study, _ = prepare(parse_args([*args, "--space", str(space_path), "--name", "s", "train.lr=2e-3"]))
    study.save_state({"name": "s", "space_path": str(space_path), "space_text": space_path.read_text(),
                      "overrides": ["train.lr=2e-3"], "tracking_uri": uri, "parent_run_id": "r",
                      "optuna_storage": study.optuna_storage})
    resumed, _ = prepare(parse_args([*args, "--name", "s", "--resume"]))
    assert resumed.space.config.train.lr == 2e-3  # the study's own overrides
    with pytest.raises(UserError, match=r"^--resume: overrides \['train.lr=3e-3'\] differ from the study's "
                                        r"\['train.lr=2e-3'\]; drop them"):
        prepare(parse_args([*args, "--name", "s", "--resume", "train.lr=3e-3"]))
    other = tmp_path / "other.yaml"
    other.write_text(BASE.replace("max_steps: 40", "max_steps: 60"))
    with pytest.raises(UserError, match=rf"^--space {other}: differs from the space study 's' started with"):
        prepare(parse_args([*args, "--name", "s", "--resume", "--space", str(other)]))
    optuna.create_study(study_name="taken", storage=optuna_store.default_url(uri, tmp_path / "runs"))
    with pytest.raises(UserError, match=r"^--name taken: the Optuna storage sqlite:///.*optuna.db already holds a "
                                        r"study of that name; choose another --name or --optuna-storage$"):
        prepare(parse_args([*args, "--name", "taken"]))
    assert not (tmp_path / "runs" / "taken").exists()  # nothing claimed
    # a URL with a query string names the same file (its path alone was tested, and the study appended to)
    with_query = f"{optuna_store.default_url(uri, tmp_path / 'runs')}?timeout=60"
    assert optuna_store.recorded_studies(with_query) == {"taken"}
    with pytest.raises(UserError, match=r"^--name taken: the Optuna storage sqlite:///.*optuna.db\?timeout=60 already"):
        prepare(parse_args([*args, "--name", "taken", "--optuna-storage", with_query]))
    assert optuna_store.open_storage(with_query).get_all_studies()[0].study_name == "taken"
    assert sorted(p.name for p in tmp_path.glob("optuna.db*")) == ["optuna.db", "optuna.db.lock"]  # not "…=60.lock"


def test_ashas_rungs_are_restored_with_the_searcher_on_resume(tmp_path):
    """Tune restores the searcher's saved state but builds the scheduler afresh: a resumed study's ASHA had empty
    rungs, so the next trial passed the first rung whatever its score. The rungs are saved with the searcher: after a
    save and restore (Tune's own calls, into a new searcher and scheduler as `--resume` makes them) a poor trial
    is stopped at the first rung by the scores recorded before the interruption."""
    from types import SimpleNamespace

    from ray.tune.schedulers import TrialScheduler

    from hpsearch.tune.searcher import RungKeepingASHA
    from hpsearch.tune.study import make_searcher

    space = load_space(write(tmp_path, BASE))  # max_steps 40, first rung at 20

    def fresh():
        searcher = make_searcher(space)
        scheduler = RungKeepingASHA(time_attr="step", metric="score", mode="max", max_t=40, grace_period=20,
                                    reduction_factor=2)
        # Tune hands the scheduler its controller, whose search_alg wraps the searcher
        return searcher, scheduler, SimpleNamespace(search_alg=SimpleNamespace(searcher=searcher))

    searcher, scheduler, controller = fresh()
    for tid, score in (("a", 0.7), ("b", 0.8), ("c", 0.9)):
        trial = SimpleNamespace(trial_id=tid)
        searcher.suggest(tid)
        scheduler.on_trial_add(controller, trial)
        assert scheduler.on_trial_result(controller, trial, {"step": 20, "score": score}) == TrialScheduler.CONTINUE
    searcher.save(str(tmp_path / "searcher.pkl"))  # the driver is interrupted here

    restored, scheduler, controller = fresh()
    restored.restore(str(tmp_path / "searcher.pkl"))
    for tid in ("a", "b", "c"):  # Tune re-adds the restored trials
        scheduler.on_trial_add(controller, SimpleNamespace(trial_id=tid))
    poor = SimpleNamespace(trial_id="d")
    scheduler.on_trial_add(controller, poor)
    assert scheduler.on_trial_result(controller, poor, {"step": 20, "score": 0.1}) == TrialScheduler.STOP
    good = SimpleNamespace(trial_id="e")
    scheduler.on_trial_add(controller, good)
    assert scheduler.on_trial_result(controller, good, {"step": 20, "score": 0.95}) == TrialScheduler.CONTINUE
    # a trial recorded at the rung before the interruption, re-run from its checkpoint, is not judged again
    assert scheduler.on_trial_result(controller, SimpleNamespace(trial_id="b"), {"step": 20, "score": 0.0}) == \
        TrialScheduler.CONTINUE


def test_overrides_may_come_before_and_after_the_options():
    """`python -m hpsearch.tune model.variant=share --num-samples 1 train.lr=2e-3` (and the comparison's): every
    override is kept, as `hpsearch.train` takes them; argparse refused the ones after an option."""
    from hpsearch.compare.cli import parse_args as compare_args
    from hpsearch.tune.cli import parse_args

    args = parse_args(["model.variant=share", "--num-samples", "1", "train.lr=2e-3", "--name", "x", "sampler.seed=3"])
    assert args.overrides == ["model.variant=share", "train.lr=2e-3", "sampler.seed=3"] and args.num_samples == 1
    args = compare_args(["seeds=2", "--name", "x", "budget.max_steps=20"])
    assert args.overrides == ["seeds=2", "budget.max_steps=20"] and args.name == "x"


def test_a_bound_written_1e_4_is_a_number():
    """PyYAML reads `1e-4` (no dot) as a string; the run config's fields take it as a number, and so do a searched
    field's bounds (it was 'expected a number')."""
    text = BASE.replace("low: 1.0e-4, high: 1.0e-2", "low: 1e-4, high: 1e-2")
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        space = load_space(write(Path(d), text))
    assert (space.param("train.lr").low, space.param("train.lr").high) == (1e-4, 1e-2)



def test_resume_without_the_studys_optuna_database_is_one_line(tmp_path):
    """A study in a bucket tracking to a server keeps its Optuna record in the first machine's working directory;
    --resume where that file is missing said a flag the user never gave, or made an empty database."""
    from hpsearch.tune.cli import parse_args, prepare

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = ["--storage-path", str(tmp_path / "runs"), "--tracking-uri", uri]
    space_path = write(tmp_path, BASE)
    study, _ = prepare(parse_args([*args, "--space", str(space_path), "--name", "s"]))
    gone = f"sqlite:///{tmp_path}/elsewhere/optuna.db"
    state = {"name": "s", "space_path": str(space_path), "space_text": space_path.read_text(), "overrides": [],
             "tracking_uri": uri, "parent_run_id": "r", "optuna_storage": gone}
    study.save_state(state)
    with pytest.raises(UserError, match=rf"^--resume: the study's Optuna record {gone} is missing "
                                        rf"\({tmp_path}/elsewhere/optuna.db is not on this machine"):
        prepare(parse_args([*args, "--name", "s", "--resume"]))
    assert not (tmp_path / "elsewhere").exists()
    # a URL with a query string names the same file (SQLAlchemy reads the path without it): it resumes
    with_query = f"{study.optuna_storage}?timeout=30"
    study.save_state({**state, "optuna_storage": with_query})
    assert prepare(parse_args([*args, "--name", "s", "--resume"]))[0].optuna_storage == with_query


def test_a_task_objective_names_a_task_of_the_suite_as_results_do(tmp_path):
    """`task/<task>/score` is checked against the suite's tasks by their canonical names: with the default data.tasks
    a folder source stands for its own tasks (task/rte/score was refused, the synthetic task/first/score accepted,
    and every trial then failed without that metric), and SST-2 is reported as sst2."""
    glue = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"

    def space(metric: str, tasks: str | None = None) -> Path:
        path = tmp_path / "space.yaml"
        path.write_text(f"data: {{source: {glue}{', tasks: [' + tasks + ']' if tasks else ''}}}\n"
                        f"objectives: [{{metric: '{metric}', mode: max}}]\n"
                        "search: {train.lr: {type: loguniform, low: 1.0e-4, high: 1.0e-3}}\n")
        return path

    assert load_space(space("task/rte/score"), []).primary.metric == "task/rte/score"
    with pytest.raises(ConfigError, match=r"objectives\[0\].metric: 'task/first/score'; .* a task of the suite "
                                          r"\(cola, sst2, .*rte, .*scitail\)"):
        load_space(space("task/first/score"), [])
    assert load_space(space("task/sst2/score", "SST-2, rte"), []).primary.metric == "task/sst2/score"
    with pytest.raises(ConfigError, match=r"'task/SST-2/score'; .* a task of the suite \(sst2, rte\)"):
        load_space(space("task/SST-2/score", "SST-2, rte"), [])
    synthetic = tmp_path / "synthetic.yaml"
    synthetic.write_text("objectives: [{metric: 'task/first/score', mode: max}]\n"
                         "search: {train.lr: {type: loguniform, low: 1.0e-4, high: 1.0e-3}}\n")
    assert load_space(synthetic, []).primary.metric == "task/first/score"
