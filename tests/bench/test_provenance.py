"""Every benchmark JSON says which code it measured: $RLSCALE_CODE on a copied work tree, else git."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from rlscale.bench import CODE_ENV, code_revision, write_result

ROOT = Path(__file__).resolve().parents[2]


def test_the_environment_names_the_code_of_a_copied_work_tree(monkeypatch):
    monkeypatch.setenv(CODE_ENV, "59af750")
    assert code_revision() == "59af750"


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_without_the_environment_the_checkout_s_commit(monkeypatch):
    monkeypatch.delenv(CODE_ENV, raising=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert code_revision() in (head, head + "-dirty")


def test_write_result_stamps_a_missing_code_and_keeps_a_given_one(monkeypatch, tmp_path):
    monkeypatch.setenv(CODE_ENV, "abc1234")
    write_result({"date": "2026-12-07", "code": None}, tmp_path / "a.json")
    write_result({"date": "2026-12-07", "code": "given"}, tmp_path / "nested" / "b.json")
    assert json.loads((tmp_path / "a.json").read_text())["code"] == "abc1234"
    assert json.loads((tmp_path / "nested" / "b.json").read_text())["code"] == "given"
