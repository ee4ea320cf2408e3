"""Model and tokenizer loading: hub ids, local paths and the project's built-in models."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlscale.errors import UserError, short_reason

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = Path(__file__).resolve().parent.parent / "assets"


def resolve_model_path(name: str, key: str = "policy.model_name") -> str:
    """builtin:NAME -> the shipped directory; anything else is passed to transformers as is
    (a local directory, or a hub id resolved through HF_HOME). `key` names the setting in errors."""
    if name.startswith(BUILTIN_PREFIX):
        path = BUILTIN_DIR / name[len(BUILTIN_PREFIX):]
        if not (path / "config.json").is_file():
            known = sorted(p.name for p in BUILTIN_DIR.iterdir() if p.is_dir()) if BUILTIN_DIR.is_dir() else []
            raise UserError(f"{key}: no built-in model {name!r} (built-ins: {', '.join(known) or 'none'})")
        return str(path)
    local = Path(name).expanduser()
    if local.exists():
        # a tokenizer may live in a directory of its own, without the model's config.json
        markers = ("config.json",) if key != "policy.tokenizer_name" else (
            "tokenizer.json", "tokenizer_config.json", "config.json")
        if not any((local / marker).is_file() for marker in markers):
            kind = "tokenizer" if key == "policy.tokenizer_name" else "model"
            raise UserError(f"{key}: {name!r} is not a {kind} directory (no {' or '.join(markers)})")
        return str(local)
    if local.is_absolute() or name.startswith((".", "~")):
        # A hub id never looks like this; without the check transformers would report
        # "Repo id must be in the form 'namespace/repo_name'" for a mistyped local path.
        raise UserError(f"{key}: {name!r} does not exist")
    return name


def cached_snapshot(repo_id: str, tokenizer_only: bool = False) -> str | None:
    """The local snapshot of hub id `repo_id` in the Hugging Face cache (HF_HOME), if it holds a
    whole model (or tokenizer); else None (transformers then asks the hub and downloads).

    Loading from the snapshot directory asks the hub nothing, as HF_HUB_OFFLINE=1 would: every
    worker of a cluster run reads the shared cache (HF_HOME on the shared volume) without one
    request per file, and a machine that cannot reach the hub starts at once instead of waiting out
    the retries. The cached revision is used as is (a newer one on the hub is not looked for).
    Whole means: a model's config and every weight file its index names (or its single weight
    file); a tokenizer's config, vocabulary and chat template (see `_whole_tokenizer`). Anything
    less (an interrupted download, a tool that fetched one file) is left to transformers."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, or not a valid repo id: transformers reports it
        return None
    if tokenizer_only:
        return str(path) if _whole_tokenizer(path) else None
    if not (path / "config.json").is_file():
        return None
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            try:
                shards = set(json.loads((path / index).read_text(encoding="utf-8"))["weight_map"].values())
            except (OSError, ValueError, KeyError, AttributeError):
                return None
            return str(path) if shards and all((path / shard).is_file() for shard in shards) else None
    single = any((path / name).is_file() for name in ("model.safetensors", "pytorch_model.bin"))
    return str(path) if single else None


def _whole_tokenizer(snapshot: Path) -> bool:
    """A tokenizer's config, its vocabulary, and its chat template known: in the config, in
    chat_template.jinja, or absent on the hub (the cache's .no_exist marker for that revision).
    Without the last, a prompt would silently lose the template the hub has."""
    vocab = [("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",)]
    if not any(all((snapshot / name).is_file() for name in files) for files in vocab):
        return False
    try:
        config = json.loads((snapshot / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    no_template = snapshot.parent.parent / ".no_exist" / snapshot.name / "chat_template.jinja"
    return (isinstance(config, dict) and "chat_template" in config) or (snapshot / "chat_template.jinja").is_file() \
        or no_template.exists()


def _load_path(name: str, key: str, trust_remote_code: bool, tokenizer_only: bool = False) -> str:
    """What to hand transformers for `name`: `resolve_model_path`'s answer, except that a hub id
    whole in the cache becomes its snapshot directory (`cached_snapshot`). Not with remote code:
    its modules are transformers' to fetch."""
    path = resolve_model_path(name, key)
    if path == name and not trust_remote_code:  # a hub id
        path = cached_snapshot(name, tokenizer_only) or name
    return path


def local_weights_dir(name: str, trust_remote_code: bool = False) -> str | None:
    """The local directory holding `name`'s safetensors weights (built-in, a path, or a hub id whole
    in the cache), for a sharded load that reads each rank's part (rlscale.models.sharded_load);
    None otherwise (a hub id to download, .bin weights, remote code): transformers loads those."""
    if trust_remote_code:
        return None
    path = Path(_load_path(name, "policy.model_name", trust_remote_code))
    if path.is_dir() and any((path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        return str(path)
    return None


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("policy.device: 'cuda' was asked for but no CUDA device is available")
    return torch.device(choice)


def pick_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, choice)


def quiet_transformers() -> None:
    """Progress bars and advice from transformers would drown the run's own display."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def load_tokenizer(name: str, trust_remote_code: bool = False, key: str = "policy.model_name"):
    from transformers import AutoTokenizer

    quiet_transformers()
    path = _load_path(name, key, trust_remote_code, tokenizer_only=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types for a bad id or path
        raise UserError(f"cannot load tokenizer {name!r}: {short_reason(exc)}") from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UserError(f"tokenizer {name!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(name: str, tokenizer, extra: list[int] | None = None, trust_remote_code: bool = False) -> list[int]:
    """The token ids that end a response (sorted, no repeats): `extra` (policy.generation.stop_token_ids),
    the tokenizer's eos id, and every eos id of model `name`'s generation_config.json (`eos_token_id`,
    an int or a list; Llama 3 and Qwen2.5 instruct models list several). A model without that file,
    or whose file cannot be read, adds none."""
    from transformers import GenerationConfig

    ids = set(extra or ())
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    quiet_transformers()
    try:
        path = _load_path(name, "policy.model_name", trust_remote_code)
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except Exception:  # no generation_config.json (or an unreadable one): transformers raises many types
        eos = None
    if eos is not None:
        ids.update(int(i) for i in ([eos] if isinstance(eos, int) else eos))
    return sorted(ids)


def load_model(name: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    path = _load_path(name, "policy.model_name", trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise UserError(f"cannot load model {name!r}: {short_reason(exc)}") from None
    return model.to(device)
