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
