"""Per-module shape metadata of an exported graph (SPEC 8): model-level ``custom_metadata_map`` entries
``bdlora.modules`` (JSON table of every replaced projection: name, form, in/out features, rank, MACs per token,
parameters), ``bdlora.summary`` (base architecture, F, totals, MAC speed-ups) and ``bdlora.version``; and each
module's name, form and rank in the ``doc_string`` of its nodes."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import torch.nn as nn

from bdlora import __version__
from bdlora.forms import DENSE, FORMS, LOWRANK, declared_bits, describe
from bdlora.models.arch import projection_modules


def module_row(name: str, m: nn.Module) -> dict | None:
    """One projection as deployed: a registered form (``bdlora.forms``), or dense + unmerged LoRA adapter (bench's
    lora variant)."""
    try:
        form, i, o, r, bias = describe(m)
    except TypeError:
        return None
    macs = DENSE.macs(i, o) + LOWRANK.macs(i, o, r) if form == "dense+lora" else FORMS[form].macs(i, o, r)
    return {"name": name, "form": form, "in_features": i, "out_features": o, "rank": r, "macs_per_token": macs,
            "parameters": macs + (o if bias is not None else 0)}


def module_table(model: nn.Module) -> list[dict]:
    """Every projection of the model as deployed (with ``bits`` where its folder keeps it at 8 bits in an int4
    export: ``--forms bits``)."""
    bits = declared_bits(getattr(model.config, "bdlora_modules", None))
    rows = [row for row in (module_row(n, m) for n, m in projection_modules(model)) if row is not None]
    for row in rows:
        if row["name"] in bits:
            row["bits"] = bits[row["name"]]
    return rows


def metadata_summary(model: nn.Module, rows: list[dict], report: dict | None) -> dict:
    cfg = model.config
    bd = getattr(cfg, "bdlora", {}) or {}
    dense = sum(r["in_features"] * r["out_features"] for r in rows)
    src = [(m.get("in_features"), m.get("out_features")) for m in (report or {}).get("modules") or []]
    if src and all(isinstance(i, int) and isinstance(o, int) and i > 0 and o > 0 for i, o in src):
        dense = sum(i * o for i, o in src)  # the source's dense projections: a pruned MLP's or a removed layer's
        # deployed shapes are not its baseline (a 1.30x channels folder read 1.00x); not macs_before (dense + LoRA)
    macs = sum(r["macs_per_token"] for r in rows)
    summary = {"base_model_type": bd.get("base_model_type", cfg.model_type), "model_type": cfg.model_type,
               "budget": bd.get("budget"), "modules": len(rows),
               "forms": {f: sum(r["form"] == f for r in rows) for f in sorted({r["form"] for r in rows})},
               "dense_macs": dense, "deployed_macs": macs, "mac_speedup_vs_dense": dense / macs}
    if report:
        for k in ("dense_kept", "dense_svd", "dense_dropped", "avg_lora_rank", "speedup_vs_dense", "speedup_vs_lora",
                  "param_reduction"):
            summary[k] = report.get(k)
        summary["method"] = report.get("provenance", {}).get("method")
    return summary


def metadata_props(rows: list[dict], summary: dict) -> dict[str, str]:
    return {"bdlora.modules": json.dumps(rows), "bdlora.summary": json.dumps(summary), "bdlora.version": __version__}


def set_metadata(model_proto, meta: dict[str, str]) -> None:
    """Replace (or add) these ``metadata_props`` of an in-memory ONNX model, keeping the others."""
    keep = [p for p in model_proto.metadata_props if p.key not in meta]
    del model_proto.metadata_props[:]
    model_proto.metadata_props.extend(keep)
    for k, v in meta.items():
        model_proto.metadata_props.add(key=k, value=v)


def read_metadata(onnx_path: Path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(onnx_path), load_external_data=False).metadata_props}
