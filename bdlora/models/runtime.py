"""Running an exported bdlora decoder under onnxruntime: numpy and onnxruntime only (no torch), so serving, ONNX-side
evaluation and the bench worker load without it.

The graph signature is ``DecoderSignature``: inputs ``input_ids``, ``attention_mask``, ``position_ids`` (not in
the onnxruntime-genai graph, which derives positions from the mask), ``past_key_values.{i}.key/value`` (batch,
kv_heads, past, head_dim); outputs ``logits`` and ``present.{i}.key/value`` (batch, kv_heads, past + seq, head_dim).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from bdlora.base.errors import ModelError, UsageError
from bdlora.base.io import sha256
from bdlora.base.runs import CONFIG, EXPORT_MARKER, GENAI_CONFIG, MODEL_ONNX, TOKENIZER_CONFIG, TOKENIZER_JSON
from bdlora.forms import GROUPS
from bdlora.models.integrity import CONFIG_KEY, TOKENIZER_KEY, check_tokenizer
from bdlora.models.scoring import score_logits
from bdlora.models.tokenizer import TextTokenizer, check_vocabulary


@dataclass(frozen=True)
class DecoderSignature:
    """Names and symbolic shapes of the inputs, outputs and KV cache of every decoder graph bdlora writes (the ONNX
    export, the genai graph and its ``genai_config.json``) and feeds (the runtime, the bench worker): the one place
    they are spelled. ``position_ids`` is False for the genai layout (its attention derives positions from the
    mask)."""

    layers: int
    position_ids: bool = True

    INPUT_IDS: ClassVar[str] = "input_ids"
    ATTENTION_MASK: ClassVar[str] = "attention_mask"
    POSITION_IDS: ClassVar[str] = "position_ids"
    LOGITS: ClassVar[str] = "logits"
    PAST: ClassVar[str] = "past_key_values.{layer}.{kind}"  # kind: "key" | "value"
    PRESENT: ClassVar[str] = "present.{layer}.{kind}"
    KINDS: ClassVar[tuple[str, str]] = ("key", "value")
    # symbolic dims: (name of each axis) of the token inputs, the mask, the logits, the cache in and out
    TOKENS_DIMS: ClassVar[tuple[str, str]] = ("batch", "seq")
    MASK_DIMS: ClassVar[tuple[str, str]] = ("batch", "total")
    PAST_DIMS: ClassVar[tuple[str, str, str, str]] = ("batch", "kv_heads", "past", "head_dim")
    PRESENT_DIMS: ClassVar[tuple[str, str, str, str]] = ("batch", "kv_heads", "total", "head_dim")

    @classmethod
    def past(cls, layer: int | str, kind: str) -> str:
        """``past_key_values.3.key``; with ``layer="%d"`` the printf template onnxruntime-genai's config takes."""
        return cls.PAST.format(layer=layer, kind=kind)

    @classmethod
    def present(cls, layer: int | str, kind: str) -> str:
        return cls.PRESENT.format(layer=layer, kind=kind)

    @property
    def cache_inputs(self) -> list[str]:
        return [self.past(i, k) for i in range(self.layers) for k in self.KINDS]

    @property
    def cache_outputs(self) -> list[str]:
        return [self.present(i, k) for i in range(self.layers) for k in self.KINDS]

    @property
    def inputs(self) -> list[str]:
        tokens = [self.INPUT_IDS, self.ATTENTION_MASK] + ([self.POSITION_IDS] if self.position_ids else [])
        return tokens + self.cache_inputs

    @property
    def outputs(self) -> list[str]:
        return [self.LOGITS] + self.cache_outputs

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """{name: {axis: symbolic name}} of every input and output (torch.onnx's ``dynamic_axes``)."""
        batch, seq = self.TOKENS_DIMS
        axes = {self.INPUT_IDS: {0: batch, 1: seq}, self.ATTENTION_MASK: dict(enumerate(self.MASK_DIMS)),
                self.LOGITS: {0: batch, 1: seq}}
        if self.position_ids:
            axes[self.POSITION_IDS] = {0: batch, 1: seq}
        axes.update({n: {0: batch, 2: self.PAST_DIMS[2]} for n in self.cache_inputs})
        axes.update({n: {0: batch, 2: self.PRESENT_DIMS[2]} for n in self.cache_outputs})
        return axes

    @classmethod
    def of_inputs(cls, names: list[str]) -> DecoderSignature:
        """The signature of a graph with these input names (a graph we wrote: cache inputs counted)."""
        prefix = cls.PAST.split("{")[0]
        layers = sum(1 for n in names if n.startswith(prefix) and n.endswith(".key"))
        return cls(layers, position_ids=cls.POSITION_IDS in names)


@dataclass(frozen=True)
class DecoderShape:
    """What a caller of the graph must know of the model: its KV-cache geometry, vocabulary and context."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab_size: int
    max_positions: int
    pruned_kv: tuple[tuple[int, int], ...] = ()  # (layer, its key/value heads) of attention blocks pruned (groups)

    def kv(self, layer: int) -> int:
        """The key/value heads layer ``layer`` caches (fewer where its attention keeps fewer groups)."""
        return dict(self.pruned_kv).get(layer, self.kv_heads)

    @classmethod
    def of(cls, config) -> DecoderShape:
        """From a transformers config object or a config.json mapping."""
        if isinstance(config, list | str | int | float | None):
            raise ValueError("not a model config (a JSON object with the decoder's sizes)")
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        need = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
        missing = [k for k in need if get(k) is None]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        return cls(layers=int(get("num_hidden_layers")), heads=heads,
                   kv_heads=int(get("num_key_value_heads") or heads),
                   head_dim=int(get("head_dim") or hidden // heads), hidden=hidden,
                   vocab_size=int(get("vocab_size")), max_positions=int(get("max_position_embeddings") or 1 << 30),
                   pruned_kv=_pruned_kv(get("bdlora_modules")))

    @classmethod
    def from_folder(cls, folder: str | Path) -> DecoderShape:
        return cls.of(json.loads((Path(folder) / CONFIG).read_text()))


def _pruned_kv(modules) -> tuple[tuple[int, int], ...]:
    """(layer, key/value heads kept) of every ``model.layers.N.self_attn`` a config declares ``groups``."""
    out = []
    for name, spec in (modules if isinstance(modules, dict) else {}).items():
        parts = name.split(".")
        if (len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] == "self_attn"
                and isinstance(spec, dict) and spec.get("form") == GROUPS.name and type(spec.get("keep")) is int):
            out.append((int(parts[2]), spec["keep"]))
    return tuple(sorted(out))


def signature_problems(shape: DecoderShape, inputs: dict[str, list], outputs: dict[str, list]) -> list[str]:
    """What config.json declares (``shape``) against a decoder graph's own inputs and outputs ({name: dims}, a dim
    an int or a symbolic name): the number of past key inputs is the number of layers, their static dims are the KV
    heads and head size, the logits' last dim is the vocabulary. A config edited to other sizes would otherwise
    size every cache the caller builds (or fail inside onnxruntime with its own error)."""
    sig = DecoderSignature.of_inputs(list(inputs))
    held = {"num_hidden_layers": sig.layers}
    declared = {"num_hidden_layers": shape.layers, "head_dim": shape.head_dim, "vocab_size": shape.vocab_size}
    for i in range(min(sig.layers, shape.layers)):  # each layer's cache: fewer heads where its attention is pruned
        dims = inputs.get(sig.past(i, "key")) or []
        if len(dims) == 4:
            what = "num_key_value_heads" if shape.kv(i) == shape.kv_heads else f"layer {i}'s key/value heads"
            held[what], declared[what], held["head_dim"] = dims[1], shape.kv(i), dims[3]
    logits = outputs.get(sig.LOGITS) or []
    if logits:
        held["vocab_size"] = logits[-1]
    return [f"{k} {declared[k]:,} but the graph has {v:,}" for k, v in held.items()
            if isinstance(v, int) and v != declared[k]]


def session_io(sess) -> tuple[dict[str, list], dict[str, list]]:
    """({input name: dims}, {output name: dims}) of an onnxruntime session."""
    return ({i.name: list(i.shape) for i in sess.get_inputs()}, {o.name: list(o.shape) for o in sess.get_outputs()})


def check_signature(folder: str | Path, shape: DecoderShape, sess) -> None:
    """One-line refusal (``ModelError``) when the folder's config.json does not describe the graph it serves."""

    problems = signature_problems(shape, *session_io(sess))
    if problems:
        raise ModelError(f"{Path(folder) / CONFIG}: declares {'; '.join(problems[:3])}: the config was "
                         "edited or does not belong to this graph")


ORT_ERRORS = 3  # onnxruntime's log severity: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal


def session_options(ort):
    """onnxruntime ``SessionOptions`` that log errors only, and its default logger set alike: its warnings (such as
    "CleanUnusedInitializersAndNodeArgs: Removing initializer ..." when a graph's optimiser drops a constant it
    folded) describe onnxruntime's own work, not a problem of the user's, and reached their terminal."""
    ort.set_default_logger_severity(ORT_ERRORS)
    so = ort.SessionOptions()
    so.log_severity_level = ORT_ERRORS
    return so


def session(path: str | Path | bytes, threads: int | None = None, opt_level: str = "all", global_pool: bool = False,
            provider: str = "CPUExecutionProvider", weights_dir: Path | None = None):
    """An onnxruntime session of the graph at ``path`` or, given bytes, of that serialised graph, whose external
    weights are then read from ``weights_dir``; ``threads`` intra-op threads (default: onnxruntime's choice, all
    cores). Weights are
    prepacked into the kernels' layouts, as deployed (without, MatMulNBits dequantises its weights on every call:
    an 8B int4 graph opens in 0.5 s at 0.4 GB instead of 12 s at 6.5 GB, but four small calls at 3B took 37 s
    against 6.7 s)."""
    import onnxruntime as ort

    so = session_options(ort)
    so.graph_optimization_level = {"none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                   "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                                   "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                   "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[opt_level]
    if global_pool:
        so.use_per_session_threads = False
    elif threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    if weights_dir is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(weights_dir))
    return ort.InferenceSession(path if isinstance(path, bytes) else str(path), so, providers=[provider])


def empty_past(shape: DecoderShape, batch: int) -> list[np.ndarray]:
    """The zero-length past K/V of a first call: 2 x layers arrays (batch, the layer's kv heads, 0, head_dim)."""
    return [np.zeros((batch, shape.kv(i // 2), 0, shape.head_dim), dtype=np.float32) for i in range(2 * shape.layers)]


def left_padded(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token lists as one left-padded batch: ids and mask (B, T) and positions counting each row's real tokens
    (0 on padding, which the mask hides)."""
    b, t = len(seqs), max(len(x) for x in seqs)
    ids = np.zeros((b, t), dtype=np.int64)
    mask = np.zeros((b, t), dtype=np.int64)
    for r, x in enumerate(seqs):
        ids[r, t - len(x) :] = x
        mask[r, t - len(x) :] = 1
    return ids, mask, np.clip(np.cumsum(mask, 1) - 1, 0, None)


def position_ids_from_mask(attention_mask: np.ndarray, seq_len: int) -> np.ndarray:
    """HF/optimum convention: cumsum of the mask minus one, padding set to 1, last ``seq_len`` positions."""
    pos = np.cumsum(attention_mask, -1) - 1
    pos = np.where(attention_mask == 0, 1, pos)
    return pos[:, -seq_len:].astype(np.int64)


def run_decoder(sess, ids, mask, pos, past) -> list[np.ndarray]:
    """One call of the graph: [logits (B, T, V), present key/values...]. A graph without ``position_ids`` (the
    onnxruntime-genai layout, whose attention derives positions from the mask) is fed the rest."""
    names = [i.name for i in sess.get_inputs()]
    values = [ids, mask, pos, *past] if DecoderSignature.POSITION_IDS in names else [ids, mask, *past]
    return sess.run(None, dict(zip(names, values)))


def run_bound(sess, ids, mask, pos, past: list) -> tuple[np.ndarray, list]:
    """One call of the graph with IO binding, for decode loops: ``past`` may hold numpy arrays or the onnxruntime
    values a previous call returned; the presents come back as onnxruntime values, to be bound as the next call's
    past, so the KV cache stays in onnxruntime's memory between steps instead of being copied into numpy and back.
    Returns (logits as numpy, presents)."""
    names = [i.name for i in sess.get_inputs()]
    values = [ids, mask, pos, *past] if DecoderSignature.POSITION_IDS in names else [ids, mask, *past]
    binding = sess.io_binding()
    for name, value in zip(names, values):
        if isinstance(value, np.ndarray):
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        else:
            binding.bind_ortvalue_input(name, value)
    for o in sess.get_outputs():
        binding.bind_output(o.name, "cpu")
    sess.run_with_iobinding(binding)
    out = binding.get_outputs()
    return out[0].numpy(), list(out[1:])


def greedy_generate(sess, shape: DecoderShape, input_ids: np.ndarray, max_new_tokens: int,
                    eos_token_id: int | None = None) -> np.ndarray:
    """Greedy decoding with the KV cache (prompt once, then one token per step); prompt and new tokens (B, T + n)."""
    b = input_ids.shape[0]
    past = empty_past(shape, b)
    mask = np.ones((b, input_ids.shape[1]), dtype=np.int64)
    ids = input_ids.astype(np.int64)
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy()
    out = [ids]
    for _ in range(max_new_tokens):
        logits, past = run_bound(sess, ids, mask, pos, past)
        nxt = logits[:, -1].argmax(-1).astype(np.int64)[:, None]  # (B, 1)
        out.append(nxt)
        mask = np.concatenate([mask, np.ones((b, 1), dtype=np.int64)], 1)
        pos = pos[:, -1:] + 1
        ids = nxt
        if eos_token_id is not None and (nxt == eos_token_id).all():
            break
    return np.concatenate(out, 1)




def score_blocks(sess, shape: DecoderShape, blocks, batch_size: int = 8) -> tuple[float, np.ndarray]:
    """(mean next-token NLL, argmax predictions (N,)) over packed blocks (``len`` and ``get(indices)`` -> (B, T)
    int64), each scored from an empty cache; at most ``batch_size`` blocks at once, fewer where their logits would
    pass ``scoring.SCORE_ELEMENTS`` (Gemma's 262k vocabulary: 2 blocks of 128 at once, not 8 at 1 GB of logits)."""

    def logits_of(x: np.ndarray) -> np.ndarray:
        b, t = x.shape
        pos = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t)).copy()
        return run_decoder(sess, x, np.ones((b, t), dtype=np.int64), pos, empty_past(shape, b))[0]

    return score_logits(logits_of, blocks, shape.vocab_size, batch_size, "the ONNX graph")


def check_onnx_dir(path: Path, onnx_file: str, runtime: str = "ort") -> None:
    """Fail fast (before a server listens or an evaluation starts) on an ONNX folder that cannot be used: missing
    files, a graph path outside the folder, a config or tokenizer that does not load (``runtime`` genai: also its
    genai_config.json). The graph itself is loaded by the caller (the server in the background, exiting non-zero if
    that fails)."""

    make = "bdlora export genai" if runtime == "genai" else "bdlora export onnx"
    if not path.is_dir():
        raise ModelError(f"{path}: no such folder (pass a `{make}` output)")
    if runtime == "genai" and not (path / GENAI_CONFIG).is_file():
        raise ModelError(f"{path}: no genai_config.json (--runtime genai serves a `bdlora export genai` output)")
    if runtime != "genai" and (path / GENAI_CONFIG).is_file():
        raise ModelError(f"{path}: a `bdlora export genai` folder (onnxruntime-genai's graph layout); serve it with "
                         "--runtime genai")
    if not (path / onnx_file).resolve().is_relative_to(path.resolve()):
        raise UsageError(f"--onnx-file {onnx_file}: must name a graph inside {path}")
    if not (path / onnx_file).is_file():
        found = ", ".join(sorted(p.name for p in path.glob("*.onnx"))) or "none"
        raise ModelError(f"{path}: no {onnx_file} (ONNX files there: {found}; pass a `{make}` output)")
    if not (path / CONFIG).is_file():
        raise ModelError(f"{path}: no config.json (pass a `{make}` output)")
    if not any((path / f).exists() for f in (TOKENIZER_JSON, TOKENIZER_CONFIG)):
        raise ModelError(f"{path}: no tokenizer files")
    if not (path / EXPORT_MARKER).is_file():  # written last: its absence means the export never finished
        raise ModelError(f"{path}: an unfinished export (no export.json, which `{make}` writes last); export again")
    loaded = {}
    for what, load in ((CONFIG, DecoderShape.from_folder), ("tokenizer", TextTokenizer)):
        try:
            loaded[what] = load(path)
        except Exception as e:  # noqa: BLE001  json, KeyError, tokenizers' own errors: one line either way
            raise ModelError(f"{path}: its {what} does not load ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
    check_vocabulary(path, len(loaded["tokenizer"]), loaded[CONFIG].vocab_size)
    try:
        marker = json.loads((path / EXPORT_MARKER).read_text())
        recorded, config_digest = marker.get(TOKENIZER_KEY), marker.get(CONFIG_KEY)
    except (ValueError, AttributeError):
        raise ModelError(f"{path}: its export.json is not a JSON object; the export is damaged") from None
    check_tokenizer(path, recorded, EXPORT_MARKER)
    if config_digest and sha256(path / CONFIG) != config_digest:  # exports before the record are not checked
        raise ModelError(f"{path / CONFIG}: differs from the config.json the graph was exported with (its SHA-256 "
                         f"in {EXPORT_MARKER}): it was edited after the export; export again")
    if runtime == "genai":
        check_genai_folder(path, onnx_file)


def check_genai_folder(path: Path, onnx_file: str = MODEL_ONNX) -> None:
    """config.json and genai_config.json against the genai graph's own signature (its weights live in the external
    data file, so reading the graph is cheap): onnxruntime-genai sizes its KV buffer from genai_config.json, so an
    edited value must be refused before a server listens, not discovered in the first request."""
    import onnx

    try:
        graph = onnx.load(str(path / onnx_file), load_external_data=False).graph
        genai = json.loads((path / GENAI_CONFIG).read_text())["model"]
        decoder = genai["decoder"]
    except Exception as e:  # noqa: BLE001  protobuf, JSON or a missing key: one line either way
        raise ModelError(f"{path}: its graph or genai_config.json does not load ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None

    def dims(values) -> dict[str, list]:
        return {v.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]
                for v in values}

    inputs, outputs = dims(graph.input), dims(graph.output)
    problems = [f"config.json {p}" for p in signature_problems(DecoderShape.from_folder(path), inputs, outputs)]
    declared = DecoderShape.of({"num_hidden_layers": decoder.get("num_hidden_layers"),
                                "num_attention_heads": decoder.get("num_attention_heads") or 1,
                                "num_key_value_heads": decoder.get("num_key_value_heads"),
                                "head_dim": decoder.get("head_size"), "hidden_size": decoder.get("hidden_size") or 1,
                                "vocab_size": genai.get("vocab_size") or 1})
    problems += [f"genai_config.json {p}" for p in signature_problems(declared, inputs, {})]
    rows = next((list(t.dims) for t in graph.initializer if t.name == "cos_cache"), None)
    ctx = genai.get("context_length")
    if rows and (not isinstance(ctx, int) or not 1 <= ctx <= rows[0]):
        problems.append(f"genai_config.json context_length {ctx!r} but the graph's rotary table has {rows[0]:,} "
                        "positions")
    if problems:
        raise ModelError(f"{path}: {'; '.join(problems[:3])}: the folder was edited or does not belong together")
