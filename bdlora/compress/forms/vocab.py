"""A draft's LM head over the tokens its teacher emits most (``forms.VOCAB``, ``--forms vocab``): the head keeps the
``keep`` tokens carrying most of the teacher's probability on the calibration tokens, every other token's logit is
``VOCAB_MARGIN`` below the lowest kept one (probability ~0).

A speculative-decoding draft needs to be cheap and to agree with the teacher; it need not be exact, because the
teacher verifies every token it proposes. A head over the frequent tokens is exact wherever the teacher's choice is
one of them and costs ``keep / vocab`` of the full head's product, which at small models is a large part of the
whole decode step (SmolLM2: a 49,152 x 576 head is ~1 ms of a 2 ms 4-layer draft; Gemma 3 270M: 262,144 x 640, 63%
of the weights). It would not do for a student that replaces the teacher: a token outside the kept set can never be
emitted.

The tokens are ranked by the teacher's probability summed over the calibration tokens (``calibrate(...,
predicted=True)``). Keeping the first K loses, at each token t, the probability ``m_t(K)`` the teacher puts outside
them; the error offered to the knapsack is ``2 sum_t m_t(K)``: to first order the teacher's own forward KL to its
distribution renormalised on the kept tokens, summed over the calibration tokens, doubled to the scale of the other
forms' loss-weighted errors (the Fisher-weighted output change estimates twice the loss increase). The kept
vocabularies are 32 (the int4 block) doubled up to the vocabulary; each is priced by its (hidden, K) product
at the head's width in the measured table, so ``vocab`` needs the whole decode step as its budget (``--speedup``).
Only the vocabularies holding at least ``MIN_COVERAGE`` of the teacher's argmax tokens are offered (a greedy draft
can match the teacher at most that often, and healing cannot give it back); the provenance records every kept
vocabulary's share.
"""

from __future__ import annotations

import numpy as np
import torch

from bdlora.forms import HEAD, VOCAB, WIDE_BITS
from bdlora.forms.context import BaseStep, Choice, OneShotContext
from bdlora.models.costs import ModuleShape

SMALLEST = 32  # tokens: the smallest kept vocabulary offered (the int4 block), doubling up to the vocabulary
# The least share of the teacher's argmax tokens (on the calibration tokens) a kept vocabulary must hold to be offered.
# Healing gives back what cutting the body costs, never a token the head cannot emit: a greedy draft matches the
# teacher at most this often. Measured on SmolLM2 at a 4x whole-step budget: offered every vocabulary, the knapsack
# kept 32 tokens (46% of the teacher's choices; the pre-healing body errors dwarfed the head's); 2,048 hold 98.4% and
# cost 1/24 of the full head.
MIN_COVERAGE = 0.98


def vocab_grid(vocab: int) -> list[int]:
    """The kept vocabularies offered: 32, 64, ... below ``vocab``."""
    out, k = [], SMALLEST
    while k < vocab:
        out.append(k)
        k *= 2
    return out


def head_cost(ctx: OneShotContext, keep: int) -> float:
    """The head's product keeping ``keep`` tokens at the head's own width (8 bits beside an int4 table), or its
    MACs."""
    s = ModuleShape(HEAD, int(ctx.config["hidden_size"]), keep)
    if ctx.table is None:
        return float(s.dense_cost)
    return float(ctx.table.cost(s, 0, WIDE_BITS if ctx.table.wide is not None else 0))


class VocabStep(BaseStep):
    name = "vocab"

    def pricing(self, ctx: OneShotContext) -> None:
        hidden, vocab = int(ctx.config["hidden_size"]), int(ctx.config["vocab_size"])
        ctx.table_options["wide"] = True
        ctx.table_options["heads"] = [*ctx.table_options.get("heads", ()), (hidden, vocab),
                                      *((hidden, k) for k in vocab_grid(vocab))]

    def calibration(self, ctx: OneShotContext) -> None:
        ctx.calibration["predicted"] = True

    def offer(self, ctx: OneShotContext) -> None:
        mass, argmax = ctx.calib.mass, ctx.calib.argmax
        order = np.argsort(-mass, kind="stable")
        kept = np.concatenate([[0.0], np.cumsum(mass[order])])  # kept[K]: probability the first K hold
        hits = np.concatenate([[0], np.cumsum(argmax[order])])
        total, picks = float(mass.sum()), max(int(argmax.sum()), 1)
        grid = vocab_grid(len(mass))
        offered = [k for k in grid if hits[k] / picks >= MIN_COVERAGE]
        ctx.offer(HEAD, [Choice(self.name, head_cost(ctx, len(mass)), 0.0)] + [
            Choice(self.name, head_cost(ctx, k), 2.0 * max(total - float(kept[k]), 0.0), keep=k) for k in offered])
        ctx.own(self.name)["order"] = order
        ctx.facts["vocab"] = {"ranked_by": "the teacher's summed probability on the calibration tokens",
                              "offered": offered, "min_argmax_coverage": MIN_COVERAGE,
                              "argmax_coverage": {str(k): float(hits[k]) / picks for k in grid},
                              "probability_kept": {str(k): float(kept[k]) / total for k in grid}}

    def deploy(self, ctx: OneShotContext, alloc) -> dict:
        choice = alloc.by(self.name).get(HEAD)
        keep = choice.keep if choice else 0
        if not keep:
            return {}
        ids = torch.from_numpy(np.sort(ctx.own(self.name)["order"][:keep]).copy())
        weight = ctx.model.get_output_embeddings().weight.detach()[ids].clone()  # (K, hidden)
        ctx.facts["vocab"]["keep"] = keep
        return {HEAD: {"spec": VOCAB.spec(keep), "state": {f"{HEAD}.weight": weight, f"{HEAD}.token_ids": ids}}}


STEP = VocabStep()
