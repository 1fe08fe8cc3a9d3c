"""Training options: one dataclass (litgpt style), a docstring per field that the CLI turns into help text, and a
validator that collects every problem and raises once.

Fields left ``None`` are resolved per teacher by ``resolve``: the paper's values for a real teacher (SPEC 3), and
values scaled to the embedded default's size for ``--teacher builtin`` (SPEC 3 *(ours)*), documented in
``BUILTIN_DEFAULTS`` and the README.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from bdlora.controller import DEFAULT_EPS_ZERO, DEFAULT_RETENTION_EMA
from bdlora.errors import ConfigError
from bdlora.layers import DEFAULT_GATE_INIT
from bdlora.student import LAYER_SELECTIONS

METHODS = ("kd-full", "kd-lora", "budgeted")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainConfig:
    method: str = "budgeted"
    """kd-full (all weights), kd-lora (PEFT LoRA, dense frozen) or budgeted (gated LoRA + budget controller)."""
    teacher: str = "builtin"
    """'builtin' (the embedded default, built on first use) or a local Hugging Face causal-LM folder."""
    data: str = "builtin"
    """'builtin' (the Python standard library) or a .txt/.jsonl/.parquet file, folder, or save_to_disk folder."""
    student_layers: int | None = None
    """Decoder layers of the student (default: half the teacher's, rounded up)."""
    layer_selection: str = "mixed"
    """Which source layers warm-start the student: first, middle, last, mixed or scratch."""
    student_init: str | None = None
    """Checkpoint the student's layers come from (default: the teacher); must share the teacher's tokenizer."""
    seq_len: int | None = None
    """Tokens per packed block (default 1024, capped by the model; builtin 128)."""
    batch_size: int | None = None
    """Sequences per micro-batch (default 8; builtin 16)."""
    grad_accum: int = 1
    """Micro-batches per optimiser step."""
    max_steps: int | None = None
    """Optimiser steps (default 1000; builtin 600). Mutually exclusive with --tokens."""
    tokens: int | None = None
    """Train on this many tokens instead of a step count (steps = tokens / (batch * grad_accum * seq_len))."""
    lr: float | None = None
    """Peak learning rate of AdamW (cosine decay, warm-up 3% capped at 2000 steps). Default 3e-4; builtin 2e-3."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    temperature: float = 3.0
    """KD temperature tau."""
    kd_weight: float = 0.8
    """KD weight lambda in L = lambda L_KD + (1 - lambda) L_CE."""
    loss_chunk: int = 1024
    """Positions per LM-head chunk of the KD loss."""
    lora_rank: int | None = None
    """LoRA rank r (kd-lora) / r_max (budgeted). Default 128; builtin 16."""
    lora_alpha: float | None = None
    """LoRA alpha; the low-rank path is scaled by alpha / r. Default 256; builtin 32."""
    budget: float = 0.4
    """F, the dense fraction retained after the decay (budgeted)."""
    decay_start: float = 0.1
    """t0, start of the budget decay as a fraction of training (budgeted)."""
    decay_end: float = 0.3
    """t1, end of the budget decay (budgeted); t0 == t1 drops to F at once."""
    retention_ema: float = DEFAULT_RETENTION_EMA
    """EMA factor beta for the dense retentions, in [0, 1); 0 disables smoothing (budgeted)."""
    eps_zero: float = DEFAULT_EPS_ZERO
    """Retentions below this are clamped to 0 and the dense path is skipped (budgeted)."""
    gate_init: float = DEFAULT_GATE_INIT
    """Initial rank-gate logit (sigmoid(3) = 0.95) (budgeted)."""
    eval_every: int | None = None
    """Validation perplexity every N steps (default 200; builtin 100) and at the end."""
    eval_tokens: int | None = None
    """Held-out tokens scored for perplexity (default 1,048,576; builtin 32,768)."""
    heldout_fraction: float | None = None
    """Fraction of documents (by MD5 of their id) held out (default 0.002; builtin 0.02)."""
    save_every: int = 200
    """Checkpoint every N steps (0: only the final student)."""
    keep_last: int = 2
    """Checkpoints kept on disk."""
    measure_step_time: bool = True
    """Budgeted runs: time training steps of kd-full, kd-lora and budgeted (all d = 0) on the same student."""
    seed: int = 0
    """Seed of initialisation, LoRA factors and data order."""
    device: str = "auto"
    """auto (CUDA if available), cpu or cuda. bf16 autocast on CUDA, fp32 on CPU."""
    out: str | None = None
    """Run directory (default: RUNS_DIR/<time>-<method>)."""
    runs_dir: str = "runs"
    """Where run directories are created."""
    cache_dir: str | None = None
    """Cache of tokenised corpora and the builtin teacher (default ~/.cache/bdlora or $BDLORA_CACHE)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Resolved, derived values (not user options)."""


# Defaults for the embedded default teacher (1.8M parameters, 4 layers): the paper's rank 128 / alpha 256 and
# 1024-token sequences would dwarf a hidden size of 128, so rank and alpha keep the paper's alpha/r = 2 at r = 16.
BUILTIN_DEFAULTS = {"seq_len": 128, "max_steps": 600, "lr": 2e-3, "lora_rank": 16, "lora_alpha": 32.0,
                    "eval_every": 100, "eval_tokens": 32768, "batch_size": 16}
REAL_DEFAULTS = {"batch_size": 8, "seq_len": 1024, "max_steps": 1000, "lr": 3e-4, "lora_rank": 128,
                 "lora_alpha": 256.0,
                 "eval_every": 200, "eval_tokens": 1 << 20}

OPTION_NAMES = {f.name for f in fields(TrainConfig)} - {"extra"}


def field_help() -> dict[str, str]:
    """Field docstrings, read from this module's source (so help text and code never diverge)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body
    out = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            out[a.target.id] = b.value.value
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise ConfigError([f"--config {path}: no such file"])
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"--config {path}: not valid YAML ({str(e).splitlines()[0]})"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: must be a mapping of option: value"])
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - OPTION_NAMES)
    if unknown:
        raise ConfigError([f"--config {path}: unknown option(s) {', '.join(unknown)}"])
    return data


def merge(yaml_values: dict[str, Any], cli_values: dict[str, Any]) -> TrainConfig:
    """Defaults < YAML < explicit command-line flags (flags left unset on the command line arrive as None)."""
    values = {**yaml_values, **{k: v for k, v in cli_values.items() if v is not None}}
    return TrainConfig(**values)


def validate(cfg: TrainConfig) -> None:
    """Every problem of the user-facing options at once, as one ConfigError."""
    p: list[str] = []
    if cfg.method not in METHODS:
        p.append(f"--method {cfg.method!r}: unknown (allowed: {', '.join(METHODS)})")
    if cfg.layer_selection not in LAYER_SELECTIONS:
        p.append(f"--layer-selection {cfg.layer_selection!r}: unknown (allowed: {', '.join(LAYER_SELECTIONS)})")
    if cfg.device not in DEVICES:
        p.append(f"--device {cfg.device!r}: unknown (allowed: {', '.join(DEVICES)})")
    for name in ("batch_size", "grad_accum", "max_steps", "tokens", "seq_len", "eval_tokens", "loss_chunk",
                 "eval_every"):
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, int) or v < 1):
            p.append(f"--{name.replace('_', '-')} {v}: must be a positive integer")
    if cfg.student_layers is not None and cfg.student_layers < 1:
        p.append(f"--student-layers {cfg.student_layers}: must be >= 1")
    if cfg.max_steps is not None and cfg.tokens is not None:
        p.append("--max-steps and --tokens: give one, not both")
    if cfg.save_every < 0:
        p.append(f"--save-every {cfg.save_every}: must be >= 0")
    if cfg.keep_last < 1:
        p.append(f"--keep-last {cfg.keep_last}: must be >= 1")
    if cfg.lr is not None and not cfg.lr > 0:
        p.append(f"--lr {cfg.lr}: must be > 0")
    if cfg.lora_rank is not None and cfg.lora_rank < 1:
        p.append(f"--lora-rank {cfg.lora_rank}: must be >= 1")
    if cfg.lora_alpha is not None and not cfg.lora_alpha > 0:
        p.append(f"--lora-alpha {cfg.lora_alpha}: must be > 0")
    if not 0.0 <= cfg.budget <= 1.0:
        p.append(f"--budget {cfg.budget}: must be in [0, 1]")
    for name in ("decay_start", "decay_end"):
        v = getattr(cfg, name)
        if not 0.0 <= v <= 1.0:
            p.append(f"--{name.replace('_', '-')} {v}: must be in [0, 1]")
    if cfg.decay_start > cfg.decay_end:
        p.append(f"--decay-start {cfg.decay_start} > --decay-end {cfg.decay_end}: the decay must start before it ends")
    if not 0.0 <= cfg.retention_ema < 1.0:
        p.append(f"--retention-ema {cfg.retention_ema}: must be in [0, 1)")
    if not 0.0 < cfg.eps_zero < 1.0:
        p.append(f"--eps-zero {cfg.eps_zero}: must be in (0, 1)")
    if not cfg.temperature > 0:
        p.append(f"--temperature {cfg.temperature}: must be > 0")
    if not 0.0 <= cfg.kd_weight <= 1.0:
        p.append(f"--kd-weight {cfg.kd_weight}: must be in [0, 1]")
    if cfg.heldout_fraction is not None and not 0.0 < cfg.heldout_fraction < 1.0:
        p.append(f"--heldout-fraction {cfg.heldout_fraction}: must be in (0, 1)")
    if p:
        raise ConfigError(p)


def resolve_defaults(cfg: TrainConfig, builtin_teacher: bool) -> TrainConfig:
    """Fill the per-teacher defaults (see BUILTIN_DEFAULTS / REAL_DEFAULTS)."""
    defaults = BUILTIN_DEFAULTS if builtin_teacher else REAL_DEFAULTS
    values = dataclasses.asdict(cfg)
    defaulted = []
    for k, v in defaults.items():
        if values.get(k) is None and not (k == "max_steps" and values.get("tokens") is not None):
            values[k] = v
            defaulted.append(k)
    values["extra"] = {**values["extra"], "defaulted": defaulted}
    return TrainConfig(**values)
