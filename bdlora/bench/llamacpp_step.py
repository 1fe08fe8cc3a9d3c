"""What a structure's decode step costs in llama.cpp, measured with llama.cpp's own kernels, so that ``plan
--runtime llamacpp`` predicts the step of the GGUF file ``export gguf`` would write for it. In the bench package: it
writes GGUF files and times them as ``bench --runtime llamacpp`` does.

onnxruntime's prediction (``bench.whole``) prices each projection form from a table and fits what lies around them,
because its forms are many (a low-rank pair at any rank, 8-bit projections inside an int4 graph) and the allocation
needs every one of them priced. A GGUF file holds fewer forms: dense layers whose MLPs keep some channels, whose
attention keeps some key/value groups with their query heads, and removed layers; and which GGML type each tensor
gets is decided by llama.cpp's quantizer from the tensor's role, the depth and the layer's place in it (Q4_K_M keeps
half of the layers' ``ffn_down`` and ``attn_v`` at Q6_K, the head at Q6_K, and falls back to another type for a row
length its blocks do not divide). So the step is measured whole, on the structure itself: the teacher's shapes and
the student's, each written as ``export gguf`` writes it (the family's architecture for the teacher, ``deci`` with
per-layer head counts and MLP widths for a pruned student, removed layers dropped), rounded by llama.cpp's own
quantizer for the K-quants, loaded by llama.cpp and timed by ``bench.genai_worker`` interleaved, at batch 1 after
``CONTEXT`` tokens, ms per token at the median of the repeats: ``predicted_decode_speedup`` is their ratio.

Every weight is zero (``export.gguf.writer.write_zero_gguf``: a sparse file, so an 8B shape costs no 16 GB of
writing): llama.cpp's CPU kernels are dense SIMD loops whose time does not depend on the values, as onnxruntime's do
not (``export.genai.latency``). What the prediction cannot see is the weights' own values in a quantizer whose type
choices depend on them (none of Q8_0, Q4_0, Q4_K_M's choose by value).

The times are cached per shapes, structure, type, threads, llama.cpp version and CPU, with the load they were taken
under: a measurement on a busy machine, or whose repeats disagree twice, is marked unclean, reused only while the
machine is busy and measured again by a quiet run (``base.load``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers

from bdlora.base import load  # through the module: the tests set its readers
from bdlora.base.errors import UsageError
from bdlora.base.io import read_json, write_json
from bdlora.base.reporter import SILENT, Reporter
from bdlora.bench.genai import time_genai
from bdlora.bench.whole import CONTEXT, shape_key
from bdlora.export.genai.latency import cpu_name
from bdlora.export.gguf.layout import LayerShape, plan_layout, tensor_plan
from bdlora.export.gguf.llamacpp import LlamaCpp, available, repacks
from bdlora.export.gguf.writer import write_zero_gguf
from bdlora.forms import LOWRANK, REMOVED, VOCAB
from bdlora.models.families import GGUF_SPM_TOKENIZER, base_type, family, with_layers

STEPS, REPEATS, WARMUP = 32, 10, 2  # decode tokens per timing, timed repeats of each file, untimed ones
STEP_VERSION = 1
MIN_VOCAB = 14  # the stand-in vocabulary's control tokens and bytes up to "\n", which llama.cpp looks up on load
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def structure(config: dict, modules: list[dict]) -> list[LayerShape | None]:
    """Each decoder layer of a report's ``modules`` as llama.cpp would hold it (None: removed): its query heads,
    key/value heads and MLP width. Forms llama.cpp has none of are refused in one line, as ``export gguf`` refuses
    them."""
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    ffn = int(config["intermediate_size"])
    lowrank = [m["name"] for m in modules if m.get("form") == LOWRANK.name]
    if lowrank:
        raise UsageError(f"--runtime llamacpp: {len(lowrank)} low-rank module(s) (e.g. {lowrank[0]}) have no "
                         "llama.cpp form; plan a student of --forms channels,groups,layers")
    if any(m.get("form") == VOCAB.name for m in modules):
        raise UsageError("--runtime llamacpp: the LM head keeps fewer tokens (--forms vocab); llama.cpp's embedding "
                         "and output share one vocabulary")
    wide = [m["name"] for m in modules if m.get("bits")]
    if wide:
        raise UsageError(f"--runtime llamacpp: {len(wide)} projection(s) kept at 8 bits (--forms bits, e.g. "
                         f"{wide[0]}): export gguf writes one type per file; plan a student of --forms "
                         "channels,groups,layers")
    layers: dict[int, list[dict]] = {}
    for m in modules:
        parts = m["name"].split(".")
        if parts[:2] == ["model", "layers"]:
            layers.setdefault(int(parts[2]), []).append(m)
    out: list[LayerShape | None] = []
    for i in range(int(config["num_hidden_layers"])):
        mods = layers.get(i, [])
        if mods and all(m["case"] == REMOVED.name for m in mods):
            out.append(None)
            continue
        groups = next((int(m["groups"]) for m in mods if m.get("groups") and m["name"].endswith(ATTENTION)), kv)
        width = next((int(m["channels"]) for m in mods if m.get("channels") and ".mlp." in m["name"]), ffn)
        out.append(LayerShape(groups * (heads // kv), groups, width))
    return out


def dense(config: dict) -> LayerShape:
    """A layer of the dense model ``config``."""
    heads = int(config["num_attention_heads"])
    return LayerShape(heads, int(config.get("num_key_value_heads") or heads), int(config["intermediate_size"]))


def _layer_shape(suffix: str, shape: tuple[int, ...], s: LayerShape, head_dim: int) -> tuple[int, ...]:
    """A decoder layer's tensor (its name after ``model.layers.N.``) at the shape the layer ``s`` gives it."""
    q, kv = s.heads * head_dim, s.kv_heads * head_dim
    rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "mlp.gate_proj": s.ffn,
            "mlp.up_proj": s.ffn}
    module, _, kind = suffix.rpartition(".")
    if module in rows:
        return (rows[module], *shape[1:])
    if module == "self_attn.o_proj" and kind == "weight":
        return (shape[0], q)
    if module == "mlp.down_proj" and kind == "weight":
        return (shape[0], s.ffn)
    return shape


def tensors_of(config: dict, layers: list[LayerShape | None]) -> dict[str, tuple[int, ...]]:
    """The weight files' tensors (name -> shape) of ``config``'s family holding ``layers`` (removed ones dropped,
    the rest numbered in order), as a compressed folder holds them: read from transformers' own model of the family
    built on the meta device (its biases, tied head and norms as the family has them)."""
    fam = family(config["model_type"], "model_type", loaded=False)
    base = {k: v for k, v in with_layers(config, 1).items()
            if k not in ("model_type", "architectures", "auto_map", "bdlora", "bdlora_modules")}
    cfg = transformers.CONFIG_MAPPING[fam.model_type](**base)
    with torch.device("meta"):
        model = getattr(transformers, fam.causal_lm)(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if bool(getattr(cfg, "tie_word_embeddings", False)):
        shapes.pop("lm_head.weight", None)
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    out = {k: v for k, v in shapes.items() if not k.startswith("model.layers.")}
    kept = [s for s in layers if s is not None]
    for j, s in enumerate(kept):
        for k, v in shapes.items():
            if k.startswith("model.layers.0."):
                suffix = k.removeprefix("model.layers.0.")
                out[f"model.layers.{j}.{suffix}"] = _layer_shape(suffix, v, s, head_dim)
    return out


def stand_in_vocab(size: int):
    """``add_vocab`` of a synthetic file: a SentencePiece-style vocabulary of ``size`` tokens (the control tokens,
    the bytes llama.cpp looks up, then numbered pieces); nothing is tokenised, the timing feeds token ids."""

    def add(writer) -> dict:
        n_bytes = min(256, size - 3)
        tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(n_bytes)),
                  *(f"t{i}" for i in range(3 + n_bytes, size))]
        writer.add_tokenizer_model(GGUF_SPM_TOKENIZER)
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * size)
        writer.add_token_types([2, 3, 3, *([6] * n_bytes), *([1] * (size - 3 - n_bytes))])
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        return {"tokens": size, "model": "stand-in"}

    return add


def synthetic_gguf(work: Path, name: str, config: dict, layers: list[LayerShape | None], quant: str,
                   threads: int) -> tuple[Path, dict]:
    """(the file, what it holds) of ``config``'s shapes with ``layers``, all weights zero, at ``quant`` as ``export
    gguf`` writes it (q4_k_m: at F16, then rounded by llama.cpp's quantizer)."""
    kept = [s for s in layers if s is not None]
    tensors = tensors_of(config, layers)
    cfg = {**with_layers(config, len(kept)), "max_position_embeddings": max(
        int(config.get("max_position_embeddings") or 0), CONTEXT + STEPS + 8)}
    layout = plan_layout(cfg, tensors)
    vocab = int(config["vocab_size"])
    plan = tensor_plan(layout, tensors, vocab)
    path = work / f"{name}.gguf"
    first = work / f"{name}-f16.gguf" if quant == "q4_k_m" else path
    info = write_zero_gguf(first, layout, plan, quant, name, stand_in_vocab(vocab))
    if first != path:
        LlamaCpp().quantize(first, path, quant, threads)
        first.unlink()
        info["types"] = "llama.cpp's quantizer"
    return path, {"arch": layout.arch, "layers": len(kept), "bytes": path.stat().st_size,
                  "types": info["types"]}


def step_path(cache: Path, config: dict, layers: list[LayerShape | None], quant: str, threads: int) -> Path:
    import llama_cpp

    tag = hashlib.sha256(json.dumps([STEP_VERSION, llama_cpp.__version__, cpu_name(), shape_key(config), quant,
                                     [None if s is None else [s.heads, s.kv_heads, s.ffn] for s in layers],
                                     repacks(), CONTEXT], sort_keys=True).encode()).hexdigest()[:12]
    return Path(cache) / "latency" / f"llamacpp-{quant}-t{threads}-{tag}.json"


@dataclass
class StepTimes:
    teacher_ms: float
    student_ms: float
    files: dict
    load: dict | None
    unclean: str | None


def _read(path: Path) -> StepTimes | None:
    try:
        doc = read_json(path)
        out = StepTimes(float(doc["teacher_ms"]), float(doc["student_ms"]), dict(doc["files"]), doc.get("load"),
                        doc.get("unclean"))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    ok = all(np.isfinite(t) and 0 < t < 1e7 for t in (out.teacher_ms, out.student_ms))
    return out if ok else None


def _timed(files: dict[str, Path], vocab: int, threads: int, work: Path,
           reporter: Reporter) -> tuple[dict, str | None]:
    """({file: decode ms/token, the median of its repeats}, why the repeats disagree or None)."""
    rows = time_genai({}, [["decode", 1, CONTEXT]], REPEATS, WARMUP, STEPS, vocab, work, reporter, ggufs=files,
                      threads=threads)
    raw = {r["variant"]: r["ms"] for r in rows}
    spread = [k for k, v in raw.items() if not load.agree(v)]
    why = f"the repeats of the {', '.join(spread)} file(s) are not within {load.AGREE:g}x of their fastest" \
        if spread else None
    return {k: float(np.median(v)) for k, v in raw.items()}, why


def measure(config: dict, layers: list[LayerShape | None], quant: str, threads: int, cache: Path,
            reporter: Reporter = SILENT) -> tuple[StepTimes, Path]:
    """The teacher's and the structure's decode step in llama.cpp (cached, or measured)."""
    path = step_path(cache, config, layers, quant, threads)
    if path.is_file():
        cached = _read(path)
        if cached is not None and load.reusable(cached.unclean, path, reporter):
            return cached, path
        if cached is None:
            reporter.stage(f"{path}: damaged (not two positive finite times), measuring again")
    teacher = [dense(config)] * int(config["num_hidden_layers"])
    work = Path(tempfile.mkdtemp(prefix="bdlora-llamacpp-step-"))
    try:
        files, info = {}, {}
        for name, shape in (("teacher", teacher), ("student", layers)):
            reporter.stage(f"writing the {name}'s shapes as a {quant} GGUF of zero weights to time in llama.cpp")
            files[name], info[name] = synthetic_gguf(work, name, config, shape, quant, threads)
        reporter.stage(f"timing both in llama.cpp on {threads} thread(s): batch 1 after {CONTEXT} tokens, {REPEATS} "
                       f"interleaved repeats of {STEPS} tokens")
        with load.LoadWatch() as watch:
            for attempt in range(2):
                ms, why = _timed(files, int(config["vocab_size"]), threads, work, reporter)
                if why is None:
                    break
                if attempt == 0:
                    reporter.stage(f"the llama.cpp timings disagree ({why}): timing them again")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    unclean = why if watch.load.quiet else f"timed with {watch.load.said()}"
    if unclean:
        load.not_cached(reporter, "the llama.cpp decode step", watch.load, why if watch.load.quiet else "")
    out = StepTimes(ms["teacher"], ms["student"], info, watch.load.record(), unclean)
    write_json(path, {"version": STEP_VERSION, "quant": quant, "threads": threads, "cpu": cpu_name(),
                      "context": CONTEXT, "teacher_ms": out.teacher_ms, "student_ms": out.student_ms,
                      "files": out.files, "load": out.load, "unclean": out.unclean})
    return out, path


def predict(config: dict, modules: list[dict], quant: str, threads: int, cache: Path,
            reporter: Reporter = SILENT) -> dict:
    """``plan --runtime llamacpp``'s prediction for the structure of ``modules`` over ``config`` (the dense model):
    the teacher's and the student's decode step in llama.cpp at ``quant`` on ``threads`` threads and their ratio."""
    layers = structure(config, modules)
    full = dense(config)
    if not family(config["model_type"], "model_type", loaded=False).gguf_per_layer and any(s != full for s in layers):
        raise UsageError(f"--runtime llamacpp: a {base_type(str(config['model_type']))} student with pruned blocks "
                         "has no llama.cpp form (deci is Llama's layer); plan a Llama, Mistral or Qwen2 student")
    kept = sum(s is not None for s in layers)
    plan_layout(with_layers(config, kept), tensors_of(config, layers))  # its refusals before anything is timed
    if int(config["vocab_size"]) < MIN_VOCAB:
        raise UsageError(f"--runtime llamacpp: vocab_size {config['vocab_size']}: llama.cpp needs at least "
                         f"{MIN_VOCAB} tokens")
    if available() is None:
        raise UsageError("--runtime llamacpp: needs llama.cpp here; install it with pip install -e \".[llamacpp]\" "
                         "(builds llama-cpp-python from source, about 10 minutes)")
    times, path = measure(config, layers, quant, threads, cache, reporter)
    doc = {"runtime": "llamacpp", "precision": quant, "threads": threads, "context": CONTEXT,
           "decode_us_teacher": 1000.0 * times.teacher_ms, "decode_us": 1000.0 * times.student_ms,
           "predicted_decode_speedup": times.teacher_ms / times.student_ms,
           "decode_layers": kept, "teacher_layers": len(layers),
           "files": times.files, "cache": str(path), "load": times.load, "measured_clean": times.unclean is None}
    if times.unclean:
        doc["measurement"] = times.unclean
    return doc
