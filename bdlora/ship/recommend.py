"""The answer of ``bdlora ship``: from its bench's front (every folder, the teacher's export and the teacher
speculating with prompt lookup and with the draft, each timed in one run and scored on both domains), for each
perplexity tolerance over the teacher's export the fastest row within it on *every* domain, the commands that
rebuild it, and "the teacher's own export" when nothing beats it; recommendation.md and ship.png beside."""

from __future__ import annotations

import shlex
from pathlib import Path

from bdlora.base.argv import flags
from bdlora.base.io import atomic_path, write_text
from bdlora.base.runs import BENCH_JSON, SHIP_PLOT, SHIP_REPORT, BenchDir
from bdlora.export.settings import GenaiExportSettings

TEACHER, LOOKUP, SPEC_DRAFT, PEER = "teacher", "spec-lookup", "spec-draft", "peer-"
BENCH = "bench"  # the ship step (and folder) that benches every folder
OFF_CHART = 10.0  # rows over 11x the teacher's perplexity are named on the picture, not plotted
OWN_FORMS = ("dense", "lora")  # the bench's own model's dense and LoRA forms: measured, never recommended


def _source(row: str, precision: str) -> str | None:
    """The front row's name without its precision suffix (None: a row of another precision)."""
    suffix = f"-{precision}"
    return row[: -len(suffix)] if row.endswith(suffix) else None


def exported(folder: Path, name: str, precision: str) -> Path:
    """Where the rebuild commands put a folder's genai export."""
    return folder / f"{name}.genai-{precision}"


def _exported(folder: Path, name: str, cfg, quant: str | None) -> str:
    rounding = flags(GenaiExportSettings, precision=cfg.precision, quant=quant)
    return "bdlora " + shlex.join(["export", "genai", str(folder / name), *rounding, "--out",
                                   str(exported(folder, name, cfg.precision))])


def verified(identical: bool | None) -> str:
    """What a speculative row's output is, as the bench measured it: the teacher verifies every token; whether the
    tokens were those of plain decoding (at int4 a verifying call rounds several rows at once in MatMulNBits, so
    a greedy tie can break the other way: measured, not assumed)."""
    if identical:
        return "its own output, token-identical to plain decoding in the bench"
    if identical is None:
        return "every token verified by the teacher"
    return ("every token verified by the teacher, but not token-identical to plain decoding in the bench: the "
            "verifying call rounds several rows at once")


def row_commands(name: str, bench_model: str, folder: Path, cfg, commands: dict[str, str], teacher: str,
                 quant: str | None, identical: bool | None = None, export: str = "") -> tuple[str, list[str]]:
    """(what ships, the commands that rebuild it) of a front row named ``name`` (without its precision);
    ``teacher``: the command that writes the teacher's export, into folder ``export``; ``identical``: a
    speculative row's tokens against plain decoding, as benched."""
    export = str(export)
    if name == TEACHER:
        return "the teacher's own export", [teacher]
    if name == LOOKUP:
        return f"the teacher's export, speculating with prompt lookup ({verified(identical)})", [
            teacher, f"bdlora serve {shlex.quote(export)} --runtime genai --prompt-lookup"]
    own = bench_model if name == "compressed" else name.removeprefix(PEER)
    made = own.removeprefix("healed-")  # the folder a healed one started from (itself when not healed)
    steps = [commands[s] for s in dict.fromkeys((made, f"heal-{made}", own)) if s in commands]
    if name == SPEC_DRAFT:
        return f"the teacher's export with the draft ({verified(identical)})", [
            teacher, *steps, _exported(folder, own, cfg, quant),
            f"bdlora serve {shlex.quote(export)} --runtime genai --draft "
            f"{shlex.quote(str(exported(folder, own, cfg.precision)))}"]
    what = f"the dense teacher healed as the students were ({own})" if name.startswith(PEER) else own
    return what, [*steps, _exported(folder, own, cfg, quant)]


def recommend(folder: Path, cfg, commands: dict[str, str], teacher_quant: str | None, scheme_ppl: dict[str, float],
              teacher: str, teacher_out: str | Path) -> dict:
    """The answers and every row (``commands``: each step's command line by name; ``teacher``: the command that
    exports the teacher's row, into ``teacher_out``), written to recommendation.md and ship.png; returned for
    recommendation.json."""
    bench = BenchDir(folder / BENCH).report()
    bench_model = Path(shlex.split(commands[BENCH])[2]).name
    rows = []
    for r in bench["front"]:
        name = _source(r["name"], cfg.precision)
        if name is None or name in OWN_FORMS:
            continue
        shown = f"{bench_model}-{cfg.precision}" if name == "compressed" else r["name"]  # the folder's own name
        rows.append({"row": r["name"], "shown": shown, "name": name, "ms": r["ms"], "ppl": r["ppl"],
                     "ppl_unseen": r.get("ppl_unseen")})
    ref = next((r for r in rows if r["name"] == TEACHER), None)
    if ref is None:
        raise ValueError(f"{folder / BENCH / BENCH_JSON}: no teacher-{cfg.precision} row to compare with")
    domains = ["ppl"] + (["ppl_unseen"] if ref["ppl_unseen"] is not None else [])
    spec = ((bench.get("speculative") or {}).get(cfg.precision) or {}).get("summary") or {}
    for r in rows:
        r["speedup"] = ref["ms"] / r["ms"]
        if r["name"] in (LOOKUP, SPEC_DRAFT):  # the bench's speculative configurations: "lookup", "draft"
            r["identical"] = (spec.get(r["name"].removeprefix("spec-")) or {}).get("identical")
        for d in domains:
            r[f"{d}_vs_teacher"] = r[d] / ref[d] - 1 if r[d] is not None else None
        r["what"], r["commands"] = row_commands(r["name"], bench_model, folder, cfg, commands, teacher,
                                                cfg.student_quant or teacher_quant, r.get("identical"), teacher_out)
    answers = []
    for t in cfg.tolerance_list():
        within = [r for r in rows if all(r[f"{d}_vs_teacher"] is not None and r[f"{d}_vs_teacher"] <= t / 100 + 1e-9
                                         for d in domains)]
        best = min(within, key=lambda r: (r["ms"], r["name"] != TEACHER))
        answers.append({"tolerance_percent": t, "row": best["row"], "what": best["what"], "speedup": best["speedup"],
                        **{f"{d}_vs_teacher": best[f"{d}_vs_teacher"] for d in domains},
                        "teacher_own": best["name"] == TEACHER, "commands": best["commands"]})
    unseen = bench.get("unseen_data")
    result = {"precision": cfg.precision, "teacher_scheme": teacher_quant, "teacher_scheme_ppl": scheme_ppl,
              "domains": {"ppl": "held-out split of " + str(cfg.data), **({"ppl_unseen": unseen} if unseen else {})},
              "teacher": {"ms": ref["ms"], "ppl": ref["ppl"], "ppl_unseen": ref["ppl_unseen"]},
              "answers": answers, "rows": sorted(rows, key=lambda r: r["ms"])}
    write_text(folder / SHIP_REPORT, markdown(result))
    plot(result, folder / SHIP_PLOT)
    return result


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1%}"


def markdown(r: dict) -> str:
    unseen = r["domains"].get("ppl_unseen")
    head = f"| tolerance | ship | decode vs the teacher's {r['precision']} | held-out ppl" + (
        f" | {unseen} ppl" if unseen else "") + " |"
    lines = [f"# Which folder to ship ({r['precision']})", "",
             f"The teacher's own {r['precision']} export (rounded by {r['teacher_scheme'] or 'nothing'}): "
             f"{r['teacher']['ms']:.2f} ms/token at batch 1, held-out perplexity {r['teacher']['ppl']:.2f}"
             + (f", {unseen} {r['teacher']['ppl_unseen']:.2f}" if unseen else "") + ". Tolerances are perplexity over "
             "it on every domain.", "", head, "|---|---|---|---|" + ("---|" if unseen else "")]
    for a in r["answers"]:
        ship = "**the teacher's own export**: nothing beats it" if a["teacher_own"] else a["what"]
        lines.append(f"| +{a['tolerance_percent']:g}% | {ship} | {a['speedup']:.2f}x | {_pct(a['ppl_vs_teacher'])} |"
                     + (f" {_pct(a.get('ppl_unseen_vs_teacher'))} |" if unseen else ""))
    lines += ["", "Every row, fastest first:", "", "| row | ms/token | decode vs teacher | held-out ppl |"
              + (f" {unseen} ppl |" if unseen else ""), "|---|---|---|---|" + ("---|" if unseen else "")]
    for row in r["rows"]:
        lines.append(f"| {row['shown']} | {row['ms']:.2f} | {row['speedup']:.2f}x | {row['ppl']:.2f} "
                     f"({_pct(row['ppl_vs_teacher'])}) |" + (
                         f" {row['ppl_unseen']:.2f} ({_pct(row['ppl_unseen_vs_teacher'])}) |" if unseen else ""))
    lines += ["", "Commands that rebuild each answer:", ""]
    answers: dict[str, list[str]] = {}  # one line per distinct answer, its tolerances together
    for a in r["answers"]:
        answers.setdefault(" && ".join(f"`{c}`" for c in a["commands"]), []).append(f"+{a['tolerance_percent']:g}%")
    lines += [f"- {', '.join(tolerances)}: {commands}" for commands, tolerances in answers.items()]
    return "\n".join(lines) + "\n"


def plot(r: dict, out: Path) -> None:
    """Perplexity over the teacher's export against decode speed-up over it, one panel per domain; the tolerance
    lines dotted, the teacher's row the origin of both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(r["domains"])
    fig, axes = plt.subplots(1, len(domains), figsize=(6 * len(domains), 4.4), squeeze=False)
    for ax, d in zip(axes[0], domains):
        shown = [row for row in r["rows"] if row[f"{d}_vs_teacher"] <= OFF_CHART]
        off = [row for row in r["rows"] if row[f"{d}_vs_teacher"] > OFF_CHART]
        for row in shown:
            kind = "s" if row["name"] == TEACHER else ("^" if row["name"].startswith("spec") else "o")
            y = 100 * row[f"{d}_vs_teacher"]
            ax.scatter(row["speedup"], y, marker=kind, s=40, zorder=3)
            ax.annotate(row["shown"].removesuffix(f"-{r['precision']}"), (row["speedup"], y), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
        for a in r["answers"]:
            ax.axhline(a["tolerance_percent"], color="#999999", lw=0.8, ls=":")
        ax.axvline(1.0, color="#999999", lw=0.8)
        ax.set_yscale("symlog", linthresh=10)
        ys = [100 * row[f"{d}_vs_teacher"] for row in shown]
        ax.set_ylim(bottom=min(-2.0, 1.5 * min(ys)), top=max(20.0, 1.5 * max(ys)))
        if off:
            ax.text(0.01, 0.99, "off the chart: " + ", ".join(
                f"{row['shown']} (+{row[f'{d}_vs_teacher']:.0%}, {row['speedup']:.2f}x)" for row in off),
                transform=ax.transAxes, fontsize=7, va="top")
        ax.set_xlabel(f"decode speed-up over the teacher's {r['precision']} export (batch 1)")
        ax.set_ylabel("perplexity over the teacher's export (%)")
        ax.set_title(r["domains"][d])
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
