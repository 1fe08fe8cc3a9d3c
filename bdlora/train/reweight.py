"""``train --reweight-every K``: a ``--data`` mixture whose weights move toward the components where the student
trails the teacher most (Sheared-LLaMA's dynamic batch loading, Xia et al. 2024).

A structured student healed on a fixed mixture recovers the components it is already close on and stays behind on
the others; the healing issue measured SmolLM2 at 1.0x the teacher on its own mixture and 2.36x on text it had not
seen. Every K optimiser steps each component's gap is measured on its own held-out slice (``SLICE_BLOCKS`` blocks):

    gap_i = max(0, NLL_student_i - NLL_teacher_i)            (nats per token; the teacher's figure computed once)
    log w_i <- log w_i + ETA * gap_i,  w <- softmax,  w <- (1 - SMOOTHING) w + SMOOTHING / n

A training sequence k (a global index, as ``BlockSampler``'s) picks its component with the weights in force and a
block of that component uniformly, both drawn from a generator seeded by (seed, k): a batch is a pure function of
(seed, step, weights), and the weights are part of every checkpoint, so ``--resume`` continues the same stream.
"""

from __future__ import annotations

import math

import numpy as np

from bdlora.base.errors import TrainingError

ETA = 1.0  # the step size of the exponentiated update, per nat of gap
SMOOTHING = 1e-2  # a share kept uniform so no component is ever dropped for good
SLICE_BLOCKS = 8  # held-out blocks of each component scored at every update


class Reweighter:
    """The mixture's components (training blocks, held-out blocks), their weights and the update rule above.
    Stands in for both the run's sampler (``indices``) and its training blocks (``batch``, ``get``)."""

    def __init__(self, specs: list[str], train: list, heldout: list, weights: list[float], seed: int, every: int):
        if len(specs) < 2:
            raise TrainingError("--reweight-every: needs a --data mixture of two or more corpora")
        self.specs, self.train, self.heldout, self.seed, self.every = specs, train, heldout, seed, every
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.initial = self.weights.copy()
        self.teacher_nll: list[float] | None = None
        self.history: list[dict] = []

    # -- the sampler and the blocks --------------------------------------------------------------------------------

    def indices(self, first: int, count: int) -> list[tuple[int, int]]:
        """(component, block) of training sequences ``first .. first + count - 1``."""
        out = []
        for k in range(first, first + count):
            rng = np.random.default_rng([self.seed, k])
            c = int(rng.choice(len(self.weights), p=self.weights))
            out.append((c, int(rng.integers(len(self.train[c])))))
        return out

    def batch(self, pairs):
        """(ids, mask) of the chosen blocks (mask None when every row is real tokens)."""
        import torch

        rows = [self.train[c].batch([i]) for c, i in pairs]
        ids = torch.cat([x for x, _ in rows])
        if all(m is None for _, m in rows):
            return ids, None
        return ids, torch.cat([torch.ones_like(x) if m is None else m for x, m in rows])

    def get(self, pairs) -> np.ndarray:
        return self.batch(pairs)[0].numpy()

    # -- the update --------------------------------------------------------------------------------------------------

    def gaps(self, student, teacher) -> tuple[list[float], list[float]]:
        """(student NLL, gap) of every component on its held-out slice."""
        from bdlora.models.perplexity import mean_nll

        def nll(model, blocks) -> float:
            return mean_nll(model, blocks, device=next(model.parameters()).device)[0]

        if self.teacher_nll is None:
            self.teacher_nll = [nll(teacher, b) for b in self.heldout]
        student_nll = [nll(student, b) for b in self.heldout]
        return student_nll, [max(0.0, s - t) for s, t in zip(student_nll, self.teacher_nll)]

    def update(self, step: int, student, teacher) -> dict:
        """Measure the gaps, move the weights, record and return what happened."""
        was = student.training
        student.eval()
        try:
            nll, gap = self.gaps(student, teacher)
        finally:
            student.train(was)
        self.weights = next_weights(self.weights, gap)
        rec = {"step": step, "weights": self.weights.tolist(), "gaps": gap, "student_nll": nll,
               "teacher_nll": list(self.teacher_nll)}
        self.history.append(rec)
        return rec

    def due(self, done: int) -> bool:
        return self.every > 0 and done % self.every == 0

    # -- checkpoints and the summary -------------------------------------------------------------------------------

    def state(self) -> dict:
        return {"weights": self.weights.tolist(), "teacher_nll": self.teacher_nll, "history": self.history}

    def load_state(self, state: dict) -> None:
        w = np.asarray(state["weights"], dtype=np.float64)
        if w.shape != self.weights.shape or not np.all(np.isfinite(w)) or abs(w.sum() - 1) > 1e-6:
            raise ValueError(f"mixture weights {state['weights']} do not fit {len(self.specs)} components")
        self.weights, self.teacher_nll, self.history = w, state.get("teacher_nll"), list(state.get("history", []))

    def summary(self) -> dict:
        return {"components": self.specs, "every": self.every, "initial_weights": self.initial.tolist(),
                "final_weights": self.weights.tolist(), "updates": len(self.history),
                "last_gaps": self.history[-1]["gaps"] if self.history else None}


def reweigh(run, done: int, m: dict) -> None:
    """--reweight-every: rank 0 measures the gaps and moves the weights; every rank samples with them."""
    from bdlora.train import distributed as D  # torch

    mix = run.sess.mixture
    if mix is None or not mix.due(done) or done >= run.cfg.max_steps:
        return
    rec = mix.update(done, run.model, run.sess.teacher) if run.env.is_main else None
    mix.weights = np.asarray(D.broadcast_object(run.env, rec["weights"] if rec else None))
    m["mixture_weights"] = mix.weights.tolist()
    if rec is not None:
        run.reporter.stage("mixture " + ", ".join(f"{s} {w:.2f} (gap {g:.3f})" for s, w, g in
                                                  zip(mix.specs, rec["weights"], rec["gaps"])))


def next_weights(weights, gaps, eta: float = ETA, smoothing: float = SMOOTHING) -> np.ndarray:
    """The exponentiated update of the module docstring: weights (summing to 1) moved toward larger gaps."""
    w = np.asarray(weights, dtype=np.float64)
    g = np.asarray([max(0.0, x) if math.isfinite(x) else 0.0 for x in gaps], dtype=np.float64)
    logits = np.log(np.maximum(w, 1e-300)) + eta * g
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return (1 - smoothing) * p + smoothing / len(p)
