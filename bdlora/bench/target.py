"""What ``bdlora bench`` times: a compressed folder (the latest by default), or in synthetic mode the structure
``plan`` predicts for a budget F with random weights; each with the LoRA rank of its lora variant and the folder the
report goes to. The command only parses options and renders."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bdlora.base.errors import ModelError, UsageError
from bdlora.base.runs import ModelDir
from bdlora.compress.bounds import check_fits, check_shape_config
from bdlora.models.arch import check_lora_rank
from bdlora.train.plan import read_model_config

SYNTHETIC_LORA_RANK = 128  # synthetic mode's lora variant (no training to take a rank from)


@dataclass
class BenchTarget:
    model: object  # the compressed model (nn.Module)
    lora_rank: int  # of the lora variant
    report: dict  # its compression report
    out: Path  # where the bench writes
    tokenizer: object = None  # None in synthetic mode
    source: ModelDir | None = None  # the compressed folder (None in synthetic mode)
    inputs: tuple = field(default=())  # what the output must not overwrite


def synthetic_target(model_config: str, budget: float | None, layers: int | None, lora_rank: int | None,
                     out_dir: str | None, runs_dir: str, lazy: bool = False) -> BenchTarget:
    """The structure ``plan`` predicts for ``budget`` at ``model_config``'s shapes, random weights; ``lazy`` (genai
    graphs only: ``--runtime genai --no-peers``): built without weights, which each export makes one layer at a time
    (``bdlora.models.lazy``), so a 3B model's three variants fit on a 24 GB machine."""
    from bdlora.bench.variants import synthetic_model

    if budget is None:
        raise UsageError("--model-config needs --budget F (the structure to bench)")
    config = read_model_config(model_config)
    check_fits(check_shape_config(config, f"--model-config {model_config}"), f"--model-config {model_config}",
               whole=not lazy)  # lazy: one layer's weights at a time
    rank = check_lora_rank(lora_rank or SYNTHETIC_LORA_RANK, config, defaulted=lora_rank is None)
    model, report = synthetic_model(config, budget, layers, rank, lazy=lazy)
    out = Path(out_dir) if out_dir else Path(runs_dir) / f"bench-synthetic-F{budget}"
    return BenchTarget(model, rank, report, out)


def compressed_target(model_dir: str | None, lora_rank: int | None, out_dir: str | None,
                      runs_dir: str) -> BenchTarget:
    from bdlora.models.load import load_model_folder

    src = ModelDir(model_dir) if model_dir else ModelDir.latest(runs_dir)
    if not src.finished():
        raise ModelError(f"{src.path}: no compression.json; bench needs a `bdlora compress` output (or use "
                         "--model-config for synthetic mode)")
    model, tok, report = load_model_folder(src.path)
    rank = check_lora_rank(lora_rank or trained_lora_rank(report), model.config, lora_rank is None)
    out = Path(out_dir) if out_dir else src.bench_out()
    return BenchTarget(model, rank, report, out, tok, src, (src.path,))


def trained_lora_rank(report: dict) -> int:
    """The LoRA rank the model was trained with (``compression.json``'s ``lora_rank``); folders written before it
    was recorded give it back from the LoRA MACs (sum of r (d_in + d_out) over the modules)."""
    if report.get("lora_rank"):
        return int(report["lora_rank"])
    per_rank = sum(m["in_features"] + m["out_features"] for m in report["modules"])
    return max(1, round(report["lora_macs"] / max(1, per_rank)))
