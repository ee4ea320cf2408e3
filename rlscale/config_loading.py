"""Loading a config: defaults, then an optional YAML file, then dotted `key.sub=value` overrides.

The schema (the classes, their defaults and checks) is rlscale/config.py; this module reads the
text a user gave, builds a Config from it and runs the checks that need no file (dataset keys,
reward spec), so `train --dry-run`, `job submit` and `cluster render` refuse what a run would.

A config file may be a NeMo-RL recipe: its `defaults:` (one file or a list, relative to the file
naming them) are read first and merged under it, the command line's overrides are applied, then
`${...}` interpolation is resolved (OmegaConf, with NeMo-RL's resolvers `mul`, `add`, `div`,
`max`), so an override of `policy.max_total_sequence_length` moves every value that refers to it.
NeMo-RL's key names are then mapped to rlscale's by rlscale/nemo_rl.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlscale.config import Config, check_reward_spec, flat_dict
from rlscale.data.presets import check_data_config
from rlscale.errors import UserError, short_reason, validation_message
from rlscale.errors import _capped as capped

_OVERRIDE = "<command line>"  # the origin of an override


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if child is None:  # a section a recipe set to null (NeMo-RL's `optimizer: null`), given keys again
            child = node[key] = {}
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


# ---------------------------------------------------------------- recipes: defaults and ${...}


def read_recipe(path: str | Path, _chain: tuple[Path, ...] = ()) -> tuple[dict[str, Any], dict[str, str]]:
    """A config file with its `defaults:` merged under it, depth first, later ones winning (NeMo-RL's
    rule: a mapping merges into a mapping, any other value, null included, replaces); returns the
    tree and, for each dotted leaf, the file that set it."""
    path = Path(path)
    if path.resolve() in _chain:
        raise UserError(f"config file {str(_chain[0])!r}: its defaults: chain includes {str(path)!r} twice")
    tree = read_yaml_mapping(path, "config file", "sections")
    origins = {key: str(path) for key in flat_dict(tree)}
    defaults = tree.pop("defaults", None)
    origins.pop("defaults", None)
    if defaults is None:
        return tree, origins
    names = [defaults] if isinstance(defaults, str) else defaults
    if not isinstance(names, list) or not all(isinstance(name, str) and name.strip() for name in names):
        raise UserError(f"config file {str(path)!r}: defaults must name a file or a list of files "
                        f"(got {short_reason(Exception(repr(defaults)), 120)})")
    base: dict[str, Any] = {}
    base_origins: dict[str, str] = {}
    top = _chain[0].parent if _chain else path.parent
    for name in names:
        parent = Path(name)
        if not parent.is_absolute():
            # relative to the file naming it; NeMo-RL resolves relative to the top recipe's folder
            parent = next((p for p in (path.parent / name, top / name) if p.is_file()), path.parent / name)
        if not parent.is_file():
            raise UserError(f"config file {str(path)!r}: defaults names {name!r}, which is not a file "
                            f"(looked in {str(path.parent)!r})")
        parent_tree, parent_origins = read_recipe(parent, (*_chain, path.resolve()))
        base, base_origins = _merge(base, base_origins, parent_tree, parent_origins)
    return _merge(base, base_origins, tree, origins)


def _merge(base: dict, base_origins: dict[str, str], over: dict, over_origins: dict[str, str]):
    def merged(a: dict, b: dict) -> dict:
        out = dict(a)
        for key, value in b.items():
            out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
                else value
        return out

    tree = merged(base, over)
    return tree, {key: over_origins.get(key, base_origins.get(key, "")) for key in flat_dict(tree)}


def _has_interpolation(tree: Any) -> bool:
    if isinstance(tree, dict):
        return any(_has_interpolation(value) for value in tree.values())
    if isinstance(tree, list):
        return any(_has_interpolation(value) for value in tree)
    return isinstance(tree, str) and "${" in tree


def _register_resolvers(omegaconf) -> None:
    """NeMo-RL's resolvers (nemo_rl/utils/config.py), registered once per process."""
    for name, function in (("mul", lambda a, b: a * b), ("add", lambda a, b: a + b),
                           ("div", lambda a, b: a / b), ("max", lambda a, b: max(a, b))):
        if not omegaconf.OmegaConf.has_resolver(name):  # register_resolver from OmegaConf 2.4 on
            register = getattr(omegaconf.OmegaConf, "register_resolver", omegaconf.OmegaConf.register_new_resolver)
            register(name, function)


def _culprit(tree: dict[str, Any], message: str, key: str) -> str:
    """The key whose own `${...}` names the missing key of `message` (OmegaConf names the key it was
    resolving, which may only refer to the culprit); else `key`."""
    import re

    missing = re.search(r"Interpolation key '([^']+)' not found", message)
    if missing:
        for dotted, value in flat_dict(tree).items():
            if isinstance(value, str) and re.search(r"\$\{\s*" + re.escape(missing.group(1)) + r"\s*[}:]", value):
                return dotted
    return key


def resolve_interpolation(tree: dict[str, Any], where) -> dict[str, Any]:
    """`${a.b}`, `${.sibling}`, `${..up.key}` and `${mul:x, y}` resolved; one-line UserError naming
    the key and its file where one cannot be."""
    if not _has_interpolation(tree):
        return tree
    import omegaconf

    _register_resolvers(omegaconf)
    try:
        return omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.create(tree), resolve=True)
    except omegaconf.errors.OmegaConfBaseException as exc:
        reason = short_reason(exc, 200).rstrip(".")
        key = _culprit(tree, reason, getattr(exc, "full_key", None) or "")
        where_text = f" ({where(key)})" if key else ""
        raise UserError(f"config key {key!r}{where_text}: cannot resolve its ${{...}}: {reason}" if key else
                        f"config: cannot resolve a ${{...}} interpolation: {reason}") from None


# ---------------------------------------------------------------- building the Config


@dataclass
class LoadedConfig:
    cfg: Config
    ignored: list[tuple[str, str]] = field(default_factory=list)  # NeMo-RL keys not acted on, and why
    notes: list[str] = field(default_factory=list)  # values changed to fit rlscale

    def ignored_lines(self) -> list[str]:
        """What `rlscale train` prints: one line per NeMo-RL key rlscale does not act on."""
        if not self.ignored:
            return []
        return [f"note: {len(self.ignored)} NeMo-RL key(s) that rlscale does not act on:",
                *(f"  {key}: {reason}" for key, reason in self.ignored)]


def load_config_and_notes(path: str | Path | None = None, overrides: list[str] | None = None,
                          strict: bool = False) -> LoadedConfig:
    """load_config, with the NeMo-RL keys it dropped (and why) and the values it changed.
    strict: refuse a config that holds NeMo-RL keys rlscale does not act on."""
    from rlscale.nemo_rl import COMMAND_LINE, translate

    tree, origins = read_recipe(path) if path is not None else ({}, {})
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
        for known in [k for k in origins if k == key or k.startswith(key + ".") or key.startswith(k + ".")]:
            del origins[known]
        origins[key] = _OVERRIDE

    def where(key: str) -> str:
        """Which file (or the command line) set `key`, a leaf, a section or a key below a leaf."""
        found = origins.get(key) or next((o for k, o in origins.items() if k.startswith(key + ".")), None) \
            or next((o for k, o in origins.items() if key.startswith(k + ".")), None)
        return COMMAND_LINE if found in (None, _OVERRIDE) else f"in config file {found!r}"

    raw = flat_dict(tree)
    resolved = resolve_interpolation(tree, where)
    translation = translate(flat_dict(resolved), raw, where)
    try:
        cfg = Config.model_validate(translation.tree)
    except ValidationError as err:
        message = validation_message(err, "config")
        first = err.errors()[0]
        if first["type"] == "extra_forbidden":  # name the key as written, and its file
            loc = ".".join(str(part) for part in first["loc"])
            written = f"loss_fn.{loc[5:]}" if loc.startswith("loss.") and any(
                k == f"loss_fn.{loc[5:]}" or k.startswith(f"loss_fn.{loc[5:]}.") for k in raw) else loc
            if written != loc:
                message = f"unknown config key {capped(written)!r}"
            if where(written) != COMMAND_LINE:
                message += f" ({where(written)})"
        raise UserError(message) from None
    if strict and translation.ignored:
        keys = [key for key, _ in translation.ignored]
        shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
        raise UserError(f"--strict: rlscale does not act on {len(keys)} NeMo-RL key(s): {shown} (run without "
                        "--strict to see what it does instead of each)")
    # the checks that need no file: a dry run, a job submission or a render refuses what the run would
    check_data_config(cfg.data)
    check_reward_spec(cfg.rewards.function)
    return LoadedConfig(cfg, translation.ignored, translation.notes)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, strict: bool = False) -> Config:
    """Defaults, then the YAML file (a NeMo-RL recipe too), then dotted overrides; raises UserError
    on any problem."""
    return load_config_and_notes(path, overrides, strict).cfg
