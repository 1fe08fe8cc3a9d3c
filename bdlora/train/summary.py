"""The end of a training run: the student saved (its best step's, with ``--eval-data``), then ``summary.json``, written
last because its presence marks the run finished (``runs.RunDir.MARKER``): what was trained, on what, how fast, and
what the method, the start and the stopping rule record."""

from __future__ import annotations

import torch

from bdlora import SCHEMA_VERSION, __version__
from bdlora.base.io import atomic_dir, write_json
from bdlora.base.runs import RunDir
from bdlora.compress.start import shapes_of
from bdlora.compress.start import summary as start_summary
from bdlora.train import distributed as D
from bdlora.train import stopping


def finish(run) -> dict:
    """Save the student of ``run`` (a ``loop.Run``), then ``summary.json``; returns the summary and the run folder
    (other processes of a torchrun job: their rank, after the main one is done)."""
    env = run.env
    if not env.is_main:
        D.barrier(env)
        return {"rank": env.rank, "run_dir": str(run.run.path)}
    kept = stopping.keep_best(run)
    run.reporter.stage("saving the student")
    with atomic_dir(run.run.student_dir) as tmp:
        run.method.save_student(run.model, run.sess.tokenizer, tmp)
    summary = run_summary(run, kept)
    batch = torch.from_numpy(run.blocks.get(run.sampler.indices(0, run.cfg.batch_size))).to(run.device)
    run.method.finalize(run.run.path, summary, run.sess.teacher, batch, run.device, run.reporter.stage)
    write_json(run.run.path / RunDir.MARKER, summary)
    D.barrier(env)
    return {**summary, "run_dir": str(run.run.path)}


def run_summary(run, kept: dict) -> dict:
    """``summary.json``'s figures: the run's settings and scale, its speed, and what its method, its start (the
    low-rank initialisation or the one-shot structure), the teacher's top-k cache, the mixture and the kept best
    step (``kept``) add."""
    cfg = run.cfg
    steps_here = cfg.max_steps - run.start_step
    summary = {
        "schema_version": SCHEMA_VERSION,
        "bdlora_version": __version__,
        "method": cfg.method,
        "teacher": cfg.teacher,
        "data": cfg.data,
        "student_layers": cfg.student_layers,
        "layer_indices": run.sess.layer_indices,
        "steps": cfg.max_steps,
        "tokens": cfg.max_steps * run.tokens_per_step,
        "world_size": run.env.world_size,
        "global_batch": run.global_batch,
        **run.figures,
        "train_seconds": run.prior_seconds + run.t1 - run.t0,
        "tokens_per_s": steps_here * run.tokens_per_step / max(run.t1 - run.t0, 1e-9),
        "resumed_from": run.start_step or None,
        "trainable_parameters": sum(p.numel() for p in run.params),
    }
    if run.start:
        summary.update(start_summary(run.start, shapes_of(run.sess.student)))
    else:
        summary["lora_init"] = "zero"
    summary.update(run.method.summary(run.model))
    if run.topk:
        summary["kd_topk"] = run.topk.stats()
    summary.update(kept)
    if run.sess.mixture:
        summary["mixture"] = run.sess.mixture.summary()
    return summary
