"""``bdlora sweep``: the budget family (paper Table 1 / Figure 1) with everything else held fixed.

Each member (a baseline method, or ``budgeted`` at one F) goes through train -> compress -> eval -> bench inside
one sweep folder. Every stage writes its artefact atomically and is a step of the ledger ship keeps
(``pipeline.ledger``, ``DIR/steps.json``): kept on ``bdlora sweep --resume DIR`` only when its output is whole and
unchanged and nothing it read was made again; an interrupted training run continues from its latest checkpoint, so
a half-done family is finished without redoing finished work. The teacher is evaluated once as the reference
row.

    DIR/sweep.json                     options of the sweep (the resume contract)
    DIR/steps.json                     the ledger: each stage's settings, what it read and its output, by digest
    DIR/<member>/                      bdlora train run
    DIR/<member>.compressed/           bdlora compress output
    DIR/<member>.eval.json             bdlora eval of the compressed model (ppl + ICL probes)
    DIR/<member>.bench/                bdlora bench of the compressed model
    DIR/teacher.eval.json              the teacher, same data and probes
    DIR/sweep.md, sweep.json results   the paper-style table; pareto.png
    DIR/main.md, table9.md, icl.png    the paper's Table 5 layout, per-task ICL (Table 9) and Figure 2
    DIR/front.bench/, front.png        --front: the family and the teacher's exports on one quality/speed front

With ``--vary`` (bdlora.sweep.vary) every method runs at every grid point; members differing only in compress-time
thresholds share one training run (``DIR/<run>/``) and get their own ``<member>.compressed``, eval and bench.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from bdlora import SCHEMA_VERSION
from bdlora.base.argv import Invocation
from bdlora.base.errors import RunDirError, flag
from bdlora.base.io import read_json, write_json, write_text
from bdlora.base.method_table import method_of
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import BENCH, BENCH_JSON, COMPRESSED, EVAL, SWEEP_OPTIONS, BenchDir, ModelDir, RunDir, SweepDir
from bdlora.base.threads import flat
from bdlora.bench.config import BenchConfig
from bdlora.bench.run import run_bench
from bdlora.compress.oneshot import compress_one_shot
from bdlora.data.documents import BUILTIN
from bdlora.eval.evaluate import EvalConfig, evaluate_target
from bdlora.models import sources
from bdlora.models.load import load_model_folder
from bdlora.models.teacher import builtin_teacher_dir
from bdlora.pipeline.ledger import Ledger, Step, do_step
from bdlora.sweep.front import bench_front
from bdlora.sweep.options import Member, SweepConfig
from bdlora.sweep.paper import teacher_label, write_paper_outputs
from bdlora.sweep.report import icl_fields, markdown, member_row, plot_pareto
from bdlora.train.checkpoint import latest_checkpoint
from bdlora.train.compress_run import compress_run
from bdlora.train.loop import train


def run_sweep(opts: SweepConfig | None, sweep: SweepDir, reporter: Reporter = SILENT, resume: bool = False) -> dict:
    """Run (or finish) every member; returns the results document (also written as sweep.md / results.json)."""
    if resume:
        if not sweep.started():
            raise RunDirError(f"--resume {sweep.path}: not a sweep folder (no sweep.json)")
        opts = SweepConfig(**sweep.read(SWEEP_OPTIONS)["options"])
    else:
        opts.validate()
        sweep.path.mkdir(parents=True, exist_ok=True)
        write_json(sweep.path / SWEEP_OPTIONS, {"schema_version": SCHEMA_VERSION, "options": dataclasses.asdict(opts)})
    members = opts.members()
    ledger = Ledger.open(sweep.path, opts.teacher)
    rows = []
    for i, m in enumerate(members, 1):
        reporter.stage(f"[{i}/{len(members)}] {m.name}")
        rows.append(_run_member(m, opts, sweep, ledger, reporter))
    teacher_row = _eval_teacher(opts, sweep, rows, reporter, ledger)
    doc = {"schema_version": SCHEMA_VERSION, "sweep_dir": str(sweep.path), "options": dataclasses.asdict(opts),
           "teacher": teacher_row, "members": rows}
    if opts.front and rows:
        peer = {r["name"]: method_of(r.get("method")).peer for r in rows}
        doc["front"] = bench_front(opts, sweep, [n for n, p in peer.items() if not p], ledger, reporter,
                                   peers=[n for n, p in peer.items() if p])
    write_text(sweep.path / "sweep.md", markdown(doc))
    plot_pareto(doc, sweep.path / "pareto.png")
    write_paper_outputs([(teacher_label(doc), doc)], sweep.path)
    write_json(sweep.path / SweepDir.MARKER, doc)
    return doc


class _Indented:
    """A reporter showing the member's own stages indented under its header line; every other hook passes
    through to the sweep's reporter."""

    def __init__(self, reporter: Reporter):
        self.r = reporter

    def stage(self, message: str) -> None:
        self.r.stage("  " + message)

    def __getattr__(self, name):
        return getattr(self.r, name)


def _run_member(m: Member, opts: SweepConfig, sweep: SweepDir, ledger: Ledger, reporter: Reporter) -> dict:
    """Produce the member's compressed folder (trained and compressed, or compressed in one shot), then evaluate it
    the one way every member is evaluated; each step is kept when the ledger can trust its output (resume)."""
    rep = _Indented(reporter)
    produce = _one_shot_member if m.method == "one-shot" else _trained_member
    model_dir, summary, lora_rank, made = produce(m, opts, sweep, ledger, rep)
    eval_step = Step(f"{m.name}{EVAL}", Invocation(("eval",), {
        "model_dir": str(model_dir.path), "examples": opts.eval_examples, "seeds": opts.eval_seeds}), EVAL, "eval",
        (made,))
    do_step(ledger, eval_step, rep, lambda: write_json(sweep.path / eval_step.out, evaluate_target(
        model_dir.path, EvalConfig(examples=opts.eval_examples, seeds=opts.eval_seeds), reporter=rep)))
    bench = _bench_member(m, opts, sweep, ledger, model_dir, lora_rank, made, rep) if opts.bench else None
    return member_row(m, summary, model_dir.report(), read_json(sweep.path / eval_step.out), bench)


def _trained_member(m: Member, opts: SweepConfig, sweep: SweepDir, ledger: Ledger, rep: Reporter):
    """(compressed folder, training summary, LoRA rank, its step) of a member that trains: train (or continue from
    its latest checkpoint), compress."""
    run = sweep.member(m.run)
    cfg = opts.train_config(m, out=str(run.path))
    train_step = Step(m.run, Invocation(("train",), flat(cfg)), RunDir.MARKER, f"train ({run.path})")

    def resumable() -> bool:  # an interrupted run continues from its latest checkpoint
        return run.started() and latest_checkpoint(run.path) is not None

    def trained() -> None:
        if resumable():
            train(None, rep, resume=run.path)
        else:
            train(cfg, rep)

    do_step(ledger, train_step, rep, trained, resumable)
    model_dir = ModelDir(sweep.path / f"{m.name}{COMPRESSED}")
    thresholds = opts.thresholds(m, run.config().get("eps_zero"))
    step = Step(model_dir.path.name, Invocation(("compress",), {"run_dir": str(run.path), **flat(thresholds)}),
                ModelDir.MARKER, "compress", (m.run,))
    do_step(ledger, step, rep, lambda: compress_run(run, thresholds, out=model_dir.path, reporter=rep))
    return model_dir, run.summary(), run.config()["lora_rank"], step.name


def _one_shot_member(m: Member, opts: SweepConfig, sweep: SweepDir, ledger: Ledger, rep: Reporter):
    """(compressed folder, summary, LoRA rank, its step) of a member without training: the teacher compressed by
    ``compress --one-shot`` to the member's ratio."""
    model_dir = ModelDir(sweep.path / f"{m.name}{COMPRESSED}")
    cache = Path(opts.train["cache_dir"]).expanduser() if opts.train.get("cache_dir") else None
    shot = opts.one_shot_config(m)
    step = Step(model_dir.path.name, Invocation(("compress",), {"run_dir": opts.teacher, "one_shot": True,
                                                                **flat(shot)}), ModelDir.MARKER, "compress --one-shot")
    do_step(ledger, step, rep, lambda: compress_one_shot(opts.teacher, shot, model_dir.path, cache_dir=cache,
                                                         reporter=rep))
    rank = opts.lora_rank(m)
    summary = {"student_val_ppl": model_dir.report()["eval"]["student_val_ppl"], "train_seconds": 0.0}  # no training
    return model_dir, summary, rank, step.name


def _bench_member(m: Member, opts: SweepConfig, sweep: SweepDir, ledger: Ledger, model_dir: ModelDir,
                  lora_rank: int, made: str, rep: Reporter) -> dict:
    bench_dir = sweep.path / f"{m.name}{BENCH}"
    bcfg = BenchConfig(scope="both", batch_sizes=opts.bench_batch_sizes, seq_lens=opts.bench_seq_lens,
                       decode_tokens=opts.bench_decode_tokens, repeats=opts.bench_repeats, warmup=1)
    step = Step(bench_dir.name, Invocation(("bench",), {"model_dir": str(model_dir.path), **flat(bcfg)}),
                BENCH_JSON, "bench", (made,))

    def benched() -> None:
        model, _, report = load_model_folder(model_dir.path)
        run_bench(model, lora_rank, bcfg, bench_dir, report, reporter=rep)

    do_step(ledger, step, rep, benched)
    return read_json(bench_dir / BenchDir.MARKER)


def _eval_teacher(opts: SweepConfig, sweep: SweepDir, rows: list[dict], reporter: Reporter,
                  ledger: Ledger | None = None) -> dict | None:
    """The teacher's reference row, and (when the students were initialised from another checkpoint) the
    init model's: the paper's Figure 2 draws its dashed line at the init model, not the teacher."""
    if not rows:
        return None
    trained = [r for r in rows if r.get("method") != "one-shot"]
    if trained:
        cfg = sweep.member(trained[0].get("run", trained[0]["name"])).config()
    else:  # one-shot members only: the slice they were measured on
        cfg = ModelDir(sweep.path / f"{rows[0]['name']}{COMPRESSED}").report()["provenance"]["data_settings"]
    ledger = ledger or Ledger.open(sweep.path, opts.teacher)
    ref = _eval_reference(cfg["teacher"], "teacher", cfg, opts, sweep, ledger, reporter)
    init = cfg.get("student_init")
    if init and init != cfg["teacher"]:
        ref["student_init"] = {**_eval_reference(init, "student_init", cfg, opts, sweep, ledger, reporter),
                               "source": init}
    return ref


def _eval_reference(spec: str, name: str, cfg: dict, opts: SweepConfig, sweep: SweepDir, ledger: Ledger,
                    reporter: Reporter) -> dict:
    ecfg = EvalConfig(examples=opts.eval_examples, seeds=opts.eval_seeds, data=cfg["data"], seq_len=cfg["seq_len"],
                      tokens=cfg["eval_tokens"], heldout_fraction=cfg["heldout_fraction"])
    step = Step(f"{name}{EVAL}", Invocation(("eval",), {"model_dir": spec, **flat(ecfg)}), EVAL, f"{name}: eval")

    def evaluated() -> None:
        cache = Path(cfg["cache_dir"]).expanduser() if cfg.get("cache_dir") else None
        folder = builtin_teacher_dir(cache) if spec == BUILTIN else Path(sources.resolve(spec, cache, flag(name)))
        reporter.stage(f"{name}: eval of {folder}")
        write_json(sweep.path / step.out, evaluate_target(folder, ecfg))

    do_step(ledger, step, reporter, evaluated)
    ev = read_json(sweep.path / step.out)
    return {"val_ppl": ev["ppl"]["val_ppl"], **icl_fields(ev)}
