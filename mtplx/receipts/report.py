"""Text views of receipt rows: a listing, one receipt in full, and two replay runs side by side."""

from __future__ import annotations

import json

from mtplx.bank.spans import reuse_ratio


def _f(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def ratio_text(cached: int | None, ceiling: int | None) -> str:
    """The reuse ratio as every view prints it: two decimals, '-' without a ceiling, and a '+'
    when more was restored than the ceiling counted as knowable (the ratio is capped at 1; the
    '+' keeps the excess visible instead of hiding it)."""
    if ceiling == 0 and cached:  # nothing counted as knowable, yet something was restored
        return "+"
    ratio = reuse_ratio(cached, ceiling)
    if ratio is None:
        return "-"
    return f"{ratio:.2f}" + ("+" if (cached or 0) > ceiling else "")


def listing(rows: list[dict]) -> str:
    """Newest first, as the TUI shows them; ratio to two decimals, TTFT to milliseconds."""
    head = (f"{'id':<28} {'utc':<23} {'source':<8} {'session':<12} {'prompt':>6} {'ceil':>6} {'cached':>6} {'ratio':>5} "
            f"{'TTFT':>7} {'tok/s':>6} {'finish':<10} shortfall")
    lines = [head]
    for r in sorted(rows, key=lambda r: r["id"], reverse=True):
        ratio = ratio_text(r.get("cached_tokens"), r.get("ceiling"))
        lines.append(f"{r['id']:<28} {r['created_utc'][:23]:<23} {r['source'] or '-':<8} {(r['session'] or '-')[:12]:<12} "
                     f"{_f(r['prompt_tokens']):>6} {_f(r['ceiling']):>6} {_f(r['cached_tokens']):>6} {ratio:>5} "
                     f"{_f(r['ttft_first_token_s'], '.3f'):>7} {_f(r['decode_tps'], '.1f'):>6} {r['finish_reason'] or '-':<10} "
                     f"{r['shortfall'] or ''}")
    return "\n".join(lines)


def detail(row: dict) -> str:
    out = []
    for key, value in row.items():
        if key == "request_json" and value:
            try:
                value = json.dumps(json.loads(value), indent=2)[:4000]
            except json.JSONDecodeError:
                pass
        out.append(f"{key}: {value}")
    return "\n".join(out)


def side_by_side(a: list[dict], b: list[dict], label_a: str, label_b: str) -> tuple[str, bool]:
    """Per turn: ceiling, achieved, ratio, TTFT of two runs; returns (table, outputs all equal)."""
    lines = [f"{'turn':>4} | {label_a[:30]:^38} | {label_b[:30]:^38} | {'Δcached':>7} {'ΔTTFT s':>8} parity",
             f"{'':>4} | {'ceil':>6} {'cached':>6} {'ratio':>6} {'TTFT':>7} {'src':<6} | {'ceil':>6} {'cached':>6} {'ratio':>6} {'TTFT':>7} {'src':<6} |"]
    parity = True
    for i, (x, y) in enumerate(zip(a, b)):
        same = x.get("output_sha256") == y.get("output_sha256")
        parity &= same
        ratio = lambda r: reuse_ratio(r.get("cached_tokens"), r.get("ceiling"))
        cell = lambda r: f"{_f(r.get('ceiling')):>6} {_f(r.get('cached_tokens')):>6} {_f(ratio(r), '.2f'):>6} {_f(r.get('ttft_first_token_s'), '.3f'):>7} {(r.get('restore_source') or '-'):<6}"
        dc = (y.get("cached_tokens") or 0) - (x.get("cached_tokens") or 0)
        dt = (y.get("ttft_first_token_s") or 0) - (x.get("ttft_first_token_s") or 0)
        lines.append(f"{i:>4} | {cell(x)} | {cell(y)} | {dc:>7} {dt:>8.3f} {'ok' if same else 'DIFFERS'}")
    if len(a) != len(b):
        lines.append(f"turn counts differ: {len(a)} vs {len(b)}")
        parity = False
    return "\n".join(lines), parity
