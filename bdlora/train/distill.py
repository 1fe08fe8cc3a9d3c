"""Distillation objective (SPEC 3, paper Appendix C):

    L_KD = tau^2 / |Omega| * sum_{t in Omega} KL(softmax(zT_t / tau) || softmax(zS_t / tau))
    L_CE = -1 / |Omega| * sum_{t in Omega} log p_S(x_{t+1})
    L    = lambda * L_KD + (1 - lambda) * L_CE

Omega is the set of positions t whose token and next token are both non-padding. As in torchtune's chunked KD
loss, the LM heads run over chunks of positions; when the batch's full-vocabulary logits would not fit in
``checkpoint_bytes`` each student chunk also runs under activation checkpointing, so neither the forward nor the
saved-for-backward state holds full-vocabulary logits of more than one chunk (the head is recomputed in backward:
one extra (chunk, H) x (H, V) matmul and softmax per chunk). Small batches skip it: on SmolLM2 (4 x 128 tokens,
vocabulary 49,152, 2 CPU cores) the recomputation was 16% of a training step.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bdlora.models.arch import base_model, hidden_and_head


def next_token_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, T-1) bool: position t is in Omega when t and t+1 are both real tokens."""
    if attention_mask is None:
        return torch.ones_like(input_ids[:, 1:], dtype=torch.bool)
    m = attention_mask.bool()
    return m[:, :-1] & m[:, 1:]


class DistillationLoss(nn.Module):
    """Chunked KD + CE loss over hidden states.

    Args:
        temperature: tau (default 3.0, the paper's ablation optimum).
        kd_weight: lambda, the weight of the KD term (default 0.8).
        chunk_size: positions per LM-head chunk.
        checkpoint_bytes: recompute each chunk's head in backward when the whole batch's logits and what backward
            keeps of them (about three fp32 (N, V) tensors) would exceed this.
    """

    def __init__(self, temperature: float = 3.0, kd_weight: float = 0.8, chunk_size: int = 1024,
                 checkpoint_bytes: int = 1 << 30):
        super().__init__()
        self.temperature = temperature
        self.kd_weight = kd_weight
        self.chunk_size = chunk_size
        self.checkpoint_bytes = checkpoint_bytes

    def _chunk_sums(self, student_head, teacher_head, hs, ht, y):
        """Sums over one chunk of positions: (KL(pT || pS) at temperature tau, CE of the student). A student head
        keeping only some tokens (a draft's ``VocabHead``: ``token_ids``) is fitted over those: the teacher's
        distribution renormalised on them, and the CE of the positions whose next token is one of them (a token it
        cannot emit says nothing about the ones it can)."""
        ids = getattr(student_head, "token_ids", None)
        zs = (F.linear(hs, student_head.weight) if ids is not None else student_head(hs)).float()  # (n, V or K)
        with torch.no_grad():
            zt = teacher_head(ht).float()  # (n, V)
            vocab = zt.shape[-1]
            if ids is not None:
                zt = zt[:, ids]  # (n, K)
            log_pt = F.log_softmax(zt / self.temperature, dim=-1)
        log_ps = F.log_softmax(zs / self.temperature, dim=-1)
        kd = (log_pt.exp() * (log_pt - log_ps)).sum()
        if ids is not None:
            where = torch.full((vocab,), -1, dtype=torch.long, device=y.device)
            where[ids] = torch.arange(len(ids), device=y.device)
            y, keep = where[y], where[y] >= 0
            zs, y = zs[keep], y[keep]
        ce = F.cross_entropy(zs, y, reduction="sum")
        return torch.stack([kd, ce])

    def _chunk_sums_topk(self, student_head, hs, t_logp, t_index, y):
        """Sums over one chunk of positions: (KL over the teacher's top-k tokens plus one bucket for the rest of
        the vocabulary, CE of the student)."""
        zs = student_head(hs).float()  # (n, V)
        log_ps = F.log_softmax(zs / self.temperature, dim=-1)
        ps_top = log_ps.gather(-1, t_index)  # (n, K)
        kd = (t_logp.exp() * (t_logp - ps_top)).sum()
        if t_index.shape[-1] < zs.shape[-1]:  # the bucket: teacher mass outside the top k against the student's
            rest_t = (1.0 - t_logp.exp().sum(-1)).clamp_min(0.0)
            log_rest_s = log_ps.scatter(-1, t_index, float("-inf")).logsumexp(-1)  # finite: V - K > 0 terms
            kd = kd + (torch.xlogy(rest_t, rest_t) - rest_t * log_rest_s).sum()
        ce = F.cross_entropy(zs, y, reduction="sum")
        return torch.stack([kd, ce])

    def _reduce(self, chunk_sums, student_head, hs, targets, y) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss from per-chunk sums over all positions (each chunk recomputed in backward when large)."""
        n = y.numel()
        if n == 0:
            raise ValueError("no non-padding position with a next token in the batch")
        sums = torch.zeros(2, device=hs.device)
        recompute = 3 * 4 * n * student_head.weight.shape[0] > self.checkpoint_bytes
        for i in range(0, n, self.chunk_size):
            args = (student_head, hs[i : i + self.chunk_size], *(t[i : i + self.chunk_size] for t in targets),
                    y[i : i + self.chunk_size])
            if recompute and torch.is_grad_enabled() and hs.requires_grad:
                sums = sums + checkpoint(chunk_sums, *args, use_reentrant=False)
            else:
                sums = sums + chunk_sums(*args)
        kd = self.temperature**2 * sums[0] / n
        ce = sums[1] / n
        loss = self.kd_weight * kd + (1 - self.kd_weight) * ce
        return loss, {"kd": float(kd.detach()), "ce": float(ce.detach()), "positions": n}

    def forward(self, student_hidden, student_head, teacher_hidden, teacher_head, input_ids,
                attention_mask=None) -> tuple[torch.Tensor, dict[str, float]]:
        omega = next_token_positions(input_ids, attention_mask)  # (B, T-1)
        hs = student_hidden[:, :-1][omega]  # (N, H)
        ht = teacher_hidden[:, :-1][omega].to(hs.dtype)  # (N, H)

        def sums(student_head, hs, ht, y):
            return self._chunk_sums(student_head, teacher_head, hs, ht, y)

        return self._reduce(sums, student_head, hs, (ht,), input_ids[:, 1:][omega])

    def forward_topk(self, student_hidden, student_head, t_logp, t_index, input_ids,
                     attention_mask=None) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss against the teacher's top-k targets (``bdlora.train.kdcache``): ``t_logp`` / ``t_index``
        (B, T-1, K) are the teacher's K largest log-probabilities at tau and their token ids. The KL runs over the
        partition {each top-k token, everything else}, a lower bound of the full KL that equals it at K = V."""
        omega = next_token_positions(input_ids, attention_mask)
        hs = student_hidden[:, :-1][omega]
        return self._reduce(self._chunk_sums_topk, student_head, hs, (t_logp[omega].float(), t_index[omega]),
                            input_ids[:, 1:][omega])


MIN_WARMUP_STEPS = 10


def warmup_steps(total_steps: int) -> int:
    """3% of the steps capped at 2000 (SPEC 3), but at least ``MIN_WARMUP_STEPS`` (at most half of a short run):
    below 34 steps 3% rounds to 0 or 1, and a first step at the full learning rate took a whitened student from
    perplexity 100 to 4,548 on the builtin teacher. (ours)"""
    return max(1, min(2000, max(round(0.03 * total_steps), min(MIN_WARMUP_STEPS, total_steps // 2))))


def warmup_cosine(total_steps: int):
    """LR multiplier: linear warm-up (``warmup_steps``), then cosine to 0 (SPEC 3)."""
    warmup = warmup_steps(total_steps)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        p = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, p)))

    return f


def diverged(loss: float, step: int, start_step: int, lr: float) -> str:
    """The message of a non-finite loss. Before this launch's first update the learning rate cannot be the cause:
    the teacher's or the student's forward already produces inf/NaN."""
    if step == start_step:
        where = "before any update" if step == 0 else f"at step {step + 1}, the first after resuming"
        return (f"loss is {loss} {where}: the teacher or student forward produces non-finite values (check the "
                "--teacher / --student-init weights and the data)")
    return f"loss became {loss} at step {step + 1}; lower --lr (now {lr})"


def autocast(device: torch.device, mode: str | None = None):
    """``--autocast``: by default (None) bf16 on CUDA devices that support it, fp32 elsewhere (SPEC 3); ``bf16``
    also on the CPU (weights and optimiser stay fp32), ``fp32`` nowhere."""
    if mode == "bf16" or (mode is None and device.type == "cuda" and torch.cuda.is_bf16_supported()):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


def kd_step(model, teacher, loss_fn: DistillationLoss, x: torch.Tensor, device: torch.device, ddp=None,
            mask: torch.Tensor | None = None, precision: str | None = None, topk=None):
    """One micro-batch's loss (teacher forward without gradients, then the student); with ``ddp`` the student's
    hidden states come through DistributedDataParallel (gradient all-reduce). ``mask`` marks real tokens of
    right-padded sequences (``--packing truncate``): causal attention keeps padding out of every real position, so
    only the loss needs it. ``precision``: ``--autocast``. ``topk``: a ``kdcache.TeacherTopK`` (``--kd-topk``),
    whose cached targets replace the teacher's forward. Returns (loss, parts)."""
    if topk is not None:
        targets = topk.targets(x)
    else:
        with torch.no_grad(), autocast(device, precision):
            th, thead = hidden_and_head(teacher, x)
    with autocast(device, precision):
        if ddp is None:
            sh, shead = hidden_and_head(model, x)
        else:
            sh = ddp(x)
            shead = base_model(model).lm_head
        if topk is not None:
            return loss_fn.forward_topk(sh, shead, *targets, x, mask)
        return loss_fn(sh, shead, th, thead, x, mask)
