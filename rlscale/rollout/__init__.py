"""rlscale's rollout engine: generation on the policy's own weights, without Hugging Face generate."""

from rlscale.rollout.engine import Generation, RolloutEngine, round_up
from rlscale.rollout.sampling import SamplingMode, SamplingParams
from rlscale.rollout.stops import StopStrings
from rlscale.rollout.tensor_parallel import TensorParallel, tp_unsupported_reason
from rlscale.rollout.weights import unsupported_reason

__all__ = ["Generation", "RolloutEngine", "SamplingMode", "SamplingParams", "StopStrings", "TensorParallel",
           "round_up", "tp_unsupported_reason", "unsupported_reason"]
