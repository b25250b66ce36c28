"""The README's cluster commands: `ray start --head`, `ray job submit ... python -m hpsearch.tune` (its one trial
loses a worker once and is retried), `mlflow ui`, `ray stop` (the cluster files: tests/test_cluster_files.py).

`ray stop` stops every Ray process it can see, so where Linux allows it the commands run in a PID namespace of
their own (`unshare --pid`): other Ray instances on the machine stay untouched."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from mlflow import MlflowClient

ROOT = Path(__file__).resolve().parents[1]


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def isolated() -> list[str]:
    """`unshare --pid --fork --mount-proc` where this machine allows it (root or user namespaces), else nothing."""
    cmd = ["unshare", "--pid", "--fork", "--mount-proc"]
    if shutil.which("unshare") and subprocess.run([*cmd, "true"], capture_output=True).returncode == 0:
        return cmd
    return []


def run_isolated(script: str, path: Path, out: Path, timeout: float, tail: int = 2000):
    """Run a bash script (written to `path`) in its own PID namespace where possible, without the caller's RAY_*
    variables; returns (the `name=code` lines it appended to `out/codes`, the tails of `out/*.log`, the process)."""
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run([*isolated(), "bash", str(path)], env=env, capture_output=True, text=True, timeout=timeout)
    logs = {p.name: p.read_text()[-tail:] for p in out.glob("*.log")}
    codes = dict(line.split("=") for line in (out / "codes").read_text().split())
    return codes, logs, done


@pytest.mark.slow
def test_readme_cluster_commands_run_a_study_as_a_ray_job(tmp_path):
    gcs, dashboard, ui, agent = free_ports(4)
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    out = tmp_path / "out"
    out.mkdir()
    script = textwrap.dedent(f"""\
        set -u
        export PATH="{Path(sys.executable).parent}:$PATH"
        export RAY_AUTH_MODE=token
        cd {ROOT}
        # the autoscaler's rounds every second, not every 5 s: the `never` study's verdict takes 3 of them; the
        # head's agent on a free port (Ray's default one, taken, leaves the head without a job agent)
        AUTOSCALER_UPDATE_INTERVAL_S=1 ray start --head --port={gcs} --dashboard-host=127.0.0.1 \\
            --dashboard-port={dashboard} --dashboard-agent-listen-port={agent} --num-cpus=2 --disable-usage-stats \\
            --temp-dir={ray_tmp} > {out}/start.log 2>&1
        echo "start=$?" >> {out}/codes
        for attempt in 1 2 3 4 5 6; do  # a busy machine may not have the head's job agent up yet
            ray job submit --address=http://127.0.0.1:{dashboard} --working-dir . \\
                --runtime-env-json "{{\\"env_vars\\": {{\\"HPSEARCH_GIT_COMMIT\\": \\"$(git rev-parse HEAD)\\"}}}}" \\
                -- \\
                python -m hpsearch.tune --name job --num-samples 1 --tracking-uri sqlite:///{out}/mlflow.db \\
                --storage-path {out}/runs budget.max_steps=20 budget.eval_every=10 budget.grace_period=10 \\
                train.debug_crash_at_step=15 data.synthetic_train_rows=100 data.synthetic_eval_rows=20 \\
                > {out}/job.log 2>&1
            code=$?
            grep -q "No available agent" {out}/job.log || break
            sleep 5
        done
        echo "submit=$code" >> {out}/codes
        # the UI starts while the next job runs (it reads the store the first job wrote)
        setsid mlflow ui --backend-store-uri sqlite:///{out}/mlflow.db --host 127.0.0.1 --port {ui} \\
            > {out}/ui.log 2>&1 &
        ui_pid=$!
        # more than this fixed-size cluster has: its autoscaler (Ray's read-only one) adds nothing, and the study
        # says so in one line after a few of its rounds, long before budget.wait_for_nodes_s
        ray job submit --address=http://127.0.0.1:{dashboard} -- python -m hpsearch.tune --name never \
            --num-samples 1 --tracking-uri sqlite:///{out}/mlflow.db --storage-path {out}/runs resources.workers=8 \
            budget.wait_for_nodes_s=600 > {out}/never.log 2>&1
        echo "never=$?" >> {out}/codes
        python - <<'EOF' > {out}/ui.json 2>> {out}/ui.log
        import json, time, urllib.request
        url = "http://127.0.0.1:{ui}/api/2.0/mlflow/experiments/get-by-name?experiment_name=hpsearch%2Fjob"
        for _ in range(240):  # a loaded box starts the UI slowly
            try:
                print(urllib.request.urlopen(url, timeout=5).read().decode()); break
            except OSError:
                time.sleep(1)
        EOF
        kill -- -$ui_pid
        ray stop > {out}/stop.log 2>&1
        echo "stop=$?" >> {out}/codes
        """)
    codes, logs, done = run_isolated(script, tmp_path / "readme.sh", out, timeout=900)
    assert {k: codes[k] for k in ("start", "submit", "stop")} == {"start": "0", "submit": "0", "stop": "0"}, \
        (codes, logs, done.stderr[-2000:])
    assert "succeeded" in logs["job.log"], logs["job.log"]
    never = (out / "never.log").read_text()
    assert codes["never"] != "0", never
    assert re.search(r"error: resources: one trial needs 7\.3 CPU but the cluster has 2 CPU and its autoscaler "
                     r"adds no node for it \(\d+ of its rounds since the request launched nothing\)", never), never
    assert "Traceback" not in never and not (out / "runs" / "never").exists()
    assert json.loads((out / "ui.json").read_text())["experiment"]["name"] == "hpsearch/job", logs["ui.log"]

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("hpsearch/job").experiment_id])
    parents = [r for r in runs if r.data.tags.get("hpsearch.role") == "study"]
    children = [r for r in runs if r.data.tags.get("hpsearch.role") == "trial"]
    assert len(parents) == 1 and len(children) == 1 and parents[0].info.status == "FINISHED"
    assert children[0].data.tags["mlflow.parentRunId"] == parents[0].info.run_id
    assert children[0].data.tags["hpsearch.outcome"] == "complete"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert parents[0].data.tags["mlflow.source.git.commit"] == commit  # recorded although Ray leaves out .git
    assert "score" in children[0].data.metrics and "test_score" in children[0].data.metrics
    # rank 0 died at step 15 (fault injection): Tune retried the trial, which went on from its step-10 checkpoint,
    # in the same MLflow run, each evaluation logged once
    assert children[0].data.tags["hpsearch.retries"] == "1"
    assert [m.step for m in client.get_metric_history(children[0].info.run_id, "score")] == [10, 20]
    shutil.rmtree(ray_tmp, ignore_errors=True)
