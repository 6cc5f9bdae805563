"""From a request's engine events to the pieces of text a client is sent.

One ``ChoiceStream`` per completion turns ``Delta``s (token ids, as the engine makes them) into
text pieces. Invariants:
- Joined, the pieces equal the completion's final text (the non-streamed answer).
- A piece never ends inside the start of a stop string that a later token completes: while a
  request has stop strings, the last ``len(longest stop) - 1`` characters are held back until
  the next token shows they are not the start of one (or the completion ends).
- A delta may repeat tokens already seen (a request retried on another Ray worker streams again
  from its first token, the same tokens by its seed): only positions not seen yet count.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.request import Completion, Delta


@dataclass
class Piece:
    """What one event adds to a completion: text (None for a model without a tokenizer), its
    token ids and their log-probability entries (when asked)."""

    text: str | None
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None = None


class ChoiceStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.detok = tokenizer.stream() if tokenizer is not None else None
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of ``text`` handed out
        self.done = False

    def push(self, d: Delta) -> Piece | None:
        """The new part of a delta, or None when it brings nothing new."""
        skip = len(self.ids) - d.start
        new = d.token_ids[skip:] if skip > 0 else d.token_ids
        if self.done or (not new and d.finish_reason is None):
            return None
        self.ids += new
        if self.detok is not None:
            self.text += "".join(self.detok.push(t) for t in new)
        lps = None if d.logprobs is None else d.logprobs[len(d.token_ids) - len(new):]
        if d.finish_reason is not None:
            return self._last(d.text if d.text is not None else self.text, new, lps, d.finish_reason)
        upto = len(self.text) - self.hold
        piece = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return Piece(piece if self.detok is not None else None, new, lps)

    def finish(self, c: Completion) -> Piece | None:
        """The rest of a completion from its final output (what no delta carried: a completion
        that ended without a last delta, e.g. cut short by an error); None once already done."""
        if self.done:
            return None
        rest = c.token_ids[len(self.ids):]
        lps = None if c.logprobs is None else c.logprobs[len(self.ids):]
        self.ids += rest
        return self._last(c.text if c.text is not None else self.text, rest, lps, c.finish_reason)

    def _last(self, final: str, ids: list[int], lps, reason: str) -> Piece:
        self.done = True
        piece = final[self.sent:]
        self.sent = len(final)
        return Piece(piece if self.detok is not None else None, ids, lps, reason)
