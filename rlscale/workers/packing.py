"""Sequence packing: whole samples concatenated into one row per micro-batch, no padding.

A micro-batch is one row of at most `budget` tokens holding several documents (prompt +
response each). Positions restart at 0 for every document and `cu_seqlens` marks the document
boundaries, so attention never crosses documents (see rlscale.models.packed_attention). Only
response targets need a log-probability: `logit_index` lists the packed positions whose next
token is a response token, `rows`/`cols` where that token sits in the batch's [B, L-1] layout.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from rlscale.workers.batch import TrainBatch


def plan_packs(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` grouped so that each group sums to ≤ budget, groups near-equal in tokens.

    As many groups as first-fit decreasing needs; then each document, longest first, joins the
    group with the most room. Equal groups mean no micro-batch is a small remainder: a remainder
    runs small, inefficient kernels, and under FSDP2 the gradient reduce-scatter, issued during
    the last micro-batch's backward, would have little compute to hide behind.
    Deterministic (ties go to the lower group); documents keep their index order inside a group.
    A document longer than the budget gets a group of its own.
    """
    if budget < 1:
        raise ValueError(f"token budget must be positive, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    count = _first_fit_groups(lengths, order, budget)
    groups: list[list[int]] = [[] for _ in range(count)]
    room = [budget] * count
    for i in order:  # any document means at least one group
        g = max(range(len(room)), key=room.__getitem__)
        if lengths[i] > room[g]:  # fits nowhere: a group of its own
            groups.append([i])
            room.append(budget - lengths[i])
        else:
            groups[g].append(i)
            room[g] -= lengths[i]
    return [sorted(g) for g in groups if g]


def _first_fit_groups(lengths: list[int], order: list[int], budget: int) -> int:
    """How many groups first-fit decreasing fills (a near-minimal count)."""
    room: list[int] = []
    for i in order:
        g = next((g for g, free in enumerate(room) if lengths[i] <= free), None)
        if g is None:
            room.append(budget - lengths[i])
        else:
            room[g] -= lengths[i]
    return len(room)


@dataclass
class PackedMicroBatch:
    input_ids: torch.Tensor  # [1, T] long, documents back to back
    position_ids: torch.Tensor  # [1, T] long, restarting at 0 per document
    cu_seqlens: torch.Tensor  # [D + 1] int32, document boundaries (0, ..., T)
    max_seqlen: int  # longest document
    logit_index: torch.Tensor  # [R] long, packed positions predicting a response token
    targets: torch.Tensor  # [R] long, the response tokens predicted there
    rows: torch.Tensor  # [R] long, batch row of each predicted token
    cols: torch.Tensor  # [R] long, its column in the batch's [B, L-1] response layout

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device) -> PackedMicroBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = to_device(value, device)
        return PackedMicroBatch(**moved)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without draining the GPU's queue: a copy from pageable memory
    first waits for all work queued on the stream (the previous micro-batch's backward), one
    from pinned memory is queued like a kernel (the pinned block is not reused before it ran)."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def pack_documents(docs, response_starts, rows) -> PackedMicroBatch:
    """One packed row from token sequences (lists or 1-D integer arrays); targets from index
    response_starts[d] on are trained on. rows[d] is the batch row of document d (reported back in
    `rows`). Whole-array numpy: a GRPO batch packs ~65k tokens per step, on the step's serial path.
    """
    lengths = np.array([len(doc) for doc in docs], dtype=np.int64)
    bounds = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    ids = np.concatenate([np.asarray(doc, dtype=np.int64) for doc in docs]) if docs else np.zeros(0, np.int64)
    positions = np.arange(len(ids)) - np.repeat(bounds[:-1], lengths)
    # target column t predicts token t + 1; response targets are columns start-1 .. len-2
    first = np.maximum(np.asarray(response_starts, dtype=np.int64).reshape(-1) - 1, 0)
    counts = np.maximum(lengths - 1 - first, 0)
    offsets = np.repeat(np.cumsum(counts) - counts, counts)  # where each document's targets begin
    cols = np.arange(int(counts.sum())) - offsets + np.repeat(first, counts)
    logit_index = cols + np.repeat(bounds[:-1], counts)
    return PackedMicroBatch(
        input_ids=torch.from_numpy(ids)[None], position_ids=torch.from_numpy(positions)[None],
        cu_seqlens=torch.from_numpy(bounds.astype(np.int32)), max_seqlen=int(lengths.max()) if docs else 0,
        logit_index=torch.from_numpy(logit_index), targets=torch.from_numpy(ids[logit_index + 1]),
        rows=torch.from_numpy(np.repeat(np.asarray(rows, dtype=np.int64), counts)), cols=torch.from_numpy(cols))


def pack_batch(batch: TrainBatch, budget: int) -> list[PackedMicroBatch]:
    """Cut a padded TrainBatch into packed micro-batches of at most `budget` tokens each.

    Response targets are read from batch.response_mask (any 1 marks a trained target); they must be
    one span per sample ending at the sample's end, as build_train_batch makes them.
    """
    lengths = batch.attention_mask.sum(1).numpy()
    ids = batch.input_ids.numpy()
    mask = batch.response_mask.numpy() > 0  # [B, L-1]
    if mask.shape[1] == 0:  # one-token samples: no targets, and argmax needs a column
        mask = np.zeros((len(lengths), 1), dtype=bool)
    has = mask.any(1)
    first = mask.argmax(1)
    last = mask.shape[1] - 1 - mask[:, ::-1].argmax(1)
    one_span_to_the_end = (last == lengths - 2) & (last - first + 1 == mask.sum(1))
    bad = np.flatnonzero(has & ~one_span_to_the_end)
    if len(bad):
        raise ValueError(f"sample {bad[0]}: response targets are not one span ending at the sample's end")
    # targets before the span are prompt: the response starts one past the first target
    starts = np.where(has, first + 1, lengths)
    return [pack_documents([ids[i, :lengths[i]] for i in group], starts[group], group)
            for group in plan_packs(lengths.tolist(), budget)]


def filler_pack(pad_id: int) -> PackedMicroBatch:
    """A two-token micro-batch with nothing to train on: keeps sharded workers in lockstep
    (every FSDP forward/backward is a collective) when one has fewer micro-batches."""
    return pack_documents([[pad_id, pad_id]], [2], [0])
