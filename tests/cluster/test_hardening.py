"""`rlscale cluster render` on a locked-down cluster (issue 25): Ray token authentication, the
NetworkPolicies, the head's own placement, GPUDirect for A4, operator labels left alone, the
output layout, optional HF_TOKEN, the light RayJob submitter, run directories on the shared
volume, the image default."""

from __future__ import annotations

import ipaddress
import json

import pytest
import yaml

from rlscale.cluster.render import (FILES, JOB_LABEL, networkpolicy, raycluster, rayjob, render, render_command,
                                    render_to_dir)
from rlscale.cluster.spec import SEED_IMAGE, ClusterSpec, cluster_spec_from_dict
from rlscale.errors import UserError
from tests.cluster.test_render import _pod_labels, _strict, _validate, check_operator_rules, schemas  # noqa: F401


def _groups(cluster_spec: dict) -> list[dict]:
    return [cluster_spec["headGroupSpec"]] + cluster_spec["workerGroupSpecs"]


def _containers(doc: dict) -> list[dict]:
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    out = [c for g in _groups(spec) for c in g["template"]["spec"]["containers"]]
    if doc["kind"] == "RayJob" and "submitterPodTemplate" in doc["spec"]:
        out += doc["spec"]["submitterPodTemplate"]["spec"]["containers"]
    return out


def _env(container: dict) -> dict[str, dict]:
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names)), f"duplicate env names in {container['name']}: {names}"
    return {e["name"]: e for e in container["env"]}


def check_auth_rules(doc: dict) -> None:
    """KubeRay's checks of authOptions (validation.go): token mode needs Ray >= 2.52.0; K8s token
    auth needs no secretName and is refused in a RayJob."""
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    auth = spec.get("authOptions")
    if auth and auth.get("mode", "token") == "token":
        assert tuple(int(x) for x in spec["rayVersion"].split(".")) >= (2, 52, 0)
        assert not (auth.get("enableK8sTokenAuth") and auth.get("secretName"))
        if doc["kind"] == "RayJob":
            assert not auth.get("enableK8sTokenAuth")


# ------------------------------------------------------------------ token authentication


@pytest.mark.parametrize("spec", [ClusterSpec(), ClusterSpec(job={"submission_mode": "K8sJobMode",
                                                                   "submitter_image": "rayproject/ray:2.54.0"})])
def test_token_authentication_is_on_in_every_ray_container(spec, schemas):
    for doc in (raycluster(spec), rayjob(spec)):
        _validate(doc, schemas[doc["kind"]])
        check_operator_rules(doc["kind"], doc)
        check_auth_rules(doc)
        cluster = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        # KubeRay >= 1.6 reads the token from our Secret (no per-cluster one of its own, whose name
        # would be the RayJob's generated cluster name)
        assert cluster["authOptions"] == {"mode": "token", "secretName": "rlscale-ray-token"}
        containers = _containers(doc)
        assert len(containers) == (3 if doc["kind"] == "RayJob" and spec.job.submission_mode == "K8sJobMode" else 2)
        for container in containers:
            env = _env(container)
            assert env["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "token"}
            # required (no `optional`): a missing token Secret stops the pod instead of starting it open
            assert env["RAY_AUTH_TOKEN"] == {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": "rlscale-ray-token", "key": "auth_token"}}}


def test_the_auth_check_catches_an_old_ray():
    doc = raycluster(ClusterSpec())
    doc["spec"]["rayVersion"] = "2.51.1"
    with pytest.raises(AssertionError):
        check_auth_rules(doc)
    with pytest.raises(UserError, match="'ray_version'.*2.52.0.*insecure"):
        cluster_spec_from_dict({"ray_version": "2.51.1"})
    assert cluster_spec_from_dict({"ray_version": "2.51.1", "insecure": True}).token_auth is False


def test_the_token_secret_can_be_named():
    spec = cluster_spec_from_dict({"auth": {"secret_name": "team.ray-token"}})
    doc = raycluster(spec)
    assert doc["spec"]["authOptions"]["secretName"] == "team.ray-token"
    assert all(_env(c)["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "team.ray-token"
               for c in _containers(doc))
    with pytest.raises(UserError, match="auth.secret_name"):
        cluster_spec_from_dict({"auth": {"secret_name": "Bad Name"}})


@pytest.mark.parametrize("how", ["flag", "spec"])
def test_insecure_renders_the_old_form_with_a_warning(tmp_path, capsys, how):
    config = tmp_path / "c.yaml"
    config.write_text("insecure: true\n" if how == "spec" else "{}\n")
    out = tmp_path / "out"
    render_command(config, out, insecure=(how == "flag"))
    err = capsys.readouterr().err
    assert "warning: insecure: no Ray token authentication and no NetworkPolicy" in err
    for name in ("cluster/raycluster.yaml", "job/rayjob.yaml"):
        doc = yaml.safe_load((out / name).read_text())
        cluster = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        assert "authOptions" not in cluster
        assert all("RAY_AUTH_MODE" not in _env(c) and "RAY_AUTH_TOKEN" not in _env(c) for c in _containers(doc))
    assert not (out / "cluster" / "networkpolicy.yaml").exists() and not (out / "job" / "networkpolicy.yaml").exists()
    assert "Insecure render" in (out / "NOTES.md").read_text()


def test_a_secure_render_warns_of_nothing(tmp_path, capsys):
    render_command(None, tmp_path, insecure=False)
    err = capsys.readouterr().err
    assert "warning" not in err


# ------------------------------------------------------------------ the NetworkPolicies

# networking.k8s.io/v1 NetworkPolicy, the fields rlscale writes (strict: a typo'd field fails)
_PORT = {"type": "object", "properties": {"protocol": {"enum": ["TCP", "UDP", "SCTP"]},
                                          "port": {"type": ["integer", "string"]}, "endPort": {"type": "integer"}}}
_SELECTOR = {"type": "object", "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array"}}}
_PEER = {"type": "object", "properties": {
    "podSelector": _SELECTOR, "namespaceSelector": _SELECTOR,
    "ipBlock": {"type": "object", "required": ["cidr"],
                "properties": {"cidr": {"type": "string"}, "except": {"type": "array"}}}}}
NETWORK_POLICY_SCHEMA = _strict({
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "networking.k8s.io/v1"}, "kind": {"const": "NetworkPolicy"},
        "metadata": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {"type": "object", "required": ["podSelector"], "properties": {
            "podSelector": _SELECTOR,
            "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
            "ingress": {"type": "array", "items": {"type": "object", "properties": {
                "from": {"type": "array", "items": _PEER}, "ports": {"type": "array", "items": _PORT}}}},
            "egress": {"type": "array"}}},
    },
})


def admits(policy: dict, target: dict, port: int, src_labels: dict | None = None, src_ns: str = "default",
           src_ip: str | None = None) -> bool | None:
    """NetworkPolicy semantics (ingress): None if the policy does not select the target pod, else
    whether a connection from the source to `port` is admitted."""
    spec = policy["spec"]
    if not spec["podSelector"]["matchLabels"].items() <= target.items():
        return None
    namespace = policy["metadata"]["namespace"]
    for rule in spec.get("ingress", []):
        if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
            continue
        for peer in rule.get("from", []):
            if "ipBlock" in peer:
                if src_ip and ipaddress.ip_address(src_ip) in ipaddress.ip_network(peer["ipBlock"]["cidr"]):
                    return True
                continue
            if src_labels is None:  # an address outside the cluster's pods
                continue
            ns_selector = peer.get("namespaceSelector")
            ns_ok = (src_ns == namespace if ns_selector is None else
                     ns_selector.get("matchLabels", {}).items() <= {"kubernetes.io/metadata.name": src_ns}.items())
            pod_ok = peer.get("podSelector", {}).get("matchLabels", {}).items() <= src_labels.items()
            if ns_ok and pod_ok:
                return True
    return False


OPERATOR = {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/component": "kuberay-operator"}


@pytest.mark.parametrize("job", [False, True])
def test_the_network_policy_admits_the_head_ports_only_from_who_needs_them(job):
    spec = ClusterSpec(job={"submission_mode": "K8sJobMode", "submitter_image": "rayproject/ray:2.54.0"})
    policy = networkpolicy(spec, job=job)
    _validate(policy, NETWORK_POLICY_SCHEMA)
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress open: model downloads, pip
    doc = rayjob(spec) if job else raycluster(spec)
    cluster = doc["spec"]["rayClusterSpec"] if job else doc["spec"]
    head, worker = (_pod_labels(g, doc) for g in _groups(cluster))
    p = spec.ports
    head_ports = [p.gcs, p.dashboard, p.client, p.ray_metrics, p.metrics]
    # it selects this cluster's pods, head and workers, and no pod of the other kind's cluster
    assert admits(policy, head, p.gcs, head) is not None and admits(policy, worker, p.gcs, head) is not None
    other_doc = raycluster(spec) if job else rayjob(spec)
    other_cluster = other_doc["spec"]["rayClusterSpec"] if not job else other_doc["spec"]
    other_head = _pod_labels(_groups(other_cluster)[0], other_doc)
    assert admits(policy, other_head, p.gcs, head) is None
    # the cluster's own pods: every port (Ray's and NCCL's many ports among them)
    for port in head_ports + [12345]:
        assert admits(policy, head, port, worker) and admits(policy, worker, port, head)
    # the operator (any namespace by default): the dashboard only
    for port in head_ports:
        assert admits(policy, head, port, OPERATOR, "ray-system") is (port == p.dashboard)
    # a RayJob's submitter pod (the labels KubeRay gives it): the dashboard only, and only to its own job
    submitter = {"ray.io/originated-from-cr-name": spec.job.name, "ray.io/originated-from-crd": "RayJob"}
    for port in head_ports:
        assert admits(policy, head, port, submitter) is (job and port == p.dashboard)
    # the metrics scraper (GKE Managed Prometheus in gmp-system): the metrics ports only
    for port in head_ports:
        assert admits(policy, head, port, {"app": "collector"}, "gmp-system") is (port in (p.ray_metrics, p.metrics))
    # anyone else: nothing (another pod of the namespace, a pod elsewhere, an outside address)
    for port in head_ports:
        assert not admits(policy, head, port, {"app": "notebook"})
        assert not admits(policy, head, port, {"app": "notebook"}, "other")
        assert not admits(policy, head, port, None, src_ip="203.0.113.9")


def test_the_policy_can_name_the_operator_s_namespace_and_address_range():
    spec = cluster_spec_from_dict({"network_policy": {"operator_namespace": "ray-system",
                                                      "operator_cidrs": ["172.16.0.0/28"], "scraper_namespace": None}})
    policy = networkpolicy(spec, job=False)
    _validate(policy, NETWORK_POLICY_SCHEMA)
    head = {"ray.io/cluster": spec.name}
    assert admits(policy, head, 8265, OPERATOR, "ray-system")
    assert not admits(policy, head, 8265, OPERATOR, "default")  # an imitation elsewhere is not the operator
    assert admits(policy, head, 8265, None, src_ip="172.16.0.5")
    assert not admits(policy, head, 6379, None, src_ip="172.16.0.5")
    assert not admits(policy, head, 8080, {"app": "collector"}, "gmp-system")  # no scraper named: none admitted
    for bad in ({"operator_cidrs": ["10.0.0.0/33"]}, {"operator_cidrs": ["0.0.0.0/0"]}, {"operator_labels": {}},
                {"operator_namespace": "Bad_NS"}):
        with pytest.raises(UserError, match="network_policy"):
            cluster_spec_from_dict({"network_policy": bad})


def test_the_policy_can_be_left_out_with_auth_still_on(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("network_policy: {enabled: false}\n")
    render_command(config, tmp_path / "out")
    assert "warning: network_policy.enabled is false" in capsys.readouterr().err
    assert not (tmp_path / "out" / "cluster" / "networkpolicy.yaml").exists()
    assert "authOptions" in (tmp_path / "out" / "cluster" / "raycluster.yaml").read_text()


# ------------------------------------------------------------------ placement, labels, GPUDirect


def test_the_head_has_its_own_placement_off_spot_and_gpu_nodes():
    rc = raycluster(ClusterSpec())["spec"]
    head, worker = (g["template"]["spec"] for g in _groups(rc))
    terms = head["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [
        {"key": "cloud.google.com/gke-spot", "operator": "NotIn", "values": ["true"]},
        {"key": "cloud.google.com/gke-preemptible", "operator": "NotIn", "values": ["true"]},
        {"key": "cloud.google.com/gke-accelerator", "operator": "DoesNotExist"}]}]
    assert "nodeSelector" not in head and "tolerations" not in head  # no GPU pool's selector or taint toleration
    assert worker["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-b200"}
    spec = cluster_spec_from_dict({"head": {"node_selector": {"cloud.google.com/gke-nodepool": "system"},
                                            "tolerations": [{"key": "dedicated", "operator": "Equal",
                                                             "value": "ray-head"}], "avoid_gpu_nodes": False}})
    head = raycluster(spec)["spec"]["headGroupSpec"]["template"]["spec"]
    assert head["nodeSelector"] == {"cloud.google.com/gke-nodepool": "system"}
    assert head["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "ray-head",
                                    "effect": "NoSchedule"}]
    assert [e["key"] for e in head["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"]] == ["cloud.google.com/gke-spot", "cloud.google.com/gke-preemptible"]
    spec = cluster_spec_from_dict({"head": {"avoid_spot": False, "avoid_gpu_nodes": False}})
    assert "affinity" not in raycluster(spec)["spec"]["headGroupSpec"]["template"]["spec"]
    with pytest.raises(UserError, match="head"):  # a head asked onto a GPU node while kept off them
        cluster_spec_from_dict({"head": {"node_selector": {"cloud.google.com/gke-accelerator": "nvidia-b200"}}})


def test_the_pods_leave_the_operator_s_labels_alone():
    """KubeRay sets app.kubernetes.io/name (older releases find the head service by it),
    app.kubernetes.io/created-by and ray.io/*; a template label of the same key overrides (or is
    refused for) them."""
    spec = ClusterSpec(job={"submission_mode": "K8sJobMode", "submitter_image": "rayproject/ray:2.54.0"})
    templates = [g["template"] for g in _groups(raycluster(spec)["spec"]) + _groups(rayjob(spec)["spec"]["rayClusterSpec"])]
    templates.append(rayjob(spec)["spec"]["submitterPodTemplate"])
    for template in templates:
        for key in template["metadata"]["labels"]:
            assert key not in ("app.kubernetes.io/name", "app.kubernetes.io/created-by", "app.kubernetes.io/component")
            assert not key.startswith("ray.io/")
    for doc in (raycluster(spec), rayjob(spec)):
        assert "app.kubernetes.io/name" not in doc["metadata"]["labels"]


def test_gpudirect_is_off_by_default_and_renders_gke_s_a4_settings_when_on(schemas):
    rc = raycluster(ClusterSpec())["spec"]
    text = json.dumps(rc)
    assert "networking.gke.io" not in text and "gib" not in text and "NCCL_NET" not in text
    spec = cluster_spec_from_dict({"gpudirect": {"enabled": True}})
    for doc in (raycluster(spec), rayjob(spec)):
        _validate(doc, schemas[doc["kind"]])
        check_operator_rules(doc["kind"], doc)
    head, worker = _groups(raycluster(spec)["spec"])
    annotations = worker["template"]["metadata"]["annotations"]
    assert annotations["networking.gke.io/default-interface"] == "eth0"
    interfaces = json.loads(annotations["networking.gke.io/interfaces"])
    assert interfaces == [{"interfaceName": "eth0", "network": "default"},
                          {"interfaceName": "eth1", "network": "gvnic-1"}] + [
        {"interfaceName": f"eth{i + 2}", "network": f"rdma-{i}"} for i in range(8)]
    pod, container = worker["template"]["spec"], worker["template"]["spec"]["containers"][0]
    assert {"name": "gib", "hostPath": {"path": "/home/kubernetes/bin/gib"}} in pod["volumes"]
    assert {"name": "gib", "mountPath": "/usr/local/gib", "readOnly": True} in container["volumeMounts"]
    env = {k: v.get("value") for k, v in _env(container).items()}
    assert env["NCCL_NET"] == "gIB" and env["NCCL_SOCKET_IFNAME"] == "eth0,eth1"
    assert env["NCCL_TUNER_CONFIG_PATH"] == "/usr/local/gib/configs/tuner_config_a4.txtpb"
    assert env["LD_LIBRARY_PATH"].split(":")[0] == "/usr/local/gib/lib64"
    # the head has no GPUs and no RDMA NICs
    assert "annotations" not in head["template"]["metadata"]
    assert "NCCL_NET" not in _env(head["template"]["spec"]["containers"][0])
    with pytest.raises(UserError, match="gpudirect"):
        cluster_spec_from_dict({"gpudirect": {"networks": []}})
    with pytest.raises(UserError, match="gpudirect.nccl_env"):
        cluster_spec_from_dict({"gpudirect": {"nccl_env": {"NCCL_IB_TOKEN": "x"}}})


# ------------------------------------------------------------------ layout, secrets, submitter, run dirs, image


def test_a_directory_apply_does_one_thing(tmp_path):
    render_to_dir(ClusterSpec(), tmp_path)
    # `kubectl apply -f DIR/` reads the .yaml/.yml/.json files at the top: there are none
    assert not [p for p in tmp_path.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml", ".json")]
    kinds = {}
    for folder in ("cluster", "job"):
        docs = [d for p in sorted((tmp_path / folder).iterdir()) for d in yaml.safe_load_all(p.read_text())]
        assert all(d.get("apiVersion") and d.get("kind") and d["metadata"].get("name") for d in docs)  # manifests only
        kinds[folder] = sorted(d["kind"] for d in docs)
    assert kinds == {"cluster": ["NetworkPolicy", "PodMonitoring", "RayCluster"],
                     "job": ["NetworkPolicy", "PodMonitoring", "RayJob"]}
    assert set(render(ClusterSpec())) == set(FILES)


def test_hf_token_is_optional_by_default():
    for container in _containers(raycluster(ClusterSpec())):
        for name in ("HF_TOKEN", "WANDB_API_KEY"):
            assert _env(container)[name]["valueFrom"]["secretKeyRef"] == {
                "name": "rlscale-secrets", "key": name, "optional": True}
    spec = cluster_spec_from_dict({"secret": {"required_keys": ["HF_TOKEN"], "optional_keys": ["WANDB_API_KEY"]}})
    container = _containers(raycluster(spec))[0]
    assert "optional" not in _env(container)["HF_TOKEN"]["valueFrom"]["secretKeyRef"]


def test_the_rayjob_submits_without_a_heavy_submitter_pod(schemas):
    job = rayjob(ClusterSpec())["spec"]
    assert job["submissionMode"] == "HTTPMode" and "submitterPodTemplate" not in job
    spec = cluster_spec_from_dict({"job": {"submission_mode": "K8sJobMode", "submitter_image": "rayproject/ray:2.54.0"}})
    doc = rayjob(spec)
    _validate(doc, schemas["RayJob"])
    template = doc["spec"]["submitterPodTemplate"]
    (container,) = template["spec"]["containers"]
    assert container["image"] == "rayproject/ray:2.54.0" != spec.pod_image
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "1Gi"}
    assert template["spec"]["restartPolicy"] == "Never"
    assert "affinity" in template["spec"] and "nodeSelector" not in template["spec"]  # a CPU node, like the head
    assert JOB_LABEL not in template["metadata"]["labels"]  # not one of the Ray pods the policy trusts fully
    with pytest.raises(UserError, match="submitter_image"):
        cluster_spec_from_dict({"job": {"submission_mode": "K8sJobMode"}})
    with pytest.raises(UserError, match="submitter_image"):
        cluster_spec_from_dict({"job": {"submitter_image": "rayproject/ray:2.54.0"}})


def test_run_directories_go_to_the_shared_volume():
    entry = rayjob(ClusterSpec())["spec"]["entrypoint"]
    assert " logger.log_dir=/lustre/rlscale-runs/rlscale-grpo " in entry
    spec = cluster_spec_from_dict({"job": {"overrides": ["logger.log_dir=/lustre/mine",
                                                         "checkpointing.checkpoint_dir=/lustre/mine/ck"]}})
    entry = rayjob(spec)["spec"]["entrypoint"]
    assert entry.count("logger.log_dir=") == 1 and "logger.log_dir=/lustre/mine" in entry
    with pytest.raises(UserError, match="'job.overrides'.*run directory.*shared volume"):
        cluster_spec_from_dict({"job": {"overrides": ["logger.log_dir=/tmp/run", "checkpointing.checkpoint_dir=/lustre/ck"]}})


def test_without_an_image_the_rayjob_installs_rlscale_from_a_wheel_and_render_says_so(tmp_path, capsys):
    spec = ClusterSpec()
    assert spec.pod_image == SEED_IMAGE
    runtime_env = yaml.safe_load(rayjob(spec)["spec"]["runtimeEnvYAML"])
    (wheel,) = runtime_env["pip"]
    assert wheel.startswith("/lustre/wheels/rlscale-") and wheel.endswith("-py3-none-any.whl")
    render_command(None, tmp_path / "a")
    err = capsys.readouterr().err
    assert "note: no image of your own" in err and wheel in err and "pip wheel --no-deps -w /lustre/wheels ." in err
    assert f"--pip {wheel}" in (tmp_path / "a" / "NOTES.md").read_text()  # for `rlscale job submit` too
    config = tmp_path / "c.yaml"
    config.write_text("image: registry.example/rlscale:0.1.0\n")
    render_command(config, tmp_path / "b")
    assert "note:" not in capsys.readouterr().err
    doc = yaml.safe_load((tmp_path / "b" / "job" / "rayjob.yaml").read_text())
    assert "pip" not in yaml.safe_load(doc["spec"]["runtimeEnvYAML"])
    assert {c["image"] for c in _containers(doc)} == {"registry.example/rlscale:0.1.0"}
    assert "--pip" not in (tmp_path / "b" / "NOTES.md").read_text()


# ------------------------------------------------------------------ the token and the other secrets


@pytest.mark.parametrize("tree,key", [
    ({"env": {"RAY_AUTH_MODE": "disabled"}}, "'env'"),  # would switch the token off behind the manifests' back
    ({"gpudirect": {"nccl_env": {"RAY_AUTH_MODE": "disabled"}}}, "'env'"),
    ({"secret": {"optional_keys": ["RAY_AUTH_TOKEN"]}}, "'secret'"),
    ({"env": {"RLSCALE_STOP_REQUESTS": "/tmp/x"}}, "'env'"),
])
def test_what_the_render_sets_itself_cannot_be_overridden(tree, key):
    with pytest.raises(UserError) as refused:
        cluster_spec_from_dict(tree)
    assert key in str(refused.value) and "\n" not in str(refused.value)


def test_the_token_value_set_here_is_refused_in_the_cluster_config(monkeypatch):
    token = "raytoken-SENTINEL-0b5e55ed"
    monkeypatch.setenv("RAY_JOB_AUTH_TOKEN", token)
    for tree in ({"env": {"LOG_TARGET": token}}, {"job": {"overrides": [f"policy.model_name={token}"]}},
                 {"job": {"pip": [f"/lustre/wheels/{token}.whl"]}}):
        with pytest.raises(UserError) as refused:
            cluster_spec_from_dict(tree)
        assert "RAY_JOB_AUTH_TOKEN" in str(refused.value) and token not in str(refused.value)
    with pytest.raises(UserError, match="RAY_AUTH_TOKEN"):
        cluster_spec_from_dict({"env": {"RAY_AUTH_TOKEN": "x"}})  # a secret's name, refused whatever its value


def test_notes_say_how_to_get_the_token_and_which_kuberay_is_needed():
    notes = render(ClusterSpec())["NOTES.md"]
    assert "KubeRay\n1.6.0 or later" in notes or "KubeRay 1.6.0 or later" in notes.replace("\n", " ")
    assert "kubectl apply -f cluster/" in notes and "kubectl apply -f job/" in notes
    assert "RAY_JOB_AUTH_TOKEN" in notes and "base64 -d" in notes
    assert "Dataplane V2" in notes
    assert "/lustre/rlscale-runs/rlscale-grpo" in notes
