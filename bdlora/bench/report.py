"""The bench report: ``bench.md`` (a Markdown table) and ``bench.png`` (measured speed-up beside the MAC limit)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bdlora.base.io import atomic_path
from bdlora.base.runs import row_name
from bdlora.bench.front import markdown as front_markdown
from bdlora.bench.front import precision_of, prediction_line


def markdown(doc: dict) -> str:
    lines = [f"# bdlora bench ({doc['thread_pool']}, onnxruntime {doc['onnxruntime']})", "",
             f"Replaced-module MAC ratio vs dense {doc['mac_ratio_modules_vs_dense']:.2f}x, vs LoRA "
             f"{doc['mac_ratio_modules_vs_lora']:.2f}x.", "",
             "| scope | phase | batch x seq | dense ms | lora ms | compressed ms (p10-p90) | vs dense | MAC limit | "
             "of limit | vs LoRA | outside modules |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    idx = {(r["scope"], r["variant"], r["phase"], r["batch"], r["seq"]): r for r in doc["results"]}
    q8 = [r for r in doc["results"] if r["variant"] == "compressed-int8"]
    for r in doc["results"]:
        if r["variant"] != "compressed" or r["scope"] == "genai":
            continue
        k = (r["phase"], r["batch"], r["seq"])
        d, lo = idx[(r["scope"], "dense", *k)], idx.get((r["scope"], "lora", *k))
        shape = f"{r['batch']}x{r['seq']}" if r["phase"] == "prefill" else f"{r['batch']}x1 (cache {r['seq']})" \
            if r["scope"] == "model" else f"{r['batch']}x1"
        outside = f"{100 * r['share_outside_modules']:.0f}%" if "share_outside_modules" in r else "-"
        lines.append(f"| {r['scope']} | {r['phase']} | {shape} | {d['median_ms']:.3f} | "
                     f"{lo['median_ms'] if lo else float('nan'):.3f} | {r['median_ms']:.3f} ({r['p10_ms']:.3f}-"
                     f"{r['p90_ms']:.3f}) | {r['speedup_vs_dense']:.2f}x | {r['mac_ratio_vs_dense']:.2f}x | "
                     f"{100 * r['fraction_of_limit']:.0f}%{noise_mark(r)} | "
                     f"{r.get('speedup_vs_lora', float('nan')):.2f}x | {outside} |")
    if q8:
        lines += ["", "int8 (onnxruntime dynamic weight quantisation), model scope:", "",
                  "| phase | batch x seq | dense int8 ms | compressed int8 ms | vs fp32 dense | vs int8 dense |",
                  "|---|---|---|---|---|---|"]
        for r in q8:
            d8 = idx.get((r["scope"], "dense-int8", r["phase"], r["batch"], r["seq"]))
            lines.append(f"| {r['phase']} | {r['batch']}x{r['seq']} | {d8['median_ms'] if d8 else float('nan'):.3f} "
                         f"| {r['median_ms']:.3f} | {r.get('speedup_vs_dense', float('nan')):.2f}x | "
                         f"{r.get('speedup_vs_dense_int8', float('nan')):.2f}x |")
    front = front_markdown(doc.get("front") or [], "teacher", doc.get("unseen_data"))
    if doc.get("prediction"):
        front += ["", prediction_line(doc["prediction"])]
    return "\n".join(lines + genai_markdown(doc, idx) + llamacpp_markdown(doc, idx) + front + noise_lines(doc)) + "\n"


def noise_mark(r: dict) -> str:
    return " (noise)" if "noise" in r else ""


def noise_lines(doc: dict) -> list[str]:
    """One line per figure above its MAC limit: what it is, and the repeats a stable figure needs."""
    noisy = [r for r in doc["results"] if "noise" in r]
    if not noisy:
        return []
    need = max(r["noise"]["repeats_needed"] for r in noisy)
    spread = 100 * max(r["noise"]["p10_p90_spread"] for r in noisy)
    return ["", f"(noise) {len(noisy)} figure(s) above the MAC limit: time cannot fall faster than the work, so these "
                f"are timing noise (p10-p90 spreads up to {spread:.0f}% of the median at {noisy[0]['repeats']} "
                f"repeats); about --repeats {need} would give a stable figure."]


def _ms(r: dict | None) -> str:
    return f"{r['median_ms']:.3f}" if r else "-"


def genai_markdown(doc: dict, idx: dict) -> list[str]:
    """The genai runtime's table: per shape, the builder's dense, ours, LoRA and compressed, at each precision."""
    rows = [r for r in doc["results"] if r["scope"] == "genai" and r["variant"].startswith("compressed")]
    if not rows:
        return [] if any(r["scope"] == "llamacpp" for r in doc["results"]) else notes_markdown(doc)
    lines = ["", "onnxruntime-genai (og.Generator; decode in ms per token): every variant through `bdlora export "
             "genai`, beside the same dense model converted by onnxruntime-genai's own builder.", "",
             "| precision | phase | batch x seq | builder dense ms | our dense ms | lora ms | compressed ms (p10-p90) "
             "| vs builder | vs our dense | MAC limit | of limit vs builder |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        precision = r["variant"].partition("-")[2] or "fp32"
        k = (r["phase"], r["batch"], r["seq"])
        b, d = idx.get(("genai", f"builder-{precision}", *k)), idx.get(("genai", row_name("dense", precision), *k))
        lo = idx.get(("genai", row_name("lora", precision), *k))
        shape = f"{r['batch']}x{r['seq']}" if r["phase"] == "prefill" else f"{r['batch']}x1 (cache {r['seq']})"
        vs_b = f"{r['speedup_vs_builder']:.2f}x" if "speedup_vs_builder" in r else "-"
        vs_d = f"{d['median_ms'] / r['median_ms']:.2f}x" if d else "-"
        frac = f"{100 * r['fraction_of_limit_vs_builder']:.0f}%{noise_mark(r)}" \
            if "fraction_of_limit_vs_builder" in r else "-"
        lines.append(f"| {precision} | {r['phase']} | {shape} | {_ms(b)} | {_ms(d)} | {_ms(lo)} | "
                     f"{r['median_ms']:.3f} ({r['p10_ms']:.3f}-{r['p90_ms']:.3f}) | {vs_b} | {vs_d} | "
                     f"{r['mac_ratio_vs_dense']:.2f}x | {frac} |")
    return lines + notes_markdown(doc)


def notes_markdown(doc: dict) -> list[str]:
    lines = []
    for key, why in (doc.get("genai_notes") or {}).items():
        lines += ["", f"{key}: {why}"]
    return lines


def llamacpp_markdown(doc: dict, idx: dict) -> list[str]:
    """llama.cpp's table: every GGUF row per shape, beside the teacher's GGUF of the same type."""
    rows = [r for r in doc["results"] if r["scope"] == "llamacpp"]
    if not rows:
        return []
    lines = ["", "llama.cpp (llama-cpp-python; every folder through `bdlora export gguf`, batch 1; decode in ms per "
             "token), timed interleaved with the rows above:", "",
             "| row | phase | batch x seq | ms (p10-p90) | vs the teacher's GGUF of its type |",
             "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["phase"], r["seq"], r["variant"])):
        ref = idx.get(("llamacpp", row_name("teacher", precision_of(r["variant"])), r["phase"], r["batch"], r["seq"]))
        shape = f"{r['batch']}x{r['seq']}" if r["phase"] == "prefill" else f"{r['batch']}x1 (cache {r['seq']})"
        vs = f"{ref['median_ms'] / r['median_ms']:.2f}x" if ref and ref is not r else "-"
        lines.append(f"| {r['variant']} | {r['phase']} | {shape} | {r['median_ms']:.3f} ({r['p10_ms']:.3f}-"
                     f"{r['p90_ms']:.3f}) | {vs} |")
    has_genai = any(r["scope"] == "genai" and r["variant"].startswith("compressed") for r in doc["results"])
    return lines + ([] if has_genai else notes_markdown(doc))


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["results"] if r["variant"] == "compressed" and "speedup_vs_dense" in r]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4.2))
    labels = [f"{r['scope'][:3]} {r['phase'][:3]}\n{r['batch']}x{r['seq']}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["mac_ratio_vs_dense"] for r in rows], 0.4, label="MAC limit vs dense", color="#bbbbbb")
    ax.bar(x + 0.2, [r["speedup_vs_dense"] for r in rows], 0.4, label="measured speed-up vs dense",
           color="tab:blue")
    ax.set_xticks(x, labels, fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("x faster than dense")
    ax.set_title("compressed vs dense under onnxruntime: measured speed-up beside the MAC limit")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
