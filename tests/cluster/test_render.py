"""`rlscale cluster render`: manifests valid for the KubeRay CRDs and operator, the seed's values,
no secret values anywhere, clear errors for bad input; the blueprint fragment's Lustre settings."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from rlscale.cluster.render import FILES, JOB_LABEL, raycluster, rayjob, render, render_command, render_to_dir
from rlscale.cluster.spec import ClusterSpec, cluster_spec_from_dict, load_cluster_spec, parse_quantity
from rlscale.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
CRDS = Path(__file__).resolve().parent / "crds"
SENTINELS = {"HF_TOKEN": "hf_SENTINEL_d6f1c0ffee", "WANDB_API_KEY": "wandb-SENTINEL-8b1e5ca1ab"}
# the Ray auth token, as `rlscale job submit` and Ray's own client read it: never in a rendered file
TOKEN_SENTINELS = {"RAY_AUTH_TOKEN": "raytoken-SENTINEL-5e11c0de", "RAY_JOB_AUTH_TOKEN": "raytoken-SENTINEL-5e11c0de"}


def _strict(schema):
    """What `kubectl apply` (server-side strict field validation) does: unknown fields are errors."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (schema.get("type") == "object" and "properties" in schema
                and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(x) for x in schema]
    return schema


@pytest.fixture(scope="module")
def schemas():
    return {kind: _strict(json.loads((CRDS / f"{kind.lower()}-v1.schema.json").read_text()))
            for kind in ("RayCluster", "RayJob")}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("manifests")
    render_to_dir(ClusterSpec(), out)
    return out


def _load(out: Path, name: str):
    return yaml.safe_load((out / name).read_text())


def _validate(doc, schema):
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:5])


# ------------------------------------------------------------------ schema and operator rules


def check_operator_rules(kind: str, doc: dict) -> None:
    """KubeRay's checks outside the schema (ray-operator/controllers/ray/utils/validation.go)."""
    name = doc["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), "name must be a DNS-1035 label"
    assert len(name) <= (53 if kind == "RayCluster" else 47)
    spec = doc["spec"] if kind == "RayCluster" else doc["spec"]["rayClusterSpec"]
    head = spec["headGroupSpec"]
    groups = [head] + spec["workerGroupSpecs"]
    assert len({g["groupName"] for g in spec["workerGroupSpecs"]}) == len(spec["workerGroupSpecs"])
    for group in groups:
        containers = group["template"]["spec"]["containers"]
        assert containers and all(c.get("name") for c in containers), "every group needs a named container"
        params = group.get("rayStartParams", {})
        assert all(isinstance(v, str) for v in params.values()), "rayStartParams values are strings"
        assert "labels" not in params
        if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")):
            assert not group.get("resources"), "resources in both rayStartParams and resources"
        for container in containers:
            names = [p["name"] for p in container.get("ports", [])]
            assert len(names) == len(set(names))
            assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 15 for n in names)
            limits = container["resources"].get("limits", {})
            requests = container["resources"].get("requests", {})
            for key, limit in limits.items():
                if key in requests:
                    assert parse_quantity(requests[key]) <= parse_quantity(limit), key
                if "/" in key:  # extended resources (GPUs): requests must equal limits
                    assert requests.get(key, limit) == limit
    for worker in spec["workerGroupSpecs"]:
        assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]
        assert worker.get("numOfHosts", 1) >= 1
    head_ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {"gcs-server", "dashboard", "client"} <= set(head_ports)
    env = head["template"]["spec"]["containers"][0].get("env", [])
    assert not any(e["name"] in ("RAY_REDIS_ADDRESS", "REDIS_PASSWORD", "REDIS_USERNAME") for e in env)
    if kind == "RayJob":
        js = doc["spec"]
        assert js["entrypoint"] and isinstance(yaml.safe_load(js["runtimeEnvYAML"]), dict)
        assert js.get("ttlSecondsAfterFinished", 0) >= 0
        assert not (js.get("suspend") and not js.get("shutdownAfterJobFinishes"))


@pytest.mark.parametrize("kind,file", [("RayCluster", "cluster/raycluster.yaml"), ("RayJob", "job/rayjob.yaml")])
def test_manifests_satisfy_the_crd_schema_and_operator_rules(rendered, schemas, kind, file):
    doc = _load(rendered, file)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == kind
    _validate(doc, schemas[kind])
    check_operator_rules(kind, doc)


def test_the_schema_check_catches_mistakes(rendered, schemas):
    doc = _load(rendered, "cluster/raycluster.yaml")
    bad = copy.deepcopy(doc)
    bad["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 8  # not a string
    with pytest.raises(AssertionError):
        _validate(bad, schemas["RayCluster"])
    bad = copy.deepcopy(doc)
    bad["spec"]["headGroupSpec"]["rayStartParam"] = {}  # a typo'd field
    with pytest.raises(AssertionError):
        _validate(bad, schemas["RayCluster"])
    bad = copy.deepcopy(doc)
    bad["spec"]["workerGroupSpecs"][0]["replicas"] = 9
    with pytest.raises(AssertionError):
        check_operator_rules("RayCluster", bad)


def test_varied_specs_stay_valid(tmp_path, schemas):
    spec = cluster_spec_from_dict({"name": "small", "num_nodes": 2, "gpus_per_node": 1,
                                   "worker": {"shm_size": "16Gi", "cpu": 4, "memory": "32Gi"},
                                   "monitoring": {"enabled": False}, "job": {"pip": ["rlscale==0.1.0"]}})
    render_to_dir(spec, tmp_path)
    assert not (tmp_path / "cluster" / "podmonitoring.yaml").exists()
    assert not (tmp_path / "job" / "podmonitoring.yaml").exists()
    for kind, file in (("RayCluster", "cluster/raycluster.yaml"), ("RayJob", "job/rayjob.yaml")):
        doc = _load(tmp_path, file)
        _validate(doc, schemas[kind])
        check_operator_rules(kind, doc)
    job = _load(tmp_path, "job/rayjob.yaml")["spec"]
    assert yaml.safe_load(job["runtimeEnvYAML"])["pip"] == ["rlscale==0.1.0"]
    dshm = _load(tmp_path, "cluster/raycluster.yaml")["spec"]["workerGroupSpecs"][0]["template"]["spec"]["volumes"][1]
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}


# ------------------------------------------------------------------ the seed's values


def _tree(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def _without_job_label(cluster_spec: dict) -> dict:
    """A RayJob's rayClusterSpec less the label that tells its pods apart (its NetworkPolicy's selector)."""
    doc = copy.deepcopy(cluster_spec)
    for group in [doc["headGroupSpec"]] + doc["workerGroupSpecs"]:
        group["template"]["metadata"]["labels"].pop(JOB_LABEL)
    return doc


def test_defaults_reproduce_the_seed_cluster(rendered):
    assert _tree(rendered) == sorted([*FILES, ".rlscale-render"])
    rc = _load(rendered, "cluster/raycluster.yaml")
    assert rc["spec"]["rayVersion"] == "2.54.0"
    head = rc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"  # reachable through the service: the policy guards it
    (worker,) = rc["spec"]["workerGroupSpecs"]
    assert worker["groupName"] == "gpu-worker-group"
    assert worker["replicas"] == worker["minReplicas"] == worker["maxReplicas"] == 8
    hc = head["template"]["spec"]["containers"][0]
    wc = worker["template"]["spec"]["containers"][0]
    head_ports = {p["name"]: p["containerPort"] for p in hc["ports"]}
    assert head_ports.items() >= {"gcs-server": 6379, "dashboard": 8265, "client": 10001,
                                  "rlscale-metrics": 9464}.items()
    # rlscale's metrics are served by the driver, on the head: no always-down worker targets
    assert "rlscale-metrics" not in {p["name"] for p in wc["ports"]}
    assert hc["resources"] == {"limits": {"cpu": "32", "memory": "1000Gi"}, "requests": {"cpu": "8", "memory": "64Gi"}}
    per_node = {"cpu": "100", "memory": "1000Gi", "nvidia.com/gpu": "8"}
    assert wc["resources"] == {"limits": per_node, "requests": per_node}
    wpod = worker["template"]["spec"]
    assert wpod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-b200"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in wpod["tolerations"]
    for pod, container in ((head["template"]["spec"], hc), (wpod, wc)):
        assert container["image"] == "nvcr.io/nvidia/nemo-rl:v0.4.0"
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/lustre"]]["persistentVolumeClaim"] == {"claimName": "lustre-pvc"}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_HOME"] == "/lustre/huggingface_cache"
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth0"
        assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == 8080
        assert pod["terminationGracePeriodSeconds"] == 30  # the 15 s of preemption_grace_s, plus the commit


def test_the_grace_period_reaches_every_pod_and_covers_the_run_s_preemption_grace():
    from rlscale.config import CheckpointingConfig

    spec = ClusterSpec(termination_grace_period_s=120)
    rc = raycluster(spec)["spec"]
    pods = [rc["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in rc["workerGroupSpecs"]]
    assert [pod["terminationGracePeriodSeconds"] for pod in pods] == [120, 120]
    assert _without_job_label(rayjob(spec)["spec"]["rayClusterSpec"]) == rc
    assert ClusterSpec().termination_grace_period_s > CheckpointingConfig().preemption_grace_s


def test_rayjob_embeds_the_same_cluster_and_runs_rlscale(rendered):
    rc, rj = _load(rendered, "cluster/raycluster.yaml"), _load(rendered, "job/rayjob.yaml")
    assert _without_job_label(rj["spec"]["rayClusterSpec"]) == rc["spec"]
    assert rj["spec"]["entrypoint"].startswith(
        "rlscale train cluster.num_nodes=8 cluster.gpus_per_node=8 logger.prometheus_port=9464 ")
    assert "checkpointing.checkpoint_dir=/lustre/" in rj["spec"]["entrypoint"]
    runtime_env = yaml.safe_load(rj["spec"]["runtimeEnvYAML"])
    assert runtime_env["env_vars"]["HF_HOME"] == "/lustre/huggingface_cache"
    assert not set(runtime_env["env_vars"]) & set(SENTINELS)
    # a stopped job's driver gets its grace before Ray's SIGKILL; a failed run (a preempted node) runs
    # again and resumes
    assert runtime_env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == "30"
    assert rj["spec"]["backoffLimit"] == 3
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["lifecycle"]["preStop"]["exec"]["command"][-1] == "rlscale"
    # worker pods leave a stop request where the driver (on the head) looks for it: on the shared
    # volume, one directory per RayCluster (its name from the pod's own label)
    for group in rc["spec"]["workerGroupSpecs"]:
        worker = group["template"]["spec"]["containers"][0]
        assert worker["lifecycle"]["preStop"]["exec"]["command"][-3:] == ["RLSCALE_STOP_REQUESTS", "30",
                                                                         "ray::PolicyWorker"]
    for container in [head] + [g["template"]["spec"]["containers"][0] for g in rc["spec"]["workerGroupSpecs"]]:
        names = [e["name"] for e in container["env"]]
        assert names.index("RLSCALE_RAY_CLUSTER") < names.index("RLSCALE_STOP_REQUESTS")  # $(...) needs it first
        assert {"name": "RLSCALE_RAY_CLUSTER", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['ray.io/cluster']"}}} in container["env"]
        assert {"name": "RLSCALE_STOP_REQUESTS",
                "value": "/lustre/.rlscale/stop-requests/$(RLSCALE_RAY_CLUSTER)"} in container["env"]


def test_the_head_pre_stop_hook_signals_the_driver_and_waits_for_it_to_exit(tmp_path):
    """Kubernetes runs it before the SIGTERM to `ray start`, which would kill the driver unsignalled.
    A unique program name here, so that no other run on this machine is signalled."""
    import subprocess
    import sys
    import time
    import uuid

    from rlscale.cluster.render import HEAD_PRE_STOP

    name = f"rlscale-prestop-{uuid.uuid4().hex[:8]}"
    program = tmp_path / "bin" / name
    program.parent.mkdir()
    program.write_text("import signal, sys, time\n"
                       "def stop(*_):\n    time.sleep(1.0); open(sys.argv[2], 'w').write('saved'); sys.exit(143)\n"
                       "signal.signal(signal.SIGTERM, stop)\nprint('UP', flush=True)\ntime.sleep(60)\n")
    marker = tmp_path / "saved"
    driver = subprocess.Popen([sys.executable, str(program), "train", str(marker)], stdout=subprocess.PIPE, text=True)
    bystander = subprocess.Popen([sys.executable, str(program), "eval", str(tmp_path / "no")],
                                 stdout=subprocess.PIPE, text=True)  # not a `train`: left alone
    try:
        assert driver.stdout.readline() == "UP\n" and bystander.stdout.readline() == "UP\n"
        start = time.monotonic()
        subprocess.run([sys.executable, "-c", HEAD_PRE_STOP, name], check=True, timeout=60)
        assert time.monotonic() - start >= 0.9  # it waited for the driver's save
        assert marker.read_text() == "saved" and driver.wait(timeout=10) == 143
        assert bystander.poll() is None
    finally:
        for process in (driver, bystander):
            process.kill()
            process.wait()


def test_the_worker_pre_stop_hook_leaves_a_request_and_waits_for_the_driver(tmp_path):
    """It writes its request whole (named by the pod's hostname, saying until when it waits),
    returns once the driver removed it, and takes it back when its wait runs out."""
    import socket
    import subprocess
    import sys
    import time

    from rlscale.cluster.render import WORKER_PRE_STOP

    directory = tmp_path / "stop-requests" / "cluster"
    request = directory / socket.gethostname()
    env = {**os.environ, "RLSCALE_STOP_REQUESTS": str(directory)}
    own_title = open(f"/proc/{os.getpid()}/cmdline", "rb").read().split(b"\0")[0].decode()
    hook = subprocess.Popen([sys.executable, "-c", WORKER_PRE_STOP, "RLSCALE_STOP_REQUESTS", "60", own_title],
                            env=env)
    try:
        deadline = time.monotonic() + 30
        while not request.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = request.read_text().splitlines()
        assert lines[0].startswith("stop requested at ")
        assert 50 < float(lines[1].removeprefix("waits until ")) - time.time() <= 60  # its grace: 60 s
        assert [p.name for p in directory.iterdir()] == [request.name]  # no temporary file left
        time.sleep(1.0)
        assert hook.poll() is None, "it waits for the driver"
        request.unlink()  # the driver's acknowledgement
        assert hook.wait(timeout=10) == 0
    finally:
        hook.kill()
        hook.wait()
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", WORKER_PRE_STOP, "RLSCALE_STOP_REQUESTS", "1", ""], check=True, timeout=30,
                   env=env)
    # no driver: it waited its 1 s, then took its request back (no stale request for a later job)
    assert time.monotonic() - start >= 0.9 and not request.exists()
    # no policy worker in the pod (no job, or the cluster torn down): no request, no wait
    subprocess.run([sys.executable, "-c", WORKER_PRE_STOP, "RLSCALE_STOP_REQUESTS", "60",
                    "ray::NoSuchWorker-" + str(os.getpid())], check=True, timeout=20, env=env)
    assert not request.exists()


def test_the_worker_hook_looks_for_the_policy_workers_process_title():
    from rlscale.cluster.render import WORKER_PROCESS_TITLE
    from rlscale.workers.policy import PolicyWorker

    assert WORKER_PROCESS_TITLE == "ray::" + PolicyWorker.__name__  # Ray's title for its actor processes


@pytest.mark.parametrize("job", [False, True])
def test_podmonitoring_selects_the_ray_pods_and_scrapes_the_metrics_port(rendered, job):
    folder = "job" if job else "cluster"
    pm = _load(rendered, f"{folder}/podmonitoring.yaml")
    assert pm["apiVersion"] == "monitoring.googleapis.com/v1" and pm["kind"] == "PodMonitoring"
    doc = _load(rendered, "job/rayjob.yaml" if job else "cluster/raycluster.yaml")
    rc = doc["spec"]["rayClusterSpec"] if job else doc["spec"]
    for group in [rc["headGroupSpec"]] + rc["workerGroupSpecs"]:
        labels = _pod_labels(group, doc)
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["name"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert {e["port"] for e in pm["spec"]["endpoints"]} & ports  # each pod has a port it scrapes
    head_ports = {p["name"] for p in rc["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {e["port"] for e in pm["spec"]["endpoints"]} <= head_ports
    assert {"port": "rlscale-metrics", "path": "/metrics", "interval": "30s"} in pm["spec"]["endpoints"]
    other = _load(rendered, f"{'cluster' if job else 'job'}/podmonitoring.yaml")
    assert other["metadata"]["name"] != pm["metadata"]["name"]  # deleting one directory leaves the other's


def _pod_labels(group: dict, doc: dict) -> dict:
    """The labels a Ray pod ends up with: its template's, plus those KubeRay sets (ray.io/cluster is
    the RayCluster's name; a RayJob's cluster gets a generated one, `<rayjob>-xxxxx`)."""
    cluster = doc["metadata"]["name"] + ("-ab1cd" if doc["kind"] == "RayJob" else "")
    return {**group["template"]["metadata"]["labels"], "ray.io/cluster": cluster,
            "app.kubernetes.io/created-by": "kuberay-operator"}


def test_output_is_deterministic_and_the_example_config_is_the_default():
    assert render(ClusterSpec()) == render(ClusterSpec())
    assert load_cluster_spec(ROOT / "examples" / "cluster.yaml") == ClusterSpec()


# ------------------------------------------------------------------ secrets


def test_no_secret_value_in_any_rendered_file(tmp_path, monkeypatch, capsys):
    for key, value in {**SENTINELS, **TOKEN_SENTINELS}.items():
        monkeypatch.setenv(key, value)
    render_command(ROOT / "examples" / "cluster.yaml", tmp_path)
    printed = capsys.readouterr()
    texts = {str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    assert "NOTES.md" in texts and "cluster/raycluster.yaml" in texts
    for value in {**SENTINELS, **TOKEN_SENTINELS}.values():
        assert value not in printed.out + printed.err
        for name, text in texts.items():
            assert value not in text, f"a secret value leaked into {name}"
    for name in ("cluster/raycluster.yaml", "job/rayjob.yaml"):
        refs = re.findall(r"secretKeyRef:\n\s+name: rlscale-secrets\n\s+key: (\w+)", texts[name])
        assert set(refs) == set(SENTINELS)
        tokens = re.findall(r"secretKeyRef:\n\s+name: rlscale-ray-token\n\s+key: (\w+)", texts[name])
        assert tokens == ["auth_token"] * 2  # head and worker: a reference, never the token
    assert '--from-literal=HF_TOKEN="$HF_TOKEN"' in texts["NOTES.md"]
    assert "kubectl create secret generic rlscale-secrets" in texts["NOTES.md"]
    # the token goes from openssl into the Secret through a pipe, and back into the shell only
    assert "openssl rand -base64 32 | tr -d '\\n' | kubectl create secret generic rlscale-ray-token" in texts["NOTES.md"]
    assert "--from-file=auth_token=/dev/stdin" in texts["NOTES.md"]
    assert "export RAY_JOB_AUTH_TOKEN=\"$(kubectl -n default get secret rlscale-ray-token" in texts["NOTES.md"]


def test_a_secret_cannot_be_put_in_plain_env():
    with pytest.raises(UserError, match="HF_TOKEN"):
        cluster_spec_from_dict({"env": {"HF_TOKEN": "x"}})
    with pytest.raises(UserError, match="MY_API_KEY"):
        cluster_spec_from_dict({"env": {"MY_API_KEY": "x"}})


@pytest.mark.parametrize("tree,key", [
    ({"env": {"MY_VAR": "hf_abcdefghijklmnopqrstuvwxyz123"}}, "'env'"),
    ({"job": {"overrides": ["policy.model_name=hf_abcdefghijklmnopqrstuvwxyz123"]}}, "'job.overrides' (entry 1)"),
    ({"job": {"pip": ["rlscale", "https://user:hunter2secret@pypi.example/rlscale.whl"]}}, "'job.pip' (entry 2)"),
])
def test_secret_values_are_refused_before_they_reach_a_manifest(tree, key, tmp_path):
    # every value of the cluster file is written into the manifests in plain text
    with pytest.raises(UserError) as refused:
        cluster_spec_from_dict(tree)
    message = str(refused.value)
    assert key in message and "Kubernetes Secret" in message and "hunter2" not in message
    assert "\n" not in message


def test_a_value_equal_to_a_local_secret_is_refused(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-value-123")
    with pytest.raises(UserError, match="'env'.*WANDB_API_KEY"):
        cluster_spec_from_dict({"env": {"LOGGING_TARGET": "wandb-secret-value-123"}})


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("tree,key", [
    ({"num_nodes": 0}, "num_nodes"),
    ({"gpus_per_node": 0}, "gpus_per_node"),
    ({"gpus_per_node": True}, "gpus_per_node"),
    ({"name": "Bad_Name"}, "name"),
    ({"name": "9starts-with-digit"}, "name"),
    ({"name": "x" * 54}, "name"),
    ({"namespace": "-ns"}, "namespace"),
    ({"job": {"name": "j" * 48}}, "job.name"),
    ({"worker": {"memory": "1000GB"}}, "worker.memory"),
    ({"worker": {"cpu": "lots"}}, "worker.cpu"),
    ({"head": {"memory_request": "2000Gi"}}, "head"),
    ({"head": {"cpu_limit": "0"}}, "head.cpu_limit"),
    ({"storage": {"mount_path": "relative"}}, "storage.mount_path"),
    ({"storage": {"pvc": "Lustre PVC"}}, "storage.pvc"),
    ({"ports": {"metrics": 8265}}, "ports"),
    ({"ports": {"gcs": 70000}}, "ports.gcs"),
    ({"node_selector": {"bad key!": "x"}}, "node_selector"),
    ({"tolerations": [{"key": "k", "effect": "Sometimes"}]}, "tolerations.0.effect"),
    ({"secret": {"name": "UPPER"}}, "secret.name"),
    ({"env": {"1BAD": "x"}}, "env"),
    ({"ray_version": "latest"}, "ray_version"),
    ({"job": {"overrides": ["grpo.max_num_steps=-3"]}}, "job.overrides"),
    ({"job": {"overrides": ["cluster.num_nodes=4"]}}, "job.overrides"),
    ({"monitoring": {"interval": "often"}}, "monitoring.interval"),
    ({"job": {"overrides": ["logger.prometheus_port=9000"]}}, "job.overrides"),
    ({"termination_grace_period_s": 15}, "termination_grace_period_s"),  # no more than preemption_grace_s
    ({"storage": {"mount_path": "/mnt/lustre"}}, "job.overrides"),  # the checkpoints would leave the volume
    ({"job": {"overrides": ["checkpointing.checkpoint_dir=/tmp/ck"]}}, "job.overrides"),
    ({"job": {"overrides": ["logger.log_dir=runs/x"]}}, "job.overrides"),  # checkpoints under a relative dir
    ({"job": {"overrides": ["checkpointing.checkpoint_dir=/lustre/../tmp/ck"]}}, "job.overrides"),
    ({"env": {"HF_HOME": "/root/.cache/huggingface"}}, "env"),
    ({"termination_grace_period_s": 60, "job": {"overrides": ["checkpointing.preemption_grace_s=90"]}},
     "termination_grace_period_s"),
    ({"gpu_per_node": 8}, "gpu_per_node"),
    ({"secret": {"optional_keys": ["HF_HOME"]}}, "env"),
])
def test_bad_input_is_a_one_line_user_error_naming_the_key(tree, key):
    with pytest.raises(UserError) as info:
        cluster_spec_from_dict(tree)
    message = str(info.value)
    assert f"'{key}" in message and "\n" not in message, message


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="cannot read"):
        load_cluster_spec(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_cluster_spec(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(UserError, match="mapping"):
        load_cluster_spec(tmp_path / "list.yaml")
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot write"):
        render_to_dir(ClusterSpec(), tmp_path / "file" / "out")


def test_a_render_replaces_the_last_one_whole(tmp_path, monkeypatch):
    out = tmp_path / "manifests"
    (out).mkdir()
    (out / "my-notes.txt").write_text("mine")
    render_to_dir(ClusterSpec(), out)
    assert (out / "cluster" / "podmonitoring.yaml").exists()
    before = {name: (out / name).read_text() for name in FILES}
    # a full disk mid-render: the previous render stays whole, no temporary file is left
    real_write, writes = Path.write_text, []

    def write_then_fail(self, *args, **kwargs):
        if writes:
            raise OSError(28, "No space left on device")
        writes.append(self)
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_then_fail)
    with pytest.raises(UserError, match="cannot write to .*: No space left on device"):
        render_to_dir(ClusterSpec(name="other"), out)
    monkeypatch.undo()
    assert {name: (out / name).read_text() for name in FILES} == before
    assert _tree(out) == sorted([*FILES, "my-notes.txt", ".rlscale-render"])
    # monitoring off: the old podmonitoring.yaml goes, so `kubectl apply -f DIR/cluster/` applies this render only
    spec = ClusterSpec.model_validate({"monitoring": {"enabled": False}})
    render_to_dir(spec, out)
    assert not (out / "cluster" / "podmonitoring.yaml").exists() and (out / "my-notes.txt").read_text() == "mine"
    # a podmonitoring.yaml the user wrote (no render wrote one since) is theirs: left alone
    (out / "cluster" / "podmonitoring.yaml").write_text("# mine\n")
    render_to_dir(spec, out)
    assert (out / "cluster" / "podmonitoring.yaml").read_text() == "# mine\n"


def test_a_render_removes_the_top_level_manifests_of_an_older_layout(tmp_path):
    """Renders before the cluster/ and job/ layout wrote raycluster.yaml, rayjob.yaml and the
    secret-reference.yaml (no manifest) at the top: `kubectl apply -f DIR/` applied both clusters and failed."""
    old = ("raycluster.yaml", "rayjob.yaml", "secret-reference.yaml", "podmonitoring.yaml")
    for name in old:
        (tmp_path / name).write_text("kind: Old\n")
    (tmp_path / ".rlscale-render").write_text("".join(f"{n}\n" for n in old) + "NOTES.md\n")
    (tmp_path / "mine.yaml").write_text("kind: Mine\n")  # never written by a render: kept
    render_to_dir(ClusterSpec(), tmp_path)
    assert not any((tmp_path / name).exists() for name in old)
    top = {p.name for p in tmp_path.iterdir() if p.is_file()}
    assert top == {"NOTES.md", ".rlscale-render", "mine.yaml"}


def test_render_app_cli(tmp_path):
    from typer.testing import CliRunner

    from rlscale.cluster.render import render_app

    result = CliRunner().invoke(render_app, ["render", "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m" / "cluster" / "raycluster.yaml").exists()
    result = CliRunner().invoke(render_app, ["render", "--out", str(tmp_path / "i"), "--insecure"])
    assert result.exit_code == 0, result.output
    assert "warning: insecure" in result.output
    assert "authOptions" not in (tmp_path / "i" / "cluster" / "raycluster.yaml").read_text()


# ------------------------------------------------------------------ the blueprint fragment


def test_blueprint_fragment_sets_the_legacy_lustre_port_with_a_gke_support_enabled_instance():
    folder = ROOT / "examples" / "blueprint"
    bp = yaml.safe_load((folder / "rlscale-lustre-ray.yaml").read_text())
    modules = {m["id"]: m for g in bp["deployment_groups"] for m in g["modules"]}
    lustre = modules["managed-lustre"]
    assert lustre["source"] == "modules/file-system/managed-lustre"
    assert lustre["settings"]["local_mount"] == "/lustre"
    gke_support = bp["vars"]["lustre_gke_support_enabled"]
    assert lustre["settings"]["gke_support_enabled"] == "$(vars.lustre_gke_support_enabled)"
    # a GKE-compatible instance listens on 6988: the cluster needs the legacy port, the firewall 6988
    assert gke_support is True and bp["vars"]["enable_legacy_lustre_port"] is True
    assert "--enable-legacy-lustre-port" in bp["gke_cluster_settings"]["post_deploy_command"]
    (rule,) = modules["lustre_firewall_rule"]["settings"]["ingress_rules"]
    assert rule["allow"][0]["ports"] == [str(bp["vars"]["lustre_lnet_port"])] == ["6988"]
    assert bp["gke_cluster_settings"]["enable_ray_operator"] is True
    assert bp["gke_cluster_settings"]["enable_managed_lustre_csi"] is True
    assert "lustre-pv" in modules
    pv, pvc = yaml.safe_load_all((folder / "lustre-pv-pvc.yaml").read_text())
    assert pvc["metadata"]["name"] == ClusterSpec().storage.pvc == pv["spec"]["claimRef"]["name"]
    assert pv["spec"]["csi"]["driver"] == "lustre.csi.storage.gke.io"
    readme = (folder / "README.md").read_text()
    assert "enableLegacyLustrePort" in readme and "https://" in readme


def test_settings_and_known_switches_are_not_taken_for_secrets():
    # `token` in a config key, or a variable that points at a key file, holds no secret
    spec = cluster_spec_from_dict({"job": {"overrides": ["loss.token_level_loss=false",
                                                        "checkpointing.checkpoint_dir=/lustre/run"]},
                                   "env": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
                                           "GOOGLE_APPLICATION_CREDENTIALS": "/var/secrets/key.json"}})
    assert "loss.token_level_loss=false" in spec.job.overrides
    with pytest.raises(UserError, match="MY_TOKEN"):
        cluster_spec_from_dict({"env": {"MY_TOKEN": "x"}})


def test_object_names_may_have_dots_as_kubernetes_allows():
    spec = cluster_spec_from_dict({"storage": {"pvc": "lustre.shared-pvc"}, "secret": {"name": "team.rl-secrets"}})
    assert spec.storage.pvc == "lustre.shared-pvc" and spec.secret.name == "team.rl-secrets"
    for bad in ("Upper.case", "trailing.", ".leading", "a..b"):
        with pytest.raises(UserError, match="storage.pvc"):
            cluster_spec_from_dict({"storage": {"pvc": bad}})
