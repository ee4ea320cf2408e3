"""The typed config of a KubeRay cluster for rlscale (`rlscale cluster render --config cluster.yaml`).

Defaults reproduce the seed's cluster (SEED.md, part 3): 8 B200 nodes of 8 GPUs, the Lustre PVC
at /lustre, the head's ports 6379/8265/10001. Every value is checked before anything is written;
a bad one is a `UserError` naming its key. Secret *values* never appear here: only the name of
the Kubernetes Secret and the keys it holds.
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

# The image the seed runs. It holds NeMo-RL, not rlscale: install rlscale through `job.pip` (runtime
# env; e.g. a wheel on the shared volume) or, better, build an image `FROM` it that pip-installs
# rlscale and set `image:` to that.
SEED_IMAGE = "nvcr.io/nvidia/nemo-rl:v0.4.0"
MAX_RAYCLUSTER_NAME = 53  # KubeRay: 63 minus the longest service suffix ("-serve-svc")
MAX_RAYJOB_NAME = 47  # KubeRay appends 6 characters to name the RayJob's cluster

class HeadResources(_Section):
    cpu_request: str = Field("8", description="head CPU request")
    cpu_limit: str = Field("32", description="head CPU limit")
    memory_request: str = Field("64Gi", description="head memory request")
    memory_limit: str = Field("1000Gi", description="head memory limit")

    @field_validator("*", mode="before")
    @classmethod
    def _q(cls, value):
        return quantity(value)

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
    required_keys: list[str] = Field(default_factory=lambda: ["HF_TOKEN"], description="keys pods fail without")
    optional_keys: list[str] = Field(default_factory=lambda: ["WANDB_API_KEY"], description="keys used if present")

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
    pip: list[str] = Field(default_factory=list, description="runtime-env pip packages (e.g. rlscale) when the image lacks them")
    shutdown_after_finish: bool = Field(True, description="RayJob: delete the cluster when the job ends")
    backoff_limit: int = Field(3, ge=0, description="RayJob: runs again after a failure (a preempted node, a lost "
                               "worker); each run resumes from the newest intact checkpoint")
    ttl_seconds_after_finished: int = Field(600, ge=0, description="RayJob: keep the cluster this long after the end")

    @field_validator("name")
    @classmethod
    def _name(cls, value):
        return dns_label(value, "RayJob name", max_len=MAX_RAYJOB_NAME, rfc1035=True)

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
    image: str = Field(SEED_IMAGE, description="container image of every Ray pod (needs rlscale: see job.pip)")
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
        default_factory=lambda: {"cloud.google.com/gke-accelerator": "nvidia-b200"}, description="node selector of every pod")
    tolerations: list[Toleration] = Field(default_factory=lambda: [Toleration(key="nvidia.com/gpu")])
    storage: Storage = Field(default_factory=Storage)
    ports: Ports = Field(default_factory=Ports)
    env: dict[str, str] = Field(default_factory=lambda: {
        "HF_HOME": "/lustre/huggingface_cache", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
    }, description="plain environment of every Ray container (never secrets)")
    secret: SecretRef = Field(default_factory=SecretRef)
    job: JobSpec = Field(default_factory=JobSpec)
    monitoring: Monitoring = Field(default_factory=Monitoring)

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
        if not value or any(c.isspace() for c in value) or value != value.strip():
            raise ValueError(f"{value!r} is not a container image reference")
        return value

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
        for key, val in value.items():
            if len(key) > 316 or not LABEL_KEY.match(key):
                raise ValueError(f"{key!r} is not a valid label key")
            if len(val) > 63 or not LABEL_VALUE.match(val):
                raise ValueError(f"{val!r} (for {key!r}) is not a valid label value")
        return value

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
        for number, text in enumerate(self.job.overrides, start=1):
            reason = override_secret_reason(text)
            if reason:
                raise ValueError(f"key 'job.overrides' (entry {number}): {reason}{keep}")
        for number, entry in enumerate(self.job.pip, start=1):
            reason = pip_secret_reason(entry)
            if reason:
                raise ValueError(f"key 'job.pip' (entry {number}): {reason}{keep}")
        return self

    @model_validator(mode="after")
    def _consistent(self):
        for key in self.secret.required_keys + self.secret.optional_keys:
            if key in self.env:
                raise ValueError(f"key 'env': {key} is also a Secret key; keep it in the Secret only")
        for text in self.job.overrides:
            key, _, value = text.partition("=")
            if key.strip().lstrip("+") == "logger.prometheus_port" and value.strip() != str(self.ports.metrics):
                raise ValueError(f"key 'job.overrides': {text!r} differs from ports.metrics ({self.ports.metrics}), "
                                 "the port the PodMonitoring scrapes; set ports.metrics instead")
        from rlscale.config_loading import load_config

        run = load_config(None, self.job.overrides)
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
        hf_home = self.env.get("HF_HOME")
        if hf_home and not _under(Path(hf_home), shared):
            raise ValueError(f"key 'env': HF_HOME={hf_home!r} is not on the shared volume ({self.storage.mount_path}, "
                             "storage.mount_path): every pod would download the model again")
        return self


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


def load_cluster_spec(path: str | Path | None) -> ClusterSpec:
    """Defaults, then the YAML file at `path` (if any)."""
    if path is None:
        return cluster_spec_from_dict({})
    loaded = read_yaml_mapping(path, "cluster config")
    return cluster_spec_from_dict(loaded)
