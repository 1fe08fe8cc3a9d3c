"""The distillation recipe: one explicit loop (nanoGPT style) shared by kd-full, kd-lora and budgeted.

A run directory holds: ``config.json`` (resolved options), ``metrics.jsonl``, ``controller.jsonl`` (budgeted),
``checkpoints/step-N/`` (atomic, with a completed marker), ``student/`` and, written last, ``summary.json``: a run
without ``summary.json`` is unfinished and can be continued with ``--resume``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from bdlora import SCHEMA_VERSION, __version__
from bdlora.config import TrainConfig, resolve_defaults, validate
from bdlora.costs import shapes_from_config, training_compute_proxy
from bdlora.data import BUILTIN, BlockSampler, Corpus, PackedBlocks, tokenize_corpus
from bdlora.distill import DistillationLoss, base_model, hidden_and_head
from bdlora.errors import DataError, ModelError, RunDirError, TrainingError, UsageError
from bdlora.evaluate import perplexity
from bdlora.io import atomic_dir, load_tensors, read_json, save_tensors, write_json
from bdlora.methods import METHOD_CLASSES, Budgeted, KDFull, KDLoRA
from bdlora.student import build_student, check_same_vocabulary
from bdlora.teacher import load_teacher


class Reporter:
    """Progress callbacks; the CLI subclasses this with rich output. Library code never prints."""

    def stage(self, message: str) -> None: ...

    def teacher_step(self, step: int, total: int, loss: float) -> None: ...

    def start(self, total_steps: int, start_step: int) -> None: ...

    def step(self, step: int, metrics: dict) -> None: ...

    def evaluated(self, step: int, metrics: dict) -> None: ...

    def finish(self) -> None: ...


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine (allowed here: auto, cpu)")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class Session:
    """Everything a run needs, built and checked before any run directory is created."""

    cfg: TrainConfig
    device: torch.device
    teacher: torch.nn.Module
    tokenizer: object
    student: torch.nn.Module
    layer_indices: list[int]
    train_blocks: PackedBlocks
    val_blocks: PackedBlocks
    data_meta: dict


def prepare(cfg: TrainConfig, reporter: Reporter | None = None) -> Session:
    """Validate options, load (or build) the teacher, tokenise the corpus, build the student. Raises typed errors
    for bad input; creates nothing but caches."""
    rep = reporter or Reporter()
    validate(cfg)
    device = resolve_device(cfg.device)
    cache = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else None
    corpus = Corpus(cfg.data)  # checks the path before the (possibly long) teacher build
    rep.stage(f"loading teacher {cfg.teacher}")
    teacher, tokenizer, teacher_path = load_teacher(cfg.teacher, cache, device=str(device), on_stage=rep.stage,
                                                    on_step=rep.teacher_step)
    cfg = resolve_defaults(cfg, builtin_teacher=cfg.teacher == BUILTIN)
    n_teacher = teacher.config.num_hidden_layers
    if cfg.student_layers is None:
        cfg.student_layers = max(1, math.ceil(n_teacher / 2))
    if cfg.student_layers > n_teacher:
        raise UsageError(f"--student-layers {cfg.student_layers}: must be between 1 and the teacher's {n_teacher}")
    max_pos = getattr(teacher.config, "max_position_embeddings", None)
    if max_pos is not None and cfg.seq_len > max_pos:
        if "seq_len" in cfg.extra.get("defaulted", ()):
            cfg.seq_len = max_pos
        else:
            raise UsageError(f"--seq-len {cfg.seq_len}: above the model's max_position_embeddings ({max_pos})")
    if cfg.tokens is not None:
        cfg.max_steps = max(1, cfg.tokens // (cfg.batch_size * cfg.grad_accum * cfg.seq_len))

    # Student: layers from --student-init (default: the teacher), same tokenizer required.
    source = teacher
    if cfg.student_init:
        rep.stage(f"loading student init {cfg.student_init}")
        source, init_tok, _ = load_teacher(cfg.student_init, cache, device="cpu")
        check_same_vocabulary(tokenizer, init_tok, f"--student-init {cfg.student_init}")
        if source.config.vocab_size != teacher.config.vocab_size:
            raise ModelError(f"--student-init {cfg.student_init}: embedding rows {source.config.vocab_size} != "
                             f"teacher's {teacher.config.vocab_size}")
    if cfg.student_layers > source.config.num_hidden_layers:
        raise UsageError(f"--student-layers {cfg.student_layers}: must be between 1 and the source's "
                         f"{source.config.num_hidden_layers} layers")
    student, idx = build_student(source, cfg.student_layers, cfg.layer_selection, seed=cfg.seed)
    student.to(device)

    heldout = cfg.heldout_fraction if cfg.heldout_fraction is not None else corpus.default_heldout_fraction
    cfg.heldout_fraction = heldout
    rep.stage(f"tokenising corpus {cfg.data} ({len(corpus.files)} files)")
    data = tokenize_corpus(corpus, tokenizer, heldout, cache)
    train_blocks = PackedBlocks(data.tokens("train"), cfg.seq_len)
    val_blocks = PackedBlocks(data.tokens("val"), cfg.seq_len, max_tokens=cfg.eval_tokens)
    if len(train_blocks) < 1:
        raise DataError(f"--data {cfg.data}: {data.meta['tokens']['train']} training tokens, fewer than one block "
                        f"of --seq-len {cfg.seq_len}")
    if len(val_blocks) < 1:
        raise DataError(f"--data {cfg.data}: the held-out slice has {data.meta['tokens']['val']} tokens, fewer "
                        f"than one block of {cfg.seq_len}; raise --heldout-fraction (now {heldout})")
    cfg.extra.update({"teacher_path": str(teacher_path), "layer_indices": idx, "teacher_layers": n_teacher,
                      "data_cache": str(data.path), "data_tokens": data.meta["tokens"]})
    return Session(cfg, device, teacher, tokenizer, student, idx, train_blocks, val_blocks, data.meta)


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------------------


def _rng_state() -> tuple[dict, dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    np_state = np.random.get_state()
    meta = {"python": repr(random.getstate()), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    return tensors, meta


def _set_rng_state(tensors: dict, meta: dict) -> None:
    import ast

    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(ast.literal_eval(meta["python"]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), *n[2:]))


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler, method, extra: dict, keep_last: int):
    """Trainable weights, optimizer (safetensors + JSON), scheduler, RNG, method state; atomically; the directory
    is complete only with ``state.json``, which is written last inside the temp dir before the rename and holds
    the SHA-256 of every other file (a torn or corrupted checkpoint is detected on resume)."""
    ckpt_root = run_dir / "checkpoints"
    with atomic_dir(ckpt_root / f"step-{step:08d}") as tmp:
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        save_tensors(tmp / "trainable.safetensors", trainable)
        opt_state = optimizer.state_dict()
        flat = {}
        for idx, st in opt_state["state"].items():
            for k, v in st.items():
                flat[f"{idx}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
        save_tensors(tmp / "optimizer.safetensors", flat)
        rng_t, rng_meta = _rng_state()
        save_tensors(tmp / "rng.safetensors", rng_t)
        files = {f.name: _sha256(f) for f in sorted(tmp.iterdir())}
        write_json(tmp / "state.json", {"step": step, "param_groups": opt_state["param_groups"],
                                         "scheduler": scheduler.state_dict(), "method": method.state(),
                                         "rng": rng_meta, "files": files, **extra})
    for old in sorted(ckpt_root.glob("step-*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(ckpt: Path) -> str | None:
    """None when the checkpoint is complete and every file matches its recorded SHA-256, else what is wrong."""
    try:
        state = read_json(ckpt / "state.json")
    except (OSError, ValueError) as e:
        return f"state.json unreadable ({type(e).__name__})"
    for name, digest in state.get("files", {}).items():
        f = ckpt / name
        if not f.exists():
            return f"{name} missing"
        if _sha256(f) != digest:
            return f"{name} checksum mismatch"
    return None


def latest_checkpoint(run_dir: Path, on_warning=None) -> Path | None:
    """The newest checkpoint that verifies; a corrupt newer one is skipped with a warning (and left on disk)."""
    import warnings

    done = [p for p in sorted((Path(run_dir) / "checkpoints").glob("step-*")) if (p / "state.json").exists()]
    for ckpt in reversed(done):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            return ckpt
        msg = f"checkpoint {ckpt.name} is corrupt ({problem}); falling back to the previous one"
        if on_warning is not None:
            on_warning(f"warning: {msg}")
        else:
            warnings.warn(msg, stacklevel=2)
    return None


def load_checkpoint(ckpt: Path, model, optimizer, scheduler, method) -> dict:
    state = read_json(ckpt / "state.json")
    trainable = load_tensors(ckpt / "trainable.safetensors")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in trainable.items():
            params[n].copy_(t)
    flat = load_tensors(ckpt / "optimizer.safetensors")
    opt_state: dict = {"state": {}, "param_groups": state["param_groups"]}
    for key, v in flat.items():
        idx, k = key.split(".", 1)
        opt_state["state"].setdefault(int(idx), {})[k] = v
    optimizer.load_state_dict(opt_state)
    scheduler.load_state_dict(state["scheduler"])
    method.load_state(state["method"])
    _set_rng_state(load_tensors(ckpt / "rng.safetensors"), state["rng"])
    return state


def _truncate_jsonl(path: Path, max_step: int) -> None:
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= max_step]
    path.write_text("".join(line + "\n" for line in keep))


# --------------------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------------------


class _StopRequest:
    """SIGINT/SIGTERM during training set a flag; the loop finishes the current optimiser step, saves a checkpoint
    and stops, so an interrupted run loses nothing and never saves a half-updated state."""

    def __init__(self):
        import signal
        import threading

        self.requested: str | None = None
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        import signal

        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def restore(self):
        import signal

        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def warmup_cosine(total_steps: int):
    """LR multiplier: linear warm-up over 3% of steps (capped at 2000), then cosine to 0 (SPEC 3)."""
    warmup = max(1, min(2000, round(0.03 * total_steps)))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        p = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, p)))

    return f


def _autocast(device: torch.device):
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


def new_run_dir(cfg: TrainConfig) -> Path:
    if cfg.out:
        out = Path(cfg.out)
        if out.exists() and any(out.iterdir()):
            raise UsageError(f"--out {out}: exists and is not empty (choose a new directory or --resume it)")
        return out
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(cfg.runs_dir) / f"{stamp}-{cfg.method}"
    i = 1
    while out.exists():
        out = Path(cfg.runs_dir) / f"{stamp}-{cfg.method}-{i}"
        i += 1
    return out


def kd_step(model, teacher, loss_fn, x, device, ddp=None):
    """One micro-batch's loss; with ``ddp`` the student's hidden states come through DDP (gradient all-reduce)."""
    with torch.no_grad(), _autocast(device):
        th, thead = hidden_and_head(teacher, x)
    with _autocast(device):
        if ddp is None:
            sh, shead = hidden_and_head(model, x)
        else:
            sh = ddp(x)
            shead = base_model(model).lm_head
        return loss_fn(sh, shead, th, thead, x)


# Options that may differ when a run is resumed: they change where/how often things are written or measured, never
# the trajectory of the weights. Every other option is fixed by the run's config.json.
RESUME_MUTABLE = ("save_every", "keep_last", "eval_every", "device", "measure_step_time", "cache_dir")


def resume_config(run_dir: Path, overrides: dict | None = None) -> TrainConfig:
    """The stored options of an unfinished run, with the allowed ``overrides`` applied; any other changed option is
    refused (a different method, model or data would silently make a different run)."""
    if not (run_dir / "config.json").exists():
        raise RunDirError(f"--resume {run_dir}: not a bdlora run directory (no config.json)")
    if (run_dir / "summary.json").exists():
        raise RunDirError(f"--resume {run_dir}: this run already finished (summary.json exists)")
    stored = read_json(run_dir / "config.json")["config"]
    values = {k: v for k, v in stored.items() if k in TrainConfig.__dataclass_fields__}
    for k, v in (overrides or {}).items():
        if v is None or k in ("out", "runs_dir"):
            continue
        if k in RESUME_MUTABLE:
            values[k] = v
        elif stored.get(k) != v:
            flag = f"--{k.replace('_', '-')}"
            raise UsageError(f"{flag} {v}: this run was started with {flag} {stored.get(k)}; --resume cannot change "
                             f"it (start a new run; changeable on resume: "
                             f"{', '.join('--' + m.replace('_', '-') for m in RESUME_MUTABLE)})")
    cfg = TrainConfig(**values)
    cfg.extra = {"world_size": stored.get("extra", {}).get("world_size", 1)}
    return cfg


def train(cfg: TrainConfig, reporter: Reporter | None = None, resume: str | Path | None = None,
          overrides: dict | None = None) -> dict:
    """Run (or continue) a distillation run; returns the summary dict (also written to ``summary.json``).

    Under torchrun (WORLD_SIZE > 1) every rank calls this: see ``bdlora.distributed`` for the contract."""
    from bdlora import distributed as D

    env = D.env_from_launcher()
    rep = (reporter or Reporter()) if env.is_main else Reporter()
    run_dir = None
    if resume is not None:
        run_dir = Path(resume)
        cfg = resume_config(run_dir, overrides)
        stored_world = cfg.extra.pop("world_size", 1)
        if stored_world != env.world_size:
            raise UsageError(f"--resume {run_dir}: the run was trained on {stored_world} process(es), this launch "
                             f"has {env.world_size}; resume with the same number so the global batch and data order "
                             "stay the same")
    dist_device = D.init(env, cfg.device)
    try:
        return _train(cfg, rep, run_dir, env, dist_device)
    finally:
        D.shutdown(env)


def _train(cfg: TrainConfig, rep: Reporter, run_dir: Path | None, env, dist_device) -> dict:
    from bdlora import distributed as D

    resume = run_dir is not None
    with D.main_first(env):  # rank 0 builds the caches (teacher, tokenised corpus) first
        sess = prepare(cfg, rep)
    cfg = sess.cfg
    device = dist_device or sess.device
    if dist_device is not None:
        sess.teacher.to(device)
        sess.student.to(device)
    cfg.extra["world_size"] = env.world_size
    torch.manual_seed(cfg.seed)
    method = METHOD_CLASSES[cfg.method](cfg)
    dense_copy = copy.deepcopy(sess.student) if cfg.method == "budgeted" and cfg.measure_step_time else None
    model = method.wrap(sess.student)
    model.to(device)
    ddp = D.wrap_ddp(model, device) if env.enabled else None
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    total = cfg.max_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total))
    loss_fn = DistillationLoss(cfg.temperature, cfg.kd_weight, cfg.loss_chunk)
    sampler = BlockSampler(len(sess.train_blocks), cfg.seed)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * env.world_size

    start_step, prior_seconds = 0, 0.0
    if resume:
        for stale in (run_dir / "checkpoints").glob(".step-*.tmp"):  # a save killed half-way
            if env.is_main:
                shutil.rmtree(stale, ignore_errors=True)
        ckpt = latest_checkpoint(run_dir, on_warning=rep.stage)
        if ckpt is None:
            raise RunDirError(f"--resume {run_dir}: no complete checkpoint to continue from")
        state = load_checkpoint(ckpt, model, optimizer, scheduler, method)
        start_step, prior_seconds = state["step"], state.get("train_seconds", 0.0)
        if env.is_main:
            for log in ("metrics.jsonl", "controller.jsonl"):
                _truncate_jsonl(run_dir / log, start_step)
            write_json(run_dir / "config.json", {"schema_version": SCHEMA_VERSION, "bdlora_version": __version__,
                                                 "config": dataclasses.asdict(cfg)})
        rep.stage(f"resuming {run_dir} at step {start_step} ({ckpt.name})")
    else:
        run_dir = new_run_dir(cfg) if env.is_main else None
        run_dir = Path(D.broadcast_object(env, str(run_dir) if run_dir else None))
        if env.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_json(run_dir / "config.json", {"schema_version": SCHEMA_VERSION, "bdlora_version": __version__,
                                                 "config": dataclasses.asdict(cfg)})
    if env.enabled:
        rep.stage(f"data parallel: {env.world_size} processes ({dist.get_backend()}), global batch "
                  f"{cfg.batch_size * cfg.grad_accum * env.world_size} x {cfg.seq_len} = {tokens_per_step:,} tokens")

    teacher_ppl = initial_ppl = None
    if env.is_main:
        rep.stage("evaluating teacher and initial student")
        teacher_ppl = perplexity(sess.teacher, sess.val_blocks)
        initial_ppl = perplexity(model, sess.val_blocks) if start_step == 0 else None

    metrics_f = open(run_dir / "metrics.jsonl", "a") if env.is_main else None
    ctrl_f = open(run_dir / "controller.jsonl", "a") if env.is_main and isinstance(method, Budgeted) else None
    rep.start(total, start_step)
    t0 = time.time()
    val_ppl = initial_ppl
    model.train()
    stop = _StopRequest()
    gated = list(method.gated.values()) if isinstance(method, Budgeted) else []
    try:
        for step in range(start_step, total):
            progress = step / max(1, total - 1)
            ctrl = method.before_step(progress)
            D.check_same_retentions(env, [m._d for m in gated], step + 1)
            if ctrl_f is not None:
                ctrl_f.write(json.dumps({"step": step + 1, **ctrl}) + "\n")
            loss_sum, kd_sum, ce_sum = 0.0, 0.0, 0.0
            for micro in range(cfg.grad_accum):
                first = ((step * cfg.grad_accum + micro) * env.world_size + env.rank) * cfg.batch_size
                x = torch.from_numpy(sess.train_blocks.get(sampler.indices(first, cfg.batch_size))).to(device)
                sync = ddp is None or micro == cfg.grad_accum - 1
                with (contextlib.nullcontext() if sync else ddp.no_sync()):
                    loss, parts = kd_step(model, sess.teacher, loss_fn, x, device, ddp)
                    if not torch.isfinite(loss.detach()):
                        raise TrainingError(f"loss became {float(loss)} at step {step + 1}; lower --lr (now {cfg.lr})")
                    (loss / cfg.grad_accum).backward()
                loss_sum += float(loss.detach()) / cfg.grad_accum
                kd_sum += parts["kd"] / cfg.grad_accum
                ce_sum += parts["ce"] / cfg.grad_accum
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum, kd_sum, ce_sum = D.mean_over_ranks(env, [loss_sum, kd_sum, ce_sum])
            done = step + 1
            elapsed = time.time() - t0
            m = {"step": done, "loss": loss_sum, "kd": kd_sum, "ce": ce_sum, "lr": scheduler.get_last_lr()[0],
                 "grad_norm": grad_norm, "tokens": done * tokens_per_step,
                 "tokens_per_s": (done - start_step) * tokens_per_step / max(elapsed, 1e-9)}
            if ctrl is not None:
                m.update(budget=ctrl["budget"], retained=ctrl["retained"], zero=ctrl["zero"])
            if env.is_main and (done % cfg.eval_every == 0 or done == total):
                val_ppl = perplexity(model, sess.val_blocks)
                m["val_ppl"] = val_ppl
                rep.evaluated(done, m)
            if metrics_f is not None:
                metrics_f.write(json.dumps(m) + "\n")
                metrics_f.flush()
            if ctrl_f is not None:
                ctrl_f.flush()
            rep.step(done, m)
            stopping = D.any_rank(env, stop.requested is not None)
            if env.is_main and ((cfg.save_every and done % cfg.save_every == 0 and done < total) or stopping):
                save_checkpoint(run_dir, done, model, optimizer, scheduler, method,
                                {"train_seconds": prior_seconds + elapsed}, cfg.keep_last)
            if stopping:
                D.barrier(env)
                raise KeyboardInterrupt(f"stopped by {stop.requested or 'a signal to another rank'} after step "
                                        f"{done}; checkpoint saved, continue with --resume {run_dir}")
    finally:
        stop.restore()
        if metrics_f is not None:
            metrics_f.close()
        if ctrl_f is not None:
            ctrl_f.close()
        rep.finish()
    train_seconds = prior_seconds + time.time() - t0
    tokens_per_s = (total - start_step) * tokens_per_step / max(time.time() - t0, 1e-9)
    if not env.is_main:
        D.barrier(env)
        return {"rank": env.rank, "run_dir": str(run_dir)}

    rep.stage("saving the student")
    with atomic_dir(run_dir / "student") as tmp:
        method.save_student(model, sess.tokenizer, tmp)
    summary = {
        "schema_version": SCHEMA_VERSION, "bdlora_version": __version__, "method": cfg.method,
        "teacher": cfg.teacher, "data": cfg.data, "student_layers": cfg.student_layers,
        "layer_indices": sess.layer_indices, "steps": total, "tokens": total * tokens_per_step,
        "world_size": env.world_size, "global_batch": cfg.batch_size * cfg.grad_accum * env.world_size,
        "teacher_val_ppl": teacher_ppl, "initial_student_val_ppl": initial_ppl, "student_val_ppl": val_ppl,
        "train_seconds": train_seconds, "tokens_per_s": tokens_per_s, "resumed_from": start_step or None,
        "trainable_parameters": sum(p.numel() for p in params),
    }
    shapes = shapes_from_config(sess.student.config.to_dict() if hasattr(sess.student, "config") else {})
    rank = cfg.lora_rank
    d_bar = {"kd-full": 1.0, "kd-lora": 1.0}.get(cfg.method) or method.controller.mean_retained
    summary["compute_proxy"] = training_compute_proxy(shapes, rank, d_bar)
    summary.update(method.summary(model))
    if isinstance(method, Budgeted):
        from bdlora.plots import plot_controller

        plot_controller(run_dir / "controller.jsonl", summary["modules"], run_dir / "controller.png")
        if dense_copy is not None:
            rep.stage("timing training steps of kd-full, kd-lora and budgeted (d = 0) on the same student")
            x = torch.from_numpy(sess.train_blocks.get(sampler.indices(0, cfg.batch_size))).to(device)
            summary["step_time_ms"] = measure_step_times(dense_copy, sess.teacher, x, cfg, device)
    write_json(run_dir / "summary.json", summary)
    D.barrier(env)
    summary["run_dir"] = str(run_dir)
    return summary


def measure_step_times(dense_student, teacher, x, cfg: TrainConfig, device, warmup: int = 2,
                       repeats: int = 5) -> dict:
    """Median wall time of one optimiser step (teacher forward included) for kd-full, kd-lora and budgeted with
    every d = 0 (after the decay at F = 0), on copies of the same student and batch, interleaved round-robin so
    machine noise hits all three alike. This is what the training-compute proxy predicts."""
    loss_fn = DistillationLoss(cfg.temperature, cfg.kd_weight, cfg.loss_chunk)
    setups = {}
    for cls in (KDFull, KDLoRA, Budgeted):
        mcfg = dataclasses.replace(cfg, budget=0.0)
        meth = cls(mcfg)
        model = meth.wrap(copy.deepcopy(dense_student)).to(device)
        if isinstance(meth, Budgeted):
            for m in meth.gated.values():
                m.set_retention(0.0)
        ps = [p for p in model.parameters() if p.requires_grad]
        setups[cls.name] = (model, torch.optim.AdamW(ps, lr=1e-6))
    times: dict[str, list[float]] = {k: [] for k in setups}
    for i in range(warmup + repeats):
        for name, (model, opt) in setups.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            loss, _ = kd_step(model, teacher, loss_fn, x, device)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times[name].append((time.perf_counter() - t) * 1000)
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {**med, "budgeted_vs_full": med["budgeted"] / med["kd-full"],
            "lora_vs_full": med["kd-lora"] / med["kd-full"], "repeats": repeats}


def is_run_dir(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "summary.json").exists() and (path / "student").is_dir()


def latest_run(runs_dir: str | Path = "runs") -> Path:
    runs = [p for p in Path(runs_dir).glob("*") if p.is_dir() and is_run_dir(p)]
    if not runs:
        raise RunDirError(f"no finished run under {runs_dir}/ (train one with `bdlora train`, or pass RUN_DIR)")
    return max(runs, key=lambda p: (p / "summary.json").stat().st_mtime)


def load_run_student(run_dir: str | Path, device: str = "cpu"):
    """(model, tokenizer, summary) of a finished run, in its trained form (gated modules / PEFT adapter intact)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise RunDirError(f"{run_dir}: not a finished bdlora run (needs config.json, summary.json and student/)")
    sdir = run_dir / "student"
    model = AutoModelForCausalLM.from_pretrained(str(sdir), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(sdir))
    summary = read_json(run_dir / "summary.json")
    if (sdir / "adapter").exists():
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(sdir / "adapter"))
    elif (sdir / "budgeted.json").exists():
        from bdlora.methods import load_budgeted_student

        model = load_budgeted_student(sdir, model)
    return model.to(device).eval(), tok, summary
