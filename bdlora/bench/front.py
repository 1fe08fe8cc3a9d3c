"""The quality/speed front of ``bdlora bench --runtime genai``: every deployed form (the student and the teacher, at
every precision, ours and onnxruntime-genai's builder's) as a point (decode ms per token at batch 1, held-out
perplexity), each marked as on the front or dominated, and by which point.

A point is dominated when another is at least as fast and at least as good, and strictly better in one (SPEC 11):
a user choosing by speed and quality never picks it. A student that is dominated by the teacher's own quantised
export is not a result, whatever its speed-up over fp32. Pure Python (matplotlib for the plot).
"""

from __future__ import annotations

from pathlib import Path

from bdlora.io import atomic_path


def dominance(points: list[dict]) -> list[dict]:
    """``points`` ({"name", "ms", "ppl"}) with "front" (bool) and "dominated_by" (the dominating point with the
    lowest perplexity, ties broken by speed; None on the front) added. Points without a perplexity are left out of
    the comparison (front None)."""
    scored = [p for p in points if p.get("ppl") is not None]
    out = []
    for p in points:
        if p.get("ppl") is None:
            out.append({**p, "front": None, "dominated_by": None})
            continue
        better = [q for q in scored if q is not p and q["ms"] <= p["ms"] and q["ppl"] <= p["ppl"]
                  and (q["ms"] < p["ms"] or q["ppl"] < p["ppl"])]
        best = min(better, key=lambda q: (q["ppl"], q["ms"], q["name"])) if better else None
        out.append({**p, "front": best is None, "dominated_by": best["name"] if best else None})
    return out


def front_points(results: list[dict], quality: dict[str, dict], batch: int = 1, seq: int | None = None) -> list[dict]:
    """One point per genai variant: its decode ms per token at ``batch`` after a ``seq``-token prompt (default: the
    shortest timed) and its held-out perplexity (``quality[variant]["ppl"]``, None when not scored)."""
    rows = [r for r in results if r["scope"] == "genai" and r["phase"] == "decode" and r["batch"] == batch]
    if not rows:
        return []
    seq = seq if seq is not None else min(r["seq"] for r in rows)
    points = [{"name": r["variant"], "ms": r["median_ms"], "p10_ms": r["p10_ms"], "p90_ms": r["p90_ms"],
               "ppl": (quality.get(r["variant"]) or {}).get("ppl"), "batch": batch, "seq": seq,
               **{k: v for k, v in (quality.get(r["variant"]) or {}).items() if k in ("icl", "icl_std")}}
              for r in rows if r["seq"] == seq]
    return [{**p, **same_precision(p, points)} for p in dominance(sorted(points, key=lambda p: p["ms"]))]


def precision_of(name: str) -> str:
    """``compressed-int4`` -> int4; ``teacher`` / ``other`` -> fp32 (the variant naming of the genai bench)."""
    tail = name.rsplit("-", 1)[-1]
    return tail if tail in ("int8", "int4", "fp32") else "fp32"


def same_precision(p: dict, points: list[dict]) -> dict:
    """How ``p`` compares with the teacher's own export at its precision (ours: ``teacher``, ``teacher-int8``,
    ``teacher-int4``): {"vs_teacher": name, "speed_vs_teacher": x, "ppl_vs_teacher": relative change}, or {} for
    the teacher's own rows and when that export is not on the front."""
    if p["name"].startswith("teacher"):
        return {}
    prec = precision_of(p["name"])
    ref_name = "teacher" if prec == "fp32" else f"teacher-{prec}"
    ref = next((q for q in points if q["name"] == ref_name), None)
    if ref is None:
        return {}
    rel = p["ppl"] / ref["ppl"] - 1 if p.get("ppl") is not None and ref.get("ppl") else None
    return {"vs_teacher": ref_name, "speed_vs_teacher": ref["ms"] / p["ms"], "ppl_vs_teacher": rel}


def markdown(points: list[dict], reference: str | None) -> list[str]:
    """The front as a table: decode ms/token, perplexity, both relative to ``reference`` (the teacher's fp32), and
    the dominance mark."""
    if not points:
        return []
    ref = next((p for p in points if p["name"] == reference), None)
    icl = any("icl" in p for p in points)
    lines = ["", f"Quality/speed front (onnxruntime-genai, decode at batch {points[0]['batch']} after a "
                 f"{points[0]['seq']}-token prompt; held-out perplexity of each graph"
                 + ("; ICL composite % ± std over seeds, on each row's plain-layout twin" if icl else "") + "):", "",
             "| variant | decode ms/token (p10-p90) | held-out ppl | " + ("ICL | " if icl else "")
             + "speed vs teacher fp32 | ppl vs teacher fp32 | vs the teacher's export at its precision (speed, ppl) | "
             "front |", "|---|---|---|" + ("---|" if icl else "") + "---|---|---|---|"]
    for p in points:
        speed, rel = vs_reference(p, ref)
        ppl = f"{p['ppl']:.3f}" if p["ppl"] is not None else "-"
        mark = "-" if p["front"] is None else "**on the front**" if p["front"] else f"dominated by {p['dominated_by']}"
        ms = f"{p['ms']:.3f} ({p['p10_ms']:.3f}-{p['p90_ms']:.3f})"
        cell = (f"{p['icl']:.1f} ± {p['icl_std']:.1f} | " if "icl" in p else "- | ") if icl else ""
        lines.append(f"| {p['name']} | {ms} | {ppl} | {cell}{speed} | {rel} | {same_precision_cell(p)} | {mark} |")
    return lines


def vs_reference(p: dict, ref: dict | None) -> tuple[str, str]:
    """(speed, perplexity change) of ``p`` against ``ref`` (the teacher's fp32) as table cells."""
    speed = f"{ref['ms'] / p['ms']:.2f}x" if ref else "-"
    rel = f"{p['ppl'] / ref['ppl'] - 1:+.1%}" if ref and p["ppl"] is not None and ref["ppl"] else "-"
    return speed, rel


def same_precision_cell(p: dict) -> str:
    if "vs_teacher" not in p:
        return "-"
    rel = "-" if p.get("ppl_vs_teacher") is None else f"{p['ppl_vs_teacher']:+.1%}"
    return f"{p['speed_vs_teacher']:.2f}x, {rel} ({p['vs_teacher']})"


def plot(points: list[dict], path: Path, title: str = "") -> None:
    """Decode ms/token against perplexity: every point labelled, the front joined, students and teachers apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = [p for p in points if p.get("ppl") is not None]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for p in scored:  # squares: the teacher's exports; triangles: the student's dense form by the builder
        kind = "teacher" if p["name"].startswith("teacher") else "builder" if p["name"].startswith("builder") else ""
        ax.scatter(p["ms"], p["ppl"], marker={"teacher": "s", "builder": "^"}.get(kind, "o"), s=40,
                   color={"teacher": "#555555", "builder": "#999999"}.get(kind, "#1f77b4"), zorder=3)
        ax.annotate(p["name"], (p["ms"], p["ppl"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    front = sorted((p for p in scored if p["front"]), key=lambda p: p["ms"])
    if front:
        ax.plot([p["ms"] for p in front], [p["ppl"] for p in front], color="#d62728", lw=1, zorder=2,
                label="front (nothing both faster and better)")
        ax.legend(fontsize=8)
    ax.set_xlabel("decode ms per token (batch 1)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(title or "quality/speed front: squares the teacher's exports, circles the student's (triangles: its "
                          "dense form by the builder)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def predicted_vs_measured(points: list[dict], cost: dict) -> dict | None:
    """What a one-shot allocation by measured decode time (``compress --one-shot --precision P``) predicted against
    what the front measured at P: the whole-step speed-up the allocation predicted (projections from the latency
    table, the rest of each layer and the step from ``bench.whole``), or for a folder written before it the
    teacher's measured decode at P less the projection time saved; None when the front lacks either row at P."""
    p = cost.get("precision")
    suffix = "" if p == "fp32" else f"-{p}"
    ms = {x["name"]: x["ms"] for x in points}
    student, teacher = ms.get(f"compressed{suffix}"), ms.get(f"teacher{suffix}")
    if p is None or student is None or teacher is None:
        return None
    if cost.get("predicted_decode_speedup"):  # the whole step, predicted without the teacher's measured time
        predicted_ms = teacher / cost["predicted_decode_speedup"]
    else:  # older folders: the teacher's measured step less the projection time saved
        predicted_ms = teacher - (cost["projection_us_dense"] - cost["projection_us"]) / 1000.0
    if predicted_ms <= 0:
        return None
    predicted, measured = teacher / predicted_ms, teacher / student
    return {"precision": p, "table_threads": cost.get("threads"), "teacher_ms": teacher, "student_ms": student,
            "predicted_student_ms": predicted_ms, "predicted_speedup": predicted, "measured_speedup": measured,
            "relative_error": predicted / measured - 1.0,
            "predicted_projection_speedup": cost["predicted_projection_speedup"]}


def prediction_line(pred: dict) -> str:
    return (f"predicted by the decode-time allocation at {pred['precision']}: {pred['predicted_speedup']:.2f}x faster "
            f"decode than the teacher's {pred['precision']} export (projections alone "
            f"{pred['predicted_projection_speedup']:.2f}x); measured {pred['measured_speedup']:.2f}x "
            f"({pred['relative_error']:+.0%})")
