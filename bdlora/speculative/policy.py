"""How many tokens to propose in a round (k), chosen from what was measured: the acceptance rate of this request's
proposals and the time the target takes to score w tokens at once and the draft to propose one.

A round of k proposals commits ``expected_tokens(alpha, k)`` tokens on average and costs ``k c_draft + c_target(k +
1)``; k = 0 is a plain decoding step (one token for ``c_target(1)``). The policy picks the k with the most tokens per
second, so speculation switches itself off (k = 0) where it does not pay: a draft that agrees too rarely, or a target
whose multi-token calls cost nearly as much per token as single steps. While k = 0 it still proposes one token every
``PROBE_EVERY`` rounds (backing off while probes fail), so an acceptance that recovers (prompt lookup entering a
repeated passage) is seen.
``best_k`` is the pure rule (tested with hypothesis); ``Costs`` is shared by every request of one server (the costs
are the machine's, and the proposer's acceptance so far is a new request's prior), ``KPolicy`` is one request's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bdlora.speculative.rules import expected_tokens

EWMA = 0.2  # weight of a new timing in the moving averages
PRIOR_ALPHA, PRIOR_WEIGHT = 0.5, 4.0  # the acceptance before any proposal is verified: 0.5, worth 4 proposals
SHARED_MEMORY = 512.0  # proposals the shared acceptance remembers (older ones count half once it holds twice this)
PRIOR_SLOPE = 0.15  # a target call of w tokens costs c(1) (1 + 0.15 (w - 1)) until two widths are measured
PRIOR_DRAFT = 0.1  # a draft step costs 0.1 c(1) until measured
PROBE_EVERY = 16  # rounds at k = 0 before a probe at k = 1; doubled after each probe that was rejected (at most
PROBE_MAX = 256  # this many), back to PROBE_EVERY when one is accepted


def best_k(alpha: float, draft_cost: float, target_cost, max_k: int) -> tuple[int, float]:
    """(k in [0, max_k] with the most committed tokens per unit time, that rate). ``target_cost(w)``: the time of a
    target call scoring w tokens; ``draft_cost``: one draft step. Ties go to the smaller k (less work for the
    same speed)."""
    best, rate = 0, 1.0 / target_cost(1)
    for k in range(1, max_k + 1):
        r = expected_tokens(alpha, k) / (k * draft_cost + target_cost(k + 1))
        if r > rate * (1.0 + 1e-9):
            best, rate = k, r
    return best, rate


@dataclass
class Costs:
    """Moving averages of the measured times (seconds): a target call per width scored, a draft step."""

    target: dict[int, float] = field(default_factory=dict)
    draft: float | None = None
    accepted: float = 0.0  # over every request that shares these costs: a new request's prior acceptance
    evaluated: float = 0.0

    def record_acceptance(self, accepted: int, evaluated: int) -> None:
        self.accepted, self.evaluated = self.accepted + accepted, self.evaluated + evaluated
        if self.evaluated > 2 * SHARED_MEMORY:
            self.accepted, self.evaluated = self.accepted / 2, self.evaluated / 2

    def prior_alpha(self) -> float:
        """The acceptance a new request starts from: what this proposer achieved on the requests before it (a
        server's 1-client latency fell to 0.68x when every short request re-learned a draft's 25% from 0.5)."""
        return (self.accepted + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.evaluated + PRIOR_WEIGHT)

    def record_target(self, width: int, seconds: float) -> None:
        old = self.target.get(width)
        self.target[width] = seconds if old is None else old + EWMA * (seconds - old)

    def record_draft(self, steps: int, seconds: float) -> None:
        if steps <= 0:
            return
        per = seconds / steps
        self.draft = per if self.draft is None else self.draft + EWMA * (per - self.draft)

    def target_cost(self, width: int) -> float:
        """Measured where it was, else a line through the measured widths (least squares; one width: its time and
        ``PRIOR_SLOPE``); 1 before anything is measured (only ratios matter)."""
        if width in self.target:
            return self.target[width]
        if not self.target:
            return 1.0 + PRIOR_SLOPE * (width - 1)
        ws = sorted(self.target)
        if len(ws) == 1:
            base = self.target[ws[0]] / (1.0 + PRIOR_SLOPE * (ws[0] - 1))
            return base * (1.0 + PRIOR_SLOPE * (width - 1))
        mw = sum(ws) / len(ws)
        mc = sum(self.target[w] for w in ws) / len(ws)
        slope = sum((w - mw) * (self.target[w] - mc) for w in ws) / sum((w - mw) ** 2 for w in ws)
        return max(mc + max(slope, 0.0) * (width - mw), min(self.target.values()))

    def draft_cost(self) -> float:
        return self.draft if self.draft is not None else PRIOR_DRAFT * self.target_cost(1)


class KPolicy:
    """One request's choice of k: fixed (``fixed``), or adaptive up to ``max_k`` from its own acceptance and the
    shared ``costs``."""

    def __init__(self, max_k: int, costs: Costs | None = None, fixed: int | None = None):
        self.max_k, self.fixed = int(max_k), fixed
        # free (set by the Speculator for prompt lookup): proposals cost no model step, so the draft's cost is 0,
        # never the draft model's measured or assumed step (which made lookup choose k = 0 where k = 4 paid 1.17x)
        self.free = False
        self.costs = costs if costs is not None else Costs()
        self.accepted = 0.0
        self.evaluated = 0.0
        self.plain_rounds = 0
        self.probe_every = PROBE_EVERY
        self.probing = False

    @property
    def alpha(self) -> float:
        return (self.accepted + self.costs.prior_alpha() * PRIOR_WEIGHT) / (self.evaluated + PRIOR_WEIGHT)

    def choose(self, limit: int) -> int:
        """k for the next round, at most ``limit`` (the tokens still wanted minus one, the room left)."""
        if limit <= 0:
            return 0
        if self.fixed is not None:
            return min(self.fixed, limit)
        draft = 0.0 if self.free else self.costs.draft_cost()
        k, _ = best_k(self.alpha, draft, self.costs.target_cost, min(self.max_k, limit))
        self.probing = False
        if k == 0:
            self.plain_rounds += 1
            if self.plain_rounds >= self.probe_every:
                self.plain_rounds, self.probing = 0, True
                return 1
        return k

    def record(self, proposed: int, accepted: int) -> None:
        """One verified proposal of ``proposed`` tokens, the first ``accepted`` of them taken: the tokens examined
        are those up to the first rejection."""
        if proposed:
            self.accepted += accepted
            self.evaluated += min(accepted + 1, proposed)
            self.costs.record_acceptance(accepted, min(accepted + 1, proposed))
        if self.probing:
            self.probe_every = PROBE_EVERY if accepted else min(2 * self.probe_every, PROBE_MAX)
