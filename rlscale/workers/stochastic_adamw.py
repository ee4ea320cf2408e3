"""AdamW for bf16 weights that keeps small updates: each new weight is rounded to bf16 stochastically.

Rounding to nearest drops every update below half a bf16 step; rounding up with probability
(distance to the lower bf16 value) / (bf16 step) keeps the expected weight exact, so many small
steps add up as they would in fp32. The update itself is computed in fp32 from fp32 moments
(AdamW as torch.optim.AdamW computes it: decoupled weight decay, bias-corrected moments).

The random bits are keyed by (seed, step, parameter index): a resumed run rounds exactly as the
uninterrupted one did, with no generator state to save. torchao.optim.AdamW offers the same with
`bf16_stochastic_round=True`, but compiles its step with torch.compile (a C++ toolchain on CPU)
and is marked experimental; this is the small version of it.
"""

from __future__ import annotations

import torch

_LOW_HALF = (1 << 16) - 1


def stochastic_round_to_bf16(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, rounding up in magnitude with probability equal to the dropped fraction.

    A bf16 value is an fp32 value with its low 16 bits zero: add 16 random bits and truncate."""
    bits = values.float().contiguous().view(torch.int32)
    noise = torch.randint(0, _LOW_HALF + 1, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    return ((bits + noise) & ~_LOW_HALF).view(torch.float32).bfloat16()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP2 (DTensor) tensor, else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class StochasticRoundingAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, step: int, index: int) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        # one stream per (seed, step, parameter): reproducible after a resume
        generator.manual_seed((self.seed * 1_000_003 + step * 10_007 + index) % (2**63))
        return generator

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                index += 1
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
                state["step"] += 1
                step = int(state["step"].item())
                weight, grad = _local(param), _local(param.grad).float()
                exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
                denom = (exp_avg_sq.sqrt() / bias2 ** 0.5).add_(group["eps"])
                updated = weight.float()
                updated.mul_(1 - group["lr"] * group["weight_decay"])
                updated.addcdiv_(exp_avg, denom, value=-group["lr"] / bias1)
                if weight.dtype == torch.bfloat16:
                    updated = stochastic_round_to_bf16(updated, self._generator(weight.device, step, index))
                weight.copy_(updated)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load casts every floating state tensor to its parameter's dtype (bf16 here): the
        moments are put back in fp32, as saved."""
        super().load_state_dict(state_dict)
        params = [param for group in self.param_groups for param in group["params"]]
        for index, saved in state_dict["state"].items():
            for key, value in saved.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.state[params[index]][key] = value.to(device=params[index].device, dtype=torch.float32)
