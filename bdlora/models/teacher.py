"""Teachers: any local Hugging Face causal LM of the Llama/Mistral/Qwen2 family, or the embedded default.

The embedded default (``--teacher builtin``) is built on first use and cached: a byte-level BPE tokenizer trained
with ``tokenizers`` on the builtin corpus (Python's standard library) and a small Mistral-style model (GQA, SwiGLU,
RoPE) pretrained on it. Everything is seeded, so two machines with the same Python build the same teacher.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
)

from bdlora import SCHEMA_VERSION
from bdlora.base.errors import DataError, ModelError, UsageError
from bdlora.base.io import atomic_dir, write_json
from bdlora.base.runs import CONFIG, TEACHER_JSON, ModelDir
from bdlora.data.blocks import BlockSampler, PackedBlocks
from bdlora.data.documents import BUILTIN, Corpus, is_heldout
from bdlora.data.tokens import default_cache_dir, tokenize_corpus
from bdlora.deployed.folder import check_architecture
from bdlora.models import sources
from bdlora.models.integrity import check_loadable, check_model_folder
from bdlora.models.load import check_tensor_shapes
from bdlora.models.perplexity import perplexity
from bdlora.models.stream import lazy_folder_model
from bdlora.models.tokenizer import check_vocabulary

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class BuiltinTeacherSpec:
    """Shape and pretraining recipe of the embedded default teacher (~2 minutes on 2 CPU cores with native bf16).

    The shape is chosen so that compression shows at inference, not only in MAC counts: the 2-layer student's seven
    projections per layer must outweigh what they do not touch (LM head, norms, attention over the cache, per-node
    runtime overhead). At hidden 128 / MLP 384 / vocabulary 4096 (revision 2) the LM head alone outweighed all 14
    projections and the compressed student decoded no faster (whole-model MAC limit 1.21x at F = 0.4); at hidden
    256 / MLP 1024 / vocabulary 1024 the projections are 88% of the dense student's per-token MACs and the limit is
    1.82x. Wider costs ~2.2x per pretraining step, so the recipe takes fewer steps to stay within the first command's
    time budget."""

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 1024
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # GQA: 2 KV heads shared by 4 query heads
    max_position_embeddings: int = 512
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 420  # in bf16 (revision 4): held-out ppl 31.9 in 119 s; fp32 at 340 steps gave 37.1 in 171 s
    lr: float = 3e-3
    warmup_steps: int = 30
    seed: int = 0
    eval_tokens: int = 65536
    autocast: str = "fp32"  # "bf16" where the CPU has native bf16 dot products (builtin_spec chooses): 1.9x faster
    revision: int = 4  # bump when the recipe or tokenizer settings change, so cached teachers are rebuilt

    def key(self, corpus_fingerprint: str) -> str:
        blob = json.dumps(asdict(self), sort_keys=True) + corpus_fingerprint + torch.__version__.split("+")[0]
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


STEPS_ENV = "BDLORA_TEACHER_STEPS"


def builtin_spec() -> BuiltinTeacherSpec:
    """The embedded default's recipe; ``$BDLORA_TEACHER_STEPS`` shortens its pretraining (the same code on a smaller
    budget, cached apart from the default: the test suite's end-to-end chain runs on one). Unset: the default."""
    base = BuiltinTeacherSpec(autocast="bf16" if native_bf16() else "fp32")
    steps = os.environ.get(STEPS_ENV)
    if steps is None:
        return base
    if not steps.isdigit() or not 1 <= int(steps) <= BuiltinTeacherSpec.steps:
        raise UsageError(f"${STEPS_ENV} {steps!r}: must be an integer in [1, {BuiltinTeacherSpec.steps}] (unset: "
                         "the default recipe)")
    return replace(base, steps=int(steps), warmup_steps=min(base.warmup_steps, max(1, int(steps) // 10)))


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (avx512_bf16 or AMX; oneDNN's own check): there bf16 autocast
    halves a training step of the builtin teacher (0.27 s against 0.51 s per step on 2 cores, measured); elsewhere
    it would be emulated and slower."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def builtin_teacher_dir(cache_dir: Path | None = None) -> Path:
    spec = builtin_spec()
    corpus = Corpus(BUILTIN)
    return Path(cache_dir or default_cache_dir()) / f"teacher-builtin-{spec.key(corpus.fingerprint())}"


def train_builtin_tokenizer(corpus: Corpus, vocab_size: int, heldout_fraction: float):
    """Byte-level BPE trained on the training documents only (the held-out slice stays unseen)."""

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    docs = (d.text for d in corpus.documents() if not is_heldout(d.id, heldout_fraction))
    tok.train_from_iterator(docs, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS,
                                   unk_token=None, model_max_length=BuiltinTeacherSpec.max_position_embeddings,
                                   model_input_names=["input_ids", "attention_mask"], padding_side="left")


def unigram_perplexity(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> float:
    """Perplexity of the add-one-smoothed unigram distribution of the training tokens on the validation tokens: the
    baseline a language model must beat by a wide margin."""
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(math.exp(-logp[np.asarray(val_tokens, dtype=np.int64)].mean()))


def build_builtin_teacher(
    cache_dir: Path | None = None,
    force: bool = False,
    on_stage: Callable[[str], None] | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
) -> Path:
    """Build (or reuse) the embedded default teacher; returns its directory (HF model + tokenizer + teacher.json)."""
    spec = builtin_spec()
    out = builtin_teacher_dir(cache_dir)
    if (out / TEACHER_JSON).exists() and not force:
        return out
    stage = on_stage or (lambda s: None)
    t_start = time.time()
    corpus = Corpus(BUILTIN)
    stage("training the byte-level BPE tokenizer on the standard library")
    tokenizer = train_builtin_tokenizer(corpus, spec.vocab_size, corpus.default_heldout_fraction)
    stage("tokenising the builtin corpus")
    data = tokenize_corpus(corpus, tokenizer, corpus.default_heldout_fraction, cache_dir)
    train_blocks = PackedBlocks(data.tokens("train"), spec.seq_len, bos=data.bos)
    val_blocks = PackedBlocks(data.tokens("val"), spec.seq_len, max_tokens=spec.eval_tokens, bos=data.bos)
    model = builtin_model(spec, tokenizer)
    stage(f"pretraining the teacher ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{spec.steps} steps of {spec.batch_size}x{spec.seq_len} tokens)")
    pretrain(model, train_blocks, spec, on_step)
    stage("evaluating the teacher")
    info = {
        "schema_version": SCHEMA_VERSION, "kind": "builtin", "spec": asdict(spec),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens_seen": spec.steps * spec.batch_size * spec.seq_len, "corpus_tokens": data.meta["tokens"],
        "val_ppl": perplexity(model, val_blocks),
        "unigram_ppl": unigram_perplexity(data.tokens("train"),
                                          val_blocks.tokens[: len(val_blocks) * val_blocks.stride], len(tokenizer)),
    }
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / TEACHER_JSON, {**info, "build_seconds": time.time() - t_start})
    return out


def builtin_model(spec: BuiltinTeacherSpec, tokenizer):
    """The embedded default's untrained Mistral-style model (GQA, SwiGLU, RoPE), seeded."""

    torch.manual_seed(spec.seed)
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
        sliding_window=None, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return MistralForCausalLM(config)


def pretrain(model, blocks: PackedBlocks, spec: BuiltinTeacherSpec, on_step=None) -> None:
    """Next-token pretraining: AdamW (0.9, 0.95; wd 0.1), linear warm-up then cosine to 10% of the peak, clip 1;
    the forward and backward in bf16 autocast where ``spec.autocast`` says so (weights and optimiser stay fp32)."""
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        p = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    sampler = BlockSampler(len(blocks), spec.seed)
    model.train()
    for step in range(spec.steps):
        x = torch.from_numpy(blocks.get(sampler.indices(step * spec.batch_size, spec.batch_size)))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.autocast == "bf16"):  # fp32 master weights
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if on_step:
            on_step(step + 1, spec.steps, float(loss.detach()))
    model.eval()


def teacher_folder(spec: str, cache_dir: Path | None = None) -> Path:
    """The local folder ``--teacher spec`` loads from (the builtin teacher built, a preset or .gguf materialised,
    on first use)."""
    if spec == BUILTIN:
        return build_builtin_teacher(cache_dir)
    return Path(sources.resolve(spec, cache_dir))


def load_teacher(spec: str, cache_dir: Path | None = None, device: str = "cpu", on_stage=None, on_step=None,
                 what: str = "--teacher", lazy=None):
    """Return (model, tokenizer, path) for ``--teacher``: ``builtin``, a local HF folder, a ``.gguf`` file, a preset
    or a hub id (see ``bdlora.models.sources``); ``what`` names the option in error messages (``--student-init`` loads
    through here too). ``lazy``: ``(folder) -> bool``, asked once the source is a folder: true, the model is built on
    the meta device and reads each weight from the folder's files when a part is made (``models.stream``: a 1B-8B
    source is never whole in fp32)."""

    if spec == BUILTIN:
        path = build_builtin_teacher(cache_dir, on_stage=on_stage, on_step=on_step)
    else:
        path = Path(sources.resolve(spec, cache_dir, what, on_stage))
    if path.is_dir():  # before transformers allocates what config.json declares

        try:
            check_loadable(path)
            if (folder := ModelDir(path)).finished():  # a folder bdlora wrote (--student-init, a compressed teacher):
                check_model_folder(path, folder.report())  # the checks eval and export run (forms, bits, digests)
            check_tensor_shapes(path)
        except ModelError as e:
            raise ModelError(f"{what} {spec}: {e}") from None
    if lazy is not None and path.is_dir() and lazy(path):
        try:
            model, tokenizer, _ = lazy_folder_model(path)
        except ModelError as e:
            raise ModelError(f"{what} {spec}: {e}") from None
        return _usable(model, tokenizer, spec, what), tokenizer, path
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad checkpoint
        if sources.looks_like_hub_id(spec) and not path.exists():
            raise sources.hub_error(spec, what, e) from None
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{what} {spec}: could not load the model or tokenizer ({msg[:200]})") from None
    check_architecture(model, f"{what} {spec}")
    check_vocabulary(f"{what} {spec}", len(tokenizer), model.get_input_embeddings().num_embeddings)
    return _usable(model, tokenizer, spec, what).to(device), tokenizer, path


def _usable(model, tokenizer, spec: str, what: str):
    """``model`` frozen, in eval mode, once its tokenizer has an EOS token (and a padding token: the EOS)."""
    if tokenizer.eos_token_id is None:
        raise ModelError(f"{what} {spec}: the tokenizer defines no EOS token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


PRETRAINED_PPL_TOKENS = 8192  # held-out builtin-corpus tokens scored by `bdlora teacher --preset` (seq 512)


# heldout.json's format: 2 scores blocks that start with BOS where the tokenizer starts every text with one (Gemma);
# a figure of an older version is measured again
HELDOUT_VERSION = 2


def describe_pretrained(spec: str, cache_dir: Path | None = None, on_stage=None, data: str = BUILTIN) -> dict:
    """Materialise a preset or .gguf teacher (``bdlora.models.sources``) and report it; its held-out perplexity on
    ``data`` (default: the builtin corpus) is measured once per corpus and kept in the folder's ``heldout.json``."""

    if not sources.is_named(spec):
        raise UsageError(f"--preset {spec}: unknown (allowed: {', '.join(sources.PRESETS)}, or a .gguf file)")
    cache = cache_dir or default_cache_dir()
    path = Path(sources.resolve(spec, cache, "--preset", on_stage))
    report = path / "heldout.json"  # not teacher.json: that file marks the builtin teacher's folder
    known = json.loads(report.read_text()) if report.is_file() else {}
    if known.get("data") != data or known.get("version") != HELDOUT_VERSION:
        model, tok, _ = load_teacher(str(path), cache, what="--preset")
        stage = on_stage or (lambda msg: None)
        stage(f"held-out perplexity over {PRETRAINED_PPL_TOKENS:,} tokens of {data}")
        corpus = Corpus(data)
        tokens = tokenize_corpus(corpus, tok, corpus.default_heldout_fraction, cache)
        seq = min(512, model.config.max_position_embeddings)
        blocks = PackedBlocks(tokens.tokens("val"), seq, max_tokens=PRETRAINED_PPL_TOKENS, bos=tokens.bos)
        write_json(report, {"val_ppl": perplexity(model, blocks), "ppl_tokens": len(blocks) * seq, "seq_len": seq,
                            "data": data, "bos_first": tokens.bos is not None,
                            "version": HELDOUT_VERSION})  # the parameter count is source.json's
    return {**(sources.source_note(path) or {}), **json.loads(report.read_text()), "path": str(path)}


@dataclass
class TeacherSource:
    """The teacher a ``teacher:N`` corpus is sampled from: its folder (whose weights key the cache) and, when
    already loaded, the model and tokenizer (loaded from the folder only if samples must be generated)."""

    path: Path | None
    model: object | None = None
    tokenizer: object | None = None
    spec: str | None = None  # resolved to ``path`` (builtin, preset, .gguf...) only when the samples are needed
    cache: Path | None = None
    runtime: Path | None = None  # the teacher's onnxruntime-genai folder the samples are generated through
    _fingerprint: str | None = field(default=None, repr=False)

    def folder(self) -> Path:
        if self.path is None:
            if not self.spec:
                raise DataError("teacher:N: the model these samples came from is not recorded; give --data a corpus")
            self.path = teacher_folder(self.spec, self.cache)
        return Path(self.path)

    def fingerprint(self) -> str:
        """SHA-256 over the folder's config.json and weight files (streamed)."""
        if self._fingerprint is None:
            folder = self.folder()
            files = [folder / CONFIG, *sorted(folder.glob("*.safetensors"))]
            h = hashlib.sha256()
            for f in files:
                if f.is_file():
                    h.update(f.name.encode() + b"\0")
                    with open(f, "rb") as fh:
                        for chunk in iter(lambda: fh.read(1 << 22), b""):
                            h.update(chunk)
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def load(self):
        if self.model is None or self.tokenizer is None:
            self.model, self.tokenizer, _ = load_teacher(str(self.folder()), self.cache)
        return self.model, self.tokenizer


def recorded_teacher(settings: dict) -> TeacherSource:
    """The teacher a run's (or a one-shot's) recorded ``teacher:N`` samples came from (``settings``: its
    ``data_settings``: ``source_path``, the teacher checkpoint, or ``teacher``, its spec; ``samples_runtime``, the
    genai folder the samples were generated through, which keys their cache), for ``data.corpora.settings_tokens``;
    resolved and loaded only if the samples are needed."""
    cache = Path(settings["cache_dir"]).expanduser() if settings.get("cache_dir") else None
    path = settings.get("source_path")
    runtime = settings.get("samples_runtime")
    return TeacherSource(Path(path) if path and Path(path).is_dir() else None, spec=settings.get("teacher"),
                         cache=cache, runtime=Path(runtime) if runtime else None)
