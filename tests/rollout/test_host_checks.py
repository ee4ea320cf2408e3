"""When the decode loop stops to check on the host (each check syncs the device and idles it):
`_Run.next_deadline`, a pure function of the live slots' admission steps and length caps."""

from rlscale.rollout.engine import _Run


def run_with(caps: list[int], waiting: int = 0) -> tuple[_Run, list[int | None]]:
    """Samples 0..len(caps)-1 live in slots of the same index, admitted at step 0; `waiting` more
    prompts queued behind them."""
    count = len(caps) + waiting
    run = _Run([[1, 2]] * count, list(range(count)), max_new_tokens=max(caps), prefill_rows=1,
               caps=caps + [max(caps)] * waiting)
    for _ in range(len(caps)):
        run.waiting.popleft()
    run.admitted_at = {slot: 0 for slot in range(len(caps))}
    return run, list(range(len(caps)))


def test_with_prompts_waiting_the_first_end_is_checked_so_a_slot_is_taken_at_once():
    run, slots = run_with([30, 10, 20], waiting=1)
    assert run.next_deadline(slots, follows="buckets") == 9  # the 10-token one's last step


def test_in_a_long_tail_the_check_waits_for_the_end_that_lets_the_rest_fit_half_the_batch():
    caps = list(range(1, 33))  # 32 live sequences, one ending at each step
    run, slots = run_with(caps)
    # the 32-bucket halves once 16 have ended: the 16th end (cap 16, its last step 15), not the first
    assert run.next_deadline(slots, follows="buckets") == 15
    run, slots = run_with(caps[:8])  # within the smallest bucket: only the last end pays
    assert run.next_deadline(slots, follows="buckets") == 7


def test_an_exact_batch_or_a_batch_that_never_shrinks():
    run, slots = run_with([5, 3, 9])
    assert run.next_deadline(slots, follows="each_end") == 2  # eager or uncompacted: any end may shrink it
    assert run.next_deadline(slots, follows="whole") == 8  # only the end of all
    assert run.next_deadline([None, None, None], follows="buckets") == 0
