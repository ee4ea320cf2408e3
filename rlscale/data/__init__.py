"""Training and held-out problems: presets, file and hub readers, arithmetic, and the loader."""

from rlscale.data.loader import PromptLoader
from rlscale.data.presets import Datasets, build_datasets
from rlscale.data.problem import Problem, ProblemSource

__all__ = ["Datasets", "Problem", "ProblemSource", "PromptLoader", "build_datasets"]
