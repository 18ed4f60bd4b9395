"""What a checkpoint says about generating from it: its end-of-sequence ids and default sampling.

Read from config.json (and its `text_config`) and generation_config.json, as transformers does:
generation_config.json wins for the end-of-sequence ids; its temperature / top_p / top_k / min_p /
repetition_penalty become defaults that explicit request parameters still override. Files only.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from mtplx.errors import ModelLoadError

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict = field(default_factory=dict)  # only the keys the files set

    @classmethod
    def read(cls, path: Path, config: dict) -> "GenerationConfig":
        eos: list[int] = []
        for source in (config, config.get("text_config") or {}):
            eos += _ids(source.get("eos_token_id"))
        gen_file = path / "generation_config.json"
        sampling: dict = {}
        if gen_file.is_file():
            try:
                gen = json.loads(gen_file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ModelLoadError(f"{gen_file}: not valid JSON ({exc})") from exc
            eos = _ids(gen.get("eos_token_id")) + eos
            # do_sample false means greedy whatever temperature says (transformers' rule).
            if gen.get("do_sample") is False:
                sampling["temperature"] = 0.0
            for key in _SAMPLING_KEYS:
                value = gen.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in sampling:
                    sampling[key] = value
            if sampling.get("top_k") is not None:
                sampling["top_k"] = int(sampling["top_k"])
        return cls(tuple(dict.fromkeys(eos)), sampling)

    def defaults(self, base):
        """`base` (SamplingParams) with the checkpoint's sampling defaults in place of its own."""
        return dataclasses.replace(base, **{k: v for k, v in self.sampling.items() if hasattr(base, k)})


def _ids(value) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
