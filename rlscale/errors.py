"""User-facing errors.

Anything the user can fix (a bad key, a missing file, an unwritable directory) is raised as a
`UserError`; the CLI prints its message as one line and exits non-zero, without a traceback.
"""


from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class UserError(Exception):
    """A problem with the user's input or environment, reported as one line."""


def short_reason(exc: BaseException, limit: int = 300) -> str:
    """First line of an exception's message, capped, so the UserError built from it stays one line."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _capped(text: str, limit: int = 120) -> str:
    """A key or value as echoed in an error: a 5000-character value would not make one line."""
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(text)} characters)"


def validation_message(err: ValidationError, subject: str) -> str:
    """One line for the first problem pydantic found, naming its key: `unknown config key 'a.b'`,
    `config key 'a.b': input should be ... (got 7)`, or for a check across keys `config: <reason>`.
    Whole mappings and lists are not echoed back (they would not fit on a line)."""
    first = err.errors()[0]
    loc = _capped(".".join(str(part) for part in first["loc"]))
    if first["type"] == "extra_forbidden":
        return f"unknown {subject} key {loc!r}"
    if first["type"] == "value_error":  # our own validators: their message is already a sentence
        reason = str(first["ctx"]["error"]) if "ctx" in first else first["msg"]
        return f"{subject} key {loc!r}: {reason}" if loc else f"{subject}: {reason}"
    got = first.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {_capped(repr(got))})"
    message = first["msg"]  # pydantic's "Input should be ...": lower-case the first letter only
    return f"{subject} key {loc!r}: {message[:1].lower()}{message[1:]}{shown}"


# ---------------------------------------------------------------- out of memory

GiB = 1024 ** 3

# The phases an out-of-memory error is reported in (the keys of a memory plan's figures, see
# rlscale.controller.planned_figures). "start-up" and "checkpoint load" happen before a step.
OOM_PHASES = ("generation", "reference logprobs", "update", "weight sync/gather", "validation",
              "checkpoint snapshot", "checkpoint load", "start-up", "reward scoring")


class OutOfMemory(UserError):
    """A worker (or the controller) ran out of device or host memory.

    Made where the memory ran out (the worker's process, so that the figures are that device's)
    from a torch.OutOfMemoryError or a MemoryError, and small and picklable so that it crosses Ray
    intact: the phase, the bytes allocated then and at the peak, the device's total, the original
    message and its traceback (text). The controller adds the step, the memory plan's figure for
    the phase, what to change and where the traceback was logged; `str()` is the one line the CLI
    prints."""

    _FIELDS = ("phase", "allocated", "peak", "total", "device", "message", "traceback_text", "host",
               "step", "rank", "planned", "advice", "log_path")

    def __init__(self, phase: str, allocated: int | None, peak: int | None, total: int | None, device: str,
                 message: str = "", traceback_text: str = "", host: bool = False, step: int | None = None,
                 rank: int | None = None, planned: int | None = None, advice: str | None = None,
                 log_path: str | None = None):
        super().__init__(phase)
        self.phase, self.allocated, self.peak, self.total, self.device = phase, allocated, peak, total, device
        self.message, self.traceback_text, self.host = message, traceback_text, host
        self.step, self.rank, self.planned, self.advice, self.log_path = step, rank, planned, advice, log_path

    def __reduce__(self):
        return _rebuild_out_of_memory, (type(self), {name: getattr(self, name) for name in self._FIELDS})

    def fields(self) -> dict:
        return {name: getattr(self, name) for name in self._FIELDS}

    def __str__(self) -> str:
        when = f"step {self.step}" if self.step is not None else "start-up"
        where = f"{self.device}" + (f", worker rank {self.rank}" if self.rank is not None else "")
        line = (f"out of memory in {self.phase} ({when}): {_gib(self.allocated)} GiB allocated of "
                f"{_gib(self.total)} GiB on {where}; ")
        line += (f"the memory plan expected {_gib(self.planned)} GiB for this phase" if self.planned is not None
                 else "the memory plan gave no figure")
        line += f"; {self.advice or advice_for(self.phase, host=self.host)}"
        if self.log_path:
            line += f"; traceback in {self.log_path}"
        return line


def _rebuild_out_of_memory(cls, fields: dict) -> OutOfMemory:
    return cls(**fields)


def _gib(size: int | None) -> str:
    return "?" if size is None else f"{size / GiB:.1f}"


def advice_for(phase: str, cfg=None, host: bool = False) -> str:
    """What to change when `phase` runs out of memory; with the run's config, the settings it has
    not set that way already."""
    policy = getattr(cfg, "policy", None)

    def unset(key: str, value) -> bool:  # the setting is not already at `value`
        return policy is None or getattr(policy, key, None) != value

    if host:
        return ("the host ran out of memory: lower checkpointing.staging_budget_gb or rewards.num_workers, "
                "or run fewer workers per node (cluster.gpus_per_node)")
    if phase in ("generation", "validation"):
        fewer = "grpo.max_val_samples" if phase == "validation" else "grpo.num_prompts_per_step"
        return (f"lower policy.generation.max_new_tokens or {fewer}, or use more GPUs "
                "(cluster.num_nodes, cluster.gpus_per_node)")
    if phase == "update":
        tips = []
        if unset("activation_checkpointing", True):
            tips.append("set policy.activation_checkpointing=true")
        tips.append("lower policy.train_micro_batch_tokens")
        if unset("master_weights", "bf16_stochastic"):
            tips.append("set policy.master_weights=bf16_stochastic")
        return ", ".join(tips[:-1]) + f" or {tips[-1]}" if len(tips) > 1 else tips[0]
    if phase == "reference logprobs":
        first = "set policy.shard_reference=true" if unset("shard_reference", True) else "use more GPUs"
        return f"{first} or lower policy.train_micro_batch_tokens"
    if phase == "weight sync/gather":
        more = "use more GPUs (cluster.num_nodes, cluster.gpus_per_node): each then gathers from a smaller shard"
        return f"set policy.keep_gathered=false or {more}" if unset("keep_gathered", False) else more
    if phase == "checkpoint snapshot":
        return "lower checkpointing.staging_budget_gb (the rest is written during the snapshot)"
    if phase == "checkpoint load":
        return "resume on as many GPUs as the checkpoint was saved from, or more"
    return "use more GPUs (cluster.num_nodes, cluster.gpus_per_node) or a smaller model"


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, the CPU allocator's failure (a plain RuntimeError) or a MemoryError."""
    if isinstance(exc, OutOfMemory):
        return False  # converted already
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError" and isinstance(exc, RuntimeError):
        return True
    return isinstance(exc, RuntimeError) and ("DefaultCPUAllocator: can't allocate memory" in str(exc)
                                              or "CUDA out of memory" in str(exc))


# function names seen in a traceback -> the phase they are in; the innermost match wins
_PHASE_OF_FRAME = {
    "generate": "generation", "_generate": "generation", "generate_rollouts": "generation",
    "train": "update", "_train": "update", "train_on_rollouts": "update",
    "sync_weights": "weight sync/gather", "sync_from": "weight sync/gather",
    "checkpoint_snapshot": "checkpoint snapshot", "load_checkpoint_shard": "checkpoint load",
    "validate": "validation", "evaluate": "validation", "score": "reward scoring",
}
# phases by the worker method the controller called (group.run_all(method, ...))
PHASE_OF_METHOD = {
    "generate": "generation", "train": "update", "compute_logprobs": "update", "sequence_kl": "update",
    "checkpoint_snapshot": "checkpoint snapshot", "checkpoint_poll": "checkpoint snapshot",
    "checkpoint_finish": "checkpoint snapshot", "checkpoint_abort": "checkpoint snapshot",
    "load_checkpoint_shard": "checkpoint load", "ready": "start-up", "hostname": "start-up",
    "__init__": "start-up",
}


def phase_of(method: str | None, tb) -> str:
    """The phase an error with traceback `tb` happened in: the worker method that was running,
    refined by the frames inside it (the reference's logprob pass inside `train`, the FSDP2 gather
    or the rollout engine's weight copy inside `generate`)."""
    phase = PHASE_OF_METHOD.get(method or "", None)
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    found = None
    for i, frame in enumerate(frames):  # outermost first: the innermost match wins
        name = frame.f_code.co_name
        local = frame.f_locals
        if name in ("_pack_logprobs", "compute_logprobs"):
            owner = local.get("self")
            model = local.get("model")
            reference = getattr(owner, "reference", None)
            if local.get("reference") is True or (reference is not None and model is reference):
                found = "reference logprobs"
        elif name == "unshard" and i > 0 and frames[i - 1].f_code.co_name == "gathered":
            found = "weight sync/gather"  # an explicit gather of the whole model (rlscale.workers.distributed)
        elif name in _PHASE_OF_FRAME and not (name == "train" and not local.get("steps", ())):
            found = _PHASE_OF_FRAME[name]  # (not torch's Module.train(), which takes no steps)
    return found or phase or (method or "the controller")


def _device_of(worker) -> "object | None":
    device = getattr(worker, "device", None)
    return device if getattr(device, "type", None) in ("cuda", "cpu") else None


def memory_figures(device=None, host: bool = False) -> tuple[int | None, int | None, int | None, str]:
    """(allocated, peak, total, device name) now, in this process: torch's allocator on a CUDA
    device, else this process's resident memory against the machine's."""
    if not host:
        try:
            import torch

            if torch.cuda.is_available() and (device is None or getattr(device, "type", None) == "cuda"):
                index = torch.cuda.current_device() if device is None or device.index is None else device.index
                props = torch.cuda.get_device_properties(index)
                return (torch.cuda.memory_allocated(index), torch.cuda.max_memory_allocated(index),
                        props.total_memory, f"cuda:{index} ({props.name})")
        except Exception:  # figures are best effort: the error itself must get through
            pass
    rss, peak = _host_rss(), _host_peak()
    if rss is not None and peak is not None:
        peak = max(peak, rss)  # the kernel's high-water mark lags the current figure by a page or so
    return rss, peak, _host_total(), "host" if host else "cpu"


def _host_rss() -> int | None:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _host_peak() -> int | None:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    except (ImportError, OSError):
        return None


def _host_total() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


_CUDA_FIGURES = re.compile(r"total capacity of ([\d.]+) (GiB|MiB).*?Of the allocated memory ([\d.]+) (GiB|MiB) "
                           r"is allocated by PyTorch", re.S)


def _from_cuda_message(message: str) -> tuple[int | None, int | None]:
    """(allocated, total) from the CUDA caching allocator's message, for an error converted away
    from its device."""
    match = _CUDA_FIGURES.search(message)
    if not match:
        return None, None
    unit = {"GiB": GiB, "MiB": 1024 ** 2}
    return int(float(match.group(3)) * unit[match.group(4)]), int(float(match.group(1)) * unit[match.group(2)])


def out_of_memory(exc: BaseException, method: str | None = None, worker=None, rank: int | None = None,
                  here: bool = True) -> OutOfMemory:
    """Our OutOfMemory for `exc` (see is_out_of_memory), with the figures of this process's device
    when `here` (the process that ran out), else those the message gives."""
    import traceback

    host = isinstance(exc, MemoryError)
    message = short_reason(exc, limit=2000) if str(exc).strip() else type(exc).__name__
    if here:
        allocated, peak, total, device = memory_figures(_device_of(worker), host=host)
    else:
        (allocated, total), peak = _from_cuda_message(str(exc)), None
        device = "host" if host else ("cuda" if "CUDA" in str(exc) else "a worker's device")
    if rank is None:
        rank = getattr(worker, "rank", None) if getattr(worker, "world_size", 1) > 1 else None
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return OutOfMemory(phase_of(method, exc.__traceback__), allocated, peak, total, device, message, text,
                       host=host, rank=rank)
