"""Resolve `rewards.function` ('math' or 'package.module:function') to a callable."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

from rlscale.config import check_reward_spec
from rlscale.errors import UserError

RewardFn = Callable[[str, str], float]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__




def _import(spec: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Is the missing module the one named in the spec (or a parent package of it)?
        ours = exc.name is not None and (module_name + ".").startswith(exc.name + ".")
        if not ours:
            raise UserError(f"rewards.function {spec!r}: importing module {module_name!r} failed: "
                            f"{_one_line(exc)}") from None
        cwd = os.getcwd()
        if cwd in [os.path.abspath(p) for p in sys.path]:
            raise UserError(f"rewards.function {spec!r}: cannot import module {module_name!r} "
                            f"(not found on the Python path)") from None
        # Console-script launchers do not put the working directory on sys.path, yet users
        # expect `my_rewards:score` next to their config to work. Workers inherit sys.path.
        sys.path.append(cwd)
        try:
            return _import(spec, module_name)
        except UserError:
            sys.path.remove(cwd)
            raise
    except Exception as exc:  # the module exists but its own code failed (SyntaxError, ...)
        raise UserError(f"rewards.function {spec!r}: importing module {module_name!r} failed: "
                        f"{_one_line(exc)}") from None


def load_reward_function(spec: str) -> RewardFn:
    """'math' -> math_reward; 'pkg.mod:func' (or 'pkg.mod:Class.method') -> that callable.

    Raises UserError (one line, naming the spec) when the spec is malformed, the module cannot
    be imported, the attribute is missing, or it is not callable.
    """
    if spec == "math":
        from rlscale.rewards.math_answer import math_reward

        return math_reward
    module_name, attr_path = check_reward_spec(spec)
    obj = _import(spec, module_name)
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise UserError(f"rewards.function {spec!r}: module {module_name!r} has no attribute "
                            f"{attr_path!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise UserError(f"rewards.function {spec!r}: {attr_path!r} is not callable (got "
                        f"{type(obj).__name__}); expected a function (response, answer) -> float")
    return obj
