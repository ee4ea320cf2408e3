"""The README's promises that code can check: its config reference and its two commands."""

from pathlib import Path

from rlscale.config import reference_table

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_config_reference_in_readme_matches_the_code():
    assert reference_table() in README, "regenerate the README's table with `rlscale config`"


def test_readme_test_command_is_what_ci_runs():
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert "bash .ci/run" in README
    assert "python -m pytest -n 2 -q" in ci and "python -m pytest -n 2 -q" in README
