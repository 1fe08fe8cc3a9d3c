"""``bdlora eval``: held-out perplexity and the 19 ICL probes (SPEC 7) of any model bdlora can load, through the one
model interface of ``eval.targets`` (a PyTorch model, in memory or read one layer at a time, or an onnxruntime
session, so the deployed graph itself is what gets scored when eval is pointed at an ONNX folder)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bdlora import SCHEMA_VERSION, __version__
from bdlora.base.errors import Checks, DataError
from bdlora.base.outputs import DEFAULT_STREAMING, STREAMING
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import MODEL_ONNX
from bdlora.base.settings import Settings
from bdlora.data.blocks import PackedBlocks, scored_blocks
from bdlora.data.corpora import SAMPLES_PREFIXES, default_heldout, load_tokens, other_domains, settings_tokens
from bdlora.data.documents import BUILTIN
from bdlora.data.tokens import bos_first, encode_prompt
from bdlora.eval.icl import TASKS, corpus_word_list, is_correct, summarise, task_examples
from bdlora.eval.targets import load_eval_target
from bdlora.models.runtime import DecoderShape, left_padded
from bdlora.models.scoring import log_normaliser
from bdlora.train.defaults import teacher_defaults


@dataclass
class EvalConfig(Settings):
    """What ``bdlora eval`` measures, and on which data (``None``: the run's own settings, else the defaults)."""

    ppl: bool = True
    """Held-out perplexity."""
    icl: bool = True
    """The 19 ICL probes of SPEC 7."""
    tokens: int | None = None
    """Held-out tokens scored (default: the run's eval-tokens)."""
    seq_len: int | None = None
    """Block length for perplexity (default: the run's)."""
    data: str | None = None
    """Corpus for perplexity and the probe word list (default: the run's corpus; builtin when unknown)."""
    heldout_fraction: float | None = None
    """With --data: the held-out fraction (default: the corpus' default)."""
    domains: str | None = None
    """Also score perplexity on these corpora, comma-separated (';' when one is a mixture; '' for none). Default:
    prose for a general-purpose model (vocabulary of 32,000 or more), none for the builtin and tiny teachers."""
    shots: int = 10
    """Demonstrations per ICL prompt."""
    seeds: int = 3
    """Demonstration seeds."""
    examples: int = 50
    """Query prompts per task and seed."""
    tasks: list[str] | None = None
    """A subset of the 19 tasks (default: all)."""
    onnx_file: str = MODEL_ONNX
    """ONNX folders: which graph to score (e.g. model_int8.onnx)."""
    batch_size: int = 32
    """Prompts per generation batch."""
    streaming: str = DEFAULT_STREAMING
    """A model folder (not ONNX): on reads it one decoder layer at a time (a 1B-8B checkpoint without its fp32
    copy in memory; each generated ICL token then reads the weights once); off holds it in fp32; auto: on past 2
    GiB of fp32 weights."""

    def check(self, c: Checks) -> Checks:
        for name in ("shots", "seeds", "examples", "batch_size"):
            c.integer(name, getattr(self, name), lo=1)
        c.integer("shots", self.shots, hi=64, what=" (at most 64 demonstrations)")
        for name in ("tokens", "seq_len"):
            c.integer(name, getattr(self, name), lo=2)
        c.number("heldout_fraction", self.heldout_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        if self.tasks is not None:
            c.require(bool(self.tasks), "--tasks: empty list (name one or more of the 19 tasks)")
            bad = [t for t in self.tasks if t not in TASKS]
            c.require(not bad, f"--tasks {','.join(bad)}: unknown (allowed: {', '.join(TASKS)})")
        c.choice("streaming", self.streaming, STREAMING)
        c.require(self.ppl or self.icl, "nothing to evaluate: --ppl and --icl both off")
        return c


def newline_token_ids(tokenizer) -> set[int]:
    """Token ids whose text contains a newline (a row's generation stops at the first)."""
    return {i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])}


def _with_answer(tokenizer, prompt_ids: list[int], prompt: str, target: str,
                 bos: int | None = None) -> tuple[list[int], int]:
    """(tokens of prompt + target + "\\n", how many of them the prompt's own tokens share): BPE may merge the
    prompt's end into the answer, so the answer is the tokens after that shared prefix."""
    full = encode_prompt(tokenizer, prompt + target + "\n", bos)
    k = 0
    while k < min(len(prompt_ids), len(full)) and full[k] == prompt_ids[k]:
        k += 1
    return full, k


def _answer_tokens(tokenizer, prompt_ids: list[int], prompt: str, target: str,
                   bos: int | None = None) -> list[int] | None:
    """The tokens spelling ``target + "\\n"`` after the prompt, or None when tokenising prompt and answer together
    does not extend the prompt's own tokens (a BPE merge across the boundary: scored by ``target_logprobs``)."""
    full, k = _with_answer(tokenizer, prompt_ids, prompt, target, bos)
    return full[k:] if k == len(prompt_ids) < len(full) else None


def _score_answers(lm, first: np.ndarray, past, mask, pos, answers: list[list[int]]) -> list[float]:
    """log p(answer | prompt) per row from the prompt's last logits ``first`` (B, V) and one forward of the
    answers' tokens on the prompt's cache (right padded, masked; the cache is left as it was)."""
    b, longest = len(answers), max(len(a) for a in answers)
    first = first.astype(np.float64)
    lp = first - log_normaliser(first)[:, None]
    out = [float(lp[r, a[0]]) for r, a in enumerate(answers)]
    if longest > 1:
        ids = np.zeros((b, longest - 1), dtype=np.int64)
        new = np.zeros_like(ids)
        for r, a in enumerate(answers):
            ids[r, : len(a) - 1], new[r, : len(a) - 1] = a[:-1], 1
        logits = lm.score(ids, np.concatenate([mask, new], 1), pos[:, -1:] + 1 + np.arange(longest - 1), past)
        logits = logits.astype(np.float64)
        logz = log_normaliser(logits)
        for r, a in enumerate(answers):
            n, tgt = len(a) - 1, np.asarray(a[1:], dtype=np.int64)
            out[r] += float((np.take_along_axis(logits[r, :n], tgt[:, None], -1)[:, 0] - logz[r, :n]).sum())
    return out


def greedy_continuations(lm, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 32,
                         stop_ids: set[int] | None = None, on_batch=None,
                         targets: list[str] | None = None) -> list[str] | tuple[list[str], list[float]]:
    """Greedy continuation of every prompt (batched, left padded, with the KV cache), each row stopped after its
    first newline token or ``max_new_tokens``. Returned in prompt order. With ``targets``, also the teacher-forced
    log p(target + "\\n") of each (see ``target_logprobs``), scored on the same prefill: the prompt is run once."""
    stop_ids = newline_token_ids(tokenizer) if stop_ids is None else stop_ids
    stop = np.zeros(max(stop_ids, default=0) + 1 if stop_ids else 1, dtype=bool)
    stop[list(stop_ids)] = True
    bos = bos_first(tokenizer)
    encoded = [encode_prompt(tokenizer, p, bos) for p in prompts]
    answers = [None] * len(prompts) if targets is None else [
        _answer_tokens(tokenizer, e, p, t, bos) for e, p, t in zip(encoded, prompts, targets)]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    results: list[str] = [""] * len(prompts)
    logprobs: list[float | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        b = len(rows)
        ids, mask, pos = left_padded([encoded[i] for i in rows])
        past, gen = None, []
        done = np.zeros(b, dtype=bool)
        for step in range(max_new_tokens):
            logits, past = lm.step(ids, mask, pos, past)
            if step == 0 and targets is not None and any(answers[i] is not None for i in rows):
                # rows without answer tokens score a placeholder (discarded) so the cache is never split
                lps = _score_answers(lm, logits, past, mask, pos, [answers[i] or [0] for i in rows])
                for i, lp in zip(rows, lps):
                    logprobs[i] = lp if answers[i] is not None else None
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
    if targets is None:
        return results
    rest = [i for i, lp in enumerate(logprobs) if lp is None]
    if rest:
        for i, lp in zip(rest, target_logprobs(lm, tokenizer, [prompts[i] for i in rest], [targets[i] for i in rest],
                                               batch_size)):
            logprobs[i] = lp
    return results, logprobs


def target_logprobs(lm, tokenizer, prompts: list[str], targets: list[str], batch_size: int = 32) -> list[float]:
    """Teacher-forced log-probability (nats) of ``target + "\\n"`` after each prompt: a continuous companion to exact
    match (ours, not in the paper) that still ranks models whose greedy answers are all wrong. Left padded."""
    seqs, n_tgt, bos = [], [], bos_first(tokenizer)
    for p, t in zip(prompts, targets):
        full, k = _with_answer(tokenizer, encode_prompt(tokenizer, p, bos), p, t, bos)
        seqs.append(full)
        n_tgt.append(len(full) - k)  # tokens that spell the answer (BPE may merge across the boundary)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out = [0.0] * len(seqs)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        ids, mask, pos = left_padded([seqs[i] for i in rows])
        t, keep = ids.shape[1], max(n_tgt[i] for i in rows) + 1  # only the answer's positions need the LM head
        logits = lm.logits(ids, mask, pos, keep=keep).astype(np.float64)  # (B, keep, V): positions t-keep .. t-1
        logz = log_normaliser(logits)  # (B, keep)
        for r, i in enumerate(rows):
            m = n_tgt[i]
            tgt = ids[r, t - m :]
            w = slice(keep - m - 1, keep - 1)  # positions t-m-1 .. t-2 predict the answer's m tokens
            lp = np.take_along_axis(logits[r, w], tgt[:, None], -1)[:, 0] - logz[r, w]
            out[i] = float(lp.sum())
    return out


def run_icl(lm, tokenizer, words: list[str], tasks=None, shots: int = 10, seeds: int = 3, examples: int = 100,
            batch_size: int = 32, on_progress=None) -> dict:
    """SPEC 7 ICL probes: per task mean/std over demonstration seeds and the macro average (accuracies in %)."""
    tasks = list(tasks or TASKS)
    all_ex = [e for task in tasks for s in range(seeds) for e in task_examples(task, words, examples, shots, s)]
    max_new = max(len(tokenizer(e.target, add_special_tokens=False)["input_ids"]) for e in all_ex) + 8
    conts, lps = greedy_continuations(lm, tokenizer, [e.prompt for e in all_ex], max_new, batch_size,
                                      on_batch=on_progress, targets=[e.target for e in all_ex])
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


def eval_data(run_cfg: dict | None, config, ecfg: EvalConfig) -> dict:
    """The held-out slice to score: the run's own (corpus, split, sequence length, token count) unless overridden;
    without a run, the builtin corpus and ``bdlora train``'s defaults for that kind of teacher."""
    cfg = dict(run_cfg or {})
    origin = cfg.pop("origin", "the run's training options")  # one-shot folders: "the --one-shot options"
    src = origin if run_cfg and "seq_len" in cfg else "defaults"
    d = ecfg.data or cfg.get("data") or BUILTIN
    builtin = (cfg.get("teacher") or (BUILTIN if d == BUILTIN else None)) == BUILTIN
    defaults = teacher_defaults(builtin)
    heldout = ecfg.heldout_fraction
    if heldout is None and not ecfg.data:
        heldout = cfg.get("heldout_fraction")
    if heldout is None:
        heldout = default_heldout(d)
    max_pos = DecoderShape.of(config).max_positions
    return {"data": d, "heldout_fraction": heldout,
            "seq_len": min(ecfg.seq_len or cfg.get("seq_len") or defaults["seq_len"], max_pos),
            "eval_tokens": ecfg.tokens or cfg.get("eval_tokens") or defaults["eval_tokens"],
            "cache_dir": cfg.get("cache_dir"), "teacher": cfg.get("teacher"), "seed": cfg.get("seed") or 0,
            "source_path": cfg.get("source_path"), "samples_runtime": cfg.get("samples_runtime"),
            SAMPLES_PREFIXES: bool(cfg.get(SAMPLES_PREFIXES)) if not ecfg.data else True,  # as the run made them
            "source": "command line" if ecfg.data or ecfg.seq_len or ecfg.tokens else src}


def evaluate_target(path: str | Path, ecfg: EvalConfig, device: str = "cpu", reporter: Reporter = SILENT,
                    samples_from: dict | None = None) -> dict:
    """``bdlora eval``: held-out perplexity and/or the ICL probes of one model; the eval document. ``samples_from``:
    whose ``teacher:N`` samples ``--data`` holds (a teacher beside its student: the student's, never new ones)."""
    ecfg.validate()
    t0 = time.time()
    reporter.stage(f"loading {path}")
    lm, tok, kind, run_cfg = load_eval_target(path, ecfg.onnx_file, device, ecfg.streaming)
    settings = eval_data(run_cfg, lm.config, ecfg)
    given = samples_from or {}
    settings.update({k: v for k, v in given.items() if v and not settings.get(k)})
    settings[SAMPLES_PREFIXES] = given.get(SAMPLES_PREFIXES, settings[SAMPLES_PREFIXES])  # the student's, as made
    cache = Path(settings["cache_dir"]).expanduser() if settings["cache_dir"] else None
    doc: dict = {"schema_version": SCHEMA_VERSION, "bdlora_version": __version__, "source": str(path),
                 "kind": kind, "onnx_file": ecfg.onnx_file if kind == "onnx" else None,
                 "model_type": _get(lm.config, "model_type"), "data": settings}
    if ecfg.ppl:
        reporter.stage(f"perplexity over {settings['eval_tokens']:,} held-out tokens of {settings['data']}")
        from bdlora.models.teacher import recorded_teacher  # torch and transformers: eval imports without them

        corpus_tokens = settings_tokens(settings, tok, teacher=recorded_teacher(settings))
        blocks = scored_blocks(corpus_tokens.tokens("val"), settings["seq_len"], settings["eval_tokens"],
                               f"--data {settings['data']}", bos=corpus_tokens.bos)
        doc["ppl"] = _score(lm, blocks)
        extra = other_domains(ecfg.domains, settings["data"], _get(lm.config, "vocab_size") or 0)
        if extra:
            doc["domains"] = {settings["data"]: doc["ppl"]}
        for d in extra:
            reporter.stage(f"perplexity over {settings['eval_tokens']:,} held-out tokens of {d}")
            try:
                tokens = load_tokens(d, tok, None, cache, what="--domains")
            except DataError as e:  # a default domain that cannot be fetched here is said, not fatal
                if ecfg.domains is not None:
                    raise
                reporter.stage(f"skipped {d}: {e}")
                doc.setdefault("domains_skipped", {})[d] = str(e)
                continue
            b = scored_blocks(tokens.tokens("val"), settings["seq_len"], settings["eval_tokens"], f"--domains {d}",
                              bos=tokens.bos)
            doc["domains"][d] = _score(lm, b)
    if ecfg.icl:
        reporter.stage(f"building the ICL word list from {settings['data']}")
        words = corpus_word_list(settings["data"], settings["heldout_fraction"], cache)
        n = len(ecfg.tasks or TASKS) * ecfg.seeds * ecfg.examples
        reporter.stage(f"ICL probes: {len(ecfg.tasks or TASKS)} tasks x {ecfg.seeds} seeds x {ecfg.examples} "
                       f"prompts ({ecfg.shots}-shot)")
        reporter.count(0, n)
        res = run_icl(lm, tok, words, ecfg.tasks, ecfg.shots, ecfg.seeds, ecfg.examples, ecfg.batch_size,
                      on_progress=lambda k: reporter.count(k, n))
        doc["icl"] = {**res, "words": {"count": len(words), "first": words[:20]}}
    doc["seconds"] = time.time() - t0
    return doc


def _score(lm, blocks: PackedBlocks) -> dict:
    """Perplexity of ``lm`` over ``blocks``, as eval reports it."""
    nll, count = lm.nll(blocks)
    return {"val_ppl": math.exp(nll), "mean_nll": nll, "predicted_tokens": count,
            "tokens": len(blocks) * blocks.seq_len, "seq_len": blocks.seq_len}


def _get(config, key: str):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)
