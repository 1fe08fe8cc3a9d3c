"""Student construction (SPEC 2): fewer decoder layers, warm-started from selected layers of a source checkpoint
(the teacher by default); embeddings, final norm and LM head copied."""

from __future__ import annotations

import numpy as np

from bdlora.base.errors import ModelError, UsageError
from bdlora.models.depth import take_layers
from bdlora.train.config import LAYER_SELECTIONS


def select_layers(mode: str, source_layers: int, n: int) -> list[int]:
    """Indices of the source layers a student of ``n`` layers is built from.

    ``mixed`` (default, the paper's best): first and last always, the rest evenly spaced between them,
    ``round(linspace(0, L-1, n))`` with numpy's round-half-to-even, unique; 12 -> 6 gives 0, 2, 4, 7, 9, 11.
    ``scratch`` returns the ``first`` indices only to size the model; its weights are then re-initialised.
    """
    if mode not in LAYER_SELECTIONS:
        raise UsageError(f"--layer-selection {mode!r}: unknown (allowed: {', '.join(LAYER_SELECTIONS)})")
    if not 1 <= n <= source_layers:
        raise UsageError(f"--student-layers {n}: must be between 1 and the source's {source_layers} layers")
    if mode in ("first", "scratch"):
        return list(range(n))
    if mode == "last":
        return list(range(source_layers - n, source_layers))
    if mode == "middle":
        start = (source_layers - n) // 2
        return list(range(start, start + n))
    if n == 1:
        return [0]
    idx = sorted({int(i) for i in np.round(np.linspace(0, source_layers - 1, n))})
    assert len(idx) == n, (idx, n)  # spacing >= 1 whenever n <= L, so rounding never merges two indices
    return idx


def check_same_vocabulary(tok_a, tok_b, what: str) -> None:
    if len(tok_a) != len(tok_b) or tok_a.get_vocab() != tok_b.get_vocab():
        raise ModelError(f"{what}: vocabulary differs from the teacher's ({len(tok_b)} vs {len(tok_a)} tokens); "
                         "teacher and student must share one tokenizer")


def build_student(source_model, n_layers: int, mode: str = "mixed", seed: int = 0):
    """A new causal LM with the source's architecture and ``n_layers`` decoder layers, warm-started from the
    selected source layers (or randomly initialised for ``scratch``). Returns (student, selected indices)."""
    idx = select_layers(mode, source_model.config.num_hidden_layers, n_layers)
    return take_layers(source_model, idx, seed, scratch=mode == "scratch"), idx


