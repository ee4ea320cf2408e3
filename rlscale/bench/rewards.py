"""A dependency-free reward for benchmark runs: timing needs varied rewards, not meaningful ones."""


def parity(response: str, answer: str) -> float:
    """1 for an even-length response, else 0: groups get non-zero advantages, so updates happen."""
    return float(len(response) % 2 == 0)


def parity_where_odd_answer(response: str, answer: str) -> float:
    """`parity` for problems whose answer has an odd number of characters, 0 for the others: about
    half the groups agree (zero advantage), as when a model solves or fails many problems outright."""
    return parity(response, answer) if len(answer) % 2 else 0.0
