"""``bdlora sweep``: the budget family (paper Table 1 / Figure 1) with everything else held fixed.

Each member (a baseline method, or ``budgeted`` at one F) goes through train -> compress -> eval -> bench inside
one sweep folder. Every stage writes its artefact atomically and is skipped when that artefact exists, and an
interrupted training run continues from its latest checkpoint, so re-running ``bdlora sweep --resume DIR``
finishes a half-done family without redoing finished work. The teacher is evaluated once as the reference row.

    DIR/sweep.json                     options of the sweep (the resume contract)
    DIR/<member>/                      bdlora train run
    DIR/<member>.compressed/           bdlora compress output
    DIR/<member>.eval.json             bdlora eval of the compressed model (ppl + ICL probes)
    DIR/<member>.bench/                bdlora bench of the compressed model
    DIR/teacher.eval.json              the teacher, same data and probes
    DIR/sweep.md, sweep.json results   the paper-style table; pareto.png
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bdlora.config import TrainConfig
from bdlora.errors import RunDirError, UsageError

BASELINES = ("kd-full", "kd-lora")


@dataclass(frozen=True)
class Member:
    name: str
    method: str
    budget: float | None


def family(budgets: list[float], baselines: list[str]) -> list[Member]:
    bad = [b for b in baselines if b not in BASELINES]
    if bad:
        raise UsageError(f"--baselines {','.join(bad)}: unknown (allowed: {', '.join(BASELINES)}, or none)")
    bad_f = [f for f in budgets if not 0.0 <= f <= 1.0]
    if bad_f:
        raise UsageError(f"--budgets {bad_f[0]}: a budget F must be in [0, 1]")
    if len(set(budgets)) != len(budgets):
        raise UsageError(f"--budgets {','.join(map(str, budgets))}: each budget once")
    members = [Member(b, b, None) for b in dict.fromkeys(baselines)]
    members += [Member(f"budgeted-F{f:g}", "budgeted", f) for f in budgets]
    if not members:
        raise UsageError("--budgets and --baselines are both empty: nothing to sweep")
    return members


@dataclass
class SweepOptions:
    budgets: list[float]
    baselines: list[str]
    train: dict  # TrainConfig fields shared by every member (method/budget/out set per member)
    eps_lr: float = 0.7
    eval_examples: int = 50
    eval_seeds: int = 3
    bench: bool = True
    bench_batch_sizes: list[int] = dataclasses.field(default_factory=lambda: [1])
    bench_seq_lens: list[int] = dataclasses.field(default_factory=lambda: [128])
    bench_repeats: int = 20
    bench_decode_tokens: int = 32


def new_sweep_dir(runs_dir: str, out: str | None) -> Path:
    if out:
        p = Path(out)
        if p.exists() and any(p.iterdir()):
            raise UsageError(f"--out {p}: exists and is not empty (choose a new folder, or --resume it)")
        return p
    return Path(runs_dir) / f"sweep-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def run_sweep(opts: SweepOptions, sweep_dir: Path, reporter=None, resume: bool = False) -> dict:
    """Run (or finish) every member; returns the results document (also written as sweep.md / results.json)."""
    from bdlora.io import read_json, write_json

    sweep_dir = Path(sweep_dir)
    if resume:
        if not (sweep_dir / "sweep.json").exists():
            raise RunDirError(f"--resume {sweep_dir}: not a sweep folder (no sweep.json)")
        stored = read_json(sweep_dir / "sweep.json")["options"]
        opts = SweepOptions(**stored)
    else:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        write_json(sweep_dir / "sweep.json", {"schema_version": 1, "options": dataclasses.asdict(opts)})
    members = family(opts.budgets, opts.baselines)
    stage = reporter.stage if reporter is not None else (lambda s: None)
    rows = []
    for i, m in enumerate(members, 1):
        stage(f"[{i}/{len(members)}] {m.name}")
        rows.append(_run_member(m, opts, sweep_dir, reporter))
    teacher_row = _eval_teacher(opts, sweep_dir, rows, stage)
    doc = {"schema_version": 1, "sweep_dir": str(sweep_dir), "options": dataclasses.asdict(opts),
           "teacher": teacher_row, "members": rows}
    write_json(sweep_dir / "results.json", doc)
    from bdlora.io import write_text

    write_text(sweep_dir / "sweep.md", markdown(doc))
    plot_pareto(doc, sweep_dir / "pareto.png")
    return doc


def _member_config(m: Member, opts: SweepOptions, run_dir: Path) -> TrainConfig:
    values = {k: v for k, v in opts.train.items() if k in TrainConfig.__dataclass_fields__ and k != "extra"}
    values.update(method=m.method, out=str(run_dir))
    if m.budget is not None:
        values["budget"] = m.budget
    return TrainConfig(**values)


def _run_member(m: Member, opts: SweepOptions, sweep_dir: Path, reporter) -> dict:
    from bdlora.compress import Thresholds, compress_run
    from bdlora.evaluate import evaluate_target
    from bdlora.io import read_json, write_json
    from bdlora.train import is_run_dir, latest_checkpoint, train

    stage = reporter.stage if reporter is not None else (lambda s: None)
    run_dir = sweep_dir / m.name
    if is_run_dir(run_dir):
        stage(f"  train: done ({run_dir})")
    elif run_dir.exists() and (run_dir / "config.json").exists() and latest_checkpoint(run_dir) is not None:
        train(TrainConfig(), reporter, resume=run_dir)
    else:
        if run_dir.exists():  # started but no checkpoint yet: nothing to keep, start the member again
            shutil.rmtree(run_dir)
        train(_member_config(m, opts, run_dir), reporter)
    summary = read_json(run_dir / "summary.json")
    cfg = read_json(run_dir / "config.json")["config"]

    comp_dir = sweep_dir / f"{m.name}.compressed"
    if (comp_dir / "compression.json").exists():
        stage("  compress: done")
    else:
        compress_run(run_dir, Thresholds(eps_lr=opts.eps_lr), out=comp_dir, force=comp_dir.exists(),
                     on_stage=lambda s: stage("  " + s))
    report = read_json(comp_dir / "compression.json")

    eval_path = sweep_dir / f"{m.name}.eval.json"
    if eval_path.exists():
        stage("  eval: done")
    else:
        doc = evaluate_target(comp_dir, examples=opts.eval_examples, seeds=opts.eval_seeds,
                              on_stage=lambda s: stage("  " + s),
                              on_progress=getattr(reporter, "count", None))
        write_json(eval_path, doc)
    ev = read_json(eval_path)

    bench = None
    if opts.bench:
        bench_dir = sweep_dir / f"{m.name}.bench"
        if (bench_dir / "bench.json").exists():
            stage("  bench: done")
        else:
            from bdlora.bench import BenchConfig, run_bench
            from bdlora.export.onnx import load_model_folder

            if bench_dir.exists():
                shutil.rmtree(bench_dir)
            model, _, rep = load_model_folder(comp_dir)
            bcfg = BenchConfig(scope="both", batch_sizes=opts.bench_batch_sizes, seq_lens=opts.bench_seq_lens,
                               decode_tokens=opts.bench_decode_tokens, repeats=opts.bench_repeats, warmup=1)
            run_bench(model, cfg["lora_rank"], bcfg, bench_dir, rep, on_stage=lambda s: stage("  " + s))
        bench = read_json(bench_dir / "bench.json")
    return member_row(m, summary, report, ev, bench)


def _proxy(method: str, summary: dict) -> float:
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


def member_row(m: Member, summary: dict, report: dict, ev: dict, bench: dict | None) -> dict:
    return {
        "name": m.name, "method": m.method, "budget": m.budget,
        "student_val_ppl": summary["student_val_ppl"], "val_ppl": ev["ppl"]["val_ppl"],
        "train_compute_proxy": _proxy(m.method, summary),
        "mac_speedup_vs_dense": report["speedup_vs_dense"], "mac_speedup_vs_lora": report["speedup_vs_lora"],
        "param_reduction": report["param_reduction"],
        "dense_kept": report["dense_kept"], "dense_svd": report["dense_svd"], "dense_dropped": report["dense_dropped"],
        "icl_composite": ev["icl"]["macro"]["mean"], "icl_composite_std": ev["icl"]["macro"]["std"],
        "icl_target_logprob": ev["icl"]["macro"]["target_logprob"],
        "measured": _measured(bench), "train_seconds": summary["train_seconds"],
    }


def _eval_teacher(opts: SweepOptions, sweep_dir: Path, rows: list[dict], stage) -> dict | None:
    from bdlora.evaluate import evaluate_target
    from bdlora.io import read_json, write_json
    from bdlora.teacher import builtin_teacher_dir

    path = sweep_dir / "teacher.eval.json"
    if not path.exists():
        if not rows:
            return None
        cfg = read_json(sweep_dir / rows[0]["name"] / "config.json")["config"]
        tdir = builtin_teacher_dir(Path(cfg["cache_dir"]).expanduser() if cfg.get("cache_dir") else None) \
            if cfg["teacher"] == "builtin" else Path(cfg["teacher"])
        stage(f"teacher: eval of {tdir}")
        doc = evaluate_target(tdir, examples=opts.eval_examples, seeds=opts.eval_seeds, data=cfg["data"],
                              seq_len=cfg["seq_len"], tokens=cfg["eval_tokens"],
                              heldout_fraction=cfg["heldout_fraction"])
        write_json(path, doc)
    ev = read_json(path)
    return {"val_ppl": ev["ppl"]["val_ppl"], "icl_composite": ev["icl"]["macro"]["mean"],
            "icl_composite_std": ev["icl"]["macro"]["std"],
            "icl_target_logprob": ev["icl"]["macro"]["target_logprob"]}


def _fmt_measured(row: dict, key: str) -> str:
    r = row["measured"].get(key)
    return f"{r['speedup_vs_dense']:.2f}x" if r else "-"


def markdown(doc: dict) -> str:
    head = ("| member | ppl (compressed) | train compute (proxy, x kd-full) | MAC speed-up vs dense | measured "
            "modules prefill | measured model decode | param reduction | dense kept/SVD/dropped | ICL composite % "
            "| ICL log p(target) |")
    lines = ["# bdlora sweep", "", head, "|" + "---|" * 10]
    t = doc.get("teacher")
    if t:
        lines.append(f"| teacher | {t['val_ppl']:.2f} | - | - | - | - | - | - | {t['icl_composite']:.1f} ± "
                     f"{t['icl_composite_std']:.1f} | {t['icl_target_logprob']:.2f} |")
    for r in doc["members"]:
        lines.append(
            f"| {r['name']} | {r['val_ppl']:.2f} | {r['train_compute_proxy']:.3f} | "
            f"{r['mac_speedup_vs_dense']:.2f}x | "
            f"{_fmt_measured(r, 'modules_prefill')} | {_fmt_measured(r, 'model_decode')} | "
            f"{100 * r['param_reduction']:.1f}% | {r['dense_kept']}/{r['dense_svd']}/{r['dense_dropped']} | "
            f"{r['icl_composite']:.1f} ± {r['icl_composite_std']:.1f} | {r['icl_target_logprob']:.2f} |")
    lines += ["", "ppl: held-out perplexity of the compressed (deployed) model. Measured speed-ups: compressed vs "
              "dense under onnxruntime (bench.json of each member; smallest batch and length). Train compute: the "
              "SPEC 5 proxy. MAC speed-up and parameter reduction: of the replaced projections, against the trained "
              "module (dense + LoRA path; paper Table 5). ICL: 19 probes, exact match, mean ± std over demonstration "
              "seeds; log p(target) is the teacher-forced log-probability of the answer (nats).", ""]
    return "\n".join(lines)


def plot_pareto(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bdlora.io import atomic_path

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


__all__ = ["BASELINES", "Member", "SweepOptions", "family", "run_sweep"]
