"""fp32 master weights at one worker: a bf16 copy of the model computes, the fp32 model is updated.

What FSDP2's MixedPrecisionPolicy does over several workers (rlscale.workers.precision), done once
per pass instead of per unit per forward and backward: on entering `computing()` every fp32
parameter is cast into its bf16 copy and the copies take the parameters' places in the modules;
each copy's gradient is added, in fp32, to its fp32 parameter's as soon as the backward has
accumulated it (the bf16 gradient is freed there), and the fp32 parameters are back in place on
leaving. The arithmetic is FSDP2's at one worker (cast the weights, compute and differentiate in
bf16, cast each gradient to fp32 and accumulate it), but with no hooks around the modules: the
compiled layers of the plain bf16 path serve unchanged (under FSDP2's hooks compiling took minutes).

The optimizer, checkpoints and exports see only the fp32 parameters, as in the FSDP2 layout.
Holds the whole model in bf16 besides: where that does not fit (policy.keep_gathered=false), one
worker uses an FSDP2 group of one instead, gathering one unit at a time.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class ComputeCopy:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.model = model
        self.places: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []  # (module, name, master)
        self.copies: dict[int, torch.nn.Parameter] = {}  # id(master) -> its copy; tied weights share one
        self.masters: list[torch.nn.Parameter] = []
        for module in model.modules():
            for name, master in module._parameters.items():
                if master is None:
                    continue
                self.places.append((module, name, master))
                if id(master) in self.copies:
                    continue
                copy = torch.nn.Parameter(torch.empty_like(master, dtype=dtype), requires_grad=master.requires_grad)
                if master.requires_grad:
                    copy.register_post_accumulate_grad_hook(_into_master(master))
                self.copies[id(master)] = copy
                self.masters.append(master)
        self.active = False

    @contextmanager
    def computing(self):
        """The model with its bf16 copies in place, freshly cast from the fp32 parameters (which
        an optimizer step or a checkpoint load may have changed since). Re-entrant."""
        if self.active:
            yield
            return
        with torch.no_grad():
            for master in self.masters:
                self.copies[id(master)].copy_(master)
        for module, name, master in self.places:
            module._parameters[name] = self.copies[id(master)]
        self.active = True
        try:
            yield
        finally:
            for module, name, master in self.places:
                module._parameters[name] = master
            self.active = False


def _into_master(master: torch.nn.Parameter):
    def hook(copy: torch.nn.Parameter) -> None:
        grad = copy.grad
        if master.grad is None:
            master.grad = grad.to(master.dtype)
        else:
            master.grad.add_(grad)  # in fp32: the bf16 gradient is promoted
        copy.grad = None

    return hook
