import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlscale.config import DataConfig
from rlscale.data import Problem, build_datasets
from rlscale.data.readers import carve_off
from rlscale.errors import UserError


def rows(n):
    return [{"problem": f"What is {i}+1?", "answer": i + 1} for i in range(n)]


def train_list(ds):
    return [ds.train[i] for i in range(ds.train.size)]


def test_jsonl_field_mapping_template_and_numeric_answers(tmp_path, write_jsonl):
    train = write_jsonl(tmp_path / "train.jsonl", [{"q": "2+2?", "sol": 4}, {"q": "3*3?", "sol": "9"}])
    val = write_jsonl(tmp_path / "val.jsonl", [{"q": "1+1?", "sol": 2.5}])
    cfg = DataConfig(dataset_name="JSONL", train_path=str(train), val_path=str(val),
                     prompt_key="q", answer_key="sol", prompt_template="Solve: {problem}\nAnswer:")
    ds = build_datasets(cfg, seed=0)
    assert ds.name == "jsonl"
    assert train_list(ds) == [Problem("Solve: 2+2?\nAnswer:", "4"), Problem("Solve: 3*3?\nAnswer:", "9")]
    assert ds.val == [Problem("Solve: 1+1?\nAnswer:", "2.5")]


def test_parquet_default_keys_and_plain_template(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"problem": ["a", "b"], "answer": [1, 2], "extra": [0, 0]}), path)
    val = tmp_path / "val.parquet"
    pq.write_table(pa.table({"problem": ["c"], "answer": [3]}), val)
    ds = build_datasets(DataConfig(dataset_name="parquet", train_path=str(path), val_path=str(val)), 0)
    assert train_list(ds) == [Problem("a", "1"), Problem("b", "2")]
    assert ds.val == [Problem("c", "3")]


def test_carve_off_is_deterministic_disjoint_and_complete(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "train.jsonl", rows(20))
    cfg = DataConfig(dataset_name="jsonl", train_path=str(path), val_size=5)
    a, b, c = build_datasets(cfg, 1), build_datasets(cfg, 1), build_datasets(cfg, 2)
    assert a.val == b.val and train_list(a) == train_list(b)
    assert a.val != c.val
    assert len(a.val) == 5 and a.train.size == 15
    assert not {p.text for p in a.val} & {p.text for p in train_list(a)}
    assert sorted(p.text for p in a.val + train_list(a)) == sorted(f"What is {i}+1?" for i in range(20))


def test_carve_off_keeps_training_order():
    problems = [Problem(str(i), str(i)) for i in range(10)]
    train, val = carve_off(problems, 4, seed=0, label="x")
    assert [int(p.text) for p in train] == sorted(int(p.text) for p in train)
    assert len(val) == 4


def test_carving_everything_is_a_user_error(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "small.jsonl", rows(3))
    with pytest.raises(UserError, match=r"data.val_size=3 .*small.jsonl' has 3"):
        build_datasets(DataConfig(dataset_name="jsonl", train_path=str(path), val_size=3), 0)


def test_training_rows_equal_to_held_out_rows_are_dropped(tmp_path, write_jsonl):
    train = write_jsonl(tmp_path / "train.jsonl", rows(4))
    val = write_jsonl(tmp_path / "val.jsonl", rows(2))
    ds = build_datasets(DataConfig(dataset_name="jsonl", train_path=str(train), val_path=str(val)), 0)
    assert [p.text for p in train_list(ds)] == ["What is 2+1?", "What is 3+1?"]


def test_missing_jsonl_field_names_file_line_and_key(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "train.jsonl", [{"problem": "a", "answer": 1}, {"problem": "b", "ans": 2}])
    with pytest.raises(UserError) as err:
        build_datasets(DataConfig(dataset_name="jsonl", train_path=str(path)), 0)
    msg = str(err.value)
    assert "train.jsonl' line 2" in msg and "'answer'" in msg and "data.answer_key" in msg
    assert "\n" not in msg


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"problem": "a", "answer": 1}\n\n{"problem": "b", "answer": \n')
    with pytest.raises(UserError, match=r"train.jsonl' line 3: not valid JSON"):
        build_datasets(DataConfig(dataset_name="jsonl", train_path=str(path)), 0)


def test_non_object_and_null_values_are_user_errors(tmp_path, write_jsonl):
    path = tmp_path / "train.jsonl"
    path.write_text('[1, 2]\n')
    with pytest.raises(UserError, match="line 1: expected a JSON object"):
        build_datasets(DataConfig(dataset_name="jsonl", train_path=str(path)), 0)
    path = write_jsonl(tmp_path / "null.jsonl", [{"problem": "a", "answer": None}])
    with pytest.raises(UserError, match=r"null.jsonl' line 1: field 'answer' is null"):
        build_datasets(DataConfig(dataset_name="jsonl", train_path=str(path)), 0)


def test_missing_file_names_key_and_path(tmp_path, write_jsonl):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UserError, match=r"data.train_path: '.*nope.jsonl' does not exist"):
        build_datasets(DataConfig(dataset_name="jsonl", train_path=str(missing)), 0)
    train = write_jsonl(tmp_path / "train.jsonl", rows(3))
    with pytest.raises(UserError, match=r"data.val_path: '.*nope.jsonl' does not exist"):
        build_datasets(DataConfig(dataset_name="jsonl", train_path=str(train), val_path=str(missing)), 0)


def test_missing_train_path_is_a_user_error():
    with pytest.raises(UserError, match="data.train_path is required"):
        build_datasets(DataConfig(dataset_name="parquet"), 0)


def test_missing_parquet_column_and_null_row(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"question": ["a"], "answer": [1]}), path)
    with pytest.raises(UserError, match=r"t.parquet': no field 'problem' \(fields: question, answer\); set data.prompt_key"):
        build_datasets(DataConfig(dataset_name="parquet", train_path=str(path)), 0)
    pq.write_table(pa.table({"problem": ["a", "b", "c"], "answer": ["1", None, "3"]}), path)
    with pytest.raises(UserError, match=r"t.parquet' row 1: field 'answer' is null"):
        build_datasets(DataConfig(dataset_name="parquet", train_path=str(path), val_size=1), 0)


def test_corrupt_parquet_is_a_user_error(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_text("not parquet")
    with pytest.raises(UserError, match="cannot read parquet file '.*bad.parquet'"):
        build_datasets(DataConfig(dataset_name="parquet", train_path=str(path)), 0)


def test_empty_file_and_non_scalar_values_are_user_errors(tmp_path, write_jsonl):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(UserError, match="empty.jsonl' holds no problems"):
        build_datasets(DataConfig(dataset_name="jsonl", train_path=str(empty)), 0)
    path = write_jsonl(tmp_path / "list.jsonl", [{"problem": ["a"], "answer": 1}])
    with pytest.raises(UserError, match="line 1: field 'problem' holds a list"):
        build_datasets(DataConfig(dataset_name="jsonl", train_path=str(path)), 0)
