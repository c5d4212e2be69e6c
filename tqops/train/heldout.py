"""Held-out prompts for the demo, the drafter stage's acceptance run and the acceptance study: one rule."""
from __future__ import annotations

import dataclasses

from . import corpus


@dataclasses.dataclass(frozen=True)
class Window:
    """One held-out file around its cut: ``ids`` are the ``cut`` tokens before it (the longest context) then the
    reference continuation; ``continuation_bytes`` is the UTF-8 size of the continuation's text."""

    path: str
    ids: tuple
    cut: int
    continuation_bytes: int

    def prompt(self, context: int) -> list[int]:
        """The ``context`` tokens before the cut."""
        return list(self.ids[self.cut - context:self.cut])

    def sequence(self, context: int) -> list[int]:
        """The prompt of ``context`` tokens, then the reference continuation."""
        return list(self.ids[self.cut - context:])


def heldout_windows(tok, count: int, longest: int, new_tokens: int) -> list[Window]:
    """Up to ``count`` windows of ``longest + new_tokens`` tokens, one per held-out file in path order.

    Each file (``corpus.read_heldout``) is encoded whole, as training encodes a document. Its cut is the first token at
    or after token ``longest`` that starts a line (the tokenizer joins a line break and the indentation after it into
    one token, so the continuation opens a fresh line); the prompt of context ``C <= longest`` is the ``C`` tokens
    before the cut and the reference continuation the ``new_tokens`` after it. Every context thus continues at the
    same place of the same file and only sees more or less of that file before it, so acceptance against context
    measures context, not document boundaries. Files too short for ``longest`` plus the continuation are skipped
    rather than padded with other documents joined by end-of-text (with the study's defaults, 1,536 + 128 tokens, 17
    of the 26 committed held-out files are long enough). A prompt runs from position 0 with no end-of-text before it,
    wherever in its file it starts, as the target's packed training sequences do; prompt + new tokens must fit the
    target's max_position_embeddings. The cut moves with ``longest``: the same ``longest`` and ``new_tokens`` give
    every caller the same prompts.
    """
    windows = []
    for f in corpus.read_heldout():
        enc = tok.encode(f.text)
        ids, offsets = enc.ids, enc.offsets
        cut = next((i for i in range(longest, len(ids) - new_tokens + 1)
                    if f.text[offsets[i][0]:offsets[i][1]].startswith("\n")), None)
        if cut is None:
            continue
        end = cut + new_tokens
        text = f.text[offsets[cut][0]:offsets[end - 1][1]]
        windows.append(Window(f.path, tuple(ids[cut - longest:end]), longest, len(text.encode("utf-8"))))
        if len(windows) == count:
            break
    return windows
