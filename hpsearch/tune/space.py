"""A search space in memory: the searched fields with their distributions and conditions, Optuna's
define-by-run function over them, the objectives, budget, resources and sampler, and each trial's run config.
Read from a file, and validated, by `hpsearch.tune.spacefile.load_space`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from hpsearch.config import RunConfig, set_field


@dataclass
class Budget:
    trials: int = 6
    max_steps: int | None = None        # -> train.max_steps (ASHA's max_t)
    eval_every: int | None = None       # -> train.eval_every (the steps where ASHA compares trials)
    grace_period: int | None = None     # steps every trial runs before ASHA may stop it; None: one evaluation
    reduction_factor: int = 2
    max_failures: int = 1               # Tune retries of a failed trial
    time_budget_s: float | None = None
    wait_for_nodes_s: float = 600.0     # on a cluster: how long to wait for nodes that fit one trial, then give up


WORKER_GROUPS = ("auto", "always", "pool")


@dataclass
class Resources:
    workers: int | None = None          # -> train.num_workers
    cpus_per_worker: float | None = None  # -> train.cpus_per_worker
    gpus_per_worker: float | None = None  # -> train.gpus_per_worker; > 0 also sets train.use_gpu
    trial_cpus: float = 0.1             # the trial's driver (launches the Ray Train trainer); Ray refuses 0
    max_concurrent: int | None = None   # None: as many trials as the cluster's CPUs/GPUs fit
    driver_resource: str | None = None  # a custom resource only the head offers (e.g. hpsearch_driver): each trial's
                                        # driver takes 1, so drivers stay on the head and workers go to worker nodes
    worker_group: str = "auto"          # auto: a one-worker trial trains in its Tune actor, others on ranks the
                                        # actor keeps (no Ray Train worker group; actors reused across trials);
                                        # pool: always on kept ranks (rankpool.py); always: a Train worker group a trial


@dataclass
class Sampler:
    seed: int = 0
    n_startup_trials: int = 3           # random trials before TPE models the results
    multivariate: bool = True           # multivariate TPE, grouped by the conditional structure


@dataclass
class Objective:
    metric: str
    mode: str                           # max | min

    @property
    def final_metric(self) -> str:
        """What a trial is ranked by at its end: the model it delivers is its best-validation checkpoint, so the
        suite score's final value is `best_score`, and a task's `best_task/<t>/score` (that task's score at the best
        step; ASHA still compares the current `metric` at its rungs)."""
        if self.metric == "score":
            return "best_score"
        return f"best_{self.metric}" if self.metric.startswith("task/") else self.metric

    def final_value(self, metrics: dict):
        return metrics.get(self.final_metric, metrics.get(self.metric))


@dataclass
class Param:
    """One searched run-config field and its distribution; `when` maps fields to the values that activate it."""

    name: str
    type: str
    choices: list | None = None
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    when: dict[str, list] = field(default_factory=dict)

    def active(self, values: dict[str, Any]) -> bool:
        return all(key in values and values[key] in allowed for key, allowed in self.when.items())

    def suggest(self, trial) -> Any:
        if self.type == "categorical":
            return trial.suggest_categorical(self.name, self.choices)
        if self.type == "int":
            return trial.suggest_int(self.name, self.low, self.high, step=self.step or 1, log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.type == "loguniform")

    def distribution(self):
        import optuna.distributions as d

        if self.type == "categorical":
            return d.CategoricalDistribution(self.choices)
        if self.type == "int":
            return d.IntDistribution(self.low, self.high, step=self.step or 1, log=self.log)
        return d.FloatDistribution(self.low, self.high, step=self.step, log=self.type == "loguniform")

    def contains(self, value: Any) -> bool:
        if self.type == "categorical":
            return value in self.choices
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        if self.type == "int" and value != int(value):
            return False
        if not self.low <= value <= self.high:
            return False
        # on the step grid, as Optuna's distribution requires (its `create_trial`, when the report rebuilds the study,
        # refuses a value off it); tested against Optuna's own check (Optuna is not imported here: the driver checks
        # a space before it loads any heavy library)
        step = self.step or (1 if self.type == "int" else None)
        if step is None:
            return True
        steps = (value - self.low) / step
        return abs(steps - round(steps)) < 1e-8

    def extremes(self) -> list:
        return list(self.choices) if self.type == "categorical" else [self.low, self.high]


class DefineByRun:
    """Optuna's define-by-run space (`OptunaSearch(space=...)`): conditional fields are suggested only when their
    `when` holds for the values already drawn (or fixed). Picklable, so Tune's searcher checkpoints keep it."""

    def __init__(self, params: list[Param], fixed: dict[str, Any]):
        self.params = params
        self.fixed = fixed  # the fixed run-config values the conditions read

    def __call__(self, trial) -> None:
        values = dict(self.fixed)
        for param in self.params:
            if param.active(values):
                values[param.name] = param.suggest(trial)


@dataclass
class SearchSpace:
    path: str
    name: str
    description: str
    config: RunConfig                   # the fixed run config (budget and resources applied, overrides too)
    params: list[Param]
    pinned: dict[str, Any]              # searched fields fixed by an override
    objectives: list[Objective]
    budget: Budget
    resources: Resources
    sampler: Sampler
    points_to_evaluate: list[dict]

    @property
    def primary(self) -> Objective:
        return self.objectives[0]

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    @property
    def grace_period(self) -> int:
        return self.budget.grace_period or self.config.train.eval_every

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)

    def define_by_run(self) -> DefineByRun:
        referenced = {key for p in self.params for key in p.when if key not in {q.name for q in self.params}}
        flat = self.config.flat()
        return DefineByRun(self.params, {key: flat[key] for key in referenced})

    def distributions(self, values: dict[str, Any]) -> dict:
        """Optuna distributions of the searched fields present in one trial's config."""
        return {p.name: p.distribution() for p in self.params if p.name in values}

    def trial_config(self, values: dict[str, Any]) -> RunConfig:
        """The run config of one trial: the fixed config with the searched values set."""
        cfg = copy.deepcopy(self.config)
        for name, value in values.items():
            set_field(cfg, name, value, "trial config")
        cfg.validate()
        return cfg
