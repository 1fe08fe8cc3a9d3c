"""Perplexity over the held-out slice (SPEC 7): exp of the mean next-token NLL over a fixed token count, packed to
the sequence length. The LM head runs in position chunks so full-vocabulary logits never sit in memory at once."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bdlora.data import PackedBlocks
from bdlora.distill import hidden_and_head
from bdlora.export.onnx import left_padded, log_normaliser


@torch.no_grad()
def mean_nll(model, blocks: PackedBlocks, batch_size: int = 8, chunk_size: int = 1024,
             device: str | torch.device = "cpu") -> tuple[float, int]:
    """(mean next-token NLL in nats, number of predicted tokens) over every block."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        x = torch.from_numpy(blocks.get(range(start, min(start + batch_size, len(blocks))))).to(device)
        hidden, head = hidden_and_head(model, x)  # (B, T, H)
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # (N, H): positions with a next token
        y = x[:, 1:].reshape(-1)
        for i in range(0, h.shape[0], chunk_size):
            logits = head(h[i : i + chunk_size]).float()  # (n, V)
            total += F.cross_entropy(logits, y[i : i + chunk_size], reduction="sum").item()
        count += y.numel()
    model.train(was_training)
    return total / max(count, 1), count


def perplexity(model, blocks: PackedBlocks, batch_size: int = 8, device: str | torch.device | None = None) -> float:
    if device is None:
        device = next(model.parameters()).device
    nll, _ = mean_nll(model, blocks, batch_size=batch_size, device=device)
    return math.exp(nll)


def run_val_blocks(cfg: dict, tokenizer) -> PackedBlocks:
    """The held-out blocks a run was scored on (same corpus, split, sequence length and token count), from the
    tokenised-corpus cache (re-tokenised if the cache was cleared)."""
    from bdlora.data import Corpus, tokenize_corpus

    cache = Path(cfg["cache_dir"]).expanduser() if cfg.get("cache_dir") else None
    data = tokenize_corpus(Corpus(cfg["data"]), tokenizer, cfg["heldout_fraction"], cache)
    return PackedBlocks(data.tokens("val"), cfg["seq_len"], max_tokens=cfg["eval_tokens"])


# ------------------------------------------------------------------------------------------------------------------
# `bdlora eval`: one interface over a PyTorch model and an onnxruntime session, so the deployed graph is what gets
# scored when the user points eval at an ONNX folder.
# ------------------------------------------------------------------------------------------------------------------


class TorchLM:
    """A causal LM in PyTorch (teacher, trained student with gated/PEFT modules, compressed or exported folder)."""

    kind = "torch"

    def __init__(self, model, device: str | torch.device = "cpu"):
        self.model = model.eval()
        self.device = torch.device(device)
        self.config = getattr(model, "config", None)

    @torch.no_grad()
    def step(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray, past):
        """Logits of the last position (B, V) and the updated cache; ``past`` None on the first call."""
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        out = self.model(input_ids=t(ids), attention_mask=t(mask), position_ids=t(pos), past_key_values=past,
                         use_cache=True)
        return out.logits[:, -1].float().cpu().numpy(), out.past_key_values

    @torch.no_grad()
    def logits(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Logits of every position (B, T, V), no cache."""
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        return self.model(input_ids=t(ids), attention_mask=t(mask), position_ids=t(pos)).logits.float().cpu().numpy()

    def nll(self, blocks: PackedBlocks, batch_size: int = 8) -> tuple[float, int]:
        return mean_nll(self.model, blocks, batch_size=batch_size, device=self.device)


class OrtLM:
    """An exported bdlora ONNX decoder (inputs ids/mask/positions/past K,V) under onnxruntime."""

    kind = "onnx"

    def __init__(self, sess, config):
        self.sess = sess
        self.config = config

    def step(self, ids, mask, pos, past):
        from bdlora.export.onnx import empty_past, run_session

        res = run_session(self.sess, ids, mask, pos, empty_past(self.config, ids.shape[0]) if past is None else past)
        return res[0][:, -1], res[1:]

    def logits(self, ids, mask, pos) -> np.ndarray:
        from bdlora.export.onnx import empty_past, run_session

        return run_session(self.sess, ids, mask, pos, empty_past(self.config, ids.shape[0]))[0]

    def nll(self, blocks: PackedBlocks, batch_size: int = 8) -> tuple[float, int]:
        from bdlora.export.onnx import ort_score

        nll, preds = ort_score(self.sess, self.config, blocks, batch_size)
        return nll, int(preds.size)


def newline_token_ids(tokenizer) -> set[int]:
    """Token ids whose text contains a newline (generation of a row stops at the first of them)."""
    return {i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])}


def greedy_continuations(lm, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 32,
                         stop_ids: set[int] | None = None, on_batch=None) -> list[str]:
    """Greedy continuation of every prompt (batched, left padded, with the KV cache), each row stopped after its
    first newline token or ``max_new_tokens``. Returned in prompt order."""
    stop_ids = newline_token_ids(tokenizer) if stop_ids is None else stop_ids
    stop = np.zeros(max(stop_ids, default=0) + 1 if stop_ids else 1, dtype=bool)
    stop[list(stop_ids)] = True
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    results: list[str] = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        b = len(rows)
        ids, mask, pos = left_padded([encoded[i] for i in rows])
        past, gen = None, []
        done = np.zeros(b, dtype=bool)
        for _ in range(max_new_tokens):
            logits, past = lm.step(ids, mask, pos, past)
            nxt = logits.argmax(-1).astype(np.int64)  # (B,)
            gen.append(np.where(done, -1, nxt))
            done |= (nxt < len(stop)) & stop[np.minimum(nxt, len(stop) - 1)]
            if done.all():
                break
            ids = nxt[:, None]
            mask = np.concatenate([mask, np.ones((b, 1), dtype=np.int64)], 1)
            pos = pos[:, -1:] + 1
        gen_arr = np.stack(gen, 1)  # (B, steps), -1 after a row stopped
        for r, i in enumerate(rows):
            results[i] = tokenizer.decode([int(x) for x in gen_arr[r] if x >= 0])
        if on_batch is not None:
            on_batch(len(rows))
    return results


def target_logprobs(lm, tokenizer, prompts: list[str], targets: list[str], batch_size: int = 32) -> list[float]:
    """Teacher-forced log-probability (nats) of ``target + "\\n"`` after each prompt: a continuous companion to exact
    match (ours, not in the paper) that still ranks models whose greedy answers are all wrong. Left padded."""
    seqs, n_tgt = [], []
    for p, t in zip(prompts, targets):
        a = tokenizer(p, add_special_tokens=False)["input_ids"]
        full = tokenizer(p + t + "\n", add_special_tokens=False)["input_ids"]
        k = len(a) if full[: len(a)] == a else 0
        while k and full[:k] != a[:k]:
            k -= 1
        seqs.append(full)
        n_tgt.append(len(full) - k)  # tokens that spell the answer (BPE may merge across the boundary)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out = [0.0] * len(seqs)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        ids, mask, pos = left_padded([seqs[i] for i in rows])
        t = ids.shape[1]
        logits = lm.logits(ids, mask, pos).astype(np.float64)  # (B, T, V)
        logz = log_normaliser(logits)  # (B, T)
        for r, i in enumerate(rows):
            m = n_tgt[i]
            tgt = ids[r, t - m :]
            lp = np.take_along_axis(logits[r, t - m - 1 : t - 1], tgt[:, None], -1)[:, 0] - logz[r, t - m - 1 : t - 1]
            out[i] = float(lp.sum())
    return out


def run_icl(lm, tokenizer, words: list[str], tasks=None, shots: int = 10, seeds: int = 3, examples: int = 100,
            batch_size: int = 32, on_progress=None) -> dict:
    """SPEC 7 ICL probes: per task mean/std over demonstration seeds and the macro average (accuracies in %)."""
    from bdlora.icl import TASKS, is_correct, summarise, task_examples

    tasks = list(tasks or TASKS)
    all_ex = [e for task in tasks for s in range(seeds) for e in task_examples(task, words, examples, shots, s)]
    max_new = max(len(tokenizer(e.target, add_special_tokens=False)["input_ids"]) for e in all_ex) + 8
    conts = greedy_continuations(lm, tokenizer, [e.prompt for e in all_ex], max_new, batch_size,
                                 on_batch=on_progress)
    lps = target_logprobs(lm, tokenizer, [e.prompt for e in all_ex], [e.target for e in all_ex], batch_size)
    correct: dict[str, dict[int, list[bool]]] = {t: {s: [] for s in range(seeds)} for t in tasks}
    logprob: dict[str, list[float]] = {t: [] for t in tasks}
    for e, c, lp in zip(all_ex, conts, lps):
        correct[e.task][e.seed].append(is_correct(c, e.target))
        logprob[e.task].append(lp)
    out = summarise(correct)
    for t in tasks:
        out["tasks"][t]["target_logprob"] = float(np.mean(logprob[t]))
    out["macro"]["target_logprob"] = float(np.mean([out["tasks"][t]["target_logprob"] for t in tasks]))
    out.update(shots=shots, seeds=seeds, examples_per_seed=examples, max_new_tokens=max_new,
               prompts=len(all_ex), sample={t: next(e.prompt for e in all_ex if e.task == t) for t in tasks},
               sample_continuations={t: next(c for e, c in zip(all_ex, conts) if e.task == t) for t in tasks})
    return out


# ------------------------------------------------------------------------------------------------------------------
# What to evaluate, and on which data
# ------------------------------------------------------------------------------------------------------------------


def load_eval_target(path: str | Path, onnx_file: str = "model.onnx", device: str = "cpu"):
    """(lm, tokenizer, kind, run_config or None) for a run directory, a model folder (teacher, compressed,
    exported HF) or an ONNX folder. ``run_config`` is the training options of the run the model came from."""
    from bdlora.errors import ModelError
    from bdlora.io import read_json
    from bdlora.train import is_run_dir, load_run_student

    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"{path}: no such model folder (pass a run directory, a model folder or an ONNX folder)")
    if is_run_dir(path):
        model, tok, _ = load_run_student(path, device)
        return TorchLM(model, device), tok, "run", read_json(path / "config.json")["config"]
    report = read_json(path / "compression.json") if (path / "compression.json").exists() else {}
    run_dir = report.get("provenance", {}).get("run_dir")
    run_cfg = read_json(Path(run_dir) / "config.json")["config"] if run_dir and (
        Path(run_dir) / "config.json").exists() else None
    if run_cfg is None and (path / "teacher.json").exists():
        run_cfg = {"data": "builtin", "teacher": "builtin"}  # the embedded default teacher's own corpus
    if (path / onnx_file).exists() or (path / "model.onnx").exists():
        from transformers import AutoConfig, AutoTokenizer

        import bdlora  # noqa: F401  registers the bdlora config classes
        from bdlora.export.onnx import session

        if not (path / onnx_file).exists():
            found = ", ".join(sorted(p.name for p in path.glob("*.onnx")))
            raise ModelError(f"{path}: no {onnx_file} (ONNX files there: {found})")
        config = AutoConfig.from_pretrained(str(path))
        return OrtLM(session(path / onnx_file), config), AutoTokenizer.from_pretrained(str(path)), "onnx", run_cfg
    from bdlora.export.onnx import load_model_folder

    model, tok, _ = load_model_folder(path)
    return TorchLM(model.to(device), device), tok, "torch", run_cfg


def eval_data(run_cfg: dict | None, config, data: str | None = None, seq_len: int | None = None,
              tokens: int | None = None, heldout_fraction: float | None = None, cache_dir: str | None = None) -> dict:
    """The held-out slice to score: the run's own (corpus, split, sequence length, token count) unless overridden;
    without a run, the builtin corpus and the defaults of ``bdlora train`` for that kind of teacher."""
    from bdlora.config import BUILTIN_DEFAULTS, REAL_DEFAULTS
    from bdlora.data import Corpus

    cfg = dict(run_cfg or {})
    src = "the run's training options" if run_cfg and "seq_len" in cfg else "defaults"
    d = data or cfg.get("data") or "builtin"
    builtin = (cfg.get("teacher") or ("builtin" if d == "builtin" else None)) == "builtin"
    defaults = BUILTIN_DEFAULTS if builtin else REAL_DEFAULTS
    if heldout_fraction is None:
        heldout_fraction = cfg.get("heldout_fraction") if not data else None
    if heldout_fraction is None:
        heldout_fraction = Corpus(d).default_heldout_fraction
    max_pos = getattr(config, "max_position_embeddings", None) or 1 << 30
    return {"data": d, "heldout_fraction": heldout_fraction,
            "seq_len": min(seq_len or cfg.get("seq_len") or defaults["seq_len"], max_pos),
            "eval_tokens": tokens or cfg.get("eval_tokens") or defaults["eval_tokens"],
            "cache_dir": cache_dir or cfg.get("cache_dir"), "source": "command line" if data or seq_len or tokens
            else src}


def evaluate_target(path: str | Path, ppl: bool = True, icl: bool = True, tokens: int | None = None,
                    shots: int = 10, seeds: int = 3, examples: int = 100, tasks=None, data: str | None = None,
                    seq_len: int | None = None, heldout_fraction: float | None = None,
                    onnx_file: str = "model.onnx", batch_size: int = 32,
                    device: str = "cpu", on_stage=None, on_progress=None) -> dict:
    """``bdlora eval``: held-out perplexity and/or the ICL probes of one model; returns the eval document."""
    import time

    from bdlora import SCHEMA_VERSION, __version__
    from bdlora.data import Corpus, tokenize_corpus
    from bdlora.icl import TASKS, corpus_word_list

    stage = on_stage or (lambda s: None)
    bad = [t for t in (tasks or []) if t not in TASKS]
    if bad:
        from bdlora.errors import UsageError

        raise UsageError(f"--tasks {','.join(bad)}: unknown (allowed: {', '.join(TASKS)})")
    t0 = time.time()
    stage(f"loading {path}")
    lm, tok, kind, run_cfg = load_eval_target(path, onnx_file, device)
    settings = eval_data(run_cfg, lm.config, data, seq_len, tokens, heldout_fraction)
    cache = Path(settings["cache_dir"]).expanduser() if settings["cache_dir"] else None
    doc: dict = {"schema_version": SCHEMA_VERSION, "bdlora_version": __version__, "source": str(path),
                 "kind": kind, "onnx_file": onnx_file if kind == "onnx" else None,
                 "model_type": getattr(lm.config, "model_type", None), "data": settings}
    if ppl:
        stage(f"perplexity over {settings['eval_tokens']:,} held-out tokens of {settings['data']}")
        corpus_tokens = tokenize_corpus(Corpus(settings["data"]), tok, settings["heldout_fraction"], cache)
        blocks = PackedBlocks(corpus_tokens.tokens("val"), settings["seq_len"], max_tokens=settings["eval_tokens"])
        nll, count = lm.nll(blocks)
        doc["ppl"] = {"val_ppl": math.exp(nll), "mean_nll": nll, "predicted_tokens": count,
                      "tokens": len(blocks) * blocks.seq_len, "seq_len": blocks.seq_len}
    if icl:
        stage(f"building the ICL word list from {settings['data']}")
        words = corpus_word_list(settings["data"], settings["heldout_fraction"], cache)
        n = len(tasks or TASKS) * seeds * examples
        stage(f"ICL probes: {len(tasks or TASKS)} tasks x {seeds} seeds x {examples} prompts ({shots}-shot)")
        if on_progress is not None:
            on_progress(0, n)
        res = run_icl(lm, tok, words, tasks, shots, seeds, examples, batch_size,
                      on_progress=(lambda k: on_progress(k, n)) if on_progress else None)
        res["words"] = {"count": len(words), "first": words[:20]}
        doc["icl"] = res
    doc["seconds"] = time.time() - t0
    return doc
