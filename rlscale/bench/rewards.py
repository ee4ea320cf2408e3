"""A dependency-free reward for benchmark runs: timing needs varied rewards, not meaningful ones."""


def parity(response: str, answer: str) -> float:
    """1 for an even-length response, else 0: groups get non-zero advantages, so updates happen."""
    return float(len(response) % 2 == 0)
