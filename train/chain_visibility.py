"""Which keys a chained MTP draft sees at inference, as a boolean matrix (no torch: tested in CI).

Levels 1..J of the head run over the same n positions. Entry (a, p) is the depth-a draft of the
round that starts at t = p - a + 1: the head's input there pairs the level a-1 output at p-1 (the
trunk's hidden at p for a = 1) with token p+1, and it drafts token p+2. At inference the head's
cache then holds first-level entries (real trunk hidden states) at positions 0..t, and the entries
this round's own chain wrote at depths 2..a-1 (positions t+1..p-1); the draft attends to those and
to itself, nothing else.
"""

from __future__ import annotations


def visible(levels: int, n: int) -> list[list[bool]]:
    """(levels * n) x (levels * n): row a*n+p (level a+1, position p) sees column b*n+q?"""
    rows = []
    for a in range(1, levels + 1):
        for p in range(n):
            row = []
            for b in range(1, levels + 1):
                for q in range(n):
                    if b == 1:
                        row.append(q <= (p if a == 1 else p - a + 1))
                    else:
                        row.append(b <= a and q == p - (a - b))
            rows.append(row)
    return rows
