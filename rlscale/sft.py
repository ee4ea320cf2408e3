"""Supervised warm start of the built-in tiny model on the arithmetic task.

`rlscale sft` reproduces the shipped `builtin:tiny-arith` model from scratch. The warm start is
deliberately imperfect: in a share of the examples that need a carry, the target answer is the
classic slip of a beginner who forgets to carry (47+38 -> 75). The model thus starts with the
right format and a habit that a verifiable reward can correct, which leaves GRPO room to show
learning on a laptop CPU within minutes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlscale.config import ArithmeticConfig
from rlscale.data.arithmetic import ARITHMETIC_TEMPLATE, ArithmeticSource
from rlscale.errors import UserError
from rlscale.models.tiny import build_char_tokenizer, build_tiny_model


SFT_STREAM_OFFSET = 10_000_000


@dataclass
class SFTSettings:
    steps: int = 1500
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 30
    slip_rate: float = 0.6  # share of carry problems shown with the carry forgotten
    max_operand: int = 99
    seed: int = 0
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4


def forgot_carry_sum(a: int, b: int) -> int:
    """a + b computed digit by digit with every carry dropped: 47+38 -> 75."""
    result, place = 0, 1
    while a or b:
        result += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return result


def warm_start_target(a: int, b: int, rng: random.Random, slip_rate: float) -> str:
    answer = a + b
    slipped = forgot_carry_sum(a, b)
    if slipped != answer and rng.random() < slip_rate:
        answer = slipped
    return f"\\boxed{{{answer}}}"


def _batch(tokenizer, source: ArithmeticSource, start: int, size: int, rng, slip_rate: float):
    rows, masks = [], []
    for index in range(start, start + size):
        a, _op, b = source.train_key(index)
        prompt = tokenizer(ARITHMETIC_TEMPLATE.replace("{problem}", f"{a}+{b}"), add_special_tokens=False)["input_ids"]
        target = tokenizer(warm_start_target(a, b, rng, slip_rate), add_special_tokens=False)["input_ids"]
        target = target + [tokenizer.eos_token_id]
        rows.append(prompt + target)
        masks.append([0] * len(prompt) + [1] * len(target))
    width = max(len(r) for r in rows)
    ids = torch.full((size, width), tokenizer.pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((size, width), dtype=torch.bool)
    for i, (row, mask) in enumerate(zip(rows, masks)):
        ids[i, : len(row)] = torch.tensor(row)
        loss_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
    return ids, loss_mask


def run_sft(out_dir: str | Path, settings: SFTSettings = SFTSettings(), log=print) -> Path:
    # checked before training: the result replaces out_dir whole, so it must be a model dir (or new/empty)
    out_dir = Path(out_dir).resolve()
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not (
            (out_dir / "config.json").exists() or (out_dir / "rlscale_sft.json").exists()))):
        raise UserError(f"--out {str(out_dir)!r} exists and is not a model directory (no config.json): give a new "
                        "or empty directory, or a model directory to replace")
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, settings.hidden_size, settings.layers, settings.heads, settings.seed)
    # The same held-out set as GRPO's default run is excluded; the stream starts far from the
    # indices a GRPO run reads first.
    arithmetic = ArithmeticConfig(max_operand=settings.max_operand, operations="+")
    source = ArithmeticSource(arithmetic, arithmetic.seed)

    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / settings.warmup_steps) * max(0.05, 1 - s / settings.steps))
    model.train()
    started = time.perf_counter()
    for step in range(settings.steps):
        ids, loss_mask = _batch(tokenizer, source, SFT_STREAM_OFFSET + step * settings.batch_size,
                                settings.batch_size, rng, settings.slip_rate)
        logits = model(input_ids=ids).logits[:, :-1]
        targets = ids[:, 1:]
        mask = loss_mask[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == settings.steps - 1:
            log(f"sft step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - started:.0f}s")
    # written beside the target and swapped in whole: the built-in model is what every default run
    # loads, and an interrupted save must not leave it half-written
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.sft-tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / "rlscale_sft.json").write_text(json.dumps(settings.__dict__, indent=2) + "\n")
    old = out_dir.with_name(f".{out_dir.name}.sft-old-{os.getpid()}")
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(staging, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir
