"""A conversation's previous prompt encoding, so a new turn re-encodes only what follows it.

Each turn's rendered prompt usually starts with the previous turn's (append-only history). Encoding is
~0.6 µs per token here, so a 24K-token conversation would spend ~15 ms per turn re-encoding history it
encoded a turn ago. Instead the new text is encoded from a token boundary a few tokens before the old
text's end, and spliced after the old ids.

That is exact only if tokens before the boundary do not depend on what follows it: true for tokenizers
that split text into words or pieces first (every HF fast tokenizer's pre-tokenizer), not guaranteed in
general. So the splice is used only when the re-encoding reproduces the old tokens between the boundary
and the old text's end (a resync check), and every ``verify_every``-th splice is compared with a full
encoding; one mismatch turns splicing off for the model. Even a wrong splice could only cost a recompute:
P checks the verified prefix's digest against its own prompt (ADR 0007).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Hashable
from dataclasses import dataclass

from kvbridge_services.common.lru import SizedLru

log = logging.getLogger(__name__)

# Tokens re-encoded before the old text's end. The first half must come out as before (resync check);
# the second half may change (a trailing space or partial word merging with the new text).
RESYNC_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Encoded:
    """A prompt's text, token ids and each token's end offset in the text (ends rather than starts: some
    tokenizers trim a token's leading space out of its offsets, never its end)."""

    text: str
    ids: array[int]  # uint32 ("I"): handed on as the prompt's ids, packed for hashing without a copy per token
    ends: array[int]

    @property
    def nbytes(self) -> int:
        return len(self.text) + self.ids.itemsize * len(self.ids) + self.ends.itemsize * len(self.ends) + 64


@dataclass(frozen=True, slots=True)
class Resume:
    """Where a new text's encoding may start: ``text[char:]`` is encoded and spliced after ``prev.ids[:token]``."""

    prev: Encoded
    token: int
    char: int


def encoded(text: str, ids: list[int], ends: list[int]) -> Encoded:
    return Encoded(text, array("I", ids), array("l", ends))


class PrefixCache:
    """Last prompt encoding per conversation, LRU, bounded by entries and by bytes."""

    def __init__(self, *, max_conversations: int, max_bytes: int, verify_every: int = 64) -> None:
        self._verify_every = verify_every
        self._by_key: SizedLru[Encoded] = SizedLru(
            max_bytes=max_bytes, max_entries=max_conversations, nbytes=lambda e: e.nbytes
        )
        self._splices = 0
        self.enabled = True
        self.reused_tokens = 0  # tokens taken from a previous encoding instead of encoded again

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def nbytes(self) -> int:
        return self._by_key.nbytes

    def resume(self, key: Hashable, text: str) -> Resume | None:
        """Where to start encoding ``text`` for conversation ``key``; None: encode it whole."""
        if not self.enabled:
            return None
        prev = self._by_key.get(key)
        if prev is None or len(prev.ids) <= RESYNC_TOKENS or not text.startswith(prev.text):
            return None
        token = len(prev.ids) - RESYNC_TOKENS
        return Resume(prev, token, prev.ends[token - 1])

    def splice(self, resume: Resume, text: str, tail_ids: list[int], tail_ends: list[int]) -> Encoded | None:
        """The whole encoding from the old ids and the encoding of ``text[resume.char:]``, or None when the
        re-encoded tokens do not reproduce the old ones where they must (then encode the text whole)."""
        prev, token, char = resume.prev, resume.token, resume.char
        check = RESYNC_TOKENS // 2
        if len(tail_ids) < check:
            return None
        for i in range(check):
            if tail_ids[i] != prev.ids[token + i] or tail_ends[i] + char != prev.ends[token + i]:
                return None
        ids = prev.ids[:token]
        ids.extend(tail_ids)
        ends = prev.ends[:token]
        ends.extend(e + char for e in tail_ends)
        self.reused_tokens += token
        return Encoded(text, ids, ends)

    def due_for_verification(self) -> bool:
        """True on every ``verify_every``-th splice: the caller compares it with a full encoding."""
        self._splices += 1
        return self._splices % self._verify_every == 0

    def disable(self, why: str) -> None:
        if self.enabled:
            log.warning("incremental prompt encoding off for this model: %s", why)
        self.enabled = False
        self._by_key.clear()

    def store(self, key: Hashable, enc: Encoded) -> None:
        if not self.enabled:
            return
        self._by_key.put(key, enc)
