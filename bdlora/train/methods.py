"""Training methods as strategy objects, so the loop in ``train.py`` is one explicit loop with no special cases.

A method wraps the dense student for training (``wrap``), may act before each optimiser step (``before_step``: the
budget controller) and log that in its own stream (``log_name``), reports the retentions every rank must agree on,
carries state for checkpoints, saves the trained student in its own form, adds its figures to the summary
(``finalize``) and turns the saved student into its deployment form (``compress``, for ``bdlora compress``). What a
method implies elsewhere (a rank, a budget, a peer) is ``method_table.METHOD_TABLE``'s:

    student/                    HF config + model.safetensors of the *dense* student + tokenizer (every method)
    student/adapter/            PEFT adapter (kd-lora)
    student/budgeted.safetensors, student/budgeted.json   gated-module factors, gates and retentions (budgeted)
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from bdlora.base.io import save_tensors, write_json
from bdlora.base.plots import plot_controller
from bdlora.base.runs import ADAPTER, CONTROLLER_LOG, META_FILE, STUDENT_META
from bdlora.models.arch import PROJECTIONS, base_model, dense_state_dict
from bdlora.models.budgeted.config import BudgetedConfig
from bdlora.models.budgeted.layer import DeployedModule
from bdlora.models.budgeted.model import (
    apply_budgeted_lora,
    build_deployed_model,
    compress_budgeted,
    declared_bits,
    dense_projections,
    gated_modules,
    narrow_sites,
    save_budgeted,
)
from bdlora.models.costs import (
    ModuleShape,
    compression_report,
    decide_module,
    is_attention,
    prune_decision,
    shapes_from_config,
    training_compute_proxy,
)
from bdlora.models.peft_compat import wrap_lora
from bdlora.train.budgeted.controller import BudgetController
from bdlora.train.budgeted.start import start_gated, start_peft
from bdlora.train.distill import DistillationLoss, kd_step


def save_dense_student(model: nn.Module, tokenizer, out_dir: Path, extra_config: dict | None = None) -> None:
    base = base_model(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = base.config
    config.save_pretrained(out_dir)
    state = dense_state_dict(model)
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_tensors(out_dir / "model.safetensors", state, metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    if extra_config:
        write_json(out_dir / STUDENT_META, extra_config)


def unpruned(config, shape: ModuleShape, keep: int) -> tuple[ModuleShape, int]:
    """(the shape ``shape`` had before its block was pruned to ``keep``, the source's key/value heads for an
    attention projection (0 for an MLP one)), from the model's config."""
    if not is_attention(shape.name):
        return shape.narrowed(int(config.intermediate_size)), 0
    heads = int(config.num_attention_heads)
    of = int(getattr(config, "num_key_value_heads", None) or heads)
    return shape.grouped(of, keep), of  # every width scaled back by of / keep


def compress_dense(model: nn.Module, lora_rank: int, provenance: dict):
    """kd-lora (PEFT adapter merged into dense: the LoRA baseline's deployment form) and kd-full (unchanged): every
    projection deployed dense, in the same architecture and with the same report keys."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    deployed = {}
    narrow = narrow_sites(model)  # a student started from a pruned folder
    bits = declared_bits(model)  # ... or from one keeping some projections at 8 bits
    for name, mod in dense_projections(model).items():
        keep = narrow.get(name.rsplit(".", 1)[0], {}).get("keep")
        if keep:  # reported against the full-width block it was pruned from
            full, of = unpruned(model.config, ModuleShape(name, mod.in_features, mod.out_features), keep)
            dec = prune_decision(full, keep, has_bias=mod.bias is not None, of=of)
        else:
            dec = decide_module(ModuleShape(name, mod.in_features, mod.out_features), 1.0, lora_rank, lora_rank,
                                has_bias=mod.bias is not None)
        dec.bits = bits.get(name, 0)
        bias = None if mod.bias is None else mod.bias.detach().clone()
        deployed[name] = DeployedModule(dec, weight=mod.weight.detach().clone(), bias=bias)
    report = compression_report([c.decision for c in deployed.values()], provenance.get("budget"), {},
                                baseline="dense")
    return build_deployed_model(model, deployed, provenance), report


class TrainingMethod:
    name = "base"
    log_name: str | None = None  # a per-step JSONL stream of this method's own (beside metrics.jsonl)

    def __init__(self, cfg):
        self.cfg = cfg

    def wrap(self, student: nn.Module, start=None) -> nn.Module:
        """The student as this method trains it; ``start`` (a ``train.budgeted.start.LowRankStart``) sets where its
        low-rank paths begin and their ranks (None: the SPEC's zero start at ``--lora-rank``)."""
        raise NotImplementedError

    def before_step(self, progress: float) -> dict | None:
        """Called once per optimiser step, before its forward; returns this step's log record (or None)."""
        return None

    def final_form(self, progress: float) -> bool:
        """Whether the student at this point of the schedule (0..1) is the form the run delivers (what
        ``--eval-data``'s best step may be chosen among)."""
        return True

    def step_metrics(self, record: dict | None) -> dict:
        """Fields of ``record`` that belong in metrics.jsonl."""
        return {}

    def retentions(self) -> list[float]:
        """Values that must be identical on every rank of a multi-process run (checked after each update)."""
        return []

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass

    def save_student(self, model: nn.Module, tokenizer, out_dir: Path) -> None:
        save_dense_student(model, tokenizer, out_dir, {"method": self.name})

    def mean_retained(self) -> float:
        """d_bar of the training-compute proxy (SPEC 5): the dense path runs in full for the baselines."""
        return 1.0

    def summary(self, model: nn.Module) -> dict:
        shapes = shapes_from_config(base_model(model).config.to_dict())
        ranks = self.ranks(model) or self.cfg.lora_rank
        return {"compute_proxy": training_compute_proxy(shapes, ranks, self.mean_retained())}

    def ranks(self, model: nn.Module) -> dict[str, int]:
        """Each trained module's LoRA rank (empty: one --lora-rank, or no LoRA)."""
        return {}

    def finalize(self, run_dir: Path, summary: dict, teacher, batch: torch.Tensor, device, stage) -> None:
        """Add the method's own artefacts and figures once the student is saved."""

    @staticmethod
    def compress(model: nn.Module, thresholds: BudgetedConfig, lora_rank: int | None, provenance: dict):
        """(the deployed model, its compression report): this method's trained student in the deployment form
        (``bdlora compress``); ``thresholds`` are the compression pass's, ``lora_rank`` the run's."""
        return compress_dense(model, 0, provenance)


class KDFull(TrainingMethod):
    """Full-parameter distillation: every student weight trains."""

    name = "kd-full"

    def wrap(self, student, start=None):
        for p in student.parameters():
            p.requires_grad_(True)
        if self.cfg.freeze_embeddings:  # tied or not, the input embedding and the head stay the teacher's
            for module in (student.get_input_embeddings(), student.get_output_embeddings()):
                for p in module.parameters():
                    p.requires_grad_(False)
        return student


class KDLoRA(TrainingMethod):
    """PEFT LoRA on the seven projection kinds (r, alpha from the config, dropout 0); dense weights frozen."""

    name = "kd-lora"

    def wrap(self, student, start=None):
        model = wrap_lora(student, r=self.cfg.lora_rank, lora_alpha=self.cfg.lora_alpha, lora_dropout=0.0,
                          target_modules=list(PROJECTIONS), bias="none", task_type="CAUSAL_LM",
                          rank_pattern={n: r for n, r in (start.ranks if start else {}).items()
                                        if r != self.cfg.lora_rank},
                          alpha_pattern={n: self.cfg.lora_alpha * r / self.cfg.lora_rank
                                         for n, r in (start.ranks if start else {}).items()
                                         if r != self.cfg.lora_rank})
        if start is not None:
            start_peft(model, start)
        return model

    def save_student(self, model, tokenizer, out_dir):
        save_dense_student(model, tokenizer, out_dir, {"method": self.name, "adapter": ADAPTER})
        model.save_pretrained(out_dir / ADAPTER, safe_serialization=True)

    @staticmethod
    def compress(model, thresholds, lora_rank, provenance):
        return compress_dense(model, lora_rank, provenance)  # the adapter merged; ranks priced as the LoRA baseline


class Budgeted(TrainingMethod):
    """Gated LoRA on the seven projection kinds with the budget controller setting the dense retentions."""

    name = "budgeted"
    log_name = CONTROLLER_LOG

    def wrap(self, student, start=None):
        # the dense student, kept to time kd-full / kd-lora / budgeted steps on the same weights at the end
        self.dense_copy = copy.deepcopy(student) if self.cfg.measure_step_time else None
        bcfg = self.cfg.budgeted()
        apply_budgeted_lora(student, bcfg.rank, bcfg.alpha, bcfg.gate_init, ranks=start.ranks if start else None)
        self.gated = gated_modules(student)
        if start is not None:
            start_gated(self.gated, start)
        self.controller = BudgetController.for_model(self.gated, bcfg, start.allocation if start else None)
        return student

    def before_step(self, progress):
        return self.controller.step(progress)

    def final_form(self, progress: float) -> bool:
        return progress >= self.cfg.decay_end  # the budget's dense paths are gone only once its decay is over

    def step_metrics(self, record):
        return {k: record[k] for k in ("budget", "retained", "zero")}

    def retentions(self):
        return [m.d for m in self.gated.values()]

    def ranks(self, model):
        return {n: m.rank for n, m in self.gated.items()}

    def state(self):
        return {"controller": self.controller.state_dict()}

    def load_state(self, state):
        self.controller.load_state_dict(state["controller"])

    def save_student(self, model, tokenizer, out_dir):
        save_dense_student(model, tokenizer, out_dir, {"method": self.name, "budgeted": META_FILE})
        save_budgeted(self.gated, self.cfg.budgeted(), out_dir)

    @staticmethod
    def compress(model, thresholds, lora_rank, provenance):
        return compress_budgeted(model, thresholds, provenance)  # harden, then drop / SVD / merge each dense path

    def mean_retained(self):
        return self.controller.mean_retained

    def summary(self, model):
        threshold = self.cfg.budgeted().gate_threshold
        rows = []
        for name, m in self.gated.items():
            g = m.gates().detach().float()
            rows.append({"name": name, "d": m.d, "gate_mean": float(g.mean()), "gate_min": float(g.min()),
                         "gate_max": float(g.max()), f"gates_above_{threshold:g}": int((g >= threshold).sum())})
        return {**super().summary(model), "modules": rows, "mean_retained": self.controller.mean_retained,
                "final_retained": self.controller.retained_fraction(),
                "final_fraction": self.controller.final_fraction}

    def finalize(self, run_dir, summary, teacher, batch, device, stage):
        plot_controller(run_dir / self.log_name, summary["modules"], run_dir / "controller.png")
        if self.dense_copy is not None:
            stage("timing training steps of kd-full, kd-lora and budgeted (d = 0) on the same student")
            summary["step_time_ms"] = measure_step_times(self.dense_copy, teacher, batch, self.cfg, device)


METHOD_CLASSES = {m.name: m for m in (KDFull, KDLoRA, Budgeted)}


def measure_step_times(dense_student, teacher, x, cfg, device, warmup: int = 2, repeats: int = 5) -> dict:
    """Median wall time of one optimiser step (teacher forward included) for kd-full, kd-lora and budgeted with
    every d = 0 (after the decay at F = 0), on copies of the same student and batch, interleaved round-robin so
    machine noise hits all three alike. This is what the training-compute proxy predicts."""
    loss_fn = DistillationLoss(cfg.temperature, cfg.kd_weight, cfg.loss_chunk)
    setups = {}
    for cls in (KDFull, KDLoRA, Budgeted):
        meth = cls(dataclasses.replace(cfg, budget=0.0, measure_step_time=False))
        model = meth.wrap(copy.deepcopy(dense_student)).to(device)
        for m in gated_modules(model).values():
            m.set_retention(0.0)
        ps = [p for p in model.parameters() if p.requires_grad]
        setups[cls.name] = (model, torch.optim.AdamW(ps, lr=1e-6))
    times: dict[str, list[float]] = {k: [] for k in setups}
    for i in range(warmup + repeats):
        for name, (model, opt) in setups.items():
            _sync(device)
            t = time.perf_counter()
            loss, _ = kd_step(model, teacher, loss_fn, x, device, precision=cfg.autocast)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            if i >= warmup:
                times[name].append((time.perf_counter() - t) * 1000)
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {**med, "budgeted_vs_full": med["budgeted"] / med["kd-full"],
            "lora_vs_full": med["kd-lora"] / med["kd-full"], "repeats": repeats}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
