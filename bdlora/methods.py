"""Training methods as small strategy objects, so the loop in ``train.py`` is one explicit loop for all of them.

A method wraps the dense student for training (``wrap``), may act before each optimiser step (``before_step``: the
budget controller), carries state for checkpoints, and saves the trained student in its own form:

    student/                    HF config + model.safetensors of the *dense* student + tokenizer (every method)
    student/adapter/            PEFT adapter (kd-lora)
    student/budgeted.safetensors, student/budgeted.json   gated-module factors, gates and retentions (budgeted)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from bdlora.controller import BudgetController
from bdlora.costs import PROJECTIONS
from bdlora.distill import base_model
from bdlora.io import save_tensors, write_json
from bdlora.layers import GatedLoRALinear, apply_budgeted_lora, gated_modules


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain HF state dict of a (possibly PEFT- or gated-LoRA-wrapped) student: adapter tensors dropped and
    ``base_layer.`` unwrapped, so it loads into the unwrapped architecture."""
    base = base_model(model)
    out = {}
    for k, v in base.state_dict().items():
        if any(t in k for t in ("lora_", "gate_logits", "retention", "lora_dropout")):
            continue
        out[k.replace(".base_layer.", ".")] = v
    return out


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
        write_json(out_dir / "bdlora_student.json", extra_config)


class TrainingMethod:
    name = "base"

    def __init__(self, cfg):
        self.cfg = cfg

    def wrap(self, student: nn.Module) -> nn.Module:
        raise NotImplementedError

    def before_step(self, progress: float) -> dict | None:
        return None

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass

    def save_student(self, model: nn.Module, tokenizer, out_dir: Path) -> None:
        save_dense_student(model, tokenizer, out_dir, {"method": self.name})

    def summary(self, model: nn.Module) -> dict:
        return {}


class KDFull(TrainingMethod):
    """Full-parameter distillation: every student weight trains."""

    name = "kd-full"

    def wrap(self, student):
        for p in student.parameters():
            p.requires_grad_(True)
        return student


class KDLoRA(TrainingMethod):
    """PEFT LoRA on the seven projection kinds (r, alpha from the config, dropout 0); dense weights frozen."""

    name = "kd-lora"

    def wrap(self, student):
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(r=self.cfg.lora_rank, lora_alpha=self.cfg.lora_alpha, lora_dropout=0.0,
                          target_modules=list(PROJECTIONS), bias="none", task_type="CAUSAL_LM")
        return get_peft_model(student, lcfg)

    def save_student(self, model, tokenizer, out_dir):
        save_dense_student(model, tokenizer, out_dir, {"method": self.name, "adapter": "adapter"})
        model.save_pretrained(out_dir / "adapter", safe_serialization=True)


class Budgeted(TrainingMethod):
    """Gated LoRA on the seven projection kinds with the budget controller setting the dense retentions."""

    name = "budgeted"

    def wrap(self, student):
        apply_budgeted_lora(student, self.cfg.lora_rank, self.cfg.lora_alpha, self.cfg.gate_init)
        self.gated = gated_modules(student)
        self.controller = BudgetController.for_model(
            self.gated, final_fraction=self.cfg.budget, decay_start=self.cfg.decay_start,
            decay_end=self.cfg.decay_end, ema=self.cfg.retention_ema, eps_zero=self.cfg.eps_zero)
        return student

    def before_step(self, progress):
        return self.controller.step(progress)

    def state(self):
        return {"controller": self.controller.state_dict()}

    def load_state(self, state):
        self.controller.load_state_dict(state["controller"])

    def save_student(self, model, tokenizer, out_dir):
        save_dense_student(model, tokenizer, out_dir, {"method": self.name, "budgeted": "budgeted.json"})
        tensors = {}
        for name, m in self.gated.items():
            tensors[f"{name}.lora_A"] = m.lora_A
            tensors[f"{name}.lora_B"] = m.lora_B
            tensors[f"{name}.gate_logits"] = m.gate_logits
            tensors[f"{name}.retention"] = m.retention
        save_tensors(out_dir / "budgeted.safetensors", tensors, metadata={"format": "pt"})
        write_json(out_dir / "budgeted.json", {
            "schema_version": 1, "rank": self.cfg.lora_rank, "alpha": self.cfg.lora_alpha,
            "gate_init": self.cfg.gate_init, "budget": self.cfg.budget, "eps_zero": self.cfg.eps_zero,
            "modules": [{"name": n, "in_features": m.in_features, "out_features": m.out_features,
                         "d": m._d} for n, m in self.gated.items()]})

    def summary(self, model):
        rows = []
        for name, m in self.gated.items():
            g = m.gates().detach().float()
            rows.append({"name": name, "d": m._d, "gate_mean": float(g.mean()), "gate_min": float(g.min()),
                         "gate_max": float(g.max()), "gates_above_0.3": int((g >= 0.3).sum())})
        return {"modules": rows, "mean_retained": self.controller.mean_retained,
                "final_retained": self.controller.retained_fraction()}


METHOD_CLASSES = {m.name: m for m in (KDFull, KDLoRA, Budgeted)}


def load_budgeted_student(student_dir: Path, model: nn.Module) -> nn.Module:
    """Re-wrap a dense student with gated modules and load the saved factors, gates and retentions."""
    from bdlora.io import load_tensors

    meta = json.loads((student_dir / "budgeted.json").read_text())
    apply_budgeted_lora(model, meta["rank"], meta["alpha"], meta.get("gate_init", 3.0))
    tensors = load_tensors(student_dir / "budgeted.safetensors")
    for name, m in gated_modules(model).items():
        assert isinstance(m, GatedLoRALinear)
        with torch.no_grad():
            m.lora_A.copy_(tensors[f"{name}.lora_A"])
            m.lora_B.copy_(tensors[f"{name}.lora_B"])
            m.gate_logits.copy_(tensors[f"{name}.gate_logits"])
        m.set_retention(float(tensors[f"{name}.retention"]))
    return model
