"""Checkpoints of a training run, and stopping on a signal without losing work.

A checkpoint ``checkpoints/step-N/`` holds the trainable weights, the optimizer state (safetensors), the RNG states
and ``state.json`` (step, optimizer param groups, scheduler, method state, RNG metadata, and the SHA-256 of every
other file). It is built in a temp folder whose ``state.json`` is written last, then renamed into place, so a folder
with a ``state.json`` is complete; a torn or corrupted one is detected by its checksums and skipped on resume.

SIGINT/SIGTERM during training set a flag (``StopRequest``); the loop finishes the current optimiser step, saves a
checkpoint and stops, so an interrupted run loses nothing and never saves a half-updated state.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import shutil
import signal
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from bdlora.base.argv import fields_of
from bdlora.base.errors import RunDirError, Terminated, UsageError, flag
from bdlora.base.io import atomic_dir, load_tensors, read_json, save_tensors, sha256, write_json, write_text
from bdlora.base.runs import CKPT_OPTIMIZER, CKPT_RNG, CKPT_STATE, CKPT_TRAINABLE, CONFIG, RunDir
from bdlora.base.threads import from_options
from bdlora.train.config import TrainConfig, resolve_path

STATE_KEYS = ("step", "param_groups", "scheduler", "method", "rng", "files")
_NAME = re.compile(r"step-(\d{8})")  # what save_checkpoint names a checkpoint, and nothing else


def checkpoint_folders(ckpt_root: Path) -> list[Path]:
    """The checkpoints under ``ckpt_root``, oldest first: folders named exactly ``step-NNNNNNNN`` holding a
    ``state.json``. Anything else there (a folder someone put or wrote under that name, another run) is never read
    as a checkpoint and never removed by the rotation."""
    found = [p for p in Path(ckpt_root).glob("step-*") if _NAME.fullmatch(p.name) and p.is_dir()
             and not p.is_symlink() and (p / CKPT_STATE).is_file()]
    return sorted(found)


def _rng_state() -> tuple[dict, dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    np_state = np.random.get_state()
    meta = {"python": repr(random.getstate()), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    return tensors, meta


def _set_rng_state(tensors: dict, meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(ast.literal_eval(meta["python"]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), *n[2:]))


def save_checkpoint(ckpt_root: Path, step: int, model, optimizer, scheduler, method, extra: dict,
                    keep_last: int) -> Path:
    """Write ``ckpt_root/step-N`` atomically (see the module docstring); keep the newest ``keep_last``."""
    path = ckpt_root / f"step-{step:08d}"
    with atomic_dir(path) as tmp:
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        save_tensors(tmp / CKPT_TRAINABLE, trainable)
        opt_state = optimizer.state_dict()
        flat = {f"{idx}.{k}": v if torch.is_tensor(v) else torch.tensor(v)
                for idx, st in opt_state["state"].items() for k, v in st.items()}
        save_tensors(tmp / CKPT_OPTIMIZER, flat)
        rng_t, rng_meta = _rng_state()
        save_tensors(tmp / CKPT_RNG, rng_t)
        files = {f.name: sha256(f) for f in sorted(tmp.iterdir())}
        write_json(tmp / CKPT_STATE, {"step": step, "param_groups": opt_state["param_groups"],
                                         "scheduler": scheduler.state_dict(), "method": method.state(),
                                         "rng": rng_meta, "files": files, **extra})
    for old in checkpoint_folders(ckpt_root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def verify_checkpoint(ckpt: Path) -> str | None:
    """None when the checkpoint is complete and every file matches its recorded SHA-256, else what is wrong."""
    try:
        state = read_json(ckpt / CKPT_STATE)
    except (OSError, ValueError) as e:
        return f"state.json unreadable ({type(e).__name__})"
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        return f"state.json lacks {', '.join(missing)}"
    named = _NAME.fullmatch(ckpt.name)
    if type(state["step"]) is not int or named is None or state["step"] != int(named.group(1)):
        # state.json is written last and carries no checksum of its own: its step must be the one its folder names
        return f"state.json records step {str(state['step'])[:20]!r}, not the folder's"
    if not isinstance(state["files"], dict) or not state["files"]:
        return "state.json records no files"
    for name, digest in state["files"].items():
        f = ckpt / name
        if not f.is_file():
            return f"{name} missing"
        if sha256(f) != digest:
            return f"{name} checksum mismatch"
    return None


def latest_checkpoint(run_dir: Path, on_warning=None) -> Path | None:
    """The newest checkpoint that verifies; a corrupt newer one is skipped with a warning (and left on disk)."""
    for ckpt in reversed(checkpoint_folders(Path(run_dir) / "checkpoints")):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            return ckpt
        msg = f"checkpoint {ckpt.name} is corrupt ({problem}); falling back to the previous one"
        if on_warning is not None:
            on_warning(f"warning: {msg}")
        else:
            warnings.warn(msg, stacklevel=2)
    return None


def remove_stale(ckpt_root: Path) -> None:
    """Temp folders of a save that was killed half-way."""
    for stale in ckpt_root.glob(".step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(ckpt: Path, model, optimizer, scheduler, method, max_steps: int | None = None) -> dict:
    """Restore a verified checkpoint. Its trainable tensors must be exactly the model's (names and shapes) and its
    step within the run's ``max_steps``: a checkpoint edited by hand (its checksums updated) is refused in one line
    instead of failing half-way through the restore."""
    state = read_json(ckpt / CKPT_STATE)
    if max_steps is not None and not 0 < state["step"] <= max_steps:
        raise RunDirError(f"{ckpt}: records step {state['step']}, outside this run's 1..{max_steps}; the checkpoint "
                          "is damaged")
    trainable = load_tensors(ckpt / CKPT_TRAINABLE)
    params = dict(model.named_parameters())
    _check_same_tensors(ckpt / CKPT_TRAINABLE, trainable,
                        {n: p for n, p in params.items() if p.requires_grad})
    with torch.no_grad():
        for n, t in trainable.items():
            params[n].copy_(t)
    flat = load_tensors(ckpt / CKPT_OPTIMIZER)
    opt_state: dict = {"state": {}, "param_groups": state["param_groups"]}
    for key, v in flat.items():
        idx, k = key.split(".", 1)
        opt_state["state"].setdefault(int(idx), {})[k] = v
    try:
        optimizer.load_state_dict(opt_state)
        scheduler.load_state_dict(state["scheduler"])
        method.load_state(state["method"])
        _set_rng_state(load_tensors(ckpt / CKPT_RNG), state["rng"])
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
        raise RunDirError(f"{ckpt}: its optimiser, scheduler, method or RNG state does not fit this run "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); the checkpoint "
                          "is damaged") from None
    return state


def _check_same_tensors(path: Path, found: dict, expected: dict) -> None:
    extra, missing = sorted(set(found) - set(expected)), sorted(set(expected) - set(found))
    if extra or missing:
        what = f"unknown tensor {extra[0]}" if extra else f"no tensor {missing[0]}"
        raise RunDirError(f"{path}: {what} ({len(found)} tensors, the run trains {len(expected)}); the checkpoint "
                          "is damaged")
    for name, t in found.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise RunDirError(f"{path}: {name} has shape {tuple(t.shape)}, the run's is "
                              f"{tuple(expected[name].shape)}; the checkpoint is damaged")


def truncate_jsonl(path: Path, max_step: int, on_warning=None) -> None:
    """Keep the records of steps <= ``max_step``; a torn last line (a crash mid-append) is dropped with a warning,
    any other unreadable line is an error naming it."""
    if not path.exists():
        return
    lines = path.read_text(errors="replace").splitlines()
    keep = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                if on_warning is not None:
                    on_warning(f"warning: {path.name}: dropped a partial last line (written when the run stopped)")
                continue
            raise RunDirError(f"{path}:{i + 1}: not valid JSON; the log is damaged") from None
        if isinstance(rec, dict) and rec.get("step", 0) <= max_step:
            keep.append(line)
    write_text(path, "".join(line + "\n" for line in keep))


@contextmanager
def stops_deferred():
    """SIGINT and SIGTERM held while a new run's folder is written and read back (its config, structure and low-rank
    start): a ``StopRequest`` over that window, the stop it records handed, once the window ends, to the handler that
    was in place (the CLI's: exit 130 or 143, the unstarted run removed), so a stop never lands inside a write or a
    read (under load a SIGTERM there surfaced as "its low-rank start does not load"); a second signal stops at once,
    as in training."""
    stop = StopRequest()
    try:
        yield
    finally:
        stop.restore()
        stop.deliver()


class StopRequest:
    """SIGINT/SIGTERM set ``requested``; a second signal stops at once (KeyboardInterrupt). Only installs handlers in
    the main thread; ``restore`` puts the previous ones back."""

    def __init__(self):
        self.requested: str | None = None
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested:  # a second signal: stop now (exit 143 when it is SIGTERM, as the CLI's own handler)
            raise Terminated("terminated (SIGTERM)") if signum == signal.SIGTERM else KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def restore(self):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def deliver(self):
        """The stop recorded (if any) to the handler that was in place before: called, or, where that was the
        system's default, the signal sent again."""
        if not self.requested:
            return
        sig = signal.Signals[self.requested]
        handler = self._old.get(sig)
        if callable(handler):
            handler(sig, None)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), sig)


def drop_unstarted(run_dir) -> str:
    """A new run interrupted (Ctrl-C, SIGTERM) before its first checkpoint has nothing to continue from: its folder
    (config.json, the low-rank start) is removed, so ``--out`` can be given again, as after a failure. Returns what
    was done ("" when it has a checkpoint: it resumes)."""
    if not run_dir.path.is_dir() or any(run_dir.checkpoints_dir.glob("step-*")):
        return ""
    shutil.rmtree(run_dir.path, ignore_errors=True)
    return f"{run_dir.path} removed (no checkpoint to continue from)"


# Options a resumed run may change (where/how often it writes or measures, never the weights); the rest are fixed
RESUME_MUTABLE = ("save_every", "keep_last", "eval_every", "device", "measure_step_time", "cache_dir")


def resume_config(run: RunDir, overrides: dict | None = None) -> TrainConfig:
    """The stored options of an unfinished run, with the allowed ``overrides`` applied; any other changed option is
    refused (a different method, model or data would silently make a different run)."""
    run.require_resumable()
    stored = run.config()
    known = fields_of(TrainConfig)  # the dials' fields too, as a run's config.json holds them
    values = {k: v for k, v in stored.items() if k in known}
    for k, v in (overrides or {}).items():
        if k == "out" and v is not None and Path(v).resolve() != run.path.resolve():
            raise UsageError(f"--out {v}: a resumed run continues in its own folder {run.path}; drop --out")
        if v is None or k in ("out", "runs_dir"):
            continue
        if k in RESUME_MUTABLE:
            values[k] = v
        elif stored.get(k) != v and stored.get(k) != resolve_path(v if isinstance(v, str) else None):
            name = flag(k)
            raise UsageError(f"{name} {v}: this run was started with {name} {stored.get(k)}; --resume cannot change "
                             f"it (start a new run; changeable on resume: "
                             f"{', '.join(flag(m) for m in RESUME_MUTABLE)})")
    try:
        cfg = from_options(TrainConfig, values)
    except TypeError as e:
        raise RunDirError(f"{run.path / CONFIG}: not a bdlora training config ({e})") from None
    return cfg
