"""``calibrate`` one decoder layer at a time, for models whose whole-model calibration does not fit: the same
``Calibration`` (tested equal to ``calibrate``'s to 1e-5), at the memory of one layer's activations and Gram matrices.

``calibrate`` runs the whole model forward and backward over a batch and keeps every projection's input Gram in
memory: at 1B (Llama-3.2-1B's shape) that was 10 GB of float64 Grams beside about 5 GB of activations held for the
backward pass, a peak of 20 GB. Here (sequential onloading, as GPTQ's reference and llm-compressor calibrate):

1. forward, layer by layer (``models.sequential.LayerByLayer``): each layer runs over every calibration batch with
   hooks adding its projections' input Grams (and its update's energy, for ``forms.layers``); the hidden states
   entering it are written to a temp folder, and its Grams too, as soon as the layer is done (``GramStore``);
2. the head: the model's own forward from the last layer's output (every decoder layer replaced by a ``Replay`` of
   it, so a family's norm, head and logit scaling are its own code) gives the loss, its gradient there, the
   predicted-token counts and the head's rounding error;
3. backward, layer by layer from the top: each layer is run again from its stored input with gradients enabled and
   the loss's gradient at its output propagated through it; the hooks read each projection's output gradient
   (Fisher diagonal, rounding error) on the way, and the gradient at its input goes down to the next.

The batches are ``calibrate``'s (``CALIB_BATCH`` blocks), so every sum is accumulated in the same order. The Grams
stay on disk until a form asks for one (``Calibration.gram``), read whole, one input group at a time.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bdlora.base.errors import ModelError, UsageError
from bdlora.base.outputs import free_space
from bdlora.base.reporter import SILENT, Reporter
from bdlora.compress.calibrate import (
    CALIB_BATCH,
    Calibration,
    _fisher_hook,
    _rounding_hooks,
    input_group,
    score_batch,
)
from bdlora.forms import HEAD
from bdlora.models.arch import projection_modules
from bdlora.models.lazy import materialized
from bdlora.models.sequential import LayerByLayer, gram_hook


class GramStore(Mapping):
    """Input group -> its (d, d) float64 Gram matrix, each in its own ``.npy`` file under a temp folder, read back
    whole when asked for (nothing held between reads). The folder goes when the store does (or at exit)."""

    def __init__(self, where: str | None = None):
        self.root = Path(tempfile.mkdtemp(prefix="bdlora-calibration-", dir=where))
        self.paths: dict[str, tuple[Path, torch.device]] = {}
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)

    def put(self, key: str, gram: torch.Tensor) -> None:
        path = self.root / f"gram-{len(self.paths)}.npy"
        np.save(path, gram.detach().cpu().numpy())
        self.paths[key] = (path, gram.device)

    def __getitem__(self, key: str) -> torch.Tensor:
        path, device = self.paths[key]
        return torch.from_numpy(np.load(path)).to(device)  # where it was measured, as ``calibrate``'s are

    def __iter__(self):
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)

    def close(self) -> None:
        self._cleanup()


def disk_needed(model, tokens: int) -> int:
    """Bytes the temp folder holds at most: every input group's float64 Gram and every layer's input hidden states
    (fp32) over ``tokens``."""
    groups = {input_group(n): m.in_features for n, m in projection_modules(model)}
    hidden = int(model.config.hidden_size)
    return sum(d * d * 8 for d in groups.values()) + len(model.model.layers) * tokens * hidden * 4


class Replay(nn.Module):
    """Stands in a decoder layer for the head's forward: returns the hidden states it holds (the last layer's
    output, with gradients enabled), whatever it is called with."""

    def __init__(self, layer: nn.Module, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden
        if hasattr(layer, "attention_type"):
            self.attention_type = layer.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        return self.hidden


def calibrate_layers(model, blocks: np.ndarray, fisher: bool = True, residual: bool = False, rounded=None,
                     bits: tuple[int, ...] = (4, 8), head: bool = False, predicted: bool = False,
                     reporter: Reporter = SILENT, where: str | None = None) -> Calibration:
    """``calibrate(model, blocks, ...)`` one decoder layer at a time (the module's docstring), ``model`` in memory or
    lazy (``models.lazy``: each layer made from its weight files when it runs); the Grams in a ``GramStore`` under
    ``where`` (default: the system's temp folder), whose free space is checked first."""
    need = disk_needed(model, int(blocks.size))
    _, free = free_space(where or tempfile.gettempdir())
    if need > free:
        raise UsageError(f"calibrating one layer at a time writes about {need / 2**30:,.1f} GiB to "
                         f"{where or tempfile.gettempdir()} and it has {free / 2**30:,.1f} GiB free (set TMPDIR to a "
                         "larger file system)")
    trainable = [q for q in model.parameters() if q.requires_grad]
    for q in trainable:  # no weight gradient: only the outputs' gradients are read
        q.requires_grad_(False)
    was_training = model.training
    model.eval()
    store = GramStore(where)
    try:
        return _calibrate(model, blocks, store, fisher, residual, rounded if fisher else None, bits, head,
                          predicted, reporter)
    except BaseException:
        store.close()
        raise
    finally:
        for q in trainable:
            q.requires_grad_(True)
        model.train(was_training)


def _calibrate(model, blocks, store: GramStore, fisher, residual, rounded, bits, head, predicted,
               reporter: Reporter) -> Calibration:
    runner = LayerByLayer(model, blocks, batch_tokens=CALIB_BATCH * blocks.shape[1])
    n = runner.layers
    total = 2 * n + 1 if fisher else n + 1
    reporter.count(0, total, "layer passes")
    updates: dict[int, list] = {}
    saved = store.root / "hidden"
    saved.mkdir()
    for i in range(n):
        for b, h in enumerate(runner.hidden):
            np.save(saved / f"{i}-{b}.npy", h.cpu().numpy())
        grams: dict[str, torch.Tensor] = {}
        hooks = _gram_hooks(model, i, grams)
        if residual and fisher:
            hooks.append((model.model.layers[i], _energy_hook(updates.setdefault(i, [0.0, 0.0]))))
        runner.run(i, hooks)
        for key, g in grams.items():
            _finite(g, key)
            store.put(key, g)
        reporter.count(1, total, "layer passes")
    fish: dict[str, torch.Tensor] = {}
    rounding: dict[str, dict[int, float]] = {}
    grads, mass, argmax = _head(model, blocks, runner.hidden, fisher, rounding, rounded if head else None, bits,
                                predicted)
    reporter.count(1, total, "layer passes")
    if fisher:
        for i in reversed(range(n)):
            if residual:
                updates[i][1] = sum(g.reshape(-1, g.shape[-1]).double().square().sum(0) for g in grads)
            inputs = [torch.from_numpy(np.load(saved / f"{i}-{b}.npy")).to(runner.device) for b in range(len(grads))]
            grads = _backward_layer(runner, i, inputs, grads, fish, rounding, rounded, bits)
            reporter.count(1, total, "layer passes")
    shutil.rmtree(saved)
    for name, f in fish.items():
        _finite(f, name)
    for i, (energy, grad) in updates.items():
        _finite(energy + grad, f"layer {i}")
    tokens = int(blocks.size)
    return Calibration(store, fish, tokens, {i: (u[0], u[1]) for i, u in sorted(updates.items())},
                       {k: {b: e * tokens for b, e in r.items()} for k, r in rounding.items()},
                       None if mass is None else mass.numpy(), None if argmax is None else argmax.numpy())


def _gram_hooks(model, index: int, grams: dict) -> list:
    """(module, forward hook) pairs adding the input Gram of each input group of decoder layer ``index``."""
    prefix, hooks, seen = f"model.layers.{index}.", [], set()
    for name, mod in projection_modules(model):
        group = input_group(name)
        if name.startswith(prefix) and group not in seen:
            seen.add(group)
            hooks.append((mod, gram_hook(grams, group)))
    return hooks


def _energy_hook(entry: list):
    """A forward hook adding the layer's update energy ``sum_t (h_out - h_in)^2`` to ``entry[0]``."""
    def hook(module, inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        entry[0] = entry[0] + (out - inputs[0]).reshape(-1, out.shape[-1]).double().square().sum(0)
    return hook


def _head(model, blocks, hidden: list[torch.Tensor], fisher: bool, rounding: dict, rounded, bits, predicted):
    """(the loss's gradient at the last layer's output per batch, or None without ``fisher``; predicted mass and
    argmax counts): the model's own forward above its decoder layers (each a ``Replay``)."""
    layers = model.model.layers
    real = list(layers)
    per = len(blocks) if not hidden else hidden[0].shape[0]
    grads, mass, argmax = [], None, None
    # the head's rounding error as ``calibrate`` measures it (its weight rounded once): hooks on the head module, whose
    # parameters the block below makes
    handles = [] if rounded is None else _rounding_hooks(model.get_output_embeddings(), HEAD, rounding, rounded, bits,
                                                         once=True)
    try:
        with materialized(model, skip="model.layers"), torch.enable_grad() if fisher else torch.no_grad():
            for b, h in enumerate(hidden):
                top = h.detach().requires_grad_(fisher)
                for i, layer in enumerate(real):
                    layers[i] = Replay(layer, top)
                x = torch.from_numpy(np.ascontiguousarray(blocks[b * per : (b + 1) * per])).to(top.device)
                mass, argmax = score_batch(model, x, fisher, predicted, mass, argmax)
                if fisher:
                    grads.append(top.grad)
    finally:
        for i, layer in enumerate(real):
            layers[i] = layer
        for handle in handles:
            handle.remove()
    return grads, mass, argmax


def _backward_layer(runner: LayerByLayer, index: int, inputs: list, grads: list, fish: dict, rounding: dict,
                    rounded, bits) -> list:
    """The loss's gradient at the input of decoder layer ``index`` per batch, from ``grads`` at its output: the
    layer run again from its ``inputs`` with gradients enabled, its projections' output gradients read by the
    Fisher (and ``rounded``: rounding-error) hooks on the way."""
    model = runner.model
    layer = model.model.layers[index]
    prefix, below = f"model.layers.{index}.", []
    with materialized(model, f"model.layers.{index}"), torch.enable_grad():
        handles = []
        for name, mod in projection_modules(model):
            if name.startswith(prefix):
                handles.append(mod.register_full_backward_hook(_fisher_hook(fish, name)))
                if rounded is not None:
                    handles += _rounding_hooks(mod, name, rounding, rounded, bits)
        try:
            for b, (h, g) in enumerate(zip(inputs, grads)):
                x = h.requires_grad_(True)
                args, kwargs = runner.calls[b][index]
                out = layer(x, *args, **kwargs)
                (out[0] if isinstance(out, tuple) else out).backward(g)
                below.append(x.grad)
        finally:
            for handle in handles:
                handle.remove()
    return below


def _finite(t: torch.Tensor, where: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ModelError(f"the model's activations or gradients on the calibration tokens are not finite (first at "
                         f"{where}): its weights hold NaN or infinity (check the --teacher / --student-init weights)")
