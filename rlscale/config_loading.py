"""Loading a config: defaults, then an optional YAML file, then dotted `key.sub=value` overrides.

The schema (the classes, their defaults and checks) is rlscale/config.py; this module reads the
text a user gave, builds a Config from it and runs the checks that need no file (dataset keys,
reward spec), so `train --dry-run`, `job submit` and `cluster render` refuse what a run would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlscale.config import Config, check_reward_spec
from rlscale.data.presets import check_data_config
from rlscale.errors import UserError, validation_message


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise UserError(f"override {dotted!r}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'grpo.max_num_steps=20' -> ('grpo.max_num_steps', 20); values are read as YAML scalars."""
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"override {text!r} is not of the form key.sub=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if value is not None and not isinstance(value, str) and _is_text_key(key):
        # A string key takes the text as typed: `data.prompt_template={problem}` is not a YAML
        # mapping, `data.hf_subset=2023` not a number, `data.arithmetic.operations=-` not a list.
        value = raw
    return key, value


def _is_text_key(dotted: str) -> bool:
    """True when `dotted` names a leaf typed str or str | None."""
    model: type[BaseModel] = Config
    *sections, leaf = dotted.split(".")
    for name in sections:
        field = model.model_fields.get(name)
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return False
        model = annotation
    field = model.model_fields.get(leaf)
    return field is not None and field.annotation in (str, str | None)


class _DuplicateKey(Exception):
    def __init__(self, key, line: int):
        super().__init__(key)
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a mapping that names a key twice (two `grpo:` sections
    would otherwise merge as "the last one wins", dropping the first's settings unseen)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden on purpose
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml_mapping(path: str | Path, what: str, of: str = "keys") -> dict[str, Any]:
    """A YAML file that must hold a mapping (empty file: {}); one-line UserError naming the file."""
    path = Path(path)
    try:
        loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except OSError as exc:
        raise UserError(f"cannot read {what} {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {str(path)!r} is not UTF-8 text (byte {exc.start})") from None
    except _DuplicateKey as exc:
        raise UserError(f"{what} {str(path)!r}: key {exc.key!r} appears twice in one mapping (line {exc.line}); "
                        "YAML would keep the last silently") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{what} {str(path)!r} is not valid YAML{where}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise UserError(f"{what} {str(path)!r} must hold a mapping of {of}")
    return loaded or {}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then dotted overrides; raises UserError on any problem."""
    tree: dict[str, Any] = read_yaml_mapping(path, "config file", "sections") if path is not None else {}
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as err:
        raise UserError(validation_message(err, "config")) from None
    # the checks that need no file: a dry run, a job submission or a render refuses what the run would
    check_data_config(cfg.data)
    check_reward_spec(cfg.rewards.function)
    return cfg
