"""The distillation recipe (nanoGPT-style, one explicit loop for kd-full, kd-lora and budgeted): ``setup`` takes
what ``session.prepare`` built (teacher, data, student) and opens (or resumes) the run directory, ``loop`` runs the
optimiser steps, ``finish`` saves the student and writes ``summary.json`` last. Method-specific behaviour lives in
``methods``; checkpoints and signal handling in ``checkpoint``; what a finished run records in ``summary``; the
run-directory layout in ``runs``; multi-process plumbing in ``distributed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from bdlora import SCHEMA_VERSION, __version__
from bdlora.base.errors import ModelError, RunDirError, Terminated, TrainingError, UsageError
from bdlora.base.io import release, write_json
from bdlora.base.outputs import check_new_out
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import FAILED, RunDir, RunFacts
from bdlora.base.threads import flat
from bdlora.compress.start import LowRankStart
from bdlora.data.blocks import BlockSampler
from bdlora.data.tokens import default_cache_dir
from bdlora.models.perplexity import perplexity
from bdlora.models.teacher import TeacherSource, load_teacher
from bdlora.train import distributed as D
from bdlora.train import forms_start, stopping
from bdlora.train.budgeted.start import needed
from bdlora.train.checkpoint import (
    StopRequest,
    drop_unstarted,
    latest_checkpoint,
    load_checkpoint,
    remove_stale,
    resume_config,
    save_checkpoint,
    stops_deferred,
    truncate_jsonl,
)
from bdlora.train.config import TrainConfig
from bdlora.train.distill import DistillationLoss, diverged, kd_step, warmup_cosine
from bdlora.train.kdcache import TeacherTopK, cache_dir
from bdlora.train.methods import METHOD_CLASSES, TrainingMethod
from bdlora.train.reweight import reweigh
from bdlora.train.session import Session, prepare
from bdlora.train.stopping import BestKeeper, TimeBudget
from bdlora.train.summary import finish


@dataclass
class Run:
    """Everything the loop touches: the session, the wrapped model and its optimiser, where it writes."""

    cfg: TrainConfig
    sess: Session
    method: TrainingMethod
    model: torch.nn.Module
    ddp: object
    params: list
    optimizer: torch.optim.Optimizer
    scheduler: object
    loss_fn: DistillationLoss
    sampler: BlockSampler
    env: D.DistEnv
    device: torch.device
    reporter: Reporter
    run: RunDir | None = None
    start: LowRankStart | None = None  # where the low-rank paths began (None: the SPEC's zero start)
    topk: TeacherTopK | None = None  # --kd-topk: the teacher's cached top-k targets
    keeper: BestKeeper | None = None  # --eval-data: the best step there
    budget: TimeBudget | None = None  # --time-budget
    start_step: int = 0
    step: int = 0  # optimiser steps done so far (for a failure report)
    prior_seconds: float = 0.0
    figures: dict = dataclasses.field(default_factory=dict)  # teacher / initial / latest student val ppl
    t0: float = 0.0  # wall clock of this process's first and last step
    t1: float = 0.0

    @property
    def tokens_per_step(self) -> int:
        c = self.cfg
        return c.batch_size * c.grad_accum * c.seq_len * self.env.world_size

    @property
    def blocks(self):
        return self.sess.mixture or self.sess.train_blocks  # --reweight-every's mixture draws its own blocks

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.cfg.grad_accum * self.env.world_size


# --------------------------------------------------------------------------------------------------------------------
# The recipe: setup, loop, finish
# --------------------------------------------------------------------------------------------------------------------


def train(cfg: TrainConfig | None, reporter: Reporter | None = None, resume: str | Path | None = None,
          overrides: dict | None = None, cost_model=None) -> dict:
    """Run (or, with ``resume``, continue: ``cfg`` is then the run's own and may be None) a distillation run; returns
    the summary dict (also written to ``summary.json``).
    ``cost_model``: with ``--precision``, the measured decode time the start is allocated by (a
    ``models.costs.CostModel``: the CLI passes ``bench.whole.MeasuredCosts``, which the core does not import).

    Under torchrun (WORLD_SIZE > 1) every rank calls this: see ``bdlora.train.distributed`` for the contract."""
    started = stopping.now()  # a --time-budget counts from here (loading, teacher samples, calibration included)
    env = D.env_from_launcher()
    rep = (reporter or SILENT) if env.is_main else SILENT
    run_dir = None
    if resume is not None:
        run_dir = RunDir(resume)
        cfg = resume_config(run_dir, overrides)
        stored_world = run_dir.facts().world_size
        if stored_world != env.world_size:
            raise UsageError(f"--resume {run_dir.path}: the run was trained on {stored_world} process(es), this "
                             f"launch has {env.world_size}; resume with the same number so the global batch and "
                             "data order stay the same")
    if cfg.dials.precision and cost_model is None and resume is None:  # before any teacher or corpus is loaded
        raise UsageError(f"--precision {cfg.dials.precision}: the decode-time table is built by `bdlora train`; this "
                         "caller passed none")
    dist_device = D.init(env, cfg.device)
    run = None
    made: list[RunDir] = []  # the run folder this call creates, once it exists
    try:
        try:
            run = setup(cfg, rep, run_dir, env, dist_device, cost_model, made)
            stopping.attach(run, started)
            loop(run)
            return finish(run)
        except KeyboardInterrupt as e:  # before the first checkpoint, a new run's folder goes (nothing to resume)
            note = drop_unstarted(made[0]) if env.is_main and made else ""
            raise type(e)(f"{e}; {note}" if str(e) else note) if note else e from None
        except Exception as e:  # a diverged run, a disk that refused a write: nothing half-written may block --out
            folder = run.run if run is not None else made[0] if made else None  # (none yet: nothing to settle)
            done = folder.settle_failure(e, run.step if run else 0) if env.is_main and folder else ""
            if isinstance(e, TrainingError):
                raise TrainingError(f"{e}; {done}" if done else str(e)) from None
            raise
    finally:
        D.shutdown(env, run)
        if cfg.out:
            release(cfg.out)  # the run folder is finished, kept as failed or gone: another command may write it


def setup(cfg: TrainConfig, rep: Reporter, resume: RunDir | None, env: D.DistEnv, dist_device,
          cost_model=None, made: list | None = None) -> Run:
    if resume is None and env.is_main and cfg.out:  # refused (and claimed) before the teacher loads and calibrates,
        check_new_out(cfg.out)  # not ~40 s later when the run folder is made
    with D.main_first(env):  # rank 0 builds the caches (teacher, tokenised corpus) first
        sess = prepare(cfg, rep, prefixes=resume.facts().samples_prefixes if resume is not None else True)
    cfg, device = sess.cfg, dist_device or sess.device
    sess.teacher.to(device)
    sess.facts = dataclasses.replace(sess.facts, world_size=env.world_size)
    topk = _topk_cache(cfg, sess, device)  # before the run directory exists: a bad --kd-topk writes nothing
    has_start = needed(cfg.method, cfg.lora_init, cfg.allocation)
    start = shaped = None
    if resume is None and env.is_main:  # before the run directory exists: a bad target writes nothing
        shaped, start = forms_start.run_start(cfg, sess.student, sess.calibration_source, rep, cost_model,
                                              has_start)
    with stops_deferred():  # a stop is taken once the new folder is whole and read back, never inside a write
        run_dir = resume if resume is not None else _new_run_dir(cfg, sess.facts, env, made)
        if shaped is not None:
            forms_start.save(shaped, sess.tokenizer, run_dir)
        if start is not None:
            start.save(*run_dir.lora_start)
        D.barrier(env)
        if cfg.structured:  # every process (and a resumed run) trains the structure read back from the run directory
            _load_structure(sess, run_dir, write=resume is None and env.is_main)
        if has_start:  # every process (and a resumed run) reads the same stored factors
            start = _read_start(run_dir)
    torch.manual_seed(cfg.seed)
    method = METHOD_CLASSES[cfg.method](cfg)
    model = method.wrap(sess.student, start).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2))
    run = Run(cfg, sess, method, model, D.wrap_ddp(model, device) if env.enabled else None, params, optimizer,
              torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.max_steps)),
              DistillationLoss(cfg.temperature, cfg.kd_weight, cfg.loss_chunk),
              sess.mixture or BlockSampler(len(sess.train_blocks), cfg.seed), env, device, rep, run=run_dir,
              start=start)
    run.topk = topk
    if resume is not None:
        _resume(run, resume)
    if env.enabled:
        rep.stage(f"data parallel: {env.world_size} processes ({dist.get_backend()}), global batch "
                  f"{run.global_batch} x {cfg.seq_len} = {run.tokens_per_step:,} tokens")
    return run


def _load_structure(sess: Session, run_dir: RunDir, write: bool) -> None:
    """The run's saved ``--forms`` structure as the session's student (its layers, recorded in config.json)."""
    folder = run_dir.structure
    try:
        model, _, _ = load_teacher(str(folder), None, device="cpu", what="the run's structured start")
        kept = forms_start.kept_layers(run_dir)
    except (OSError, ValueError, KeyError, ModelError) as e:
        raise RunDirError(f"{run_dir.path}: its structured start ({folder.name}/) does not load ({e}); the run is "
                          "damaged") from None
    sess.student = model.to(sess.device)
    sess.layer_indices = [sess.layer_indices[i] for i in kept]
    sess.facts = dataclasses.replace(sess.facts, layer_indices=tuple(sess.layer_indices))
    if write:
        _write_config(run_dir, sess.cfg, sess.facts)


def _topk_cache(cfg: TrainConfig, sess: Session, device) -> TeacherTopK | None:
    """``--kd-topk K``: the cache of the teacher's top-k targets (None for full-vocabulary KD)."""
    if not cfg.kd_topk:
        return None
    vocab = sess.teacher.get_output_embeddings().weight.shape[0]
    if cfg.kd_topk > vocab:
        raise UsageError(f"--kd-topk {cfg.kd_topk}: must be between 1 and the teacher's vocabulary ({vocab}); "
                         "0 distils from the full vocabulary")
    source = TeacherSource(Path(sess.facts.teacher_path))
    root = cache_dir(cfg.cache_root() or default_cache_dir(), source.fingerprint(),
                     cfg.kd_topk, cfg.temperature, cfg.autocast)
    return TeacherTopK(sess.teacher, cfg.kd_topk, cfg.temperature, root, device, cfg.autocast, cfg.loss_chunk,
                       {"teacher": sess.facts.teacher_path, "teacher_sha256": source.fingerprint()})


def _new_run_dir(cfg: TrainConfig, facts: RunFacts, env: D.DistEnv, made: list | None = None) -> RunDir:
    """A new run directory (made by rank 0, its path broadcast) with its config.json; recorded in ``made`` before
    anything is written in it, so a SIGTERM between its config.json and the caller's next line still removes it."""
    if env.is_main and cfg.out:
        check_new_out(cfg.out)
    path = RunDir.new(cfg.method, cfg.runs_dir, cfg.out).path if env.is_main else None
    run_dir = RunDir(D.broadcast_object(env, str(path) if path else None))
    if made is not None:
        made.append(run_dir)
    if env.is_main:
        run_dir.path.mkdir(parents=True, exist_ok=True)
        _write_config(run_dir, cfg, facts)
    return run_dir


def _read_start(run_dir: RunDir) -> LowRankStart:
    meta, factors = run_dir.lora_start
    try:
        return LowRankStart.load(meta, factors)
    except (OSError, ValueError, KeyError) as e:
        raise RunDirError(f"{run_dir.path}: its low-rank start ({meta.name}, {factors.name}) does not load "
                          f"({type(e).__name__}); the run is damaged") from None


def _write_config(run_dir: RunDir, cfg: TrainConfig, facts: RunFacts) -> None:
    write_json(run_dir.config_file, {"schema_version": SCHEMA_VERSION, "bdlora_version": __version__,
                                     "config": flat(cfg), "run": dataclasses.asdict(facts)})


def _resume(run: Run, run_dir: RunDir) -> None:
    run.run = run_dir
    if run.env.is_main:
        remove_stale(run_dir.checkpoints_dir)
    ckpt = latest_checkpoint(run_dir.path, on_warning=run.reporter.stage)
    if ckpt is None:
        raise RunDirError(f"--resume {run_dir.path}: no complete checkpoint to continue from")
    state = load_checkpoint(ckpt, run.model, run.optimizer, run.scheduler, run.method, run.cfg.max_steps)
    run.start_step, run.prior_seconds = state["step"], state.get("train_seconds", 0.0)
    if run.sess.mixture is not None:
        run.sess.mixture.load_state(state["mixture"])
    if run.env.is_main:
        (run_dir.path / FAILED).unlink(missing_ok=True)
        logs = [run_dir.metrics_log] + ([run_dir.path / run.method.log_name] if run.method.log_name else [])
        for log in logs:
            truncate_jsonl(log, run.start_step, on_warning=run.reporter.stage)
        _write_config(run_dir, run.cfg, run.sess.facts)
    run.reporter.stage(f"resuming {run_dir.path} at step {run.start_step} ({ckpt.name})")


def loop(run: Run) -> None:
    """Optimiser steps from ``run.start_step`` to the end; validation, logs and checkpoints on their schedule."""
    cfg, env, rep = run.cfg, run.env, run.reporter
    run.figures = {"teacher_val_ppl": None, "initial_student_val_ppl": None, "student_val_ppl": None}
    if env.is_main:
        rep.stage("evaluating teacher and initial student")
        run.figures["teacher_val_ppl"] = perplexity(run.sess.teacher, run.sess.val_blocks)
        t = stopping.now()
        scores = stopping.validate(run, run.start_step, initial=True)
        if run.start_step == 0:
            run.figures["initial_student_val_ppl"] = scores["val_ppl"]
        if run.budget is not None:
            run.budget.eval_seconds = stopping.now() - t
    run.figures["student_val_ppl"] = run.figures["initial_student_val_ppl"]
    logs = _open_logs(run)
    rep.start(cfg.max_steps, run.start_step)
    run.t0 = time.time()
    if run.budget is not None:
        run.budget.begin()
    run.model.train()
    stop = StopRequest()
    try:
        step = run.start_step
        while step < cfg.max_steps:  # a --time-budget sets max_steps after its first steps
            run.step = step
            m = _optimiser_step(run, step, logs)
            halt = D.any_rank(env, stop.requested is not None)
            done = m["step"]
            if env.is_main and ((cfg.save_every and done % cfg.save_every == 0 and done < cfg.max_steps) or halt):
                save_checkpoint(run.run.checkpoints_dir, done, run.model, run.optimizer, run.scheduler, run.method,
                                {"train_seconds": run.prior_seconds + time.time() - run.t0,
                                 **({"mixture": run.sess.mixture.state()} if run.sess.mixture else {})}, cfg.keep_last)
            if halt:
                D.barrier(env)
                kind = Terminated if stop.requested == "SIGTERM" else KeyboardInterrupt  # exit 143 or 130
                raise kind(f"stopped by {stop.requested or 'a signal to another rank'} after step "
                           f"{done}; checkpoint saved, continue with --resume {run.run.path}")
            step += 1
    finally:
        stop.restore()
        for f in logs.values():
            f.close()
        rep.finish()
    run.t1 = time.time()


def _open_logs(run: Run) -> dict:
    if not run.env.is_main:
        return {}
    logs = {"metrics": open(run.run.metrics_log, "a")}
    if run.method.log_name:
        logs["method"] = open(run.run.path / run.method.log_name, "a")
    return logs


def _optimiser_step(run: Run, step: int, logs: dict) -> dict:
    """One optimiser step (``grad_accum`` micro-batches) and its metrics record (logged, reported)."""
    cfg, env = run.cfg, run.env
    record = run.method.before_step(step / max(1, cfg.max_steps - 1))
    D.check_same_retentions(env, run.method.retentions(), step + 1)
    if "method" in logs:
        logs["method"].write(json.dumps({"step": step + 1, **record}) + "\n")
        logs["method"].flush()
    sums = [0.0, 0.0, 0.0]  # loss, kd, ce
    for micro in range(cfg.grad_accum):
        first = ((step * cfg.grad_accum + micro) * env.world_size + env.rank) * cfg.batch_size
        x, mask = (t if t is None else t.to(run.device)
                   for t in run.blocks.batch(run.sampler.indices(first, cfg.batch_size)))
        sync = run.ddp is None or micro == cfg.grad_accum - 1
        with (contextlib.nullcontext() if sync else run.ddp.no_sync()):
            loss, parts = kd_step(run.model, run.sess.teacher, run.loss_fn, x, run.device, run.ddp, mask,
                                  run.cfg.autocast, run.topk)
            if not torch.isfinite(loss.detach()):
                raise TrainingError(diverged(float(loss.detach()), step, run.start_step, cfg.lr))
            (loss / cfg.grad_accum).backward()
        for i, v in enumerate((float(loss.detach()), parts["kd"], parts["ce"])):
            sums[i] += v / cfg.grad_accum
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip))
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    loss, kd, ce = D.mean_over_ranks(env, sums)
    done, elapsed = step + 1, time.time() - run.t0
    m = {"step": done, "loss": loss, "kd": kd, "ce": ce, "lr": run.scheduler.get_last_lr()[0],
         "grad_norm": grad_norm, "tokens": done * run.tokens_per_step,
         "tokens_per_s": (done - run.start_step) * run.tokens_per_step / max(elapsed, 1e-9),
         **run.method.step_metrics(record)}
    reweigh(run, done, m)
    stopping.fit_budget(run, done, lambda: _write_config(run.run, cfg, run.sess.facts))
    if env.is_main and (done % cfg.eval_every == 0 or done == cfg.max_steps):
        m.update(stopping.validate(run, done))
        run.figures["student_val_ppl"] = m["val_ppl"]
        run.reporter.evaluated(done, m)
    if "metrics" in logs:
        logs["metrics"].write(json.dumps(m) + "\n")
        logs["metrics"].flush()
    run.reporter.step(done, m)
    return m
