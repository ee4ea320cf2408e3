"""`rlscale sft` rebuilds the built-in model's recipe: a loadable Qwen2 model and char tokenizer."""

import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from rlscale.models.loading import BUILTIN_DIR
from rlscale.sft import forgot_carry_sum
from tests.integration.helpers import run_cli


def test_forgot_carry_sum_drops_every_carry():
    assert forgot_carry_sum(47, 38) == 75
    assert forgot_carry_sum(99, 1) == 90
    assert forgot_carry_sum(12, 30) == 42  # no carry: the true sum


def test_sft_writes_a_model_that_loads_and_records_its_recipe(tmp_path):
    out = tmp_path / "tiny"
    result = run_cli("sft", "--out", str(out), "--steps", "3", cwd=tmp_path)
    assert result.returncode == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "qwen2"
    assert tokenizer.decode(tokenizer("47+38=")["input_ids"]) == "47+38="
    recipe = json.loads((out / "rlscale_sft.json").read_text())
    shipped = json.loads((BUILTIN_DIR / "tiny-arith" / "rlscale_sft.json").read_text())
    assert recipe["steps"] == 3
    assert {k: v for k, v in recipe.items() if k != "steps"} == {k: v for k, v in shipped.items() if k != "steps"}
    # run again into the same directory: replaced whole, nothing left beside it
    again = run_cli("sft", "--out", str(out), "--steps", "2", cwd=tmp_path)
    assert again.returncode == 0, again.output
    assert json.loads((out / "rlscale_sft.json").read_text())["steps"] == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tiny")) == []


def test_sft_refuses_to_replace_a_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    result = run_cli("sft", "--out", str(tmp_path / "mine"), "--steps", "1", cwd=tmp_path)
    assert result.returncode == 2 and "is not a model directory" in result.output
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
