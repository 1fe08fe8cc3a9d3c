"""Bounds for the readers that plan from shapes alone (``plan FOLDER`` from its compression.json, ``plan`` and
``bench --model-config``): what they accept before they build a synthetic graph or allocate anything. A config of
hidden size 1e7 had plan measuring for minutes and bench allocating 40 GB to 1 TB; a compression.json (no digest
covers it) declaring layer 1e9 had plan build a 137-layer graph. Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

from bdlora.base.errors import ModelError, shown
from bdlora.models.integrity import OPTIONAL_SIZES, declared_sizes, implied_parameters

# What a reader that plans from shapes alone (plan, bench --model-config) accepts before it builds anything: well
# above every released decoder (Llama 3.1 405B: hidden 16,384, MLP 53,248, 126 layers, 128 heads; Gemma 3: a
# 262,144-token vocabulary), far below what would allocate tens of gigabytes for one synthetic graph.
SIZE_BOUNDS = {"vocab_size": 1 << 20, "hidden_size": 1 << 15, "intermediate_size": 1 << 18,
               "num_hidden_layers": 512, "num_attention_heads": 512, "num_key_value_heads": 512, "head_dim": 1024}


def check_shape_config(cfg: dict, where: str) -> dict[str, int]:
    """The decoder sizes of a config read for its shapes only, refused in one line naming the field (not a positive
    integer, above ``SIZE_BOUNDS``, key/value heads that do not divide the heads, a hidden size the heads do not
    divide when no head_dim is given) before anything is allocated; returns them."""
    sizes, bad = declared_sizes(cfg, OPTIONAL_SIZES + ("vocab_size",))  # plan needs no vocabulary
    if bad:
        raise ModelError(f"{where}: {bad[0]}")
    for k, v in sizes.items():
        if cfg.get(k) is not None and v > SIZE_BOUNDS[k]:  # as given (a derived head size is not the user's)
            raise ModelError(f"{where}: {k} {v:,} is above {SIZE_BOUNDS[k]:,}, the largest bdlora plans or builds "
                             "(no released decoder comes near it)")
    heads, kv = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if kv > heads or heads % kv:
        raise ModelError(f"{where}: num_key_value_heads {kv} must divide num_attention_heads {heads}")
    if cfg.get("head_dim") is None and sizes["hidden_size"] % heads:
        raise ModelError(f"{where}: hidden_size {sizes['hidden_size']} is not a multiple of num_attention_heads "
                         f"{heads} (and no head_dim is given)")
    return sizes


# A folder's provenance without teacher_layers (compressed runs before it was recorded) implies its teacher's depth
# by its highest layer index: at most this many times the folder's own depth (a draft keeps half its teacher's
# layers; [0, 511] on a 2-layer folder had plan measuring a 512-layer step for minutes)
DEEPER = 4


def check_report_provenance(report: dict, where: str, max_layers: int = SIZE_BOUNDS["num_hidden_layers"],
                            deepest: int | None = None) -> None:
    """compression.json as plan reads it (no digest covers it): a list of modules with a name and integer features,
    a numeric speed-up, and provenance layers that are distinct, increasing integers within ``max_layers`` (a
    ``layer_indices`` of [0, 1e9] had plan build a 137-layer graph), or within ``deepest`` when no teacher_layers
    is recorded."""
    def bad(what: str) -> ModelError:
        return ModelError(f"{where}: {what}; the file is damaged or was edited")

    mods = report.get("modules")
    if not isinstance(mods, list) or not mods:
        raise bad("no modules list")
    for m in mods:
        if not isinstance(m, dict) or not isinstance(m.get("name"), str):
            raise bad(f"a module entry {shown(m)} has no name")
        for k in ("in_features", "out_features"):
            if isinstance(m.get(k), bool) or not isinstance(m.get(k), int) or not 0 < m[k] <= SIZE_BOUNDS[
                    "intermediate_size"]:
                raise bad(f"{m['name']}: {k} {shown(m.get(k))} is not a positive integer in range")
    s = report.get("speedup_vs_dense")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < float("inf"):
        raise bad(f"speedup_vs_dense {shown(s)} is not a positive number")
    prov = report.get("provenance") or {}
    if not isinstance(prov, dict):
        raise bad(f"provenance {shown(prov)} is not an object")
    t = prov.get("teacher_layers")
    if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 0 < t <= max_layers):
        raise bad(f"provenance teacher_layers {shown(t)} is not a layer count in 1..{max_layers}")
    idx = prov.get("layer_indices")
    if idx is not None:
        top = t or min(max_layers, deepest or max_layers)
        if (not isinstance(idx, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in idx)
                or any(not 0 <= i < top for i in idx) or idx != sorted(set(idx))):
            raise bad(f"provenance layer_indices {shown(idx)} are not distinct increasing layers in 0..{top - 1}")


FP32 = 4  # bytes a synthetic weight takes: every graph measured or built from shapes alone is fp32 first
GRAPH_COPIES = 3  # a timed projection: its fp32 tensor, its serialised graph and the session's own copy


def machine_memory() -> int:
    """Bytes of memory this machine has free now (``MemAvailable``: free pages and the caches the kernel would give
    back), else its physical pages where that cannot be read: against the total, Llama-405B's largest graph (about
    23 GiB) passed on a 24 GiB machine with other work resident, and was still being timed minutes later."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(sizes: dict[str, int], where: str, whole: bool) -> None:
    """What a reader of shapes alone will allocate, against this machine's memory, in one line before it allocates
    (Llama-405B shapes, every field within ``SIZE_BOUNDS``: plan --precision int4 segfaulted after 58 s, bench
    --model-config raised "can't allocate 8405385216 bytes"). ``whole``: the whole model in fp32 (bench's synthetic
    model); else its largest matrix as one timed graph (plan --precision)."""
    sizes = {**sizes, "vocab_size": sizes.get("vocab_size", 1)}
    h, inter = sizes["hidden_size"], sizes.get("intermediate_size", 4 * sizes["hidden_size"])
    if whole:
        need, what = implied_parameters(sizes) * FP32, f"its {implied_parameters(sizes):,} parameters in fp32"
    else:
        biggest = max(sizes["vocab_size"] * h, h * inter)
        need, what = biggest * FP32 * GRAPH_COPIES, f"its largest matrix ({biggest:,} weights) timed as a graph"
    have = machine_memory()
    if need > have:
        raise ModelError(f"{where}: {what} needs about {need / 2**30:,.0f} GiB, more than the {have / 2**30:,.0f} "
                         "GiB this machine has free (give a model that fits, or free memory)")
