"""The sweep's outputs: one row per member, ``sweep.md`` (the paper-style table) and ``pareto.png``."""

from __future__ import annotations

from pathlib import Path

from bdlora.base.io import atomic_path
from bdlora.bench.front import markdown as front_markdown
from bdlora.sweep.options import Member
from bdlora.sweep.vary import show


def _proxy(method: str, summary: dict) -> float:
    """Training compute relative to kd-full; a one-shot member trains nothing (calibration only): 0."""
    if method == "one-shot":
        return 0.0
    p = summary["compute_proxy"]
    return {"kd-full": 1.0, "kd-lora": p["lora_vs_full"]}.get(method, p["bud_vs_full"])


def _measured(bench: dict | None) -> dict:
    """Compressed-vs-dense measured speed-ups of the smallest batch/seq: modules prefill, model prefill and decode."""
    if bench is None:
        return {}
    out = {}
    for r in bench["results"]:
        if r["variant"] != "compressed":
            continue
        key = f"{r['scope']}_{r['phase']}"
        if key not in out:
            out[key] = {"speedup_vs_dense": r["speedup_vs_dense"], "mac_ratio_vs_dense": r["mac_ratio_vs_dense"],
                        "batch": r["batch"], "seq": r["seq"], "median_ms": r["median_ms"]}
    return out


def icl_fields(ev: dict) -> dict:
    """The ICL figures of an eval document that the sweep's tables use: the composite (the paper's ±), its
    log-probability score and every task's mean and std over seeds (Table 9)."""
    icl = ev["icl"]
    return {"icl_composite": icl["macro"]["mean"], "icl_composite_std": icl["macro"]["std"],
            "icl_target_logprob": icl["macro"]["target_logprob"],
            "icl_tasks": {t: {"mean": v["mean"], "std": v["std"]} for t, v in icl["tasks"].items()}}


def member_row(m: Member, summary: dict, report: dict, ev: dict, bench: dict | None) -> dict:
    return {
        "name": m.name, "method": m.method, "budget": m.budget, "run": m.run, "settings": m.settings,
        "student_val_ppl": summary["student_val_ppl"], "val_ppl": ev["ppl"]["val_ppl"],
        "train_compute_proxy": _proxy(m.method, summary),
        "mac_speedup_vs_dense": report["speedup_vs_dense"], "mac_speedup_vs_lora": report["speedup_vs_lora"],
        "param_reduction": report["param_reduction"],
        "dense_kept": report["dense_kept"], "dense_svd": report["dense_svd"], "dense_dropped": report["dense_dropped"],
        **icl_fields(ev),
        "measured": _measured(bench), "train_seconds": summary["train_seconds"],
    }


def _fmt_measured(row: dict, key: str) -> str:
    r = row["measured"].get(key)
    return f"{r['speedup_vs_dense']:.2f}x" if r else "-"


def varied(doc: dict) -> list[str]:
    """The options a sweep's --vary grid varies, in the order they were given."""
    return [k for a in doc.get("options", {}).get("vary", []) for k in a["options"]]


def _setting(r: dict, k: str) -> str:
    return show(r["settings"][k]) if k in r.get("settings", {}) else "-"


def markdown(doc: dict) -> str:
    keys = varied(doc)
    head = ("| member |" + "".join(f" {k} |" for k in keys) + " ppl (compressed) | train compute (proxy, x kd-full) "
            "| MAC speed-up vs dense | measured modules prefill | measured model decode | param reduction "
            "| dense kept/SVD/dropped | ICL composite % | ICL log p(target) |")
    lines = ["# bdlora sweep", "", head, "|" + "---|" * (10 + len(keys))]
    blank = " - |" * len(keys)
    t = doc.get("teacher")
    for label, ref in (("teacher", t), ("student init", (t or {}).get("student_init"))):
        if ref:
            lines.append(f"| {label} |{blank} {ref['val_ppl']:.2f} | - | - | - | - | - | - | "
                         f"{ref['icl_composite']:.1f} ± {ref['icl_composite_std']:.1f} | "
                         f"{ref['icl_target_logprob']:.2f} |")
    for r in doc["members"]:
        settings = "".join(f" {_setting(r, k)} |" for k in keys)
        lines.append(
            f"| {r['name']} |{settings} {r['val_ppl']:.2f} | {r['train_compute_proxy']:.3f} | "
            f"{r['mac_speedup_vs_dense']:.2f}x | "
            f"{_fmt_measured(r, 'modules_prefill')} | {_fmt_measured(r, 'model_decode')} | "
            f"{100 * r['param_reduction']:.1f}% | {r['dense_kept']}/{r['dense_svd']}/{r['dense_dropped']} | "
            f"{r['icl_composite']:.1f} ± {r['icl_composite_std']:.1f} | {r['icl_target_logprob']:.2f} |")
    lines += ["", "ppl: held-out perplexity of the compressed (deployed) model. Measured speed-ups: compressed vs "
              "dense under onnxruntime (bench.json of each member; smallest batch and length). Train compute: the "
              "SPEC 5 proxy. MAC speed-up and parameter reduction: of the replaced projections; budgeted members "
              "against the trained module (dense + LoRA path), the KD baselines against the dense student they "
              "deploy as (paper Table 5). ICL: 19 probes, exact match, mean ± the mean of the per-task stds over "
              "demonstration seeds (the paper's form); log p(target) is the teacher-forced log-probability of the "
              "answer (nats). The student init row (when the students were initialised from a checkpoint other than "
              "the teacher) is the paper's Figure 2 reference line.", ""]
    if doc.get("front"):
        front = doc["front"]
        lines += front_markdown(front["points"], "teacher", front.get("unseen_data")) + [
            "", f"(one run: {front['bench']}; plot: front.png)", ""]
    return "\n".join(lines)


def plot_pareto(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (key, label) in zip(axes, [("mac", "MAC speed-up of the replaced modules vs dense"),
                                       ("model_decode", "measured end-to-end decode speed-up vs dense")]):
        for r in doc["members"]:
            x = r["mac_speedup_vs_dense"] if key == "mac" else (r["measured"].get(key) or {}).get("speedup_vs_dense")
            if x is None:
                continue
            ax.scatter([x], [r["val_ppl"]], s=40)
            ax.annotate(r["name"], (x, r["val_ppl"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if doc.get("teacher"):
            ax.axhline(doc["teacher"]["val_ppl"], ls="--", color="gray", lw=1, label="teacher")
            ax.legend(fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out perplexity (lower is better)")
        ax.grid(alpha=0.3)
    fig.suptitle("bdlora sweep: quality vs inference cost")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
