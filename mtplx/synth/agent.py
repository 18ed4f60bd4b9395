"""Seeded coding-agent conversations in OpenAI message form.

Each conversation has a session head (system prompt + tools), user requests, assistant turns
with reasoning (`reasoning_content`), tool calls with JSON arguments, tool results of realistic
size, and final answers. The same seed (and corpus) gives the same conversation.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from mtplx.synth.corpus import Corpus, SourceFile
from mtplx.synth.heads import HEADS, tools_for

PACKAGES = ["inventory", "billing", "scheduler", "gateway", "ledger", "parser", "notifier", "catalog", "metrics", "auth"]
FOLDERS = ["src", "lib", "app", "core"]


@dataclass(frozen=True)
class Sizes:
    """How long tool results get (lines of file content or log)."""

    min_lines: int = 12
    max_lines: int = 60


class _Episode:
    """Builds one conversation; methods append messages for one agent step each."""

    def __init__(self, rng: random.Random, corpus: Corpus, sizes: Sizes, head: dict):
        self.rng, self.corpus, self.sizes, self.head = rng, corpus, sizes, head
        self.package = rng.choice(PACKAGES)
        self.folder = rng.choice(FOLDERS)
        self.messages: list[dict] = [{"role": "system", "content": head["system"]}]
        self.calls = 0

    # -- primitives -------------------------------------------------------------------------
    def source(self) -> SourceFile:
        return self.corpus.excerpt(self.rng, self.rng.randint(self.sizes.min_lines, self.sizes.max_lines))

    def path_for(self, src: SourceFile) -> str:
        return f"{self.folder}/{self.package}/{src.name}.py"

    def call(self, thought: str, name: str, arguments: dict, result: str) -> None:
        self.calls += 1
        call_id = f"call_{self.calls:03d}_{self.rng.randrange(16**6):06x}"
        self.messages.append(
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": thought,
                "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}],
            }
        )
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": result})

    def answer(self, thought: str, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text, "reasoning_content": thought})

    def has(self, tool: str) -> bool:
        return tool in self.head["tools"]

    # -- tool results -----------------------------------------------------------------------
    def test_log(self, test_file: str, func: str, failing: bool) -> str:
        n = self.rng.randint(8, 40)
        lines = [f"============================= test session starts ==============================",
                 f"collected {n} items", ""]
        dots = "." * (n - 1) + ("F" if failing else ".")
        lines.append(f"{test_file} {dots}  [100%]")
        if failing:
            lines += ["", "=================================== FAILURES ===================================",
                      f"_________________________________ test_{func} _________________________________", "",
                      f"    def test_{func}():", f">       assert {func}(sample) == expected",
                      f"E       AssertionError: assert None == {self.rng.randint(2, 999)}", "",
                      f"{test_file}:{self.rng.randint(10, 300)}: AssertionError",
                      f"=========================== 1 failed, {n - 1} passed in {self.rng.uniform(0.1, 9):.2f}s ==========================="]
        else:
            lines.append(f"============================== {n} passed in {self.rng.uniform(0.1, 9):.2f}s ==============================")
        return "\n".join(lines)

    def listing(self, names: list[str]) -> str:
        rows = [f"{self.rng.choice(['-rw-r--r--', '-rw-rw-r--'])} {self.rng.randint(200, 40000):>7} {n}.py" for n in names]
        return "\n".join(["__init__.py", *rows, "README.md"])

    def grep(self, src: SourceFile, pattern: str) -> str:
        hits = [(i + 1, line) for i, line in enumerate(src.text.splitlines()) if pattern in line][:12]
        return "\n".join(f"{self.path_for(src)}:{i}:{line}" for i, line in hits) or "no matches"

    # -- tasks ------------------------------------------------------------------------------
    def fix_test(self) -> None:
        src = self.source()
        func = self.rng.choice(src.functions or ["main"])
        test_file = f"tests/test_{src.name}.py"
        path = self.path_for(src)
        self.ask(f"The test for {func} in {test_file} is failing. Please find the cause and fix it.")
        runner = "run_shell" if self.has("run_shell") else None
        if runner:
            self.call(f"I should run the failing test first to see the error for {func}.",
                      "run_shell", {"command": f"python -m pytest {test_file} -x -q"}, self.test_log(test_file, func, True))
        self.call(f"The assertion fails in {func}. I need to read {path} to see how {func} works.",
                  "read_file", {"path": path}, src.text)
        fixer = "edit_file" if self.has("edit_file") else "write_file" if self.has("write_file") else None
        if fixer == "edit_file":
            self.call(f"{func} returns None on one branch. I will make it return the computed value.",
                      "edit_file", {"path": path, "old": f"def {func}(", "new": f"def {func}("}, f"Edited {path}: 1 replacement.")
        elif fixer == "write_file":
            self.call(f"{func} returns None on one branch. I will rewrite {path} with the fix.",
                      "write_file", {"path": path, "content": src.text[:400]}, f"Wrote {len(src.text[:400])} bytes to {path}.")
        if runner and fixer:
            self.call(f"Now I run {test_file} again to check that the fix works.",
                      "run_shell", {"command": f"python -m pytest {test_file} -q"}, self.test_log(test_file, func, False))
            self.answer(f"The test passes now, so I can summarise the fix in {func}.",
                        f"Fixed `{func}` in `{path}`: it returned None on one branch, so the test in `{test_file}` failed. "
                        f"It now returns the computed value and the tests pass.")
        else:
            self.answer(f"I found the problem in {func} but I cannot change files here.",
                        f"The failure comes from `{func}` in `{path}`, which returns None on one branch. "
                        f"Return the computed value there and `{test_file}` should pass.")

    def explain(self) -> None:
        src = self.source()
        path = self.path_for(src)
        names = src.functions[:4] or src.classes[:4] or ["main"]
        self.ask(f"Can you explain what {path} does?")
        self.call(f"I need to read {path} before I can explain it.", "read_file", {"path": path}, src.text)
        listed = ", ".join(f"`{n}`" for n in names)
        self.answer(f"The file defines {', '.join(names)}. I can describe each one briefly.",
                    f"`{path}` defines {listed}. The main entry point is `{names[0]}`, and the other functions support it.")

    def find_usage(self) -> None:
        src = self.source()
        name = self.rng.choice(src.functions or src.classes or ["main"])
        self.ask(f"Where is {name} used in the {self.package} package?")
        self.call(f"I will search the package for {name} to find every use.",
                  "search", {"pattern": name, "path": f"{self.folder}/{self.package}"}, self.grep(src, name))
        self.call(f"The matches are in {self.path_for(src)}. I will read it to see the context.",
                  "read_file", {"path": self.path_for(src)}, src.text)
        self.answer(f"I have the matches and the context for {name}.",
                    f"`{name}` is defined and used in `{self.path_for(src)}`; the search found no other callers in `{self.package}`.")

    def survey(self) -> None:
        sources = [self.source() for _ in range(self.rng.randint(2, 4))]
        folder = f"{self.folder}/{self.package}"
        self.ask(f"Give me an overview of the {folder} folder.")
        self.call(f"First I list {folder} to see which modules it has.",
                  "list_dir", {"path": folder}, self.listing([s.name for s in sources]))
        first = sources[0]
        self.call(f"{first.name}.py looks central. I will read it.", "read_file", {"path": self.path_for(first)}, first.text)
        self.answer(f"I saw the listing and read {first.name}.py, which is enough for an overview.",
                    f"`{folder}` holds {len(sources)} modules: " + ", ".join(f"`{s.name}.py`" for s in sources)
                    + f". `{first.name}.py` defines " + (", ".join(f"`{f}`" for f in first.functions[:3]) or "no functions") + ".")

    def diagnose(self) -> None:
        src = self.source()
        service = f"{self.package}-worker"
        self.ask(f"The {service} service keeps restarting. What is going on?")
        log = "\n".join(f"2026-11-{self.rng.randint(1, 28):02d}T{self.rng.randint(0, 23):02d}:{self.rng.randint(0, 59):02d}:00Z "
                        f"{self.rng.choice(['INFO', 'WARN', 'ERROR'])} {service}: {self.rng.choice(['started', 'health check failed', 'exited with code 1', 'retrying connection'])}"
                        for _ in range(self.rng.randint(6, 30)))
        self.call(f"I will look at the recent log lines of {service} first.",
                  "run_shell", {"command": f"journalctl -u {service} -n 50 --no-pager"}, log)
        self.call(f"The worker exits with code 1. I will read its entry module {self.path_for(src)}.",
                  "read_file", {"path": self.path_for(src)}, src.text)
        self.answer(f"The log and the code point to a failing health check.",
                    f"`{service}` fails its health check and exits with code 1, so the supervisor restarts it. "
                    f"Check the start-up path in `{self.path_for(src)}` first.")

    def ask(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def tasks(self) -> list:
        options = [self.explain]
        if self.has("search"):
            options.append(self.find_usage)
        if self.has("list_dir"):
            options.append(self.survey)
        if self.has("run_shell"):
            options += [self.fix_test, self.diagnose]
        return options


def conversation(seed: int, corpus: Corpus, sizes: Sizes = Sizes(), max_user_turns: int = 3, head: dict | None = None) -> dict:
    """One seeded conversation: {"head", "tools", "messages"}."""
    rng = random.Random(seed)
    head = head or rng.choice(HEADS)
    episode = _Episode(rng, corpus, sizes, head)
    for _ in range(rng.randint(1, max_user_turns)):
        rng.choice(episode.tasks())()
    return {"head": head["name"], "tools": tools_for(head), "messages": episode.messages}
