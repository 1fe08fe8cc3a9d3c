"""``bdlora serve --draft FOLDER`` / ``--prompt-lookup``: the engines' speculative rounds.

A sequence that runs alone (the engine's batch holds only it) is continued speculatively: its proposer (the draft
model, opened once per server, with one cache per sequence; or prompt lookup) suggests k tokens, the served model
verifies them in one call over the sequence's own cache, and the tokens the acceptance rule commits are taken one by
one exactly as decoded tokens are (sampling parameters, stop strings, log-probabilities: the served model's own
rows). With two or more sequences the engine decodes them together as before: one batched step already gives each
of them a token for about the cost of one, which a batch-1 speculative round cannot beat, so speculation stays off
under concurrency and serving with a proposer is never slower than without one there. k is chosen per request from
its measured acceptance and the server's measured costs (``speculative.policy``); a proposer that does not pay is
switched off by the same rule.
"""

from __future__ import annotations

import numpy as np

from bdlora.speculative.config import SpeculationConfig
from bdlora.speculative.decoders import DecoderFactory, stop_ids_of
from bdlora.speculative.loop import SpecStats, Speculator
from bdlora.speculative.policy import Costs, KPolicy
from bdlora.speculative.proposers import new_proposer


class EngineSpeculation:
    """One server's proposer: the draft model opened once (``threads`` intra-op threads), the costs its requests
    share, and the totals /metrics reports."""

    def __init__(self, spec: SpeculationConfig, threads: int | None, stop_ids, eos: int | None):
        self.spec = spec
        self.draft = DecoderFactory(spec.draft, threads) if spec.draft else None
        self.stop_ids = list(stop_ids)  # never fed to the served model
        self.draft_stop_ids = stop_ids_of(self.draft, eos) if self.draft is not None else []
        self.costs = Costs()
        self.totals = SpecStats()

    def speculator(self, seq, target, max_length: int) -> Speculator:
        """The sequence's speculator over ``target`` (a decoder view of its cache, made for this round); its proposer
        and policy live on the sequence across rounds."""
        if getattr(seq, "proposer", None) is None:
            seq.proposer = new_proposer(self.spec.kind, self.spec.ngram, self.draft, max_length, self.draft_stop_ids)
            seq.policy = KPolicy(self.spec.max_k, self.costs, fixed=self.spec.max_k if self.spec.fixed_k else None)
        return Speculator(target, seq.proposer, seq.policy, self.stop_ids)

    def round(self, seq, target, max_length: int) -> list[tuple[int, np.ndarray]]:
        """One round for ``seq`` (a ``sequence.Sequence`` whose ``next_token`` the target has not been fed):
        [(token, logits row)] committed, to be taken in order by ``seq.accept``."""
        p = seq.req.params
        if seq.rng is None and p.temperature > 0.0:
            seq.rng = np.random.default_rng(p.seed)
        sp = self.speculator(seq, target, max_length)
        context = list(seq.req.prompt_ids) + seq.generated
        wanted = p.max_tokens - len(seq.generated)
        out = sp.round(context, p.temperature, p.top_p, seq.rng, wanted, max_length - len(context))
        self.totals.add(sp.stats)
        return out

    def metrics(self) -> dict:
        t = self.totals
        return {"spec_rounds": t.rounds, "spec_proposed": t.proposed, "spec_accepted": t.accepted,
                "spec_evaluated": t.evaluated, "spec_committed": t.committed, "spec_draft_steps": t.draft_steps}
