"""Model and tokenizer paths: errors name the setting the path came from."""

import pytest

from rlscale.errors import UserError
from rlscale.models.loading import load_tokenizer, resolve_model_path


def test_a_missing_path_is_named_with_its_key(tmp_path):
    with pytest.raises(UserError, match=r"^policy.model_name: '/nonexistent/m' does not exist$"):
        resolve_model_path("/nonexistent/m")
    with pytest.raises(UserError, match=r"^policy.tokenizer_name: '/nonexistent/tok' does not exist$"):
        load_tokenizer("/nonexistent/tok", key="policy.tokenizer_name")
    with pytest.raises(UserError, match=r"^policy.model_name: .* is not a model directory \(no config.json\)$"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(UserError, match=r"^policy.tokenizer_name: .* is not a tokenizer directory \(no tokenizer.json"):
        resolve_model_path(str(tmp_path), "policy.tokenizer_name")
    (tmp_path / "tokenizer.json").write_text("{}")  # a tokenizer of its own, no config.json: fine
    assert resolve_model_path(str(tmp_path), "policy.tokenizer_name") == str(tmp_path)
    with pytest.raises(UserError, match=r"^policy.model_name: no built-in model 'builtin:nope' \(built-ins: .*tiny-arith"):
        resolve_model_path("builtin:nope")
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a hub id passes through


def _hub_cache_entry(cache, repo_id: str, files: dict[str, bytes]):
    """A Hugging Face hub cache entry as downloads leave it: refs/main names a snapshot dir."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    return snapshot


def test_a_cached_hub_id_loads_from_its_snapshot_without_the_hub(tmp_path, monkeypatch):
    """A hub id found whole in the cache loads from the snapshot dir (no request: the hub endpoint
    here is a closed port); a partial entry (config only) is left to transformers."""
    import huggingface_hub.constants
    import torch

    from rlscale.models.loading import cached_snapshot, load_model
    from rlscale.models.tiny import build_char_tokenizer, build_tiny_model

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    source = tmp_path / "source"
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, hidden_size=32, layers=1, heads=2, seed=0).save_pretrained(source)
    tokenizer.save_pretrained(source)
    snapshot = _hub_cache_entry(cache, "acme/tiny", {p.name: p.read_bytes() for p in source.iterdir()})
    if not (snapshot / "chat_template.jinja").exists():  # as transformers' first download records it
        (cache / "models--acme--tiny" / ".no_exist" / snapshot.name).mkdir(parents=True)
        (cache / "models--acme--tiny" / ".no_exist" / snapshot.name / "chat_template.jinja").write_text("")
    assert cached_snapshot("acme/tiny", tokenizer_only=True) == str(snapshot)
    assert cached_snapshot("acme/tiny") == str(snapshot)
    model = load_model("acme/tiny", torch.float32, torch.device("cpu"))
    assert model.config.hidden_size == 32
    assert load_tokenizer("acme/tiny").get_vocab() == tokenizer.get_vocab()

    _hub_cache_entry(cache, "acme/partial", {"config.json": (source / "config.json").read_bytes()})
    assert cached_snapshot("acme/partial") is None and cached_snapshot("acme/partial", tokenizer_only=True) is None
    assert cached_snapshot("acme/not-cached") is None


def test_an_incomplete_cached_snapshot_is_left_to_transformers(tmp_path, monkeypatch):
    """An interrupted sharded download (the index and one shard of two), a stray .bin, or a
    tokenizer config without its vocabulary is not a whole model or tokenizer."""
    import json

    import huggingface_hub.constants

    from rlscale.models.loading import cached_snapshot

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    config = b'{"model_type": "qwen2"}'
    index = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                       "b": "model-00002-of-00002.safetensors"}}).encode()
    snapshot = _hub_cache_entry(tmp_path, "acme/sharded", {"config.json": config, "model.safetensors.index.json": index,
                                                           "model-00001-of-00002.safetensors": b"x"})
    assert cached_snapshot("acme/sharded") is None
    (snapshot / "model-00002-of-00002.safetensors").write_bytes(b"x")
    assert cached_snapshot("acme/sharded") == str(snapshot)
    _hub_cache_entry(tmp_path, "acme/stray", {"config.json": config, "training_args.bin": b"x"})
    assert cached_snapshot("acme/stray") is None
    tokenizer = _hub_cache_entry(tmp_path, "acme/tok", {"tokenizer_config.json": b"{}"})
    assert cached_snapshot("acme/tok", tokenizer_only=True) is None
    (tokenizer / "vocab.json").write_text("{}")
    assert cached_snapshot("acme/tok", tokenizer_only=True) is None  # a BPE vocabulary needs its merges
    (tokenizer / "merges.txt").write_text("")
    # the chat template is not known: not fetched yet, or the repo has none?
    assert cached_snapshot("acme/tok", tokenizer_only=True) is None
    no_exist = tmp_path / "models--acme--tok" / ".no_exist" / tokenizer.name
    no_exist.mkdir(parents=True)
    (no_exist / "chat_template.jinja").write_text("")  # the hub said: none
    assert cached_snapshot("acme/tok", tokenizer_only=True) == str(tokenizer)
    (no_exist / "chat_template.jinja").unlink()
    (tokenizer / "chat_template.jinja").write_text("{{ messages }}")
    assert cached_snapshot("acme/tok", tokenizer_only=True) == str(tokenizer)
