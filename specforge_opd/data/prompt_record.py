"""The one record schema of every prompt source, and the text comparisons the training pool makes on it.

``PromptRecord`` is what every source yields and every consumer renders; ``normalize_text`` and
``slice_of`` decide duplicates and the SFT/OPD hash slices; ``OverlapIndex`` is the contamination
check against the evaluation sets. Stdlib only: the parsers (``data.sources``) and the pool
(``data.prompts``) both build on it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Iterable, Optional

from specforge_opd.errors import UserError


#: Word n-gram length of the contamination check (GPT-3's 13-gram overlap test).
OVERLAP_NGRAM = 13
#: Eval prompts shorter than OVERLAP_NGRAM words but at least this long match as a whole word sequence.
MIN_SHORT_MATCH_WORDS = 6


class PromptsError(UserError, ValueError):
    """A prompt source is missing, unknown or empty; the message names the setting and the fix."""


@dataclass
class PromptRecord:
    """One prompt of any source.

    Exactly one of ``messages`` (a chat prefix ending with a user turn, OpenAI
    form) or ``prompt`` (the text of a single user turn) is set. ``answer`` is
    the reference answer where the source has one. ``meta`` holds
    source-specific fields (MT-Bench's second turn and category, HumanEval's
    entry point and tests); JSON-serializable values only.

    Raises:
        PromptsError: both or neither of ``messages`` and ``prompt``.
    """

    id: str
    source: str
    messages: Optional[list[dict]] = None
    prompt: Optional[str] = None
    answer: Optional[str] = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if (self.messages is None) == (self.prompt is None):
            raise PromptsError(f"record {self.source}/{self.id}: set exactly one of messages and prompt")

    def chat_messages(self) -> list[dict]:
        """The messages to render: ``messages``, or ``prompt`` as one user turn."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}]

    def text(self) -> str:
        """The first user turn's text: what slicing compares, so every turn of a conversation
        falls in the slice of its first turn (SFT and OPD never share a conversation)."""
        if self.prompt is not None:
            return self.prompt
        for m in self.messages:
            if m.get("role") == "user":
                return str(m.get("content") or "")
        return ""

    def user_texts(self) -> list[str]:
        """Every user turn's text, in order (what the contamination check compares)."""
        if self.prompt is not None:
            return [self.prompt]
        return [str(m.get("content") or "") for m in self.messages if m.get("role") == "user"]

    def context_text(self) -> str:
        """What duplicates and ``data.max_prompt_tokens`` are judged on: ``text()`` for a first
        turn; for a later turn (``messages`` holding an assistant turn) every turn's text, joined."""
        if self.messages is None or not any(m.get("role") == "assistant" for m in self.messages):
            return self.text()
        return "\n".join(str(m.get("content") or "") for m in self.messages)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict) -> "PromptRecord":
        return cls(**d)


# ---------------------------------------------------------------------------
# normalization, slices, contamination


def normalize_text(text: str) -> str:
    """NFKC, lower case, whitespace collapsed: the form compared for duplicates, slices and overlap."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def slice_of(text: str, num_slices: int) -> int:
    """The hash slice of a prompt: ``int(sha1(normalize_text(text))) % num_slices``."""
    return int(hashlib.sha1(normalize_text(text).encode("utf-8")).hexdigest(), 16) % num_slices


_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    return _WORD.findall(normalize_text(text))


class OverlapIndex:
    """Eval-set texts, for dropping training prompts that overlap them.

    A training prompt overlaps when its normalized text equals an eval
    prompt's, or shares a 13-word sequence with one, or contains a whole eval
    prompt of 6-12 words.
    """

    def __init__(self, texts: Iterable[str]):
        self.exact: set[str] = set()
        self.grams: set[tuple[str, ...]] = set()
        #: short eval prompts as " w1 w2 ... wk ": a substring test on the joined words is C-fast
        self.short: set[str] = set()
        for t in texts:
            self.exact.add(normalize_text(t))
            w = _words(t)
            if len(w) >= OVERLAP_NGRAM:
                self.grams.update(tuple(w[i : i + OVERLAP_NGRAM]) for i in range(len(w) - OVERLAP_NGRAM + 1))
            elif len(w) >= MIN_SHORT_MATCH_WORDS:
                self.short.add(" " + " ".join(w) + " ")

    def overlaps(self, text: str) -> bool:
        """True when ``text`` overlaps an indexed eval prompt (see the class docstring)."""
        if normalize_text(text) in self.exact:
            return True
        w = _words(text)
        n = OVERLAP_NGRAM
        if self.grams and any(tuple(w[i : i + n]) in self.grams for i in range(len(w) - n + 1)):
            return True
        if self.short:
            joined = " " + " ".join(w) + " "
            return any(s in joined for s in self.short)
        return False
