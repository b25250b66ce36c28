"""Autoscaling from a cluster YAML on this machine: `cluster/local-autoscale.yaml` with Ray's fake multi-node
provider (its worker nodes are real raylets here, started and removed by the real autoscaler). A study submitted as
a Ray job needs CPUs the head does not offer: the autoscaler starts worker nodes, the trials' ranks (kept by each
trial's actor, the default) run on them while the trials' drivers stay on the head (`resources.driver_resource`),
every trial gets its MLflow child, and idle nodes go away. In a PID namespace of its own where the machine allows
it, so `ray stop` stops only this cluster."""
import json
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from test_tune_cluster import free_ports, run_isolated

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_study_on_an_autoscaling_cluster_from_the_shipped_yaml(tmp_path):
    gcs, dashboard, agent = free_ports(3)
    config = yaml.safe_load((ROOT / "cluster" / "local-autoscale.yaml").read_text())
    config["provider"]["gcs_address"] = f"127.0.0.1:{gcs}"  # the shipped file says 6379: the test's own port
    (tmp_path / "autoscale.yaml").write_text(yaml.safe_dump(config))
    head = config["available_node_types"][config["head_node_type"]]["resources"]
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    out = tmp_path / "out"
    out.mkdir()
    api = f"http://127.0.0.1:{dashboard}"
    script = textwrap.dedent(f"""\
        set -u
        export PATH="{Path(sys.executable).parent}:$PATH"
        export RAY_AUTH_MODE=token
        cd {tmp_path}
        # the autoscaler's rounds every second, not every 5 s, as Ray's own fake-cluster helper sets them
        # (`ray.cluster_utils.AutoscalingCluster`): launches, idle removals and the study's verdicts come in rounds
        RAY_FAKE_CLUSTER=1 AUTOSCALER_UPDATE_INTERVAL_S=1 ray start --head --port={gcs} --num-cpus={int(head["CPU"])} \\
            --resources='{json.dumps({k: v for k, v in head.items() if k != "CPU"})}' \\
            --dashboard-host=127.0.0.1 --dashboard-port={dashboard} --dashboard-agent-listen-port={agent} \\
            --disable-usage-stats --temp-dir={ray_tmp} --autoscaling-config={tmp_path}/autoscale.yaml \\
            > {out}/start.log 2>&1
        echo "start=$?" >> {out}/codes
        for attempt in 1 2 3 4 5 6 7 8 9 10; do  # the head's job agent takes a while on a busy machine
            ray job submit --address={api} -- \\
                python -m hpsearch.tune --name auto --num-samples 2 --tracking-uri sqlite:///{out}/mlflow.db \\
                --storage-path {out}/runs budget.max_steps=20 budget.eval_every=10 budget.grace_period=10 \\
                data.synthetic_train_rows=100 data.synthetic_eval_rows=20 \\
                resources.driver_resource=hpsearch_driver resources.cpus_per_worker=1 > {out}/job.log 2>&1
            code=$?
            grep -q "No available agent" {out}/job.log || break
            sleep 5
        done
        echo "submit=$code" >> {out}/codes
        # a demand no node type can meet (a GPU): the study gives up in one line, starting nothing
        ray job submit --address={api} -- python -m hpsearch.tune --name never --num-samples 1 \
            --tracking-uri sqlite:///{out}/mlflow.db --storage-path {out}/runs resources.gpus_per_worker=1 \
            budget.wait_for_nodes_s=60 > {out}/never.log 2>&1
        echo "never=$?" >> {out}/codes
        python - <<'EOF' > {out}/state.json 2>> {out}/state.log
        import json, time
        from ray.util.state import list_actors, list_nodes
        api = "{api}"
        seen = {{"nodes": [[n.node_id, n.is_head_node] for n in list_nodes(address=api, detail=True, limit=1000)],
                "workers": [a.node_id for a in list_actors(address=api, detail=True, limit=10000,
                                                           filters=[("class_name", "=", "Rank")])],
                "drivers": [a.node_id for a in list_actors(address=api, detail=True, limit=10000,
                                                           filters=[("class_name", "=", "ImplicitFunc")])]}}
        # Ray Train's autoscaling coordinator keeps a finished run's resource request until it expires (180 s),
        # then the nodes are idle for idle_timeout_minutes and go
        deadline = time.time() + 420
        while time.time() < deadline:
            alive = [n.node_id for n in list_nodes(address=api, limit=1000)
                     if not n.is_head_node and n.state == "ALIVE"]
            if not alive:
                break
            time.sleep(3)
        seen["alive_workers_at_end"] = alive
        print(json.dumps(seen))
        EOF
        ray stop > {out}/stop.log 2>&1
        echo "stop=$?" >> {out}/codes
        """)
    codes, logs, done = run_isolated(script, tmp_path / "autoscale.sh", out, timeout=1500, tail=3000)
    assert codes["start"] == "0" and codes["submit"] == "0" and codes["stop"] == "0", (codes, logs, done.stderr[-2000:])
    assert "succeeded" in logs["job.log"], logs["job.log"]
    # the head alone does not fit a trial: the study said it waits for nodes, and the autoscaler brought them
    assert "[hpsearch.tune] waiting for nodes: one trial needs 2.1 CPU, 1 hpsearch_driver, the cluster has 1 CPU, " \
           "8 hpsearch_driver" in (out / "job.log").read_text(), logs["job.log"]
    never = (out / "never.log").read_text()
    assert codes["never"] != "0" and "error: resources: one trial needs" in never, never
    # its verdict ("its autoscaler adds no node for it"), or, while the autoscaler still reports the previous job's
    # nodes going away, the wait's end: either is one line, with nothing started
    assert not (out / "runs" / "never").exists() or not any((out / "runs" / "never").iterdir())

    state = json.loads((out / "state.json").read_text())
    head_ids = {node for node, is_head in state["nodes"] if is_head}
    worker_ids = {node for node, is_head in state["nodes"] if not is_head}
    # the autoscaler launched a worker node for each of the two trials, and they ran at once: Tune's pending trial
    # asked for the second node (the number of trials at once was set from the first node alone, and the cluster
    # never grew past it). On a slow machine a node can go idle (idle_timeout_minutes: 0.2) before its trial's ranks
    # reach it, and is removed and launched again (4 nodes for the 2 trials in one CI run)
    job = (out / "job.log").read_text()
    assert job.index("started (2/2)") < job.index(" complete: "), job  # the second started before the first ended
    assert len(worker_ids) >= 2, state
    assert len(set(state["workers"])) >= 2 and set(state["workers"]) <= worker_ids, state  # the ranks ran on them
    assert state["drivers"] and set(state["drivers"]) <= head_ids, state  # the trials' drivers on the head
    assert state["alive_workers_at_end"] == [], state  # idle nodes were removed

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    assert client.get_experiment_by_name("hpsearch/never") is None  # gave up before any MLflow run
    runs = client.search_runs([client.get_experiment_by_name("hpsearch/auto").experiment_id])
    parents = [r for r in runs if r.data.tags.get("hpsearch.role") == "study"]
    children = [r for r in runs if r.data.tags.get("hpsearch.role") == "trial"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
