"""The answer of ``bdlora ship``: from its bench's front (every folder, the teacher's export and the teacher
speculating with prompt lookup and with the draft, each timed in one run and scored on both domains; with llama.cpp,
every folder's GGUF and the teacher's beside them), for each perplexity tolerance over the teacher's export the
fastest row within it on *every* domain, the commands that rebuild it, and "the teacher's own export" when nothing
beats it; recommendation.md and ship.png beside.

With llama.cpp rows the answer is given per runtime (in onnxruntime-genai against the teacher's genai export, in
llama.cpp against the teacher's GGUF of the same type), and overall: against the teacher's fastest export in either
runtime (what a user would deploy without bdlora), the fastest row within the tolerance, its runtime named."""

from __future__ import annotations

import shlex
from pathlib import Path

from bdlora.base.argv import Invocation, option_values, shown
from bdlora.base.io import atomic_path, write_text
from bdlora.base.runs import BENCH_JSON, GGUF, MODEL_GGUF, SHIP_PLOT, SHIP_REPORT, BenchDir
from bdlora.bench.front import RUNTIME_NAMES, precision_of, runtime_of
from bdlora.export.settings import GenaiExportConfig, GgufExportConfig

TEACHER, LOOKUP, SPEC_DRAFT, PEER = "teacher", "spec-lookup", "spec-draft", "peer-"
BENCH = "bench"  # the ship step (and folder) that benches every folder
OFF_CHART = 10.0  # rows over 11x the teacher's perplexity are named on the picture, not plotted
OWN_FORMS = ("dense", "lora")  # the bench's own model's dense and LoRA forms: measured, never recommended


def _source(row: str, precision: str) -> str | None:
    """The front row's name without its precision suffix (None: a row of another precision)."""
    suffix = f"-{precision}"
    return row[: -len(suffix)] if row.endswith(suffix) else None


def exported(folder: Path, name: str, precision: str) -> Path:
    """Where the rebuild commands put a folder's genai export (a GGUF precision: its ``export gguf`` folder)."""
    if precision.startswith(GGUF):
        return folder / f"{name}.{precision}"
    return folder / f"{name}.genai-{precision}"


def _gguf(source: str | Path, out: Path, precision: str) -> Invocation:
    return Invocation(("export", "gguf"), {
        "model_dir": str(source), **option_values(GgufExportConfig, quant=precision.removeprefix(GGUF),
                                                  merge_lowrank=True), "out_dir": str(out)})


def _exported(folder: Path, name: str, cfg, quant: str | None) -> Invocation:
    return Invocation(("export", "genai"), {
        "model_dir": str(folder / name), **option_values(GenaiExportConfig, precision=cfg.precision, quant=quant),
        "out_dir": str(exported(folder, name, cfg.precision))})


def _served(export: str, **speculation) -> Invocation:
    """``bdlora serve`` of a genai folder, ``speculation`` its speculative options (prompt_lookup, draft)."""
    return Invocation(("serve",), {"onnx_dir": export, "runtime": "genai", **speculation})


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
                 quant: str | None, spell, identical: bool | None = None, export: str = "", gguf: str | None = None,
                 teacher_dir: str | Path | None = None) -> tuple[str, list[str]]:
    """(what ships, the commands that rebuild it) of a front row named ``name`` (without its precision);
    ``teacher``: the command that writes the teacher's export, into folder ``export``; ``spell``: a bdlora
    ``Invocation`` as the line a person types; ``identical``: a speculative row's tokens against plain decoding, as
    benched; ``gguf`` (a llama.cpp row's precision, gguf-q4_k_m): the file ``export gguf`` writes, run in llama.cpp
    (``teacher_dir``: the teacher's folder)."""
    export = str(export)

    def line(inv: Invocation) -> str:
        return shown(inv, spell)

    if gguf is not None:
        own = {TEACHER: None, "compressed": bench_model}.get(name, name.removeprefix(PEER))
        made = (own or "").removeprefix("healed-")
        steps = [commands[s] for s in dict.fromkeys((made, f"heal-{made}", own)) if own and s in commands]
        out = exported(folder, own or TEACHER, gguf)
        serve = f"python -m llama_cpp.server --model {shlex.quote(str(out / MODEL_GGUF))}"
        what = "the teacher's own GGUF" if own is None else (
            f"the dense teacher healed as the students were ({own})" if name.startswith(PEER) else own)
        return f"{what} in llama.cpp ({gguf.removeprefix(GGUF).upper()})", [
            *steps, line(_gguf(teacher_dir if own is None else folder / own, out, gguf)), serve]
    if name == TEACHER:
        return "the teacher's own export", [teacher]
    if name == LOOKUP:
        return f"the teacher's export, speculating with prompt lookup ({verified(identical)})", [
            teacher, line(_served(export, prompt_lookup=True))]
    own = bench_model if name == "compressed" else name.removeprefix(PEER)
    made = own.removeprefix("healed-")  # the folder a healed one started from (itself when not healed)
    steps = [commands[s] for s in dict.fromkeys((made, f"heal-{made}", own)) if s in commands]
    if name == SPEC_DRAFT:
        return f"the teacher's export with the draft ({verified(identical)})", [
            teacher, *steps, line(_exported(folder, own, cfg, quant)),
            line(_served(export, draft=str(exported(folder, own, cfg.precision))))]
    what = f"the dense teacher healed as the students were ({own})" if name.startswith(PEER) else own
    return what, [*steps, line(_exported(folder, own, cfg, quant))]


def _rows(bench: dict, bench_model: str, precision: str) -> list[dict]:
    """The front's rows at ``precision`` (genai) or at the GGUF type of its llama.cpp rows, each with its runtime
    and name without the precision; the bench model's own dense and LoRA forms left out."""
    rows = []
    for r in bench["front"]:
        runtime = runtime_of(r["name"])
        prec = precision if runtime == "genai" else precision_of(r["name"])
        name = _source(r["name"], prec)
        if name is None or name in OWN_FORMS:
            continue
        shown = f"{bench_model}-{prec}" if name == "compressed" else r["name"]  # the folder's own name
        rows.append({"row": r["name"], "shown": shown, "name": name, "runtime": runtime, "precision": prec,
                     "ms": r["ms"], "ppl": r["ppl"], "ppl_unseen": r.get("ppl_unseen")})
    return rows


def _answers(rows: list[dict], ref: dict, domains: list[str], tolerances: list[float], mark: str) -> list[dict]:
    """Per tolerance, the fastest of ``rows`` within it of ``ref`` on every domain (``mark``: the fields of that
    comparison, "" against the row's own runtime's teacher, "_overall" against the fastest teacher)."""
    answers = []
    for t in tolerances:
        within = [r for r in rows if all(r[f"{d}_vs_teacher{mark}"] is not None
                                         and r[f"{d}_vs_teacher{mark}"] <= t / 100 + 1e-9 for d in domains)]
        best = min(within or [ref], key=lambda r: (r["ms"], r["name"] != TEACHER, r["runtime"] != ref["runtime"]))
        answers.append({"tolerance_percent": t, "row": best["row"], "runtime": best["runtime"], "what": best["what"],
                        "speedup": ref["ms"] / best["ms"],
                        **{f"{d}_vs_teacher": best[f"{d}_vs_teacher{mark}"] for d in domains},
                        "teacher_own": best["name"] == TEACHER, "commands": best["commands"]})
    return answers


def recommend(folder: Path, cfg, commands: dict[str, str], teacher_quant: str | None, scheme_ppl: dict[str, float],
              teacher: str, teacher_out: str | Path, teacher_dir: str | Path | None, spell, bench_model: str) -> dict:
    """The answers and every row (``commands``: each step's command line by name; ``bench_model``: the name of the
    folder the bench step benched, whose rows are named "compressed"; ``teacher``: the command that
    exports the teacher's row, into ``teacher_out``; ``teacher_dir``: the teacher's folder, which llama.cpp's row is
    exported from; ``spell``: an ``Invocation`` as its command line), written to recommendation.md and ship.png;
    returned for recommendation.json."""
    bench = BenchDir(folder / BENCH).report()
    rows = _rows(bench, bench_model, cfg.precision)
    refs = {r["runtime"]: r for r in rows if r["name"] == TEACHER}
    if "genai" not in refs:
        raise ValueError(f"{folder / BENCH / BENCH_JSON}: no teacher-{cfg.precision} row to compare with")
    rows = [r for r in rows if r["runtime"] in refs]  # a runtime without the teacher's row has nothing to beat
    ref, overall = refs["genai"], min(refs.values(), key=lambda r: (r["ms"], r["runtime"] != "genai"))
    domains = ["ppl"] + (["ppl_unseen"] if ref["ppl_unseen"] is not None else [])
    spec = ((bench.get("speculative") or {}).get(cfg.precision) or {}).get("summary") or {}
    for r in rows:
        own = refs[r["runtime"]]
        r["speedup"], r["speedup_overall"] = own["ms"] / r["ms"], overall["ms"] / r["ms"]
        if r["name"] in (LOOKUP, SPEC_DRAFT):  # the bench's speculative configurations: "lookup", "draft"
            r["identical"] = (spec.get(r["name"].removeprefix("spec-")) or {}).get("identical")
        for d in domains:
            r[f"{d}_vs_teacher"] = r[d] / own[d] - 1 if r[d] is not None and own[d] else None
            r[f"{d}_vs_teacher_overall"] = r[d] / overall[d] - 1 if r[d] is not None and overall[d] else None
        r["what"], r["commands"] = row_commands(
            r["name"], bench_model, folder, cfg, commands, teacher, cfg.student_quant or teacher_quant, spell,
            r.get("identical"), teacher_out, r["precision"] if r["runtime"] == "llamacpp" else None, teacher_dir)
    tolerances = cfg.tolerance_list()
    unseen = bench.get("unseen_data")
    by_runtime = {rt: {"teacher": {"row": own["row"], "ms": own["ms"], "ppl": own["ppl"],
                                   "ppl_unseen": own["ppl_unseen"]},
                       "answers": _answers([r for r in rows if r["runtime"] == rt], own, domains, tolerances, "")}
                  for rt, own in refs.items()}
    result = {"precision": cfg.precision, "teacher_scheme": teacher_quant, "teacher_scheme_ppl": scheme_ppl,
              "domains": {"ppl": "held-out split of " + str(cfg.data), **({"ppl_unseen": unseen} if unseen else {})},
              "teacher": {"ms": ref["ms"], "ppl": ref["ppl"], "ppl_unseen": ref["ppl_unseen"]},
              "reference": {"row": overall["row"], "runtime": overall["runtime"], "ms": overall["ms"],
                            "ppl": overall["ppl"], "ppl_unseen": overall["ppl_unseen"]},
              "answers": _answers(rows, overall, domains, tolerances, "_overall"),
              "rows": sorted(rows, key=lambda r: r["ms"])}
    if len(refs) > 1:
        result["by_runtime"] = by_runtime
    write_text(folder / SHIP_REPORT, markdown(result))
    plot(result, folder / SHIP_PLOT)
    return result


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1%}"


def _answer_lines(answers: list[dict], unseen: str | None, runtimes: bool, against: str) -> list[str]:
    head = f"| tolerance | ship |{' runtime |' if runtimes else ''} decode vs {against} | held-out ppl" + (
        f" | {unseen} ppl" if unseen else "") + " |"
    lines = [head, "|---|---|" + ("---|" if runtimes else "") + "---|---|" + ("---|" if unseen else "")]
    for a in answers:
        ship = "**the teacher's own export**: nothing beats it" if a["teacher_own"] else a["what"]
        lines.append(f"| +{a['tolerance_percent']:g}% | {ship} |"
                     + (f" {RUNTIME_NAMES[a['runtime']]} |" if runtimes else "")
                     + f" {a['speedup']:.2f}x | {_pct(a['ppl_vs_teacher'])} |"
                     + (f" {_pct(a.get('ppl_unseen_vs_teacher'))} |" if unseen else ""))
    return lines


def markdown(r: dict) -> str:
    unseen = r["domains"].get("ppl_unseen")
    runtimes = "by_runtime" in r
    ref = r["reference"]
    lines = [f"# Which folder to ship ({r['precision']})", "",
             f"The teacher's own {r['precision']} export (rounded by {r['teacher_scheme'] or 'nothing'}): "
             f"{r['teacher']['ms']:.2f} ms/token at batch 1, held-out perplexity {r['teacher']['ppl']:.2f}"
             + (f", {unseen} {r['teacher']['ppl_unseen']:.2f}" if unseen else "") + ". " + (
                 f"Its fastest export in any runtime is {ref['row']} in {RUNTIME_NAMES[ref['runtime']]} "
                 f"({ref['ms']:.2f} ms/token, perplexity {ref['ppl']:.2f}): the answers below are against it, with "
                 "perplexity tolerances over it on every domain, and then per runtime against the teacher in that "
                 "runtime." if runtimes else "Tolerances are perplexity over it on every domain.")]
    lines += [""] + _answer_lines(r["answers"], unseen, runtimes, f"the teacher's {ref['row']}")
    for rt, part in (r.get("by_runtime") or {}).items():
        lines += ["", f"In {RUNTIME_NAMES[rt]}, against the teacher's {part['teacher']['row']} "
                      f"({part['teacher']['ms']:.2f} ms/token):", ""]
        lines += _answer_lines(part["answers"], unseen, False, f"the teacher's {part['teacher']['row']}")
    lines += ["", "Every row, fastest first (each against the teacher in its own runtime):", "",
              "| row |" + (" runtime |" if runtimes else "") + " ms/token | decode vs teacher | held-out ppl |"
              + (f" {unseen} ppl |" if unseen else ""),
              "|---|" + ("---|" if runtimes else "") + "---|---|---|" + ("---|" if unseen else "")]
    for row in r["rows"]:
        lines.append(f"| {row['shown']} |" + (f" {RUNTIME_NAMES[row['runtime']]} |" if runtimes else "")
                     + f" {row['ms']:.2f} | {row['speedup']:.2f}x | {row['ppl']:.2f} "
                     f"({_pct(row['ppl_vs_teacher'])}) |" + (
                         f" {row['ppl_unseen']:.2f} ({_pct(row['ppl_unseen_vs_teacher'])}) |" if unseen else ""))
    lines += ["", "Commands that rebuild each answer:", ""]
    answers: dict[str, list[str]] = {}  # one line per distinct answer, its tolerances together
    every = r["answers"] + [a for part in (r.get("by_runtime") or {}).values() for a in part["answers"]]
    for a in every:
        tags = answers.setdefault(" && ".join(f"`{c}`" for c in a["commands"]), [])
        if f"+{a['tolerance_percent']:g}%" not in tags:
            tags.append(f"+{a['tolerance_percent']:g}%")
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
        vs = f"{d}_vs_teacher_overall"  # against the teacher's fastest export (the genai one without llama.cpp rows)
        shown = [row for row in r["rows"] if row[vs] <= OFF_CHART]
        off = [row for row in r["rows"] if row[vs] > OFF_CHART]
        for row in shown:
            kind = "s" if row["name"] == TEACHER else ("^" if row["name"].startswith("spec") else "o")
            y = 100 * row[vs]
            ax.scatter(row["speedup_overall"], y, marker=kind, s=40, zorder=3,
                       color="#ff7f0e" if row["runtime"] == "llamacpp" else "#1f77b4")
            ax.annotate(row["shown"].removesuffix(f"-{r['precision']}"), (row["speedup_overall"], y), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
        for a in r["answers"]:
            ax.axhline(a["tolerance_percent"], color="#999999", lw=0.8, ls=":")
        ax.axvline(1.0, color="#999999", lw=0.8)
        ax.set_yscale("symlog", linthresh=10)
        ys = [100 * row[vs] for row in shown]
        ax.set_ylim(bottom=min(-2.0, 1.5 * min(ys)), top=max(20.0, 1.5 * max(ys)))
        if off:
            ax.text(0.01, 0.99, "off the chart: " + ", ".join(
                f"{row['shown']} (+{row[vs]:.0%}, {row['speedup_overall']:.2f}x)" for row in off),
                transform=ax.transAxes, fontsize=7, va="top")
        ax.set_xlabel(f"decode speed-up over the teacher's {r['reference']['row']} (batch 1"
                      + ("; orange: llama.cpp" if "by_runtime" in r else "") + ")")
        ax.set_ylabel("perplexity over the teacher's export (%)")
        ax.set_title(r["domains"][d])
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
