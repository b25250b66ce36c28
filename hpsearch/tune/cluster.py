"""One trial's demand on the cluster: its placement bundles, how many trials fit at once, and waiting for nodes on
an autoscaling cluster (asking the autoscaler, reading its verdict, giving up in one line)."""
from __future__ import annotations

import json
import time

from hpsearch.errors import UserError
from hpsearch.tune.space import SearchSpace


def trial_resources(space: SearchSpace) -> dict[str, float]:
    """What one trial holds while it runs, summed over `trial_bundles`: its driver's CPU slice (and driver
    resource) plus its Train workers (the same sum for a trial that trains in its own actor)."""
    need: dict[str, float] = {}
    for bundle in trial_bundles(space):
        for k, v in bundle.items():
            need[k] = need.get(k, 0.0) + v
    return need


def in_process(space: SearchSpace) -> bool:
    """Whether a trial trains in its own Tune actor rather than launching Ray Train's worker group: one worker,
    `resources.worker_group=auto`, and no `driver_resource` (which keeps drivers apart from workers)."""
    r = space.resources
    return space.config.train.num_workers == 1 and r.worker_group == "auto" and not r.driver_resource


def pooled(space: SearchSpace) -> bool:
    """Whether a trial trains on ranks its Tune actor keeps from trial to trial (rankpool.py):
    `resources.worker_group=pool`, or `auto` when the trial does not train in its own actor (several workers, or a
    `driver_resource`)."""
    r = space.resources
    return r.worker_group == "pool" or (r.worker_group == "auto" and not in_process(space))


def uses_ray_train(space: SearchSpace) -> bool:
    """Whether a trial launches Ray Train's worker group (`resources.worker_group=always`): neither `in_process`
    nor `pooled`. Only then does a private local Ray need its dashboard (launch.init_ray)."""
    return not in_process(space) and not pooled(space)


def trial_bundles(space: SearchSpace) -> list[dict[str, float]]:
    """One trial's demand as placement bundles: its driver, then each Train worker; a trial that trains in its own
    actor (`in_process`) is one bundle, the two summed."""
    t, r = space.config.train, space.resources
    driver = {"CPU": r.trial_cpus, **({r.driver_resource: 1.0} if r.driver_resource else {})}
    worker = {"CPU": t.cpus_per_worker, **({"GPU": t.gpus_per_worker} if t.use_gpu else {})}
    if in_process(space):
        return [{**worker, "CPU": r.trial_cpus + t.cpus_per_worker}]
    return [driver] + [dict(worker) for _ in range(t.num_workers)]


def trial_placement(space: SearchSpace):
    """What the trial's Tune actor asks for: its first bundle (the driver's, or the whole of an in-process trial;
    Ray Train places its workers itself), and for a trial on kept ranks (`pooled`: `pool`, or `auto` with several
    workers or a driver resource) every bundle (its ranks start in bundles 1..N of the actor's placement group, kept
    with the actor from trial to trial)."""
    from ray.tune import PlacementGroupFactory
    bundles = trial_bundles(space)
    return PlacementGroupFactory(bundles if pooled(space) else bundles[:1])


def wait_for_nodes(space: SearchSpace, say) -> None:
    """On a cluster (RAY_ADDRESS): until the cluster's resources fit one trial, ask the autoscaler for it
    (`request_resources`) and wait, up to `budget.wait_for_nodes_s`; then a one-line error. A cluster that already
    fits returns at once; the request is withdrawn either way (the trials then make their own demand)."""
    import ray
    from ray.autoscaler.sdk import request_resources

    need = trial_resources(space)
    fits = lambda have: all(have.get(k, 0.0) + 1e-9 >= v for k, v in need.items())
    show = lambda d: ", ".join(f"{v:g} {k}" for k, v in sorted(d.items()) if k in need)
    have = ray.cluster_resources()
    if fits(have):
        return
    limit = space.budget.wait_for_nodes_s
    say(f"waiting for nodes: one trial needs {show(need)}, the cluster has {show(have) or 'none of it'} "
        f"(asked the autoscaler; giving up after {limit:g} s, budget.wait_for_nodes_s)")
    last = _autoscaler_status() or {}
    before = last.get("time", 0.0)  # rounds after this one have seen the request
    failed_before = (last.get("autoscaler_report") or {}).get("failed_nodes") or ()  # the autoscaler's history
    request_resources(bundles=trial_bundles(space))
    deadline, rounds, verdict = time.monotonic() + limit, {}, None
    try:
        while not fits(have) and time.monotonic() < deadline and verdict is None:
            time.sleep(2.0)
            have = ray.cluster_resources()
            verdict = autoscaler_adds_nothing(before, _autoscaler_status(), rounds, failed_before=failed_before)
    finally:
        request_resources(bundles=[])
    if fits(have):
        return
    if verdict:
        raise UserError(f"resources: one trial needs {show(need)} but the cluster has {show(have) or 'none of it'} "
                        f"and its autoscaler adds no node for it ({verdict}): lower resources.* or give the "
                        "cluster a node type that fits")
    raise UserError(f"resources: one trial needs {show(need)} but after {limit:g} s the cluster has "
                    f"{show(have) or 'none of it'}; no node type of the cluster fits it, or the autoscaler "
                    "could not add nodes: lower resources.* or raise budget.wait_for_nodes_s")


def _autoscaler_status() -> dict | None:
    """The autoscaler's last report (Ray's `__autoscaling_status` record, what `ray status` shows), if one runs."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        return json.loads(raw) if raw else None
    except Exception:  # no record, or not readable: no verdict, the wait decides
        return None


def autoscaler_adds_nothing(before: float, status: dict | None, rounds: dict, needed: int = 3,
                            failed_before=()) -> str | None:
    """The autoscaler's verdict on our request, from its reports (`rounds` collects them by time, across calls):
    once `needed` of its rounds after the one at `before` (the last before the request) launched no node, started
    none and saw no node fail that had not failed before the request (`failed_before`: Ray lists every node it ever
    lost in each report), it will add nothing for it (a fixed-size cluster, one at its size limit, or no node type
    that fits), said in a few words; else None (still deciding, launching, retrying, or no autoscaler report to
    read: then the wait decides)."""
    report = (status or {}).get("autoscaler_report")
    if report is not None and status.get("time", 0.0) > before:
        rounds[status["time"]] = report
    known = {tuple(node) for node in failed_before}
    if any(r.get("pending_launches") or r.get("pending_nodes") or
           {tuple(node) for node in r.get("failed_nodes") or ()} - known for r in rounds.values()):
        return None
    if len(rounds) < needed:
        return None
    return f"{len(rounds)} of its rounds since the request launched nothing"


def concurrency(space: SearchSpace, cluster: dict[str, float], grows: bool = False) -> tuple[int | None, int]:
    """(Tune's limit of trials at once, how many run at once now). `resources.max_concurrent` is both. Null: as many
    as the cluster's CPUs and GPUs fit now (at least 1), which is also the limit unless the cluster `grows` (one Ray
    was given, RAY_ADDRESS: it may autoscale). There, no limit: Tune keeps one trial pending beyond those that run
    (its rule for a searcher that is no grid; a grid's trials all wait), and that trial's demand is what the
    autoscaler adds nodes for; a limit set from the nodes up at the start kept a study on its first node however
    large its cluster could grow. On a machine of its own a study keeps the limit, so the searcher suggests each
    trial once the one before it has reported, not while it runs."""
    if space.resources.max_concurrent:
        return space.resources.max_concurrent, space.resources.max_concurrent
    fits = max(1, min(int(cluster.get(k, 0.0) / v + 1e-9) for k, v in trial_resources(space).items()))
    # only when Tune's placement group holds the whole trial (its own actor, or kept ranks): a trial that launches
    # Ray Train's worker group asks Tune for its driver's bundle alone, which places at once, so without a limit
    # every trial would start together
    whole = not uses_ray_train(space)
    return (None if grows and whole else fits), fits


def at_a_time(limit: int | None, now: int) -> str:
    """The console's words for `concurrency`'s answer."""
    return f"{now} at a time" if limit else f"{now} at a time (as many as the cluster fits: more as nodes join)"
