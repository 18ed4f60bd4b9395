"""Incremental detokenisation with stop strings.

Text is released only when it is complete (no dangling UTF-8 byte) and cannot be the start of a
stop string; a stop string ends the text before it, as OpenAI's `stop` does.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self._prefix = 0  # decode window start (keeps merges across token boundaries right)
        self._read = 0  # tokens whose text is already in self.text
        self.text = ""
        self.released = 0  # characters of self.text handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append one token; returns the newly released text ('' if held back)."""
        self.ids.append(token)
        window = self._decode(self.ids[self._prefix :])
        if window.endswith("\ufffd"):
            return ""
        done = self._decode(self.ids[self._prefix : self._read])
        self.text += window[len(done) :]
        self._prefix, self._read = self._read, len(self.ids)
        return self._release()

    def _release(self) -> str:
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.released - len(stop)))
            if at != -1:
                self.text, self.stopped = self.text[:at], True
        end = len(self.text)
        if not self.stopped:
            for stop in self.stops:  # hold back a tail that may grow into a stop string
                for n in range(min(len(stop) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(stop[:n]):
                        end = min(end, len(self.text) - n)
                        break
        out, self.released = self.text[self.released : max(end, self.released)], max(end, self.released)
        return out

    def flush(self) -> str:
        """At the end: release whatever was held back (it did not become a stop string)."""
        out, self.released = self.text[self.released :], len(self.text)
        return out
