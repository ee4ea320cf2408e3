"""Render a `ClusterSpec` into Kubernetes manifests (`rlscale cluster render --config C --out DIR`).

The output is laid out so that one directory apply does one thing:

- `cluster/`: a long-lived RayCluster, its NetworkPolicy and its PodMonitoring
  (`kubectl apply -f DIR/cluster/`, then `rlscale job submit` through a port-forward);
- `job/`: a RayJob (a cluster made for one `rlscale train` run, deleted after it), its
  NetworkPolicy and PodMonitoring (`kubectl apply -f DIR/job/`);
- `NOTES.md` at the top: the Secrets to create (names and keys, never values), the commands.

Ray token authentication is on (KubeRay `authOptions`, and RAY_AUTH_MODE / RAY_AUTH_TOKEN from a
Secret in every Ray container, so that an operator too old for authOptions still starts an
authenticated cluster); the NetworkPolicy admits the head's ports only from the cluster's own pods,
the KubeRay operator, a RayJob's submitter pod and the metrics scraper. `insecure` renders neither.
Secret values are never read, let alone written: pods get them through `secretKeyRef`.
Minimum KubeRay: 1.6.0 (authOptions.secretName); Ray 2.52.0 (token authentication).
"""

from __future__ import annotations

import copy
import json
import os
import shlex
from pathlib import Path
from typing import Any, Optional

import typer
import yaml

from rlscale.cluster.spec import (AUTH_TOKEN_KEY, GPU_NODE_LABEL, MIN_KUBERAY, SEED_IMAGE, SPOT_NODE_LABELS, WHEEL_DIR,
                                  ClusterSpec, load_cluster_spec)
from rlscale.errors import UserError

FILES = ("cluster/raycluster.yaml", "cluster/networkpolicy.yaml", "cluster/podmonitoring.yaml",
         "job/rayjob.yaml", "job/networkpolicy.yaml", "job/podmonitoring.yaml", "NOTES.md")
# what renders before the cluster/ and job/ layout wrote at the top (removed by a new render, so
# that a stale raycluster.yaml is not applied beside the new ones)
LEGACY_FILES = ("raycluster.yaml", "rayjob.yaml", "secret-reference.yaml", "podmonitoring.yaml")
RENDER_RECORD = ".rlscale-render"  # the files the last render wrote (the only ones it may remove)
METRICS_PORT_NAME = "rlscale-metrics"  # IANA service name: at most 15 characters
JOB_LABEL = "rlscale/rayjob"  # on a RayJob's pods: their RayCluster's name is generated, ray.io/cluster unknown
CLUSTER_LABEL = "ray.io/cluster"  # set by the operator on every pod of a RayCluster


def _labels(spec: ClusterSpec, job: bool = False) -> dict[str, str]:
    """On every object and Ray pod. Not app.kubernetes.io/name: the operator sets it on the pods
    (KubeRay before 1.2 finds the head service by it) and a template's labels would override it."""
    labels = {"app.kubernetes.io/part-of": "rlscale", "app.kubernetes.io/instance": spec.name}
    if job:
        labels[JOB_LABEL] = spec.job.name
    return labels


def pod_selector(spec: ClusterSpec, job: bool) -> dict[str, str]:
    """The labels that pick the Ray pods of the RayCluster (job=False) or of the RayJob's cluster."""
    return {JOB_LABEL: spec.job.name} if job else {CLUSTER_LABEL: spec.name}


RAY_CLUSTER_ENV = "RLSCALE_RAY_CLUSTER"


def stop_requests_dir(spec: ClusterSpec) -> str:
    """Where worker pods being stopped leave their request for the driver (rlscale.preemption):
    one directory per RayCluster (a RayJob's cluster has a generated name), from the pod's own
    `ray.io/cluster` label, so that two clusters on one volume never read each other's requests."""
    return f"{spec.storage.mount_path.rstrip('/')}/.rlscale/stop-requests/$({RAY_CLUSTER_ENV})"


def _env(spec: ClusterSpec, worker: bool = False) -> list[dict[str, Any]]:
    from rlscale.preemption import STOP_REQUESTS_ENV

    plain = dict(spec.env)
    if worker and spec.gpudirect.enabled:  # the gIB NCCL plugin's settings (its own socket interfaces)
        plain.update(spec.gpudirect.nccl_env)
    env = [{"name": k, "value": v} for k, v in plain.items()]
    # Kubernetes expands $(NAME) in a value from the variables defined before it
    env.append({"name": RAY_CLUSTER_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['ray.io/cluster']"}}})
    env.append({"name": STOP_REQUESTS_ENV, "value": stop_requests_dir(spec)})
    for key in spec.secret.required_keys + spec.secret.optional_keys:
        ref = {"name": spec.secret.name, "key": key}
        if key in spec.secret.optional_keys:
            ref["optional"] = True
        env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    env += auth_env(spec)
    return env


def auth_env(spec: ClusterSpec) -> list[dict[str, Any]]:
    """Ray token authentication, set on the container itself: KubeRay >= 1.6 keeps these (and reads
    the same Secret through authOptions.secretName); an operator that drops authOptions still starts
    a cluster that demands the token. Not optional: a missing token Secret stops the pod (fail closed)."""
    if not spec.token_auth:
        return []
    return [{"name": "RAY_AUTH_MODE", "value": "token"},
            {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": spec.auth_secret, "key": AUTH_TOKEN_KEY}}}]


def _volumes(spec: ClusterSpec, worker: bool = False) -> list[dict[str, Any]]:
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.worker.shm_size:
        shm["sizeLimit"] = spec.worker.shm_size
    volumes = [
        {"name": "shared-storage", "persistentVolumeClaim": {"claimName": spec.storage.pvc}},
        {"name": "dshm", "emptyDir": shm},
    ]
    if worker and spec.gpudirect.enabled:  # what GKE's RDMA installer DaemonSet puts on the node
        volumes += [{"name": "gib", "hostPath": {"path": spec.gpudirect.gib_host_path}},
                    {"name": "library-dir-host", "hostPath": {"path": "/home/kubernetes/bin/nvidia"}}]
    return volumes


def _mounts(spec: ClusterSpec, worker: bool = False) -> list[dict[str, Any]]:
    mounts = [{"name": "shared-storage", "mountPath": spec.storage.mount_path},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    if worker and spec.gpudirect.enabled:
        mounts += [{"name": "gib", "mountPath": "/usr/local/gib", "readOnly": True},
                   {"name": "library-dir-host", "mountPath": "/usr/local/nvidia", "readOnly": True}]
    return mounts


def gpudirect_annotations(spec: ClusterSpec) -> dict[str, str]:
    """GKE multi-networking: eth0 on the pod network, then one interface per network (A4: a gVNIC, 8 RDMA NICs)."""
    interfaces = [{"interfaceName": "eth0", "network": "default"}]
    interfaces += [{"interfaceName": f"eth{i}", "network": name} for i, name in enumerate(spec.gpudirect.networks, 1)]
    return {"networking.gke.io/default-interface": "eth0",
            "networking.gke.io/interfaces": json.dumps(interfaces, separators=(",", ":"))}


def head_affinity(spec: ClusterSpec) -> dict[str, Any] | None:
    """The head (GCS, the driver) off spot nodes and GPU nodes: a preempted head ends the run."""
    expressions = []
    if spec.head.avoid_spot:
        expressions += [{"key": key, "operator": "NotIn", "values": ["true"]} for key in SPOT_NODE_LABELS]
    if spec.head.avoid_gpu_nodes:
        expressions.append({"key": GPU_NODE_LABEL, "operator": "DoesNotExist"})
    if not expressions:
        return None
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": expressions}]}}}


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


def _pod(spec: ClusterSpec, container: dict[str, Any], worker: bool, job: bool) -> dict[str, Any]:
    metadata: dict[str, Any] = {"labels": _labels(spec, job)}
    if worker and spec.gpudirect.enabled:
        metadata["annotations"] = gpudirect_annotations(spec)
    pod: dict[str, Any] = {
        "containers": [container],
        # time between SIGTERM and SIGKILL: rlscale's emergency save and commit happen in it
        "terminationGracePeriodSeconds": spec.termination_grace_period_s,
    }
    if worker:
        pod["nodeSelector"] = dict(spec.node_selector)
        pod["tolerations"] = [t.model_dump(exclude_none=True) for t in spec.tolerations]
    else:
        if spec.head.node_selector:
            pod["nodeSelector"] = dict(spec.head.node_selector)
        if spec.head.tolerations:
            pod["tolerations"] = [t.model_dump(exclude_none=True) for t in spec.head.tolerations]
        affinity = head_affinity(spec)
        if affinity:
            pod["affinity"] = affinity
    pod["volumes"] = _volumes(spec, worker)
    return {"metadata": metadata, "spec": pod}


def _metrics_ports(spec: ClusterSpec, driver: bool) -> list[dict[str, Any]]:
    """Ray's metrics port on every pod; rlscale's only where its driver serves it (the head), so
    the PodMonitoring has no worker targets that are always down."""
    ports = [{"name": "metrics", "containerPort": spec.ports.ray_metrics, "protocol": "TCP"}]
    if driver:
        ports.append({"name": METRICS_PORT_NAME, "containerPort": spec.ports.metrics, "protocol": "TCP"})
    return ports


def ray_cluster_spec(spec: ClusterSpec, job: bool = False) -> dict[str, Any]:
    """The `spec` of a RayCluster (job=True: a RayJob's `rayClusterSpec`, its pods labelled for its policy)."""
    from rlscale.preemption import STOP_REQUESTS_ENV

    p, head, worker = spec.ports, spec.head, spec.worker
    head_container = {
        "name": "ray-head",
        "image": spec.pod_image,
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
        "image": spec.pod_image,
        "ports": _metrics_ports(spec, False),
        "resources": {"limits": dict(per_node), "requests": dict(per_node)},
        "env": _env(spec, worker=True),
        "volumeMounts": _mounts(spec, worker=True),
        # tell the driver, and keep this pod's Ray worker for its emergency save (WORKER_PRE_STOP)
        "lifecycle": {"preStop": {"exec": {"command": [
            "python", "-c", WORKER_PRE_STOP, STOP_REQUESTS_ENV, str(spec.termination_grace_period_s),
            WORKER_PROCESS_TITLE]}}},
    }
    cluster: dict[str, Any] = {"rayVersion": spec.ray_version}
    if spec.token_auth:
        cluster["authOptions"] = {"mode": "token", "secretName": spec.auth_secret}
    return cluster | {
        "enableInTreeAutoscaling": False,
        "headGroupSpec": {
            "rayStartParams": {"dashboard-host": "0.0.0.0", "port": str(p.gcs),
                               "dashboard-port": str(p.dashboard), "ray-client-server-port": str(p.client),
                               "metrics-export-port": str(p.ray_metrics)},
            "template": _pod(spec, head_container, worker=False, job=job),
        },
        "workerGroupSpecs": [{
            "groupName": worker.group_name,
            "replicas": spec.num_nodes,
            "minReplicas": spec.num_nodes,
            "maxReplicas": spec.num_nodes,
            "numOfHosts": 1,
            "rayStartParams": {"metrics-export-port": str(p.ray_metrics)},
            "template": _pod(spec, worker_container, worker=True, job=job),
        }],
    }


def _metadata(spec: ClusterSpec, name: str, job: bool = False) -> dict[str, Any]:
    return {"name": name, "namespace": spec.namespace, "labels": _labels(spec, job)}


def raycluster(spec: ClusterSpec) -> dict[str, Any]:
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": _metadata(spec, spec.name), "spec": ray_cluster_spec(spec)}


def train_overrides(spec: ClusterSpec) -> list[str]:
    """The overrides `rlscale train` gets on this cluster: its size, the metrics port, then job.overrides."""
    args = [f"cluster.num_nodes={spec.num_nodes}", f"cluster.gpus_per_node={spec.gpus_per_node}"]
    has_port = any(o.split("=", 1)[0].strip().lstrip("+") == "logger.prometheus_port" for o in spec.job.overrides)
    if spec.monitoring.enabled and not has_port:  # the driver serves what the PodMonitoring scrapes
        args.append(f"logger.prometheus_port={spec.ports.metrics}")
    return args + spec.run_overrides()  # the run directory on the shared volume unless set


def entrypoint(spec: ClusterSpec) -> str:
    return shlex.join(["rlscale", "train", *train_overrides(spec)])


def runtime_env(spec: ClusterSpec) -> dict[str, Any]:
    """Plain settings only: secrets reach the processes from the pods' env (secretKeyRef)."""
    from rlscale.cluster.jobs import job_stop_wait_s
    from rlscale.config_loading import load_config

    env: dict[str, Any] = {"env_vars": dict(spec.env)}
    # a stopped Ray job (the RayJob deleted or suspended) gets its grace, as `rlscale job submit` sets it
    grace = load_config(None, spec.run_overrides()).checkpointing.preemption_grace_s
    env["env_vars"].setdefault("RAY_JOB_STOP_WAIT_TIME_S", job_stop_wait_s(grace))
    if spec.job_pip:
        env["pip"] = spec.job_pip
    return env


SUBMITTER_CONTAINER = "ray-job-submitter"


def submitter_pod_template(spec: ClusterSpec) -> dict[str, Any]:
    """K8sJobMode: `ray job submit` in a small image (the operator's default is the head's image,
    many GB, pulled onto a CPU node for a client), placed like the head, with the token."""
    template = _pod(spec, {
        "name": SUBMITTER_CONTAINER,
        "image": spec.job.submitter_image,
        "resources": {"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "500m", "memory": "200Mi"}},
        "env": auth_env(spec),
    }, worker=False, job=False)
    template["metadata"]["labels"] = _labels(spec)  # not the RayJob's pod label: it is no Ray pod
    template["spec"]["restartPolicy"] = "Never"
    del template["spec"]["volumes"], template["spec"]["terminationGracePeriodSeconds"]
    return template


def rayjob(spec: ClusterSpec) -> dict[str, Any]:
    cluster_spec = copy.deepcopy(ray_cluster_spec(spec, job=True))
    job: dict[str, Any] = {
        "entrypoint": entrypoint(spec),
        "runtimeEnvYAML": yaml.safe_dump(runtime_env(spec), sort_keys=False),
        "shutdownAfterJobFinishes": spec.job.shutdown_after_finish,
        "backoffLimit": spec.job.backoff_limit,  # a preempted run is run again: it resumes
        "ttlSecondsAfterFinished": spec.job.ttl_seconds_after_finished,
        # HTTPMode: the operator submits to the dashboard itself, no submitter pod to pull an image for
        "submissionMode": spec.job.submission_mode,
    }
    if spec.job.submission_mode == "K8sJobMode":
        job["submitterPodTemplate"] = submitter_pod_template(spec)
    job["rayClusterSpec"] = cluster_spec
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": _metadata(spec, spec.job.name, job=True),
            "spec": job}


def networkpolicy(spec: ClusterSpec, job: bool) -> dict[str, Any]:
    """Ingress to this cluster's Ray pods: every port from the cluster's own pods (Ray and NCCL use
    many), the dashboard/jobs port from the KubeRay operator (it polls the dashboard and, for a
    RayJob in HTTPMode, submits) and from a RayJob's submitter pod, the metrics ports from the
    scraper; nothing else (the GCS and client ports stay in the cluster). Egress is left open
    (model downloads, pip). `kubectl port-forward` enters the pod through the kubelet, not past
    the policy, so it keeps working."""
    p, policy = spec.ports, spec.network_policy
    own = pod_selector(spec, job)
    dashboard = [{"protocol": "TCP", "port": p.dashboard}]
    operator: dict[str, Any] = {"podSelector": {"matchLabels": dict(policy.operator_labels)}}
    operator["namespaceSelector"] = ({"matchLabels": {"kubernetes.io/metadata.name": policy.operator_namespace}}
                                     if policy.operator_namespace else {})
    operators = [operator] + [{"ipBlock": {"cidr": cidr}} for cidr in policy.operator_cidrs]
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": own}}]},
        {"from": operators, "ports": dashboard},
    ]
    if job and spec.job.submission_mode == "K8sJobMode":  # the labels KubeRay gives the submitter pod
        ingress.append({"from": [{"podSelector": {"matchLabels": {
            "ray.io/originated-from-cr-name": spec.job.name, "ray.io/originated-from-crd": "RayJob"}}}],
            "ports": dashboard})
    if policy.scraper_namespace:
        ingress.append({"from": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": policy.scraper_namespace}}}],
            "ports": [{"protocol": "TCP", "port": p.ray_metrics}, {"protocol": "TCP", "port": p.metrics}]})
    name = f"{spec.job.name if job else spec.name}-ray"
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _metadata(spec, name, job),
            "spec": {"podSelector": {"matchLabels": own}, "policyTypes": ["Ingress"], "ingress": ingress}}


def create_secret_command(spec: ClusterSpec) -> str:
    keys = spec.secret.required_keys + spec.secret.optional_keys
    literals = " ".join(f'--from-literal={k}="${k}"' for k in keys)
    return f"kubectl create secret generic {spec.secret.name} --namespace {spec.namespace} {literals}"


def create_token_command(spec: ClusterSpec) -> str:
    """A random token straight into the Secret: never on a command line, in a file or a shell variable."""
    return (f"openssl rand -base64 32 | tr -d '\\n' | kubectl create secret generic {spec.auth_secret} "
            f"--namespace {spec.namespace} --from-file={AUTH_TOKEN_KEY}=/dev/stdin")


def get_token_command(spec: ClusterSpec) -> str:
    return (f"export RAY_JOB_AUTH_TOKEN=\"$(kubectl -n {spec.namespace} get secret {spec.auth_secret} "
            f"-o jsonpath='{{.data.{AUTH_TOKEN_KEY}}}' | base64 -d)\"")


def podmonitoring(spec: ClusterSpec, job: bool) -> dict[str, Any]:
    endpoints = [{"port": METRICS_PORT_NAME, "path": "/metrics", "interval": spec.monitoring.interval}]
    if spec.monitoring.scrape_ray_metrics:
        endpoints.append({"port": "metrics", "path": "/metrics", "interval": spec.monitoring.interval})
    name = f"{spec.job.name if job else spec.name}-metrics"
    return {
        "apiVersion": "monitoring.googleapis.com/v1", "kind": "PodMonitoring",
        "metadata": _metadata(spec, name, job),
        "spec": {"selector": {"matchLabels": pod_selector(spec, job)}, "endpoints": endpoints},
    }


def image_note(spec: ClusterSpec) -> str | None:
    """What `render` says about the image when the spec names none (no rlscale image is published)."""
    if spec.image and spec.image != SEED_IMAGE:
        return None
    wheel = spec.job_pip
    how = (f"the RayJob installs rlscale from {wheel[0]} (job.pip): build it with `pip wheel --no-deps -w "
           f"{spec.storage.mount_path}/{WHEEL_DIR} .` on a machine that mounts the volume" if wheel else
           "and job.pip installs nothing: the pods have no rlscale")
    return (f"no image of your own: the pods run the seed's {SEED_IMAGE} (NeMo-RL, without rlscale); {how}; or "
            "build the repository's Dockerfile, push it and set `image:`")


def warnings(spec: ClusterSpec) -> list[str]:
    out = []
    if spec.insecure:
        out.append("insecure: no Ray token authentication and no NetworkPolicy: any pod (or anyone) that reaches "
                   f"port {spec.ports.dashboard} of the head can run code in the pods and read their Secrets")
    elif not spec.network_policy.enabled:
        out.append("network_policy.enabled is false: every pod that reaches the head can try its ports "
                   "(the token still guards them)")
    return out


def notes(spec: ClusterSpec) -> str:
    ns, svc, job_svc = spec.namespace, f"{spec.name}-head-svc", f"{spec.job.name}-head-svc"
    dash = spec.ports.dashboard
    auth = ""
    token_line = ""
    if spec.token_auth:
        auth = f"""
   The Ray auth token (Ray token authentication; the pods read it from `{spec.auth_secret}`, key
   `{AUTH_TOKEN_KEY}`, and so does the KubeRay operator, through `authOptions.secretName`): a random
   value piped straight into the Secret, never on a command line or in a file:

       {create_token_command(spec)}
"""
        token_line = f"""
   `rlscale job submit` (and `status`, `logs`, `stop`, `list`) needs that token: read it from the
   Secret into your shell only (it is sent as a Bearer header, never printed or stored):

       {get_token_command(spec)}
"""
    keys = ", ".join(f"{k} ({'required' if k in spec.secret.required_keys else 'optional'})"
                     for k in spec.secret.required_keys + spec.secret.optional_keys) or "none"
    policy = ("" if not spec.renders_network_policy else f"""
The NetworkPolicies (`networkpolicy.yaml`) admit the head's ports only from the cluster's own pods,
the KubeRay operator, a RayJob's submitter pod and the metrics scraper; they need a network plugin
that enforces NetworkPolicy (GKE Dataplane V2 does; without one they are accepted and do nothing).
`kubectl port-forward` is not affected.
""")
    insecure = "" if spec.token_auth else """
**Insecure render** (`insecure: true` / `--insecure`): no token, no NetworkPolicy. Anyone who
reaches the head's port {port} can run code in the pods and read their Secrets.
""".format(port=dash)
    image = image_note(spec)
    wheel = spec.job_pip if image is not None else []
    pip_flag = f" --pip {wheel[0]}" if wheel else ""
    image_text = (f"The image is `{spec.pod_image}`." if image is None else
                  image[0].upper() + image[1:] + ".")
    return f"""# Running rlscale on KubeRay ({spec.name}, namespace {ns})

Rendered by `rlscale cluster render`. No secret value is in these files. Needs KubeRay
{MIN_KUBERAY} or later (Ray token authentication through `authOptions.secretName`) and Ray 2.52.0
or later in the image.
{insecure}
Layout: `cluster/` is a long-lived RayCluster, `job/` a RayJob (a cluster made for one run);
apply one directory, not both. The commands below run from this directory.

1. Secrets (the values come from your shell, not from a file):

   `{spec.secret.name}`: {keys}. Every key is read through `secretKeyRef`; an optional one may be
   missing (the default model is not gated, HF_TOKEN is only for gated ones):

       export HF_TOKEN=...   WANDB_API_KEY=...
       {create_secret_command(spec)}

   `--from-literal` still puts the value on the kubectl command line of your own machine; on a
   shared machine use `--from-env-file` with a file readable only by you, then delete it.
{auth}
2. Either start a long-lived cluster and submit jobs to it:

       kubectl apply -f cluster/
       kubectl -n {ns} port-forward service/{svc} {dash}:{dash}
{token_line}
       rlscale job submit --address http://localhost:{dash}{pip_flag} logger.prometheus_port={spec.ports.metrics} ...

   or run one job on a cluster made for it (deleted {spec.job.ttl_seconds_after_finished}s after it ends):

       kubectl apply -f job/
       kubectl -n {ns} get rayjob {spec.job.name} -w

   Its logs: `kubectl -n {ns} port-forward service/{job_svc} {dash}:{dash}`, then
   `rlscale job logs "$(kubectl -n {ns} get rayjob {spec.job.name} -o jsonpath='{{.status.jobId}}')" --follow
   --address http://localhost:{dash}` (with the token as above).

3. Teardown: `kubectl delete -f cluster/` (or `-f job/`), then
   `kubectl -n {ns} delete secret {spec.secret.name}{' ' + spec.auth_secret if spec.token_auth else ''}`.

Run directories (`logger.log_dir`: metrics.jsonl, summary.json, the resolved config) and
checkpoints are on the shared volume ({spec.storage.mount_path}); the RayJob's go to
`{spec.default_log_dir()}` unless job.overrides sets logger.log_dir.
{policy}
{image_text} Metrics: the training driver serves Prometheus on port {spec.ports.metrics} when
given `logger.prometheus_port={spec.ports.metrics}` (the RayJob's entrypoint has it; add it to
`rlscale job submit` too); Ray's own metrics are on {spec.ports.ray_metrics}. Both are scraped by
`podmonitoring.yaml`.
"""


class _Dumper(yaml.SafeDumper):
    """safe_dump, with multi-line strings (runtimeEnvYAML) as readable `|` blocks and no anchors
    (a value used twice is written twice)."""

    def ignore_aliases(self, data):
        return True


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def _dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096)


def render(spec: ClusterSpec) -> dict[str, str]:
    """File name (relative to the output directory) -> text, in a fixed order; the same spec
    always gives the same bytes."""
    policy, monitor = spec.renders_network_policy, spec.monitoring.enabled
    files = {
        "cluster/raycluster.yaml": _dump(raycluster(spec)),
        "cluster/networkpolicy.yaml": _dump(networkpolicy(spec, job=False)) if policy else None,
        "cluster/podmonitoring.yaml": _dump(podmonitoring(spec, job=False)) if monitor else None,
        "job/rayjob.yaml": _dump(rayjob(spec)),
        "job/networkpolicy.yaml": _dump(networkpolicy(spec, job=True)) if policy else None,
        "job/podmonitoring.yaml": _dump(podmonitoring(spec, job=True)) if monitor else None,
        "NOTES.md": notes(spec),
    }
    return {name: text for name, text in files.items() if text is not None}


def render_to_dir(spec: ClusterSpec, out: Path) -> list[Path]:
    """Write the manifests into `out`: every file under a temporary name first, then renamed, so
    a failure (a full disk) leaves the previous render whole; a file an earlier render wrote that
    this spec no longer produces (podmonitoring.yaml once monitoring is off, the top-level
    manifests of renders before the cluster/ and job/ layout) is removed, so that `kubectl apply -f`
    on a directory applies this render only; which files a render wrote is kept in .rlscale-render,
    and nothing else (a file of the user's) is ever removed."""
    out = Path(out)
    files = render(spec)
    staged = {name: out / Path(name).parent / f".{Path(name).name}.tmp" for name in files}
    record = out / RENDER_RECORD
    known = set(FILES) | set(LEGACY_FILES)
    try:
        earlier = set(record.read_text(encoding="utf-8").split()) & known if record.is_file() else set()
    except OSError:
        earlier = set()
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            staged[name].parent.mkdir(parents=True, exist_ok=True)
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


def render_command(config: Path | None, out: Path, insecure: bool = False) -> list[Path]:
    """What `rlscale cluster render --config C --out DIR [--insecure]` does; prints the files
    written (stdout) and its warnings and notes (stderr)."""
    spec = load_cluster_spec(config, insecure=insecure)
    written = render_to_dir(spec, out)
    for path in written:
        typer.echo(str(path))
    for text in warnings(spec):
        typer.echo(f"warning: {text}", err=True)
    note = image_note(spec)
    if note:
        typer.echo(f"note: {note}", err=True)
    return written


render_app = typer.Typer(add_completion=False, no_args_is_help=True, help="KubeRay manifests for rlscale.")


@render_app.callback()
def _cluster_group() -> None:
    """KubeRay cluster manifests for rlscale (a group, so that `render` stays a subcommand)."""


@render_app.command("render")
def _render_cli(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="cluster YAML (default: the seed's cluster)"),
    out: Path = typer.Option(..., "--out", "-o", help="directory to write the manifests to"),
    insecure: bool = typer.Option(False, "--insecure", help="no Ray token authentication and no NetworkPolicy "
                                  "(the unauthenticated form; anyone reaching the dashboard can run code)"),
) -> None:
    """Write cluster/ (RayCluster), job/ (RayJob), each with its NetworkPolicy and PodMonitoring, and NOTES.md into --out."""
    render_command(config, out, insecure)
