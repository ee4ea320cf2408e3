"""The progress display without a terminal (a Ray job's log, CI): plain lines, whole, no bar."""

from rlscale.telemetry.progress import ProgressDisplay


def test_without_a_terminal_it_prints_whole_plain_lines_and_no_bar(capsys):
    long_note = "run dir runs/default  |  " + "x" * 150  # longer than any default width
    with ProgressDisplay(40, 0) as progress:
        progress.print(long_note)
        for step in range(1, 41):
            progress.update(step, {"reward/mean": 0.5, "accuracy": 0.25, "throughput/tokens_per_s": 4000.0,
                                   "val/accuracy": 0.375, "ckpt/stall_s": 0.01})
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == long_note
    steps = lines[1:]
    assert [line.split()[1] for line in steps] == [f"{s}/40" for s in range(2, 41, 2)]  # every 5% of the run
    assert all(line.startswith("step ") and "val 0.375  ckpt stall 0.01s  ETA" in line for line in steps)
    assert not any("GRPO" in line for line in lines)  # the live bar stays off


def test_disabled_prints_notes_only(capsys):
    with ProgressDisplay(10, 0, enabled=False) as progress:
        progress.print("a note")
        progress.update(10, {"reward/mean": 1.0})
    assert capsys.readouterr().err.splitlines() == ["a note"]


def test_without_a_terminal_the_last_step_is_printed_even_off_the_grid(capsys):
    for total, start, expected in ((45, 0, "step 45/45"), (45, 43, "step 45/45"), (1010, 1000, "step 1010/1010")):
        with ProgressDisplay(total, start) as progress:
            for step in range(start + 1, total + 1):
                progress.update(step, {"reward/mean": 0.5})
        assert capsys.readouterr().err.splitlines()[-1].startswith(expected + "  ")
