"""`rlscale job` against a real local Ray head with its dashboard (no mocks).

The head runs with token authentication on (RAY_AUTH_MODE=token, its own random token), as recent
Ray versions do by default, so the tests also cover the Authorization header. It is started with
`ray start --head --block` in its own session and stopped by signalling that process (and, if
anything is left, its process group): never `ray stop`, which would stop every Ray on the machine.
"""

from __future__ import annotations

import ast
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.job_submission")
requests = pytest.importorskip("requests")

from rlscale.cluster.jobs import TOKEN_ENV, build_submission  # noqa: E402
from rlscale.errors import UserError  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
HF_SENTINEL = "sentinel-hf-token-5d1e0c7a"
WANDB_SENTINEL = "sentinel-wandb-key-93b2f4e6"
# `rlscale job ...` the way the lead wires it (app.add_typer(job_app, name="job")), run through
# rlscale.cli.main so that errors are printed as the user sees them.
CLI = ("from rlscale.cli import app, main\n"
       "from rlscale.cluster.jobs import job_app\n"
       "if not any(g.name == 'job' for g in app.registered_groups):\n"
       "    app.add_typer(job_app, name='job')\n"
       "main()\n")
TINY_CONFIG = """\
policy:
  model_name: model
  device: cpu
  train_global_batch_size: 4
grpo:
  max_num_steps: 2
  num_prompts_per_step: 2
  num_generations_per_prompt: 2
  max_val_samples: 4
data:
  arithmetic:
    num_val_problems: 4
logger:
  progress: false
  log_dir: runs/job
checkpointing:
  enabled: false
rewards:
  num_workers: 1
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


@pytest.fixture(scope="module")
def ray_head():
    """(dashboard URL, auth token) of a fresh local Ray head; skipped if it cannot start here."""
    ray_bin = Path(sys.executable).parent / "ray"
    if not ray_bin.exists():
        ray_bin = shutil.which("ray")
        if ray_bin is None:
            pytest.skip("no `ray` command next to this Python or on PATH")
    token = secrets.token_hex(24)
    temp_dir = tempfile.mkdtemp(prefix="rlsray", dir="/tmp")  # short: Ray's unix sockets live there
    ports = {name: _free_port() for name in ("port", "dashboard-port", "node-manager-port", "object-manager-port",
                                             "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                             "runtime-env-agent-port", "metrics-export-port",
                                             "ray-client-server-port")}
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "HF_TOKEN", "WANDB_API_KEY", "RAY_AUTH_TOKEN_PATH")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    command = [str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
               "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=2", "--num-gpus=0",
               "--object-store-memory=200000000", "--disable-usage-stats", f"--temp-dir={temp_dir}",
               *(f"--{name}={port}" for name, port in ports.items())]
    log_path = Path(temp_dir) / "ray-start.log"
    log = open(log_path, "w")
    head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{ports['dashboard-port']}"

    def teardown():
        if head.poll() is None:
            head.send_signal(signal.SIGTERM)  # `ray start --block` shuts its node down on SIGTERM
            try:
                head.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for pid in _session_pids(head.pid):  # whatever outlived it, in the session we created
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if head.poll() is None:
            head.kill()
            head.wait(10)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)

    deadline, ready = time.monotonic() + 90, False
    while time.monotonic() < deadline and head.poll() is None:
        try:
            ready = requests.get(f"{url}/api/jobs/", headers={"Authorization": f"Bearer {token}"},
                                 timeout=2).status_code == 200
        except requests.RequestException:
            pass
        if ready:
            break
        time.sleep(0.5)
    if not ready:
        tail = log_path.read_text(errors="replace")[-1500:]
        teardown()
        pytest.skip(f"the Ray head with its dashboard did not start here: {tail}")
    yield url, token
    teardown()


def rlscale_job(*args: str, token: str | None = None, cwd: Path | None = None, timeout: float = 240,
                **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", TOKEN_ENV, "RAY_AUTH_MODE")}
    env.update(HF_TOKEN=HF_SENTINEL, WANDB_API_KEY=WANDB_SENTINEL, RAY_AUTH_MODE="disabled", **env_extra)
    if token:
        env[TOKEN_ENV] = token
    return subprocess.run([sys.executable, "-c", CLI, "job", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("rlscale: error:")]
    assert len(errors) == 1, result.stderr
    for word in words:
        assert word in errors[0], errors[0]


def no_sentinel(text: str) -> bool:
    return HF_SENTINEL not in text and WANDB_SENTINEL not in text


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    """A working directory: tiny model, config, and things that must not be uploaded."""
    from rlscale.models.tiny import build_char_tokenizer, build_tiny_model

    root = tmp_path_factory.mktemp("job-wd")
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, hidden_size=32, layers=2, heads=2).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "cfg.yaml").write_text(TINY_CONFIG)
    for folder in ("runs/old", ".venv/lib", ".git/objects", "scratch"):
        (root / folder).mkdir(parents=True)
        (root / folder / "big.bin").write_bytes(b"\0" * 1024)
    (root / ".env").write_text(f"HF_TOKEN={HF_SENTINEL}\n")
    (root / ".rayignore").write_text("scratch\n")
    return root


def _client(url: str, token: str):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(url, headers={"Authorization": f"Bearer {token}"})


def test_submit_follows_a_tiny_training_job_to_succeeded_and_leaks_no_secret(ray_head, work_dir, tmp_path):
    url, token = ray_head
    hf_home = str(tmp_path / "hf-home")
    result = rlscale_job("submit", "--address", url, "--config", "cfg.yaml", "--launcher", "python -m rlscale.cli",
                         "--hf-home", hf_home, "--socket-ifname", "", "--env", f"PYTHONPATH={REPO_ROOT}",
                         "grpo.seed=7", "policy.generation.max_new_tokens=16", "--follow",
                         token=token, cwd=work_dir, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    job_id = next(line.split(": ", 1)[1] for line in result.stdout.splitlines() if line.startswith("submission id:"))
    assert f"rlscale job logs {job_id} --follow" in result.stdout
    assert "Kubernetes Secret" in result.stdout and f"job {job_id} SUCCEEDED" in result.stdout
    assert '"final_step": 2' in result.stdout  # the summary, streamed back
    assert no_sentinel(out)

    info = _client(url, token).get_job_info(job_id)
    assert str(info.status) == "SUCCEEDED"
    assert info.entrypoint == "python -m rlscale.cli train --config cfg.yaml grpo.seed=7 policy.generation.max_new_tokens=16"
    env_vars = info.runtime_env["env_vars"]
    assert env_vars["HF_HOME"] == hf_home and "GLOO_SOCKET_IFNAME" not in env_vars
    assert not {"HF_TOKEN", "WANDB_API_KEY"} & set(env_vars)
    for name in ("/runs", ".venv", ".git", ".env"):
        assert name in info.runtime_env["excludes"]
    exposed = json.dumps({"runtime_env": info.runtime_env, "entrypoint": info.entrypoint,
                          "metadata": info.metadata, "message": info.message})
    assert no_sentinel(exposed)
    logs = _client(url, token).get_job_logs(job_id)
    assert '"final_step": 2' in logs and no_sentinel(logs)

    status = rlscale_job("status", job_id, "--address", url, token=token)
    assert status.returncode == 0 and "SUCCEEDED" in status.stdout and no_sentinel(status.stdout)
    listing = rlscale_job("list", "--address", url, token=token)
    assert listing.returncode == 0 and job_id in listing.stdout and no_sentinel(listing.stdout + listing.stderr)
    logs_cmd = rlscale_job("logs", job_id, "--address", url, token=token)
    assert logs_cmd.returncode == 0 and '"final_step": 2' in logs_cmd.stdout and no_sentinel(logs_cmd.stdout)


def test_the_upload_honours_rayignore_and_leaves_big_and_private_folders_out(ray_head, work_dir):
    url, token = ray_head
    submission = build_submission(work_dir, work_dir / "cfg.yaml", [], {}, "", "")
    # Every path in the unpacked upload. (Ray reuses an upload of the same content, so an earlier
    # job's outputs may sit next to it: runs/job is that, runs/old would be the upload's.)
    submission["entrypoint"] = ("python -c \"import os; print('FILES', sorted(os.path.relpath(os.path.join(d, f)) "
                                "for d, _, fs in os.walk('.') for f in fs))\"")
    client = _client(url, token)
    job_id = client.submit_job(**submission)
    deadline = time.monotonic() + 60
    while not client.get_job_status(job_id).is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
    logs = client.get_job_logs(job_id)
    line = next(line for line in logs.splitlines() if line.startswith("FILES"))
    files = ast.literal_eval(line[len("FILES "):])
    assert {"cfg.yaml", "model/config.json", ".rayignore"} <= set(files), files
    leaked = [f for f in files if f.split("/")[0] in {".venv", ".git", ".env", "scratch"} or f.startswith("runs/old")]
    assert not leaked, files


def test_stop_and_no_wait(ray_head, work_dir):
    url, token = ray_head
    result = rlscale_job("submit", "--address", url, "--config", "cfg.yaml", "--launcher", "python -m rlscale.cli",
                         "--hf-home", "", "--socket-ifname", "", "--no-wait", "grpo.max_num_steps=100000",
                         token=token, cwd=work_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    job_id = next(line.split(": ", 1)[1] for line in result.stdout.splitlines() if line.startswith("submission id:"))
    stopped = rlscale_job("stop", job_id, "--address", url, token=token)
    assert stopped.returncode == 0, stopped.stderr
    client = _client(url, token)
    deadline = time.monotonic() + 60
    while not client.get_job_status(job_id).is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert str(client.get_job_status(job_id)) == "STOPPED"


def test_secrets_unknown_jobs_and_bad_addresses_are_one_line_errors(ray_head, work_dir):
    url, token = ray_head
    before = len(_client(url, token).list_jobs())
    base = ("submit", "--address", url, "--config", "cfg.yaml", "--no-wait")
    for extra, words in (
        (["policy.hf_token=abc12345678"], ("refusing the override", "names a secret")),
        ([f"policy.model_name={HF_SENTINEL}"], ("refusing the override", "HF_TOKEN")),
        (["--env", "HF_TOKEN=whatever-value"], ("refusing --env HF_TOKEN",)),
        (["--env", f"SOMETHING={WANDB_SENTINEL}"], ("WANDB_API_KEY",)),
        (["--launcher", "env WANDB_API_KEY=abcdefgh12 rlscale"], ("refusing --launcher",)),
    ):
        result = rlscale_job(*base, *extra, token=token, cwd=work_dir)
        assert_one_line_error(result, *words)
        assert no_sentinel(result.stdout + result.stderr)
    assert len(_client(url, token).list_jobs()) == before  # nothing was submitted

    for command in (["status", "raysubmit_doesnotexist"], ["logs", "raysubmit_doesnotexist", "--follow"],
                    ["stop", "raysubmit_doesnotexist"]):
        assert_one_line_error(rlscale_job(*command, "--address", url, token=token), "no job 'raysubmit_doesnotexist'")
    assert_one_line_error(rlscale_job("list", "--address", f"http://127.0.0.1:{_free_port()}", token=token),
                          "cannot reach")
    assert_one_line_error(rlscale_job("list", "--address", url), "requires an auth token")
    assert_one_line_error(rlscale_job("list", "--address", url, token="wrong-token"), "rejected the auth token")


def test_the_config_must_travel_with_the_upload(tmp_path):
    (tmp_path / "wd").mkdir()
    (tmp_path / "outside.yaml").write_text("grpo:\n  max_num_steps: 2\n")
    with pytest.raises(UserError, match="outside the working directory"):
        build_submission(tmp_path / "wd", tmp_path / "outside.yaml", [], {}, "", "")
    (tmp_path / "wd" / "conf").mkdir()
    (tmp_path / "wd" / "conf" / "my run.yaml").write_text("grpo:\n  max_num_steps: 2\n")
    submission = build_submission(tmp_path / "wd", tmp_path / "wd" / "conf" / "my run.yaml",
                                  ["data.prompt_template=Q: {problem}"], {}, "/lustre/hf", "eth0")
    assert submission["entrypoint"] == "rlscale train --config 'conf/my run.yaml' 'data.prompt_template=Q: {problem}'"
    assert submission["runtime_env"]["env_vars"] == {
        "HF_HOME": "/lustre/hf", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    (tmp_path / "wd" / ".rayignore").write_text("conf/\n")
    with pytest.raises(UserError, match=r"\.rayignore excludes it"):
        build_submission(tmp_path / "wd", tmp_path / "wd" / "conf" / "my run.yaml", [], {}, "", "")
    with pytest.raises(UserError, match="unknown config key"):
        build_submission(tmp_path / "wd", None, ["grpo.no_such_key=1"], {}, "", "")
