"""Training options (and those of ``compress --one-shot``): dataclasses (litgpt style), a docstring per field that the
CLI turns into help text, and a validator that collects every problem and raises once.

Fields left ``None`` are resolved per teacher by ``resolve_defaults``: for a real teacher the paper's rank, alpha,
sequence length and learning rate with a short budget fit for a first run (``REAL_DEFAULTS``; the paper's full budget
is the ``paper`` recipe, ``--config paper``), and values scaled to the embedded default's size for ``--teacher
builtin`` (SPEC 3 *(ours)*), documented in ``BUILTIN_DEFAULTS`` and the README. The Budgeted LoRA settings take
their defaults from ``BudgetedConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bdlora.base.argv import fields_of
from bdlora.base.errors import Checks, shown
from bdlora.base.method_table import GATED, METHODS, Method, method_of
from bdlora.base.settings import Settings
from bdlora.base.threads import flat, from_options
from bdlora.data.documents import BUILTIN
from bdlora.forms import LOWRANK
from bdlora.forms.dials import TrainDials
from bdlora.models.budgeted.config import ALLOCATIONS, LORA_INITS, BudgetedConfig
from bdlora.models.budgeted.config import DEFAULTS as BUDGETED
from bdlora.train.defaults import BUILTIN_DEFAULTS, REAL_DEFAULTS, teacher_defaults
from bdlora.train.forms_flags import train_forms_problems
from bdlora.train.stopping import stopping_problems

DEVICES = ("auto", "cpu", "cuda")
LAYER_SELECTIONS = ("first", "middle", "last", "mixed", "scratch")
PACKINGS = ("pack", "truncate")
AUTOCASTS = ("bf16", "fp32")


@dataclass
class TrainConfig(Settings):
    method: str = GATED
    """kd-full (all weights), kd-lora (PEFT LoRA, dense frozen) or budgeted (gated LoRA + budget controller)."""
    teacher: str = BUILTIN
    """'builtin' (the embedded default, built on first use) or a local Hugging Face causal-LM folder."""
    data: str = BUILTIN
    """'builtin' (the Python standard library), 'prose' (English documentation, fetched once), 'teacher:N' (N
    tokens sampled from the teacher, cached), a .txt/.jsonl/.parquet file, folder or save_to_disk folder, or a
    mixture of these: builtin:0.5,prose:0.5."""
    samples_runtime: str | None = None
    """Generate teacher:N samples through this onnxruntime-genai folder of the teacher (`bdlora export genai TEACHER
    --precision int4`: batched, at the deploy runtime's speed) instead of PyTorch; cached apart from PyTorch's."""
    calib_data: str | None = None
    """The corpus the whitened start and the quality allocation are calibrated on, as --data (default: --data);
    e.g. teacher:65536 or builtin:0.5,prose:0.5."""
    student_layers: int | None = None
    """Decoder layers of the student (default: half the teacher's, rounded up; with --student-init, all of its
    layers)."""
    layer_selection: str = "mixed"
    """Which source layers warm-start the student: first, middle, last, mixed or scratch."""
    student_init: str | None = None
    """Checkpoint the student's layers come from (default: the teacher); must share the teacher's tokenizer."""
    seq_len: int | None = None
    """Tokens per training sequence (a default is capped by the model's positions)."""
    packing: str = "pack"
    """How documents become sequences: 'pack' (EOS-separated documents cut into seq_len blocks, nanoGPT) or
    'truncate' (one document per sequence, its first seq_len tokens, shorter ones padded and the padding left out of
    the loss: the paper's). --tokens counts sequence slots either way."""
    batch_size: int | None = None
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimiser step."""
    max_steps: int | None = None
    """Optimiser steps; mutually exclusive with --tokens."""
    tokens: int | None = None
    """Train on this many tokens in all instead of a step count (steps = tokens / (batch * grad_accum * seq_len *
    processes): the budget is global, as the paper's 2.55B tokens over two GPUs)."""
    lr: float | None = None
    """Peak learning rate of AdamW (cosine decay, warm-up 3% of the steps, at least 10, capped at 2000)."""
    weight_decay: float = 0.0
    """AdamW weight decay (the paper's 0)."""
    adam_beta1: float = 0.9
    """AdamW beta1. The paper does not state its betas; 0.9 / 0.95 are nanoGPT's and most LLM recipes'."""
    adam_beta2: float = 0.95
    """AdamW beta2 (see --adam-beta1)."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    temperature: float | None = None
    """KD temperature tau."""
    kd_weight: float | None = None
    """KD weight lambda in L = lambda L_KD + (1 - lambda) L_CE."""
    freeze_embeddings: bool | None = None
    """kd-full: keep the token embeddings and the LM head frozen (kd-lora and budgeted never train them)."""
    loss_chunk: int = 1024
    """Positions per LM-head chunk of the KD loss."""
    kd_topk: int = 0
    """Distil from the teacher's K most likely next tokens at tau (the rest of its mass as one bucket), computed
    once per training sequence and cached (CACHE/kd-topk), so later epochs, reruns and sweep members on the same
    teacher and data skip the teacher's forward; 0: the full vocabulary, the teacher run at every step (the paper)."""
    lora_rank: int | None = None
    """LoRA rank r (kd-lora) / r_max (budgeted)."""
    lora_alpha: float | None = None
    """LoRA alpha; the low-rank path is scaled by alpha / r."""
    budget: float = BUDGETED.budget
    """F, the dense fraction retained after the decay (budgeted)."""
    decay_start: float = BUDGETED.decay_start
    """t0, start of the budget decay as a fraction of training (budgeted)."""
    decay_end: float = BUDGETED.decay_end
    """t1, end of the budget decay (budgeted); t0 == t1 drops to F at once."""
    retention_ema: float = BUDGETED.retention_ema
    """EMA factor beta for the dense retentions, in [0, 1); 0 disables smoothing (budgeted)."""
    eps_zero: float = BUDGETED.eps_zero
    """Retentions below this are clamped to 0 and the dense path is skipped (budgeted)."""
    gate_init: float = BUDGETED.gate_init
    """Initial rank-gate logit (sigmoid(3) = 0.95) (budgeted)."""
    lora_init: str | None = None
    """How the low-rank paths start (kd-lora, budgeted): zero (LoRA's B = 0: learnt from nothing; the paper),
    whitened (each projection's activation-aware truncated SVD, measured on --calib-tokens; the frozen dense path
    holds the residual W - B A, so the student is unchanged until the budget removes the dense path) or svd (plain
    truncated SVD). The paper recipe pins zero."""
    allocation: str | None = None
    """Which dense paths the budget removes (budgeted): cost (the paper: cheapest first, one --lora-rank for all) or
    quality (per-module ranks where the Fisher-weighted truncation error per MAC saved is least). The paper recipe
    pins cost."""
    dials: TrainDials = TrainDials()
    """--mac-ratio (with --allocation quality), --precision, --quant, --forms (the structure the student starts
    as), --speedup, --width-multiple: what the start's allocation is given (``forms.dials.Dials``, shared with
    compress --one-shot)."""
    calib_tokens: int | None = None
    """Training-split tokens the whitened init and the quality allocation are measured on (a default is cut to the
    whole split when that is smaller)."""
    eval_every: int | None = None
    """Validation perplexity every N steps and at the end."""
    eval_tokens: int | None = None
    """Held-out tokens scored for perplexity."""
    eval_data: str | None = None
    """A corpus the run never trains on (as --data; none of its corpora may be in --data), scored on its held-out
    slice at every validation: the saved student is the step best there (a budgeted run's once its budget
    schedule is over), e.g. fortunes."""
    reweight_every: int = 0
    """With a --data mixture: every N steps move its weights toward the components where the student trails the
    teacher most on their held-out slices (Sheared-LLaMA's dynamic batch loading; the weights are logged in
    metrics.jsonl and the summary); 0 keeps the weights given."""
    time_budget: str | None = None
    """Fit the run in this wall-clock time from the start of the command (90s, 60m, 1.5h; loading, teacher samples
    and calibration included): the step count is planned from the first steps' measured time and the run stops
    cleanly when the next step and the finish would no longer fit. Replaces --max-steps and --tokens."""
    heldout_fraction: float | None = None
    """Fraction of documents (by MD5 of their id) held out (default: the corpus's own, 0.02 for the builtin corpus
    and 0.002 for others)."""
    save_every: int = 200
    """Checkpoint every N steps (0: only the final student)."""
    keep_last: int = 2
    """Checkpoints kept on disk."""
    measure_step_time: bool = True
    """Budgeted runs: time training steps of kd-full, kd-lora and budgeted (all d = 0) on the same student."""
    seed: int = 0
    """Seed of initialisation, LoRA factors and data order."""
    device: str = "auto"
    """auto (CUDA if available), cpu or cuda."""
    autocast: str | None = None
    """bf16 or fp32 forward and backward (weights and optimiser stay fp32). Default: bf16 on CUDA, fp32 on CPU."""
    out: str | None = None
    """Run directory (default: RUNS_DIR/<time>-<method>)."""
    runs_dir: str = "runs"
    """Where runs live: run folders, compressed models and sweeps (default runs/)."""
    cache_dir: str | None = None
    """Cache of tokenised corpora and the builtin teacher (default ~/.cache/bdlora or $BDLORA_CACHE)."""
    defaulted: tuple[str, ...] = ()
    """The options the teacher's defaults filled (resolved by ``resolve_defaults``, not a user option): where a
    value may be fitted to the teacher or data, a defaulted one is, an explicit one is checked."""

    @property
    def traits(self) -> Method:
        """What ``method`` implies (``METHOD_TABLE``)."""
        return method_of(self.method)

    @property
    def structured(self) -> bool:
        """Whether the student starts as a one-shot structure (``--forms`` beyond lowrank, or ``--speedup``)."""
        return self.dials.forms not in (None, LOWRANK.name) or self.dials.whole_step

    def budgeted(self) -> BudgetedConfig:
        """The Budgeted LoRA settings of this run (rank and alpha resolved)."""
        return BudgetedConfig(rank=BUDGETED.rank if self.lora_rank is None else self.lora_rank,
                              alpha=BUDGETED.alpha if self.lora_alpha is None else self.lora_alpha,
                              gate_init=self.gate_init, budget=self.budget, decay_start=self.decay_start,
                              decay_end=self.decay_end, retention_ema=self.retention_ema, eps_zero=self.eps_zero)

    def cache_root(self) -> Path | None:
        """The cache folder given by --cache-dir (user-expanded), or None for the default one."""
        return Path(self.cache_dir).expanduser() if self.cache_dir else None

    def check(self, c: Checks) -> Checks:
        """Every problem of the user-facing options at once, as one ConfigError (values from YAML included, so a
        ``"0.4"`` string or a ``true`` batch size is refused like a bad flag)."""
        c.choice("method", self.method, METHODS)
        c.choice("layer_selection", self.layer_selection, LAYER_SELECTIONS)
        c.choice("packing", self.packing, PACKINGS)
        c.choice("device", self.device, DEVICES)
        if self.autocast is not None:
            c.choice("autocast", self.autocast, AUTOCASTS)
        if self.lora_init is not None:
            c.choice("lora_init", self.lora_init, LORA_INITS)
        if self.allocation is not None:
            c.choice("allocation", self.allocation, ALLOCATIONS)
        d = self.dials
        d.check(c)
        if d.precision is not None:
            c.require(self.structured or (self.traits.gated and self.allocation != "cost"
                                          and d.mac_ratio is not None),
                      f"--precision {d.precision}: allocates a budgeted student's start by decode time; give "
                      "--method budgeted --allocation quality --mac-ratio R (or --forms F)")
        train_forms_problems(c, self)
        for name in ("teacher", "data", "samples_runtime", "calib_data", "student_init", "out", "runs_dir",
                     "cache_dir"):
            c.text(name, getattr(self, name))
        for name in ("batch_size", "grad_accum", "max_steps", "tokens", "eval_tokens", "loss_chunk", "eval_every",
                     "student_layers", "keep_last", "calib_tokens"):
            c.integer(name, getattr(self, name), lo=1)
        c.integer("seq_len", self.seq_len, lo=2, what=" (a block needs a token and its successor)")
        for name in ("save_every", "kd_topk", "seed", "reweight_every"):
            c.integer(name, getattr(self, name), lo=0)
        c.require(self.max_steps is None or self.tokens is None, "--max-steps and --tokens: give one, not both")
        stopping_problems(c, self)
        c.number("lr", self.lr, lo=0.0, lo_open=True)
        c.number("weight_decay", self.weight_decay, lo=0.0)
        c.number("adam_beta1", self.adam_beta1, 0.0, 1.0, hi_open=True)
        c.number("adam_beta2", self.adam_beta2, 0.0, 1.0, hi_open=True)
        c.number("grad_clip", self.grad_clip, lo=0.0, lo_open=True)
        c.number("temperature", self.temperature, lo=0.0, lo_open=True)
        c.number("kd_weight", self.kd_weight, 0.0, 1.0)
        c.number("heldout_fraction", self.heldout_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        c.require(isinstance(self.measure_step_time, bool),
                  f"--measure-step-time {shown(self.measure_step_time)}: must be true or false")
        self.budgeted().check(c)
        return c


# The objective: the paper's (tau 3, lambda 0.8 over the full vocabulary) for every run. Logit-only forward KL at tau 1
# (Minitron's healing loss, --temperature 1 --kd-weight 1) was measured as the default for healing a structure and
# lost: SmolLM2 channels,groups 1.2x, kd-lora 150 steps of builtin:1,prose:1, mixture 20.39 against 18.42 and fortunes
# 165.4 against 166.2 (docs/smollm2.md). Healing a structure freezes kd-full's embeddings and head (a frozen head keeps
# what the teacher knew of tokens the healing data does not hold); the paper's kd-full trains every weight.
OBJECTIVE_DEFAULTS = {"paper": {"temperature": 3.0, "kd_weight": 0.8, "freeze_embeddings": False},
                      "heal": {"temperature": 3.0, "kd_weight": 0.8, "freeze_embeddings": True}}

# The peak learning rate follows the teacher and how the trained paths start (measured, docs/results.md "Learning
# rate by start"): from nothing (LoRA's zero start, or kd-full's copied weights) the builtin student needs 2e-3; a
# whitened or SVD start is already close to the teacher and needs healing, not learning: at 2e-3 the builtin
# quickstart student ended at 29.65 (teacher 27.87), at 1e-3 27.77 and at 5e-4 27.77. Real teachers: the paper's
# 3e-4 from zero; from the whitened start SmolLM2 at 1.2x (the smollm2-cpu recipe, 40 steps) ended at 20.66 at 3e-4
# and 19.82 at 1e-4 (teacher 17.86).
DEFAULT_LR = {("builtin", "zero"): 2e-3, ("builtin", "start"): 1e-3, ("real", "zero"): 3e-4, ("real", "start"): 1e-4}


def _shown(v) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


def defaults_help() -> dict[str, str]:
    """The per-teacher defaults as ``bdlora train --help`` shows them, written from ``REAL_DEFAULTS``,
    ``BUILTIN_DEFAULTS`` and ``DEFAULT_LR`` (each value's one home)."""
    notes = {}
    for k in REAL_DEFAULTS.keys() | BUILTIN_DEFAULTS.keys():
        real, builtin = REAL_DEFAULTS.get(k), BUILTIN_DEFAULTS.get(k)
        notes[k] = (f"Default {_shown(real)}." if real == builtin else
                    f"Default {_shown(real)}; builtin teacher {_shown(builtin)}.")
    paper, heal = OBJECTIVE_DEFAULTS["paper"], OBJECTIVE_DEFAULTS["heal"]
    for k in paper:
        heals = f"; healing a --forms structure {_shown(heal[k])}" if paper[k] != heal[k] else ""
        notes[k] = f"Default {_shown(paper[k])}{heals}."
    lr = {k: _shown(v) for k, v in DEFAULT_LR.items()}
    notes["lr"] = (f"Default by teacher and start: from the whitened or SVD start {lr['real', 'start']} (builtin "
                   f"teacher {lr['builtin', 'start']}), from zero {lr['real', 'zero']} (builtin teacher "
                   f"{lr['builtin', 'zero']}).")
    return notes


def default_lr(builtin_teacher: bool, method: str, lora_init: str | None) -> float:
    """The peak learning rate ``--lr`` defaults to (see ``DEFAULT_LR``)."""
    start = "zero" if not method_of(method).low_rank or lora_init in (None, "zero") else "start"
    return DEFAULT_LR[("builtin" if builtin_teacher else "real", start)]


OPTION_NAMES = tuple(n for n in fields_of(TrainConfig) if n != "defaulted")  # the dials' fields, not `dials`


RUN_LENGTH = ("max_steps", "tokens", "time_budget")  # each alone says how long a run trains


def merge(yaml_values: dict[str, Any], cli_values: dict[str, Any]) -> TrainConfig:
    """Defaults < YAML < explicit command-line flags (flags left unset on the command line arrive as None). How long
    a run trains is one setting given three ways: a flag giving one of them replaces the file's (a recipe's
    max_steps no longer blocks --time-budget)."""
    given = {k: v for k, v in cli_values.items() if v is not None}
    if any(k in given for k in RUN_LENGTH):
        yaml_values = {k: v for k, v in yaml_values.items() if k not in RUN_LENGTH}
    values = {**yaml_values, **given}
    return from_options(TrainConfig, values)


def resolve_path(value: str | None) -> str | None:
    """A local path option stored absolute (so the run can be read from any working directory); 'builtin', presets
    and hub ids are kept as given."""
    if value is None or value == BUILTIN:
        return value
    p = Path(value).expanduser()
    return str(p.resolve()) if p.exists() else value


def resolve_defaults(cfg: TrainConfig, builtin_teacher: bool) -> TrainConfig:
    """Fill the per-teacher defaults (see BUILTIN_DEFAULTS / REAL_DEFAULTS) and store local paths absolute."""
    defaults = {**teacher_defaults(builtin_teacher),
                **OBJECTIVE_DEFAULTS["heal" if cfg.structured else "paper"]}
    values = flat(cfg)
    defaulted = []
    for k, v in defaults.items():
        if values.get(k) is None and not (k == "max_steps" and values.get("tokens") is not None):
            values[k] = v
            defaulted.append(k)
    if values.get("lr") is None:
        values["lr"] = default_lr(builtin_teacher, values["method"], values["lora_init"])
        defaulted.append("lr")
    for k in ("teacher", "data", "samples_runtime", "calib_data", "student_init"):
        values[k] = resolve_path(values[k])
    if values["cache_dir"]:
        values["cache_dir"] = str(Path(values["cache_dir"]).expanduser().resolve())
    values["defaulted"] = tuple(defaulted)
    return from_options(TrainConfig, values)
