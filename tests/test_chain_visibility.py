"""The MTP head's chained training sees exactly what a draft step sees at inference."""

from train.chain_visibility import visible


def test_a_chained_draft_sees_the_history_its_chain_and_itself():
    n, levels = 6, 4
    seen = visible(levels, n)

    def keys(level, p):
        row = seen[(level - 1) * n + p]
        return {(b + 1, q) for b in range(levels) for q in range(n) if row[b * n + q]}

    # Level 1 is the head over real trunk states: causal over first-level entries.
    assert keys(1, 3) == {(1, 0), (1, 1), (1, 2), (1, 3)}
    # Depth 3 at position 5: the round started at t = 3, so history up to 3, then the entries its
    # own chain wrote at depth 2 (position 4), then itself. No other round's deep entries.
    assert keys(3, 5) == {(1, 0), (1, 1), (1, 2), (1, 3), (2, 4), (3, 5)}
    assert keys(4, 5) == {(1, 0), (1, 1), (1, 2), (2, 3), (3, 4), (4, 5)}
    # Every row sees itself (no empty softmax row, even where no round can start).
    assert all(seen[i][i] for i in range(levels * n))
