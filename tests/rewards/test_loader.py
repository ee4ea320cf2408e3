import sys

import pytest

from rlscale.errors import UserError
from rlscale.rewards import load_reward_function, math_reward
from tests.rewards import user_rewards


def test_math_and_user_functions_resolve():
    assert load_reward_function("math") is math_reward
    assert load_reward_function("tests.rewards.user_rewards:exact") is user_rewards.exact
    assert load_reward_function("tests.rewards.user_rewards:Grader.length")("abc", "") == 3


@pytest.mark.parametrize("spec, fragment", [
    ("tests.rewards.user_rewards", "must be 'math' or 'package.module:function'"),
    (":exact", "must be 'math' or 'package.module:function'"),
    ("tests.rewards.user_rewards:", "must be 'math' or 'package.module:function'"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("tests.rewards.no_such_module:f", "cannot import module 'tests.rewards.no_such_module'"),
    ("tests.rewards.user_rewards:missing", "has no attribute 'missing'"),
    ("tests.rewards.user_rewards:NOT_CALLABLE", "'NOT_CALLABLE' is not callable (got int)"),
])
def test_bad_specs_raise_one_line_user_errors(spec, fragment):
    with pytest.raises(UserError) as info:
        load_reward_function(spec)
    message = str(info.value)
    assert repr(spec) in message and fragment in message and "\n" not in message


def test_module_that_fails_to_import(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_mod.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="importing module 'broken_reward_mod' failed: "
                                        "ModuleNotFoundError.*no_such_dependency_xyz"):
        load_reward_function("broken_reward_mod:f")


def test_module_in_working_directory_is_found(tmp_path, monkeypatch):
    # As under a console-script launcher, where the working directory is not on sys.path.
    (tmp_path / "cwd_reward_mod.py").write_text("def score(r, a):\n    return 0.25\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    monkeypatch.chdir(tmp_path)
    assert load_reward_function("cwd_reward_mod:score")("x", "y") == 0.25
