import datasets
import pytest

from rlscale.config import DataConfig
from rlscale.config_loading import load_config
from rlscale.data import Problem, build_datasets
from rlscale.data.presets import MATH_TEMPLATE, find_preset, gsm8k_answer
from rlscale.errors import UserError


def hub_folder(root, write_jsonl, config_name, splits):
    """A local dataset laid out like a hub repo: README metadata naming configs and split files."""
    root.mkdir()
    lines = ["---", "configs:", f"- config_name: {config_name}", "  data_files:"]
    for split, rows in splits.items():
        write_jsonl(root / f"{split}.jsonl", rows)
        lines += [f"  - split: {split}", f"    path: {split}.jsonl"]
    (root / "README.md").write_text("\n".join(lines + ["---", ""]))
    return str(root)


def math(problem):
    return MATH_TEMPLATE.replace("{problem}", problem)


@pytest.mark.parametrize("name,canonical", [
    ("deepscaler", "DeepScaler"), ("DeepScaleR", "DeepScaler"), ("DeepScaler", "DeepScaler"),
    ("GSM8K", "gsm8k"), ("openmathinstruct-2", "OpenMathInstruct-2"), ("Arithmetic", "arithmetic"),
    ("HuggingFace", "huggingface")])
def test_dataset_names_match_case_insensitively(name, canonical):
    assert find_preset(name).name == canonical


def test_unknown_dataset_lists_the_valid_names():
    with pytest.raises(UserError, match=r"dataset_name='mathz' .*valid: arithmetic, DeepScaler, gsm8k, "
                                        r"OpenMathInstruct-2, jsonl, parquet, huggingface"):
        build_datasets(DataConfig(dataset_name="mathz"), 0)


def test_math_template_asks_for_a_boxed_answer():
    assert math("1+1?") == "1+1?\nPlease reason step by step, and put your final answer within \\boxed{}."


def test_gsm8k_answer_extraction():
    assert gsm8k_answer("She pays 3*4=<<3*4=12>>12.\n#### 1,200 ") == "1200"
    assert gsm8k_answer("a #### b\n#### -7") == "-7"  # the last marker wins
    with pytest.raises(ValueError, match="####"):
        gsm8k_answer("no marker here")


def test_arithmetic_preset_builds_unlimited_train_and_held_out():
    ds = build_datasets(DataConfig(), seed=0)
    assert ds.train.size is None and len(ds.val) == 256 and ds.name == "arithmetic"
    assert ds.val[0].text.endswith("=") and ds.val[0].answer.lstrip("-").isdigit()


def test_template_without_placeholder_is_a_user_error():
    with pytest.raises(UserError, match=r"data.prompt_template='Solve:' must contain \{problem\}"):
        build_datasets(DataConfig(prompt_template="Solve:"), 0)


def test_keys_the_dataset_ignores_are_user_errors():
    # checked when the config loads (so a dry run or a job submission refuses it), and again by
    # build_datasets for a DataConfig made any other way
    with pytest.raises(UserError, match=r"data.train_path is set but data.dataset_name='arithmetic' "
                                        r"does not use it \(used by: jsonl, parquet\)"):
        load_config(overrides=["data.train_path=x.jsonl"])  # forgot data.dataset_name=jsonl
    with pytest.raises(UserError, match=r"data.train_path is set but data.dataset_name='arithmetic'"):
        build_datasets(DataConfig(train_path="x.jsonl"), 0)
    with pytest.raises(UserError, match=r"data.train_path is required for data.dataset_name=jsonl"):
        load_config(overrides=["data.dataset_name=jsonl"])
    with pytest.raises(UserError, match=r"data.prompt_template='\{foo\}' must contain \{problem\}"):
        load_config(overrides=["data.prompt_template={foo}"])
    with pytest.raises(UserError, match=r"rewards.function 'garbage' must be 'math' or 'package.module:function'"):
        load_config(overrides=["rewards.function=garbage"])
    with pytest.raises(UserError, match="data.hf_subset is set"):
        build_datasets(DataConfig(dataset_name="jsonl", hf_subset="main"), 0)


def test_gsm8k_preset_maps_fields_extracts_answers_and_uses_test_split(tmp_path, offline_hf, write_jsonl):
    folder = hub_folder(tmp_path / "gsm8k", write_jsonl, "main", {
        "train": [{"question": "Q1", "answer": "work\n#### 1,000"}, {"question": "Q2", "answer": "#### 2"}],
        "test": [{"question": "Q3", "answer": "x\n#### 3"}]})
    ds = build_datasets(DataConfig(dataset_name="gsm8k", hf_name=folder), 0)
    assert [ds.train[i] for i in range(ds.train.size)] == [Problem(math("Q1"), "1000"), Problem(math("Q2"), "2")]
    assert ds.val == [Problem(math("Q3"), "3")]


def test_gsm8k_row_without_marker_names_the_row(tmp_path, offline_hf, write_jsonl):
    folder = hub_folder(tmp_path / "gsm8k", write_jsonl, "main", {
        "train": [{"question": "Q1", "answer": "#### 1"}, {"question": "Q2", "answer": "2"}],
        "test": [{"question": "Q3", "answer": "#### 3"}]})
    with pytest.raises(UserError, match=r"split 'train' row 1: field 'answer' has no '####'"):
        build_datasets(DataConfig(dataset_name="gsm8k", hf_name=folder), 0)


def test_openmathinstruct_reads_train_1m_and_carves_val(tmp_path, offline_hf, write_jsonl):
    rows = [{"problem": f"P{i}", "expected_answer": i, "generated_solution": "..."} for i in range(6)]
    folder = hub_folder(tmp_path / "omi2", write_jsonl, "default", {"train_1M": rows})
    ds = build_datasets(DataConfig(dataset_name="OpenMathInstruct-2", hf_name=folder, val_size=2), 4)
    assert ds.train.size == 4 and len(ds.val) == 2
    everything = ds.val + [ds.train[i] for i in range(4)]
    assert sorted(p.answer for p in everything) == [str(i) for i in range(6)]
    assert all(p.text == math(f"P{p.answer}") for p in everything)
    again = build_datasets(DataConfig(dataset_name="OpenMathInstruct-2", hf_name=folder, val_size=2), 4)
    assert again.val == ds.val


def test_deepscaler_missing_column_names_dataset_and_key(tmp_path, offline_hf, write_jsonl):
    folder = hub_folder(tmp_path / "ds", write_jsonl, "default", {"train": [{"problem": "p", "solution": "s"}]})
    with pytest.raises(UserError, match=r"dataset '.*ds' split 'train': no field 'answer' "
                                        r"\(fields: problem, solution\); set data.answer_key"):
        build_datasets(DataConfig(dataset_name="deepscaler", hf_name=folder), 0)


def test_generic_huggingface_reads_a_saved_dataset_dict(tmp_path, offline_hf):
    path = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"q": ["a", "b"], "a": [1, 2]}),
        "validation": datasets.Dataset.from_dict({"q": ["c"], "a": [3]}),
    }).save_to_disk(str(path))
    cfg = DataConfig(dataset_name="huggingface", hf_name=str(path), val_split="validation",
                     prompt_key="q", answer_key="a", prompt_template="> {problem}")
    ds = build_datasets(cfg, 0)
    assert [ds.train[i] for i in range(2)] == [Problem("> a", "1"), Problem("> b", "2")]
    assert ds.val == [Problem("> c", "3")]
    with pytest.raises(UserError, match="split 'test': no such split \\(splits: train, validation\\)"):
        build_datasets(cfg.model_copy(update={"val_split": "test"}), 0)


def test_unreachable_hub_dataset_is_a_one_line_user_error(offline_hf):
    with pytest.raises(UserError) as err:
        build_datasets(DataConfig(dataset_name="huggingface", hf_name="no-such-org/no-such-dataset"), 0)
    msg = str(err.value)
    assert msg.startswith("cannot load dataset 'no-such-org/no-such-dataset' split 'train': ")
    assert "\n" not in msg


def test_generic_huggingface_needs_a_name():
    with pytest.raises(UserError, match="data.hf_name is required"):
        build_datasets(DataConfig(dataset_name="huggingface"), 0)


def test_explicit_train_split_overrides_the_preset_split(tmp_path, offline_hf, write_jsonl):
    rows = [{"problem": f"P{i}", "expected_answer": str(i)} for i in range(4)]
    folder = hub_folder(tmp_path / "omi2", write_jsonl, "default", {"train_2M": rows})
    with pytest.raises(UserError, match="split 'train_1M'"):  # the preset's default split
        build_datasets(DataConfig(dataset_name="OpenMathInstruct-2", hf_name=folder, val_size=1), 0)
    cfg = load_config(overrides=["data.dataset_name=OpenMathInstruct-2", f"data.hf_name={folder}",
                                 "data.train_split=train_2M", "data.val_size=1"])
    ds = build_datasets(cfg.data, 0)
    assert ds.train.size == 3 and len(ds.val) == 1
