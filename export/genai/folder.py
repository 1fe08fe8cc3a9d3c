"""``bdlora export genai``: a model folder -> an onnxruntime-genai model folder (model.onnx + model.onnx.data,
genai_config.json, tokenizer files, config.json, export.json written last), validated before it is published."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import onnx

from bdlora import SCHEMA_VERSION
from bdlora.base.errors import Checks, UsageError
from bdlora.base.io import atomic_dir, write_json
from bdlora.base.outputs import check_out_dir
from bdlora.base.provenance import recorded_data_settings
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import ALL_LOGITS_ONNX, GENAI_CONFIG, MODEL_ONNX, OnnxDir
from bdlora.base.schemes import FLOAT, PRECISIONS
from bdlora.base.threads import flat
from bdlora.data.blocks import PackedBlocks, scored_blocks
from bdlora.data.corpora import heldout_blocks, settings_tokens
from bdlora.data.documents import BUILTIN, Corpus
from bdlora.data.tokens import tokenize_corpus
from bdlora.export.decoder import DecoderLayout, build_decoder, decoder_graph
from bdlora.export.decoder import save_graph as save_plain
from bdlora.export.defaults import MAX_CONTEXT, MAX_OPSET
from bdlora.export.files import identity, write_model_files
from bdlora.export.genai import validate as v
from bdlora.export.genai.config import base_type_of, genai_config
from bdlora.export.genai.embedding import TABLE, quantize_embedding
from bdlora.export.genai.gptq import BLOCK_SIZE, input_grams
from bdlora.export.genai.logits import split_head
from bdlora.export.genai.pieces import score_in_pieces
from bdlora.export.genai.quantize import describe, quantize_nbits
from bdlora.export.genai.stream import CalibratedInputs, ExternalData, Rounding, StreamingBuilder, save_streamed
from bdlora.export.genai.tokenizer import readable_by_genai
from bdlora.export.onnx.metadata import metadata_props, metadata_summary, module_table, set_metadata
from bdlora.export.onnx.validate import ExportValidationError, quality_figures, quantized_quality
from bdlora.export.preflight import check_export_inputs
from bdlora.export.settings import GenaiExportConfig
from bdlora.models.lazy import SOURCE, is_lazy, materialized
from bdlora.models.load import load_model_folder
from bdlora.models.runtime import DecoderShape, session
from bdlora.models.stream import PARITY_LAYERS, PARITY_VOCAB, lazy_folder_model, score_streamed, streamed, streams
from bdlora.models.teacher import recorded_teacher

QUALITY_TOKENS = 32768  # held-out tokens scored with the fp32 and quantised graphs when no training run is known
STREAM_QUALITY_TOKENS = 512  # a streamed export's default: each token costs a PyTorch forward of the whole model
STREAM_GENERATED = 8  # a streamed fp32 export's greedy tokens checked against PyTorch (each a pass over the weights)


def save_graph(proto, path: Path) -> None:
    """A graph with every weight in one external-data file beside it (``model.onnx.data``), as the builder does."""

    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data")


def context_length_of(config, context_length: int | None) -> int:
    limit = int(getattr(config, "max_position_embeddings", None) or MAX_CONTEXT)
    ctx = int(min(limit, MAX_CONTEXT) if context_length is None else context_length)  # 0 is a value, not "unset"
    if not 1 <= ctx <= limit:
        raise UsageError(f"--context-length {ctx}: must be in [1, {limit}] (the model's positions)")
    return ctx


def write_genai_files(model, tok, folder: Path, settings: GenaiExportConfig, report: dict | None = None,
                      fp32_path: Path | None = None, calibration=None, grams: dict | None = None,
                      reporter: Reporter = SILENT) -> dict:
    """Write the genai files of ``model`` into the existing ``folder`` as ``settings`` say: the graph as model.onnx
    (+ .data), genai_config.json (``settings.pool.threads``: the intra-op threads it asks for, 0 or None none), config,
    tokenizer (if given) and compression.json (if ``report``); with ``fp32_path`` a quantised export also writes its
    fp32 graph there (the quality reference). A calibrated scheme rounds against ``calibration`` (packed token
    blocks whose activations give each MatMul's input Gram matrix); ``grams``: input Gram matrices measured before
    (one model exported at several precisions is calibrated once), filled in when empty. Returns what was written
    (nodes, quantisation)."""

    settings, ctx, meta, fitted = _beside_graph(model, tok, folder, settings, report)
    precision, cfg = settings.precision, model.config
    proto = build_decoder(model, DecoderLayout.genai(ctx))
    set_metadata(proto, meta)
    info: dict = {"nodes": len(proto.graph.node)}
    if PRECISIONS[precision].rounded:
        if fp32_path is not None:  # the fp32 reference first, then the same proto is rounded in place: no copy of it
            fp32_path.parent.mkdir(exist_ok=True)
            save_graph(proto, fp32_path)
            if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
                onnx.load_external_data_for_model(proto, str(fp32_path.parent))  # saving moved them to disk
        qproto, info["quantization"] = rounded(proto, settings, DecoderShape.of(cfg), calibration, grams, reporter,
                                               in_place=True, tied=tied_head(cfg))
        save_graph(qproto, folder / MODEL_ONNX)
    else:
        save_graph(proto, folder / MODEL_ONNX)
    return {**info, **fitted, **_split_head(folder)}


def _beside_graph(model, tok, folder: Path, settings: GenaiExportConfig, report: dict | None):
    """What a genai folder holds beside its graph (genai_config.json, config, tokenizer, compression.json), written;
    returns (``settings`` for this model: the LM head at the bits its folder declares unless told, the context
    length, the graph's metadata, what the tokenizer lost to be read by onnxruntime-genai: ``tokenizer.
    readable_by_genai``)."""
    settings, cfg = settings.resolved(model.config), model.config
    ctx = context_length_of(cfg, settings.context_length)
    write_json(folder / GENAI_CONFIG,
               genai_config(cfg, base_type_of(cfg), ctx, pool=settings.pool, spin=settings.spin))
    write_model_files(folder, model, tok, report)
    fitted = readable_by_genai(folder)
    rows = module_table(model)
    return settings, ctx, metadata_props(rows, metadata_summary(model, rows, report)), \
        ({"tokenizer": fitted} if fitted else {})


def _split_head(folder: Path) -> dict:
    """model.onnx: the last position's logits; model_all_logits.onnx: every position's (``logits.split_head``)."""
    split_head(folder)
    return {"logits": {MODEL_ONNX: "each row's last position", ALL_LOGITS_ONNX: "every position"}}


def write_streamed_genai_files(model, tok, folder: Path, settings: GenaiExportConfig, report: dict | None = None,
                               reporter: Reporter = SILENT, calibration=None) -> dict:
    """``write_genai_files`` for a lazy model (``bdlora.models.stream``): each part emitted, rounded and written to
    model.onnx.data in turn (``export.genai.stream``); no fp32 reference graph (the validation of a streamed export
    checks parity on a model cut to a few layers, ``validate.cut_parity``, and the quality against PyTorch read one
    layer at a time). A calibrated scheme rounds each part against its inputs on ``calibration`` (packed blocks),
    measured one layer at a time (``stream.CalibratedInputs``)."""
    settings, ctx, meta, fitted = _beside_graph(model, tok, folder, settings, report)
    precision, cfg = settings.precision, model.config
    rounds = PRECISIONS[precision].rounded
    layout = DecoderLayout.genai(ctx)
    data = ExternalData(folder / f"{MODEL_ONNX}.data")
    inputs = None
    if settings.calibrated:
        reporter.stage(f"calibrating: {len(calibration) * calibration.seq_len:,} tokens carried up the model one "
                       f"layer at a time, each part rounded ({settings.quant}) against its MatMuls' inputs")
        inputs = CalibratedInputs(model, calibration.get(range(len(calibration))))
    rounding = Rounding(precision, settings.quant, settings.head_bits, inputs=inputs) if rounds else None
    g = StreamingBuilder(layout.opset, data=data, rounding=rounding, deferred=frozenset({TABLE} if rounds else ()),
                         on_part=lambda: reporter.count(1, cfg.num_hidden_layers + 2, "parts"))
    reporter.count(0, cfg.num_hidden_layers + 2, "parts")
    try:
        proto = build_decoder(model, layout, g)
        set_metadata(proto, meta)
        info: dict = {"nodes": len(proto.graph.node), "streamed": True}
        if rounds:
            table = _table_of(model)
            emb = quantize_embedding(proto, tied_head(cfg), table=table)
            for k, t in enumerate(proto.graph.initializer):  # a table the rounded graph still gathers from
                if t.name == TABLE:
                    proto.graph.initializer[k].CopyFrom(data.put(TABLE, table().float().numpy()))
            data.externalise(proto)
            info["quantization"] = {**describe(proto, BLOCK_SIZE), **rounding.summary(), **emb}
        save_streamed(proto, folder / MODEL_ONNX)
    finally:
        data.close()
    return {**info, **fitted, **_split_head(folder)}


def _table_of(model):
    """The embedding table of a lazy model, made when called: read from its weight files, or a synthetic model's
    seeded values (``lazy.materialized``: the ones its graph's head was emitted with)."""
    source = getattr(model, SOURCE, None)
    if source is not None:
        return lambda: source.read(TABLE)

    def made():
        with materialized(model, "model.embed_tokens"):
            return model.model.embed_tokens.weight.detach().clone()
    return made


def tied_head(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def rounded(proto, settings: GenaiExportConfig, shape: DecoderShape, calibration=None, grams: dict | None = None,
            reporter: Reporter = SILENT, in_place: bool = False, tied: bool = False):
    """(the fp32 decoder ``proto`` rounded as ``settings`` say, what was done): a calibrated scheme first measures
    every MatMul's input Gram matrix on ``calibration`` (unless ``grams`` already holds them: one model rounded at
    several precisions, or in both layouts, is calibrated once; filled in here). The genai folder and the bench's
    plain-layout ICL twins are rounded by this one function."""
    grams = {} if grams is None else grams
    if settings.calibrated and not grams:
        reporter.stage(f"calibrating: the input of every MatMul over {len(calibration) * calibration.seq_len:,} "
                       "tokens (fp32 graph)")
        grams.update(input_grams(proto, shape, calibration,
                                 on_block=lambda d, t: reporter.count(1, t, "blocks")))  # count: increments
    if settings.calibrated:
        reporter.stage(f"{settings.quant}: rounding every MatMul to {settings.precision} against its input")
    out, info = quantize_nbits(proto, settings.precision, settings.quant, grams, settings.head_bits,
                               settings.int8_share, in_place=in_place)
    if settings.calibrated:
        info["calibration_tokens"] = len(calibration) * calibration.seq_len
    info.update(quantize_embedding(out, tied))  # the table once, quantised (the tied head's weights where it can)
    return out, info


LAYOUTS = ("genai", "plain")


def deployment(model, tok, folder: Path, settings: GenaiExportConfig, layout: str = "genai", calibration=None,
               grams: dict | None = None, proto=None, reporter: Reporter = SILENT) -> Path:
    """``model`` written as it deploys under ``settings`` (precision, scheme, head bits, 8-bit share, context,
    threads) into ``folder`` (made if missing); the one writer behind ``export genai``, the bench's rows, its ICL
    twins and the whole-step probes. ``layout`` "genai": the onnxruntime-genai folder (``write_genai_files``; no
    tokenizer files when ``tok`` is None), returned; "plain": the decoder in ``export onnx``'s layout (explicit
    position ids: what batched, left-padded scoring takes) rounded exactly as the genai graph is (``plain_graph``),
    saved as ``folder/model.onnx``, whose path is returned. ``calibration``/``grams``: as ``rounded``; ``proto``: the
    model's fp32 plain graph when already emitted (one model at several precisions)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: allowed {', '.join(LAYOUTS)}")
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "genai":
        if is_lazy(model) and not settings.calibrated:  # a synthetic model (the timing probes, a full-depth 8B among
            # them): written one layer at a time, never its whole fp32 graph
            write_streamed_genai_files(model, tok, folder, settings, reporter=reporter)
        else:
            write_genai_files(model, tok, folder, settings, calibration=calibration, grams=grams, reporter=reporter)
        return folder
    save_plain(plain_graph(model, settings, calibration, grams, proto), folder / MODEL_ONNX)
    return folder / MODEL_ONNX


def plain_graph(model, settings: GenaiExportConfig, calibration=None, grams: dict | None = None, proto=None):
    """``model``'s decoder in the plain layout, rounded as ``write_genai_files`` rounds its genai graph with the same
    ``settings`` (``grams``: filled on the first calibrated call and reused; ``proto``: the model's fp32 plain graph
    when already emitted, which the quantisers copy, never change)."""
    settings = settings.resolved(model.config)
    if proto is None:
        proto, _ = decoder_graph(model, DecoderLayout.plain(model.config, MAX_OPSET))
    if not PRECISIONS[settings.precision].rounded:
        return proto
    return rounded(proto, settings, DecoderShape.of(model.config), calibration, grams,
                   tied=tied_head(model.config))[0]


def export_genai_folder(model_dir: str | Path, out: str | Path, settings: GenaiExportConfig = GenaiExportConfig(),
                        force: bool = False, reporter: Reporter = SILENT) -> dict:
    """Export ``model_dir`` (a compressed student or any folder of a family the table has) for onnxruntime-genai as
    ``settings`` say (``threads`` None: this machine's usable cores; 0 leaves them out, and onnxruntime-genai then
    runs the folder on one thread; ``streaming``: whether the model is read and written one layer at a time)."""
    settings.check(Checks()).done()
    model_dir, out = Path(model_dir), Path(out)
    check_out_dir(out, force, (model_dir,))
    rounds = PRECISIONS[settings.precision]
    stream = streams(settings.streaming, model_dir, whole=bool(settings.int8_share))
    check_export_inputs(model_dir, out, rounds.bits, reference=rounds.rounded and not stream)
    reporter.stage(f"loading {model_dir}" + (" lazily (each layer read from its weight files when emitted)"
                                             if stream else ""))
    seconds: dict[str, float] = {}  # each phase's wall time, and each check's beside it
    with timed(seconds, "load"):
        model, tok, report = lazy_folder_model(model_dir) if stream else load_model_folder(model_dir)
    ctx = context_length_of(model.config, settings.context_length)
    settings = replace(settings.resolved(model.config), pool=settings.pool.resolved(), context_length=ctx)
    precision = settings.precision
    info: dict = {"schema_version": SCHEMA_VERSION, "runtime": "onnxruntime-genai", "source": str(model_dir.resolve()),
                  "precision": precision, "context_length": ctx, "intra_op_threads": settings.pool.threads or None,
                  "streamed": stream, "settings": flat(settings),
                  "summary": metadata_summary(model, module_table(model), report)}
    with atomic_dir(out) as tmp:
        reporter.stage("emitting the genai graph (GroupQueryAttention, fused RMSNorm, shared-input first factors)"
                       + (f", quantising the projections to {precision} (MatMulNBits)" if rounds.rounded else "")
                       + (", one layer at a time" if stream else ""))
        fp32 = tmp / MODEL_ONNX if not rounds.rounded or stream else tmp / FLOAT / MODEL_ONNX
        with timed(seconds, "export"):  # the calibration blocks' reading included, as export_seconds always had
            calibration = None
            if settings.calibrated:
                calibration = calibration_blocks(model_dir, report, tok, DecoderShape.of(model.config),
                                                 settings.calib_tokens)
            if stream:
                info.update(write_streamed_genai_files(model, tok, tmp, settings, report, reporter, calibration))
            else:
                info.update(write_genai_files(model, tok, tmp, settings, report, fp32_path=fp32,
                                              calibration=calibration, reporter=reporter))
        info["export_seconds"], info["seconds"] = seconds["export"], seconds
        if settings.validate:
            info["validation"] = _validate(tmp, model, tok, report, model_dir, settings, reporter, stream)
            info["seconds"].update(info["validation"]["seconds"])
        if fp32 != tmp / MODEL_ONNX:  # the fp32 reference graph served validation only
            for f in fp32.parent.iterdir():
                f.unlink()
            fp32.parent.rmdir()
        info["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())
                         if p.name.startswith(MODEL_ONNX) or p.name == ALL_LOGITS_ONNX}
        info.update(identity(tmp))
        write_json(tmp / OnnxDir.MARKER, info)
    return info


@contextmanager
def timed(seconds: dict, what: str):
    """``seconds[what]``: the wall time of the block (each check's cost, in the folder's report)."""
    t0 = time.time()
    yield
    seconds[what] = time.time() - t0


def _validate(tmp: Path, model, tok, report, model_dir: Path, settings: GenaiExportConfig, reporter: Reporter,
              stream: bool = False) -> dict:
    seconds: dict[str, float] = {}
    out: dict = {"seconds": seconds}
    rounds = PRECISIONS[settings.precision].rounded
    shape = DecoderShape.of(model.config)
    with timed(seconds, "parity"):
        if stream:
            reporter.stage(f"validating the graph against PyTorch on the model's first {PARITY_LAYERS} layers and "
                           f"{PARITY_VOCAB:,} vocabulary rows (prefill, decode, decode steps, the last-position "
                           "head, onnxruntime-genai's own run; fp32)")
            out["parity"] = v.cut_parity(model, settings.context_length, tmp)
            fp32 = None
        else:
            fp32 = session(tmp / (ALL_LOGITS_ONNX if not rounds else f"{FLOAT}/{MODEL_ONNX}"))
            reporter.stage("validating the graph against PyTorch (prefill, decode, decode steps)")
            out["parity"] = v.graph_parity(model, fp32)
    if not stream:
        with timed(seconds, "last_position"):
            out["last_position"] = v.last_position_parity(tmp, shape)
    reporter.stage("checking onnxruntime-genai's tokenizer against the model's")
    with timed(seconds, "tokenizer"):
        out["tokenizer"] = v.tokenizer_roundtrip(tmp, tok)
    if stream:  # the whole graph is the cut's checked form (``v.structure``), measured in pieces (``_quality``)
        with timed(seconds, "structure"):
            out["structure"] = v.structure(tmp, shape)
    if not rounds:
        reporter.stage("generating with og.Generator against PyTorch's greedy tokens" if not stream else
                       "PyTorch's greedy tokens against the graph's, run in pieces")
        with timed(seconds, "generator"):
            if stream:  # the whole fp32 graph is 4x the int4 one's: never one session (32 GB at 8B)
                with streamed(model):
                    out["generator"] = v.greedy_in_pieces(tmp, model, tok, n=STREAM_GENERATED)
            else:
                out["generator"] = v.generator_greedy(tmp, model, tok)
        return out
    with timed(seconds, "quality"):
        out["quality"] = _quality(tmp, model, tok, report, model_dir, settings, reporter, fp32, seconds)
    return out


def _quality(tmp: Path, model, tok, report, model_dir: Path, settings: GenaiExportConfig, reporter: Reporter,
             fp32, seconds: dict) -> dict:
    """The rounded graph's held-out perplexity against fp32's: the fp32 graph's (``fp32``, a session) or, streamed
    (``fp32`` None), PyTorch's one layer at a time against the rounded graph's run in pieces (``pieces``: one piece's
    session at a time, not the whole graph's 6.4 GiB at 8B)."""
    data = recorded_data_settings(model_dir, (report or {}).get("provenance", {}))
    blocks = _quality_blocks(data, tok, DecoderShape.of(model.config))
    tokens = settings.quality_tokens or (STREAM_QUALITY_TOKENS if fp32 is None else None)
    if tokens is not None:  # the first blocks of the same slice, at least one
        blocks = PackedBlocks(blocks.tokens, blocks.seq_len, max_tokens=tokens, bos=blocks.bos)
    what = "the fp32 graph" if fp32 is not None else "PyTorch (fp32, one layer at a time)"
    reporter.stage(f"scoring {len(blocks) * blocks.seq_len:,} held-out tokens ({len(blocks)} blocks) with {what} and "
                   f"the {settings.precision} graph (--quality-tokens sets how many)"
                   + (" (in pieces, one session at a time)" if fp32 is None else ""))
    shape = DecoderShape.of(model.config)
    if fp32 is None:
        with timed(seconds, "rounded_graph"):
            rounded_scores = score_in_pieces(tmp, shape, blocks, reporter=reporter)
        q = {**quality_figures(score_streamed(model, blocks), rounded_scores, blocks),
             "reference": "pytorch-fp32-streamed", "rounded_graph": "in pieces"}
    else:
        q = quantized_quality(fp32, session(tmp / ALL_LOGITS_ONNX), shape, blocks)
    q["max_ppl_change"] = settings.max_ppl_change
    if q["ppl_change"] > settings.max_ppl_change:
        raise ExportValidationError(
            f"{settings.precision} raises held-out perplexity by {q['ppl_change']:.1%} ({q['val_ppl_fp32']:.3g} -> "
            f"{q['val_ppl_quantized']:.3g}; argmax agreement {q['argmax_agreement']:.1%}), above --max-ppl-change "
            f"{settings.max_ppl_change:g}; export fp32 or int8, or pass a larger --max-ppl-change to accept it")
    return q


def data_settings(model_dir: Path, report: dict | None) -> dict:
    """The corpus settings of the run (or one-shot compression) a model folder came from ({} when unknown)."""
    return recorded_data_settings(model_dir, (report or {}).get("provenance", {})) or {}


def corpus_blocks(settings: dict, tok, split: str, seq_len: int, tokens: int) -> PackedBlocks:
    """The first ``tokens`` of ``split`` of the corpus in ``settings`` (the builtin corpus when none), packed."""
    data = settings_tokens(settings, tok, teacher=recorded_teacher(settings))
    return scored_blocks(data.tokens(split), seq_len, tokens,
                         f"the model's corpus ({settings.get('data') or BUILTIN})",
                         "held-out slice" if split == "val" else "training split", bos=data.bos)


def calibration_blocks(model_dir: Path, report: dict | None, tok, shape: DecoderShape, tokens: int):
    """Calibration tokens for GPTQ: the first ``tokens`` of the *training* split (never the held-out slice the
    quality is then measured on) of the corpus the model came from (its run's, or its one-shot compression's), else
    the builtin corpus; blocks of 256 tokens (at most the model's positions)."""
    return corpus_blocks(data_settings(model_dir, report), tok, "train", min(256, shape.max_positions), tokens)


def heldout_for(model_dir: Path, report: dict | None, tok, shape: DecoderShape, tokens: int):
    """The held-out slice the model's own figures come from (its run's or one-shot compression's corpus, split and
    block length; the builtin corpus otherwise), ``tokens`` of it."""
    settings = data_settings(model_dir, report)
    return corpus_blocks(settings, tok, "val", min(settings.get("seq_len") or 128, shape.max_positions), tokens)


def _quality_blocks(settings: dict | None, tok, shape):
    """The held-out blocks the model's perplexity was reported on (``settings``: its run's or compression's corpus
    settings), else the first ``QUALITY_TOKENS`` of the builtin corpus's held-out slice in blocks of 128 tokens."""

    if settings is not None:
        return heldout_blocks(settings, tok, teacher=recorded_teacher(settings))
    corpus = Corpus(BUILTIN)
    data = tokenize_corpus(corpus, tok, corpus.default_heldout_fraction, None)
    return PackedBlocks(data.tokens("val"), min(128, shape.max_positions), max_tokens=QUALITY_TOKENS, bos=data.bos)
