"""Sequential (layer-wise) error correction of a compressed model's low-rank pairs, before any training.

The whitened start factors every projection on the *teacher's* inputs; once the layers below are compressed, a
projection sees other inputs, and the errors compound up the stack. As GPTQ and SVD-LLM v2 do, the correction walks
the decoder layers in order and, inside each layer, the projection groups in the order they are computed (q/k/v,
o, gate/up, down). For each low-rank projection ``y = B A x~`` it keeps ``A`` and sets ``B`` to the least-squares
solution against the teacher's own output ``W x`` on the same calibration tokens, where ``x`` is the projection's
input in the teacher and ``x~`` its input in the compressed model (the layers below, and the groups before it in
this layer, already corrected):

    B = W C_xs A^T (A C_ss A^T + lambda I)^-1,   C_xs = sum x x~^T,  C_ss = sum x~ x~^T

(float64; ``lambda`` = ``RIDGE`` x the mean diagonal of ``A C_ss A^T``, so a rank-deficient calibration stays
solvable). Biases are left as they are: the same bias is on both sides. Dense projections are not changed.

The layers are run one at a time on hidden states kept for the whole calibration set (teacher and compressed side by
side), with the arguments the model itself passes its first layer (mask, rotary embeddings, positions), so one pass
costs about six forward passes of the model over the calibration tokens, whatever its depth.
"""

from __future__ import annotations

import torch

from bdlora.base.errors import ModelError
from bdlora.base.reporter import SILENT, Reporter
from bdlora.compress.calibrate import CALIB_BATCH, input_group
from bdlora.models.arch import base_model, is_projection

RIDGE = 1e-6


class _Stop(Exception):
    pass


def _entry(model, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(hidden states, keyword arguments) the model passes its first decoder layer for ``x``."""
    layers = base_model(model).model.layers
    seen: dict = {}

    def pre(module, args, kwargs):
        seen["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        seen["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    handle = layers[0].register_forward_pre_hook(pre, with_kwargs=True)
    try:
        model(input_ids=x, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen["hidden"].detach(), seen["kwargs"]


def _run(layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return (out[0] if isinstance(out, tuple) else out).detach()


def _inputs(layer, hidden, kwargs, modules: dict[str, torch.nn.Module], stop_after: str | None = None) -> dict:
    """The inputs (n_tokens, d_in) of ``modules`` (name -> module of ``layer``) in one pass of ``layer``; the pass
    stops once ``stop_after``'s input is seen."""
    got: dict = {}
    handles = []

    def hook(name):
        def f(module, args):
            got[name] = args[0].detach().reshape(-1, args[0].shape[-1])
            if name == stop_after:
                raise _Stop
        return f

    for name, mod in modules.items():
        handles.append(mod.register_forward_pre_hook(hook(name)))
    try:
        _run(layer, hidden, kwargs)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return got


def solve_second_factor(weight: torch.Tensor, proj_in: torch.Tensor, c_xs: torch.Tensor,
                        c_ss: torch.Tensor) -> torch.Tensor:
    """``B`` minimising ``sum ||W x - B A x~||^2`` given ``C_xs = sum x x~^T`` and ``C_ss = sum x~ x~^T`` (float64)."""
    w, a = weight.double(), proj_in.double()
    m = a @ c_ss @ a.T
    lam = RIDGE * float(m.diagonal().mean().clamp_min(1e-30))
    n = w @ c_xs @ a.T
    return torch.linalg.solve(m + lam * torch.eye(m.shape[0], dtype=m.dtype, device=m.device), n.T).T


@torch.no_grad()
def correct_sequential(teacher, student, blocks, low_rank: dict[str, tuple], reporter: Reporter = SILENT) -> dict:
    """Correct, in place, the second factor of every low-rank projection of ``student`` (a copy of ``teacher``
    with the projections in ``low_rank`` replaced) on the calibration ``blocks`` (n, T) int64.

    ``low_rank``: name -> (module, set_proj_out) where ``module`` is the student's projection (its forward computes
    the low-rank pair, its ``proj_in.weight`` is A) and ``set_proj_out(B)`` stores the new second factor. Returns
    {name: (relative output error before, after)} on the calibration tokens.
    """
    t_layers, s_layers = base_model(teacher).model.layers, base_model(student).model.layers
    if len(t_layers) != len(s_layers):
        raise ModelError(f"sequential correction needs the teacher's depth ({len(t_layers)} layers), not "
                         f"{len(s_layers)}")
    t_mods, s_mods = dict(teacher.named_modules()), dict(student.named_modules())
    was = teacher.training, student.training
    teacher.eval(), student.eval()
    batches = [torch.from_numpy(blocks[i : i + CALIB_BATCH]).to(next(teacher.parameters()).device)
               for i in range(0, len(blocks), CALIB_BATCH)]
    entries = [_entry(teacher, x) for x in batches]
    h_t = [h for h, _ in entries]
    h_s = [h.clone() for h in h_t]
    kws = [kw for _, kw in entries]
    errors: dict = {}
    reporter.count(0, len(t_layers), "layers")
    try:
        for li in range(len(t_layers)):
            prefix = _layer_prefix(teacher, li)
            names = [n for n in t_mods if n.startswith(prefix) and is_projection(n)]
            groups: dict[str, list[str]] = {}
            for n in names:
                groups.setdefault(input_group(n), []).append(n)
            firsts = {g: ns[0] for g, ns in groups.items()}
            t_in = [_inputs(t_layers[li], h, kw, {f: t_mods[f] for f in firsts.values()}) for h, kw in zip(h_t, kws)]
            for g, ns in groups.items():
                todo = [n for n in ns if n in low_rank]
                if not todo:
                    continue
                first = firsts[g]
                c_xs = c_ss = None
                for b, (h, kw) in enumerate(zip(h_s, kws)):
                    xs = _inputs(s_layers[li], h, kw, {first: s_mods[first]}, stop_after=first)[first].double()
                    xt = t_in[b][first].double()
                    c_xs = xt.T @ xs if c_xs is None else c_xs + xt.T @ xs
                    c_ss = xs.T @ xs if c_ss is None else c_ss + xs.T @ xs
                c_xx = sum(x[first].double().T @ x[first].double() for x in t_in)
                for n in todo:
                    mod, set_out = low_rank[n]
                    w = t_mods[n].weight
                    a = mod.proj_in.weight
                    before = _error(w, a, mod.proj_out.weight, c_xx, c_xs, c_ss)
                    b_new = solve_second_factor(w, a, c_xs, c_ss)
                    set_out(b_new.to(mod.proj_out.weight.dtype))
                    errors[n] = (before, _error(w, a, mod.proj_out.weight, c_xx, c_xs, c_ss))
            h_t = [_run(t_layers[li], h, kw) for h, kw in zip(h_t, kws)]
            h_s = [_run(s_layers[li], h, kw) for h, kw in zip(h_s, kws)]
            reporter.count(1, len(t_layers), "layers")
    finally:
        teacher.train(was[0]), student.train(was[1])
    return errors


def _error(w, a, b, c_xx, c_xs, c_ss) -> float:
    """Relative squared error ``sum ||W x - B A x~||^2 / sum ||W x||^2`` from the accumulated Gram matrices."""
    w, a, b = w.double(), a.double(), b.double()
    ba = b @ a
    target = torch.trace(w @ c_xx @ w.T)
    err = target - 2 * torch.trace(w @ c_xs @ ba.T) + torch.trace(ba @ c_ss @ ba.T)
    return float(err / target.clamp_min(1e-30))


def _layer_prefix(model, index: int) -> str:
    layers = base_model(model).model.layers
    for name, mod in model.named_modules():
        if mod is layers[index]:
            return name + "."
    raise ModelError(f"decoder layer {index} not found")
