"""``--data teacher:N`` / ``--calib-data teacher:N``: a corpus sampled from the teacher itself.

Self-generated calibration data carries what the model already does (its chat format, its own distribution of
topics and styles) rather than one domain a user happened to have (Ji et al., ICLR 2025, find it beats external
calibration data for pruning). A chat model (its tokenizer has a chat template) answers varied user requests built
from ``REQUESTS`` x ``TOPICS`` (plus a few few-shot pattern prompts, as ICL-formatted calibration helps broadly:
Bandari et al. 2024), and each document is the whole conversation in the model's template; a plain LM continues
from its BOS (or EOS) token. In a ``--data`` mixture with other corpora, every other prompt is instead a prefix
(``PREFIX_TOKENS``) of one of their training documents, which the teacher continues: its text then also covers the
kinds of text the mixture heals on (the teacher's continuations of them), not only chat replies. Batches cycle
through ``TEMPERATURES`` with nucleus sampling (top-p 0.95), each batch seeded from (seed, batch index), so the
samples are a pure function of (teacher weights, N, seed, prefixes) on one machine.

The samples are written once into the cache as ``samples.jsonl`` with ``corpus.json`` (teacher, its weights' hash,
N, seed, sampling settings, time taken), keyed by the teacher's weights, N, seed, the runtime and the prefixes'
digest, and then read as any corpus.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from bdlora.base.errors import DataError
from bdlora.base.io import atomic_dir, sha256, write_json
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import CORPUS_FILE, TEACHER_SAMPLES
from bdlora.data import runtime_samples

GEN_VERSION = 1
TEMPERATURES = (0.7, 0.9, 1.1)
TOP_P = 0.95
BATCH = 32
MAX_NEW_TOKENS = 256
PREFIX_TOKENS = 32  # tokens of another corpus of the mix a prefix prompt carries (the teacher continues them)
PREFIX_POOL = 2048  # prefixes drawn from those corpora's training splits, equally from each

REQUESTS = (
    "Explain {t} to a curious teenager.", "Write a short story about {t}.", "Give three surprising facts about {t}.",
    "Describe {t} in a few sentences.", "Write a short poem about {t}.", "What are the pros and cons of {t}?",
    "Summarize the history of {t}.", "Write a polite email asking a colleague about {t}.",
    "List the steps someone should take to learn about {t}.", "Answer briefly: why does {t} matter?",
    "Write a dialogue between two friends discussing {t}.", "Give me a simple analogy for {t}.",
)
TOPICS = (
    "the ocean", "photosynthesis", "a city at night", "machine learning", "the Roman Empire", "climate change",
    "baking bread", "the human heart", "black holes", "the stock market", "a rainy afternoon", "volcanoes",
    "learning a new language", "honeybees", "the printing press", "electric cars", "friendship", "chess",
    "the moon landing", "vaccines", "a mountain village", "recycling", "jazz music", "sleep", "the internet",
    "ancient Egypt", "gardening", "earthquakes", "a job interview", "the water cycle", "prime numbers",
    "a lost dog", "coffee", "the immune system", "renewable energy", "a library", "birds migrating", "time zones",
)
PATTERNS = (  # few-shot prompts in the shapes of ICL tasks: the model continues the pattern
    "Continue the pattern and explain it: {a}, {b}, {c}, ...",
    "Translate each word to French, then use it in a sentence: {a}, {b}, {c}.",
    "Sort these words alphabetically and say what they have in common: {c}, {a}, {b}.",
    "Give the opposite of each word: {a} ->, {b} ->, {c} ->",
)
WORDS = ("cold", "bright", "happy", "open", "early", "heavy", "quiet", "strong", "fast", "deep", "soft", "young")


class Teacher(Protocol):
    """The teacher a ``teacher:N`` corpus is sampled from (``models.teacher.TeacherSource``): its folder, whose
    weights key the cache, their fingerprint, the model and tokenizer (loaded only when samples must be generated),
    and the onnxruntime-genai folder the samples are generated through, if any."""

    runtime: Path | None

    def folder(self) -> Path: ...

    def fingerprint(self) -> str: ...

    def load(self) -> tuple: ...


@dataclass(frozen=True)
class Prefixes:
    """Token prefixes from the training splits of the other corpora of a mixture (``sources``), in the order prompts
    use them."""

    sources: tuple[str, ...]
    pool: tuple[tuple[int, ...], ...]

    def digest(self) -> str:
        h = hashlib.sha256("|".join(self.sources).encode())
        for p in self.pool:
            h.update(np.asarray(p, dtype=np.int64).tobytes() + b";")
        return h.hexdigest()[:16]


def draw_prefixes(streams: dict[str, np.ndarray], seed: int) -> Prefixes | None:
    """``PREFIX_POOL`` prefixes of ``PREFIX_TOKENS`` tokens at seeded random places of each training stream (an equal
    share from each), shuffled; None when no stream is long enough to hold one."""
    usable = {name: s for name, s in streams.items() if len(s) > PREFIX_TOKENS}
    if not usable:
        return None
    rng = np.random.default_rng([seed, PREFIX_TOKENS])
    pool = []
    for s in usable.values():
        starts = np.sort(rng.integers(0, len(s) - PREFIX_TOKENS, PREFIX_POOL // len(usable)))
        pool += [tuple(int(t) for t in s[a: a + PREFIX_TOKENS]) for a in starts]
    return Prefixes(tuple(usable), tuple(pool[i] for i in rng.permutation(len(pool))))


def samples_dir(teacher: Teacher, n_tokens: int, seed: int, cache: Path,
                reporter: Reporter = SILENT, prefixes: Prefixes | None = None) -> Path:
    """The cached folder of ``n_tokens`` teacher samples for ``seed`` (generated now if absent); ``prefixes``: half
    the prompts continue them (``draw_prefixes``)."""
    via = f"|genai|{runtime_samples.fingerprint(teacher.runtime)}" if teacher.runtime else ""
    via += f"|prefixes|{prefixes.digest()}" if prefixes else ""
    key = hashlib.sha256(f"{GEN_VERSION}|{teacher.fingerprint()}|{n_tokens}|{seed}{via}".encode()).hexdigest()[:20]
    out = Path(cache) / "corpora" / f"teacher-{key}"
    if out.exists():
        problem = _cache_problem(out)
        if problem is None:
            return out
        reporter.stage(f"the cached teacher samples {out} {problem}: sampling them again")
        shutil.rmtree(out)
    model, tok = teacher.load()
    runtime = f"its onnxruntime-genai export {teacher.runtime}" if teacher.runtime else "PyTorch"
    lead = f"; half the prompts continue {', '.join(prefixes.sources)}" if prefixes else ""
    reporter.stage(f"sampling {n_tokens:,} tokens from the teacher through {runtime} (seed {seed}{lead}; generated "
                   "once, then cached)")
    t0 = time.time()
    with atomic_dir(out) as tmp:
        if teacher.runtime:
            docs, generated = generate_runtime(teacher.runtime, tok, n_tokens, seed, reporter, prefixes=prefixes)
        else:
            docs, generated = generate(model, tok, n_tokens, seed, reporter, prefixes=prefixes)
        with open(tmp / TEACHER_SAMPLES, "w", encoding="utf-8") as fh:
            for d in docs:
                fh.write(json.dumps(d, ensure_ascii=False) + "\n")
        write_json(tmp / CORPUS_FILE, {
            "name": f"teacher:{n_tokens}", "teacher": str(teacher.folder()), "teacher_sha256": teacher.fingerprint(),
            "tokens_requested": n_tokens, "tokens_generated": generated, "documents": len(docs), "seed": seed,
            "temperatures": list(TEMPERATURES), "top_p": TOP_P, "max_new_tokens": MAX_NEW_TOKENS,
            "chat_template": has_chat_template(tok), "seconds": time.time() - t0, "version": GEN_VERSION,
            "runtime": "onnxruntime-genai" if teacher.runtime else "pytorch",
            "runtime_folder": str(teacher.runtime) if teacher.runtime else None,
            "runtime_precision": runtime_samples.precision(teacher.runtime) if teacher.runtime else None,
            "prefix_sources": list(prefixes.sources) if prefixes else [], "prefix_tokens": PREFIX_TOKENS,
            SAMPLES_SHA256: sha256(tmp / TEACHER_SAMPLES)})
    return out


SAMPLES_SHA256 = "samples_sha256"  # corpus.json: the content hash of samples.jsonl, checked on every reuse


def _cache_problem(out: Path) -> str | None:
    """Why a cached samples folder cannot be reused (None: it can): a rewritten or truncated samples.jsonl read as
    if it were the teacher's (perplexity 424.0 against 16.65), or a folder without a whole record."""
    try:
        want = json.loads((out / CORPUS_FILE).read_text()).get(SAMPLES_SHA256)
    except (OSError, ValueError, AttributeError):
        return f"have no readable {CORPUS_FILE}"
    if not want:
        return "carry no content hash (written by an older bdlora)"
    try:
        if sha256(out / TEACHER_SAMPLES) != want:
            return "were changed or damaged (samples.jsonl's content hash differs from the one recorded)"
    except OSError:
        return "have no samples.jsonl"
    return None


def has_chat_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def prompts(seed: int, count: int) -> list[str]:
    """``count`` user requests drawn with ``seed``: REQUESTS x TOPICS, and one in eight a PATTERNS prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        if rng.random() < 0.125:
            a, b, c = rng.choice(WORDS, size=3, replace=False)
            out.append(PATTERNS[rng.integers(len(PATTERNS))].format(a=a, b=b, c=c))
        else:
            out.append(REQUESTS[rng.integers(len(REQUESTS))].format(t=TOPICS[rng.integers(len(TOPICS))]))
    return out


@torch.no_grad()
def generate(model, tok, n_tokens: int, seed: int, reporter: Reporter = SILENT, temperatures: tuple[float, ...] =
             TEMPERATURES, prefixes: Prefixes | None = None) -> tuple[list[dict], int]:
    """Documents of sampled text until ``n_tokens`` new tokens are generated, through PyTorch (transformers'
    ``generate``, left-padded batches); returns (documents, tokens)."""
    device = next(model.parameters()).device
    max_pos = getattr(model.config, "max_position_embeddings", None) or 2048
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def batch(ids: list[list[int]], new: int, temperature: float, batch_seed: int) -> list[list[int]]:
        width = max(len(x) for x in ids)
        x = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros_like(x)
        for i, row in enumerate(ids):  # left-padded, so every prompt ends where generation starts
            x[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        torch.manual_seed(batch_seed)
        out = model.generate(input_ids=x.to(device), attention_mask=mask.to(device), do_sample=temperature > 0,
                             temperature=temperature or None, top_p=TOP_P if temperature else None,
                             top_k=0 if temperature else None, max_new_tokens=new, eos_token_id=tok.eos_token_id,
                             pad_token_id=pad)
        return out[:, width:].tolist()

    was_training = model.training
    model.eval()
    try:
        return sample_documents(tok, n_tokens, seed, max_pos, batch, reporter, temperatures, prefixes)
    finally:
        model.train(was_training)


def generate_runtime(folder: Path, tok, n_tokens: int, seed: int, reporter: Reporter = SILENT,
                     temperatures: tuple[float, ...] = TEMPERATURES,
                     prefixes: Prefixes | None = None) -> tuple[list[dict], int]:
    """``generate``'s documents through the teacher's onnxruntime-genai export ``folder``."""
    context, batch = runtime_samples.batcher(folder, tok.eos_token_id, TOP_P)
    return sample_documents(tok, n_tokens, seed, context, batch, reporter, temperatures, prefixes)


def sample_documents(tok, n_tokens: int, seed: int, max_pos: int, batch, reporter: Reporter = SILENT,
                     temperatures: tuple[float, ...] = TEMPERATURES,
                     prefixes: Prefixes | None = None) -> tuple[list[dict], int]:
    """The documents of ``generate`` from any runtime: ``batch(prompt ids, new tokens, temperature, seed)`` returns
    each prompt's new tokens (EOS ends a reply; what follows it is ignored). With ``prefixes``, every other prompt is
    the next prefix (its EOS tokens dropped) and the document is the prefix and its continuation, as plain text."""
    chat = has_chat_template(tok)
    eos = tok.eos_token_id
    start = tok.bos_token_id if tok.bos_token_id is not None else eos
    if eos is None:
        raise DataError("teacher:N: the teacher's tokenizer has no EOS token to end a sample with")
    docs, total, batch_index = [], 0, 0
    reporter.count(0, n_tokens, "tokens")
    while total < n_tokens:
        temperature = temperatures[batch_index % len(temperatures)]
        asks = prompts(seed * 1_000_003 + batch_index, BATCH) if chat else [None] * BATCH
        ids = _prompt_ids(tok, asks, start, chat)
        lead = {i: [t for t in prefixes.pool[(batch_index * BATCH + i) // 2 % len(prefixes.pool)] if t != eos]
                for i in range(1, BATCH, 2)} if prefixes else {}
        for i, p in lead.items():
            ids[i] = [start, *p]
        new = max(1, min(MAX_NEW_TOKENS, max_pos - max(len(x) for x in ids)))
        for i, row in enumerate(batch(ids, new, temperature, seed * 1_000_003 + batch_index)):
            reply = row[: row.index(eos)] if eos in row else row
            if not reply:
                continue
            text = tok.decode(lead.get(i, []) + reply, skip_special_tokens=True)
            if chat and i not in lead:
                text = tok.apply_chat_template([{"role": "user", "content": asks[i]},
                                                {"role": "assistant", "content": text}], tokenize=False)
            docs.append({"id": f"teacher-{seed}-{batch_index}-{i}", "text": text, "temperature": temperature,
                         "prefix_tokens": len(lead.get(i, []))})
            total += len(reply)
            reporter.count(len(reply), n_tokens, "tokens")
        batch_index += 1
    return docs, total


def _prompt_ids(tok, asks: list, start: int, chat: bool) -> list[list[int]]:
    if not chat:
        return [[start] for _ in asks]
    out = []
    for a in asks:
        ids = tok.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out
