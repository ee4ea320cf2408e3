"""Read problems from jsonl, parquet and Hugging Face datasets, checking every row up front.

Each reader returns a full list of `Problem`s, so a missing file, column or value fails when
the run starts, not hours later; every error names the file (or dataset) and the line or row.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from rlscale.data.problem import Problem, apply_template
from rlscale.errors import UserError, short_reason


class BadRow(Exception):
    """A row's value is unusable; the message lacks the location, which the caller adds."""


@dataclass(frozen=True)
class FieldMap:
    """Which fields hold the problem and answer, and how to turn them into a `Problem`."""

    prompt_key: str
    answer_key: str
    template: str
    extract_answer: Callable[[str], str] | None = None  # e.g. gsm8k's "... #### 72" -> "72"

    def missing(self, where: str, key: str, present: Iterable[str]) -> UserError:
        which = "prompt_key" if key == self.prompt_key else "answer_key"
        return UserError(f"{where}: no field {key!r} (fields: {', '.join(map(str, present)) or 'none'}); "
                         f"set data.{which}")

    def problem(self, raw_problem: Any, raw_answer: Any) -> Problem:
        """Raises BadRow; kept cheap because it runs once per row of million-row datasets."""
        text = _as_text(self.prompt_key, raw_problem)
        answer = _as_text(self.answer_key, raw_answer)
        if self.extract_answer is not None:
            try:
                answer = self.extract_answer(answer)
            except ValueError as exc:
                raise BadRow(f"field {self.answer_key!r} {exc}") from None
            if not answer:
                raise BadRow(f"field {self.answer_key!r} has an empty final answer")
        return Problem(apply_template(self.template, text), answer)


def _as_text(key: str, value: Any) -> str:
    if isinstance(value, str):
        if not value.strip():
            raise BadRow(f"field {key!r} is empty")
        return value
    if value is None:
        raise BadRow(f"field {key!r} is null")
    if isinstance(value, (int, float)):  # numeric answers in files become strings
        return str(value)
    raise BadRow(f"field {key!r} holds a {type(value).__name__}, expected a string or number")


def _existing_file(path: str, key: str) -> Path:
    p = Path(path)
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else "does not exist"
        raise UserError(f"{key}: '{path}' {what}")
    return p


def _non_empty(problems: list[Problem], label: str) -> list[Problem]:
    if not problems:
        raise UserError(f"{label} holds no problems")
    return problems


def read_jsonl(path: str, fields: FieldMap, key: str = "data.train_path") -> list[Problem]:
    """One JSON object per line; blank lines are skipped."""
    p = _existing_file(path, key)
    problems = []
    line_no = 0
    try:
        with p.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"'{path}' line {line_no}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                if not isinstance(row, dict):
                    raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
                for k in (fields.prompt_key, fields.answer_key):
                    if k not in row:
                        raise fields.missing(where, k, row)
                try:
                    problems.append(fields.problem(row[fields.prompt_key], row[fields.answer_key]))
                except BadRow as exc:
                    raise UserError(f"{where}: {exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"'{path}' line {line_no + 1}: not UTF-8 text") from None
    return _non_empty(problems, f"'{path}'")


def read_parquet(path: str, fields: FieldMap, key: str = "data.train_path") -> list[Problem]:
    import pyarrow.parquet as pq

    p = _existing_file(path, key)
    try:
        names = pq.read_schema(p).names
        for k in (fields.prompt_key, fields.answer_key):
            if k not in names:
                raise fields.missing(f"'{path}'", k, names)
        table = pq.read_table(p, columns=[fields.prompt_key, fields.answer_key])
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"cannot read parquet file '{path}': {short_reason(exc, 200)}") from None
    return _non_empty(_columns_to_problems(
        f"'{path}'", fields, table.column(fields.prompt_key).to_pylist(),
        table.column(fields.answer_key).to_pylist()), f"'{path}'")


def _columns_to_problems(label: str, fields: FieldMap, texts: list, answers: list) -> list[Problem]:
    problems = []
    for i, (text, answer) in enumerate(zip(texts, answers)):
        try:
            problems.append(fields.problem(text, answer))
        except BadRow as exc:
            raise UserError(f"{label} row {i}: {exc}") from None
    return problems


def read_hf(name: str, subset: str | None, split: str, fields: FieldMap) -> list[Problem]:
    """A split of a hub dataset, a local dataset folder, or a `save_to_disk` folder."""
    import datasets  # heavy; only imported when a hub dataset is used

    label = f"dataset '{name}'" + (f" subset '{subset}'" if subset else "") + f" split '{split}'"
    try:
        local = Path(name)
        if (local / "dataset_dict.json").is_file() or (local / "state.json").is_file():
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise UserError(f"{label}: no such split (splits: {', '.join(ds)})")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(name, subset, split=split)
    except UserError:
        raise
    except Exception as exc:  # offline, unknown id, bad subset or split, corrupt cache, ...
        raise UserError(f"cannot load {label}: {short_reason(exc, 200)}") from None
    for k in (fields.prompt_key, fields.answer_key):
        if k not in ds.column_names:
            raise fields.missing(label, k, ds.column_names)
    texts, answers = list(ds[fields.prompt_key]), list(ds[fields.answer_key])
    return _non_empty(_columns_to_problems(label, fields, texts, answers), label)


def carve_off(problems: list[Problem], val_size: int, seed: int, label: str) -> tuple[list[Problem], list[Problem]]:
    """Split `val_size` held-out problems off, deterministically by seed.

    The held-out list is in shuffled order (so any prefix is a random sample); the training
    list keeps the source order minus the held-out rows.
    """
    if val_size >= len(problems):
        raise UserError(f"data.val_size={val_size} leaves no training problems: {label} has "
                        f"{len(problems)}; lower data.val_size or give a held-out set")
    order = list(range(len(problems)))
    random.Random(f"carve:{seed}").shuffle(order)
    held = order[:val_size]
    held_set = set(held)
    return [p for i, p in enumerate(problems) if i not in held_set], [problems[i] for i in held]
