"""The paper's tables and figure from one sweep, or from several merged (one per teacher: its three-teacher layout).

- ``main.md``: Table 5's layout: a row per method (baselines, then Budgeted LoRA), perplexity and ICL composite per
  teacher, then the student-side efficiency columns (training-compute proxy, MAC speed-up vs dense, parameter
  reduction) and the measured end-to-end decode speed-up under onnxruntime.
- ``table9.md``: Table 9: per-task ICL accuracy, mean ± std over demonstration seeds, a column per reference model
  and per member (x teacher), and the composite with the paper's ± (the mean of the per-task stds).
- ``icl.png``: Figure 2: the composite per member, grouped by teacher, with its error bar, and a dashed line at the
  model the students were initialised from (``--student-init``, else the teacher itself).

A *group* is ``(label, results.json document)``; ``bdlora sweep`` writes these for its own single group and
``bdlora sweep-merge`` for several.
"""

from __future__ import annotations

from pathlib import Path

from bdlora import SCHEMA_VERSION
from bdlora.base.errors import UsageError
from bdlora.base.io import atomic_path, write_json, write_text
from bdlora.base.method_table import method_of
from bdlora.base.runs import PAPER_ICL, PAPER_MAIN, PAPER_TABLE9, SweepDir
from bdlora.sweep.vary import show

OUTPUTS = (PAPER_MAIN, PAPER_TABLE9, PAPER_ICL)


def teacher_label(doc: dict) -> str:
    """How a sweep's teacher is named in merged tables: 'builtin', the preset, or the folder / file name."""
    return show(doc.get("options", {}).get("train", {}).get("teacher") or "builtin")


def method_label(row: dict) -> str:
    base = {"kd-full": "KD Full", "kd-lora": "KD LoRA"}.get(row["method"]) or (
        f"one-shot {row['settings']['mac_ratio']:g}x" if row["method"] == "one-shot" else f"F = {row['budget']:g}")
    return base + "".join(f", {k}={show(v)}" for k, v in (row.get("settings") or {}).items()
                          if not (row["method"] == "one-shot" and k == "mac_ratio"))


def init_reference(doc: dict) -> tuple[str, dict] | None:
    """The Figure 2 reference: the student-init model when it differs from the teacher, else the teacher."""
    t = doc.get("teacher")
    if not t:
        return None
    if t.get("student_init"):
        return f"init ({show(t['student_init']['source'])})", t["student_init"]
    return "teacher (init)", t


def _member_names(groups) -> list[str]:
    names: list[str] = []
    for _, doc in groups:
        names += [r["name"] for r in doc["members"] if r["name"] not in names]
    return names


def _rows_by_name(doc: dict) -> dict:
    return {r["name"]: r for r in doc["members"]}


def _distinct(values: list[str]) -> str:
    return " / ".join(dict.fromkeys(values)) if values else "-"


def main_table(groups: list[tuple[str, dict]]) -> str:
    labels = [g[0] for g in groups]
    head = ["Method", *(f"PPL {lb}" for lb in labels), *(f"ICL % {lb}" for lb in labels), "Train compute",
            "MAC speed-up", "Param red.", "Measured decode"]
    lines = ["# Quality and efficiency (paper Table 5 layout)", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    refs = [(lb, doc["teacher"]) for lb, doc in groups if doc.get("teacher")]
    if refs:
        ppl = {lb: f"{t['val_ppl']:.2f}" for lb, t in refs}
        icl = {lb: f"{t['icl_composite']:.1f}" for lb, t in refs}
        lines.append("| Teacher | " + " | ".join([*(ppl.get(lb, "-") for lb in labels), *(icl.get(lb, "-")
                                                                                         for lb in labels)])
                     + " | - | - | - | - |")
    tables = [_rows_by_name(doc) for _, doc in groups]
    names = _member_names(groups)
    for section, pick in (("Baselines", lambda r: not method_of(r["method"]).gated),
                          ("Budgeted LoRA", lambda r: method_of(r["method"]).gated)):
        chosen = [n for n in names if pick(next(t[n] for t in tables if n in t))]
        if not chosen:
            continue
        lines.append(f"| *{section}* |" + " |" * (len(head) - 1))
        for n in chosen:
            rows = [t.get(n) for t in tables]
            present = [r for r in rows if r]
            decode = [f"{r['measured']['model_decode']['speedup_vs_dense']:.2f}x" for r in present
                      if r.get("measured", {}).get("model_decode")]
            cells = [method_label(present[0]),
                     *(f"{r['val_ppl']:.2f}" if r else "-" for r in rows),
                     *(f"{r['icl_composite']:.1f} ± {r['icl_composite_std']:.1f}" if r else "-" for r in rows),
                     _distinct([f"{r['train_compute_proxy']:.2f}x" for r in present]),
                     _distinct([f"{r['mac_speedup_vs_dense']:.2f}x" for r in present]),
                     _distinct([f"{100 * r['param_reduction']:.1f}%" for r in present]), _distinct(decode)]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "PPL: held-out perplexity of the compressed model; ICL: composite exact match over the 19 probes, "
              "± the mean of the per-task stds over seeds. Train compute: the SPEC 5 proxy (x KD Full). MAC speed-up "
              "and parameter reduction: of the replaced projections (budgeted vs dense + LoRA, the KD baselines vs "
              "the dense student they deploy as). Measured decode: whole model under onnxruntime vs the dense "
              "student. Efficiency cells list each teacher's value when they differ.", ""]
    return "\n".join(lines)


def _cell(t: dict | None) -> str:
    return f"{t['mean']:.1f} ± {t['std']:.1f}" if t else "-"


def table9(groups: list[tuple[str, dict]]) -> str:
    """Per-task ICL accuracy (Table 9): reference models first (deduplicated), then each member x teacher."""
    multi = len(groups) > 1
    cols: list[tuple[str, dict]] = []
    seen = set()
    for lb, doc in groups:
        t = doc.get("teacher")
        if t:
            cols.append((f"teacher {lb}" if multi else "teacher", t))
            init = t.get("student_init")
            if init and init["source"] not in seen:
                seen.add(init["source"])
                cols.append((init_reference(doc)[0], init))
    tables = [(lb, _rows_by_name(doc)) for lb, doc in groups]
    for n in _member_names(groups):
        cols += [(f"{n} {lb}" if multi else n, t[n]) for lb, t in tables if n in t]
    tasks = list(dict.fromkeys(k for _, c in cols for k in c.get("icl_tasks", {})))
    lines = ["# Per-task ICL accuracy (paper Table 9)", "", "| task | " + " | ".join(c[0] for c in cols) + " |",
             "|" + "---|" * (len(cols) + 1)]
    for task in tasks:
        lines.append(f"| {task} | " + " | ".join(_cell(c.get("icl_tasks", {}).get(task)) for _, c in cols) + " |")
    lines.append("| **ICL composite (macro)** | " + " | ".join(
        f"**{c['icl_composite']:.1f} ± {c['icl_composite_std']:.1f}**" for _, c in cols) + " |")
    lines += ["", "Exact-match accuracy (%) per probe, mean ± population std over demonstration seeds; the composite "
              "is the mean over tasks ± the mean of the per-task stds (the paper's form).", ""]
    return "\n".join(lines)


def plot_icl(groups: list[tuple[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _member_names(groups)
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + 0.5 * len(names) * len(groups)), 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for gi, (_, doc) in enumerate(groups):
        rows = _rows_by_name(doc)
        for mi, n in enumerate(names):
            if n in rows:
                r = rows[n]
                ax.bar(gi + (mi - (len(names) - 1) / 2) * width, r["icl_composite"], width * 0.9,
                       yerr=r["icl_composite_std"], capsize=3, color=colours[mi % len(colours)],
                       label=n if gi == 0 else None)
        ref = init_reference(doc)
        if ref:
            ax.hlines(ref[1]["icl_composite"], gi - 0.45, gi + 0.45, colors="black", linestyles="--", lw=1,
                      label=ref[0] if gi == 0 else None)
    ax.set_xticks(range(len(groups)), [lb for lb, _ in groups])
    ax.set_xlabel("teacher")
    ax.set_ylabel("ICL composite accuracy (%)")
    top = max([r["icl_composite"] + r["icl_composite_std"] for _, d in groups for r in d["members"]]
              + [ref[1]["icl_composite"] for ref in map(init_reference, (d for _, d in groups)) if ref] + [0.0])
    ax.set_ylim(0, max(1.0, 1.15 * top))  # accuracies: never below 0, and a visible axis when everything is 0
    ax.set_title("ICL composite, 19 probes (mean ± mean per-task std over seeds)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")  # the legend sits beside the axes
    plt.close(fig)


def write_paper_outputs(groups: list[tuple[str, dict]], folder: Path) -> None:
    write_text(folder / PAPER_MAIN, main_table(groups))
    write_text(folder / PAPER_TABLE9, table9(groups))
    plot_icl(groups, folder / PAPER_ICL)


def merge_sweeps(dirs: list[str], labels: list[str] | None, out: Path, force: bool = False) -> dict:
    """Combine finished sweeps (one per teacher) into the paper's three-teacher layout in ``out``."""

    if labels and len(labels) != len(dirs):
        raise UsageError(f"--labels: {len(labels)} label(s) for {len(dirs)} sweep(s) (one per sweep, in order)")
    sweeps = [SweepDir(d) for d in dirs]
    for s in sweeps:
        if not s.path.is_dir():
            raise UsageError(f"{s.path}: no such folder (pass finished `bdlora sweep` folders, one per teacher)")
        if not s.finished():
            raise UsageError(f"{s.path}: not a finished sweep folder (no {SweepDir.MARKER}; finish it with "
                             f"`bdlora sweep --resume {s.path}`)")
    docs = [s.read(SweepDir.MARKER) for s in sweeps]
    labels = labels or [teacher_label(d) for d in docs]
    if len(set(labels)) != len(labels):
        raise UsageError(f"sweeps share the label {labels[0]!r}: name each with --labels A,B,C")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise UsageError(f"--out {out}: exists and is not empty (choose a new folder, or --force to replace its "
                         "merged outputs)")
    groups = list(zip(labels, docs))
    write_paper_outputs(groups, out)
    merged = {"schema_version": SCHEMA_VERSION, "sweeps": [{"label": lb, "path": str(s.path.resolve())}
                                                            for lb, s in zip(labels, sweeps)],
              "outputs": list(OUTPUTS)}
    write_json(out / "merged.json", merged)
    return merged
