"""Post-training compression (paper Sec. 3.3; SPEC 6): gated training modules -> deployment modules.

1. Harden the gates: keep ranks with g >= tau_g (at least the largest), fold gates and alpha/r into B:
   ``B' = (alpha / r_max) B[:, kept] diag(g[kept])``, ``A' = A[kept]``.
2. By the final retention d: drop the dense path (d < eps_zero), SVD-approximate it and fuse with the LoRA pair
   (eps_zero <= d < eps_lr), or merge it (d >= eps_lr): ``W_eff = d W + B' A'``.
3. A factorised module that would cost at least its dense merge is merged instead (``merged-cheaper``).

The arithmetic of the decisions and of the report lives in ``costs`` (shared with ``plan``); this module does the
weight surgery. SVDs and merges run in float64 and are cast back to the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from bdlora.costs import (
    DEFAULT_EPS_LR,
    DEFAULT_GATE_THRESHOLD,
    DEFAULT_SVD_MAX_RANK,
    ModuleDecision,
    ModuleShape,
    compression_report,
    decide_module,
    deployed_form,
)
from bdlora.errors import ConfigError
from bdlora.layers import GatedLoRALinear, gated_modules


@dataclass
class Thresholds:
    eps_zero: float = 1e-3
    eps_lr: float = DEFAULT_EPS_LR
    gate_threshold: float = DEFAULT_GATE_THRESHOLD
    svd_max_rank: int = DEFAULT_SVD_MAX_RANK

    def validate(self) -> None:
        p = []
        for name in ("eps_zero", "eps_lr", "gate_threshold"):
            v = getattr(self, name)
            if not 0.0 < v < 1.0:
                p.append(f"--{name.replace('_', '-')} {v}: must be in (0, 1)")
        if 0.0 < self.eps_zero < 1.0 and 0.0 < self.eps_lr < 1.0 and self.eps_zero >= self.eps_lr:
            p.append(f"--eps-zero {self.eps_zero} >= --eps-lr {self.eps_lr}: the drop threshold must be below the "
                     "SVD threshold")
        if self.svd_max_rank < 1:
            p.append(f"--svd-max-rank {self.svd_max_rank}: must be >= 1")
        if p:
            raise ConfigError(p)


def harden_gates(m: GatedLoRALinear, gate_threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A', B') in float64: ranks with sigmoid(gate) >= tau_g (at least the largest gate), gates and scale in B'."""
    g = torch.sigmoid(m.gate_logits.detach().double())  # (r,)
    kept = torch.nonzero(g >= gate_threshold).flatten()
    if kept.numel() == 0:
        kept = torch.argmax(g).reshape(1)
    a = m.lora_A.detach().double()[kept]  # (r', d_in)
    b = m.scaling * m.lora_B.detach().double()[:, kept] * g[kept]  # (d_out, r')
    return a, b


@dataclass
class CompressedModule:
    decision: ModuleDecision
    weight: torch.Tensor | None = None  # dense: (d_out, d_in)
    proj_in: torch.Tensor | None = None  # low-rank: (r, d_in)
    proj_out: torch.Tensor | None = None  # low-rank: (d_out, r)
    bias: torch.Tensor | None = None

    def module(self) -> nn.Module:
        """A standalone torch module computing the deployed form (tests compare it with the training module)."""
        from bdlora.export.modeling_bdlora import LowRankLinear

        dec = self.decision
        if self.weight is not None:
            mod = nn.Linear(dec.in_features, dec.out_features, bias=self.bias is not None)
            mod.weight.data.copy_(self.weight)
        else:
            mod = LowRankLinear(dec.in_features, dec.out_features, dec.rank, bias=self.bias is not None)
            mod.proj_in.weight.data.copy_(self.proj_in)
            mod.proj_out.weight.data.copy_(self.proj_out)
        if self.bias is not None:
            (mod.bias if isinstance(mod, nn.Linear) else mod.proj_out.bias).data.copy_(self.bias)
        return mod


def fused_svd_pair(dw: torch.Tensor, a: torch.Tensor, b: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Case 2: ``d W ~= U_k V_k`` (singular values folded into U_k), fused with the hardened LoRA pair into one
    low-rank pair: first factor ``[V_k; A']`` (k + r', d_in), second ``[U_k, B']`` (d_out, k + r')."""
    u, s, vh = torch.linalg.svd(dw, full_matrices=False)
    return torch.cat([vh[:k], a]), torch.cat([u[:, :k] * s[:k], b], 1)


def compress_module(name: str, m: GatedLoRALinear, th: Thresholds) -> CompressedModule:
    d = m._d
    a, b = harden_gates(m, th.gate_threshold)
    shape = ModuleShape(name, m.in_features, m.out_features)
    bias = m.base_layer.bias
    dec = decide_module(shape, d, a.shape[0], m.rank, th.eps_zero, th.eps_lr, th.svd_max_rank, bias is not None)
    dtype = m.base_layer.weight.dtype
    bias = None if bias is None else bias.detach().clone()
    w = m.base_layer.weight.detach().double()
    if dec.case == "dropped":
        return CompressedModule(dec, proj_in=a.to(dtype), proj_out=b.to(dtype), bias=bias)
    if dec.case == "svd":
        first, second = fused_svd_pair(d * w, a, b, dec.svd_rank)
        return CompressedModule(dec, proj_in=first.to(dtype), proj_out=second.to(dtype), bias=bias)
    # kept, or merged-cheaper: the exact merge d W + B' A'
    return CompressedModule(dec, weight=(d * w + b @ a).to(dtype), bias=bias)


def _base_config_dict(config) -> dict:
    cfg = config.to_dict()
    for k in ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path", "bdlora_modules",
              "bdlora"):
        cfg.pop(k, None)
    return cfg


def build_compressed_model(base_model: nn.Module, compressed: dict[str, CompressedModule], provenance: dict):
    """The bdlora HF architecture holding ``compressed`` modules and every other weight of ``base_model``."""
    from bdlora.export.modeling_bdlora import FAMILIES

    family = base_model.config.model_type
    if family.startswith("bdlora_"):
        family = family[len("bdlora_"):]
    if family not in FAMILIES:
        raise ConfigError([f"base model_type {family!r}: no bdlora architecture (supported: {', '.join(FAMILIES)})"])
    cfg_cls, model_cls = FAMILIES[family]
    modules = {n: deployed_form(c.decision.rank) for n, c in compressed.items()}
    config = cfg_cls(bdlora_modules=modules, bdlora={"base_model_type": family, **provenance},
                     **_base_config_dict(base_model.config))
    config.auto_map = {"AutoConfig": f"modeling_bdlora.{cfg_cls.__name__}",
                       "AutoModelForCausalLM": f"modeling_bdlora.{model_cls.__name__}"}
    config.architectures = [model_cls.__name__]
    model = model_cls(config)
    from bdlora.methods import dense_state_dict

    state = {k: v for k, v in dense_state_dict(base_model).items()
             if not any(k.startswith(n + ".") for n in compressed)}
    for n, c in compressed.items():
        if c.weight is not None:
            state[f"{n}.weight"] = c.weight
            if c.bias is not None:
                state[f"{n}.bias"] = c.bias
        else:
            state[f"{n}.proj_in.weight"] = c.proj_in
            state[f"{n}.proj_out.weight"] = c.proj_out
            if c.bias is not None:
                state[f"{n}.proj_out.bias"] = c.bias
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    assert not missing and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def compress_budgeted(model: nn.Module, th: Thresholds, provenance: dict):
    """(compressed HF model, report) of a student with ``GatedLoRALinear`` modules."""
    th.validate()
    gated = gated_modules(model)
    compressed = {n: compress_module(n, m, th) for n, m in gated.items()}
    r_max = next(iter(gated.values())).rank
    report = compression_report([c.decision for c in compressed.values()], r_max, provenance.get("budget"),
                                {"eps_zero": th.eps_zero, "eps_lr": th.eps_lr, "gate_threshold": th.gate_threshold,
                                 "svd_max_rank": th.svd_max_rank})
    return build_compressed_model(model, compressed, {**provenance, "thresholds": report["thresholds"]}), report


def compress_dense(model: nn.Module, lora_rank: int, provenance: dict):
    """kd-lora (PEFT adapter merged into dense: the LoRA baseline's deployment form) and kd-full (unchanged): every
    projection deployed dense, in the same architecture and with the same report keys."""
    from bdlora.costs import PROJECTIONS

    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    compressed = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
            dec = decide_module(ModuleShape(name, mod.in_features, mod.out_features), 1.0, lora_rank, lora_rank,
                                1e-3, DEFAULT_EPS_LR, DEFAULT_SVD_MAX_RANK, mod.bias is not None)
            bias = None if mod.bias is None else mod.bias.detach().clone()
            compressed[name] = CompressedModule(dec, weight=mod.weight.detach().clone(), bias=bias)
    report = compression_report([c.decision for c in compressed.values()], lora_rank, provenance.get("budget"), {})
    return build_compressed_model(model, compressed, provenance), report


def compress_run(run_dir, th: Thresholds, out=None, force: bool = False, evaluate: bool = True,
                 on_stage=None) -> tuple[dict, Path]:
    """Compress a finished run into a model folder; returns (report, folder). The run is never modified."""

    from bdlora import SCHEMA_VERSION, __version__
    from bdlora.errors import RunDirError
    from bdlora.export.hf import check_out_dir, save_model_folder
    from bdlora.io import read_json
    from bdlora.train import is_run_dir, load_run_student

    stage = on_stage or (lambda s: None)
    th.validate()
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise RunDirError(f"{run_dir}: not a finished bdlora run (needs config.json, summary.json and student/)")
    out = Path(out) if out else run_dir.parent / f"{run_dir.name}.compressed"
    check_out_dir(out, force, (run_dir,))
    cfg = read_json(run_dir / "config.json")["config"]
    summary = read_json(run_dir / "summary.json")
    method = summary["method"]
    if method == "budgeted" and not (run_dir / "student" / "budgeted.safetensors").exists():
        raise RunDirError(f"{run_dir}: a budgeted run without student/budgeted.safetensors (gated modules missing)")
    stage(f"loading the {method} student from {run_dir}")
    model, tok, _ = load_run_student(run_dir)
    provenance = {"name": f"{run_dir.name} compressed", "method": method, "teacher": cfg["teacher"],
                  "budget": cfg["budget"] if method == "budgeted" else None, "run_dir": str(run_dir),
                  "student_layers": cfg["student_layers"], "layer_indices": summary.get("layer_indices")}
    stage("compressing")
    if method == "budgeted":
        if not gated_modules(model):
            raise RunDirError(f"{run_dir}: the budgeted student has no gated modules to compress")
        compressed, report = compress_budgeted(model, th, provenance)
    else:
        compressed, report = compress_dense(model, cfg["lora_rank"] if method == "kd-lora" else 0, provenance)
    report.update(schema_version=SCHEMA_VERSION, bdlora_version=__version__, source="compress",
                  provenance=provenance)
    if evaluate:
        from bdlora.evaluate import perplexity, run_val_blocks

        stage("scoring the held-out slice (uncompressed vs compressed)")
        blocks = run_val_blocks(cfg, tok)
        report["eval"] = {"student_val_ppl": perplexity(model, blocks), "compressed_val_ppl":
                          perplexity(compressed, blocks), "tokens": len(blocks) * blocks.seq_len}
    stage(f"writing {out}")
    save_model_folder(compressed, tok, out, report, force)
    return report, out
