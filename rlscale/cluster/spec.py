"""The typed config of a KubeRay cluster for rlscale (`rlscale cluster render --config cluster.yaml`).

Defaults reproduce the seed's cluster (SEED.md, part 3): 8 B200 nodes of 8 GPUs, the Lustre PVC
at /lustre, the head's ports 6379/8265/10001, with what the seed left open closed: Ray token
authentication and a NetworkPolicy (unless `insecure`), the head on a non-spot CPU node, run
directories on the shared volume. Every value is checked before anything is written; a bad one is
a `UserError` naming its key. Secret *values* never appear here: only the names of the Kubernetes
Secrets and the keys they hold.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from rlscale.cluster.k8s import (ENV_NAME, LABEL_KEY, LABEL_VALUE, dns_label, dns_subdomain, duration, parse_quantity,
                                 quantity)
from rlscale.config import _Section  # one strict base: no unknown keys, no booleans for numbers
from rlscale.config_loading import read_yaml_mapping
from rlscale.errors import UserError, validation_message

__all__ = ["ClusterSpec", "cluster_spec_from_dict", "load_cluster_spec", "parse_quantity"]

# The image the seed runs. It holds NeMo-RL, not rlscale. No rlscale image is published, so without
# `image:` the manifests name this one and the RayJob installs rlscale from a wheel on the shared
# volume (`job.pip`, default WHEEL_DIR/<wheel>); build the repository's Dockerfile and set `image:`
# to skip that install.
SEED_IMAGE = "nvcr.io/nvidia/nemo-rl:v0.4.0"
WHEEL_DIR = "wheels"  # under storage.mount_path: `pip wheel --no-deps -w /lustre/wheels .`
RUN_ROOT = "rlscale-runs"  # under storage.mount_path: the run directories (logger.log_dir) by default
MIN_RAY_FOR_TOKEN_AUTH = (2, 52, 0)  # Ray's token authentication; KubeRay refuses authOptions below it
MIN_KUBERAY = "1.6.0"  # authOptions.secretName (token auth with a Secret of ours); authOptions itself: 1.5.1
AUTH_TOKEN_KEY = "auth_token"  # the key KubeRay reads from authOptions.secretName
RESERVED_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_K8S_TOKEN_AUTH",
                "RLSCALE_RAY_CLUSTER", "RLSCALE_STOP_REQUESTS")
GPU_NODE_LABEL = "cloud.google.com/gke-accelerator"
SPOT_NODE_LABELS = ("cloud.google.com/gke-spot", "cloud.google.com/gke-preemptible")
MAX_RAYCLUSTER_NAME = 53  # KubeRay: 63 minus the longest service suffix ("-serve-svc")
MAX_RAYJOB_NAME = 47  # KubeRay appends 6 characters to name the RayJob's cluster

class Toleration(_Section):
    key: str
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"

    @model_validator(mode="after")
    def _value_matches_operator(self):
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("a toleration with operator Exists takes no value")
        return self


def _check_labels(value: dict[str, str]) -> dict[str, str]:
    for key, val in value.items():
        if len(key) > 316 or not LABEL_KEY.match(key):
            raise ValueError(f"{key!r} is not a valid label key")
        if len(val) > 63 or not LABEL_VALUE.match(val):
            raise ValueError(f"{val!r} (for {key!r}) is not a valid label value")
    return value


class HeadResources(_Section):
    cpu_request: str = Field("8", description="head CPU request")
    cpu_limit: str = Field("32", description="head CPU limit")
    memory_request: str = Field("64Gi", description="head memory request")
    memory_limit: str = Field("1000Gi", description="head memory limit")
    # The head holds the GCS and the driver: a preempted head ends the run. Its own placement,
    # not the GPU workers' (the top-level node_selector and tolerations are the workers').
    node_selector: dict[str, str] = Field(default_factory=dict, description="node selector of the head pod")
    tolerations: list[Toleration] = Field(default_factory=list, description="tolerations of the head pod")
    avoid_spot: bool = Field(True, description="keep the head off spot and preemptible nodes (GKE node labels "
                             "cloud.google.com/gke-spot / gke-preemptible)")
    avoid_gpu_nodes: bool = Field(True, description="keep the head off GPU nodes (label cloud.google.com/gke-accelerator)")

    @field_validator("cpu_request", "cpu_limit", "memory_request", "memory_limit", mode="before")
    @classmethod
    def _q(cls, value):
        return quantity(value)

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, value):
        return _check_labels(value)

    @model_validator(mode="after")
    def _placement_possible(self):
        if self.avoid_gpu_nodes and GPU_NODE_LABEL in self.node_selector:
            raise ValueError(f"head.node_selector asks for {GPU_NODE_LABEL} while head.avoid_gpu_nodes keeps the head "
                             "off GPU nodes; set head.avoid_gpu_nodes: false to put it on one")
        if self.avoid_spot and any(self.node_selector.get(k) == "true" for k in SPOT_NODE_LABELS):
            raise ValueError("head.node_selector asks for a spot node while head.avoid_spot keeps the head off them")
        return self

    @model_validator(mode="after")
    def _request_within_limit(self):
        for kind in ("cpu", "memory"):
            request, limit = getattr(self, f"{kind}_request"), getattr(self, f"{kind}_limit")
            if parse_quantity(request) > parse_quantity(limit):
                raise ValueError(f"head.{kind}_request ({request}) is larger than head.{kind}_limit ({limit})")
        return self


class WorkerResources(_Section):
    group_name: str = Field("gpu-worker-group", description="the worker group's name")
    cpu: str = Field("100", description="CPU per worker pod (request = limit)")
    memory: str = Field("1000Gi", description="memory per worker pod (request = limit)")
    shm_size: str | None = Field(None, description="size limit of the /dev/shm memory emptyDir (none: unbounded)")

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _q(cls, value):
        return quantity(value)

    @field_validator("shm_size", mode="before")
    @classmethod
    def _shm(cls, value):
        return None if value is None else quantity(value)

    @field_validator("group_name")
    @classmethod
    def _name(cls, value):
        return dns_label(value, "worker group name")


class Storage(_Section):
    pvc: str = Field("lustre-pvc", description="PersistentVolumeClaim of the shared file system")
    mount_path: str = Field("/lustre", description="where the PVC is mounted in every Ray pod")

    @field_validator("pvc")
    @classmethod
    def _pvc(cls, value):
        return dns_subdomain(value, "PVC name")

    @field_validator("mount_path")
    @classmethod
    def _path(cls, value):
        if not value.startswith("/") or value.rstrip("/") in ("", "/dev/shm") or ".." in value.split("/"):
            raise ValueError(f"{value!r} must be an absolute path other than / and /dev/shm")
        return value.rstrip("/")


class Ports(_Section):
    gcs: int = Field(6379, ge=1, le=65535, description="head: GCS server (gcs-server)")
    dashboard: int = Field(8265, ge=1, le=65535, description="head: dashboard and Jobs API")
    client: int = Field(10001, ge=1, le=65535, description="head: Ray client")
    ray_metrics: int = Field(8080, ge=1, le=65535, description="every pod: Ray's Prometheus metrics")
    metrics: int = Field(9464, ge=1, le=65535, description="rlscale's Prometheus endpoint (logger.prometheus_port)")

    @model_validator(mode="after")
    def _distinct(self):
        seen: dict[int, str] = {}
        for name, port in self.model_dump().items():
            if port in seen:
                raise ValueError(f"ports.{name} and ports.{seen[port]} are both {port}")
            seen[port] = name
        return self


class SecretRef(_Section):
    name: str = Field("rlscale-secrets", description="Kubernetes Secret holding HF_TOKEN / WANDB_API_KEY")
    # HF_TOKEN is optional: the default model is not gated, and a required key that is missing
    # keeps every pod in CreateContainerConfigError
    required_keys: list[str] = Field(default_factory=list, description="keys pods fail without")
    optional_keys: list[str] = Field(default_factory=lambda: ["HF_TOKEN", "WANDB_API_KEY"],
                                     description="keys used if present")

    @field_validator("name")
    @classmethod
    def _name(cls, value):
        return dns_subdomain(value, "Secret name")

    @field_validator("required_keys", "optional_keys")
    @classmethod
    def _keys(cls, value):
        for key in value:
            if not ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
        return value

    @model_validator(mode="after")
    def _disjoint(self):
        both = set(self.required_keys) & set(self.optional_keys)
        if both:
            raise ValueError(f"{sorted(both)[0]!r} is listed as both required and optional")
        return self


class JobSpec(_Section):
    name: str = Field("rlscale-grpo", description="RayJob name (DNS-1035, at most 47 characters)")
    overrides: list[str] = Field(default_factory=lambda: [
        "policy.model_name=Qwen/Qwen2.5-72B-Instruct", "grpo.max_num_steps=20",
        "grpo.num_generations_per_prompt=8", "grpo.num_prompts_per_step=32",
        "policy.train_global_batch_size=256", "checkpointing.enabled=True", "checkpointing.save_period=2",
        "checkpointing.keep_top_k=2", "checkpointing.checkpoint_dir=/lustre/rlscale-grpo",
        "data.dataset_name=DeepScaler", "logger.wandb_enabled=False",
    ], description="`rlscale train` overrides; cluster.num_nodes/gpus_per_node come from this file")
    pip: list[str] | None = Field(None, description="runtime-env pip packages; default: none with an `image:`, else "
                                  "the rlscale wheel on the shared volume (<mount_path>/wheels/rlscale-<version>-py3-none-any.whl)")
    submission_mode: Literal["HTTPMode", "K8sJobMode"] = Field(
        "HTTPMode", description="RayJob: the operator submits the job over HTTP (no submitter pod); K8sJobMode runs "
        "`ray job submit` in a pod of job.submitter_image")
    submitter_image: str | None = Field(None, description="K8sJobMode: a small image with the `ray` CLI (the "
                                        "operator's default, the head image, is the multi-GB training image)")
    shutdown_after_finish: bool = Field(True, description="RayJob: delete the cluster when the job ends")
    backoff_limit: int = Field(3, ge=0, description="RayJob: runs again after a failure (a preempted node, a lost "
                               "worker); each run resumes from the newest intact checkpoint")
    ttl_seconds_after_finished: int = Field(600, ge=0, description="RayJob: keep the cluster this long after the end")

    @field_validator("name")
    @classmethod
    def _name(cls, value):
        return dns_label(value, "RayJob name", max_len=MAX_RAYJOB_NAME, rfc1035=True)

    @field_validator("submitter_image")
    @classmethod
    def _submitter_image(cls, value):
        return None if value is None else _image_ref(value)

    @model_validator(mode="after")
    def _submitter(self):
        if self.submission_mode == "K8sJobMode" and not self.submitter_image:
            raise ValueError("job.submission_mode K8sJobMode needs job.submitter_image (a small image with the `ray` "
                             "CLI, e.g. rayproject/ray of the cluster's Ray version); HTTPMode needs no submitter pod")
        if self.submission_mode == "HTTPMode" and self.submitter_image:
            raise ValueError("job.submitter_image is used only with job.submission_mode K8sJobMode")
        return self

    @field_validator("overrides")
    @classmethod
    def _overrides(cls, value):
        from rlscale.config_loading import load_config

        for text in value:
            if text.split("=", 1)[0].strip().lstrip("+") in ("cluster.num_nodes", "cluster.gpus_per_node"):
                raise ValueError(f"{text!r}: set num_nodes / gpus_per_node at the top of this file instead")
        try:
            load_config(None, value)  # the keys and values `rlscale train` will be given
        except UserError as exc:
            raise ValueError(str(exc)) from None
        return value


class Auth(_Section):
    secret_name: str | None = Field(None, description="Secret holding the Ray auth token under the key auth_token "
                                    "(default: <name>-ray-token); you create it, the manifests only name it")

    @field_validator("secret_name")
    @classmethod
    def _name(cls, value):
        return None if value is None else dns_subdomain(value, "Secret name")


class NetworkPolicySpec(_Section):
    enabled: bool = Field(True, description="render a NetworkPolicy for the Ray pods (needs a network plugin that "
                          "enforces policies, e.g. GKE Dataplane V2)")
    operator_namespace: str | None = Field(None, description="namespace of the KubeRay operator (None: any namespace)")
    operator_labels: dict[str, str] = Field(default_factory=lambda: {"app.kubernetes.io/component": "kuberay-operator"},
                                            description="pod labels of the KubeRay operator (its Helm chart's and kustomize's)")
    operator_cidrs: list[str] = Field(default_factory=list, description="address ranges admitted to the dashboard as "
                                      "the operator, where it runs outside the cluster's pods (a hosted operator)")
    scraper_namespace: str | None = Field("gmp-system", description="namespace of the metrics scraper (GKE Managed "
                                          "Prometheus: gmp-system); None: no scraper admitted")

    @field_validator("operator_namespace", "scraper_namespace")
    @classmethod
    def _ns(cls, value):
        return None if value is None else dns_label(value, "namespace")

    @field_validator("operator_labels")
    @classmethod
    def _labels(cls, value):
        if not value:
            raise ValueError("network_policy.operator_labels is empty: that would admit every pod")
        return _check_labels(value)

    @field_validator("operator_cidrs")
    @classmethod
    def _cidrs(cls, value):
        import ipaddress

        for text in value:
            try:
                net = ipaddress.ip_network(text, strict=True)
            except ValueError:
                raise ValueError(f"{text!r} is not a CIDR such as 172.16.0.0/28") from None
            if net.prefixlen == 0:
                raise ValueError(f"{text!r} admits every address")
        return value


# GKE's A4 (B200) GPUDirect RDMA: the worker pods join the cluster's multi-networks (one gVNIC, eight
# RDMA NICs) by annotation, mount the gIB NCCL plugin that GKE's RDMA installer DaemonSet puts on the
# node, and set NCCL's environment as the plugin's set_nccl_env.sh does for A4
# (https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-rdma). Off by
# default: on a cluster without those networks the pods would not schedule.
GIB_NCCL_ENV = {
    "NCCL_NET": "gIB", "NCCL_CROSS_NIC": "0", "NCCL_NET_GDR_LEVEL": "PIX", "NCCL_P2P_NET_CHUNKSIZE": "131072",
    "NCCL_NVLS_CHUNKSIZE": "524288", "NCCL_IB_ADAPTIVE_ROUTING": "1", "NCCL_IB_QPS_PER_CONNECTION": "4",
    "NCCL_IB_TC": "52", "NCCL_IB_FIFO_TC": "84", "NCCL_SOCKET_IFNAME": "eth0,eth1",
    "NCCL_TUNER_CONFIG_PATH": "/usr/local/gib/configs/tuner_config_a4.txtpb",
    "LD_LIBRARY_PATH": "/usr/local/gib/lib64:/usr/local/nvidia/lib64",
}


class GPUDirect(_Section):
    enabled: bool = Field(False, description="A4 GPUDirect RDMA on the worker pods (GKE multi-networking + gIB)")
    networks: list[str] = Field(default_factory=lambda: ["gvnic-1"] + [f"rdma-{i}" for i in range(8)],
                                description="GKE Network objects for eth1, eth2, ... (eth0 stays the default network)")
    gib_host_path: str = Field("/home/kubernetes/bin/gib", description="where GKE's RDMA installer puts the gIB plugin")
    nccl_env: dict[str, str] = Field(default_factory=lambda: dict(GIB_NCCL_ENV),
                                     description="worker environment for the gIB NCCL plugin")

    @field_validator("networks")
    @classmethod
    def _networks(cls, value):
        if not value:
            raise ValueError("gpudirect.networks is empty")
        for name in value:
            dns_subdomain(name, "network name")
        return value

    @field_validator("nccl_env")
    @classmethod
    def _env(cls, value):
        for key in value:
            if not ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
        return value


class Monitoring(_Section):
    enabled: bool = Field(True, description="render a PodMonitoring (Google Managed Prometheus)")
    interval: str = Field("30s", description="scrape interval")
    scrape_ray_metrics: bool = Field(True, description="also scrape Ray's own metrics port")

    @field_validator("interval")
    @classmethod
    def _interval(cls, value):
        return duration(value)


class ClusterSpec(_Section):
    name: str = Field("rlscale", description="RayCluster name (DNS-1035, at most 53 characters)")
    namespace: str = Field("default", description="Kubernetes namespace")
    image: str | None = Field(None, description="container image of every Ray pod, with rlscale in it (the "
                              "repository's Dockerfile); default: the seed's NeMo-RL image, rlscale from job.pip")
    insecure: bool = Field(False, description="no Ray token authentication and no NetworkPolicy (the form before "
                           "rlscale 0.1's hardening): anyone reaching port 8265 can run code in the pods")
    ray_version: str = Field("2.54.0", description="Ray version inside the image")
    num_nodes: int = Field(8, ge=1, description="GPU worker pods (replicas = min = max)")
    gpus_per_node: int = Field(8, ge=1, description="GPUs per worker pod")
    termination_grace_period_s: int = Field(
        30, ge=0, description="terminationGracePeriodSeconds of every Ray pod: SIGTERM to SIGKILL; the default is "
        "checkpointing.preemption_grace_s (15) + 15 s for the commit and exit (a GKE spot node gives non-system "
        "pods 15 s whatever this says, unless its node pool's graceful-shutdown period is raised)")
    head: HeadResources = Field(default_factory=HeadResources)
    worker: WorkerResources = Field(default_factory=WorkerResources)
    node_selector: dict[str, str] = Field(
        default_factory=lambda: {"cloud.google.com/gke-accelerator": "nvidia-b200"},
        description="node selector of the worker pods (the head's: head.node_selector)")
    tolerations: list[Toleration] = Field(default_factory=lambda: [Toleration(key="nvidia.com/gpu")],
                                          description="tolerations of the worker pods (the head's: head.tolerations)")
    storage: Storage = Field(default_factory=Storage)
    ports: Ports = Field(default_factory=Ports)
    env: dict[str, str] = Field(default_factory=lambda: {
        "HF_HOME": "/lustre/huggingface_cache", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
    }, description="plain environment of every Ray container (never secrets)")
    secret: SecretRef = Field(default_factory=SecretRef)
    auth: Auth = Field(default_factory=Auth)
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    gpudirect: GPUDirect = Field(default_factory=GPUDirect)
    job: JobSpec = Field(default_factory=JobSpec)
    monitoring: Monitoring = Field(default_factory=Monitoring)

    # ------------------------------------------------------------------ what the render uses

    @property
    def pod_image(self) -> str:
        return self.image or SEED_IMAGE

    @property
    def job_pip(self) -> list[str]:
        """The RayJob's runtime-env pip packages: job.pip as given, else (no image of one's own) the
        rlscale wheel on the shared volume."""
        if self.job.pip is not None:
            return list(self.job.pip)
        own = self.image and self.image != SEED_IMAGE
        return [] if own else [default_wheel(self.storage.mount_path)]

    @property
    def auth_secret(self) -> str:
        return self.auth.secret_name or f"{self.name}-ray-token"

    @property
    def token_auth(self) -> bool:
        return not self.insecure

    @property
    def renders_network_policy(self) -> bool:
        return not self.insecure and self.network_policy.enabled

    def default_log_dir(self) -> str:
        return f"{self.storage.mount_path}/{RUN_ROOT}/{self.job.name}"

    def run_overrides(self) -> list[str]:
        """job.overrides, with the run directory on the shared volume unless they set one: relative to
        the head's working directory, metrics.jsonl, summary.json and the resolved config would go
        with the RayJob's cluster (deleted ttl_seconds_after_finished after the end) or a retry."""
        keys = {text.split("=", 1)[0].strip().lstrip("+") for text in self.job.overrides}
        extra = [] if "logger.log_dir" in keys else [f"logger.log_dir={self.default_log_dir()}"]
        return extra + list(self.job.overrides)

    @field_validator("name")
    @classmethod
    def _name(cls, value):
        return dns_label(value, "RayCluster name", max_len=MAX_RAYCLUSTER_NAME, rfc1035=True)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value):
        return dns_label(value, "namespace")

    @field_validator("image")
    @classmethod
    def _image(cls, value):
        return None if value is None else _image_ref(value)

    @field_validator("ray_version", mode="before")
    @classmethod
    def _ray_version(cls, value):
        text = str(value)
        if not re.match(r"^\d+\.\d+\.\d+$", text):
            raise ValueError(f"{text!r} is not a Ray version such as 2.54.0")
        return text

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, value):
        return _check_labels(value)

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, value):
        from rlscale.cluster.jobs import secret_name

        if not isinstance(value, dict):
            return value
        out = {}
        for key, val in value.items():
            if not isinstance(key, str) or not ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
            if secret_name(key):
                raise ValueError(f"{key} looks like a secret: list it under secret.required_keys or "
                                 "secret.optional_keys and store it in the Kubernetes Secret")
            if isinstance(val, (dict, list)) or val is None:
                raise ValueError(f"env.{key} must be a plain value")
            out[key] = str(val).lower() if isinstance(val, bool) else str(val)
        return out

    @model_validator(mode="after")
    def _no_secret_values(self):
        """Every value here is written into the manifests in plain text (pod env, the RayJob's
        entrypoint and runtime env): the same checks as `rlscale job submit`."""
        from rlscale.cluster.jobs import override_secret_reason, pip_secret_reason, secret_reason

        keep = "; keep secrets in the Kubernetes Secret (secret.required_keys / secret.optional_keys)"
        for key, value in self.env.items():
            reason = secret_reason(key, value)
            if reason:
                raise ValueError(f"key 'env': {reason}{keep}")
        for key, value in self.gpudirect.nccl_env.items():
            reason = secret_reason(key, value)
            if reason:
                raise ValueError(f"key 'gpudirect.nccl_env': {reason}{keep}")
        for number, text in enumerate(self.job.overrides, start=1):
            reason = override_secret_reason(text)
            if reason:
                raise ValueError(f"key 'job.overrides' (entry {number}): {reason}{keep}")
        for number, entry in enumerate(self.job.pip or [], start=1):
            reason = pip_secret_reason(entry)
            if reason:
                raise ValueError(f"key 'job.pip' (entry {number}): {reason}{keep}")
        return self

    @model_validator(mode="after")
    def _consistent(self):
        for key in self.secret.required_keys + self.secret.optional_keys:
            if key in self.env:
                raise ValueError(f"key 'env': {key} is also a Secret key; keep it in the Secret only")
        # what the render sets itself: a second entry of the same name would override it (RAY_AUTH_MODE=disabled)
        for where, keys in (("env", list(self.env) + list(self.gpudirect.nccl_env)),
                            ("secret", self.secret.required_keys + self.secret.optional_keys)):
            for key in keys:
                if key in RESERVED_ENV:
                    raise ValueError(f"key '{where}': {key} is set by rlscale cluster render itself "
                                     "(Ray token authentication, the stop-request directory)")
        for text in self.job.overrides:
            key, _, value = text.partition("=")
            if key.strip().lstrip("+") == "logger.prometheus_port" and value.strip() != str(self.ports.metrics):
                raise ValueError(f"key 'job.overrides': {text!r} differs from ports.metrics ({self.ports.metrics}), "
                                 "the port the PodMonitoring scrapes; set ports.metrics instead")
        if self.token_auth and tuple(int(x) for x in self.ray_version.split(".")) < MIN_RAY_FOR_TOKEN_AUTH:
            raise ValueError(f"key 'ray_version': Ray {self.ray_version} has no token authentication (2.52.0 and "
                             "later have it; KubeRay refuses authOptions below it): use a newer Ray, or set "
                             "insecure: true (an unauthenticated cluster)")
        for entry in self.job.pip or []:
            if not entry.strip() or entry.lstrip().startswith("-"):
                raise ValueError("key 'job.pip': an entry is empty or an option; give a package, a wheel path or a URL")
        from rlscale.config_loading import load_config

        run = load_config(None, self.run_overrides())
        grace = run.checkpointing.preemption_grace_s
        if grace >= self.termination_grace_period_s:
            raise ValueError(f"key 'termination_grace_period_s': {self.termination_grace_period_s} s does not leave "
                             f"the job's checkpointing.preemption_grace_s ({grace:g} s) time to commit; make it larger")
        # what must outlive a pod lives on the shared volume: a pod's own disk goes with the pod
        shared = Path(self.storage.mount_path)
        if run.checkpointing.enabled and not _under(run.checkpoint_dir, shared):
            raise ValueError(f"key 'job.overrides': the checkpoint directory {str(run.checkpoint_dir)!r} is not on the "
                             f"shared volume ({self.storage.mount_path}, storage.mount_path): checkpoints there die "
                             "with the head pod; set checkpointing.checkpoint_dir under it")
        if not _under(Path(run.logger.log_dir), shared):
            raise ValueError(f"key 'job.overrides': the run directory logger.log_dir={run.logger.log_dir!r} is not on "
                             f"the shared volume ({self.storage.mount_path}, storage.mount_path): metrics.jsonl, "
                             "summary.json and the resolved config there die with the head pod; set it under it "
                             f"or leave it out (default {self.default_log_dir()})")
        hf_home = self.env.get("HF_HOME")
        if hf_home and not _under(Path(hf_home), shared):
            raise ValueError(f"key 'env': HF_HOME={hf_home!r} is not on the shared volume ({self.storage.mount_path}, "
                             "storage.mount_path): every pod would download the model again")
        return self


def _image_ref(value: str) -> str:
    if not value or any(c.isspace() for c in value) or value != value.strip():
        raise ValueError(f"{value!r} is not a container image reference")
    return value


def default_wheel(mount_path: str) -> str:
    """Where `pip wheel --no-deps -w <mount_path>/wheels .` puts this version's wheel."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        number = version("rlscale")
    except PackageNotFoundError:  # a source tree not installed
        number = "0.1.0"
    return f"{mount_path.rstrip('/')}/{WHEEL_DIR}/rlscale-{number}-py3-none-any.whl"


def _under(path: Path, root: Path) -> bool:
    return path.is_absolute() and ".." not in path.parts and (path == root or root in path.parents)


def cluster_spec_from_dict(tree: dict[str, Any] | None) -> ClusterSpec:
    """Validate a mapping (a parsed cluster.yaml); raises UserError naming the first bad key."""
    if tree is not None and not isinstance(tree, dict):
        raise UserError("cluster config must be a mapping of keys")
    try:
        return ClusterSpec.model_validate(tree or {})
    except ValidationError as err:
        raise UserError(validation_message(err, "cluster config")) from None


def load_cluster_spec(path: str | Path | None, insecure: bool = False) -> ClusterSpec:
    """Defaults, then the YAML file at `path` (if any); `insecure` as `rlscale cluster render --insecure`."""
    loaded = {} if path is None else read_yaml_mapping(path, "cluster config")
    if insecure and isinstance(loaded, dict):
        loaded = {**loaded, "insecure": True}
    return cluster_spec_from_dict(loaded)
