"""``teacher:N`` through the teacher's own onnxruntime-genai export (``train --samples-runtime FOLDER``): the text
that protects what healing data does not cover, generated at the deploy runtime's speed instead of PyTorch's.

The teacher's samples are the data-free stand-in for broad pretraining text (LLM-QAT, GKD, self-data distillation),
and the slowest data to make: 32,768 tokens of SmolLM2 took 31 minutes through transformers' ``generate`` on 2
cores. Here the prompts, temperatures and documents are ``selfgen``'s (``sample_documents``); each batch is one
onnxruntime-genai generator over right-padded prompts (as ``serve`` batches them), and each step's token is drawn
here, in numpy, from the step's logits (temperature, then the nucleus of ``TOP_P``; a generator seeded by the batch)
and forced into the generator (every other logit ``FORCE_OFF``, as ``serve`` does), so a finished row feeds the pad
token and the sampling is ours, exact and reproducible. At temperature 0 it is greedy decoding, token for token
PyTorch's on an fp32 export (tested).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from bdlora.base.errors import DataError
from bdlora.base.runs import EXPORT_MARKER, GENAI_CONFIG

FORCE_OFF = np.float32(-1e30)
CANDIDATES = 1024  # tokens sorted for the nucleus; a row whose top CANDIDATES hold less than TOP_P is sorted whole


def check_folder(folder: str | Path, teacher_folder: str | Path, vocab_size: int) -> Path:
    """The genai folder ``folder`` as the teacher's export, or a one-line DataError naming what is wrong."""
    f = Path(folder).expanduser()
    what = f"--samples-runtime {folder}"
    if not (f / GENAI_CONFIG).is_file():
        raise DataError(f"{what}: not an onnxruntime-genai folder (no {GENAI_CONFIG}; make one with `bdlora export "
                        "genai TEACHER --precision int4`)")
    try:
        meta = json.loads((f / EXPORT_MARKER).read_text())
        cfg = json.loads((f / GENAI_CONFIG).read_text())
        vocab = int(cfg["model"]["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{what}: its {EXPORT_MARKER} / {GENAI_CONFIG} do not read ({type(e).__name__})") from None
    source = meta.get("source")
    if not source or Path(source).expanduser().resolve() != Path(teacher_folder).resolve():
        raise DataError(f"{what}: exported from {source}, not the teacher {teacher_folder} (teacher samples come "
                        "from the teacher's own export)")
    if vocab != vocab_size:
        raise DataError(f"{what}: vocabulary {vocab}, the teacher's is {vocab_size}")
    return f.resolve()


def fingerprint(folder: Path) -> str:
    """SHA-256 over the folder's genai config and graph files (streamed): what keys its samples in the cache."""
    h = hashlib.sha256()
    for f in [folder / GENAI_CONFIG, *sorted(folder.glob("*.onnx")), *sorted(folder.glob("*.onnx.data"))]:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def precision(folder: Path) -> str | None:
    try:
        return json.loads((folder / EXPORT_MARKER).read_text()).get("precision")
    except (OSError, ValueError):
        return None


def sample_rows(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> np.ndarray:
    """One token per row of (B, V) ``logits``: the argmax at temperature 0, else a draw from the nucleus (the
    fewest most likely tokens holding ``top_p`` of the mass at ``temperature``, renormalised). Vectorised over rows:
    the ``CANDIDATES`` most likely tokens of each row are sorted (``argpartition``, linear in V), and only a row
    whose candidates hold less than ``top_p`` (a flat distribution) is sorted whole."""
    if temperature <= 0:
        return logits.argmax(-1)
    z = logits.astype(np.float32) / np.float32(temperature)
    p = np.exp(z - z.max(-1, keepdims=True))  # float32: a step's sampling stays small beside the model's step
    p /= p.sum(-1, keepdims=True, dtype=np.float64).astype(np.float32)
    n, v = p.shape
    k = min(CANDIDATES, v)
    cand = np.argpartition(-z, k - 1, axis=-1)[:, :k] if k < v else np.tile(np.arange(v), (n, 1))
    flat = np.take_along_axis(p, cand, -1).sum(-1) < top_p
    out = np.empty(n, dtype=np.int64)
    u = rng.random(n)
    for rows, idx in ((np.flatnonzero(~flat), None), (np.flatnonzero(flat), np.arange(v))):
        if len(rows) == 0:
            continue
        ids = cand[rows] if idx is None else np.tile(idx, (len(rows), 1))
        order = np.take_along_axis(ids, np.argsort(-np.take_along_axis(p[rows], ids, -1), -1, kind="stable"), -1)
        sp = np.take_along_axis(p[rows], order, -1)
        sp = np.where(np.cumsum(sp, -1) - sp < top_p, sp, 0.0)  # every token whose more likely ones hold < top_p
        cdf = np.cumsum(sp, -1)
        pick = np.minimum((cdf < (u[rows] * cdf[:, -1])[:, None]).sum(-1), v - 1)
        out[rows] = order[np.arange(len(rows)), pick]
    return out


def batcher(folder: Path, eos_token_id: int, top_p: float):
    """``(context, batch)`` for ``selfgen.sample_documents`` through the genai folder: ``batch(prompt ids, new
    tokens, temperature, seed)`` returns each prompt's new tokens, sampled here from the runtime's logits."""
    import onnxruntime_genai as og

    cfg = json.loads((folder / GENAI_CONFIG).read_text())
    context, pad = int(cfg["model"]["context_length"]), int(cfg["model"]["pad_token_id"])
    model = og.Model(str(folder))

    def batch(ids: list[list[int]], new: int, temperature: float, batch_seed: int) -> list[list[int]]:
        width = max(len(x) for x in ids)
        x = np.full((len(ids), width), pad, dtype=np.int32)
        for j, row in enumerate(ids):
            x[j, : len(row)] = row
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=min(context, width + new), do_sample=False, batch_size=len(ids))
        gen = og.Generator(model, params)
        gen.append_tokens(x)
        rng = np.random.default_rng(batch_seed)
        out: list[list[int]] = [[] for _ in ids]
        alive = np.ones(len(ids), dtype=bool)
        rows = np.arange(len(ids))
        forced = None
        for step in range(new):
            logits = np.asarray(gen.get_logits())[:, -1]
            chosen = sample_rows(logits, temperature, top_p, rng)
            for j in np.flatnonzero(alive):
                out[j].append(int(chosen[j]))
                alive[j] = chosen[j] != eos_token_id
            if not alive.any() or step == new - 1:
                break
            feed = np.where(alive, chosen, pad)
            if forced is None:
                forced = np.full(logits.shape, FORCE_OFF, dtype=np.float32)
            forced[rows, feed] = 0.0
            gen.set_logits(forced)
            forced[rows, feed] = FORCE_OFF
            gen.generate_next_token()
        return out

    return context, batch
