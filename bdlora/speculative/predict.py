"""The speculative speed-up a draft should give, from three measured figures (``plan --speculative``):

- ``alpha``: how often the draft's next token is the target's (greedy agreement, measured token by token on
  held-out text with the target's own context: what a round's acceptance is, position by position);
- ``draft``: one draft step's time as a share of one target decode step (the latency tables' whole-step
  predictions of both);
- ``verify(w)``: one target call scoring ``w`` tokens as a share of one decode step (measured on the target's
  shapes at the deployed precision: multi-token calls cost more per call on a CPU, the int4 kernels especially).

A round of k proposals then commits ``expected_tokens(alpha, k)`` tokens for ``k draft + verify(k + 1)`` decode steps'
time, against one token per step without a draft (Leviathan et al., section 3.4, with the verification's measured
cost in place of their constant). Acceptance is not independent from token to token (a draft agrees in runs), so
this is an estimate; bench --speculative measures it.
"""

from __future__ import annotations

from bdlora.speculative.rules import expected_tokens


def speculative_speedup(alpha: float, draft: float, verify: dict[int, float], max_k: int) -> dict:
    """{"per_k": {k: predicted speed-up}, "best_k": k, "speedup": its speed-up} (k = 0, no proposal, is 1.0)."""
    per_k = {0: 1.0}
    for k in range(1, max_k + 1):
        if k + 1 in verify:
            per_k[k] = expected_tokens(alpha, k) / (k * draft + verify[k + 1])
    best = max(per_k, key=lambda k: (per_k[k], -k))
    return {"alpha": alpha, "draft_step_share": draft, "verify_share": {str(w): v for w, v in verify.items()},
            "per_k": {str(k): v for k, v in per_k.items()}, "best_k": best, "speedup": per_k[best]}
