"""The GRPO loop saves in the background, logs each commit, and resumes where it stopped."""

import json

from rlscale.controller import train

TINY_RUN = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "policy.train_global_batch_size=4",
            "policy.generation.max_new_tokens=4", "grpo.val_at_start=false", "grpo.val_at_end=false",
            "rewards.num_workers=1", "checkpointing.save_period=1", "logger.progress=false"]


def test_loop_saves_every_step_logs_commits_and_resumes(make_cfg):
    first = train(make_cfg(*TINY_RUN, "grpo.max_num_steps=2"))
    cfg = make_cfg(*TINY_RUN, "grpo.max_num_steps=3")
    assert first["final_step"] == 2
    assert sorted(p.name for p in cfg.checkpoint_dir.iterdir()) == ["step_1", "step_2"]

    resumed = train(cfg)
    assert resumed["resumed_from"] == str(cfg.checkpoint_dir / "step_2") and resumed["steps_run"] == 1
    assert sorted(p.name for p in cfg.checkpoint_dir.iterdir()) == ["step_2", "step_3"]  # keep_top_k=2
    rows = [json.loads(line) for line in (cfg.checkpoint_dir.parent / "run" / "metrics.jsonl").read_text().splitlines()]
    step_rows = [row for row in rows if "reward/mean" in row]
    assert [row["step"] for row in step_rows] == [1, 2, 3]
    assert all(row["ckpt/stall_s"] >= 0 for row in step_rows)  # every step saved
    committed = [row["ckpt/committed_step"] for row in rows if "ckpt/committed_step" in row]
    assert 3 in committed  # the last save's commit is logged too, on the run's final row
    assert all(row.get("ckpt/GBps", 1) > 0 for row in rows)
    on_disk = sum(f.stat().st_size for f in cfg.checkpoint_dir.rglob("*") if f.is_file())
    assert abs(rows[-1]["ckpt/retained_GB"] * 1e9 - on_disk) < 0.01 * on_disk  # steps 2 and 3 kept
    state = json.loads((cfg.checkpoint_dir / "step_3" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["loader"]["consumed"] == 6  # 2 prompts a step, across the resume


def test_resuming_an_older_step_sets_the_abandoned_timeline_aside(make_cfg):
    """resume=<older step> starts a new timeline: the newer steps are renamed (kept), so that a
    later resume=auto continues this run instead of mixing in the abandoned one's steps."""
    train(make_cfg(*TINY_RUN, "grpo.max_num_steps=3", "checkpointing.keep_top_k=null"))
    first = make_cfg(*TINY_RUN, "grpo.max_num_steps=3", "checkpointing.keep_top_k=null")
    root = first.checkpoint_dir
    abandoned_weights = (root / "step_3" / "trainer_state.json").read_bytes()
    again = train(make_cfg(*TINY_RUN, "grpo.max_num_steps=2", "checkpointing.keep_top_k=null",
                           f"checkpointing.resume={root / 'step_1'}"))
    assert again["resumed_from"] == str(root / "step_1") and again["steps_run"] == 1
    assert sorted(p.name for p in root.iterdir()) == ["abandoned_step_2", "abandoned_step_3", "step_1", "step_2"]
    assert (root / "abandoned_step_3" / "trainer_state.json").read_bytes() == abandoned_weights  # kept as it was
    resumed = train(make_cfg(*TINY_RUN, "grpo.max_num_steps=3", "checkpointing.keep_top_k=null"))
    assert resumed["resumed_from"] == str(root / "step_2")  # this run's step 2, not the abandoned step 3
    # the same explicit resume again (a retried job): one abandoned copy per step, the newest
    train(make_cfg(*TINY_RUN, "grpo.max_num_steps=2", "checkpointing.keep_top_k=null",
                   f"checkpointing.resume={root / 'step_1'}"))
    assert sorted(p.name for p in root.iterdir()) == ["abandoned_step_2", "abandoned_step_3", "step_1", "step_2"]
    assert (root / "abandoned_step_3" / "trainer_state.json").read_bytes() != abandoned_weights


def test_a_finished_run_writes_its_summary_before_it_lets_go_of_the_directory(make_cfg, monkeypatch):
    """A run waiting for the claim (a retried job) looks for the summary as soon as it gets the
    directory: the summary must be there by then, or it would train the finished run again."""
    from rlscale.ckpt import claim

    cfg = make_cfg(*TINY_RUN, "grpo.max_num_steps=1")
    seen = []
    release = claim.release

    def recording_release(token):
        seen.append((cfg.checkpoint_dir.parent / "run" / "summary.json").exists())
        release(token)

    monkeypatch.setattr(claim, "release", recording_release)
    train(cfg)
    assert seen and all(seen)


def test_a_run_that_waited_for_the_directory_chooses_its_resume_step_again(make_cfg, monkeypatch, capsys):
    """A run that waits for the directory's claim (held from another node: a retried job) chose
    its resume step before the wait, and the holder may have saved a newer step or finished
    meanwhile: the choice is made again once the claim is had. A finished run is left as it is, a
    newer step is resumed from; neither step is trained again from the older one."""
    from rlscale.ckpt import Checkpointer

    def run(*overrides):
        return make_cfg(*TINY_RUN, "checkpointing.keep_top_k=null", *overrides)

    done = train(run("grpo.max_num_steps=2"))
    root, log_dir = run().checkpoint_dir, run().checkpoint_dir.parent / "run"
    away = root.parent / "away"
    away.mkdir()
    saved_meanwhile = []  # what the holder writes while this run waits: moved back in prepare
    prepare = Checkpointer.prepare

    def prepare_after_a_wait(self, notify=None):
        prepare(self, notify)
        while saved_meanwhile:
            path = saved_meanwhile.pop()
            (away / path.name).rename(path)
        return True  # as if the claim had waited for a holder

    def hold_back(*paths):
        for path in paths:
            path.rename(away / path.name)
            saved_meanwhile.append(path)

    monkeypatch.setattr(Checkpointer, "prepare", prepare_after_a_wait)
    state_2 = (root / "step_2" / "trainer_state.json").read_bytes()
    metrics = (log_dir / "metrics.jsonl").read_bytes()
    # before the wait: step 1, work left; during it the holder saved step 2 and wrote its summary
    hold_back(root / "step_2", log_dir / "summary.json")
    capsys.readouterr()
    assert train(run("grpo.max_num_steps=2")) == done
    assert f"the run in {log_dir} finished at step 2" in capsys.readouterr().err
    assert (root / "step_2" / "trainer_state.json").read_bytes() == state_2
    assert (log_dir / "metrics.jsonl").read_bytes() == metrics  # nothing trained, nothing logged
    # before the wait: step 1; during it the holder saved step 2, and this run goes on to step 3
    hold_back(root / "step_2")
    resumed = train(run("grpo.max_num_steps=3"))
    assert resumed["resumed_from"] == str(root / "step_2") and resumed["steps_run"] == 1


def test_the_checkpointer_saves_every_save_period_steps_and_at_the_last(make_cfg):
    """What the loop asks after each step (Checkpointer.saves_at)."""
    from rlscale.ckpt import Checkpointer

    def saves(*overrides, last=7):
        cfg = make_cfg(*overrides)
        ckpt = Checkpointer(cfg.checkpoint_dir, cfg.checkpointing, "{}", "x")  # not prepared: only decides
        return [step for step in range(1, last + 1) if ckpt.saves_at(step, last)]

    assert saves("checkpointing.save_period=3") == [3, 6, 7]
    assert saves("checkpointing.save_period=1") == [1, 2, 3, 4, 5, 6, 7]
    assert saves("checkpointing.save_period=20") == [7]
    assert saves("checkpointing.save_period=7") == [7]
    assert saves("checkpointing.save_period=3", "checkpointing.enabled=false") == []


def test_a_resume_with_other_settings_names_them(make_cfg, capsys):
    """The same directory resumed by a run with other settings (another job sharing a relative run
    dir, say) is said so, naming the settings; a longer horizon or other logging is not news."""
    from rlscale.run_dir import config_changes

    train(make_cfg(*TINY_RUN, "grpo.max_num_steps=1"))
    step = make_cfg(*TINY_RUN).checkpoint_dir / "step_1"
    assert config_changes(step, make_cfg(*TINY_RUN, "grpo.max_num_steps=5", "logger.progress=true")) is None
    note = config_changes(step, make_cfg(*TINY_RUN, "policy.optimizer.lr=0.5", "grpo.seed=7"))
    assert note.startswith("resuming step_1, saved with other settings: ")
    assert "grpo.seed 42 -> 7" in note and "policy.optimizer.lr 0.0002 -> 0.5" in note
    capsys.readouterr()
    train(make_cfg(*TINY_RUN, "grpo.max_num_steps=2", "policy.optimizer.lr=0.5"))
    assert "saved with other settings: policy.optimizer.lr 0.0002 -> 0.5;" in capsys.readouterr().err


def test_a_reward_function_that_fails_on_every_sample_stops_the_run_before_it_trains(make_cfg):
    import pytest

    from rlscale.errors import UserError

    cfg = make_cfg(*TINY_RUN, "grpo.max_num_steps=2", "rewards.function=tests.rewards.user_rewards:returns_text")
    with pytest.raises(UserError, match="rewards.function 'tests.rewards.user_rewards:returns_text' failed on "
                                        "every sample of step 1: sample 0: reward must be a finite float"):
        train(cfg)
    assert not (cfg.checkpoint_dir / "step_1").exists()  # nothing trained on all-zero rewards was kept


def test_prompts_cut_to_fit_the_sequence_limit_are_reported(make_cfg, capsys):
    cfg = make_cfg(*TINY_RUN, "grpo.max_num_steps=2", "policy.max_total_sequence_length=8")
    train(cfg)
    err = capsys.readouterr().err
    assert "step 1: 4 of 4 prompts were longer than the 4 tokens left for them" in err
    assert err.count("lost their beginning") == 1  # once a run; the metric has every step
    rows = [json.loads(line) for line in (cfg.checkpoint_dir.parent / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["prompt/cut_fraction"] for row in rows if "prompt/cut_fraction" in row] == [1.0, 1.0]
    assert train(make_cfg(*TINY_RUN, "grpo.max_num_steps=1", "logger.log_dir=" + str(cfg.checkpoint_dir.parent / "b"),
                          "checkpointing.checkpoint_dir=" + str(cfg.checkpoint_dir.parent / "b" / "ck")))
    assert "lost their beginning" not in capsys.readouterr().err  # with room to spare, nothing is cut


def test_a_fresh_start_does_not_overwrite_another_run_s_metrics(make_cfg):
    import pytest

    from rlscale.errors import UserError

    train(make_cfg(*TINY_RUN, "grpo.max_num_steps=2"))
    cfg = make_cfg(*TINY_RUN, "grpo.max_num_steps=1")
    metrics = cfg.checkpoint_dir.parent / "run" / "metrics.jsonl"
    before = metrics.read_bytes()
    with pytest.raises(UserError, match="holds a checkpointed run and this run has checkpointing.enabled=false"):
        train(make_cfg(*TINY_RUN, "grpo.max_num_steps=1", "checkpointing.enabled=false"))
    with pytest.raises(UserError, match=r"a run with other settings \(grpo.seed 42 -> 3\) .* starts from scratch"):
        train(make_cfg(*TINY_RUN, "grpo.max_num_steps=1", "grpo.seed=3", "checkpointing.resume=never",
                       "checkpointing.checkpoint_dir=" + str(cfg.checkpoint_dir.parent / "elsewhere")))
    assert metrics.read_bytes() == before  # nothing of the first run was touched
    # the same settings with checkpointing off is that run starting over, and may
    off = make_cfg(*TINY_RUN, "grpo.max_num_steps=1", "checkpointing.enabled=false",
                   "logger.log_dir=" + str(cfg.checkpoint_dir.parent / "off"))
    train(off)
    assert train(off)["final_step"] == 1


def test_keys_of_another_rlscale_version_are_not_other_settings(make_cfg):
    import yaml

    from rlscale.run_dir import config_differences

    cfg = make_cfg(*TINY_RUN)
    tree = cfg.to_dict()
    tree["grpo"]["an_option_since_removed"] = 1  # written by another version
    del tree["loss"]["token_level_loss"]  # an option this version added
    (cfg.checkpoint_dir.parent / "old").mkdir()
    (cfg.checkpoint_dir.parent / "old" / "config.yaml").write_text(yaml.safe_dump(tree))
    assert config_differences(cfg.checkpoint_dir.parent / "old", cfg) is None
    tree["grpo"]["seed"] = 1
    (cfg.checkpoint_dir.parent / "old" / "config.yaml").write_text(yaml.safe_dump(tree))
    assert config_differences(cfg.checkpoint_dir.parent / "old", cfg) == "grpo.seed 1 -> 42"
    (cfg.checkpoint_dir.parent / "old" / "config.yaml").write_text("just text\n")
    assert config_differences(cfg.checkpoint_dir.parent / "old", cfg) is None


def test_a_start_that_fails_to_open_its_sinks_leaves_the_run_dir_as_it_was(make_cfg):
    import socket

    import pytest

    from rlscale.errors import UserError

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def points(run):
        events = EventAccumulator(str(run / "tensorboard"))
        events.Reload()
        return [(s.step, s.value) for s in events.Scalars("reward/mean")]

    train(make_cfg(*TINY_RUN, "grpo.max_num_steps=1", "logger.tensorboard_enabled=true"))
    run = make_cfg(*TINY_RUN).checkpoint_dir.parent / "run"
    before = {name: (run / name).read_bytes() for name in ("summary.json", "config.yaml", "metrics.jsonl")}
    plotted = points(run)
    assert len(plotted) == 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=str(port)):
            train(make_cfg(*TINY_RUN, "grpo.max_num_steps=2", f"logger.prometheus_port={port}",
                           "logger.tensorboard_enabled=true"))
    assert {name: (run / name).read_bytes() for name in before} == before
    assert points(run) == plotted  # no event file that would purge them


def test_eval_of_a_checkpoint_uses_its_run_s_settings(make_cfg):
    """The run generated at most 4 tokens and validated on its own held-out set: so does the eval."""
    from typer.testing import CliRunner

    from rlscale.cli import app

    cfg = make_cfg(*TINY_RUN, "grpo.max_num_steps=1", "grpo.max_val_samples=8")
    train(cfg)
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(cfg.checkpoint_dir / "step_1")])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout[result.stdout.index("{"):])
    assert out["num_problems"] == 8 and out["response_length_mean"] <= 4  # max_new_tokens=4, not the default 16
    refused = CliRunner().invoke(app, ["eval", "--checkpoint", str(cfg.checkpoint_dir / "step_1"),
                                       "--temperature", "inf"])
    assert refused.exit_code != 0 and "--temperature inf must be a finite number" in str(refused.exception)
    # a run made elsewhere (on CUDA) evaluates here; settings this version lacks are named with their file
    import re

    import pytest

    from rlscale.cli import eval_config
    from rlscale.errors import UserError

    elsewhere = cfg.checkpoint_dir.parent / "made-on-cuda"
    elsewhere.mkdir()
    saved = (cfg.checkpoint_dir / "step_1" / "config.yaml").read_text()
    (elsewhere / "config.yaml").write_text(re.sub(r"(?m)^  device: \w+$", "  device: cuda", saved, count=1))
    made = eval_config(elsewhere, None, ["rewards.num_workers=1"])
    assert made.policy.device == "auto" and made.policy.generation.max_new_tokens == 4
    assert made.rewards.num_workers == 1  # overrides still win
    (elsewhere / "config.yaml").write_text(saved + "future_section:\n  key: 1\n")
    with pytest.raises(UserError, match=r"made-on-cuda/config.yaml \(the checkpoint's run settings\): .*--config FILE"):
        eval_config(elsewhere, None, [])
