"""What a training run is made of, built and checked before any run directory exists: the device, the teacher
(built or materialised on first use), the tokenised corpus and its training and held-out blocks, and the student
warm-started from the teacher's (or ``--student-init``'s) layers. ``prepare`` raises typed errors for bad input and
creates nothing but caches; ``train`` then opens the run directory and runs the loop."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from bdlora.base.errors import DataError, ModelError, UsageError
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import RunFacts
from bdlora.compress.calibrate import check_calib_tokens
from bdlora.data.blocks import DocumentBlocks, PackedBlocks, scored_blocks, training_blocks
from bdlora.data.corpora import check_spec, default_heldout, general_calib_data, load_parts, load_tokens, one_corpus
from bdlora.data.documents import BUILTIN
from bdlora.data.runtime_samples import check_folder
from bdlora.forms import LOWRANK
from bdlora.models.arch import check_lora_rank
from bdlora.models.teacher import TeacherSource, load_teacher
from bdlora.train import distributed as D
from bdlora.train.budgeted.start import needed
from bdlora.train.config import TrainConfig, resolve_defaults
from bdlora.train.reweight import SLICE_BLOCKS, Reweighter
from bdlora.train.student import build_student, check_same_vocabulary


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine (allowed here: auto, cpu)")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class Session:
    """Teacher, data and student, built and checked before any run directory is created."""

    cfg: TrainConfig
    device: torch.device
    teacher: torch.nn.Module
    tokenizer: object
    student: torch.nn.Module
    layer_indices: list[int]
    train_blocks: PackedBlocks | DocumentBlocks
    val_blocks: PackedBlocks
    calib_blocks: PackedBlocks | None = None  # --calib-data's training split (None: calibrate on train_blocks)
    eval_blocks: PackedBlocks | None = None  # --eval-data's held-out slice (never trained on)
    mixture: Reweighter | None = None  # --reweight-every: the components, their weights, the run's sampler
    facts: RunFacts = RunFacts()  # what was resolved on the way (teacher checkpoint, corpus cache, ...)

    @property
    def calibration_source(self):
        return self.calib_blocks if self.calib_blocks is not None else self.train_blocks


def prepare(cfg: TrainConfig, reporter: Reporter = SILENT, prefixes: bool = True) -> Session:
    """Validate options, load (or build) the teacher, tokenise the corpus, build the student. Raises typed errors
    for bad input; creates nothing but caches. ``prefixes``: whether ``teacher:N`` in a mixture continues the other
    parts' prefixes (``corpora.load_parts``; a run resumed from before they existed did not)."""
    cfg.validate()
    device = resolve_device(cfg.device)
    cache = cfg.cache_root()
    parts = check_spec(cfg.data)  # checks the paths before the (possibly long) teacher build
    if cfg.reweight_every and len(parts) < 2:
        raise UsageError(f"--reweight-every {cfg.reweight_every}: needs a --data mixture of two or more corpora "
                         f"(e.g. builtin:1,prose:1); --data {cfg.data} is one")
    if cfg.calib_data:
        check_spec(cfg.calib_data, "--calib-data")
    reporter.stage(f"loading teacher {cfg.teacher}")
    teacher, tokenizer, teacher_path = load_teacher(cfg.teacher, cache, device=str(device), on_stage=reporter.stage,
                                                    on_step=reporter.teacher_step)
    cfg = _resolve_sizes(resolve_defaults(cfg, builtin_teacher=cfg.teacher == BUILTIN), teacher)
    student, idx = _build_student(cfg, teacher, tokenizer, cache, reporter)
    student.to(device)
    runtime = cfg.samples_runtime and check_folder(cfg.samples_runtime, teacher_path, teacher.config.vocab_size)
    source = TeacherSource(teacher_path, teacher, tokenizer, runtime=runtime or None)  # what teacher:N samples from
    loaded = load_parts(cfg.data, tokenizer, cfg.heldout_fraction, cache, teacher=source, seed=cfg.seed,
                        reporter=reporter, prefixes=prefixes)  # read once: the mixture and its reweighting's parts
    data = one_corpus(loaded, cache)
    train_blocks = training_blocks(data.tokens("train"), cfg.seq_len, cfg.packing, tokenizer.eos_token_id,
                                   data.bos)
    if len(train_blocks) < 1:
        raise DataError(f"--data {cfg.data}: {data.meta['tokens']['train']} training tokens, fewer than one "
                        + (f"block of --seq-len {cfg.seq_len}" if cfg.packing == "pack" else "document"))
    val_blocks = scored_blocks(data.tokens("val"), cfg.seq_len, cfg.eval_tokens, f"--data {cfg.data}", bos=data.bos)
    eval_blocks = None
    if cfg.eval_data:
        ev = load_tokens(cfg.eval_data, tokenizer, None, cache, what="--eval-data", teacher=source, seed=cfg.seed,
                         reporter=reporter, prefixes=prefixes)
        eval_blocks = scored_blocks(ev.tokens("val"), cfg.seq_len, cfg.eval_tokens, f"--eval-data {cfg.eval_data}",
                                    bos=ev.bos)
    calib_blocks = None
    if needed(cfg.method, cfg.lora_init, cfg.allocation) or cfg.structured:
        general = general_calib_data(cfg.data, cfg.calib_data, teacher.config.vocab_size)
        if general != cfg.calib_data:  # recorded in the run's config.json as what the start calibrated on
            cfg = dataclasses.replace(cfg, calib_data=general, defaulted=(*cfg.defaulted, "calib_data"))
            reporter.stage(f"calibrating the start of a general-purpose teacher on {general} (--calib-data to "
                           "choose)")
        if cfg.calib_data and cfg.calib_data != cfg.data:
            calib = load_tokens(cfg.calib_data, tokenizer, None, cache, what="--calib-data", teacher=source,
                                seed=cfg.seed, reporter=reporter, prefixes=prefixes)
            calib_blocks = PackedBlocks(calib.tokens("train"), cfg.seq_len, bos=calib.bos)
        blocks = calib_blocks if calib_blocks is not None else train_blocks
        if "calib_tokens" in cfg.defaulted:  # a defaulted count fits the split; an explicit one must
            cfg.calib_tokens = min(cfg.calib_tokens, len(blocks) * blocks.seq_len)
        check_calib_tokens(blocks, cfg.calib_tokens, "--calib-data" if calib_blocks is not None else "--data")
    facts = RunFacts(teacher_path=str(teacher_path), layer_indices=tuple(idx),
                     teacher_layers=teacher.config.num_hidden_layers, data_cache=str(data.path),
                     data_tokens=data.meta["tokens"], samples_prefixes=prefixes)
    mixture = None
    if cfg.reweight_every:
        mixture = components(cfg, loaded, tokenizer)
    return Session(cfg, device, teacher, tokenizer, student, idx, train_blocks, val_blocks, calib_blocks, eval_blocks,
                   mixture, facts)


def components(cfg: TrainConfig, loaded, tokenizer) -> Reweighter:
    """--reweight-every: each component of the mixture on its own (``loaded``: the parts the mixture was cut from),
    its training blocks and ``SLICE_BLOCKS`` blocks of its held-out split."""
    train, held = [], []
    for p, t in loaded:
        train.append(training_blocks(t.tokens("train"), cfg.seq_len, cfg.packing, tokenizer.eos_token_id, t.bos))
        held.append(scored_blocks(t.tokens("val"), cfg.seq_len, SLICE_BLOCKS * cfg.seq_len,
                                  f"--data {p.spec} (--reweight-every)", bos=t.bos))
        if len(train[-1]) < 1:
            raise DataError(f"--data {p.spec}: no training sequence of --seq-len {cfg.seq_len} to draw")
    return Reweighter([p.spec for p, _ in loaded], train, held, [p.weight for p, _ in loaded], cfg.seed,
                      cfg.reweight_every)


def _resolve_sizes(cfg: TrainConfig, teacher) -> TrainConfig:
    """Student depth, sequence length (capped by the model's positions when defaulted), steps from --tokens and
    the held-out fraction, each checked against the teacher."""
    n_teacher, defaulted = teacher.config.num_hidden_layers, cfg.defaulted
    if cfg.student_layers is None and not cfg.student_init:  # with --student-init: all of its layers (below)
        cfg.student_layers = max(1, math.ceil(n_teacher / 2))
    if cfg.student_layers is not None and cfg.student_layers > n_teacher:
        raise UsageError(f"--student-layers {cfg.student_layers}: must be between 1 and the teacher's {n_teacher}")
    max_pos = getattr(teacher.config, "max_position_embeddings", None)
    if max_pos is not None and cfg.seq_len > max_pos:
        if "seq_len" not in defaulted:
            raise UsageError(f"--seq-len {cfg.seq_len}: above the model's max_position_embeddings ({max_pos})")
        cfg.seq_len = max_pos
    cfg.lora_rank = check_lora_rank(cfg.lora_rank, teacher.config, "lora_rank" in defaulted)
    if cfg.tokens is not None:  # a global budget: every step consumes batch x accum x seq tokens on each process
        world = D.env_from_launcher().world_size
        cfg.max_steps = max(1, cfg.tokens // (cfg.batch_size * cfg.grad_accum * cfg.seq_len * world))
    if cfg.heldout_fraction is None:
        cfg.heldout_fraction = default_heldout(cfg.data)  # None for a mixture: each component keeps its own
    return cfg


def _build_student(cfg: TrainConfig, teacher, tokenizer, cache, reporter: Reporter):
    """Layers from --student-init (default: the teacher), which must share the teacher's tokenizer."""
    source = teacher
    if cfg.student_init:
        reporter.stage(f"loading student init {cfg.student_init}")
        source, init_tok, _ = load_teacher(cfg.student_init, cache, device="cpu", what="--student-init")
        check_same_vocabulary(tokenizer, init_tok, f"--student-init {cfg.student_init}")
        if source.config.vocab_size != teacher.config.vocab_size:
            raise ModelError(f"--student-init {cfg.student_init}: embedding rows {source.config.vocab_size} != "
                             f"teacher's {teacher.config.vocab_size}")
        pairs = [n for n, m in source.named_modules() if type(m).__name__ == LOWRANK.module_class]
        if pairs:  # a student trains dense projections (narrower ones from a pruned folder are fine)
            raise ModelError(f"--student-init {cfg.student_init}: holds {len(pairs)} low-rank pairs (first "
                             f"{pairs[0]}); a student starts from dense projections: give the teacher or a folder "
                             "compressed with --forms channels")
    if cfg.student_layers is None:
        cfg.student_layers = source.config.num_hidden_layers
    if cfg.student_layers > source.config.num_hidden_layers:
        raise UsageError(f"--student-layers {cfg.student_layers}: must be between 1 and the source's "
                         f"{source.config.num_hidden_layers} layers")
    return build_student(source, cfg.student_layers, cfg.layer_selection, seed=cfg.seed)
