"""One request's speculative decoding loop (``Speculator``): the target's cache holds the committed context but its
last token; each round the proposer suggests k tokens, the target scores that last token and the proposals in one
call, the acceptance rule (``rules``) decides what is committed, and the target's cache is rolled back past the
rejected proposals. ``generate`` runs it to the end; the serving engines call ``round`` themselves.

Every committed token comes with the target's logits row that predicted it, so log-probabilities and any later
check are the target's own, exactly as without a proposer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from bdlora.speculative.policy import KPolicy
from bdlora.speculative.rules import distribution, draw, verify_greedy, verify_sampled


@dataclass
class SpecStats:
    """What a speculative generation did: rounds, proposals, target and draft calls and their time."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    evaluated: int = 0
    committed: int = 0
    target_calls: int = 0
    draft_steps: int = 0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    ks: dict[int, int] = field(default_factory=dict)

    @property
    def acceptance(self) -> float:
        """Accepted proposals per proposal examined (those up to each round's first rejection)."""
        return self.accepted / self.evaluated if self.evaluated else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        return self.committed / self.target_calls if self.target_calls else 0.0

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "proposed": self.proposed, "accepted": self.accepted,
                "evaluated": self.evaluated, "acceptance": self.acceptance, "committed": self.committed,
                "target_calls": self.target_calls, "tokens_per_target_call": self.tokens_per_target_call,
                "draft_steps": self.draft_steps, "target_seconds": self.target_seconds,
                "draft_seconds": self.draft_seconds, "k": {str(k): n for k, n in sorted(self.ks.items())}}

    def add(self, other: SpecStats) -> None:
        for name in ("rounds", "proposed", "accepted", "evaluated", "committed", "target_calls", "draft_steps",
                     "target_seconds", "draft_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, n in other.ks.items():
            self.ks[k] = self.ks.get(k, 0) + n


class Speculator:
    """``target``: a decoder (``decoders``) whose graph returns every appended position's logits; ``proposer``: a
    ``DraftProposer`` or ``PromptLookup`` (None: plain decoding through the same loop); ``policy``: the k of each
    round. ``stop_ids``: tokens the target is never fed (end-of-text; the pad id under onnxruntime-genai)."""

    def __init__(self, target, proposer, policy: KPolicy, stop_ids=()):
        if not getattr(target, "all_rows", True) and proposer is not None:
            raise ValueError("the target's graph computes only the last position's logits; verifying proposals needs "
                             "every position's")
        self.target, self.proposer, self.policy = target, proposer, policy
        if getattr(proposer, "free", False):
            policy.free = True  # prompt lookup: its proposals cost nothing, whatever a draft's steps cost
        self.stop_ids = {int(t) for t in stop_ids if t is not None}
        self.stats = SpecStats()

    def prefill(self, prompt: list[int]) -> np.ndarray:
        """The target's logits (V,) after ``prompt`` (all of it fed): the caller draws the first token from them and
        appends it to the context, whose last token ``round`` then feeds."""
        t0 = time.perf_counter()
        row = self.target.append(list(prompt))[-1]
        self.stats.target_seconds += time.perf_counter() - t0
        self.stats.target_calls += 1
        return row

    def round(self, seq: list[int], temperature: float, top_p: float, rng: np.random.Generator | None,
              wanted: int, room: int) -> list[tuple[int, np.ndarray]]:
        """Commit the next tokens after ``seq`` (the committed context: the target holds all of it but the last
        token): [(token, the target's logits row that predicted it)], at least one. ``wanted``: tokens still to
        generate (a round commits at most k + 1, so k < wanted); ``room``: positions the target can still take."""
        target = self.target
        lag = seq[target.length:]  # the committed tokens the target has not seen (usually the last one)
        k = self.policy.choose(min(wanted - 1, room - len(lag))) if self.proposer is not None else 0
        proposal, q = [], None
        if k > 0:
            t0 = time.perf_counter()
            calls = self.proposer.calls
            prop = self.proposer.propose(seq, k, temperature, top_p, rng)
            proposal, q = prop.tokens, prop.q
            spent = time.perf_counter() - t0
            self.stats.draft_seconds += spent
            self.stats.draft_steps += self.proposer.calls - calls
            self.policy.costs.record_draft(self.proposer.calls - calls, spent)
        fed = proposal[:-1] if proposal and proposal[-1] in self.stop_ids else proposal
        before = target.length
        t0 = time.perf_counter()
        z = target.append(lag + fed)[len(lag) - 1 :]  # row i predicts proposal[i] (the last row: the bonus)
        spent = time.perf_counter() - t0
        self.stats.target_seconds += spent
        self.stats.target_calls += 1
        self.policy.costs.record_target(len(lag) + len(fed), spent)
        if temperature <= 0.0:
            m, nxt = verify_greedy(proposal, z)
        else:
            m, nxt = verify_sampled(proposal, q, np.stack([distribution(r, temperature, top_p) for r in z]), rng)
        target.rewind(before + len(lag) + m)
        if proposal:
            self.policy.record(len(proposal), m)
        committed = proposal[:m] + ([] if nxt is None else [nxt])
        s = self.stats
        s.rounds += 1
        s.ks[len(proposal)] = s.ks.get(len(proposal), 0) + 1
        s.proposed += len(proposal)
        s.accepted += m
        s.evaluated += min(m + 1, len(proposal))
        s.committed += len(committed)
        return [(t, z[i]) for i, t in enumerate(committed)]


def generate(speculator: Speculator, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, eos: int | None = None,
             max_length: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """The generated tokens of ``prompt`` (with the target's logits row of each), at most ``max_new_tokens``, ending
    after ``eos``; exactly the target's greedy tokens at temperature 0, the target's distribution otherwise."""
    rng = np.random.default_rng(seed) if temperature > 0.0 else None
    limit = max_length or 1 << 62
    if max_new_tokens <= 0:
        return
    row = speculator.prefill(prompt)
    first = int(np.argmax(row)) if temperature <= 0.0 else draw(distribution(row, temperature, top_p), rng)
    seq = list(prompt) + [first]
    speculator.stats.committed += 1
    yield first, row
    made = 1
    while made < max_new_tokens and seq[-1] != eos and len(seq) < limit:
        for token, row in speculator.round(seq, temperature, top_p, rng, max_new_tokens - made, limit - len(seq)):
            seq.append(token)
            made += 1
            yield token, row
            if made >= max_new_tokens or token == eos:
                return
