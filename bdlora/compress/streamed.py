"""``compress --one-shot`` of a source too large to hold in fp32 (``--streaming``: a 1B-8B model), one decoder layer at
a time from end to end.

A 3B source is 12.8 GB in fp32 and its compressed model about as much again: held together, with the calibration,
they passed 17 GB. Read lazily instead (``models.stream.lazy_folder_model``: the architecture on the meta device,
each weight read from the folder's safetensors files, bf16 until its part is made), the source exists one layer at
a time through every stage:

1. calibration: ``compress.layerwise`` (each layer made for its own forward and backward);
2. the forms' offers and deploys: a form that reads the projections' weights (``Step.per_layer``) is called once per
   decoder layer (``sections``), on the one-shot's context narrowed to that layer's projections (its offers and
   its own state stay the context's), while that layer's weights exist; the others (layers, bits, vocab) once, with
   the parts outside the layers made;
3. every tensor a deploy builds (a pruned projection, a low-rank pair, a narrowed head) goes at once to a
   ``TensorStore`` under the temp folder and its module keeps a meta tensor of its shape; a projection that stays
   dense keeps the source's meta parameter;
4. the compressed model is built on the meta device like the in-memory one (``build_deployed_model(share=True)``),
   and its folder written one tensor at a time (``deployed.folder.save_model_folder`` with ``value``): each from the
   store, or from the source's weight files under its source name (a layer kept after removed ones is renumbered).

The held-out perplexities run ``models.stream.streamed`` (one layer in fp32 at a time). The folder is the one the
in-memory path writes, tensor for tensor (tested to 1e-5 on every form).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bdlora.base.reporter import SILENT
from bdlora.forms import HEAD
from bdlora.models.lazy import SOURCE, is_lazy, materialized

TENSOR_FIELDS = ("weight", "proj_in", "proj_out", "bias")  # what a DeployedModule holds


class TensorStore:
    """Name -> tensor, each batch put in its own safetensors file under a temp folder and read back one tensor at a
    time; the folder goes when the store is closed (or at exit)."""

    def __init__(self, where: str | None = None):
        self.root = Path(tempfile.mkdtemp(prefix="bdlora-deployed-", dir=where))
        self.paths: dict[str, Path] = {}
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)

    def put(self, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            return
        path = self.root / f"part-{len(self.paths)}.safetensors"
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path))
        self.paths.update(dict.fromkeys(tensors, path))

    def __contains__(self, name: str) -> bool:
        return name in self.paths

    def read(self, name: str) -> torch.Tensor:
        with safe_open(str(self.paths[name]), framework="pt") as f:
            return f.get_tensor(name)

    def close(self) -> None:
        self._cleanup()


def sections(ctx, step):
    """(context, the part of the source to make) for each call of ``step``'s offer or deploy: the whole context
    once for an in-memory source; for a lazy one, a ``per_layer`` step once per decoder layer (the context narrowed
    to that layer's projections and shapes, its progress line said once), any other once with the parts outside the
    layers made."""
    if not is_lazy(ctx.model):
        yield ctx, None
        return
    if not step.per_layer:
        yield ctx, {"skip": "model.layers"}
        return
    n = len(ctx.model.model.layers)
    for i in range(n):
        prefix = f"model.layers.{i}."
        mods = {k: m for k, m in ctx.mods.items() if k.startswith(prefix)}
        yield (replace(ctx, mods=mods, shapes=[s for s in ctx.shapes if s.name in mods],
                       reporter=ctx.reporter if i == 0 else SILENT), {"within": f"model.layers.{i}"})
        if i == 0:  # after the step's own line: a bar over the layers
            ctx.reporter.count(0, n, "layers")
        ctx.reporter.count(1, n, "layers")


def made(model, part: dict | None):
    """``part`` of the lazy ``model`` made for the block (``sections``' second item); nothing for None."""
    return nullcontext() if part is None else materialized(model, **part)


def narrowed(alloc, part: dict | None):
    """``alloc`` with only the choices at the sites inside ``part`` (``sections``' decoder layer); as it is for any
    other part."""
    if part is None or "within" not in part:
        return alloc
    prefix = part["within"] + "."
    return replace(alloc, chosen={site: cs for site, cs in alloc.chosen.items() if site.startswith(prefix)})


def spill(built: dict, store: TensorStore | None) -> dict:
    """``built`` (a deploy's {projection: DeployedModule}, and its record of the head: ``OneShotStructure.head``) with
    every real tensor moved to ``store`` under its name in the compressed model's state dict (before any renumbering)
    and a meta tensor of its shape left in its place; as it is without a store."""
    if store is None:
        return built
    out = {}
    for name, dep in built.items():
        if name == HEAD:  # the head's record: its tensors (a form of its own) and what it declares
            if "state" in dep:
                store.put({k: t for k, t in dep["state"].items() if not t.is_meta})
                dep = {**dep, "state": {k: t.to("meta") for k, t in dep["state"].items()}}
            out[name] = dep
            continue
        store.put({k: t for k, t in dep.state(name).items() if not t.is_meta})
        for f in TENSOR_FIELDS:
            if getattr(dep, f) is not None:
                setattr(dep, f, getattr(dep, f).to("meta"))
        out[name] = dep
    return out


def source_name(name: str, kept: list[int] | None) -> str:
    """The source's name of tensor ``name`` of the compressed model: a layer of a shallower model (``kept``: the
    source's layers it keeps, in order) under its source index."""
    parts = name.split(".")
    if kept and parts[:2] == ["model", "layers"]:
        parts[2] = str(kept[int(parts[2])])
    return ".".join(parts)


def folder_values(source, store: TensorStore, kept: list[int] | None):
    """``(name, meta tensor) -> value`` of the compressed model built on lazy ``source``: the deploys' tensors from
    ``store``, every other from the source's weight files (``SOURCE``)."""
    read = getattr(source, SOURCE)

    def value(name: str, p: torch.Tensor) -> torch.Tensor:
        key = source_name(name, kept)
        return store.read(key) if key in store else read(key, p)

    return value
