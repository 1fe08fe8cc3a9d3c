"""Calibration activations one decoder layer at a time (sequential onloading, as llm-compressor and GPTQ's reference
implementation calibrate): the hidden states of every calibration block entering layer ``i`` are kept, layer ``i``
is made from its weight files (``lazy.materialized``), run over them with hooks on its projections, and dropped; the
outputs enter layer ``i + 1``. A 1B-8B model is calibrated holding one layer in fp32 and the blocks' hidden states
(32,768 tokens of an 8B model: 0.5 GB), never the model.

What each layer is called with besides its input (the causal mask of its attention type, the rotary embedding of
its positions, Gemma 3's sliding and global variants) is the model's own: one forward of the base model with every
decoder layer replaced by a ``Recorder`` that keeps its arguments and passes the hidden states on, so no family's
mask or rotary code is copied here. The numbers are the whole model's forward (tested to 1e-5 against the loaded
model's projections' inputs).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from bdlora.base.errors import ModelError
from bdlora.models.arch import projection_modules
from bdlora.models.lazy import materialized

BATCH_TOKENS = 2048  # calibration tokens per layer call: an 8B MLP's (tokens, 14,336) activations stay ~120 MB each


class Recorder(nn.Module):
    """Stands in a decoder layer for one forward: keeps the keyword arguments it is called with, returns its input."""

    def __init__(self, layer: nn.Module, calls: list):
        super().__init__()
        self.calls = calls
        if hasattr(layer, "attention_type"):  # families that read it from the layer (Qwen2, Gemma 3)
            self.attention_type = layer.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        self.calls.append((hidden_states, args, kwargs))
        return hidden_states


@contextmanager
def _recording(model):
    layers = model.model.layers
    real = list(layers)
    calls: list[list] = [[] for _ in real]
    for i, layer in enumerate(real):
        layers[i] = Recorder(layer, calls[i])
    try:
        yield calls
    finally:
        for i, layer in enumerate(real):
            layers[i] = layer


class LayerByLayer:
    """The hidden states of ``blocks`` (n, T) token ids entering each decoder layer of the lazy ``model`` in turn:
    ``run(i, hooks)`` runs layer ``i`` (the next one) over them, with ``hooks`` on its modules, and keeps its
    outputs; ``final()`` is the final norm's output (the LM head's input)."""

    def __init__(self, model, blocks: np.ndarray, batch_tokens: int = BATCH_TOKENS):
        self.model = model
        self.next = 0
        per = max(1, batch_tokens // blocks.shape[1])
        self.hidden, self.calls = [], []
        # a model held on a GPU calibrates there (a lazy one's parameters are made on the CPU)
        self.device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
        skip = ("model.layers", "lm_head")
        with torch.no_grad(), materialized(model, skip=skip), _recording(model) as calls:
            for start in range(0, len(blocks), per):
                x = torch.from_numpy(np.ascontiguousarray(blocks[start : start + per])).to(self.device)
                model.model(input_ids=x, use_cache=False)
                h, args, kwargs = calls[0][-1]
                self.hidden.append(h)
                self.calls.append([(c[-1][1], c[-1][2]) for c in calls])

    @property
    def layers(self) -> int:
        return len(self.model.model.layers)

    @torch.no_grad()
    def run(self, index: int, hooks=()) -> None:
        """Layer ``index`` over every batch, ``hooks`` ((module, forward hook) pairs) registered meanwhile."""
        if index != self.next:
            raise ModelError(f"layer {index} run before layer {self.next}: the hidden states go up one layer a time")
        layer = self.model.model.layers[index]
        handles = [m.register_forward_hook(h) for m, h in hooks]
        try:
            with materialized(self.model, f"model.layers.{index}"):
                for b, h in enumerate(self.hidden):
                    args, kwargs = self.calls[b][index]
                    out = layer(h, *args, **kwargs)
                    self.hidden[b] = out[0] if isinstance(out, tuple) else out
        finally:
            for handle in handles:
                handle.remove()
        self.next += 1

    @torch.no_grad()
    def final(self) -> list[torch.Tensor]:
        """The final norm's output of every batch (run after the last layer)."""
        if self.next != self.layers:
            raise ModelError(f"the final norm read after {self.next} of {self.layers} layers")
        with materialized(self.model, "model.norm"):
            return [self.model.model.norm(h) for h in self.hidden]


def layer_input_grams(runner: LayerByLayer, index: int) -> dict[str, torch.Tensor]:
    """``X^T X`` (summed in float64) of the input of every projection of decoder layer ``index`` over the
    calibration blocks, by the projection's name, and of a low-rank projection's rank-r activation under
    ``NAME.proj_out``; runs the layer (``runner.run``)."""
    grams: dict[str, torch.Tensor] = {}
    prefix = f"model.layers.{index}."
    hooks = []
    for name, mod in projection_modules(runner.model):
        if name.startswith(prefix):
            hooks.append((mod, gram_hook(grams, name)))
            if hasattr(mod, "proj_out"):
                hooks.append((mod.proj_out, gram_hook(grams, f"{name}.proj_out")))
    runner.run(index, hooks)
    return grams


def add_gram(grams: dict, key: str, x: torch.Tensor) -> None:
    """Adds ``X^T X`` of the rows of ``x`` (..., d) to ``grams[key]`` (d, d): the products of one batch in fp32,
    summed across batches in fp64 (every calibration of this toolkit measures its Grams so)."""
    x = x.detach().reshape(-1, x.shape[-1]).float()
    g = (x.T @ x).double()
    grams[key] = grams[key] + g if key in grams else g


def gram_hook(grams: dict, key: str):
    """A forward hook adding its module's input to ``grams[key]`` (``add_gram``)."""
    def hook(module, inputs, output):
        add_gram(grams, key, inputs[0])
    return hook
