"""What proposes the tokens the target verifies: a draft model (``DraftProposer``, a decoder of ``decoders``, e.g. a
student bdlora made from the teacher), or the context itself (``PromptLookup``: the continuation of the last n-gram's
most recent earlier occurrence, Saxena's prompt-lookup decoding; no model at all)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bdlora.speculative.rules import distribution, draw


@dataclass
class Proposal:
    """Proposed tokens and the distributions they were drawn from ((k, V); None: a deterministic proposer)."""

    tokens: list[int]
    q: np.ndarray | None = None


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists: slice comparisons (C speed) in a binary search,
    since a context of thousands of tokens is compared every round and differs, if at all, near its end."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class DraftProposer:
    """A draft model proposing token by token from its own distribution (greedy at temperature 0). Its cache holds a
    prefix of what it was fed (``fed``); each proposal first rolls it back to what the committed context shares
    with it, then feeds the rest of the context in one call. A token in ``stop_ids`` (end-of-text; under
    onnxruntime-genai also the pad id, which it drops from the end of what it is fed) ends the proposal unfed."""

    name = "draft"

    def __init__(self, decoder, stop_ids=()):
        self.decoder = decoder
        self.stop_ids = {int(t) for t in stop_ids if t is not None}
        self.fed: list[int] = []
        self.calls = 0

    def propose(self, seq: list[int], k: int, temperature: float, top_p: float,
                rng: np.random.Generator | None) -> Proposal:
        keep = min(common_prefix(self.fed, seq), len(seq) - 1)  # at least one token to feed: its logits are needed
        self.decoder.rewind(keep)
        self.fed = self.fed[:keep]
        feed = list(seq[keep:])
        tokens, qs = [], []
        for _ in range(k):
            row = self.decoder.append(feed)[-1]
            self.fed += feed
            self.calls += 1
            q = distribution(row, temperature, top_p)
            d = int(np.argmax(q)) if temperature <= 0.0 else draw(q, rng)
            tokens.append(d)
            qs.append(q)
            if d in self.stop_ids:
                break
            feed = [d]
        return Proposal(tokens, np.stack(qs) if qs and temperature > 0.0 else None)


class PromptLookup:
    """Proposes the tokens that followed the most recent earlier occurrence of the context's last n tokens, the
    longest n in [``min_ngram``, ``max_ngram``] that occurred before (none: no proposal, a plain step). The n-grams
    are indexed incrementally (the committed context only grows), so a lookup costs a dictionary probe per n."""

    name = "prompt-lookup"
    free = True  # a proposal costs no model step: the k policy prices it at 0

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes {min_ngram}..{max_ngram}: need 1 <= min <= max")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> the last position it ended at (< len(seq) - 1)
        self.indexed = 0  # positions whose n-grams are in the index
        self.seen: list[int] = []
        self.calls = 0

    def _extend(self, seq: list[int]) -> None:
        if seq[: len(self.seen)] != self.seen:  # another context: start over
            self.index, self.indexed, self.seen = {}, 0, []
        self.seen += seq[len(self.seen):]
        for end in range(self.indexed, len(seq) - 1):  # n-grams ending before the last position
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n + 1 >= 0:
                    self.index[tuple(seq[end - n + 1 : end + 1])] = end
        self.indexed = max(self.indexed, len(seq) - 1)

    def propose(self, seq: list[int], k: int, temperature: float = 0.0, top_p: float = 1.0,
                rng: np.random.Generator | None = None) -> Proposal:
        self._extend(seq)
        for n in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            end = self.index.get(tuple(seq[len(seq) - n :]))
            if end is not None:
                return Proposal([int(t) for t in seq[end + 1 : end + 1 + k]])
        return Proposal([])


PROPOSERS = (DraftProposer.name, PromptLookup.name)  # the one spelling of each proposer, everywhere


def speculation_length(prompt: int, new_tokens: int, max_k: int, limit: int | None = None) -> int:
    """Positions the target's and the draft's decoders hold for ``new_tokens`` after a ``prompt``-token prompt (the
    one formula, for ``generate`` and ``bench``; a server's come from its cache): a round may run ``max_k`` proposals
    past the last token kept, and the verified step and its bonus token take two more; at most ``limit`` (the
    model's positions)."""
    n = prompt + new_tokens + max_k + 2
    return n if limit is None else min(limit, n)


def new_proposer(kind: str | None, ngram: int, draft=None, max_length: int = 0, stop_ids=()):
    """The proposer ``kind`` names (``PROPOSERS``; None: no speculation, no proposer), the one place one is built
    for ``generate``, ``serve`` and ``bench``: the ``draft`` factory's decoder for ``max_length`` tokens, never fed
    ``stop_ids``; or prompt lookup matching n-grams of up to ``ngram`` tokens."""
    if kind is None:
        return None
    if kind == DraftProposer.name:
        return DraftProposer(draft.new(max_length), stop_ids)
    if kind == PromptLookup.name:
        return PromptLookup(ngram)
    raise ValueError(f"proposer {kind!r}: allowed {', '.join(PROPOSERS)}")
