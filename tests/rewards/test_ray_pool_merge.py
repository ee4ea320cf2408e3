from rlscale.rewards.ray_pool import merge_results
from rlscale.rewards.scorer import ScoreResult


def test_merge_keeps_order_sums_counts_and_renumbers_the_first_error():
    parts = [ScoreResult([1.0, 0.0], 0, 0, 0.1, None),
             ScoreResult([0.0, 0.5, 1.0], 1, 1, 0.2, "sample 1: ValueError: boom")]
    merged = merge_results(parts, offsets=[0, 2], seconds=0.25)
    assert merged.rewards == [1.0, 0.0, 0.0, 0.5, 1.0]
    assert (merged.num_timeouts, merged.num_errors, merged.seconds) == (1, 1, 0.25)
    assert merged.first_error == "sample 3: ValueError: boom"
