"""The cluster files users start from (`cluster/`), checked without a cloud, a Kubernetes cluster or Ray running.

- Ray cluster-launcher files (every `cluster/*.yaml` with a `provider`): Ray's own schema (`ray-schema.json`), then
  what `ray up` does before it calls the cloud (`prepare_config`: the provider's defaults, then Ray's
  `validate_config`); a provider key Ray does not know is a typo. The commands in a file's header parse with the
  real CLI parser and the space file they name loads.
- `aws.yaml` and `gcp.yaml` (the paper's GPU search): an autoscaled GPU worker type from zero that fits a trial of
  `search_spaces/paper.yaml`, shared storage mounted into the containers and owned by the Ray user, the MLflow
  server and the dashboard on the head's loopback, the `hpsearch_driver` resource on the head.
- The KubeRay RayJob: the structure KubeRay requires (field names checked against the ray.io/v1 types, so a
  misspelt field fails), an entrypoint that parses with `hpsearch.tune`'s parser and names a space file that
  loads, autoscaled worker groups from zero, GPU limits, volumes, a ReadWriteMany claim on every pod, MLflow next to
  the driver.
- Every file: each `YOUR_...` placeholder is named in its header, the Ray version is the installed one, and no
  mode makes anything world-writable.
- Misspelt or missing fields make these checks fail (the `test_a_broken_*` cases), so a typo fails CI.
"""
import copy
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.providers import _get_default_config
from ray.autoscaler._private.util import fill_node_type_min_max_workers, prepare_config, validate_config

from hpsearch.errors import ConfigError, UserError
from hpsearch.tune.cli import parse_args
from hpsearch.tune.cluster import trial_resources
from hpsearch.tune.spacefile import load_space

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
RAY_SCHEMA = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
GPU_LAUNCHER_FILES = ("aws.yaml", "gcp.yaml")  # the paper's search on a cloud
RAYJOB_FILE = "kuberay-rayjob.yaml"
PLACEHOLDER = re.compile(r"\bYOUR_[A-Z0-9_]+\b")
# What Ray's autoscaler reads from a launcher file as it is when the provider ships no defaults file to fill it.
AUTOSCALER_READS = ("cluster_name", "max_workers", "idle_timeout_minutes", "provider", "auth", "available_node_types",
                    "head_node_type", "file_mounts", "cluster_synced_files", "worker_setup_commands",
                    "worker_start_ray_commands")

# Field names of KubeRay's ray.io/v1 types (apis/ray/v1/*_types.go), for the parts of a RayJob this repo writes.
RAYJOB_SPEC = {"activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
               "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy", "entrypoint", "runtimeEnvYAML",
               "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus", "entrypointNumGpus",
               "ttlSecondsAfterFinished", "shutdownAfterJobFinishes", "suspend", "schedule"}
RAYCLUSTER_SPEC = {"headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling", "autoscalerOptions",
                   "headServiceAnnotations", "suspend", "managedBy", "gcsFaultToleranceOptions", "authOptions",
                   "upgradeStrategy"}
HEAD_GROUP = {"serviceType", "headService", "enableIngress", "rayStartParams", "template", "resources", "labels"}
WORKER_GROUP = {"groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds", "numOfHosts",
                "rayStartParams", "template", "scaleStrategy", "suspend", "resources", "labels"}
AUTOSCALER_OPTIONS = {"resources", "image", "imagePullPolicy", "env", "envFrom", "volumeMounts", "securityContext",
                      "idleTimeoutSeconds", "upscalingMode", "version"}
# ... and of the Kubernetes core/v1 types inside them.
POD_TEMPLATE = {"metadata", "spec"}
POD_SPEC = {"activeDeadlineSeconds", "affinity", "automountServiceAccountToken", "containers", "dnsConfig",
            "dnsPolicy", "enableServiceLinks", "ephemeralContainers", "hostAliases", "hostIPC", "hostNetwork",
            "hostPID", "hostUsers", "hostname", "imagePullSecrets", "initContainers", "nodeName", "nodeSelector", "os",
            "overhead", "preemptionPolicy", "priority", "priorityClassName", "readinessGates", "resourceClaims",
            "resources", "restartPolicy", "runtimeClassName", "schedulerName", "schedulingGates", "securityContext",
            "serviceAccount", "serviceAccountName", "setHostnameAsFQDN", "shareProcessNamespace", "subdomain",
            "terminationGracePeriodSeconds", "tolerations", "topologySpreadConstraints", "volumes"}
CONTAINER = {"name", "image", "command", "args", "workingDir", "ports", "envFrom", "env", "resources", "resizePolicy",
             "restartPolicy", "volumeMounts", "volumeDevices", "livenessProbe", "readinessProbe", "startupProbe",
             "lifecycle", "terminationMessagePath", "terminationMessagePolicy", "imagePullPolicy", "securityContext",
             "stdin", "stdinOnce", "tty"}
RESOURCES = {"limits", "requests", "claims"}
GPU = "nvidia.com/gpu"


# ---- reading the files ----------------------------------------------------------------------------------------------
def documents(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def launcher_files() -> list[Path]:
    return [p for p in sorted(CLUSTER.glob("*.yaml")) if any(isinstance(d, dict) and "provider" in d
                                                             for d in documents(p))]


def manifests() -> list[dict]:
    return [d for p in sorted(CLUSTER.glob("*.yaml")) for d in documents(p) if isinstance(d, dict) and "kind" in d]


def split_header(path: Path) -> tuple[str, str]:
    """(the comment block the file starts with, without the comment marks; the rest of the file)."""
    lines = path.read_text().splitlines()
    n = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    return "\n".join(line[1:] for line in lines[:n]), "\n".join(lines[n:])


def header(path: Path) -> str:
    return split_header(path)[0]


def header_commands(path: Path) -> list[list[str]]:
    """Every `python -m hpsearch.tune ...` in the file's header (continuation lines joined), as argument lists."""
    text = re.sub(r"\\\n\s*", " ", header(path))
    commands = []
    for match in re.finditer(r"python -m hpsearch\.tune[^`\n]*", text):
        line = match.group(0).split("  #")[0]
        commands.append(shlex.split(line)[3:])
    return commands


def tune_args(argv: list[str], where: str):
    """`argv` through the real CLI parser; a --space must name a file of search_spaces/ that loads."""
    try:
        args = parse_args(argv)
    except UserError:  # the parser's one-line error (hpsearch.cli.Parser)
        raise AssertionError(f"{where}: `python -m hpsearch.tune {shlex.join(argv)}` does not parse") from None
    if args.space:
        space_path = ROOT / args.space
        assert not Path(args.space).is_absolute() and space_path.parent == ROOT / "search_spaces", \
            f"{where}: --space {args.space}: expected a file of search_spaces/ (relative to the checkout)"
        assert space_path.is_file(), f"{where}: --space {args.space} does not exist"
        try:
            args.loaded_space = load_space(space_path, args.overrides)
        except ConfigError as e:
            raise AssertionError(f"{where}: {e}") from None
    return args


def loopback_port(uri: str, where: str) -> int:
    match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/?", uri or "")
    assert match, f"{where}: --tracking-uri {uri!r}: expected the MLflow server on the head, http://127.0.0.1:PORT"
    return int(match.group(1))


def option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# ---- Ray cluster-launcher files -------------------------------------------------------------------------------------
def check_launcher(config: dict, where: str) -> dict:
    """What `ray up` checks before it calls the cloud; returns the config with Ray's defaults filled in."""
    try:
        jsonschema.validate(config, RAY_SCHEMA)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{where}: Ray's schema: {e.message} (at {e.json_path})") from None
    known = set(RAY_SCHEMA["properties"]["provider"]["properties"])
    if config["provider"].get("type") == "fake_multinode":  # keys its provider and autoscaler read; not in the schema
        known |= {"gcs_address", "head_node_id", "launch_multiple", "disable_launch_config_check", "use_node_id_as_ip"}
    unknown = set(config["provider"]) - known
    assert not unknown, f"{where}: provider keys Ray does not know: {sorted(unknown)} (known: {sorted(known)})"
    try:
        has_defaults = _get_default_config(config["provider"]) is not None
    except FileNotFoundError:  # the wheel lacks e.g. fake_multinode's example.yaml: the file must be complete
        has_defaults = False
    try:
        if has_defaults:
            prepared = prepare_config(copy.deepcopy(config))
        else:
            missing = [k for k in AUTOSCALER_READS if k not in config]
            assert not missing, f"{where}: no defaults for provider {config['provider']['type']}; missing {missing}"
            prepared = copy.deepcopy(config)
            fill_node_type_min_max_workers(prepared)
        validate_config(prepared)
    except (ValueError, RuntimeError, jsonschema.ValidationError) as e:
        raise AssertionError(f"{where}: Ray's validate_config: {getattr(e, 'message', e)}") from None
    types = prepared["available_node_types"]
    assert types[prepared["head_node_type"]]["max_workers"] == 0, f"{where}: the head type is not a worker type"
    workers = {name: t for name, t in types.items() if name != prepared["head_node_type"]}
    assert any(t["min_workers"] == 0 and t["max_workers"] >= 1 for t in workers.values()), \
        f"{where}: expected a worker type the autoscaler starts from zero (min_workers 0, max_workers >= 1)"
    for name, t in workers.items():
        assert t["min_workers"] <= t["max_workers"], f"{where}: {name}: min_workers > max_workers"
    return prepared


def check_gpu_launcher(config: dict, path: Path) -> None:
    """The paper's search on a cloud: GPU workers from zero that fit a trial, shared storage given to the Ray user,
    MLflow and the dashboard on the head's loopback, the study started as the header says."""
    where = path.name
    prepared = check_launcher(config, where)
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    gpu_types = {n: t for n, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert gpu_types, f"{where}: no worker type with GPUs"
    assert all(t["min_workers"] == 0 for t in gpu_types.values()), f"{where}: GPU workers must start from zero"
    assert head["resources"].get("hpsearch_driver", 0) >= 1, f"{where}: the head must offer hpsearch_driver"
    assert "GPU" not in head["resources"], f"{where}: no training on the head"

    mounts = [o.split()[1].split(":") for o in prepared["docker"].get("run_options", []) if o.startswith("-v ")]
    commands = prepared["initialization_commands"] + prepared["setup_commands"] + prepared["head_start_ray_commands"]
    start = " ".join(c for c in prepared["head_start_ray_commands"] if "ray start" in c)
    assert "--dashboard-host=127.0.0.1" in start, f"{where}: the dashboard must listen on the head's loopback only"
    mlflow = [shlex.split(c.split(">")[0]) for c in prepared["head_start_ray_commands"] if "mlflow server" in c]
    assert len(mlflow) == 1, f"{where}: expected one `mlflow server` among head_start_ray_commands"
    assert option(mlflow[0], "--host") == "127.0.0.1", f"{where}: MLflow must listen on the head's loopback only"

    runs = header_commands(path)
    new = [argv for argv in runs if "--resume" not in argv]
    assert new and any("--resume" in argv for argv in runs), f"{where}: the header must say how to start and resume"
    for argv in runs:
        args = tune_args(argv, f"{where} header")
        storage = args.storage_path
        shared = [dst for src, dst in mounts if under(storage, dst)]
        assert shared, f"{where}: --storage-path {storage} is on no volume mounted into the containers ({mounts})"
        src = next(s for s, d in mounts if d == shared[0])
        assert any("mount " in c and c.rstrip().endswith(" " + src) for c in commands), \
            f"{where}: nothing mounts shared storage at {src}"
        assert any(re.search(rf"chown .*{re.escape(shared[0])}\b.*chmod 0?700 {re.escape(shared[0])}\b", c)
                   for c in prepared["setup_commands"]), \
            f"{where}: {shared[0]} must be given to the Ray user (chown, then chmod 0700) in setup_commands"
        if argv in new:
            assert loopback_port(args.tracking_uri, where) == int(option(mlflow[0], "--port")), \
                f"{where}: --tracking-uri {args.tracking_uri} is not the MLflow server's port"
            backend = option(mlflow[0], "--backend-store-uri")
            assert under(backend.removeprefix("sqlite:///"), shared[0]), f"{where}: MLflow's store is not shared"
            need = trial_resources(args.loaded_space)
            t = args.loaded_space.config.train
            fits = [n for n, nt in gpu_types.items() if nt["resources"]["GPU"] >= t.gpus_per_worker
                    and nt["resources"].get("CPU", 0) >= t.cpus_per_worker]
            assert fits, f"{where}: no GPU worker type holds one Train worker of {args.space}"
            total = {k: sum(min(nt["max_workers"], prepared["max_workers"]) * nt["resources"].get(k, 0)
                            for nt in gpu_types.values()) + head["resources"].get(k, 0) for k in need}
            assert all(total[k] >= v for k, v in need.items()), \
                f"{where}: at full scale ({total}) the cluster does not fit one trial of {args.space} ({need})"


def test_every_cluster_file_is_checked_here():
    """A new file in cluster/ is a launcher file or Kubernetes manifests (both checked below), or a Dockerfile."""
    names = {p.name for p in CLUSTER.iterdir()}
    assert set(GPU_LAUNCHER_FILES) | {RAYJOB_FILE} <= names
    assert set(GPU_LAUNCHER_FILES) <= {p.name for p in launcher_files()}
    for path in sorted(CLUSTER.iterdir()):
        if path.suffix in (".yaml", ".yml"):
            docs = documents(path)
            assert docs and all(isinstance(d, dict) for d in docs), f"{path.name}: not YAML mappings"
            assert path in launcher_files() or all("apiVersion" in d and "kind" in d for d in docs), \
                f"{path.name}: neither a Ray cluster-launcher file nor Kubernetes manifests"
        else:
            assert path.name.startswith("Dockerfile"), f"{path.name}: a file these tests do not check"


@pytest.mark.parametrize("path", launcher_files(), ids=lambda p: p.name)
def test_launcher_file_passes_rays_own_validation(path):
    (config,) = documents(path)
    check_launcher(config, path.name)
    for argv in header_commands(path):  # the commands users copy from the header
        tune_args(argv, f"{path.name} header")


@pytest.mark.parametrize("name", GPU_LAUNCHER_FILES)
def test_gpu_launcher_file_runs_the_paper_search(name):
    path = CLUSTER / name
    (config,) = documents(path)
    check_gpu_launcher(config, path)


# ---- the KubeRay RayJob ---------------------------------------------------------------------------------------------
def check_fields(obj, allowed: set, where: str) -> dict:
    assert isinstance(obj, dict), f"{where}: expected a mapping, got {obj!r}"
    unknown = set(obj) - allowed
    assert not unknown, f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(allowed)}"
    return obj


def check_pod_template(template, where: str) -> dict:
    """A pod template: known fields, containers with a name and an image, every mounted volume defined."""
    check_fields(template, POD_TEMPLATE, f"{where}.template")
    spec = check_fields(template.get("spec"), POD_SPEC, f"{where}.template.spec")
    containers = spec.get("containers")
    assert isinstance(containers, list) and containers, f"{where}: template.spec.containers is empty or missing"
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for kind in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(kind, [])):
            at = f"{where}.template.spec.{kind}[{i}]"
            check_fields(c, CONTAINER, at)
            assert c.get("name") and c.get("image"), f"{at}: a container needs a name and an image"
            check_fields(c.get("resources", {}), RESOURCES, f"{at}.resources")
            for m in c.get("volumeMounts", []):
                assert m.get("name") in volumes, f"{at}: volumeMount {m.get('name')!r} names no volume of the pod"
                assert str(m.get("mountPath", "")).startswith("/"), f"{at}: volumeMount without an absolute mountPath"
    return spec


def ray_resources(param: str) -> dict:
    """rayStartParams.resources in KubeRay's format: a JSON object inside a quoted string."""
    text = param.strip()
    if text.startswith('"') and text.endswith('"'):
        text = text[1:-1].replace('\\"', '"')
    return json.loads(text)


def shared_claims(spec: dict, path: str) -> set:
    """The PersistentVolumeClaims mounted at `path` (or above it) in the pod's first (Ray) container."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = spec["containers"][0].get("volumeMounts", [])
    return {volumes[m["name"]]["persistentVolumeClaim"]["claimName"] for m in mounts
            if under(path, m["mountPath"]) and "persistentVolumeClaim" in volumes[m["name"]]}


def check_rayjob(job: dict, others: list[dict]) -> None:
    where = RAYJOB_FILE
    assert job.get("apiVersion") == "ray.io/v1", f"{where}: apiVersion must be ray.io/v1"
    assert job.get("kind") == "RayJob", f"{where}: kind must be RayJob"
    assert (job.get("metadata") or {}).get("name") or job["metadata"].get("generateName"), f"{where}: metadata.name"
    spec = check_fields(job.get("spec"), RAYJOB_SPEC, f"{where}: spec")
    assert spec.get("submissionMode", "K8sJobMode") in ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
    assert isinstance(spec.get("shutdownAfterJobFinishes", False), bool), f"{where}: shutdownAfterJobFinishes: a bool"
    assert isinstance(spec.get("ttlSecondsAfterFinished", 0), int) and spec.get("ttlSecondsAfterFinished", 0) >= 0

    # the entrypoint: hpsearch.tune with a space file that loads, MLflow on the head, state on the shared volume
    entry = shlex.split(spec.get("entrypoint") or "")
    assert entry[:3] == ["python", "-m", "hpsearch.tune"], f"{where}: entrypoint must run python -m hpsearch.tune"
    assert not {"&&", "||", ";", "|"} & set(entry), f"{where}: entrypoint: one command, no shell lists"
    args = tune_args(entry[3:], f"{where}: entrypoint")
    assert args.space, f"{where}: entrypoint: name the space file with --space"
    runtime_env = yaml.safe_load(spec.get("runtimeEnvYAML") or "{}") or {}
    workdir = runtime_env.get("working_dir")
    assert workdir, f"{where}: runtimeEnvYAML needs a working_dir (the relative --space resolves there)"
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert re.search(rf"^WORKDIR {re.escape(workdir)}$", dockerfile, re.M), \
        f"{where}: working_dir {workdir} is not the checkout of cluster/Dockerfile's image"
    port = loopback_port(args.tracking_uri, f"{where}: entrypoint")
    storage = args.storage_path
    assert storage.startswith("/"), f"{where}: entrypoint: --storage-path must be an absolute path on the volume"

    cluster = check_fields(spec.get("rayClusterSpec"), RAYCLUSTER_SPEC, f"{where}: spec.rayClusterSpec")
    assert cluster.get("enableInTreeAutoscaling") is True, f"{where}: enableInTreeAutoscaling must be true"
    assert str(cluster.get("rayVersion")) == ray.__version__, f"{where}: rayVersion is not Ray {ray.__version__}"
    options = check_fields(cluster.get("autoscalerOptions", {}), AUTOSCALER_OPTIONS, f"{where}: autoscalerOptions")
    assert options.get("upscalingMode", "Default") in ("Default", "Aggressive", "Conservative")
    assert (cluster.get("authOptions") or {}).get("mode") == "token", f"{where}: Ray's token authentication must be on"

    head = check_fields(cluster.get("headGroupSpec"), HEAD_GROUP, f"{where}: headGroupSpec")
    groups = [("headGroupSpec", head)]
    workers = cluster.get("workerGroupSpecs")
    assert isinstance(workers, list) and workers, f"{where}: workerGroupSpecs is empty or missing"
    names = set()
    for i, group in enumerate(workers):
        at = f"{where}: workerGroupSpecs[{i}]"
        check_fields(group, WORKER_GROUP, at)
        assert isinstance(group.get("groupName"), str) and group["groupName"] not in names, \
            f"{at}: groupName must be given, a name no other group has"
        names.add(group["groupName"])
        for key in ("minReplicas", "maxReplicas"):
            assert isinstance(group.get(key), int), f"{at}: {key} must be given, an integer"
        replicas = group.get("replicas", 0)
        assert group["minReplicas"] == 0, f"{at}: minReplicas must be 0 (the autoscaler starts workers from zero)"
        assert group["minReplicas"] <= replicas <= group["maxReplicas"], \
            f"{at}: expected minReplicas <= replicas <= maxReplicas, got {group['minReplicas']}, {replicas}, " \
            f"{group['maxReplicas']}"
        assert group["maxReplicas"] >= 1, f"{at}: maxReplicas must be >= 1"
        groups.append((f"workerGroupSpecs[{i}]", group))
    pods = {}
    for name, group in groups:
        params = group.get("rayStartParams")
        assert isinstance(params, dict), f"{where}: {name}: rayStartParams is missing (KubeRay requires it)"
        assert all(isinstance(v, str) for v in params.values()), f"{where}: {name}: rayStartParams values are strings"
        pods[name] = check_pod_template(group.get("template"), f"{where}: {name}")

    assert ray_resources(head["rayStartParams"].get("resources", '"{}"')).get("hpsearch_driver", 0) >= 1, \
        f"{where}: the head must offer the hpsearch_driver resource (rayStartParams.resources)"
    head_pod = pods["headGroupSpec"]
    mlflow = [c for c in head_pod["containers"] if c.get("command", [])[:2] == ["mlflow", "server"]]
    assert len(mlflow) == 1, f"{where}: expected one `mlflow server` container in the head pod"
    command = mlflow[0]["command"]
    assert option(command, "--host") == "127.0.0.1", f"{where}: MLflow must listen on the pod's loopback only"
    assert option(command, "--port") == str(port), f"{where}: --tracking-uri port {port} is not MLflow's --port"
    assert {m["mountPath"] for m in mlflow[0].get("volumeMounts", [])
            if under(option(command, "--backend-store-uri").removeprefix("sqlite:///"), m["mountPath"])}, \
        f"{where}: MLflow's store is not on the shared volume"

    # GPUs: on the GPU group(s), enough at full scale for one trial of the space
    need = trial_resources(args.loaded_space)
    t = args.loaded_space.config.train
    gpus = 0
    for name, group in groups[1:]:
        ray_container = pods[name]["containers"][0]
        limits = ray_container.get("resources", {}).get("limits", {})
        if "gpu" in group["groupName"].lower():
            assert int(limits.get(GPU, 0)) > 0, f"{where}: {name}: a GPU group needs a {GPU} limit"
        if GPU in limits:
            requested = ray_container["resources"].get("requests", {}).get(GPU, limits[GPU])
            assert str(requested) == str(limits[GPU]), f"{where}: {name}: {GPU} requests must equal limits"
            assert int(limits[GPU]) >= t.gpus_per_worker, f"{where}: {name}: a pod holds no Train worker"
            gpus += group["maxReplicas"] * int(limits[GPU])
    assert gpus >= need.get("GPU", 0), f"{where}: at full scale {gpus} GPUs, a trial of {args.space} needs {need}"
    assert "nvidia.com/gpu" not in head_pod["containers"][0].get("resources", {}).get("limits", {})

    # the shared volume: one ReadWriteMany claim holding --storage-path in the head and every worker group
    claims = {name: shared_claims(pod, storage) for name, pod in pods.items()}
    for name, found in claims.items():
        assert found, f"{where}: {name}: --storage-path {storage} is on no PersistentVolumeClaim of the Ray container"
    all_claims = set.union(*claims.values())
    assert len(all_claims) == 1, f"{where}: the pods mount different claims at {storage}: {claims}"
    (claim,) = all_claims
    pvcs = {d["metadata"]["name"]: d for d in others if d.get("kind") == "PersistentVolumeClaim"}
    assert claim in pvcs, f"{where}: claim {claim!r} is defined by no PersistentVolumeClaim in cluster/"
    assert "ReadWriteMany" in pvcs[claim]["spec"]["accessModes"], f"{where}: claim {claim!r} is not ReadWriteMany"
    init = " ".join(shlex.join(c.get("command", []) + c.get("args", [])) for c in head_pod.get("initContainers", []))
    root = next(m["mountPath"] for m in head_pod["containers"][0]["volumeMounts"] if under(storage, m["mountPath"]))
    assert re.search(rf"chown .*{re.escape(root)}\b.*chmod 0?700 {re.escape(root)}\b", init), \
        f"{where}: an init container of the head must give {root} to the Ray user (chown, then chmod 0700)"


def rayjob_and_others() -> tuple[dict, list[dict]]:
    (job,) = [d for d in documents(CLUSTER / RAYJOB_FILE) if d.get("kind") == "RayJob"]
    return job, manifests()


def test_rayjob_has_the_structure_kuberay_requires():
    job, others = rayjob_and_others()
    check_rayjob(job, others)


# ---- every file -----------------------------------------------------------------------------------------------------
def cluster_files() -> list[Path]:
    return sorted(p for p in CLUSTER.iterdir() if p.is_file())


@pytest.mark.parametrize("path", cluster_files(), ids=lambda p: p.name)
def test_every_placeholder_is_named_in_the_header(path):
    head, rest = split_header(path)
    missing = sorted(set(PLACEHOLDER.findall(rest)) - set(PLACEHOLDER.findall(head)))
    assert not missing, f"{path.name}: placeholders the header does not name: {missing}"


@pytest.mark.parametrize("path", cluster_files(), ids=lambda p: p.name)
def test_ray_version_is_the_installed_one(path):
    for version in re.findall(r"rayproject/ray:(\d+\.\d+\.\d+)", path.read_text()):
        assert version == ray.__version__, f"{path.name}: Ray image {version}, installed Ray {ray.__version__}"
    for version in re.findall(r"hpsearch:(\d+\.\d+\.\d+)", path.read_text()):
        assert version == ray.__version__, f"{path.name}: image tag hpsearch:{version} names another Ray version"


def world_writable(text: str) -> list[str]:
    """Modes in shell commands or Kubernetes fields that let every account write."""
    found = []
    for m in re.finditer(r"\bchmod\s+((?:-\S+\s+)*)(\S+)", text):
        mode = m.group(2).strip("'\"")
        if re.fullmatch(r"[0-7]{3,4}", mode):
            if int(mode, 8) & 0o002:
                found.append(m.group(0))
        elif re.search(r"(^|,)[ugo]*[ao][ugo]*[+=][rwxXst]*w|(^|,)[+=][rwxXst]*w", mode):
            found.append(m.group(0))
    for m in re.finditer(r"\bumask\s+([0-7]{1,4})\b", text):
        if not int(m.group(1), 8) & 0o002:
            found.append(m.group(0))
    for m in re.finditer(r"\b(?:defaultMode|mode)\s*:\s*(0?[0-7]{3,4}|\d+)\b", text):
        value = m.group(1)
        number = int(value, 8) if value.startswith("0") else int(value)
        if number & 0o002:
            found.append(m.group(0))
    found += re.findall(r"\b0?777\b", text)
    return found


@pytest.mark.parametrize("path", cluster_files(), ids=lambda p: p.name)
def test_nothing_is_made_world_writable(path):
    assert not world_writable(path.read_text()), f"{path.name}: world-writable: {world_writable(path.read_text())}"


@pytest.mark.parametrize("text, bad", [
    ("sudo chmod 777 /mnt/shared", True), ("chmod -R 0777 /x", True), ("chmod 1777 /x", True),
    ("chmod 0766 /x", True), ("chmod o+w /x", True), ("chmod -R a+rwX /x", True), ("chmod +w /x", True),
    ("umask 000", True), ("defaultMode: 0777", True), ("defaultMode: 511", True),
    ("chmod 0700 /mnt/shared", False), ("chmod 755 /x", False), ("chmod u+w /x", False), ("umask 022", False),
    ("defaultMode: 0400", False), ("chmod go-w /x", False),
])
def test_the_world_writable_check_itself(text, bad):
    assert bool(world_writable(text)) is bad


# ---- typos and omissions fail ---------------------------------------------------------------------------------------
def rename(mapping: dict, old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


LAUNCHER_BREAKAGES = {
    "max_workers misspelt": ("aws.yaml", lambda c: rename(c, "max_workers", "max_worker"), "max_worker"),
    "available_node_types misspelt": ("aws.yaml", lambda c: rename(c, "available_node_types", "available_node_type"),
                                      "available_node_type"),
    "node type's max_workers misspelt": ("gcp.yaml", lambda c: rename(c["available_node_types"]["gpu_8x"],
                                                                      "max_workers", "max_worker"), "max_worker"),
    "node type without resources": ("aws.yaml", lambda c: c["available_node_types"]["gpu_8x"].pop("resources"),
                                    "resources"),
    "GPU count a string": ("gcp.yaml", lambda c: c["available_node_types"]["gpu_8x"]["resources"].update(GPU="8"),
                           "GPU|'8'"),
    "head_node_type missing": ("aws.yaml", lambda c: c.pop("head_node_type"), "head_node_type"),
    "head_node_type misspelt": ("gcp.yaml", lambda c: c.update(head_node_type="haed"), "head_node_type"),
    "provider key misspelt": ("aws.yaml", lambda c: rename(c["provider"], "availability_zone", "availability_zon"),
                              "availability_zon"),
    "project_id misspelt": ("gcp.yaml", lambda c: rename(c["provider"], "project_id", "projectid"), "projectid"),
    "min_workers above max_workers": ("aws.yaml", lambda c: c["available_node_types"]["gpu_8x"].update(min_workers=9),
                                      "max_workers"),
    "GPU workers not from zero": ("gcp.yaml", lambda c: c["available_node_types"]["gpu_8x"].update(min_workers=1),
                                  "from zero"),
    "MLflow on all interfaces": ("aws.yaml", lambda c: c.update(head_start_ray_commands=[
        x.replace("--host 127.0.0.1", "--host 0.0.0.0") for x in c["head_start_ray_commands"]]), "loopback"),
    "storage not given to the Ray user": ("gcp.yaml", lambda c: c.update(setup_commands=c["setup_commands"][1:]),
                                          "Ray user"),
    "shared storage not mounted into Docker": ("aws.yaml", lambda c: c["docker"].update(run_options=[]),
                                               "no volume"),
}


@pytest.mark.parametrize("case", LAUNCHER_BREAKAGES)
def test_a_broken_launcher_file_fails(case):
    name, breaks, message = LAUNCHER_BREAKAGES[case]
    (config,) = documents(CLUSTER / name)
    breaks(config)
    with pytest.raises(AssertionError, match=message):
        check_gpu_launcher(config, CLUSTER / name)


def head_spec(job):
    return job["spec"]["rayClusterSpec"]["headGroupSpec"]


def gpu_group(job):
    return job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]


def set_entrypoint(job, old, new):
    job["spec"]["entrypoint"] = job["spec"]["entrypoint"].replace(old, new)


RAYJOB_BREAKAGES = {
    "apiVersion v1alpha1": (lambda j: j.update(apiVersion="ray.io/v1alpha1"), "apiVersion"),
    "kind RayCluster": (lambda j: j.update(kind="RayCluster"), "kind"),
    "spec field misspelt": (lambda j: rename(j["spec"], "shutdownAfterJobFinishes", "shutdownAfterJobFinished"),
                            "shutdownAfterJobFinished"),
    "enableInTreeAutoscaling misspelt": (lambda j: rename(j["spec"]["rayClusterSpec"], "enableInTreeAutoscaling",
                                                          "enableInTreeAutoScaling"), "enableInTreeAutoScaling"),
    "autoscaling off": (lambda j: j["spec"]["rayClusterSpec"].update(enableInTreeAutoscaling=False),
                        "enableInTreeAutoscaling"),
    "no rayClusterSpec": (lambda j: j["spec"].pop("rayClusterSpec"), "rayClusterSpec"),
    "no rayStartParams on the head": (lambda j: head_spec(j).pop("rayStartParams"), "rayStartParams"),
    "a rayStartParams number": (lambda j: head_spec(j)["rayStartParams"].update({"num-cpus": 8}), "strings"),
    "no hpsearch_driver on the head": (lambda j: head_spec(j)["rayStartParams"].pop("resources"), "hpsearch_driver"),
    "head without containers": (lambda j: head_spec(j)["template"]["spec"].pop("containers"), "containers"),
    "pod field misspelt": (lambda j: rename(gpu_group(j)["template"]["spec"], "tolerations", "toleration"),
                           "toleration"),
    "container field misspelt": (lambda j: rename(gpu_group(j)["template"]["spec"]["containers"][0], "volumeMounts",
                                                  "volumeMount"), "volumeMount"),
    "no groupName": (lambda j: gpu_group(j).pop("groupName"), "groupName"),
    "no minReplicas": (lambda j: gpu_group(j).pop("minReplicas"), "minReplicas"),
    "minReplicas 1": (lambda j: gpu_group(j).update(minReplicas=1), "minReplicas"),
    "replicas above maxReplicas": (lambda j: gpu_group(j).update(replicas=5), "replicas"),
    "no GPU limit": (lambda j: gpu_group(j)["template"]["spec"]["containers"][0]["resources"]["limits"].pop(GPU),
                     GPU),
    "volumeMount of no volume": (lambda j: gpu_group(j)["template"]["spec"]["containers"][0]["volumeMounts"][0]
                                 .update(name="shard"), "shard"),
    "pods on different claims": (lambda j: gpu_group(j)["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]
                                 .update(claimName="other"), "different claims"),
    "claim defined nowhere": (lambda j: [pod["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]
                                         .update(claimName="other") for pod in (head_spec(j), gpu_group(j))],
                              "no PersistentVolumeClaim in cluster/"),
    "entrypoint flag misspelt": (lambda j: set_entrypoint(j, "--space ", "--spaces "), "does not parse"),
    "entrypoint space file missing": (lambda j: set_entrypoint(j, "paper.yaml", "papr.yaml"), "papr.yaml"),
    "entrypoint override wrong": (lambda j: set_entrypoint(j, "--space", "budget.trails=3 --space"), "trails"),
    "entrypoint not hpsearch.tune": (lambda j: set_entrypoint(j, "hpsearch.tune", "hpsearch.train"), "hpsearch.tune"),
    "tracking server elsewhere": (lambda j: set_entrypoint(j, "127.0.0.1:5000", "127.0.0.1:5001"), "port"),
    "storage off the volume": (lambda j: set_entrypoint(j, "/mnt/shared/hpsearch", "/tmp/hpsearch"), "no Persistent"),
    "no working_dir": (lambda j: j["spec"].pop("runtimeEnvYAML"), "working_dir"),
    "no token authentication": (lambda j: j["spec"]["rayClusterSpec"].pop("authOptions"), "token"),
}


@pytest.mark.parametrize("case", RAYJOB_BREAKAGES)
def test_a_broken_rayjob_fails(case):
    breaks, message = RAYJOB_BREAKAGES[case]
    job, others = rayjob_and_others()
    breaks(job)
    with pytest.raises(AssertionError, match=message):
        check_rayjob(job, others)
