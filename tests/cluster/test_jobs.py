"""`rlscale job` against a real local Ray head with its dashboard (no mocks).

The head runs with token authentication on (RAY_AUTH_MODE=token, its own random token), as recent
Ray versions do by default, so the tests also cover the Authorization header. It is started with
`ray start --head --block` in its own session and stopped by signalling that process (and, if
anything is left, its process group): never `ray stop`, which would stop every Ray on the machine.
"""

from __future__ import annotations

import ast
import http.server
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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


class LocalRayHead:
    """A local Ray head with its dashboard, in its own session and temp dir, on ports picked here.

    Ready means a trivial job ran to SUCCEEDED: the dashboard answering is not enough, its job
    agent may still be starting (a submission then gets "No available agent"). `ray start --block`
    takes the whole node down when one of its processes dies, so `url()` starts a fresh head if
    the last one has gone, and a head that never gets ready is retried on new ports."""

    ATTEMPTS = 3

    def __init__(self, ray_bin: str, token: str):
        self.ray_bin, self.token = ray_bin, token
        self.process: subprocess.Popen | None = None
        self.address = ""
        self.temp_dir = ""
        self.failures: list[str] = []
        self.skip_reason: str | None = None

    def url(self) -> str:
        if self.skip_reason is not None:  # tried and failed once: the module's other tests skip at once
            pytest.skip(self.skip_reason)
        if self.process is not None and self.process.poll() is None:
            return self.address
        if self.process is not None:
            self.failures.append(f"the head exited ({self.process.returncode}): {self._log_tail()}")
            self.stop()
        for _ in range(self.ATTEMPTS):
            self._start()
            if self._ready(deadline=time.monotonic() + 120):
                return self.address
            self.failures.append(self._log_tail())
            self.stop()
        self.skip_reason = "the Ray head with its dashboard did not start here: " + " | ".join(self.failures)[-3000:]
        pytest.skip(self.skip_reason)

    def _start(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rlsray", dir="/tmp")  # short: Ray's unix sockets live there
        ports = {name: _free_port() for name in ("port", "dashboard-port", "node-manager-port", "object-manager-port",
                                                 "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                 "runtime-env-agent-port", "metrics-export-port",
                                                 "ray-client-server-port")}
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_ADDRESS", "HF_TOKEN", "WANDB_API_KEY", "RAY_AUTH_TOKEN_PATH")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, RAY_USAGE_STATS_ENABLED="0",
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
        command = [self.ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                   "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=2", "--num-gpus=0",
                   "--object-store-memory=200000000", "--disable-usage-stats", f"--temp-dir={self.temp_dir}",
                   *(f"--{name}={port}" for name, port in ports.items())]
        with open(Path(self.temp_dir) / "ray-start.log", "w") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.address = f"http://127.0.0.1:{ports['dashboard-port']}"

    def _ready(self, deadline: float) -> bool:
        headers = {"Authorization": f"Bearer {self.token}"}
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if requests.get(f"{self.address}/api/jobs/", headers=headers, timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        else:
            return False
        job_id = None
        while time.monotonic() < deadline and self.process.poll() is None:
            try:  # a dashboard that dies meanwhile is "not ready" (and the head is started again)
                client = _client(self.address, self.token)
                job_id = job_id or client.submit_job(entrypoint="python -c pass")
                status = client.get_job_status(job_id)
            except (RuntimeError, ConnectionError, requests.RequestException) as exc:
                self.failures.append(f"probe job: {str(exc)[:200]}")
                time.sleep(1)
                continue
            if status.is_terminal():
                return str(status) == "SUCCEEDED"
            time.sleep(0.5)
        return False

    def _log_tail(self) -> str:
        """The last lines of `ray start` and of the dashboard and its agent, for the skip message."""
        tails = []
        for path in [Path(self.temp_dir) / "ray-start.log",
                     *Path(self.temp_dir).glob("session_latest/logs/dashboard*.log")]:
            try:
                tails.append(f"{path.name}: " + " / ".join(path.read_text(errors="replace").splitlines()[-4:]))
            except OSError:
                pass
        return "; ".join(tails)[-1500:]

    def stop(self) -> None:
        head, self.process = self.process, None
        if head is None:
            return
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
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def local_ray_head():
    ray_bin = Path(sys.executable).parent / "ray"
    if not ray_bin.exists():
        ray_bin = shutil.which("ray")
        if ray_bin is None:
            pytest.skip("no `ray` command next to this Python or on PATH")
    head = LocalRayHead(str(ray_bin), secrets.token_hex(24))
    yield head
    head.stop()


@pytest.fixture
def ray_head(local_ray_head):
    """(dashboard URL, auth token) of a live local Ray head, shared by this module's tests."""
    return local_ray_head.url(), local_ray_head.token


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
    assert "Kubernetes Secret" in result.stderr and f"job {job_id} SUCCEEDED" in result.stdout
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
    port = _free_port()
    assert_one_line_error(rlscale_job("list", "--address", f"http://127.0.0.1:{port}", token=token),
                          "cannot reach", f"its port {port} forwarded")
    taken = _client(url, token).list_jobs()[0].submission_id
    assert_one_line_error(rlscale_job(*base, "--submission-id", taken, token=token, cwd=work_dir),
                          f"--submission-id {taken}: a job with that id already exists")
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
        "HF_HOME": "/lustre/hf", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
        "RAY_JOB_STOP_WAIT_TIME_S": "30"}  # Ray's SIGKILL waits for the default 15 s grace + 15
    (tmp_path / "wd" / ".rayignore").write_text("conf/\n")
    with pytest.raises(UserError, match=r"\.rayignore excludes it"):
        build_submission(tmp_path / "wd", tmp_path / "wd" / "conf" / "my run.yaml", [], {}, "", "")
    with pytest.raises(UserError, match="unknown config key"):
        build_submission(tmp_path / "wd", None, ["grpo.no_such_key=1"], {}, "", "")
    with pytest.raises(UserError, match=r"--launcher \"'x\" is not a valid shell command: No closing quotation"):
        build_submission(tmp_path / "wd", None, [], {}, "", "", launcher="'x")
    with pytest.raises(UserError, match="--launcher is empty"):
        build_submission(tmp_path / "wd", None, [], {}, "", "", launcher=" ")


class _StartingDashboard(http.server.BaseHTTPRequestHandler):
    """The two answers of a Ray dashboard whose job agent is not up yet, then up: 500 "No
    available agent" for the first `busy` submissions, then the job. `lost_reply` plays an
    attempt that reached the agent but whose answer was lost: it registers the job, answers 500."""

    busy, lost_reply = 2, False
    jobs: dict = {}
    posts = 0

    def _send(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.path == "/api/version":
            self._send(200, json.dumps({"version": "0", "ray_version": "2.60.0", "ray_commit": "x",
                                        "session_name": "s"}))
        elif self.path.startswith("/api/jobs/") and self.path.rstrip("/").rsplit("/", 1)[-1] in self.jobs:
            self._send(200, json.dumps(self.jobs[self.path.rstrip("/").rsplit("/", 1)[-1]]))
        else:
            self._send(404, "no such job")

    def do_POST(self):  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        cls.posts += 1
        sid = request["submission_id"]
        if sid in cls.jobs:
            self._send(400, f"Traceback (most recent call last):\n  ...\nValueError: Job with submission_id {sid} "
                            "already exists. Please use a different submission_id.")
        elif cls.posts <= cls.busy:
            if cls.lost_reply:
                cls.jobs[sid] = {"status": "PENDING", "entrypoint": request["entrypoint"], "submission_id": sid,
                                 "type": "SUBMISSION"}
            self._send(500, "No available agent to submit job, please try again later.")
        else:
            cls.jobs[sid] = {"status": "PENDING", "entrypoint": request["entrypoint"], "submission_id": sid,
                             "type": "SUBMISSION"}
            self._send(200, json.dumps({"job_id": sid, "submission_id": sid}))

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("lost_reply", [False, True])
def test_submit_waits_for_the_job_agent_and_never_submits_twice(lost_reply, capsys):
    from ray.job_submission import JobSubmissionClient

    from rlscale.cluster.jobs import submit_when_ready

    handler = type("Handler", (_StartingDashboard,), {"jobs": {}, "posts": 0, "lost_reply": lost_reply})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        client = JobSubmissionClient(url)
        job_id = submit_when_ready(client, url, None, {"entrypoint": "echo hi"}, pause_s=0.05)
        assert job_id.startswith("raysubmit_") and list(handler.jobs) == [job_id]
        # busy twice, then the job (200); or, the first answer lost, "already exists" at the retry
        assert handler.posts == (2 if lost_reply else 3) and "no job agent yet" in capsys.readouterr().err
        # out of patience: Ray's answer as the one-line error
        handler.busy, handler.posts, handler.lost_reply = 10**6, 0, False
        with pytest.raises(UserError, match="No available agent"):
            submit_when_ready(client, url, "raysubmit_late", {"entrypoint": "echo hi"}, retry_s=0.2, pause_s=0.05)
        assert 2 <= handler.posts <= 6
    finally:
        server.shutdown()
        server.server_close()


def test_ray_tracebacks_become_their_last_line():
    """What Ray's client raises for a server-side traceback (its own formatting, which appends
    "." to a body ending in a newline) reads as status + the exception's line."""
    import traceback
    from types import SimpleNamespace

    from ray.dashboard.modules.dashboard_sdk import SubmissionClient

    from rlscale.cluster.jobs import _first_line

    try:
        raise ValueError("Job with submission_id x already exists. Please use a different submission_id.")
    except ValueError:
        body = traceback.format_exc()
    with pytest.raises(RuntimeError) as raised:
        SubmissionClient._raise_error(None, SimpleNamespace(status_code=400, text=body))
    assert body.endswith("\n") and str(raised.value).endswith("\n.")
    assert _first_line(raised.value) == ("Request failed with status code 400: ValueError: Job with submission_id x "
                                         "already exists. Please use a different submission_id.")
    assert _first_line(RuntimeError("Request failed with status code 500: .")) == \
        "Request failed with status code 500: ."


def test_pip_packages_travel_in_the_runtime_env_and_never_a_secret(tmp_path, monkeypatch):
    (tmp_path / "wd").mkdir()
    wheel = "/lustre/wheels/rlscale-0.1.0-py3-none-any.whl"
    submission = build_submission(tmp_path / "wd", None, [], {}, "", "", pip=[wheel, "math-verify>=0.7"])
    assert submission["runtime_env"]["pip"] == [wheel, "math-verify>=0.7"]
    assert "pip" not in build_submission(tmp_path / "wd", None, [], {}, "", "")["runtime_env"]
    monkeypatch.setenv("HF_TOKEN", HF_SENTINEL)
    for entry, reason in ((f"git+https://{HF_SENTINEL}@example.com/x.git", "this environment's HF_TOKEN"),
                          ("git+https://user:hf_" + "a1B2" * 6 + "@huggingface.co/o/p.git", "Hugging Face token"),
                          ("https://ci:s3cret-pass@pypi.example.com/simple/pkg.whl", "its URL carries a password")):
        with pytest.raises(UserError, match=f"refusing --pip entry 2: .*{reason}") as refused:
            build_submission(tmp_path / "wd", None, [], {}, "", "", pip=[wheel, entry])
        assert "s3cret" not in str(refused.value) and HF_SENTINEL not in str(refused.value)
    for entry, what in (("", "empty"), ("  ", "empty"), ("--index-url=https://x", "an option")):
        with pytest.raises(UserError, match=f"--pip entry 2 is {what}"):
            build_submission(tmp_path / "wd", None, [], {}, "", "", pip=[wheel, entry])


def test_the_ray_auth_token_set_here_is_refused_in_a_request_and_redacted(tmp_path, monkeypatch):
    """The token of a rendered cluster (RAY_JOB_AUTH_TOKEN / RAY_AUTH_TOKEN here) follows the rules
    of HF_TOKEN and WANDB_API_KEY: never in an override, --env or --pip, redacted from output."""
    from rlscale.cluster.jobs import _redact

    token = "raytoken-SENTINEL-77aa0c"
    for name in ("RAY_AUTH_TOKEN", "RAY_JOB_AUTH_TOKEN"):
        monkeypatch.setenv(name, token)
        for overrides, env, pip in ((["policy.model_name=" + token], {}, None), ([], {"MY_VAR": f"x{token}"}, None),
                                    ([], {}, [f"/lustre/{token}.whl"])):
            with pytest.raises(UserError) as refused:
                build_submission(tmp_path, None, overrides, env, "", "", pip=pip)
            assert name in str(refused.value) and token not in str(refused.value)
        assert token not in _redact(f"the token {token} in a log line")
        monkeypatch.delenv(name)
    assert build_submission(tmp_path, None, ["policy.model_name=" + token], {}, "", "")["entrypoint"]


def test_submit_notes_a_run_directory_off_the_shared_volume():
    from rlscale.cluster.jobs import _placement_notes

    notes = _placement_notes(None, [])
    assert any("logger.log_dir='runs/default'" in n and "/lustre/rlscale-runs/" in n for n in notes)
    assert any("checkpoints go to 'runs/default/checkpoints'" in n for n in notes)
    # a run directory on the volume takes the default checkpoint directory with it
    assert _placement_notes(None, ["logger.log_dir=/lustre/rlscale-runs/r1"]) == []
