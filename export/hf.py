"""Saving and sharing the compressed student as a Hugging Face model folder (SPEC 8, HF part).

A folder holds: ``config.json`` (the bdlora architecture, with ``auto_map``), ``model.safetensors``,
``modeling_bdlora.py`` (so ``trust_remote_code=True`` works without bdlora), the tokenizer,
``generation_config.json``, and ``compression.json`` (the SPEC 6.4 report plus validation perplexities).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from bdlora.errors import ModelError
from bdlora.io import atomic_dir, write_json, write_text
from bdlora.runs import ModelDir, check_out_dir

MODELING_FILE = Path(__file__).with_name("modeling_bdlora.py")


def register() -> None:
    """Register the bdlora architectures with the Auto classes (called on ``import bdlora``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bdlora.export.modeling_bdlora import FAMILIES

    for cfg_cls, model_cls in FAMILIES.values():
        AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)
        AutoModelForCausalLM.register(cfg_cls, model_cls, exist_ok=True)


def save_model_folder(model, tokenizer, out: Path, report: dict) -> Path:
    """Write the model folder atomically: an interrupted save leaves no folder that looks complete."""
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        shutil.copy(MODELING_FILE, tmp / MODELING_FILE.name)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / ModelDir.MARKER, report)
    return out


def model_card(report: dict) -> str:
    """README.md of an exported folder: provenance, structure table, MAC figures, validation perplexity."""
    prov = report.get("provenance", {})
    n = report["modules_total"]
    lines = [
        "---",
        "library_name: transformers",
        "tags: [bdlora, budgeted-lora, distillation, low-rank]",
        "---",
        "",
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
    return "\n".join(lines) + "\n"


def export_hf(model_dir: Path, out: Path, force: bool = False) -> Path:
    """Copy a compressed model folder into a clean, shareable folder with a generated model card."""
    src = ModelDir(model_dir)
    if not src.finished():
        raise ModelError(f"{src.path}: not a bdlora model folder (needs config.json and compression.json; "
                         "run `bdlora compress` first)")
    check_out_dir(out, force, (src.path,))
    report = src.report()
    with atomic_dir(out) as tmp:
        for f in sorted(src.path.iterdir()):
            if f.is_file() and not f.name.startswith("."):
                shutil.copy(f, tmp / f.name)
        write_text(tmp / "README.md", model_card(report))
    return out
