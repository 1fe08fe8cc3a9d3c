"""``bdlora ship MODEL --out DIR``: every step that answers "which folder should I ship?", each one bdlora command
run as its own process (its memory returned when it ends, its output and log kept), skipped when its output is
already whole, so running the same command again resumes instead of redoing:

    DIR/ship.json                 the model and options (the resume contract)
    DIR/teacher-SCHEME/           export genai of the teacher at --precision, one per --schemes (the lowest held-out
                                  perplexity is the teacher's row)
    DIR/student-S/                compress --one-shot --forms F --precision P --speedup S, one per --speedups
    DIR/draft/                    the teacher's draft (--forms layers,channels,vocab --speedup --draft-speedup)
    DIR/heal-NAME/, healed-NAME/  with --heal-steps (or --heal-time-budget): train --student-init NAME, then
                                  compress (and heal-dense/: the teacher healed with the same data and steps, the
                                  fair peer; under a time budget, the most steps any candidate took)
    DIR/bench/                    bench --runtime genai: every folder, the teacher's export, prompt lookup and the
                                  draft speculating for the teacher, on both domains, in one run
    DIR/settings/STEP.json        each step's command and settings (``base.argv.Invocation``), which it reads with
                                  --settings-file: ship spells no other command's flags
    DIR/logs/STEP.log             each step's whole output
    DIR/recommendation.{md,json}, DIR/ship.png   written last (``bdlora.ship.recommend``)
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from bdlora import SCHEMA_VERSION
from bdlora.base.argv import Invocation, Spell, option_values, shown
from bdlora.base.errors import BdloraError, UsageError
from bdlora.base.io import read_json, write_json
from bdlora.base.method_table import ADAPTED, WHOLE
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import BENCH_JSON, EXPORT_MARKER, SHIP_OPTIONS, SHIP_RESULT, GenaiDir, ModelDir, RunDir
from bdlora.base.threads import flat
from bdlora.bench.config import BenchConfig
from bdlora.compress.config import OneShotConfig
from bdlora.data.documents import BUILTIN
from bdlora.export.settings import GenaiExportConfig
from bdlora.models.runtime import DecoderShape
from bdlora.models.sources import resolve
from bdlora.pipeline.ledger import Ledger, Step, do_step
from bdlora.ship.config import DRAFT_FORMS, ShipConfig
from bdlora.ship.preflight import check_reach, check_settings
from bdlora.ship.process import spawn
from bdlora.ship.recommend import BENCH, exported, recommend
from bdlora.train.config import TrainConfig

COMPRESSED_MARKER = ModelDir.MARKER  # written last by compress
RUN_MARKER = RunDir.MARKER  # written last by train
DRAFT, LOGS, DENSE = "draft", "logs", "dense"
SETTINGS = "settings"  # DIR/settings/STEP.json: the settings file each step's command reads (``Invocation``); a
# step's output is DIR/STEP and its log DIR/logs/STEP.log
HEAL_FIELDS = ("teacher", "student_init", "student_layers", "method", "data", "max_steps", "time_budget", "batch_size",
               "seq_len", "out")  # a heal's train options, in the order its command line gives them


class StepFailed(BdloraError):
    """A step's command exited non-zero: its last lines and its log are named; what earlier steps wrote is kept."""


def start(model: str, cfg: ShipConfig, folder: Path) -> bool:
    """Check a rerun asks for what DIR/ship.json holds (an option added since it was written holds its default), or
    that a new folder is free; nothing is written (``record`` writes it once every check before the first step has
    passed: a refused ship left a ship.json that refused the corrected rerun). True when the folder was already
    started (a resume)."""
    record = {"model": model, "options": flat(cfg)}
    path = folder / SHIP_OPTIONS
    if path.is_file():
        try:
            held = read_json(path)
            held = {"model": held["model"], "options": {**flat(ShipConfig()), **held["options"]}}
        except (ValueError, KeyError, TypeError, OSError):
            raise UsageError(f"--out {folder}: its {SHIP_OPTIONS} is damaged; choose a new folder") from None
        if held != record:
            diff = [f"model {held['model']!r} (given {model!r})"] if held["model"] != model else []
            diff += [f"--{k.replace('_', '-')} {held['options'].get(k)!r} (given {v!r})"
                     for k, v in record["options"].items() if held["options"].get(k) != v]
            raise UsageError(f"--out {folder}: holds a ship of other settings ({'; '.join(diff[:3])}); rerun with "
                             "those to resume it, or choose a new folder")
        return True
    if folder.exists() and any(folder.iterdir()):
        raise UsageError(f"--out {folder}: exists and is not empty and is not a ship folder (choose a new folder)")
    return False


def record(model: str, cfg: ShipConfig, folder: Path) -> None:
    """DIR/ship.json: the model and options a rerun must repeat to resume."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / SHIP_OPTIONS, {"schema_version": SCHEMA_VERSION, "model": model, "options": flat(cfg)})


def run_step(step: Step, folder: Path, reporter: Reporter) -> None:
    """Run one step's command as its own process, its output into DIR/logs/NAME.log (its "> ..." stage lines also
    shown); Ctrl-C or SIGTERM stops it the same way (it removes what it had half-written) and is raised again."""
    log = folder / LOGS / f"{step.name}.log"
    log.parent.mkdir(exist_ok=True)
    settings = folder / SETTINGS / f"{step.name}.json"
    settings.parent.mkdir(exist_ok=True)
    write_json(settings, {"schema_version": SCHEMA_VERSION, **step.invocation.to_json()})
    argv = step.invocation.file_argv(settings)
    with open(log, "a") as f:
        f.write(f"$ bdlora {shlex.join(argv)}\n")
        f.flush()
        proc = spawn([sys.executable, "-m", "bdlora.cli", *argv])
        tail: list[str] = []
        try:
            for line in proc.stdout:
                f.write(line)
                f.flush()  # the log follows the step as it runs
                tail = (tail + [line.rstrip()])[-8:]
                if line.startswith("> "):
                    reporter.stage(f"  {line[2:].rstrip()}")
            code = proc.wait()
        except BaseException:  # Ctrl-C, SIGTERM: the step is stopped as the user would stop it, then we stop
            _stop(proc)
            raise
    if code != 0:
        said = next((t for t in reversed(tail) if t.startswith("error:")), tail[-1] if tail else "")
        raise StepFailed(f"step {step.name} failed (exit {code}: {said[:300]}); its log: {log}. Rerun the same "
                         "command to resume from it")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def teacher_export(model: str, cfg: ShipConfig, quant: str | None, out: Path, threads: bool = True,
                   **more) -> Invocation:
    """``export genai`` of the teacher at --precision rounded by ``quant`` (None: the default), ``more`` of its
    settings; with ``threads``, ship's --threads."""
    return Invocation(("export", "genai"), {
        "model_dir": model, **option_values(GenaiExportConfig, precision=cfg.precision, quant=quant, **more),
        "out_dir": str(out), **option_values(GenaiExportConfig, threads=cfg.pool.threads if threads else None)})


def teacher_folder(model: str, reporter: Reporter) -> str:
    """The teacher's own folder (export genai reads a folder or a .gguf; builtin is built, a preset materialised,
    once, into bdlora's cache); the students are made from ``model`` itself, so their provenance names it."""
    from bdlora.models.teacher import build_builtin_teacher

    if model == BUILTIN:
        return str(build_builtin_teacher(on_stage=reporter.stage, on_step=reporter.teacher_step))
    return resolve(model, on_stage=reporter.stage)


def teacher_steps(model: str, cfg: ShipConfig, folder: Path) -> list[Step]:
    """One export of the teacher per scheme at --precision (none at fp32: nothing is rounded); its export.json
    records the held-out perplexity the scheme is chosen by. --max-ppl-change is lifted: a bad scheme is measured,
    not refused."""
    return [Step(f"teacher-{q}", teacher_export(model, cfg, q, folder / f"teacher-{q}", max_ppl_change=1000.0),
                 EXPORT_MARKER, f"the teacher's {cfg.precision} export rounded by {q}")
            for q in (cfg.scheme_list() if len(cfg.scheme_list()) > 1 else [])]


def chosen_scheme(cfg: ShipConfig, folder: Path) -> tuple[str | None, dict[str, float]]:
    """The scheme whose teacher export scored the lowest held-out perplexity, and every scheme's figure."""
    schemes = cfg.scheme_list()
    if len(schemes) <= 1:
        return (schemes[0] if schemes else None), {}
    ppl = {q: GenaiDir(folder / f"teacher-{q}").quantized_ppl() for q in schemes}
    return min(ppl, key=lambda q: (ppl[q], schemes.index(q))), ppl


def one_shot(model: str, cfg: ShipConfig, quant: str | None, forms: str, speedup: float, out: Path,
             student: bool = True) -> Invocation:
    """``compress --one-shot`` of a student (or, ``student`` False, the draft) of ``model`` (its evaluation left to
    the bench)."""
    return Invocation(("compress",), {
        "run_dir": model, "one_shot": True, **option_values(OneShotConfig, precision=cfg.precision, data=cfg.data),
        "no_eval": True, **option_values(OneShotConfig, quant=quant, threads=cfg.pool.threads, forms=forms,
                                         speedup=float(speedup),
                                         width_multiple=cfg.width_multiple if student else None),
        "out_dir": str(out)})


def student_steps(model: str, cfg: ShipConfig, folder: Path, quant: str | None) -> list[Step]:
    steps = [Step(f"student-{s:g}", one_shot(model, cfg, quant, cfg.forms, s, folder / f"student-{s:g}"),
                  COMPRESSED_MARKER, f"a student predicted {s:g}x faster ({cfg.forms})") for s in cfg.speedup_list()]
    if cfg.draft_speedup:
        steps.append(Step(DRAFT, one_shot(model, cfg, quant, DRAFT_FORMS, cfg.draft_speedup, folder / DRAFT, False),
                          COMPRESSED_MARKER, f"the teacher's draft, predicted {cfg.draft_speedup:g}x faster"))
    return steps


def heal_steps(model: str, source: str, cfg: ShipConfig, folder: Path, made: list[str],
               peer_steps: int | None = None) -> list[Step]:
    """Each made folder healed (train --student-init, then compress) for --heal-steps or --heal-time-budget; with
    ``peer_steps``, the dense teacher (its folder ``source``) healed with the same data for that many steps (the
    peer every student is compared with at its precision) instead. The draft, a new depth and head, is healed
    whole (kd-full); a student through adapters on its frozen structure (kd-lora)."""
    steps = []
    for name in made if peer_steps is None else [DENSE]:
        run = folder / f"heal-{name}"
        start = None if name == DENSE else str(folder / name)
        method = WHOLE if name == DRAFT else ADAPTED
        count = peer_steps or cfg.heal_steps
        heal = TrainConfig(teacher=model, student_init=start, method=method, data=cfg.data,
                           student_layers=DecoderShape.from_folder(start or source).layers,
                           max_steps=count or None, time_budget=None if count else cfg.heal_time_budget,
                           batch_size=cfg.heal_batch_size, seq_len=cfg.heal_seq_len, out=str(run))
        train = Invocation(("train",), option_values(TrainConfig, **{f: getattr(heal, f) for f in HEAL_FIELDS}))
        length = f"{count} steps" if count else f"time-budget {cfg.heal_time_budget}"
        steps.append(Step(f"heal-{name}", train, RUN_MARKER, f"healing {name} ({length} of {method})",
                          () if name == DENSE else (name,)))
        healed = Invocation(("compress",), {"run_dir": str(run), "no_eval": True,
                                            "out_dir": str(folder / f"healed-{name}")})
        steps.append(Step(f"healed-{name}", healed, COMPRESSED_MARKER, f"the healed {name} as a folder",
                          (f"heal-{name}",)))
    return steps


def peer_step_count(cfg: ShipConfig, folder: Path, made: list[str]) -> int:
    """The dense peer's steps: --heal-steps, or under --heal-time-budget the most steps any candidate's heal took
    (read from its summary), so the peer is never healed less than what it is compared with."""
    if cfg.heal_steps:
        return cfg.heal_steps
    return max(RunDir(folder / f"heal-{name}").steps_taken() for name in made)


def bench_step(cfg: ShipConfig, folder: Path, made: list[str], teacher_quant: str | None,
               quant: str | None) -> Step:
    """One bench of every folder: the draft (when there is one) as the bench's own model, so that it speculates
    for the teacher's export beside prompt lookup; the others with --also; the healed dense teacher as --peer; with
    --gguf (by default where llama-cpp-python is installed) each of them and the teacher also as a GGUF file in
    llama.cpp. The
    bench model's own dense and LoRA forms are left out (--no-own-forms): ship recommends none of them, and at 1B
    they were two teacher-sized folders exported, timed and scored on both domains."""
    names = [f"healed-{n}" if cfg.heals else n for n in made]
    first, others = names[-1] if cfg.draft_speedup else names[0], names[:-1] if cfg.draft_speedup else names[1:]
    gguf = cfg.gguf_quant()  # llama.cpp's rows beside the genai ones, timed interleaved in the same run
    bench = Invocation(("bench",), {
        "model_dir": str(folder / first), **option_values(
            BenchConfig, runtime="genai,llamacpp" if gguf else "genai", genai_precisions=[cfg.precision],
            gguf_quants=[gguf] if gguf else None, scope="model", batch_sizes=[1], seq_lens=[cfg.seq_len],
            decode_tokens=cfg.decode_tokens, repeats=cfg.repeats, peers=False, own_forms=False),
        "out_dir": str(folder / BENCH), **option_values(BenchConfig, threads=cfg.pool.threads),
        "also": [str(folder / other) for other in others] or None,
        "peer": [str(folder / f"healed-{DENSE}")] if cfg.heals else None,
        **option_values(BenchConfig, quant=quant, teacher_quant=teacher_quant if quant else None,
                        speculative=bool(cfg.draft_speedup) or None,
                        fixed_widths=False if cfg.draft_speedup else None, eval_data=cfg.eval_data,
                        quality_tokens=cfg.quality_tokens)})
    benched = (*names, *([f"healed-{DENSE}"] if cfg.heals else []))
    return Step(BENCH, bench, BENCH_JSON, "every folder side by side, on both domains", benched)


def run_ship(model: str, cfg: ShipConfig, folder: Path, spell: Spell, reporter: Reporter = SILENT,
             runner=run_step) -> dict:
    """Every step (those whose output can be trusted kept: ``Ledger``), then the recommendation; returns it.
    ``spell``: a step's line as a person types it (shown, and recommended); ``runner`` runs one step."""
    folder = Path(folder)
    resumed = start(model, cfg, folder)
    if resumed:
        reporter.stage(f"resuming {folder}: finished steps are verified and kept")
    source = teacher_folder(model, reporter)
    check_settings(cfg, source)
    ledger = Ledger.open(folder, source, spell)
    made_names = [s.name for s in student_steps(model, cfg, folder, None)]
    if not all(name in ledger.steps for name in made_names):  # a speed-up no step has reached yet
        check_reach(model, cfg, spell, reporter.stage, source)
    if not resumed:
        record(model, cfg, folder)
    ran: dict[str, float] = {}  # the steps this invocation ran, and their seconds

    def do(steps: list[Step]) -> None:
        for step in steps:
            def make(step=step) -> None:
                reporter.stage(f"{step.name}: {step.what}\n    {shown(step.invocation, spell)}")
                runner(step, folder, reporter)

            seconds = do_step(ledger, step, reporter, make)
            if seconds is not None:
                ran[step.name] = seconds

    exports = teacher_steps(model, cfg, folder)
    do(exports)
    teacher_quant, scheme_ppl = chosen_scheme(cfg, folder)
    if scheme_ppl:
        reporter.stage("teacher's held-out perplexity by scheme: " + ", ".join(
            f"{q} {p:.3f}" for q, p in scheme_ppl.items()) + f" -> {teacher_quant}")
    quant = cfg.student_quant or teacher_quant
    made_steps = student_steps(model, cfg, folder, quant)
    do(made_steps)
    made = [s.name for s in made_steps]
    heal = heal_steps(model, source, cfg, folder, made) if cfg.heals else []
    do(heal)
    if cfg.heals:
        peer = heal_steps(model, source, cfg, folder, made, peer_steps=peer_step_count(cfg, folder, made))
        do(peer)
        heal += peer
    bench = bench_step(cfg, folder, made, teacher_quant, quant)
    do([bench])
    chosen = [s for s in exports if s.name == f"teacher-{teacher_quant}"]
    out = folder / chosen[0].name if chosen else exported(folder, "teacher", cfg.precision)
    teacher = shown(chosen[0].invocation if chosen else teacher_export(model, cfg, teacher_quant, out, threads=False),
                    spell)
    result = recommend(folder, cfg, {s.name: shown(s.invocation, spell) for s in [*made_steps, *heal, bench]},
                       teacher_quant, scheme_ppl, teacher, out, source, spell,
                       Path(bench.invocation.values["model_dir"]).name)
    result["steps_run_seconds"] = ran
    write_json(folder / SHIP_RESULT, result)
    return result
