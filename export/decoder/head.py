"""The LM head of every decoder graph, emitted by its declared form (``config.bdlora_modules["lm_head"]``; absent:
the dense head): one emitter per head form, registered in ``HEADS``, so a form of the head is one entry here.

- dense: ``logits = final @ W^T (+ b)``, one MatMul (``/lm_head/MatMul``, which the quantisers round as the head);
- vocab (``forms.VOCAB``, a draft's): the same MatMul over the ``keep`` kept tokens' rows, scattered into a full
  vocabulary row filled with the lowest kept logit less ``VOCAB_MARGIN``, so the graph's logits keep the signature
  every runtime and verifier reads (vocabulary-wide rows), at ``keep / vocab`` of the head's product.
"""

from __future__ import annotations

import numpy as np
import torch.nn as nn

from bdlora.forms import HEAD, VOCAB, VOCAB_MARGIN
from bdlora.models.runtime import DecoderSignature as Sig

HEAD_MATMUL = "/lm_head/MatMul"


def _f32(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _dense(g, head: nn.Module, final: str) -> None:
    w_head = g.init("lm_head.weight", _f32(head.weight).T)
    if head.bias is None:
        g.node("MatMul", [final, w_head], HEAD_MATMUL, outputs=[Sig.LOGITS])
    else:
        logits = g.one("MatMul", [final, w_head], HEAD_MATMUL)
        g.node("Add", [logits, g.init("lm_head.bias", _f32(head.bias))], "/lm_head/Add", outputs=[Sig.LOGITS])


def _vocab(g, head: nn.Module, final: str) -> None:
    kept = g.one("MatMul", [final, g.init("lm_head.weight", _f32(head.weight).T)], HEAD_MATMUL)  # (B, S, K)
    ids = g.init("lm_head.token_ids", head.token_ids.detach().cpu().numpy().astype(np.int64).reshape(1, 1, -1))
    p = "/lm_head/vocab"
    bs = g.one("Shape", [kept], f"{p}/bs", start=0, end=2)  # (B, S)
    full = g.one("Concat", [bs, g.const(f"{p}/V", [head.out_features])], f"{p}/full_shape", axis=0)
    low = g.one("ReduceMin", [kept, g.const(f"{p}/last_axis", [-1])], f"{p}/ReduceMin", keepdims=1)  # (B, S, 1)
    floor = g.one("Sub", [low, g.const(f"{p}/margin", VOCAB_MARGIN, np.float32)], f"{p}/floor")
    fill = g.one("Expand", [floor, full], f"{p}/fill_rows")  # (B, S, V)
    index = g.one("Expand", [ids, g.one("Shape", [kept], f"{p}/kept_shape")], f"{p}/index")  # (B, S, K)
    g.node("ScatterElements", [fill, index, kept], f"{p}/ScatterElements", outputs=[Sig.LOGITS], axis=2)


HEADS = {"dense": _dense, VOCAB.name: _vocab}  # the head's declared form -> its emitter


def emit_head(g, model: nn.Module, final: str) -> None:
    """The logits of ``final`` (the final norm's output) by ``model``'s head in the form its config declares."""
    spec = (getattr(model.config, "bdlora_modules", None) or {}).get(HEAD) or {}
    HEADS[spec.get("form", "dense")](g, model.lm_head, final)
