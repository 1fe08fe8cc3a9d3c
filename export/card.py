"""The model card (``README.md``) of an ``export hf`` folder, written through ``huggingface_hub``'s ``ModelCard`` and
``ModelCardData`` so hubs index it: library, pipeline, tags, the base model when it is a hub id, the compression
summary as structured metadata (``bdlora:``) and the validation perplexity as an evaluation result (model-index).
"""

from __future__ import annotations

import re
from pathlib import Path

from bdlora.models.sources import PRESETS

TAGS = ["bdlora", "budgeted-lora", "distillation", "low-rank", "compressed"]
SUMMARY_KEYS = ("dense_kept", "dense_svd", "dense_dropped", "modules_total", "avg_lora_rank", "speedup_vs_dense",
                "speedup_vs_lora", "param_reduction")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_id(teacher) -> str | None:
    """``teacher`` if it names a hub repository (``org/name``, not a local path), a preset's original repository
    (``smollm2-135m``: HuggingFaceTB/SmolLM2-135M-Instruct), else None: hubs validate ``base_model`` against
    existing repositories."""

    if isinstance(teacher, str) and teacher in PRESETS:
        return PRESETS[teacher].hub_id
    if not isinstance(teacher, str) or not _HUB_ID.match(teacher) or Path(teacher).exists():
        return None
    return teacher


def card_data(report: dict):
    from huggingface_hub import EvalResult, ModelCardData

    prov = report.get("provenance", {})
    name = prov.get("name", "bdlora compressed student")
    summary = {k: report[k] for k in SUMMARY_KEYS if k in report}
    summary.update({k: prov[k] for k in ("method", "budget", "student_layers", "layer_indices", "teacher")
                    if prov.get(k) is not None})
    ev = report.get("eval") or {}
    results = None
    if ev.get("compressed_val_ppl") is not None:
        results = [EvalResult(task_type="text-generation", dataset_type="heldout", dataset_name="held-out split of "
                              "the training corpus", metric_type="perplexity", metric_name="validation perplexity",
                              metric_value=round(float(ev["compressed_val_ppl"]), 4))]
        summary.update(student_val_ppl=ev.get("student_val_ppl"), compressed_val_ppl=ev["compressed_val_ppl"])
    return ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=TAGS,
                         base_model=hub_id(prov.get("teacher")), model_name=name, eval_results=results,
                         bdlora=summary)


def model_card(report: dict) -> str:
    """README.md of an exported folder: structured metadata, then provenance, structure table, MAC figures and
    validation perplexity as text."""
    from huggingface_hub import ModelCard

    prov = report.get("provenance", {})
    n = report["modules_total"]
    lines = [
        f"# {prov.get('name', 'bdlora compressed student')}",
        "",
        "A Budgeted LoRA student (mixed dense / low-rank projections), exported by "
        f"bdlora {report.get('bdlora_version', '')}.",
        "",
        "| | |",
        "|---|---|",
        f"| base teacher | `{prov.get('teacher', '?')}` |",
        f"| method | {prov.get('method', '?')} |",
        f"| dense budget F | {prov.get('budget', '-')} |",
        f"| student layers | {prov.get('student_layers', '?')} "
        f"(from teacher layers {prov.get('layer_indices', '?')}) |",
        f"| dense kept / SVD / dropped | {report['dense_kept']}/{n} / {report['dense_svd']}/{n} / "
        f"{report['dense_dropped']}/{n} |",
        f"| average LoRA rank kept | {report['avg_lora_rank']:.1f} |",
        f"| MAC speed-up vs dense (replaced modules) | {report['speedup_vs_dense']:.2f}x |",
        f"| MAC speed-up vs LoRA (replaced modules) | {report['speedup_vs_lora']:.2f}x |",
        f"| parameter reduction (replaced modules) | {100 * report['param_reduction']:.1f}% |",
    ]
    ev = report.get("eval", {})
    if ev:
        lines.append(f"| validation perplexity (uncompressed student) | {ev['student_val_ppl']:.3f} |")
        lines.append(f"| validation perplexity (this model) | {ev['compressed_val_ppl']:.3f} |")
    lines += ["", "## Load", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)  # or `import bdlora` first",
              "tokenizer = AutoTokenizer.from_pretrained(PATH)", "```", "", "## Structure", "",
              "| module | d | case | form | rank | MACs/token |", "|---|---|---|---|---|---|"]
    for m in report["modules"]:
        lines.append(f"| {m['name']} | {m['d']:.3f} | {m['case']} | {m['form']} | {m['rank'] or '-'} | "
                     f"{m['macs_after']:,} |")
    card = ModelCard(f"---\n{card_data(report).to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")
    return str(card)
