"""`rlscale job`: run `rlscale train` on a Ray cluster through the Ray Jobs API.

It imports Ray for the Jobs API's client (and Ray's upload rules and errors); it starts no Ray here.

The seed submits with `ray job submit --working-dir . --runtime-env ray_runtime_env.json -- bash
run.sh`, its tokens written in plain text into that JSON file. Here:

- the working directory is uploaded as the job's `working_dir`. Ray itself honours `.rayignore`
  and `.gitignore` files (in every directory of the upload, gitignore syntax) and its own
  default excludes (.git, .venv, venv, __pycache__); on top, rlscale always excludes the big or
  private folders a run leaves behind (`DEFAULT_EXCLUDES`: runs/, .venv/, .git/, .env, ...), so a
  changed Ray default or `RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES` does not ship them;
- the runtime env carries HF_HOME on the shared volume and the socket interface names, nothing
  else unless asked (`--env`);
- HF_TOKEN and WANDB_API_KEY never travel with the job: not in the runtime env, the entrypoint,
  the metadata or the upload's config. On a cluster they come from a Kubernetes Secret mounted as
  environment variables on the Ray pods. `submit` refuses an override or `--env` that carries
  one, and checks the whole request for the values of the secrets set where it runs;
- the Ray dashboard may require a token (Ray >= 2.52 has token authentication; recent releases
  enable it by default on local clusters; `rlscale cluster render` turns it on). `--token` or
  RAY_JOB_AUTH_TOKEN is sent as an `Authorization: Bearer` header, never printed or stored;
  without one, Ray's own client adds its token when RAY_AUTH_MODE=token here (RAY_AUTH_TOKEN,
  RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token). For a rendered cluster the token is in the Secret
  the manifests name (`<name>-ray-token`, key auth_token):
  `export RAY_JOB_AUTH_TOKEN="$(kubectl get secret rlscale-ray-token -o jsonpath='{.data.auth_token}' | base64 -d)"`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import re
import shlex
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

import typer

from rlscale.errors import UserError

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
DEFAULT_HF_HOME = "/lustre/huggingface_cache"
DEFAULT_SOCKET_IFNAME = "eth0"
TOKEN_ENV = "RAY_JOB_AUTH_TOKEN"
# Secrets a run may need; they reach the pods from a Kubernetes Secret, never from here.
SECRET_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")
# ... and the Ray auth token, as this client (RAY_JOB_AUTH_TOKEN) and Ray's own (RAY_AUTH_TOKEN) read
# it: its value set here is refused in a request and redacted from output like theirs.
RAY_TOKEN_ENV_VARS = ("RAY_AUTH_TOKEN", "RAY_JOB_AUTH_TOKEN")
REDACTED_ENV_VARS = SECRET_ENV_VARS + RAY_TOKEN_ENV_VARS
# gitwildmatch patterns relative to the working directory, as Ray's `excludes`. No trailing
# slashes: Ray matches a directory's own path without one, so `runs/` would still walk the tree.
DEFAULT_EXCLUDES = [
    ".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache",
    "*.egg-info", "/runs", "/wandb", ".env", ".env.*",
]
_SECRET_NAME = re.compile(
    r"(^|[._-])(token|secret|password|passwd|credentials?|api[_-]?key|access[_-]?key|private[_-]?key)($|[._-])",
    re.IGNORECASE)
_HF_TOKEN_VALUE = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
_MIN_SECRET_LEN = 8  # shorter values are not matched in text (too many false hits)
# A head that is up but whose job agent is not (a cluster still starting, an agent restarting)
# answers a submission with this 500; Ray says to try again later, so `submit` does, for a while.
_NO_AGENT = "No available agent to submit job"
SUBMIT_RETRY_S = 120.0

job_app = typer.Typer(no_args_is_help=True, help="Run training on a Ray cluster (the Ray Jobs API).")

ADDRESS_OPTION = typer.Option(
    None, "--address", help=f"Ray dashboard, http://HOST:8265 (default: RAY_ADDRESS, else {DEFAULT_ADDRESS})")
TOKEN_OPTION = typer.Option(
    None, "--token", show_default=False,
    help=f"dashboard auth token, sent as a Bearer header (better: set {TOKEN_ENV}, kept out of `ps`; a rendered "
    "cluster's is in its Secret <name>-ray-token, key auth_token: see NOTES.md)")


# ---------------------------------------------------------------- address, auth, errors


def resolve_address(address: str | None) -> str:
    """--address, else RAY_ADDRESS, else the local dashboard; always an http(s) URL."""
    source = "--address"
    if not address:
        address, source = os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS, "RAY_ADDRESS"
    address = address.strip().rstrip("/")
    if "://" not in address:
        address = "http://" + address
    if not address.startswith(("http://", "https://")):
        raise UserError(f"{source} {address!r}: the jobs API needs the Ray dashboard's http address, "
                        "e.g. http://127.0.0.1:8265")
    return address


def _token(token: str | None) -> str | None:
    return token or os.environ.get(TOKEN_ENV) or None


def _redacted_extra(token: str | None) -> tuple[str, ...]:
    """Values to redact from output besides the environment's secrets: the auth token, if any."""
    return (_token(token),) if _token(token) else ()


def _follow_to_end(client, job_id: str, extra: tuple[str, ...]) -> None:
    """Stream the logs until the job ends, then exit with its outcome."""
    _finish(client, job_id, follow_logs(client, job_id, extra))


def _auth_headers(token: str | None) -> dict | None:
    return {"Authorization": f"Bearer {token}"} if token else None


def _first_line(exc: BaseException) -> str:
    """The line that says what went wrong; for a server-side traceback that Ray passes on
    ("Request failed with status code 400: Traceback ..."), its status and final line."""
    # (Ray's client appends "." to the server's text, which ends in a newline: a line of its own)
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip(" .")]
    if not lines:
        return type(exc).__name__
    if len(lines) > 1 and lines[0].endswith("Traceback (most recent call last):"):
        return f"{lines[0].split(' Traceback')[0]} {lines[-1]}"
    return lines[0]


@contextmanager
def _ray_errors(address: str, job_id: str | None = None):
    """Ray's exceptions as one-line UserErrors (unreachable, auth, unknown job, refused request)."""
    import requests
    from ray.exceptions import AuthenticationError, RayError

    try:
        yield
    except (UserError, SystemExit, typer.Exit, typer.Abort):  # typer.Exit is a RuntimeError
        raise
    except AuthenticationError as exc:
        if "Authentication required" in str(exc):
            raise UserError(f"the Ray cluster at {address} requires an auth token: set {TOKEN_ENV} (or "
                            "--token); a cluster from `rlscale cluster render` keeps it in its Secret: "
                            f"export {TOKEN_ENV}=\"$(kubectl get secret <name>-ray-token -o "
                            "jsonpath='{.data.auth_token}' | base64 -d)\"; `ray get-auth-token` prints a local "
                            "cluster's") from None
        raise UserError(f"the Ray cluster at {address} rejected the auth token ({TOKEN_ENV} / --token)") from None
    except (ConnectionError, requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
        parts = urlsplit(address)
        port = parts.port or (443 if parts.scheme == "https" else 80)  # what the client dialled
        raise UserError(f"cannot reach the Ray dashboard at {address} ({_first_line(exc).rstrip('.')}); is the cluster "
                        f"up and its port {port} forwarded?") from None
    except requests.exceptions.RequestException as exc:
        raise UserError(f"request to {address} failed: {_first_line(exc)}") from None
    except (RuntimeError, ValueError, RayError) as exc:
        text = _first_line(exc)
        if job_id is not None and "status code 404" in text:
            raise UserError(f"no job {job_id!r} on the Ray cluster at {address}") from None
        raise UserError(f"Ray: {_redact(text)}") from None
    except Exception as exc:  # aiohttp and the like, from the log stream
        if type(exc).__module__.split(".")[0] in {"aiohttp", "requests", "urllib3"}:
            raise UserError(f"connection to {address} failed: {_first_line(exc)}") from None
        raise


def job_client(address: str | None = None, token: str | None = None):
    """A JobSubmissionClient for the dashboard at `address` (checked reachable)."""
    from ray.job_submission import JobSubmissionClient

    url = resolve_address(address)
    with _ray_errors(url):
        return url, JobSubmissionClient(url, headers=_auth_headers(_token(token)))


# ---------------------------------------------------------------- secrets


def _local_secret_values(extra: tuple[str, ...] = ()) -> list[str]:
    values = [os.environ.get(name, "") for name in REDACTED_ENV_VARS] + list(extra)
    return [v for v in values if v and len(v) >= _MIN_SECRET_LEN]


def _redact(text: str, extra: tuple[str, ...] = ()) -> str:
    for value in _local_secret_values(extra):
        text = text.replace(value, "***")
    return _HF_TOKEN_VALUE.sub("hf_***", text)


# names that look like secrets by the pattern but hold none (a path to a key file, a switch)
_NOT_SECRET_NAMES = {"GOOGLE_APPLICATION_CREDENTIALS", "HF_HUB_DISABLE_IMPLICIT_TOKEN"}


@functools.lru_cache(maxsize=1)
def config_keys() -> frozenset[str]:
    """Every dotted key of rlscale's config (e.g. loss.token_level_loss: a setting, not a secret)."""
    from rlscale.config import Config, flat_dict

    return frozenset(flat_dict(Config().model_dump(mode="json")))


def secret_name(key: str) -> bool:
    """Whether a variable or key name says it holds a secret (HF_TOKEN, *_API_KEY, ...)."""
    if key in _NOT_SECRET_NAMES or key in config_keys():
        return False
    return key.upper() in SECRET_ENV_VARS or bool(_SECRET_NAME.search(key))


def secret_reason(key: str, value: str, extra: tuple[str, ...] = ()) -> str | None:
    """Why `key=value` looks like a secret, or None."""
    if secret_name(key):
        return f"{key!r} names a secret"
    for name in REDACTED_ENV_VARS:
        secret = os.environ.get(name, "")
        if len(secret) >= _MIN_SECRET_LEN and secret in value:
            return f"the value of {key!r} is this environment's {name}"
    if any(secret in value for secret in extra if len(secret) >= _MIN_SECRET_LEN):
        return f"the value of {key!r} is the dashboard auth token"
    if _HF_TOKEN_VALUE.search(value):
        return f"the value of {key!r} looks like a Hugging Face token"
    return None


def pip_secret_reason(entry: str, extra: tuple[str, ...] = ()) -> str | None:
    """Why a pip requirement looks like it carries a secret (a token, a URL with a password), or None."""
    reason = secret_reason("--pip", entry, extra)
    if reason is None and "://" in entry and urlsplit(entry.split("+", 1)[-1]).password:
        reason = "its URL carries a password"
    return reason


def override_secret_reason(text: str, extra: tuple[str, ...] = ()) -> str | None:
    """Why a `key=value` override looks like a secret, or None."""
    key, _, value = text.partition("=")
    return secret_reason(key.strip().lstrip("+"), value, extra)


def _refuse_secret(what: str, reason: str) -> UserError:
    return UserError(f"{what}: {reason}; secrets never travel with a job (they would be readable through "
                     "the jobs API): on the cluster HF_TOKEN and WANDB_API_KEY come from the Kubernetes Secret "
                     "mounted on the Ray pods")


def job_stop_wait_s(preemption_grace_s: float) -> str:
    """RAY_JOB_STOP_WAIT_TIME_S for a run: Ray's job stop sends SIGTERM to the driver and every
    process it started, then SIGKILL after this many seconds (3 by default); the run's grace to
    finish its step and save, plus 15 s for the commit and exit."""
    return str(math.ceil(preemption_grace_s) + 15)


def check_no_secrets(overrides: list[str], env_pairs: dict[str, str], config_text: str | None,
                     extra: tuple[str, ...] = ()) -> None:
    for text in overrides:
        reason = override_secret_reason(text, extra)
        if reason:
            raise _refuse_secret("refusing the override", reason)
    for key, value in env_pairs.items():
        reason = secret_reason(key, value, extra)
        if reason:
            raise _refuse_secret(f"refusing --env {key}", reason)
    if config_text is not None:
        for value in _local_secret_values(extra):
            if value in config_text:
                raise _refuse_secret("refusing the config file", "it holds the value of a secret set here")
        if _HF_TOKEN_VALUE.search(config_text):
            raise _refuse_secret("refusing the config file", "it holds what looks like a Hugging Face token")


# ---------------------------------------------------------------- the submission


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for text in pairs:
        key, sep, value = text.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise UserError(f"--env {text!r} is not of the form NAME=VALUE")
        env[key] = value
    return env


def _excluded_by(working_dir: Path, rel: str, excludes: list[str]) -> str | None:
    """What keeps `rel` (a file under working_dir) out of the upload, mirroring Ray's rules."""
    try:
        from ray._private import ray_constants
        from ray._private.thirdparty.pathspec import PathSpec
    except ImportError:  # Ray moved them: the job then says it cannot read the file
        return None
    parts = rel.split("/")
    spec = PathSpec.from_lines("gitwildmatch", list(ray_constants.get_runtime_env_default_excludes()) + excludes)
    if any(spec.match_file("/".join(parts[:i])) for i in range(1, len(parts) + 1)):
        return "the upload's excludes"
    names = [".rayignore"]
    if os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1":
        names.insert(0, ".gitignore")
    for depth in range(len(parts)):
        base, below = working_dir.joinpath(*parts[:depth]), parts[depth:]
        for name in names:
            ignore = base / name
            if ignore.is_file():
                spec = PathSpec.from_lines("gitwildmatch", ignore.read_text(errors="replace").splitlines())
                if any(spec.match_file("/".join(below[:i])) for i in range(1, len(below) + 1)):
                    return str(ignore.relative_to(working_dir))
    return None


def build_submission(working_dir: Path, config: Path | None, overrides: list[str], env: dict[str, str],
                     hf_home: str, socket_ifname: str, launcher: str = "rlscale",
                     excludes: list[str] | None = None, token: str | None = None,
                     pip: list[str] | None = None) -> dict:
    """The entrypoint, runtime env and metadata of `rlscale job submit` (checked for secrets).
    pip: packages Ray installs for the job (e.g. an rlscale wheel on the shared volume, when the
    image lacks it)."""
    from rlscale.config_loading import load_config

    working_dir = Path(working_dir)
    if not working_dir.is_dir():
        raise UserError(f"--working-dir {str(working_dir)!r} is not a directory")
    working_dir = working_dir.resolve()
    extra = (token,) if token else ()
    config_text, rel = None, None
    if config is not None:
        if not Path(config).is_file():
            raise UserError(f"config file {str(config)!r} does not exist")
        try:
            rel = Path(config).resolve().relative_to(working_dir).as_posix()
        except ValueError:
            raise UserError(f"config file {str(config)!r} is outside the working directory {str(working_dir)!r}: "
                            "it travels with the upload, so put it inside (or pass --working-dir)") from None
        config_text = Path(config).read_text(errors="replace")
    check_no_secrets(overrides, env, config_text, extra)
    try:
        launcher_words = shlex.split(launcher)
    except ValueError as exc:
        raise UserError(f"--launcher {launcher!r} is not a valid shell command: {exc}") from None
    if not launcher_words:
        raise UserError("--launcher is empty (expected the command that runs rlscale, e.g. 'rlscale')")
    for word in launcher_words:  # `HF_TOKEN=... rlscale` would put it in the entrypoint
        name, sep, value = word.partition("=")
        reason = secret_reason(name, value, extra) if sep else None
        if reason:
            raise _refuse_secret("refusing --launcher", reason)
    cfg = load_config(config, overrides)  # a typo fails here, not minutes later on the cluster
    all_excludes = DEFAULT_EXCLUDES + list(excludes or [])
    if rel is not None:
        blocker = _excluded_by(working_dir, rel, all_excludes)
        if blocker:
            raise UserError(f"config file {rel!r} would not be uploaded: {blocker} excludes it")

    env_vars = {}
    if hf_home:
        env_vars["HF_HOME"] = hf_home
    if socket_ifname:
        env_vars["GLOO_SOCKET_IFNAME"] = socket_ifname
        env_vars["NCCL_SOCKET_IFNAME"] = socket_ifname
    env_vars.update(env)
    if "PYTHONPATH" in env:
        # rlscale's driver passes its PYTHONPATH on to its workers (ray.init(runtime_env=...)); the
        # same key in the job's env is a conflict for Ray unless told to merge (the driver's value
        # already starts with the job's).
        env_vars.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")
    env_vars.setdefault("RAY_JOB_STOP_WAIT_TIME_S", job_stop_wait_s(cfg.checkpointing.preemption_grace_s))
    command = [*launcher_words, "train"]
    if rel is not None:
        command += ["--config", rel]
    command += overrides
    submission = {
        "entrypoint": shlex.join(command),
        "runtime_env": {"working_dir": str(working_dir), "excludes": all_excludes, "env_vars": env_vars},
        "metadata": {"submitted_by": "rlscale job submit", "config": rel or ""},
    }
    for number, entry in enumerate(pip or [], start=1):  # a URL can carry credentials (https://user:token@...)
        if not entry.strip() or entry.lstrip().startswith("-"):
            raise UserError(f"--pip entry {number} is {'empty' if not entry.strip() else 'an option'}: "
                            "give a package (a name, a wheel path or a URL)")
        reason = pip_secret_reason(entry, extra)
        if reason:  # the entry itself is not repeated: it holds the secret
            raise _refuse_secret(f"refusing --pip entry {number}", reason)
    if pip:
        submission["runtime_env"]["pip"] = list(pip)
    # Last line of defence: no secret value set here appears anywhere in the request.
    flat = json.dumps(submission)
    if any(value in flat for value in _local_secret_values(extra)):
        raise _refuse_secret("refusing the submission", "it would carry the value of a secret set here")
    return submission


def _placement_notes(config: Path | None, overrides: list[str]) -> list[str]:
    """Where a relative run or checkpoint directory ends up on the cluster, said before it surprises anyone."""
    from rlscale.config_loading import load_config

    cfg = load_config(config, overrides)
    notes = []
    if not Path(cfg.logger.log_dir).is_absolute():
        notes.append(f"the run directory logger.log_dir={cfg.logger.log_dir!r} (metrics.jsonl, summary.json, the "
                     "resolved config) is inside the job's unpacked working directory on the head, not the shared "
                     "volume: it goes with the head pod; set logger.log_dir=/lustre/rlscale-runs/<run>")
    if cfg.checkpointing.enabled and not Path(cfg.checkpoint_dir).is_absolute():
        notes.append(f"checkpoints go to {str(cfg.checkpoint_dir)!r} inside the job's unpacked working directory on "
                     "the node that runs the driver (not the shared volume; Ray reuses that directory for an "
                     "identical upload, so a later job may resume from it): set checkpointing.checkpoint_dir=/lustre/<run>")
    return notes


# ---------------------------------------------------------------- following a job


def _write(text: str, extra: tuple[str, ...]) -> None:
    sys.stdout.write(_redact(text, extra))
    sys.stdout.flush()


def _poll_logs(client, job_id: str, extra: tuple[str, ...], already: int = 0) -> None:
    seen = already
    while True:
        done = client.get_job_status(job_id).is_terminal()
        text = client.get_job_logs(job_id)
        _write(text[seen:], extra)
        seen = len(text)
        if done:
            return
        time.sleep(2.0)


def follow_logs(client, job_id: str, extra: tuple[str, ...] = ()):
    """Stream the job's logs until it ends (Ray's websocket tail; polling if that fails); its final status."""
    logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)  # "WebSocket closed"

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            _write(chunk, extra)

    try:
        asyncio.run(tail())
    except KeyboardInterrupt:
        typer.echo(f"\nstopped following; the job keeps running (stop it: rlscale job stop {job_id})", err=True)
        raise SystemExit(130) from None
    except Exception as exc:  # a proxy without websockets, a dropped stream: poll instead
        typer.echo(f"(log stream interrupted: {_first_line(exc)}; polling)", err=True)
        _poll_logs(client, job_id, extra, already=len(client.get_job_logs(job_id)))
    deadline = time.monotonic() + 30.0
    status = client.get_job_status(job_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
        status = client.get_job_status(job_id)
    return status


def _finish(client, job_id: str, status) -> None:
    if str(status) == "SUCCEEDED":
        typer.echo(f"job {job_id} SUCCEEDED")
        return
    message = (client.get_job_info(job_id).message or "").strip()
    # Ray appends the log tail to the message; the stream has shown it already
    message = message.splitlines()[0].split(", last available logs")[0] if message else ""
    typer.echo(f"job {job_id} {status}" + (f": {_redact(message)}" if message else ""), err=True)
    # SystemExit, not typer.Exit: a caller running the app with standalone_mode=False gets
    # typer.Exit's code as a return value, which is easy to drop.
    raise SystemExit(1)


def _when(ms: int | None) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


# ---------------------------------------------------------------- commands


@job_app.command("submit", context_settings={"allow_extra_args": False})
def submit_cmd(
    overrides: Optional[list[str]] = typer.Argument(None, help="dotted overrides, e.g. grpo.max_num_steps=20",
                                                    show_default=False),
    address: Optional[str] = ADDRESS_OPTION,
    token: Optional[str] = TOKEN_OPTION,
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config inside the working directory"),
    working_dir: Path = typer.Option(Path("."), "--working-dir", help="uploaded as the job's working directory"),
    env: Optional[list[str]] = typer.Option(None, "--env", help="NAME=VALUE for the job (repeatable); no secrets"),
    hf_home: str = typer.Option(DEFAULT_HF_HOME, "--hf-home", help="HF_HOME on the shared volume ('' = unset)"),
    socket_ifname: str = typer.Option(DEFAULT_SOCKET_IFNAME, "--socket-ifname",
                                      help="GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME ('' = unset)"),
    exclude: Optional[list[str]] = typer.Option(None, "--exclude",
                                                help="more upload excludes, gitignore syntax (repeatable)"),
    launcher: str = typer.Option("rlscale", "--launcher", help="command before `train`, e.g. 'python -m rlscale.cli'"),
    pip: Optional[list[str]] = typer.Option(
        None, "--pip", help="a package Ray installs for the job (repeatable), e.g. an rlscale wheel on the shared "
        "volume when the image lacks rlscale"),
    submission_id: Optional[str] = typer.Option(None, "--submission-id", help="default: Ray picks one"),
    no_wait: bool = typer.Option(False, "--no-wait", help="return after submitting"),
    follow: bool = typer.Option(False, "--follow", help="stream the logs until the job ends (the default)"),
) -> None:
    """Upload the working directory and run `rlscale train` there as a Ray job; follow its logs."""
    if no_wait and follow:
        raise UserError("give --no-wait or --follow, not both")
    token = _token(token)
    extra = (token,) if token else ()
    submission = build_submission(working_dir, config, list(overrides or []), _parse_env(env or []),
                                  hf_home, socket_ifname, launcher, exclude, token, pip)
    present = [name for name in SECRET_ENV_VARS if os.environ.get(name)]
    typer.echo("secrets: HF_TOKEN and WANDB_API_KEY are not sent with the job; on the cluster they come from the "
               "Kubernetes Secret (rlscale-secrets unless renamed in `rlscale cluster render`) mounted as "
               "environment variables on the Ray pods"
               + (f"; {' and '.join(present)} set here {'stays' if len(present) == 1 else 'stay'} here"
                  if present else ""), err=True)  # notes on stderr, like the one below; stdout: the job
    for note in _placement_notes(config, list(overrides or [])):
        typer.echo(f"note: {note}", err=True)
    url, client = job_client(address, token)
    # Ray warns that it skips .git/.venv by default; rlscale excludes them anyway.
    logging.getLogger("ray._private.runtime_env.working_dir").setLevel(logging.ERROR)
    job_id = submit_when_ready(client, url, submission_id, submission)
    hint = "" if address is None and not os.environ.get("RAY_ADDRESS") else f" --address {url}"
    typer.echo(f"submission id: {job_id}")
    typer.echo(f"follow its logs: rlscale job logs {job_id} --follow{hint}")
    if no_wait:
        typer.echo(f"status: rlscale job status {job_id}{hint}   stop: rlscale job stop {job_id}{hint}")
        return
    with _ray_errors(url, job_id):
        _follow_to_end(client, job_id, extra)


def _job_exists(client, submission_id: str) -> bool:
    try:
        client.get_job_info(submission_id)
        return True
    except Exception:
        return False


def submit_when_ready(client, url: str, submission_id: str | None, submission: dict,
                      retry_s: float = SUBMIT_RETRY_S, pause_s: float = 2.0) -> str:
    """Submit, retrying while the head has no job agent yet; the submission id is fixed up front,
    so a retry after an attempt that did reach the agent finds that job instead of a second one."""
    from ray.dashboard.modules.job.job_manager import generate_job_id

    if submission_id and _job_exists(client, submission_id):  # Ray answers this with a bare 500
        raise UserError(f"--submission-id {submission_id}: a job with that id already exists on the Ray cluster "
                        f"at {url}; pick another id or leave it out")
    submission_id = submission_id or generate_job_id()
    deadline, retried = time.monotonic() + retry_s, False
    while True:
        try:
            with _ray_errors(url):
                return client.submit_job(submission_id=submission_id, **submission)
        except UserError as exc:
            if _NO_AGENT not in str(exc) or time.monotonic() + pause_s > deadline:
                if retried and _job_exists(client, submission_id):
                    return submission_id  # an earlier attempt got through after all
                raise
        if not retried:
            typer.echo(f"note: the Ray head at {url} has no job agent yet (still starting?); retrying for up "
                       f"to {retry_s:.0f} s", err=True)
        retried = True
        time.sleep(pause_s)


@job_app.command("status")
def status_cmd(
    job_id: str = typer.Argument(..., help="submission id"),
    address: Optional[str] = ADDRESS_OPTION,
    token: Optional[str] = TOKEN_OPTION,
) -> None:
    """A job's status, message and times."""
    url, client = job_client(address, token)
    with _ray_errors(url, job_id):
        info = client.get_job_info(job_id)
    extra = _redacted_extra(token)
    typer.echo(f"submission id: {info.submission_id or info.job_id}")
    typer.echo(f"status:        {info.status}")
    if info.message:
        typer.echo(f"message:       {_redact(info.message, extra)}")
    typer.echo(f"started:       {_when(info.start_time)}")
    typer.echo(f"ended:         {_when(info.end_time)}")
    typer.echo(f"entrypoint:    {_redact(info.entrypoint or '', extra)}")


@job_app.command("logs")
def logs_cmd(
    job_id: str = typer.Argument(..., help="submission id"),
    follow: bool = typer.Option(False, "--follow", "-f", help="stream until the job ends"),
    address: Optional[str] = ADDRESS_OPTION,
    token: Optional[str] = TOKEN_OPTION,
) -> None:
    """A job's logs so far, or (--follow) streamed until it ends."""
    url, client = job_client(address, token)
    extra = _redacted_extra(token)
    with _ray_errors(url, job_id):
        client.get_job_info(job_id)  # an unknown id: one line, before any stream opens
        if not follow:
            _write(client.get_job_logs(job_id), extra)
            return
        _follow_to_end(client, job_id, extra)


@job_app.command("stop")
def stop_cmd(
    job_id: str = typer.Argument(..., help="submission id"),
    address: Optional[str] = ADDRESS_OPTION,
    token: Optional[str] = TOKEN_OPTION,
) -> None:
    """Ask a job to stop (Ray terminates its driver, then kills it after a grace period)."""
    url, client = job_client(address, token)
    with _ray_errors(url, job_id):
        if client.stop_job(job_id):
            typer.echo(f"stop requested for {job_id}")
        else:
            typer.echo(f"{job_id} is not running ({client.get_job_status(job_id)})")


@job_app.command("list")
def list_cmd(
    address: Optional[str] = ADDRESS_OPTION,
    token: Optional[str] = TOKEN_OPTION,
) -> None:
    """The cluster's jobs, oldest first."""
    url, client = job_client(address, token)
    with _ray_errors(url):
        jobs = client.list_jobs()
    extra = _redacted_extra(token)
    if not jobs:
        typer.echo(f"no jobs on {url}")
        return
    typer.echo(f"{'SUBMISSION ID':<30} {'STATUS':<10} {'STARTED':<24} ENTRYPOINT")
    for info in sorted(jobs, key=lambda j: j.start_time or 0):
        entry = _redact(info.entrypoint or "", extra)
        entry = entry if len(entry) <= 80 else entry[:77] + "..."
        typer.echo(f"{(info.submission_id or info.job_id or '-'):<30} {str(info.status):<10} "
                   f"{_when(info.start_time):<24} {entry}")
