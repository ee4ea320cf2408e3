"""The unit of training data: one templated prompt and its ground-truth answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rlscale.errors import UserError

PLACEHOLDER = "{problem}"


@dataclass(frozen=True, slots=True)
class Problem:
    text: str  # user message, prompt template already applied (chat templating happens later)
    answer: str  # ground truth, compared with the response's final answer by the reward


class ProblemSource:
    """Indexable problems; `size` is None for an unlimited (generated) source."""

    size: int | None = None

    def __getitem__(self, i: int) -> Problem:
        raise NotImplementedError


class ListSource(ProblemSource):
    """A finite source backed by a list (files and hub datasets, loaded eagerly)."""

    def __init__(self, problems: Sequence[Problem]):
        self._problems = list(problems)
        self.size = len(self._problems)

    def __getitem__(self, i: int) -> Problem:
        return self._problems[i]

    def __len__(self) -> int:
        return self.size


def check_template(template: str, where: str = "data.prompt_template") -> str:
    if PLACEHOLDER not in template:
        raise UserError(f"{where}={template!r} must contain {PLACEHOLDER}")
    return template


def apply_template(template: str, problem: str) -> str:
    # str.replace, not str.format: math templates contain literal braces such as "\boxed{}".
    return template.replace(PLACEHOLDER, problem)
