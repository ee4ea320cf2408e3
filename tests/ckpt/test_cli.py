"""rlscale ckpt list / verify / export."""

import pytest
import torch
from typer.testing import CliRunner

from rlscale.ckpt import layout
from rlscale.cli import app
from rlscale.errors import UserError
from tests.ckpt.conftest import checkpointer_for, make_group, train_steps


@pytest.fixture
def run_dir(make_cfg):
    cfg = make_cfg("checkpointing.keep_top_k=null")
    group = make_group(cfg)
    train_steps(group.workers[0])
    ckpt = checkpointer_for(cfg)
    ckpt.save(1, group, {}, {"val/accuracy": 0.5})
    ckpt.save(2, group, {}, {"val/accuracy": 0.75})
    ckpt.wait()
    (cfg.checkpoint_dir / "tmp_step_3").mkdir()
    return cfg.checkpoint_dir, group.workers[0]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_list_shows_committed_and_uncommitted_steps(run_dir):
    root, _ = run_dir
    result = invoke("ckpt", "list", root)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 3
    assert "step       1  intact" in lines[0] and "val/accuracy=0.5" in lines[0]
    assert "step       2  intact" in lines[1] and "val/accuracy=0.75" in lines[1]
    assert "step       3  uncommitted" in lines[2]
    assert isinstance(invoke("ckpt", "list", root / "nope").exception, UserError)


def test_verify_exit_status_follows_the_checksums(run_dir):
    root, _ = run_dir
    step = root / "step_2"
    ok = invoke("ckpt", "verify", step)
    assert ok.exit_code == 0 and "checksums match" in ok.output
    shard = sorted((step / "optim").glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = invoke("ckpt", "verify", step)
    assert bad.exit_code == 1 and "damaged" in bad.output and shard.name in bad.output
    assert invoke("ckpt", "verify", "--sizes-only", step).exit_code == 0  # sizes alone cannot see it
    (step / "manifest.json").unlink()
    missing = invoke("ckpt", "verify", step)
    assert missing.exit_code == 1 and "manifest.json is missing" in missing.output
    assert isinstance(invoke("ckpt", "verify", root / "step_9").exception, UserError)
    for given in (root, root.parent):  # the checkpoint dir, or its run dir (steps in checkpoints/)
        if given == root.parent:
            (root.parent / "checkpoints").symlink_to(root)
        wrong = invoke("ckpt", "verify", given).exception
        assert isinstance(wrong, UserError) and "is not a step directory: it holds" in str(wrong)
        assert "step_2, " in str(wrong) and "verify one of those" in str(wrong)


def test_export_writes_a_model_dir_transformers_loads(run_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    root, worker = run_dir
    out = tmp_path / "exported"
    result = invoke("ckpt", "export", root / "step_2", out)
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(out).to(worker.device)
    ids = torch.randint(3, 60, (1, 9), device=worker.device)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, worker.model(input_ids=ids).logits)
    again = invoke("ckpt", "export", root / "step_2", out)
    assert isinstance(again.exception, UserError) and "not an empty directory" in str(again.exception)
    # an existing empty directory (here through a symlink, like a mounted volume) takes the files
    (tmp_path / "volume").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "volume")
    assert invoke("ckpt", "export", root / "step_2", tmp_path / "link").exit_code == 0
    assert sorted(p.name for p in (tmp_path / "volume").iterdir()) == sorted(p.name for p in out.iterdir())
    assert (tmp_path / "link").is_symlink()


def test_a_failed_export_leaves_nothing_that_looks_like_a_model(run_dir, tmp_path, monkeypatch):
    import shutil

    root, _ = run_dir
    real_copy, copies = shutil.copyfile, []

    def copy_then_disk_full(src, dst):
        if copies:
            raise OSError(28, "No space left on device", str(dst))
        copies.append(dst)
        return real_copy(src, dst)

    monkeypatch.setattr(shutil, "copyfile", copy_then_disk_full)
    out = tmp_path / "exported"
    result = invoke("ckpt", "export", root / "step_2", out)
    assert isinstance(result.exception, UserError)
    assert "No space left on device" in str(result.exception) and str(out) in str(result.exception)
    assert copies and not out.exists()
    assert not [p for p in tmp_path.iterdir() if "exported" in p.name]  # no partial dir, no staging left


@pytest.mark.parametrize("manifest", ['[1, 2]', '{"files": [1]}', '{"files": {"a": "12"}}', '{"step": "x"}',
                                      '{"files": {}, "checksums": [1]}', '"text"'])
def test_a_manifest_of_the_wrong_shape_is_a_damaged_step_not_a_crash(run_dir, manifest):
    root, _ = run_dir
    (root / "step_2" / "manifest.json").write_text(manifest)
    listed = invoke("ckpt", "list", root)
    assert listed.exit_code == 0, listed.output
    assert "step       2  damaged" in listed.output and "not a manifest" in listed.output
    verified = invoke("ckpt", "verify", root / "step_2")
    assert verified.exit_code == 1 and "damaged" in verified.output
    assert layout.latest_intact(root).name == "step_1"  # what resume=auto takes


def test_an_os_error_reaches_the_user_as_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """main()'s backstop: a file-system refusal no command anticipated is one line and exit 2,
    not a traceback; RLSCALE_TRACEBACK=1 brings the traceback back."""
    import sys

    from rlscale import cli
    from rlscale.ckpt import tools

    def refuse(root):
        raise OSError(36, "File name too long", str(root / "x"))

    monkeypatch.setattr(tools, "list_steps", refuse)
    monkeypatch.setattr(sys, "argv", ["rlscale", "ckpt", "list", str(tmp_path)])
    monkeypatch.delenv("RLSCALE_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as stopped:
        cli.main()
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"rlscale: error: {tmp_path / 'x'}: File name too long")
    monkeypatch.setenv("RLSCALE_TRACEBACK", "1")
    with pytest.raises(OSError, match="File name too long"):
        cli.main()


def test_ctrl_c_before_a_run_handles_it_says_interrupted(tmp_path, monkeypatch, capsys):
    """Ctrl-C while a command starts up (before a run's own SIGINT handling) exits 130 with one line."""
    import sys

    from rlscale import cli
    from rlscale.ckpt import tools

    def interrupted(root):
        raise KeyboardInterrupt

    monkeypatch.setattr(tools, "list_steps", interrupted)
    monkeypatch.setattr(sys, "argv", ["rlscale", "ckpt", "list", str(tmp_path)])
    with pytest.raises(SystemExit) as stopped:
        cli.main()
    assert stopped.value.code == 130 and capsys.readouterr().err == "rlscale: interrupted\n"
