"""The local Hugging Face cache, read the way huggingface_hub lays it out — offline, never a download.

`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub` holds one folder per repository,
`models--{org}--{name}`, whose `refs/{revision}` file names the commit whose files sit in
`snapshots/{commit}/`. This module knows folders and files only (no MLX, no network).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def looks_like_repo_id(text: str) -> bool:
    """`org/name` (optionally `@revision`), not a path that exists or starts like one."""
    repo = text.split("@", 1)[0]
    parts = repo.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def repo_folder(repo_id: str) -> Path:
    return cache_dir() / ("models--" + repo_id.replace("/", "--"))


def snapshot(repo_id: str) -> tuple[Path | None, str]:
    """The snapshot folder of `org/name[@revision]`, or None and a sentence saying what was looked at."""
    repo, _, revision = repo_id.partition("@")
    revision = revision or "main"
    folder = repo_folder(repo)
    if not folder.is_dir():
        return None, f"{folder} does not exist"
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    path = folder / "snapshots" / commit
    if path.is_dir():
        return path, str(path)
    snapshots = sorted(p for p in (folder / "snapshots").glob("*") if p.is_dir())
    if not ref.is_file() and revision == "main" and len(snapshots) == 1:
        return snapshots[0], str(snapshots[0])  # a cache copied without refs/: its only snapshot
    return None, f"{ref if ref.is_file() else folder / 'refs' / revision} names no snapshot in {folder / 'snapshots'}"


def cached_models() -> list[tuple[str, Path]]:
    """(repo id, snapshot folder) of every cached model repository that has a config.json."""
    root = cache_dir()
    out = []
    for folder in sorted(root.glob("models--*")) if root.is_dir() else ():
        repo_id = folder.name[len("models--"):].replace("--", "/", 1)
        path, _ = snapshot(repo_id)
        if path is not None and (path / "config.json").is_file():
            out.append((repo_id, path))
    return out


def repo_id_of(path: Path) -> str | None:
    """`org/name` when `path` is a snapshot folder inside a hub cache, else None."""
    path = Path(path)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name[len("models--"):].replace("--", "/", 1)
    return None
