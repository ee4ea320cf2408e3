"""Render a `ClusterSpec` into Kubernetes manifests (`rlscale cluster render --config C --out DIR`).

Writes raycluster.yaml (RayCluster, ray.io/v1), rayjob.yaml (the same cluster inside a RayJob whose
entrypoint is `rlscale train ...`), secret-reference.yaml (which Secret keys the pods read),
podmonitoring.yaml (Google Managed Prometheus) and NOTES.md (the commands to run, including the
`kubectl create secret` line). Secret values are never read, let alone written: pods get them
through `secretKeyRef`, so they stay out of manifests, runtime envs and the Ray job's metadata.
"""

from __future__ import annotations

import copy
import os
import shlex
from pathlib import Path
from typing import Any, Optional

import typer
import yaml

from rlscale.cluster.spec import ClusterSpec, load_cluster_spec
from rlscale.errors import UserError

FILES = ("raycluster.yaml", "rayjob.yaml", "secret-reference.yaml", "podmonitoring.yaml", "NOTES.md")
RENDER_RECORD = ".rlscale-render"  # the files the last render wrote (the only ones it may remove)
METRICS_PORT_NAME = "rlscale-metrics"  # IANA service name: at most 15 characters


def _labels(spec: ClusterSpec) -> dict[str, str]:
    """On every Ray pod: what the PodMonitoring selects (a RayJob's cluster gets a generated name)."""
    return {"app.kubernetes.io/name": "rlscale", "app.kubernetes.io/instance": spec.name}


RAY_CLUSTER_ENV = "RLSCALE_RAY_CLUSTER"


def stop_requests_dir(spec: ClusterSpec) -> str:
    """Where worker pods being stopped leave their request for the driver (rlscale.preemption):
    one directory per RayCluster (a RayJob's cluster has a generated name), from the pod's own
    `ray.io/cluster` label, so that two clusters on one volume never read each other's requests."""
    return f"{spec.storage.mount_path.rstrip('/')}/.rlscale/stop-requests/$({RAY_CLUSTER_ENV})"


def _env(spec: ClusterSpec) -> list[dict[str, Any]]:
    from rlscale.preemption import STOP_REQUESTS_ENV

    env = [{"name": k, "value": v} for k, v in spec.env.items()]
    # Kubernetes expands $(NAME) in a value from the variables defined before it
    env.append({"name": RAY_CLUSTER_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['ray.io/cluster']"}}})
    env.append({"name": STOP_REQUESTS_ENV, "value": stop_requests_dir(spec)})
    for key in spec.secret.required_keys + spec.secret.optional_keys:
        ref = {"name": spec.secret.name, "key": key}
        if key in spec.secret.optional_keys:
            ref["optional"] = True
        env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def _volumes(spec: ClusterSpec) -> list[dict[str, Any]]:
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.worker.shm_size:
        shm["sizeLimit"] = spec.worker.shm_size
    return [
        {"name": "shared-storage", "persistentVolumeClaim": {"claimName": spec.storage.pvc}},
        {"name": "dshm", "emptyDir": shm},
    ]


def _mounts(spec: ClusterSpec) -> list[dict[str, Any]]:
    return [{"name": "shared-storage", "mountPath": spec.storage.mount_path},
            {"name": "dshm", "mountPath": "/dev/shm"}]


# The head pod's preStop hook. Kubernetes stops a pod by SIGTERM to its main process, which on the
# head is `ray start --block`: Ray then kills its processes, and the job's driver (`rlscale train`,
# started by Ray's job supervisor) would die without the SIGTERM that makes it finish its step and
# save. The hook runs first: it sends the driver SIGTERM and waits for it to exit (within
# terminationGracePeriodSeconds); only then does the pod's main process get its own. Plain Python
# reading /proc: the image need not have procps, nor rlscale outside the job's runtime env. Its
# argument is the program name to look for (`rlscale`, run as `rlscale train` or `python -m rlscale.cli train`).
HEAD_PRE_STOP = """\
import os, signal, sys, time
name = sys.argv[1].encode()
def drivers():
    found = []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            words = open('/proc/%s/cmdline' % pid, 'rb').read().split(b'\\0')
        except OSError:
            continue
        named = any(w.endswith(b'/' + name) or w in (name, name + b'.cli') for w in words)
        if named and b'train' in words:
            found.append(int(pid))
    return found
for pid in drivers():
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        pass
while drivers():
    time.sleep(0.5)
"""


# A worker pod's preStop hook. Its SIGTERM would kill the pod's Ray worker, and the driver on the
# head would learn of it only when the next collective failed, losing the steps since the last
# save. If a policy worker runs in the pod (a process titled `ray::PolicyWorker...`), the hook
# instead leaves a request named by the pod's hostname in the stop-requests directory on the
# shared volume (written whole: a temporary dot-file, then renamed) and waits for the driver to
# remove it, which it does once its emergency save has committed or when it exits (see
# rlscale.preemption.StopRequests). When its wait runs out at the end of the grace period it takes
# the request back (in the kubelet's 2 s extension for a hook still running then); the request
# also says until when it waits, so that a driver ignores one left by a hook killed earlier. With no policy worker in the
# pod (no job running, the cluster torn down) it returns at once. Plain Python, as HEAD_PRE_STOP.
# Arguments: the variable naming the directory, the grace period in seconds, the process title to
# look for ('' = do not look).
WORKER_PRE_STOP = """\
import os, socket, sys, time
directory, grace_s, title = os.environ[sys.argv[1]], float(sys.argv[2]), sys.argv[3].encode()
def running(title):
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            if open('/proc/%s/cmdline' % pid, 'rb').read().startswith(title):
                return True
        except OSError:
            pass
    return False
if title and not running(title):
    sys.exit(0)
until, deadline = time.time() + grace_s, time.monotonic() + grace_s
os.makedirs(directory, exist_ok=True)
path = os.path.join(directory, socket.gethostname())
tmp = os.path.join(directory, '.' + socket.gethostname() + '.tmp')
with open(tmp, 'w') as f:
    f.write('stop requested at %f\\nwaits until %f\\n' % (time.time(), until))
    f.flush()
    os.fsync(f.fileno())
os.replace(tmp, path)
while os.path.exists(path) and time.monotonic() < deadline:
    time.sleep(0.5)
try:
    os.remove(path)
except OSError:
    pass
"""
WORKER_PROCESS_TITLE = "ray::PolicyWorker"  # Ray titles an actor's process ray::<class>[.<method>]


def _pod(spec: ClusterSpec, container: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"labels": _labels(spec)},
        "spec": {
            "containers": [container],
            # time between SIGTERM and SIGKILL: rlscale's emergency save and commit happen in it
            "terminationGracePeriodSeconds": spec.termination_grace_period_s,
            "nodeSelector": dict(spec.node_selector),
            "tolerations": [t.model_dump(exclude_none=True) for t in spec.tolerations],
            "volumes": _volumes(spec),
        },
    }


def _metrics_ports(spec: ClusterSpec, driver: bool) -> list[dict[str, Any]]:
    """Ray's metrics port on every pod; rlscale's only where its driver serves it (the head), so
    the PodMonitoring has no worker targets that are always down."""
    ports = [{"name": "metrics", "containerPort": spec.ports.ray_metrics, "protocol": "TCP"}]
    if driver:
        ports.append({"name": METRICS_PORT_NAME, "containerPort": spec.ports.metrics, "protocol": "TCP"})
    return ports


def ray_cluster_spec(spec: ClusterSpec) -> dict[str, Any]:
    """The `spec` of a RayCluster (also a RayJob's `rayClusterSpec`)."""
    from rlscale.preemption import STOP_REQUESTS_ENV

    p, head, worker = spec.ports, spec.head, spec.worker
    head_container = {
        "name": "ray-head",
        "image": spec.image,
        "ports": [{"name": "gcs-server", "containerPort": p.gcs, "protocol": "TCP"},
                  {"name": "dashboard", "containerPort": p.dashboard, "protocol": "TCP"},
                  {"name": "client", "containerPort": p.client, "protocol": "TCP"}] + _metrics_ports(spec, True),
        "resources": {"limits": {"cpu": head.cpu_limit, "memory": head.memory_limit},
                      "requests": {"cpu": head.cpu_request, "memory": head.memory_request}},
        "env": _env(spec),
        "volumeMounts": _mounts(spec),
        # the driver runs here: signal it before Ray's own shutdown (HEAD_PRE_STOP)
        "lifecycle": {"preStop": {"exec": {"command": ["python", "-c", HEAD_PRE_STOP, "rlscale"]}}},
    }
    per_node = {"cpu": worker.cpu, "memory": worker.memory, "nvidia.com/gpu": str(spec.gpus_per_node)}
    worker_container = {
        "name": "ray-worker",
        "image": spec.image,
        "ports": _metrics_ports(spec, False),
        "resources": {"limits": dict(per_node), "requests": dict(per_node)},
        "env": _env(spec),
        "volumeMounts": _mounts(spec),
        # tell the driver, and keep this pod's Ray worker for its emergency save (WORKER_PRE_STOP)
        "lifecycle": {"preStop": {"exec": {"command": [
            "python", "-c", WORKER_PRE_STOP, STOP_REQUESTS_ENV, str(spec.termination_grace_period_s),
            WORKER_PROCESS_TITLE]}}},
    }
    return {
        "rayVersion": spec.ray_version,
        "enableInTreeAutoscaling": False,
        "headGroupSpec": {
            "rayStartParams": {"dashboard-host": "0.0.0.0", "port": str(p.gcs),
                               "dashboard-port": str(p.dashboard), "ray-client-server-port": str(p.client),
                               "metrics-export-port": str(p.ray_metrics)},
            "template": _pod(spec, head_container),
        },
        "workerGroupSpecs": [{
            "groupName": worker.group_name,
            "replicas": spec.num_nodes,
            "minReplicas": spec.num_nodes,
            "maxReplicas": spec.num_nodes,
            "numOfHosts": 1,
            "rayStartParams": {"metrics-export-port": str(p.ray_metrics)},
            "template": _pod(spec, worker_container),
        }],
    }


def _metadata(spec: ClusterSpec, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": spec.namespace, "labels": _labels(spec)}


def raycluster(spec: ClusterSpec) -> dict[str, Any]:
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": _metadata(spec, spec.name), "spec": ray_cluster_spec(spec)}


def train_overrides(spec: ClusterSpec) -> list[str]:
    """The overrides `rlscale train` gets on this cluster: its size, the metrics port, then job.overrides."""
    args = [f"cluster.num_nodes={spec.num_nodes}", f"cluster.gpus_per_node={spec.gpus_per_node}"]
    has_port = any(o.split("=", 1)[0].strip().lstrip("+") == "logger.prometheus_port" for o in spec.job.overrides)
    if spec.monitoring.enabled and not has_port:  # the driver serves what the PodMonitoring scrapes
        args.append(f"logger.prometheus_port={spec.ports.metrics}")
    return args + list(spec.job.overrides)


def entrypoint(spec: ClusterSpec) -> str:
    return shlex.join(["rlscale", "train", *train_overrides(spec)])


def runtime_env(spec: ClusterSpec) -> dict[str, Any]:
    """Plain settings only: secrets reach the processes from the pods' env (secretKeyRef)."""
    from rlscale.cluster.jobs import job_stop_wait_s
    from rlscale.config_loading import load_config

    env: dict[str, Any] = {"env_vars": dict(spec.env)}
    # a stopped Ray job (the RayJob deleted or suspended) gets its grace, as `rlscale job submit` sets it
    grace = load_config(None, spec.job.overrides).checkpointing.preemption_grace_s
    env["env_vars"].setdefault("RAY_JOB_STOP_WAIT_TIME_S", job_stop_wait_s(grace))
    if spec.job.pip:
        env["pip"] = list(spec.job.pip)
    return env


def rayjob(spec: ClusterSpec) -> dict[str, Any]:
    cluster_spec = copy.deepcopy(ray_cluster_spec(spec))
    return {
        "apiVersion": "ray.io/v1", "kind": "RayJob",
        "metadata": _metadata(spec, spec.job.name),
        "spec": {
            "entrypoint": entrypoint(spec),
            "runtimeEnvYAML": yaml.safe_dump(runtime_env(spec), sort_keys=False),
            "shutdownAfterJobFinishes": spec.job.shutdown_after_finish,
            "backoffLimit": spec.job.backoff_limit,  # a preempted run is run again: it resumes
            "ttlSecondsAfterFinished": spec.job.ttl_seconds_after_finished,
            "submissionMode": "K8sJobMode",
            "rayClusterSpec": cluster_spec,
        },
    }


def secret_reference(spec: ClusterSpec) -> dict[str, Any]:
    """Which Secret keys the pods read (a record for people, not a manifest): names, never values."""
    keys = [{"key": k, "required": True} for k in spec.secret.required_keys]
    keys += [{"key": k, "required": False} for k in spec.secret.optional_keys]
    return {
        "secretName": spec.secret.name,
        "namespace": spec.namespace,
        "keys": keys,
        "create": create_secret_command(spec),
        "note": "Values are never written by rlscale; the pods read them through secretKeyRef.",
    }


def create_secret_command(spec: ClusterSpec) -> str:
    keys = spec.secret.required_keys + spec.secret.optional_keys
    literals = " ".join(f'--from-literal={k}="${k}"' for k in keys)
    return f"kubectl create secret generic {spec.secret.name} --namespace {spec.namespace} {literals}"


def podmonitoring(spec: ClusterSpec) -> dict[str, Any]:
    endpoints = [{"port": METRICS_PORT_NAME, "path": "/metrics", "interval": spec.monitoring.interval}]
    if spec.monitoring.scrape_ray_metrics:
        endpoints.append({"port": "metrics", "path": "/metrics", "interval": spec.monitoring.interval})
    return {
        "apiVersion": "monitoring.googleapis.com/v1", "kind": "PodMonitoring",
        "metadata": _metadata(spec, f"{spec.name}-metrics"),
        "spec": {"selector": {"matchLabels": _labels(spec)}, "endpoints": endpoints},
    }


def notes(spec: ClusterSpec) -> str:
    ns, svc = spec.namespace, f"{spec.name}-head-svc"
    return f"""# Running rlscale on KubeRay ({spec.name}, namespace {ns})

Rendered by `rlscale cluster render`. No secret value is in these files.

1. Store the tokens in a Kubernetes Secret (the values come from your shell, not from a file):

       export HF_TOKEN=...   WANDB_API_KEY=...   # WANDB_API_KEY is optional
       {create_secret_command(spec)}

   `--from-literal` still puts the value on the kubectl command line of your own machine; on a
   shared machine use `--from-env-file` with a file readable only by you, then delete it.

2. Either start a long-lived cluster and submit jobs to it:

       kubectl apply -f raycluster.yaml -f podmonitoring.yaml
       kubectl -n {ns} port-forward service/{svc} {spec.ports.dashboard}:{spec.ports.dashboard}
       rlscale job submit --address http://localhost:{spec.ports.dashboard} logger.prometheus_port={spec.ports.metrics} ...

   or run one job on a cluster made for it (deleted {spec.job.ttl_seconds_after_finished}s after it ends):

       kubectl apply -f rayjob.yaml -f podmonitoring.yaml
       kubectl -n {ns} get rayjob {spec.job.name} -w

3. Teardown: `kubectl delete -f raycluster.yaml` (or `-f rayjob.yaml`), `-f podmonitoring.yaml`,
   and `kubectl -n {ns} delete secret {spec.secret.name}`.

The image is `{spec.image}`; it must contain rlscale (build one `FROM` it, or put a wheel on the
shared volume, `pip wheel --no-deps -w {spec.storage.mount_path}/wheels .`, and list its path under
`job.pip`, or give it to `rlscale job submit --pip`). Metrics: the training driver serves
Prometheus on port {spec.ports.metrics} when given `logger.prometheus_port={spec.ports.metrics}`
(rayjob.yaml's entrypoint has it; add it to `rlscale job submit` too); Ray's own metrics are on
{spec.ports.ray_metrics}. Both are scraped by podmonitoring.yaml.
"""


class _Dumper(yaml.SafeDumper):
    """safe_dump, with multi-line strings (runtimeEnvYAML) as readable `|` blocks."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def _dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096)


def render(spec: ClusterSpec) -> dict[str, str]:
    """File name -> text, in a fixed order; the same spec always gives the same bytes."""
    files = {
        "raycluster.yaml": _dump(raycluster(spec)),
        "rayjob.yaml": _dump(rayjob(spec)),
        "secret-reference.yaml": "# Not a manifest: the Secret the pods read, by name. Values live only in the Secret.\n"
                                 + _dump(secret_reference(spec)),
        "podmonitoring.yaml": _dump(podmonitoring(spec)) if spec.monitoring.enabled else None,
        "NOTES.md": notes(spec),
    }
    return {name: text for name, text in files.items() if text is not None}


def render_to_dir(spec: ClusterSpec, out: Path) -> list[Path]:
    """Write the manifests into `out`: every file under a temporary name first, then renamed, so
    a failure (a full disk) leaves the previous render whole; a file an earlier render wrote that
    this spec no longer produces (podmonitoring.yaml once monitoring is off) is removed, so
    `kubectl apply -f` on the directory applies this render only; which files a render wrote is
    kept in .rlscale-render, and nothing else (a file of the user's) is ever removed."""
    out = Path(out)
    files = render(spec)
    staged = {name: out / f".{name}.tmp" for name in files}
    record = out / RENDER_RECORD
    try:
        earlier = set(record.read_text(encoding="utf-8").split()) & set(FILES) if record.is_file() else set()
    except OSError:
        earlier = set()
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            staged[name].write_text(text, encoding="utf-8")
        for name in files:
            os.replace(staged[name], out / name)
        for name in earlier - set(files):
            (out / name).unlink(missing_ok=True)
        record.write_text("".join(f"{name}\n" for name in files), encoding="utf-8")
    except OSError as exc:
        for tmp in staged.values():
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
        raise UserError(f"cannot write to {str(out)!r}: {exc.strerror}") from None
    return [out / name for name in files]


def render_command(config: Path | None, out: Path) -> list[Path]:
    """What `rlscale cluster render --config C --out DIR` does; prints the files written."""
    written = render_to_dir(load_cluster_spec(config), out)
    for path in written:
        typer.echo(str(path))
    return written


render_app = typer.Typer(add_completion=False, no_args_is_help=True, help="KubeRay manifests for rlscale.")


@render_app.callback()
def _cluster_group() -> None:
    """KubeRay cluster manifests for rlscale (a group, so that `render` stays a subcommand)."""


@render_app.command("render")
def _render_cli(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="cluster YAML (default: the seed's cluster)"),
    out: Path = typer.Option(..., "--out", "-o", help="directory to write the manifests to"),
) -> None:
    """Write RayCluster, RayJob, Secret reference, PodMonitoring and NOTES.md into --out."""
    render_command(config, out)
