"""Tensor-parallel decoding: which slice of each weight a rank holds, and the collectives between.

Megatron's split of the Llama block over T ranks, as vLLM does it: each rank holds H/T query
heads with their kv heads, 1/T of the MLP's intermediate rows, and 1/T of the (padded)
vocabulary. q/k/v and gate/up are column-parallel (each rank computes its own heads and
intermediate units, no communication); o_proj and down_proj are row-parallel (each rank's output
is a partial sum over its inputs: one all-reduce each); the embedding is a lookup in the rank's
vocabulary rows, all-reduced; the LM head's logits are gathered so that every rank samples from
the same full [B, V] row. Two all-reduces a layer, one gather a step.

KV heads: split when Hkv % T == 0; when T % Hkv == 0 (more ranks than kv heads) each kv head is
replicated on T / Hkv ranks, rank r holding kv head r // (T / Hkv), whose query heads under GQA
are exactly rank r's H/T.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (the older name is deprecated there, the only one before)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_unsupported_reason(shape, size: int) -> str | None:
    """Why a model of `shape` (a `ModelShape`, or anything with num_heads, num_kv_heads and
    intermediate_size) cannot be split over `size` ranks; None when it can. Needs no process group,
    so a config check can call it."""
    if size < 1:
        return f"tensor parallel size {size} (must be at least 1)"
    heads, kv_heads, intermediate = shape.num_heads, shape.num_kv_heads, shape.intermediate_size
    if heads % size:
        return f"{heads} attention heads not divisible by tensor parallel size {size}"
    if kv_heads % size and size % kv_heads:
        return f"{kv_heads} kv heads neither divisible by nor dividing tensor parallel size {size}"
    if intermediate % size:
        return f"MLP intermediate size {intermediate} not divisible by tensor parallel size {size}"
    return None


class RankSlices(NamedTuple):
    """What one rank holds: head ranges (in heads), intermediate rows, and padded-vocabulary rows
    (rows from `vocab_size` on are padding: zero weights, logits dropped)."""

    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group. `group`: the process group of the T ranks
    sharing one model (None: the default group); `rank` is the rank within it.
    `communicate_alone`: run the tensor-parallel path (its collectives) even at size 1, so that
    the capture of NCCL collectives in the decode step can be exercised on one GPU (benchmarks)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    communicate_alone: bool = False

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} outside 0..{self.size - 1}")

    # ------------------------------------------------------------------ slices

    def split(self, count: int) -> range:
        """This rank's equal, contiguous share of `count` items (count % size == 0)."""
        if count % self.size:
            raise ValueError(f"{count} does not split over tensor parallel size {self.size}")
        share = count // self.size
        return range(self.rank * share, (self.rank + 1) * share)

    def q_heads(self, num_heads: int) -> range:
        return self.split(num_heads)

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> range:
        """Split when the kv heads divide over the ranks, else (T % Hkv == 0) the one kv head
        that this rank's query heads share, replicated on T / Hkv ranks."""
        if num_kv_heads % self.size == 0:
            held = self.split(num_kv_heads)
        elif self.size % num_kv_heads == 0:
            head = self.rank // (self.size // num_kv_heads)
            held = range(head, head + 1)
        else:
            raise ValueError(f"{num_kv_heads} kv heads do not split over tensor parallel size {self.size}")
        group = num_heads // num_kv_heads  # query heads per kv head under GQA
        q = self.q_heads(num_heads)
        if (q.start // group, -(-q.stop // group)) != (held.start, held.stop):
            raise ValueError(f"rank {self.rank}'s query heads {q} do not use exactly kv heads {held}")
        return held

    def vocab(self, vocab_size: int) -> range:
        """This rank's rows of the vocabulary padded up to a multiple of the size."""
        return self.split(-(-vocab_size // self.size) * self.size)

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (x is returned)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x [..., n] concatenated along the last dim in rank order: [..., size * n]."""
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out.unflatten(0, (self.size, x.shape[0])).movedim(0, -2).flatten(-2)

    def capturable(self) -> bool:
        """Whether the collectives may run inside a CUDA graph (NCCL's can, gloo's cannot)."""
        return "nccl" in str(dist.get_backend(self.group))

    def shared_seed(self, device: torch.device) -> int:
        """A seed drawn from rank 0's torch generator, the same on every rank: ranks that drew
        their own would sample different tokens from the same logits and their caches would part."""
        seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).to(device)
        dist.broadcast(seed, group=self.group, group_src=0)
        return int(seed.item())


def rank_slices(shape, tp: TensorParallel | None) -> RankSlices:
    """The slices of `shape`'s model a rank holds (all of it without tensor parallelism)."""
    if tp is None:
        return RankSlices(range(shape.num_heads), range(shape.num_kv_heads), range(shape.intermediate_size),
                          range(shape.vocab_size))
    reason = tp_unsupported_reason(shape, tp.size)
    if reason:
        raise ValueError(f"rollout engine: {reason}")
    return RankSlices(tp.q_heads(shape.num_heads), tp.kv_heads(shape.num_heads, shape.num_kv_heads),
                      tp.split(shape.intermediate_size), tp.vocab(shape.vocab_size))
