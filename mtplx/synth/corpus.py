"""Real source text for tool results: Python standard-library files found on this machine.

Agents read real code, so tool results made of real code give the tiny models (and the bank's
benchmarks) realistic token statistics. The corpus is sorted by path so a seed picks the same
files on any machine with the same Python version.
"""

from __future__ import annotations

import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

_SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "ensurepip", "__pycache__"}


@dataclass(frozen=True)
class SourceFile:
    name: str
    text: str

    @property
    def functions(self) -> list[str]:
        return re.findall(r"^\s*def ([a-z_][a-z0-9_]{2,30})\(", self.text, flags=re.M)

    @property
    def classes(self) -> list[str]:
        return re.findall(r"^class ([A-Z][A-Za-z0-9_]{2,30})", self.text, flags=re.M)


class Corpus:
    """A seeded view of the standard library's source files."""

    def __init__(self, root: Path | None = None, max_files: int = 400):
        root = root or Path(sysconfig.get_paths()["stdlib"])
        paths = sorted(
            p for p in root.rglob("*.py") if not (_SKIP_PARTS & set(p.relative_to(root).parts))
        )
        self.paths = [p for p in paths if 2_000 < p.stat().st_size < 200_000][:max_files] or paths[:max_files]
        if not self.paths:
            raise RuntimeError(f"no Python source files under {root}")

    def excerpt(self, rng: random.Random, max_lines: int) -> SourceFile:
        """A contiguous excerpt of one file, at most max_lines long, starting at a definition."""
        path = rng.choice(self.paths)
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith(("def ", "class "))] or [0]
        start = rng.choice(starts[: max(1, len(starts) - 1)])
        text = "\n".join(lines[start : start + max_lines]).rstrip()
        return SourceFile(name=path.stem.lstrip("_") or "module", text=text)

    def all_text(self, limit_chars: int) -> str:
        """Concatenated source text, for tokenizer training."""
        parts, total = [], 0
        for path in self.paths:
            text = path.read_text(encoding="utf-8", errors="replace")
            parts.append(text)
            total += len(text)
            if total >= limit_chars:
                break
        return "\n".join(parts)
