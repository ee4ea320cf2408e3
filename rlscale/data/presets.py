"""Dataset presets and `build_datasets`, the one entry point the trainer calls.

A preset names where the data lives, which fields hold problem and answer, and the default
prompt template; data.prompt_key / answer_key / prompt_template (and hf_name / hf_subset /
train_split / val_split) override it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from rlscale.config import DataConfig
from rlscale.data.arithmetic import ARITHMETIC_TEMPLATE, ArithmeticSource
from rlscale.data.problem import ListSource, Problem, ProblemSource, check_template
from rlscale.data.readers import FieldMap, carve_off, read_hf, read_jsonl, read_parquet
from rlscale.errors import UserError

MATH_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."

Kind = Literal["arithmetic", "hub", "jsonl", "parquet"]


def gsm8k_answer(solution: str) -> str:
    """gsm8k answers are worked solutions ending in '#### 1,234'; the number is what is graded."""
    _, marker, final = solution.rpartition("####")
    if not marker:
        raise ValueError("has no '####' final-answer marker")
    return final.strip().replace(",", "")


@dataclass(frozen=True)
class Preset:
    name: str
    kind: Kind
    template: str = "{problem}"  # generic sources: the file's text is the prompt, unchanged
    prompt_key: str = "problem"
    answer_key: str = "answer"
    hf_name: str | None = None
    hf_subset: str | None = None
    train_split: str = "train"
    val_split: str | None = None  # None: carve data.val_size problems off the train split
    extract_answer: Callable[[str], str] | None = field(default=None, repr=False)


PRESETS = [
    Preset("arithmetic", "arithmetic", template=ARITHMETIC_TEMPLATE),
    Preset("DeepScaler", "hub", MATH_TEMPLATE, hf_name="agentica-org/DeepScaleR-Preview-Dataset"),
    Preset("gsm8k", "hub", MATH_TEMPLATE, "question", "answer", hf_name="openai/gsm8k",
           hf_subset="main", val_split="test", extract_answer=gsm8k_answer),
    Preset("OpenMathInstruct-2", "hub", MATH_TEMPLATE, "problem", "expected_answer",
           hf_name="nvidia/OpenMathInstruct-2", train_split="train_1M"),
    Preset("jsonl", "jsonl"),
    Preset("parquet", "parquet"),
    Preset("huggingface", "hub"),
]

# Keys that select or shape a source; setting one the chosen dataset ignores is almost always a
# mistake (e.g. data.train_path without data.dataset_name=jsonl would silently train arithmetic).
_SOURCE_KEYS = {
    "arithmetic": set(),
    "jsonl": {"train_path", "val_path", "prompt_key", "answer_key"},
    "parquet": {"train_path", "val_path", "prompt_key", "answer_key"},
    "hub": {"hf_name", "hf_subset", "train_split", "val_split", "prompt_key", "answer_key"},
}


@dataclass
class Datasets:
    train: ProblemSource
    val: list[Problem]
    name: str = ""  # the preset's canonical name, for logs


def find_preset(name: str) -> Preset:
    for preset in PRESETS:
        if preset.name.casefold() == name.casefold():
            return preset
    valid = ", ".join(p.name for p in PRESETS)
    raise UserError(f"data.dataset_name={name!r} is not a known dataset (valid: {valid})")


def _given(cfg: DataConfig, key: str) -> bool:
    """True when the user set `key` to something other than its default."""
    return key in cfg.model_fields_set and getattr(cfg, key) != DataConfig.model_fields[key].default


def _check_unused_keys(cfg: DataConfig, preset: Preset) -> None:
    all_keys = set().union(*_SOURCE_KEYS.values())
    for key in sorted(all_keys - _SOURCE_KEYS[preset.kind]):
        if _given(cfg, key):
            users = ", ".join(p.name for p in PRESETS if key in _SOURCE_KEYS[p.kind])
            raise UserError(f"data.{key} is set but data.dataset_name={cfg.dataset_name!r} does not "
                            f"use it (used by: {users})")


def _field_map(cfg: DataConfig, preset: Preset) -> FieldMap:
    answer_key = cfg.answer_key or preset.answer_key
    # The preset's answer extractor describes the preset's own answer field only.
    extract = preset.extract_answer if answer_key == preset.answer_key else None
    template = preset.template if cfg.prompt_template is None else check_template(cfg.prompt_template)
    return FieldMap(cfg.prompt_key or preset.prompt_key, answer_key, template, extract)


def _without_val_texts(train: list[Problem], val: list[Problem], label: str) -> list[Problem]:
    """Drop training rows whose prompt equals a held-out prompt (duplicates leak the answer)."""
    val_texts = {p.text for p in val}
    kept = [p for p in train if p.text not in val_texts]
    if not kept:
        raise UserError(f"{label}: every training problem also appears in the held-out set")
    return kept


def _load_files(cfg: DataConfig, preset: Preset, fields: FieldMap, seed: int):
    read = read_jsonl if preset.kind == "jsonl" else read_parquet
    train = read(cfg.train_path, fields, "data.train_path")
    if cfg.val_path:
        return train, read(cfg.val_path, fields, "data.val_path")
    return carve_off(train, cfg.val_size, seed, f"'{cfg.train_path}'")


def _load_hub(cfg: DataConfig, preset: Preset, fields: FieldMap, seed: int):
    name = cfg.hf_name or preset.hf_name  # one of them is set: check_data_config saw to it
    subset = cfg.hf_subset or preset.hf_subset
    train_split = cfg.train_split if _given(cfg, "train_split") else preset.train_split
    val_split = cfg.val_split or preset.val_split
    train = read_hf(name, subset, train_split, fields)
    if val_split:
        return train, read_hf(name, subset, val_split, fields)
    return carve_off(train, cfg.val_size, seed, f"dataset '{name}' split '{train_split}'")


def check_data_config(data_cfg: DataConfig) -> Preset:
    """What can be checked without reading a file: the dataset is known, its keys are the ones it
    uses, the ones it needs are there, the template is usable. `build_datasets` and
    `rlscale.config_loading.load_config` run it, so `train --dry-run`, `job submit` and
    `cluster render` refuse what a run would refuse."""
    preset = find_preset(data_cfg.dataset_name)
    _check_unused_keys(data_cfg, preset)
    if preset.kind in ("jsonl", "parquet") and not data_cfg.train_path:
        raise UserError(f"data.train_path is required for data.dataset_name={preset.name}")
    if preset.kind == "hub" and not (data_cfg.hf_name or preset.hf_name):
        raise UserError("data.hf_name is required for data.dataset_name=huggingface")
    if data_cfg.prompt_template is not None:
        check_template(data_cfg.prompt_template)
    return preset


def build_datasets(data_cfg: DataConfig, seed: int) -> Datasets:
    """Training source and held-out problems for the configured dataset; raises UserError."""
    preset = check_data_config(data_cfg)
    fields = _field_map(data_cfg, preset)
    if preset.kind == "arithmetic":
        # the arithmetic task has its own seed so its held-out set stays fixed across runs
        source = ArithmeticSource(data_cfg.arithmetic, data_cfg.arithmetic.seed, fields.template)
        return Datasets(source, source.held_out, preset.name)
    load = _load_hub if preset.kind == "hub" else _load_files
    train, val = load(data_cfg, preset, fields, seed)
    train = _without_val_texts(train, val, f"data.dataset_name={preset.name}")
    return Datasets(ListSource(train), val, preset.name)
