"""What a policy worker computes in and what its optimizer updates (policy.dtype, policy.master_weights).

AdamW on bf16 weights rounds away every update smaller than half a bf16 step of the weight (about
|w| / 512): with weights ~N(0, 0.02) most updates vanish at learning rates below ~1e-5, the range
real RL post-training runs in. So a 16-bit compute dtype gets, by default, fp32 master weights:

- fp32: fp32 parameters and AdamW moments; the forward and backward run on a bf16 cast of the
  weights, gradients are cast to fp32 and accumulated across micro-batches in fp32. Over several
  workers FSDP2's MixedPrecisionPolicy does it per unit as it gathers and reduce-scatters; at one
  worker a bf16 copy of the whole model does it once per pass (rlscale.workers.compute_copy: the
  same arithmetic, with compiled layers), or, when the policy is gathered one unit at a time
  (policy.keep_gathered=false), an FSDP2 group of one.
- bf16_stochastic: bf16 parameters, fp32 moments, and updates rounded to bf16 stochastically
  (rlscale.workers.stochastic_adamw), so a small update is kept on average; gradients reduced and
  accumulated in fp32 over several workers (at one worker they are accumulated in bf16: a plain
  bf16 model).
- bf16: bf16 parameters and moments (torch's AdamW), only when asked for.
The frozen reference model and the rollout engine's copy are in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlscale.config import OptimizerConfig, PolicyConfig
from rlscale.models import pick_dtype


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # forward and backward, the reference model, the rollout engine
    weights: torch.dtype  # the parameters the optimizer updates
    master: str  # fp32 | bf16_stochastic | bf16 | lora (frozen base, fp32 adapters)

    @property
    def mixed(self) -> bool:
        """A 16-bit compute dtype over fp32 master weights or stochastic rounding: over several
        workers FSDP2's MixedPrecisionPolicy casts the parameters and reduces gradients in fp32."""
        return self.compute != torch.float32 and self.master in ("fp32", "bf16_stochastic")

    def one_worker_layout(self, keep_gathered: bool) -> str:
        """How one worker holds its policy: "compute_copy" (fp32 master weights with a bf16 copy of
        the whole model, rlscale.workers.compute_copy), "fsdp" (fp32 master weights gathered one
        FSDP2 unit at a time, a group of one) or "plain" (the weights are what computes)."""
        if self.compute == torch.float32 or self.master != "fp32":
            return "plain"
        return "compute_copy" if keep_gathered else "fsdp"

    def fsdp_policy(self, world_size: int):
        """FSDP2's MixedPrecisionPolicy for this precision (None: FSDP2's default, all in the weights'
        dtype). Gradients are reduced and accumulated in fp32 for fp32 master weights, and for bf16
        weights over several workers (a sum over ranks); at one worker a bf16 weight's gradient is
        reduced by a copy, which fp32 buffers would only make larger (7B: 11 GB a unit of 6 layers)."""
        if not self.mixed:  # fp32 compute, or plain bf16 (FSDP2's defaults over several workers)
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        fp32_reduce = self.master == "fp32" or world_size > 1
        return MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=torch.float32 if fp32_reduce else None)


def compute_dtype(policy: PolicyConfig, device: torch.device) -> torch.dtype:
    """policy.dtype as rlscale.models.pick_dtype reads it, except that auto is bf16 wherever bf16
    weights were asked for (on a CPU too)."""
    if policy.dtype == "auto" and policy.master_weights in ("bf16", "bf16_stochastic"):
        return torch.bfloat16
    return pick_dtype(policy.dtype, device)


def resolve_precision(policy: PolicyConfig, device: torch.device) -> Precision:
    """The worker's precision. master_weights=auto is resolved by the memory plan before workers
    start (rlscale.memory_plan); a worker that still sees auto (no plan was made) takes fp32."""
    compute = compute_dtype(policy, device)
    if policy.lora.enabled:  # a frozen base in the compute dtype; the adapters (rlscale.models.lora) in fp32
        return Precision(compute, compute, "lora")
    if compute == torch.float32:
        return Precision(torch.float32, torch.float32, "fp32")
    master = "fp32" if policy.master_weights == "auto" else policy.master_weights
    weights = torch.float32 if master == "fp32" else torch.bfloat16
    return Precision(compute, weights, master)


def make_optimizer(params, opt: OptimizerConfig, precision: Precision, device: torch.device, seed: int):
    """AdamW as the precision needs it; `seed` keys the stochastic rounding (per rank)."""
    kwargs = dict(lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    if precision.master == "bf16_stochastic":
        from rlscale.workers.stochastic_adamw import StochasticRoundingAdamW

        return StochasticRoundingAdamW(params, seed=seed, **kwargs)
    # fused: one kernel for all parameters on GPU
    return torch.optim.AdamW(params, fused=device.type == "cuda" or None, **kwargs)
