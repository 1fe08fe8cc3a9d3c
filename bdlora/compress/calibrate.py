"""Calibration: what the low-rank initialisation and the quality allocation measure on a model before it changes.

One forward and backward pass over ``--calib-tokens`` tokens of the run's own training split accumulates, per
projection, the Gram matrix of its inputs ``C = X^T X`` (float64; projections that read the same tensor, q/k/v and
gate/up, share one) and the Fisher diagonal of its outputs ``f = sum_t g_t^2`` (g the gradient of the next-token
loss with respect to the module's output; no weight gradient is computed). With ``residual`` it also accumulates,
per decoder layer, the energy of the update it adds to the residual stream ``sum_t (h_out - h_in)^2`` and the
Fisher diagonal of its output, per hidden dimension: what removing the layer costs (``forms.layers``). The
blocks are drawn from the training split with a fixed seed, so two processes (or a rerun) calibrate on the same
tokens; under torchrun only rank 0 calibrates and the others read its factors (``methods.LowRankInit``), so every
process starts bit-identical.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from bdlora.base.errors import DataError, ModelError
from bdlora.compress.forms.lowrank import FISHER_DAMPING
from bdlora.forms import HEAD  # the LM head's key in ``Calibration.rounding`` (``calibrate(..., head=True)``)
from bdlora.models.arch import projection_modules
from bdlora.models.sequential import gram_hook

CALIB_SEED = 20261124
CALIB_BATCH = 8
HEAD_CHUNK = 256  # tokens per product of the head's rounding error: (tokens, vocabulary) float64 per chunk


def input_group(name: str) -> str:
    """Projections reading the same tensor share one Gram matrix: ``...self_attn.{q,k,v}_proj`` and
    ``...mlp.{gate,up}_proj``."""
    head, proj = name.rsplit(".", 1)
    if proj in ("q_proj", "k_proj", "v_proj"):
        return f"{head}.qkv"
    if proj in ("gate_proj", "up_proj"):
        return f"{head}.gate_up"
    return name


@dataclass
class Calibration:
    grams: Mapping[str, torch.Tensor]  # input group -> (d_in, d_in) float64 (on disk: ``layerwise.GramStore``)
    fisher: dict[str, torch.Tensor]  # module -> (d_out,) float64
    tokens: int
    residual: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer -> (update
    # energy, output Fisher diagonal), each (hidden,) float64; only with ``calibrate(..., residual=True)``
    rounding: dict[str, dict[int, float]] = field(default_factory=dict)  # module -> {bits: the loss-weighted output
    # error of its weight rounded to that width}; only with ``calibrate(..., rounded=...)`` (``_rounding_hooks``);
    # with ``head=True`` also the LM head's, under ``HEAD``
    mass: np.ndarray | None = None  # (vocab,) the model's probability of each token summed over the calibration
    # tokens; only with ``calibrate(..., predicted=True)`` (``forms.vocab``)
    argmax: np.ndarray | None = None  # (vocab,) how often each token is the model's argmax there (the same)

    def gram(self, name: str) -> torch.Tensor:
        return self.grams[input_group(name)]

    def group(self, name: str) -> str:
        """The input group whose Gram ``name`` reads (the key to cache what is derived from it: a ``GramStore`` of
        ``compress.layerwise`` reads a new tensor on every ``gram`` call, so no tensor's identity is one)."""
        return input_group(name)


def check_calib_tokens(blocks, tokens: int, what: str = "--data") -> int:
    """The number of ``seq_len`` blocks ``tokens`` calibration tokens take; more than the training split holds is
    an error naming what it holds."""
    seq = blocks.seq_len
    want = max(1, -(-tokens // seq))
    if len(blocks) < want:
        raise DataError(f"--calib-tokens {tokens}: the training split holds {len(blocks) * seq:,} tokens in "
                        f"{len(blocks)} blocks of {seq}; lower --calib-tokens or give a larger {what}")
    return want


def calibration_blocks(blocks, tokens: int) -> np.ndarray:
    """(n, seq_len) token blocks: ``tokens`` worth of the training blocks, drawn without replacement with a fixed
    seed (so every process and every rerun calibrates on the same tokens)."""
    want = check_calib_tokens(blocks, tokens)
    idx = np.sort(np.random.default_rng(CALIB_SEED).choice(len(blocks), size=want, replace=False))
    return blocks.get(idx)


def calibrate(model, blocks: np.ndarray, fisher: bool = True, on_progress=None, residual: bool = False,
              rounded=None, bits: tuple[int, ...] = (4, 8), head: bool = False,
              predicted: bool = False) -> Calibration:
    """Gram matrices (and with ``fisher`` the output Fisher diagonals) of every projection of ``model`` over the
    token ``blocks`` (n, T); with ``residual`` (and ``fisher``) each decoder layer's update energy and output Fisher;
    with ``rounded`` (``(weight (out, in) array, bits) -> the weight as an export rounds it``, and ``fisher``) each
    projection's rounding error at every width of ``bits`` (``_rounding_hooks``), and with ``head`` the LM head's
    (its weight rounded once; the logits' change weighted by the loss's squared gradient there, ``HEAD_CHUNK`` tokens
    at a time so a 262k-token vocabulary stays a few hundred MB); with ``predicted``, the model's probability of every
    token summed over the tokens and how often each is its argmax. The model's weights are not changed and get no
    gradient. ``on_progress(k)`` is called after each batch with the number of blocks it held."""
    grams: dict[str, torch.Tensor] = {}
    fish: dict[str, torch.Tensor] = {}
    rounding: dict[str, dict[int, float]] = {}
    mass = argmax = None
    hooks = _projection_hooks(model, grams, fish if fisher else None, rounding, rounded if fisher else None, bits)
    if head and rounded is not None and fisher:
        hooks += _rounding_hooks(model.get_output_embeddings(), HEAD, rounding, rounded, bits, once=True)
    updates: dict[int, list] = {}
    if residual and fisher:
        for i, layer in enumerate(model.model.layers):
            hooks.append(layer.register_forward_hook(_residual_hook(updates, i), with_kwargs=True))
    embed = model.get_input_embeddings()
    if fisher:  # gradients flow from the loss to every module output without any weight requiring one
        hooks.append(embed.register_forward_hook(lambda m, i, o: o.detach().requires_grad_()))
    was_training = model.training
    model.eval()
    trainable = [q for q in model.parameters() if q.requires_grad]
    for q in trainable:  # no weight gradient: only the outputs' gradients are read
        q.requires_grad_(False)
    device = next(model.parameters()).device
    try:
        with torch.enable_grad() if fisher else torch.no_grad():
            for start in range(0, len(blocks), CALIB_BATCH):
                x = torch.from_numpy(np.ascontiguousarray(blocks[start : start + CALIB_BATCH])).to(device)
                mass, argmax = score_batch(model, x, fisher, predicted, mass, argmax)
                if on_progress is not None:
                    on_progress(len(x))
    finally:
        for h in hooks:
            h.remove()
        for q in trainable:
            q.requires_grad_(True)
        model.train(was_training)
    bad = [k for k, v in (*grams.items(), *fish.items(), *((f"layer {i}", u[0] + u[1]) for i, u in updates.items()))
           if not bool(torch.isfinite(v).all())]
    if bad:
        raise ModelError(f"the model's activations or gradients on the calibration tokens are not finite (first at "
                         f"{bad[0]}): its weights hold NaN or infinity (check the --teacher / --student-init weights)")
    tokens = int(blocks.size)
    return Calibration(grams, fish, tokens, {i: (u[0], u[1]) for i, u in sorted(updates.items())},
                       {n: {b: e * tokens for b, e in r.items()} for n, r in rounding.items()},
                       None if mass is None else mass.numpy(), None if argmax is None else argmax.numpy())


def score_batch(model, x: torch.Tensor, fisher: bool, predicted: bool, mass, argmax):
    """The model's forward on the token batch ``x`` (B, T): with ``predicted`` its logits added to ``mass`` and
    ``argmax`` (returned), with ``fisher`` the summed next-token loss's backward run, so the hooks read the output
    gradients (``calibrate``'s batches, and the head of ``layerwise.calibrate_layers``)."""
    logits = model(input_ids=x, use_cache=False).logits
    if predicted:
        mass, argmax = _predicted(logits.detach(), mass, argmax)
    if fisher:
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1),
                               reduction="sum")
        loss.backward()
    return mass, argmax


def _predicted(logits: torch.Tensor, mass, argmax):
    """``mass`` and ``argmax`` counts (vocab,) with one batch's logits (B, T, V) added, ``HEAD_CHUNK`` positions at a
    time (a 262k-token softmax of a whole batch would be gigabytes)."""
    z = logits.reshape(-1, logits.shape[-1])
    if mass is None:
        mass = torch.zeros(z.shape[-1], dtype=torch.float64)
        argmax = torch.zeros(z.shape[-1], dtype=torch.int64)
    for start in range(0, len(z), HEAD_CHUNK):
        chunk = z[start : start + HEAD_CHUNK].float()
        mass += torch.softmax(chunk, -1).sum(0).double().cpu()
        argmax += torch.bincount(chunk.argmax(-1).cpu(), minlength=z.shape[-1])
    return mass, argmax


def _projection_hooks(model, grams: dict, fish: dict | None, rounding: dict, rounded, bits) -> list:
    """The hooks filling ``grams`` (one per input group), ``fish`` (None: no Fisher) and, with ``rounded``,
    ``rounding`` on every projection of ``model``."""
    hooks, seen = [], set()
    for name, mod in projection_modules(model):
        group = input_group(name)
        if group not in seen:
            seen.add(group)
            hooks.append(mod.register_forward_hook(gram_hook(grams, group)))
        if fish is not None:
            hooks.append(mod.register_full_backward_hook(_fisher_hook(fish, name)))
        if rounded is not None:
            hooks += _rounding_hooks(mod, name, rounding, rounded, bits)
    return hooks


def _fisher_hook(fish: dict, name: str):
    def hook(module, grad_input, grad_output):
        g = grad_output[0].detach().reshape(-1, grad_output[0].shape[-1]).double()
        f = g.square().sum(0)
        fish[name] = fish[name] + f if name in fish else f
    return hook


def _rounding_hooks(mod, name: str, rounding: dict, rounded, bits: tuple[int, ...], once: bool = False) -> list:
    """Hooks adding, per width b of ``bits``, ``sum_t sum_i (g_ti^2 + d) ((W - Q_b(W)) x_t)_i^2`` over the tokens:
    the rounding's output change weighted by the loss's squared gradient *at the same token* (d: ``FISHER_DAMPING``
    of the batch's mean squared gradient, as the spectrum damps the Fisher). Token by token, not the Fisher diagonal
    times the output change's energy as the other forms' errors are: a weight's rounding error scales with its
    inputs, and a few tokens carry inputs hundreds of times larger (SmolLM2's attention sinks: its layer-11 down
    projection makes them) where the loss's gradient is small, which the product of the two sums counts as if they
    met (22x too high there, 5x over all projections, measured). ``calibrate`` multiplies the sum by the tokens, the
    scale the product of sums has when the two are independent, so it compares with the other forms' errors.
    ``once``: the rounded weights are computed at the first batch and kept (the LM head: one matrix, rounded once
    instead of once per batch), and the products run ``HEAD_CHUNK`` tokens at a time."""
    seen: dict = {}
    deltas: dict[int, torch.Tensor] = {}

    def delta_of(w, b: int, dtype):
        if b in deltas:
            return deltas[b]
        d = (w - torch.as_tensor(np.asarray(rounded(w.float().cpu().numpy(), b)), dtype=w.dtype,
                                 device=w.device)).to(dtype)
        if once:
            deltas[b] = d
        return d

    def forward(module, inputs, output):
        seen["x"] = inputs[0].detach()

    def backward(module, grad_input, grad_output):
        x = seen.pop("x", None)
        if x is None:
            return
        g = grad_output[0].detach().reshape(-1, grad_output[0].shape[-1])
        x = x.reshape(-1, x.shape[-1])
        damping = FISHER_DAMPING * float(g.double().square().mean())
        w = module.weight.detach()
        errors = rounding.setdefault(name, {})
        step = HEAD_CHUNK if once else len(x)
        for b in bits:
            delta = delta_of(w, b, x.dtype)
            for i in range(0, len(x), step):
                g2 = g[i : i + step].double().square() + damping
                errors[b] = errors.get(b, 0.0) + float((g2 * (x[i : i + step] @ delta.T).double().square()).sum())

    return [mod.register_forward_hook(forward), mod.register_full_backward_hook(backward)]


def _residual_hook(updates: dict, index: int):
    """Adds the layer's update energy now and, through a hook on its output tensor, its output's squared gradient
    during the backward pass."""

    def hook(module, args, kwargs, output):
        h_in = (args[0] if args else kwargs["hidden_states"]).detach()
        out = output[0] if isinstance(output, tuple) else output
        d = (out.detach() - h_in).reshape(-1, out.shape[-1]).double().square().sum(0)
        entry = updates.setdefault(index, [torch.zeros_like(d), torch.zeros_like(d)])
        entry[0] += d
        if out.requires_grad:
            def grad_hook(g, entry=entry):
                entry[1] += g.detach().reshape(-1, g.shape[-1]).double().square().sum(0)
            out.register_hook(grad_hook)
    return hook
