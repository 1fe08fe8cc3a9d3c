"""What ``--data`` and ``--calib-data`` name, beyond one corpus folder, and the one function every command reads
tokens through (``load_tokens``).

A spec is one of:

- ``builtin``: the Python standard library's source (``bdlora.data.tokens``);
- ``prose``: English prose, the reStructuredText documentation of Django (``PROSE``: 640 files, 6 MB of English,
  BSD-3-Clause), fetched once from the package registry as the project's source distribution with ``pip download
  --no-deps`` (nothing is installed) and kept in the cache with its licence;
- ``fortunes``: English of another kind (quotations, literature, poems, jokes: BSD fortune's files from Debian's
  ``fortunes`` package, ``bdlora.data.fortunes``), fetched once and cached with its licence: the domain a model
  calibrated or healed on ``builtin:1,prose:1`` never saw;
- a path: a .txt/.jsonl/.parquet file or folder, or a ``datasets.save_to_disk`` folder;
- ``teacher:N``: N tokens sampled from the teacher itself (``bdlora.data.selfgen``), generated once per (teacher
  weights, N, seed) and cached like a corpus;
- a mixture ``A:w,B:w,...`` of any of the above (``builtin:0.5,/corpora/prose:0.5``; weights are normalised).

A mixture is built from its components' token streams: each split takes, from every component, exactly
``floor(w_i * T)`` tokens, where ``T`` is the largest total no component runs short of (nothing is repeated, so a
small component bounds the total), in chunks of ``MIX_CHUNK`` tokens drawn evenly from the whole component and
shuffled together with a fixed seed, so any prefix of a split (the held-out tokens ``--eval-tokens`` scores) holds
the same proportions. Components keep their own held-out fractions unless one is given for all.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bdlora.base.errors import DataError
from bdlora.base.io import atomic_dir
from bdlora.base.reporter import SILENT, Reporter
from bdlora.data.blocks import PackedBlocks, scored_blocks
from bdlora.data.documents import BUILTIN, BUILTIN_HELDOUT_FRACTION, Corpus
from bdlora.data.fortunes import FORTUNES, fortunes_dir
from bdlora.data.fortunes import HELDOUT_FRACTION as FORTUNES_HELDOUT
from bdlora.data.prose import PROSE, prose_dir
from bdlora.data.token_cache import sealed, whole
from bdlora.data.tokens import TokenizedCorpus, default_cache_dir, tokenize_corpus

BUILTIN_CORPORA = (BUILTIN, PROSE, FORTUNES)  # the corpora bdlora names (the first ships with Python, the others are
# fetched once from a package registry and cached)
TEACHER_PREFIX = "teacher:"
# teacher:N generates N tokens with the teacher before training starts: beyond this it is a typo, not a corpus
# (teacher:1000000000000 started generating with no end in sight)
MAX_TEACHER_TOKENS = 100_000_000
MIX_CHUNK = 1024
MIX_SEED = 20261125
MIX_VERSION = 1
SAMPLES_PREFIXES = "samples_prefixes"  # data settings: teacher:N in a mixture continued the other parts


@dataclass(frozen=True)
class Part:
    spec: str
    weight: float


def parse(spec: str, what: str = "--data") -> list[Part]:
    """The components of ``spec`` with normalised weights; one component (weight 1) unless ``spec`` holds a comma
    and is not itself an existing path."""
    spec = str(spec)
    if "," not in spec or Path(spec).expanduser().exists():
        _check_single(spec, what)
        return [Part(spec, 1.0)]
    parts = []
    for item in spec.split(","):
        name, sep, w = item.strip().rpartition(":")
        try:
            weight = float(w) if sep else float("nan")
        except ValueError:
            weight = float("nan")
        if not name or not math.isfinite(weight) or weight <= 0:
            raise DataError(f"{what} {spec}: '{item}' is not CORPUS:WEIGHT with a positive weight (a mixture is "
                            "e.g. builtin:0.5,prose:0.5)")
        _check_single(name, what)
        parts.append(Part(name, weight))
    names = [p.spec for p in parts]
    if len(set(names)) != len(names):
        raise DataError(f"{what} {spec}: a corpus is named twice; give each once with its whole weight")
    top = max(p.weight for p in parts)  # scaled first: weights of 1e308 summed to inf and divided to zero
    total = sum(p.weight / top for p in parts)
    parts = [Part(p.spec, p.weight / top / total) for p in parts]
    for part, item in zip(parts, spec.split(",")):
        if part.weight == 0.0:
            raise DataError(f"{what} {spec}: '{item.strip()}': a weight this small next to the others is zero in "
                            "floating point (give weights within a factor of 1e300 of each other)")
    return parts


def teacher_tokens(spec: str) -> int | None:
    """N of a ``teacher:N`` spec (None for any other)."""
    if not spec.startswith(TEACHER_PREFIX):
        return None
    return int(spec[len(TEACHER_PREFIX):])


def _check_single(spec: str, what: str) -> None:
    if spec.startswith(TEACHER_PREFIX):
        n = spec[len(TEACHER_PREFIX):]
        # ASCII digits only: "²".isdigit() is true and int("²") a ValueError
        if not (n.isascii() and n.isdigit()) or not 1 <= int(n) <= MAX_TEACHER_TOKENS:
            raise DataError(f"{what} {spec}: teacher:N needs a whole number of tokens from 1 to "
                            f"{MAX_TEACHER_TOKENS:,} (e.g. teacher:65536)")
        return
    if spec in BUILTIN_CORPORA:
        return
    Corpus(spec, what=what)  # the path exists and holds a readable kind of corpus


def check_spec(spec: str, what: str = "--data") -> list[Part]:
    """Refuse a bad spec (unknown path, malformed mixture, bad N) before anything long starts."""
    return parse(spec, what)


def default_heldout(spec: str) -> float | None:
    """The held-out fraction a spec uses when none is given: its corpus's own (0.02 for builtin, prose and teacher
    samples; 0.002 for a user corpus); None for a mixture (each component keeps its own)."""
    parts = parse(spec)
    if len(parts) > 1:
        return None
    s = parts[0].spec
    if s == FORTUNES:
        return FORTUNES_HELDOUT
    if s in (BUILTIN, PROSE) or s.startswith(TEACHER_PREFIX):
        return BUILTIN_HELDOUT_FRACTION
    return Corpus(s).default_heldout_fraction


GENERAL_VOCABULARY = 32000
# What a general-purpose model (a pretrained LLM's vocabulary) calibrates on by default, in compress --one-shot, plan
# and train's start: the two builtin corpora that are not the unseen one (fortunes stays unseen for the front).
# Measured on SmolLM2 at one-shot 1.2x, 8,192 tokens: against builtin alone, prose 13.70 -> 12.59 and fortunes
# 106.0 -> 104.1 at builtin 23.34 -> 23.53.
GENERAL_CALIB_DATA = "builtin:1,prose:1"


def general_calib_data(data: str, calib_data: str | None, vocab_size: int) -> str | None:
    """The calibration corpus to use when ``--calib-data`` was not given (None: ``data`` itself): the builtin mixture
    ``GENERAL_CALIB_DATA`` for a general-purpose model scored on the builtin corpus."""
    if calib_data is None and data == BUILTIN and vocab_size >= GENERAL_VOCABULARY:
        return GENERAL_CALIB_DATA
    return calib_data


def unseen_corpus(*specs: str | None) -> str | None:
    """The first builtin corpus (fortunes, prose, builtin: the kind of English furthest from the others first) that
    none of ``specs`` (a run's --data and --calib-data, mixtures included) names: the default second domain a
    student is scored on; None when every one was seen."""
    seen = {p.spec for s in specs if s for p in parse(s)}
    return next((c for c in (FORTUNES, PROSE, BUILTIN) if c not in seen), None)


def shared_corpus(eval_data: str, data: str) -> str | None:
    """A corpus ``eval_data`` shares with the training ``data`` (None: they share none): the same name or file, or
    teacher samples on both sides (drawn with the same seed, their first documents are the same)."""
    def key(spec: str) -> str:
        p = Path(spec).expanduser()
        return str(p.resolve()) if p.exists() else TEACHER_PREFIX if teacher_tokens(spec) is not None else spec

    seen = {key(p.spec): p.spec for p in parse(data)}
    return next((p.spec for p in parse(eval_data, "--eval-data") if key(p.spec) in seen), None)


def other_domains(domains: str | None, data: str, vocab_size: int) -> list[str]:
    """The corpora scored besides ``data``: ``domains`` as given, else for a general-purpose model (a vocabulary of
    ``GENERAL_VOCABULARY`` or more: a pretrained LLM's, not the builtin or a test teacher's) prose and the builtin
    corpus ``data`` does not name (``unseen_corpus``: fortunes for a model healed on builtin and prose)."""
    if domains is None:
        names = list(dict.fromkeys(x for x in (PROSE, unseen_corpus(data)) if x)) if (
            vocab_size >= GENERAL_VOCABULARY) else []
    else:
        names = [d.strip() for d in domains.split(";" if ";" in domains else ",") if d.strip()]
    for d in names:
        check_spec(d, "--domains")
    return [d for d in names if d != data]


def open_corpus(spec: str, cache_dir: Path | None = None, what: str = "--data", teacher=None, seed: int = 0,
                reporter: Reporter = SILENT, prefixes=None) -> Corpus:
    """The documents of one (non-mixture) spec: prose and teacher samples are materialised into the cache first.
    ``teacher``: a ``selfgen.Teacher`` (``models.teacher.TeacherSource``, needed for ``teacher:N``); ``prefixes``:
    ``selfgen.Prefixes`` half its prompts continue."""
    cache = Path(cache_dir or default_cache_dir())
    n = teacher_tokens(spec)
    if spec == PROSE:
        corpus = Corpus(prose_dir(cache, reporter), what=what, name=PROSE)
    elif spec == FORTUNES:
        corpus = Corpus(fortunes_dir(cache, reporter), what=what, name=FORTUNES)
        corpus.default_heldout_fraction = FORTUNES_HELDOUT
        return corpus
    elif n is not None:
        from bdlora.data.selfgen import samples_dir

        if teacher is None:
            raise DataError(f"{what} {spec}: teacher samples need the teacher they are sampled from")
        corpus = Corpus(samples_dir(teacher, n, seed, cache, reporter, prefixes), what=what, name=spec)
    else:
        return Corpus(spec, what=what)
    corpus.default_heldout_fraction = BUILTIN_HELDOUT_FRACTION  # hundreds of documents, as the builtin corpus
    return corpus


def load_tokens(spec: str, tokenizer, heldout_fraction: float | None = None, cache_dir: Path | None = None,
                what: str = "--data", teacher=None, seed: int = 0, reporter: Reporter = SILENT,
                prefixes: bool = True) -> TokenizedCorpus:
    """The train/val token streams of ``spec`` (tokenised once and cached): one corpus or a mixture of its parts
    (``load_parts``)."""
    loaded = load_parts(spec, tokenizer, heldout_fraction, cache_dir, what, teacher, seed, reporter, prefixes)
    return one_corpus(loaded, cache_dir, what)


def one_corpus(loaded: list[tuple[Part, TokenizedCorpus]], cache_dir: Path | None = None,
               what: str = "--data") -> TokenizedCorpus:
    """The one corpus of ``load_parts``' parts: itself when there is one, else their mixture."""
    if len(loaded) == 1:
        return loaded[0][1]
    return mix([t for _, t in loaded], [p.weight for p, _ in loaded], [p.spec for p, _ in loaded],
               Path(cache_dir or default_cache_dir()), what)


def load_parts(spec: str, tokenizer, heldout_fraction: float | None = None, cache_dir: Path | None = None,
               what: str = "--data", teacher=None, seed: int = 0, reporter: Reporter = SILENT,
               prefixes: bool = True) -> list[tuple[Part, TokenizedCorpus]]:
    """Each part of ``spec`` with its token streams. In a mixture (``prefixes``: runs and folders written before
    they existed record False), ``teacher:N`` samples continue prefixes of the other parts' training splits for half
    their prompts, the same samples whoever asks (the mixture, its reweighting, its evaluation)."""
    parts = parse(spec, what)
    cache = Path(cache_dir or default_cache_dir())

    def one(s: str, prefixes=None) -> TokenizedCorpus:
        corpus = open_corpus(s, cache, what, teacher, seed, reporter, prefixes)
        frac = corpus.default_heldout_fraction if heldout_fraction is None else heldout_fraction
        reporter.stage(f"tokenising {s} ({len(corpus.files)} files)")
        tokens = tokenize_corpus(corpus, tokenizer, frac, cache)
        if sum(tokens.meta["tokens"].values()) == 0:
            raise DataError(f"{what} {s}: the corpus is empty")
        return tokens

    if len(parts) == 1:
        return [(parts[0], one(parts[0].spec))]
    made = {p.spec: one(p.spec) for p in parts if teacher_tokens(p.spec) is None}
    drawn = None
    if prefixes and len(made) < len(parts):
        from bdlora.data.selfgen import draw_prefixes

        drawn = draw_prefixes({s: t.tokens("train") for s, t in made.items()}, seed)
    return [(p, made[p.spec] if p.spec in made else one(p.spec, drawn)) for p in parts]


def mix_counts(available: list[int], weights: list[float]) -> list[int]:
    """Tokens each component gives to a split: ``floor(w_i * T)`` with ``T = min_i(available_i / w_i)``, the
    largest total no component runs short of."""
    total = min(a / w for a, w in zip(available, weights))
    return [min(a, math.floor(w * total + 1e-9)) for a, w in zip(available, weights)]


def _chunks(n_avail: int, take: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(start, length) spans of a component's stream totalling exactly ``take`` tokens: whole ``MIX_CHUNK`` chunks
    drawn without replacement across the whole stream, the last one cut short."""
    n_chunks = n_avail // MIX_CHUNK
    whole, rest = divmod(take, MIX_CHUNK)
    want = whole + (1 if rest else 0)
    if want > n_chunks:  # a component shorter than a few chunks: its first ``take`` tokens in one span
        return [(0, take)] if take else []
    idx = np.sort(rng.choice(n_chunks, size=want, replace=False))
    spans = [(int(i) * MIX_CHUNK, MIX_CHUNK) for i in idx]
    if rest:
        spans[-1] = (spans[-1][0], rest)
    return spans


def mix(parts: list[TokenizedCorpus], weights: list[float], specs: list[str], cache: Path,
        what: str = "--data") -> TokenizedCorpus:
    """The mixture of tokenised components with ``weights`` (summing to 1), cached by its components' content keys
    and weights."""
    dtypes = {p.meta["dtype"] for p in parts}
    key = hashlib.sha256(json.dumps([MIX_VERSION, MIX_CHUNK, [p.path.name for p in parts],
                                     [round(w, 12) for w in weights]]).encode()).hexdigest()[:20]
    out = cache / "data" / f"mixture-{key}"
    if (meta := whole(out)) is not None:  # else absent, interrupted or damaged: mixed again in its place
        return TokenizedCorpus(out, meta, parts[0].bos)
    dtype = "uint32" if "uint32" in dtypes else next(iter(dtypes))
    components = [{"spec": s, "weight": w, "cache": p.path.name, "tokens": {}}
                  for s, w, p in zip(specs, weights, parts)]
    counts = {}
    with atomic_dir(out) as tmp:
        for split in ("train", "val"):
            available = [p.meta["tokens"][split] for p in parts]
            take = mix_counts(available, weights)
            if sum(take) == 0 and split == "train":
                raise DataError(f"{what}: a component of the mixture has no {split} tokens "
                                f"({', '.join(f'{s}: {a:,}' for s, a in zip(specs, available))})")
            rng = np.random.default_rng(MIX_SEED)
            spans = [(i, s) for i, (p, t) in enumerate(zip(parts, take))
                     for s in _chunks(len(p.tokens(split)), t, rng)]
            order = rng.permutation(len(spans))
            with open(tmp / f"{split}.bin", "wb") as fh:
                for j in order:
                    i, (start, length) = spans[j]
                    fh.write(np.asarray(parts[i].tokens(split)[start : start + length], dtype=dtype).tobytes())
            counts[split] = int(sum(take))
            for c, t in zip(components, take):
                c["tokens"][split] = int(t)
        meta = sealed(tmp, {"format_version": 1, "corpus": ",".join(f"{s}:{w:g}" for s, w in zip(specs, weights)),
                            "corpus_kind": "mixture", "dtype": dtype, "tokens": counts, "mixture": components,
                            "chunk_tokens": MIX_CHUNK})
    return TokenizedCorpus(out, meta, parts[0].bos)


# --------------------------------------------------------------------------------------------------------------------
# What a run or a folder recorded
# --------------------------------------------------------------------------------------------------------------------


def settings_tokens(settings: dict, tokenizer, what: str = "--data", teacher=None) -> TokenizedCorpus:
    """The tokens of the corpus a run (or a one-shot compression) recorded in ``settings`` (``RunDir.data_settings``
    or a compression's ``data_settings``: data, heldout_fraction, cache_dir, seed); the builtin corpus when none is
    recorded. ``teacher``: the teacher ``teacher:N`` samples came from (``models.teacher.recorded_teacher(settings)``,
    a ``selfgen.Teacher``), needed only when the corpus holds such samples."""
    cache = Path(settings["cache_dir"]).expanduser() if settings.get("cache_dir") else None
    return load_tokens(settings.get("data") or BUILTIN, tokenizer, settings.get("heldout_fraction"), cache, what,
                       teacher=teacher, seed=int(settings.get("seed") or 0),
                       prefixes=bool(settings.get(SAMPLES_PREFIXES)))


def heldout_blocks(run_config: dict, tokenizer, teacher=None) -> PackedBlocks:  # run_config: RunDir.data_settings()
    """The held-out blocks a run was scored on (same corpus, split, sequence length and token count), from the
    tokenised-corpus cache (re-tokenised if the cache was cleared); ``teacher`` as ``settings_tokens``'s."""
    data = settings_tokens(run_config, tokenizer, teacher=teacher)
    return scored_blocks(data.tokens("val"), run_config["seq_len"], run_config["eval_tokens"],
                         f"the run's corpus ({run_config.get('data') or BUILTIN})", bos=data.bos)
