"""``bdlora bench --runtime genai``: the variants timed in onnxruntime-genai, the runtime users deploy with.

Every variant (dense, lora, compressed; each at every ``--genai-precisions`` precision) is exported by
``bdlora.export.genai`` and driven by ``og.Generator``, as a deployment would run it: the KV cache lives in one
buffer that GroupQueryAttention updates in place (no per-step copies through Python). The peer rows are what a
user would deploy without bdlora: the same dense model (the compressed student's low-rank pairs multiplied out)
saved as a plain Hugging Face folder of its base family and converted by onnxruntime-genai's own model builder
(``python -m onnxruntime_genai.models.builder``) at fp32 and, when asked, int4. Every folder gets the same session
options (intra-op threads); timing runs in a separate process (``bench.genai_worker``), variants interleaved.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch.nn as nn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from bdlora.base.errors import BdloraError, DataError, UsageError
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import CONFIG, GENAI_CONFIG, all_logits_graph, row_name
from bdlora.base.schemes import mixed
from bdlora.base.threads import ThreadPool
from bdlora.bench.config import NO_DOMAIN, BenchConfig
from bdlora.bench.front import PEER
from bdlora.bench.launch import run_timing_process
from bdlora.bench.specs import GenaiTiming
from bdlora.data.corpora import GENERAL_VOCABULARY, default_heldout, unseen_corpus
from bdlora.data.documents import BUILTIN
from bdlora.data.tokens import default_cache_dir
from bdlora.deployed.modeling_bdlora import BDLORA_CLASSES
from bdlora.eval.icl import corpus_word_list
from bdlora.eval.reference import teacher_folder
from bdlora.export.genai.folder import (
    calibration_blocks,
    corpus_blocks,
    data_settings,
    deployment,
    heldout_for,
)
from bdlora.export.settings import DEFAULT as GENAI
from bdlora.export.settings import HEAD_BITS
from bdlora.models.budgeted.model import narrow_sites
from bdlora.models.families import FAMILIES, base_type
from bdlora.models.load import load_model_folder
from bdlora.models.runtime import DecoderShape, score_blocks, session

BUILDER_PRECISIONS = {"fp32": "fp32", "int4": "int4"}  # the builder's -p values we compare against


def _stand_in_tokenizer():
    """A byte-level BPE with no merges, for synthetic mode (the builder copies a tokenizer; nothing decodes)."""

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(sorted(alphabet))}}  # EOS 0: in any vocabulary
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


DEFAULT_QUALITY_TOKENS = 8192  # held-out tokens of the front's perplexities when the model has no run to copy
MAX_QUALITY_TOKENS = 32768  # ... and at most, by default: every folder is scored (a real teacher's run has 1M)


def save_base_folder(dense: nn.Module, tok, folder: Path) -> None:
    """``dense`` (a bdlora model whose projections are all dense) as a plain HF folder of its base family."""

    cfg = dense.config
    base = (getattr(cfg, "bdlora", None) or {}).get("base_model_type", cfg.model_type)

    cfg_cls, _ = BDLORA_CLASSES[base]
    base_cfg_cls = next(c for c in cfg_cls.__mro__[1:] if not c.__name__.startswith("Bdlora"))  # e.g. LlamaConfig
    keep = {k: v for k, v in cfg.to_dict().items()
            if k not in ("bdlora_modules", "bdlora", "auto_map", "architectures", "model_type")}
    plain = AutoModelForCausalLM.from_config(base_cfg_cls(**keep))
    missing, unexpected = plain.load_state_dict(dense.state_dict(), strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise BdloraError(f"dense variant does not map onto {base}: missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]}")
    plain.save_pretrained(folder)
    tok.save_pretrained(folder)


def builder_misreads(config) -> str | None:
    """Why onnxruntime-genai's builder would write a wrong graph for a model of this config, or None.

    The builder (0.18) takes every ``nn.Linear`` with ``vocab_size`` outputs for the LM head, so when the MLP is as
    wide as the vocabulary it wires the logits to layer 0's MLP input: its graph loads and runs, and scores
    perplexity ~650 where the model has ~95 (the builtin teacher: SwiGLU 1024, vocabulary 1024). Its rows would
    be a wrong graph, timed; bench leaves them out and says why."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    known = FAMILIES.get(base_type(str(get("model_type") or "")))
    if known is None or not known.builder:
        return (f"onnxruntime-genai's builder does not convert model_type {get('model_type')!r} "
                "(bdlora.models.families)")
    heads, hidden = get("num_attention_heads") or 1, get("hidden_size")
    head_dim = get("head_dim") or (hidden or 0) // heads
    outs = {"intermediate_size": get("intermediate_size"), "hidden_size": hidden, "query width": heads * head_dim,
            "key/value width": (get("num_key_value_heads") or heads) * head_dim}
    vocab = get("vocab_size")
    same = [k for k, v in outs.items() if v == vocab]
    if same:
        return (f"onnxruntime-genai's builder takes every Linear with vocab_size ({vocab}) outputs for the LM head, "
                f"and this model's {same[0]} is also {vocab}: its graph would be wrong, so it is not timed")
    return None


def run_builder(hf_folder: Path, out: Path, precision: str, threads: int, cache: Path) -> str | None:
    """Convert ``hf_folder`` with onnxruntime-genai's builder; None on success, else the reason it could not."""
    misread = builder_misreads(json.loads((hf_folder / CONFIG).read_text()))
    if misread:
        return misread
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o", str(out), "-p",
           BUILDER_PRECISIONS[precision], "-e", "cpu", "-c", str(cache)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (out / GENAI_CONFIG).exists():
        tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()][-1:]
        return f"onnxruntime-genai's builder failed ({tail[0][:200] if tail else proc.returncode})"
    cfg = json.loads((out / GENAI_CONFIG).read_text())
    cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = int(threads)  # same as our folders
    (out / GENAI_CONFIG).write_text(json.dumps(cfg, indent=2))
    return None


def export_variants(models: dict[str, nn.Module], tok, precisions: list[str], work: Path, pool: ThreadPool,
                    peers: bool, reporter: Reporter = SILENT, teacher: Path | None = None,
                    settings=BenchConfig().settings_for, calibration=None) -> tuple[dict[str, Path], dict]:
    """Every variant at every precision as a genai folder, plus the builder's peer folders; (folders, notes).
    ``models`` may hold "teacher" (the model the student came from; ``teacher`` its HF folder, which the builder
    converts as a user would: ``teacher-builder-<precision>``). ``settings`` (model name, precision -> its
    ``GenaiExportConfig``) and ``calibration`` (the blocks a calibrated scheme rounds against): how each folder is
    written (``export.genai.folder.deployment``)."""

    folders: dict[str, Path] = {}
    notes: dict = {}
    tok = tok if tok is not None else _stand_in_tokenizer()
    for name, m in models.items():
        ctx = int(min(getattr(m.config, "max_position_embeddings", 4096) or 4096, 4096))
        grams: dict = {}  # gptq: one calibration per model, whatever the precisions
        for p in precisions:
            key = row_name(name, p)
            reporter.stage(f"exporting the {key} genai folder")
            given = settings(name, p, context_length=ctx, pool=pool)
            shipped = given.resolved(m.config)  # the head at the bits the folder declares, unless --head-bits
            if mixed(p) and given.head_bits is None and shipped.head_bits != HEAD_BITS:
                notes[key] = (f"LM head at {shipped.head_bits} bits, as the folder declares (--forms bits chose it): "
                              "rounding, not structure; --head-bits 4 puts every int4 row's head there")
            folders[key] = deployment(m, tok, work / f"genai-{key}", shipped, calibration=calibration, grams=grams,
                                      reporter=reporter)
    if peers:
        sources = [("teacher-builder", teacher)] if teacher is not None else []
        dense = models.get("dense")
        narrow = narrow_sites(dense) if dense is not None else []
        if dense is None:  # --no-own-forms: the builder converts the teacher only
            notes["builder"] = "no builder row of the model's dense form (--no-own-forms)"
        elif narrow:  # the builder writes one MLP width and head count for every layer: no builder row of the student
            for p in [p for p in precisions if p in BUILDER_PRECISIONS]:
                notes[f"builder-{p}"] = (f"onnxruntime-genai's builder writes one MLP width and head count for every "
                                         f"layer; {len(narrow)} of this model's blocks are pruned (--forms channels, "
                                         "groups)")
        else:
            hf = work / "hf-dense"
            save_base_folder(dense, tok, hf)
            sources.insert(0, ("builder", hf))
        for prefix, src in sources:
            for p in [p for p in precisions if p in BUILDER_PRECISIONS]:
                key = f"{prefix}-{p}"
                reporter.stage(f"converting {src.name} with onnxruntime-genai's builder ({p})")
                failed = run_builder(src, work / f"genai-{key}", p, pool.count, work / "builder-cache")
                if failed:
                    notes[key] = failed
                    reporter.stage(f"{key}: {failed}")
                else:
                    folders[key] = work / f"genai-{key}"
    return folders, notes


def score_folders(folders: dict[str, Path], shapes: dict[str, DecoderShape], blocks,
                  reporter: Reporter = SILENT) -> dict[str, dict]:
    """Held-out perplexity of every folder's graph under onnxruntime, on the same blocks (``shapes``: the decoder
    shape of each folder's model, by folder key)."""
    out = {}
    for key, folder in folders.items():
        shape = shapes[key]
        reporter.stage(f"held-out perplexity of {key} ({len(blocks) * blocks.seq_len:,} tokens)")
        nll, _ = score_blocks(session(folder / all_logits_graph(folder)), shape, blocks)
        out[key] = {"ppl": math.exp(nll), "tokens": len(blocks) * blocks.seq_len}
    return out


def time_genai(folders: dict[str, Path], shapes: list, repeats: int, warmup: int, decode_tokens: int, vocab: int,
               work: Path, reporter: Reporter = SILENT, ggufs: dict[str, Path] | None = None,
               threads: int | None = None) -> list[dict]:
    """Time every folder through og.Generator, and every GGUF file (``ggufs``) in llama.cpp on ``threads`` threads,
    interleaved in one separate process; raw per-repeat ms per (variant, shape)."""
    spec = GenaiTiming(folders={k: str(v) for k, v in folders.items()}, shapes=shapes, repeats=repeats, warmup=warmup,
                       decode_tokens=decode_tokens, vocab=vocab, threads=threads,
                       gguf={k: str(v) for k, v in (ggufs or {}).items()})
    res = run_timing_process(spec, "genai", work,
                             lambda line: line.startswith("genai "), reporter, what="genai and llama.cpp timing")
    return res["times"]


@dataclass
class Deployment:
    """What the deployed comparison needs beside the student: its teacher (model and HF folder, exported at every
    precision and converted by the builder), the held-out blocks every graph's perplexity is measured on, and the
    calibration blocks of ``--quant gptq``."""

    teacher: nn.Module | None = None
    teacher_dir: Path | None = None
    heldout: object | None = None
    calibration: object | None = None
    others: dict[str, nn.Module] = field(default_factory=dict)  # more students on the same front (bench --also)
    # and healed dense peers (bench --peer: ``peer-NAME``, rounded as the teacher)
    unseen: tuple[str, object] | None = None  # (corpus, its held-out blocks): the second domain every row is scored on
    words: list[str] | None = None  # --icl: the probes' word list, from the held-out documents of the same corpus
    folders: dict[str, Path] = field(default_factory=dict)  # each front model's folder by row name (compressed,
    # teacher, an --also's, peer-NAME): what --runtime llamacpp exports as GGUF files


def unseen_data(eval_data: str | None, settings: dict, vocab_size: int) -> str | None:
    """The second domain of the front (``--eval-data``): as given ("none": no second domain), else for a
    general-purpose model the first builtin corpus its run neither trained nor calibrated on
    (``corpora.unseen_corpus``; a tiny model with its own small vocabulary gets none unless asked)."""
    if eval_data is not None:
        return None if eval_data == NO_DOMAIN else eval_data
    if vocab_size < GENERAL_VOCABULARY:
        return None
    return unseen_corpus(settings.get("data") or BUILTIN, settings.get("calib_data"))


def deployment_for(model_dir: Path, report: dict, tok, model: nn.Module, cfg, reporter: Reporter = SILENT,
                   also: list[str] = (), peers: list[str] = ()):
    """The teacher (from the run's or one-shot's provenance; None when it cannot be found here), the held-out
    blocks and (``--quant gptq``) the calibration blocks of a compressed folder's quality/speed front (``cfg``:
    the ``BenchConfig``)."""
    deploy, shape = Deployment(), DecoderShape.of(model.config)
    deploy.folders["compressed"] = Path(model_dir)
    settings = data_settings(model_dir, report)
    if cfg.teacher:
        spec = settings.get("teacher") or (report.get("provenance") or {}).get("teacher")
        cache = Path(settings["cache_dir"]).expanduser() if settings.get("cache_dir") else default_cache_dir()
        folder, why = teacher_folder(spec, cache)
        if folder is None:
            reporter.stage(f"no teacher rows: {why}")
        else:
            reporter.stage(f"loading the teacher {folder}")
            deploy.teacher, _, _ = load_model_folder(folder)
            deploy.teacher_dir = folder
            deploy.folders["teacher"] = Path(folder)
    for flag, folders, prefix in (("--also", also, ""), ("--peer", peers, PEER)):
        for other in folders:
            name = prefix + Path(other).name.removesuffix(".compressed")
            reporter.stage(f"loading {other} (as {name})")
            deploy.others[name], other_tok, _ = load_model_folder(other)
            deploy.folders[name] = Path(other)
            if other_tok.get_vocab() != tok.get_vocab():
                raise UsageError(f"{flag} {other}: its tokenizer is not {model_dir}'s (the front compares one slice)")
    tokens = cfg.quality_tokens
    if tokens is None:  # the run's own held-out figures (train's and eval's), not a slice of them
        tokens = min(settings.get("eval_tokens") or DEFAULT_QUALITY_TOKENS, MAX_QUALITY_TOKENS)
    if tokens:
        deploy.heldout = heldout_for(model_dir, report, tok, shape, tokens)
        unseen = unseen_data(cfg.eval_data, settings, shape.vocab_size)
        if unseen:
            reporter.stage(f"the unseen domain every row is also scored on: {unseen}")
            try:
                deploy.unseen = (unseen, corpus_blocks({"data": unseen, "heldout_fraction": default_heldout(unseen),
                                                        "cache_dir": settings.get("cache_dir")}, tok, "val",
                                                       deploy.heldout.seq_len, tokens))
            except DataError as e:  # the default corpus cannot be fetched here: said, not fatal; --eval-data is
                if cfg.eval_data is not None:
                    raise
                reporter.stage(f"no unseen domain: {e}")
    if cfg.calibrated:
        deploy.calibration = calibration_blocks(model_dir, report, tok, shape, GENAI.calib_tokens)
    if cfg.icl:
        data = settings.get("data") or BUILTIN
        cache = Path(settings["cache_dir"]).expanduser() if settings.get("cache_dir") else None
        reporter.stage(f"building the ICL word list from {data}")
        deploy.words = corpus_word_list(data, settings.get("heldout_fraction") or default_heldout(data), cache)
    return deploy
