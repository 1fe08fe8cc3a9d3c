"""The quality/speed front of ``bdlora bench --runtime genai``: every deployed form (the student and the teacher, at
every precision, ours and onnxruntime-genai's builder's) as a point (decode ms per token at batch 1, held-out
perplexity), each marked as on the front or dominated, and by which point.

A point is dominated when another is at least as fast and at least as good, and strictly better in one (SPEC 11):
a user choosing by speed and quality never picks it. A student that is dominated by the teacher's own quantised
export is not a result, whatever its speed-up over fp32. Pure Python (matplotlib for the plot).
"""

from __future__ import annotations

from pathlib import Path

from bdlora.base.io import atomic_path
from bdlora.base.runs import GGUF, row_name
from bdlora.base.schemes import DEFAULT_SCHEME, FLOAT, PRECISIONS, rounded, scheme

DEPLOYED = ("genai", "llamacpp")  # the runtimes users deploy in: their rows (by scope) make the front
RUNTIME_NAMES = {"genai": "onnxruntime-genai", "llamacpp": "llama.cpp"}  # as a report names them


def dominance(points: list[dict], key: str = "ppl", mark: str = "") -> list[dict]:
    """``points`` ({"name", "ms", key}) with "front{mark}" (bool) and "dominated_by{mark}" (the dominating point with
    the lowest ``key``, ties broken by speed; None on the front) added. Points without ``key`` are left out of the
    comparison (front None). ``key`` "ppl_unseen" (mark "_unseen"): the same on the unseen domain."""
    scored = [p for p in points if p.get(key) is not None]
    out = []
    for p in points:
        if p.get(key) is None:
            out.append({**p, f"front{mark}": None, f"dominated_by{mark}": None})
            continue
        better = [q for q in scored if q is not p and q["ms"] <= p["ms"] and q[key] <= p[key]
                  and (q["ms"] < p["ms"] or q[key] < p[key])]
        best = min(better, key=lambda q: (q[key], q["ms"], q["name"])) if better else None
        out.append({**p, f"front{mark}": best is None, f"dominated_by{mark}": best["name"] if best else None})
    return out


def front_points(results: list[dict], quality: dict[str, dict], batch: int = 1, seq: int | None = None) -> list[dict]:
    """One point per genai variant: its decode ms per token at ``batch`` after a ``seq``-token prompt (default: the
    shortest timed) and its held-out perplexity (``quality[variant]["ppl"]``, None when not scored)."""
    rows = [r for r in results if r["scope"] in DEPLOYED and r["phase"] == "decode" and r["batch"] == batch]
    if not rows:
        return []
    seq = seq if seq is not None else min(r["seq"] for r in rows)
    points = [{"name": r["variant"], "ms": r["median_ms"], "p10_ms": r["p10_ms"], "p90_ms": r["p90_ms"],
               "ppl": (quality.get(r["variant"]) or {}).get("ppl"), "batch": batch, "seq": seq,
               **{k: v for k, v in (quality.get(r["variant"]) or {}).items() if k in ("icl", "icl_std", "ppl_unseen")}}
              for r in rows if r["seq"] == seq]
    points = dominance(sorted(points, key=lambda p: p["ms"]))
    if any(p.get("ppl_unseen") is not None for p in points):  # marked on the domain no row was fitted to as well
        points = dominance(points, "ppl_unseen", "_unseen")
    return [{**p, **same_precision(p, points), **same_precision(p, points, PEER)} for p in points]


def precision_of(name: str) -> str:
    """``compressed-int4`` -> int4; ``teacher-gguf-q4_k_m`` -> gguf-q4_k_m; ``teacher`` / ``other`` -> fp32 (the
    variant naming of the genai bench)."""
    head, _, tail = name.rpartition("-")
    if head.rpartition("-")[2] == GGUF.rstrip("-"):  # teacher-gguf-q4_k_m
        return GGUF + tail
    return tail if tail in PRECISIONS else FLOAT


def runtime_of(name: str) -> str:
    """The runtime a front row runs in: llamacpp (a GGUF row) or genai."""
    return "llamacpp" if precision_of(name).startswith(GGUF) else "genai"


def runtimes_named(points: list[dict]) -> str:
    """The runtimes of the front's ``points``, named as a report names them: "onnxruntime-genai and llama.cpp"."""
    return " and ".join(dict.fromkeys(RUNTIME_NAMES[runtime_of(p["name"])] for p in points))


PEER = "peer-"  # the prefix of a healed dense peer's rows (bench --peer FOLDER)


def same_precision(p: dict, points: list[dict], against: str = "teacher") -> dict:
    """How ``p`` compares with the teacher's own export at its precision (ours: ``teacher``, ``teacher-int8``,
    ``teacher-int4``), or with ``against=PEER`` the first healed dense peer's (``peer-NAME``, ``peer-NAME-int4``):
    {"vs_teacher": name, "speed_vs_teacher": x, "ppl_vs_teacher": relative change, "ppl_unseen_vs_teacher": ...}
    (``_peer`` for a peer), or {} for the reference's own rows and when it is not on the front."""
    tag = "peer" if against == PEER else "teacher"
    if p["name"].startswith(("teacher", PEER)):
        return {}
    prec = precision_of(p["name"])
    refs = [q for q in points if q["name"].startswith(against) and not q["name"].startswith("teacher-builder")
            and precision_of(q["name"]) == prec and (against == PEER or q["name"] == row_name("teacher", prec))]
    if not refs:
        return {}
    ref = refs[0]
    out = {f"vs_{tag}": ref["name"], f"speed_vs_{tag}": ref["ms"] / p["ms"]}
    for key in ("ppl", "ppl_unseen"):
        if key in p or key in ref:
            ok = p.get(key) is not None and ref.get(key)
            out[f"{key}_vs_{tag}"] = p[key] / ref[key] - 1 if ok else None
    return out


def markdown(points: list[dict], reference: str | None, unseen: str | None = None) -> list[str]:
    """The front as a table: decode ms/token, perplexity (and on the unseen domain ``unseen``), both relative to
    ``reference`` (the teacher's fp32), against the teacher's export and the healed dense peer at the same precision,
    and the dominance mark on each domain."""
    if not points:
        return []
    ref = next((p for p in points if p["name"] == reference), None)
    icl = any("icl" in p for p in points)
    two = any(p.get("ppl_unseen") is not None for p in points)
    peer = any("vs_peer" in p for p in points)
    lines = ["", f"Quality/speed front ({runtimes_named(points)}, decode at batch {points[0]['batch']} after a "
                 f"{points[0]['seq']}-token prompt; held-out perplexity of each graph"
                 + (f", and on {unseen}, a corpus no row was calibrated or healed on" if two else "")
                 + ("; ICL composite % ± std over seeds, on each row's plain-layout twin" if icl else "") + "):", "",
             "| variant | decode ms/token (p10-p90) | held-out ppl | " + ("unseen ppl | " if two else "")
             + ("ICL | " if icl else "") + "speed vs teacher fp32 | ppl vs teacher fp32 | vs the teacher's export at "
             "its precision (speed, ppl" + (", unseen" if two else "") + ") | "
             + ("vs the healed dense peer at its precision | " if peer else "") + "front |",
             "|---|---|---|" + ("---|" if two else "") + ("---|" if icl else "") + "---|---|---|"
             + ("---|" if peer else "") + "---|"]
    for p in points:
        speed, rel = vs_reference(p, ref)
        ppl = f"{p['ppl']:.3f}" if p["ppl"] is not None else "-"
        cells = (f"{p['ppl_unseen']:.3f} | " if p.get("ppl_unseen") is not None else "- | ") if two else ""
        cells += (f"{p['icl']:.1f} ± {p['icl_std']:.1f} | " if "icl" in p else "- | ") if icl else ""
        ms = f"{p['ms']:.3f} ({p['p10_ms']:.3f}-{p['p90_ms']:.3f})"
        peer_cell = f" {same_precision_cell(p, 'peer')} |" if peer else ""
        lines.append(f"| {p['name']} | {ms} | {ppl} | {cells}{speed} | {rel} | {same_precision_cell(p)} |{peer_cell} "
                     f"{front_mark(p, two)} |")
    return lines


def front_mark(p: dict, two: bool) -> str:
    """On the front or dominated (by whom), on the held-out domain and, with ``two``, on the unseen one."""
    def one(mark: str) -> str:
        front = p.get(f"front{mark}")
        return "-" if front is None else "**on the front**" if front else f"dominated by {p[f'dominated_by{mark}']}"

    return f"{one('')}; unseen: {one('_unseen')}" if two else one("")


def vs_reference(p: dict, ref: dict | None) -> tuple[str, str]:
    """(speed, perplexity change) of ``p`` against ``ref`` (the teacher's fp32) as table cells."""
    speed = f"{ref['ms'] / p['ms']:.2f}x" if ref else "-"
    rel = f"{p['ppl'] / ref['ppl'] - 1:+.1%}" if ref and p["ppl"] is not None and ref["ppl"] else "-"
    return speed, rel


def same_precision_cell(p: dict, tag: str = "teacher") -> str:
    if f"vs_{tag}" not in p:
        return "-"
    rels = [p.get(f"{k}_vs_{tag}") for k in ("ppl", "ppl_unseen") if f"{k}_vs_{tag}" in p]
    shown = ", ".join("-" if r is None else f"{r:+.1%}" for r in rels)
    return f"{p[f'speed_vs_{tag}']:.2f}x, {shown} ({p[f'vs_{tag}']})"


def plot(points: list[dict], path: Path, title: str = "", unseen: str | None = None) -> None:
    """Decode ms/token against perplexity: every point labelled, the front joined, students and teachers apart; a
    second panel for the unseen domain ``unseen`` when the points were scored on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ppl", "", "held-out perplexity")]
    if any(p.get("ppl_unseen") is not None for p in points):
        panels.append(("ppl_unseen", "_unseen", f"perplexity on {unseen or 'the unseen domain'} (never fitted)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 5.5), squeeze=False)
    for ax, (key, mark, label) in zip(axes[0], panels):
        _panel(ax, points, key, mark, label)
    fig.suptitle(title or "quality/speed front: squares the teacher's exports, diamonds the healed dense peer's, "
                          "circles the student's (triangles: its dense form by the builder)", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def _panel(ax, points: list[dict], key: str, mark: str, label: str) -> None:
    scored = [p for p in points if p.get(key) is not None]
    for p in scored:
        kind = next((k for k in ("teacher", "builder", PEER) if p["name"].startswith(k)), "")
        ax.scatter(p["ms"], p[key], marker={"teacher": "s", "builder": "^", PEER: "D"}.get(kind, "o"), s=40,
                   color={"teacher": "#555555", "builder": "#999999", PEER: "#2ca02c"}.get(kind, "#1f77b4"),
                   zorder=3)
        ax.annotate(p["name"], (p["ms"], p[key]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    front = sorted((p for p in scored if p.get(f"front{mark}")), key=lambda p: p["ms"])
    if front:
        ax.plot([p["ms"] for p in front], [p[key] for p in front], color="#d62728", lw=1, zorder=2,
                label="front (nothing both faster and better)")
        ax.legend(fontsize=8)
    ax.set_xlabel("decode ms per token (batch 1)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)


def predicted_vs_measured(points: list[dict], cost: dict, schemes: tuple[str, str] | None = None) -> dict | None:
    """What a one-shot allocation by measured decode time (``compress --one-shot --precision P``) predicted against
    what the front measured at P: the whole-step speed-up the allocation predicted (projections from the latency
    table, the rest of each layer and the step from ``bench.whole``), or for a folder written before it the
    teacher's measured decode at P less the projection time saved; None when the front lacks either row at P.
    ``schemes``: how the bench rounded (the student's, the teacher's); the prediction was made for both in the
    nodes of one scheme (``cost["scheme"]``, rtn when a folder predates it), and says so when they differ."""
    p = cost.get("precision")
    if p is None:
        return None
    ms = {x["name"]: x["ms"] for x in points}
    student, teacher = ms.get(row_name("compressed", p)), ms.get(row_name("teacher", p))
    if student is None or teacher is None:
        return None
    if cost.get("predicted_decode_speedup"):  # the whole step, predicted without the teacher's measured time
        predicted_ms = teacher / cost["predicted_decode_speedup"]
    else:  # older folders: the teacher's measured step less the projection time saved
        predicted_ms = teacher - (cost["projection_us_dense"] - cost["projection_us"]) / 1000.0
    if predicted_ms <= 0:
        return None
    predicted, measured = teacher / predicted_ms, teacher / student
    out = {"precision": p, "table_threads": cost.get("threads"), "teacher_ms": teacher, "student_ms": student,
           "predicted_student_ms": predicted_ms, "predicted_speedup": predicted, "measured_speedup": measured,
           "relative_error": predicted / measured - 1.0,
           "predicted_projection_speedup": cost["predicted_projection_speedup"],
           "predicted_scheme": cost.get("scheme") or DEFAULT_SCHEME}
    if schemes is not None and rounded(p):
        out["measured_schemes"] = {"student": schemes[0], "teacher": schemes[1]}
    return out


def prediction_line(pred: dict) -> str:
    measured, predicted = pred.get("measured_schemes") or {}, pred.get("predicted_scheme") or DEFAULT_SCHEME
    layouts = {scheme(v).layout(pred["precision"]) for v in measured.values()}  # gptq runs rtn's nodes: the same
    caveat = (f"; predicted in {predicted}'s nodes, measured with the student rounded by {measured['student']} and "
              f"the teacher by {measured['teacher']}: not the same graphs"
              if layouts - {scheme(predicted).layout(pred["precision"])} else "")
    return (f"predicted by the decode-time allocation at {pred['precision']}: {pred['predicted_speedup']:.2f}x faster "
            f"decode than the teacher's {pred['precision']} export (projections alone "
            f"{pred['predicted_projection_speedup']:.2f}x); measured {pred['measured_speedup']:.2f}x "
            f"({pred['relative_error']:+.0%}{caveat})")
