"""The header line of an attached view: the server's model, the layout of a sharded run (mode,
ranks, pipeline split), each rank's bank where the ranks differ, and a collective that has stalled.
Pure: a /health report in, one line out."""

from __future__ import annotations


def header(base: str, report: dict | None) -> str:
    """`base` (what the view was started on), then what /health says about the server."""
    if not report:
        return base
    parts = [base]
    if report.get("model") and report["model"] != base:
        parts.append(report["model"])
    if layout := report.get("layout"):
        split = f" (layers {'/'.join(map(str, layout['split']))})" if layout.get("split") else ""
        parts.append(f"{layout['mode']} × {layout['ranks']} ranks{split}")
        if line := banks_by_rank(layout.get("banks") or []):
            parts.append(line)
        if layout.get("status") == "stalled":
            parts.append(f"stalled: {layout.get('stalled')}")
    if report.get("status") == "unavailable":
        parts.append(f"unavailable: {report.get('engine_error') or report.get('engine')}")
    return " · ".join(parts)


def banks_by_rank(banks: list[dict]) -> str | None:
    """Each rank's bank, only when the ranks hold different things (under pp entry sizes differ;
    a rank's SSD can fail alone)."""
    seen = {(b["ram_entries"], b["ram_kib"], b["ssd_entries"], b["ssd"]) for b in banks}
    if len(seen) < 2:
        return None
    return "bank " + "; ".join(f"r{b['rank']} {b['ram_entries']} in RAM {b['ram_kib'] / 1024:.1f} MiB"
                                + (f" +{b['ssd_entries']} on SSD" if b["ssd_entries"] else "")
                                + (", SSD degraded" if b["ssd"] == "degraded" else "") for b in banks)
