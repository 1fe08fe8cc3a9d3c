"""ONNX export of a (compressed) student as a decoder with KV cache (SPEC 8), optimum-onnx's pattern: declare the
inputs and outputs with named dynamic axes, export, then *validate* against PyTorch with a stated tolerance.

Graph signature (opset 17 by default):
    inputs   input_ids (batch, seq) int64, attention_mask (batch, past + seq) int64, position_ids (batch, seq)
             int64, past_key_values.{i}.key / .value (batch, kv_heads, past, head_dim) float32
    outputs  logits (batch, seq, vocab), present.{i}.key / .value (batch, kv_heads, past + seq, head_dim)

Why a hand-built mask: with transformers 4.57 the TorchScript exporter fails on the vmap-based mask builder and the
older mask function bakes shapes in, while the dynamo exporter is slow. A ``DynamicCache`` cannot be an ONNX input
either. So ``DecoderWithCache`` takes flat past tensors, rebuilds the cache, and passes a 4D additive mask (causal
and padding, built from plain comparisons) that transformers uses as is. Attention runs in its eager form.

Model-level metadata (``custom_metadata_map``): ``bdlora.modules`` (JSON table of every replaced projection: name,
form, in/out features, rank, MACs per token, parameters), ``bdlora.summary`` (base architecture, F, totals, MAC
speed-ups) and ``bdlora.version``. Nodes of each module also carry the module's name in their ``doc_string``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from bdlora.errors import BdloraError, ModelError, UsageError

DEFAULT_OPSET = 17
MIN_OPSET = 14  # scaled_dot_product / trilu-free attention and the ops the legacy exporter emits need >= 14
TOLERANCE = 1e-4  # max |ONNX - torch| on logits and present key/values, fp32
VALIDATION_SHAPES = ((1, 1, 0), (2, 6, 0), (2, 1, 5), (3, 4, 3))  # (batch, seq, past); rows 0 are left padded


class ExportValidationError(BdloraError):
    """The exported graph disagrees with PyTorch beyond the tolerance."""


def max_opset() -> int:
    from torch.onnx._constants import ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET

    return int(ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET)


def check_opset(opset: int) -> None:
    if not MIN_OPSET <= opset <= max_opset():
        raise UsageError(f"--opset {opset}: the exporter supports opsets {MIN_OPSET}..{max_opset()}")


def build_4d_mask(attention_mask: torch.Tensor, seq_len: int, dtype=torch.float32) -> torch.Tensor:
    """(B, 1, seq, past + seq) additive mask: 0 where query t may attend key j (j <= past + t and j not padding),
    the dtype's minimum elsewhere (not -inf, so a fully padded query row stays finite)."""
    b, total = attention_mask.shape
    past = total - seq_len
    q = torch.arange(seq_len, device=attention_mask.device).view(1, 1, seq_len, 1) + past
    k = torch.arange(total, device=attention_mask.device).view(1, 1, 1, total)
    allowed = (k <= q) & attention_mask.view(b, 1, 1, total).bool()
    return torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


class DecoderWithCache(nn.Module):
    """Flat-tensor wrapper of a causal LM: (input_ids, attention_mask, position_ids, *past) -> (logits, *present)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.num_layers = model.config.num_hidden_layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        mask = build_4d_mask(attention_mask, input_ids.shape[1])
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        present = []
        for layer in out.past_key_values.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def kv_shape(config) -> tuple[int, int]:
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv, head_dim


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    ins = ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    outs = ["logits"] + [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return ins, outs


def position_ids_from_mask(attention_mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """HF/optimum convention: cumsum of the mask minus one, padding set to 1, last ``seq_len`` positions."""
    pos = attention_mask.long().cumsum(-1) - 1
    pos = pos.masked_fill(attention_mask == 0, 1)
    return pos[:, -seq_len:]


def empty_past(config, batch: int) -> list[np.ndarray]:
    """The zero-length past K/V of a first call: 2 x layers arrays (batch, kv_heads, 0, head_dim)."""
    kv, hd = kv_shape(config)
    return [np.zeros((batch, kv, 0, hd), dtype=np.float32) for _ in range(2 * config.num_hidden_layers)]


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


def log_normaliser(logits: np.ndarray) -> np.ndarray:
    """log sum exp over the last axis, stable (logits minus this is the log-softmax)."""
    top = logits.max(-1, keepdims=True)
    return np.log(np.exp(logits - top).sum(-1)) + top[..., 0]


def example_inputs(config, batch: int, seq: int, past: int, pad_first: int = 0, seed: int = 0):
    """Random inputs of the graph's signature; the first row is left padded by ``pad_first`` tokens."""
    g = torch.Generator().manual_seed(seed)
    kv, hd = kv_shape(config)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    if pad_first:
        mask[0, :pad_first] = 0
    pos = position_ids_from_mask(mask, seq)
    pasts = [torch.randn(batch, kv, past, hd, generator=g) for _ in range(2 * config.num_hidden_layers)]
    return ids, mask, pos, pasts


def load_model_folder(model_dir: str | Path):
    """(model, tokenizer, compression report or None) of any folder bdlora can load: a compressed bdlora model,
    a kd-full student, or a plain HF checkpoint. Loaded in fp32 with eager attention (what is exported)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import bdlora  # noqa: F401  registers the bdlora architectures

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise ModelError(f"{model_dir}: not a model folder (no config.json); pass a `bdlora compress` output or a "
                         "Hugging Face model folder")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                     attn_implementation="eager")
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # noqa: BLE001
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelError(f"{model_dir}: could not load the model ({msg[:200]})") from None
    from bdlora.teacher import check_architecture

    check_architecture(model, str(model_dir))
    report = json.loads((model_dir / "compression.json").read_text()) if (model_dir / "compression.json").exists() \
        else None
    return model.eval(), tok, report


# --------------------------------------------------------------------------------------------------------------------
# Module table (metadata)
# --------------------------------------------------------------------------------------------------------------------


def module_table(model: nn.Module) -> list[dict]:
    """Every projection of the model as deployed: dense, low-rank, or dense + unmerged LoRA adapter."""
    from bdlora.costs import PROJECTIONS
    from bdlora.export.modeling_bdlora import LowRankLinear

    rows = []
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        bias = 0
        if isinstance(m, LowRankLinear):
            form, i, o, r = "lowrank", m.in_features, m.out_features, m.rank
            macs = r * (i + o)
            bias = o if m.proj_out.bias is not None else 0
        elif isinstance(m, nn.Linear):
            form, i, o, r = "dense", m.in_features, m.out_features, 0
            macs = i * o
            bias = o if m.bias is not None else 0
        elif hasattr(m, "base") and hasattr(m, "lora_rank"):  # dense + unmerged LoRA (bench's lora variant)
            form, i, o, r = "dense+lora", m.base.in_features, m.base.out_features, m.lora_rank
            macs = i * o + r * (i + o)
            bias = o if m.base.bias is not None else 0
        else:
            continue
        rows.append({"name": name, "form": form, "in_features": i, "out_features": o, "rank": r,
                     "macs_per_token": macs, "parameters": macs + bias})
    return rows


def metadata_summary(model: nn.Module, rows: list[dict], report: dict | None) -> dict:
    cfg = model.config
    bd = getattr(cfg, "bdlora", {}) or {}
    dense = sum(r["in_features"] * r["out_features"] for r in rows)
    macs = sum(r["macs_per_token"] for r in rows)
    summary = {"base_model_type": bd.get("base_model_type", cfg.model_type), "model_type": cfg.model_type,
               "budget": bd.get("budget"), "modules": len(rows),
               "forms": {f: sum(r["form"] == f for r in rows) for f in sorted({r["form"] for r in rows})},
               "dense_macs": dense, "deployed_macs": macs, "mac_speedup_vs_dense": dense / macs}
    if report:
        for k in ("dense_kept", "dense_svd", "dense_dropped", "avg_lora_rank", "speedup_vs_dense", "speedup_vs_lora",
                  "param_reduction"):
            summary[k] = report.get(k)
        summary["method"] = report.get("provenance", {}).get("method")
    return summary


def _scope(name: str) -> str:
    """Module name -> the TorchScript exporter's node-name scope (``model.layers.0.mlp`` -> ``model/layers.0/mlp``)."""
    return re.sub(r"layers/(\d+)", r"layers.\1", name.replace(".", "/"))


def tag_nodes(m, rows: list[dict]) -> None:
    """Where the graph keeps module scopes in node names, put the module's name, form and rank in ``doc_string``."""
    tags = [(f"/{_scope(r['name'])}/", r) for r in rows]
    for node in m.graph.node:
        for scope, r in tags:
            if scope in node.name:
                node.doc_string = json.dumps({"bdlora_module": r["name"], "form": r["form"], "rank": r["rank"]})
                break


def add_metadata(onnx_path: Path, rows: list[dict], summary: dict) -> None:
    import onnx

    from bdlora import __version__

    m = onnx.load(str(onnx_path), load_external_data=False)
    meta = {"bdlora.modules": json.dumps(rows), "bdlora.summary": json.dumps(summary), "bdlora.version": __version__}
    keep = [p for p in m.metadata_props if p.key not in meta]
    del m.metadata_props[:]
    m.metadata_props.extend(keep)
    for k, v in meta.items():
        m.metadata_props.add(key=k, value=v)
    onnx.save(m, str(onnx_path))


# --------------------------------------------------------------------------------------------------------------------
# Export, run, validate
# --------------------------------------------------------------------------------------------------------------------


def export_decoder(model: nn.Module, path: Path, opset: int = DEFAULT_OPSET, fuse: bool = True) -> int:
    """Trace ``model`` (fp32, eager attention) into ``path`` with the KV-cache signature and dynamic axes; then fuse
    MatMuls that share an input (q/k/v, gate/up; see ``fuse.py``)."""
    import warnings

    check_opset(opset)
    model.config._attn_implementation = "eager"
    wrapper = DecoderWithCache(model).eval()
    ins, outs = io_names(model.config.num_hidden_layers)
    ids, mask, pos, pasts = example_inputs(model.config, 2, 3, 2)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
            "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    axes.update({n: {0: "batch", 2: "past"} for n in ins[3:]})
    axes.update({n: {0: "batch", 2: "total"} for n in outs[1:]})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about the cache's Python-side bookkeeping
        torch.onnx.export(wrapper, (ids, mask, pos, *pasts), str(path), input_names=ins, output_names=outs,
                          dynamic_axes=axes, opset_version=opset, dynamo=False, do_constant_folding=True)
    return postprocess(path, module_table(model), fuse)


def optimize_graph(path: Path, model: nn.Module) -> dict[str, int]:
    """Rewrite ``path`` in place with onnxruntime's transformer optimizer (its ``qwen3`` fusions, which match the
    Llama/Mistral/Qwen2 decoder layer): RMSNorm -> ``SimplifiedLayerNormalization``, residual add + RMSNorm ->
    ``SkipSimplifiedLayerNormalization``, rotary position embedding -> ``RotaryEmbedding`` (com.microsoft contrib
    ops, so the graph then runs on onnxruntime only). The projections' MatMuls are untouched. Returns the count of
    each fused op.

    The optimizer writes cos/sin caches for 131,072 positions computed with its own RoPE assumptions; they are
    replaced by the model's own rotary embedding (``model.model.rotary_emb``, so RoPE scaling variants are exact)
    over ``max_position_embeddings`` positions."""
    import logging

    import onnx
    from onnx import numpy_helper
    from onnxruntime.transformers.optimizer import optimize_model

    config = model.config
    fused_ops = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RotaryEmbedding")
    # the optimizer and its symbolic shape inference log a line per attention block they cannot prove shapes for
    quiet = [logging.getLogger(n) for n in ("onnxruntime.transformers", "symbolic_shape_infer",
                                           "onnxruntime.tools.symbolic_shape_infer")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
        om = optimize_model(str(path), model_type="qwen3", num_heads=config.num_attention_heads,
                            hidden_size=config.hidden_size, opt_level=0)
    finally:
        for q, lv in zip(quiet, levels):
            q.setLevel(lv)
    g = om.model.graph
    # RotaryEmbedding inputs: (input, position_ids, cos_cache, sin_cache), caches (max_positions, rotary_dim / 2)
    caches = {n.input[i]: kind for n in g.node if n.op_type == "RotaryEmbedding" and len(n.input) >= 4
              for i, kind in ((2, "cos"), (3, "sin"))}
    if caches:
        from bdlora.distill import base_model

        core = base_model(model).model
        n_pos = config.max_position_embeddings
        with torch.no_grad():
            probe = torch.zeros(1, dtype=torch.float32)
            cos, sin = core.rotary_emb(probe, torch.arange(n_pos)[None])  # (1, P, head_dim), halves repeated
        half = cos.shape[-1] // 2
        exact = {"cos": cos[0, :, :half].numpy().astype(np.float32),
                 "sin": sin[0, :, :half].numpy().astype(np.float32)}
        for init in g.initializer:
            if init.name in caches:
                init.CopyFrom(numpy_helper.from_array(exact[caches[init.name]], init.name))
    onnx.helper.set_model_props(om.model, meta)
    om.save_model_to_file(str(path))
    counts = {op: sum(1 for n in g.node if n.op_type == op) for op in fused_ops}
    return {k: v for k, v in counts.items() if v}


def postprocess(path: Path, rows: list[dict], fuse: bool = True) -> int:
    """Tag module nodes, then (optionally) fuse shared-input MatMuls; returns the number of MatMuls fused away."""
    import onnx

    from bdlora.export.fuse import fuse_shared_input_matmuls

    m = onnx.load(str(path))
    tag_nodes(m, rows)
    n = fuse_shared_input_matmuls(m) if fuse else 0
    onnx.save(m, str(path))
    return n


def session(path: Path, threads: int | None = None, opt_level: str = "all", global_pool: bool = False,
            provider: str = "CPUExecutionProvider"):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = {"none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                   "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                                   "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                   "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[opt_level]
    if global_pool:
        so.use_per_session_threads = False
    elif threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=[provider])


def run_session(sess, ids, mask, pos, pasts) -> list[np.ndarray]:
    names = [i.name for i in sess.get_inputs()]
    values = [ids, mask, pos, *pasts]
    return sess.run(None, {n: (v.numpy() if torch.is_tensor(v) else v) for n, v in zip(names, values)})


@torch.no_grad()
def validate(model: nn.Module, sess, shapes=VALIDATION_SHAPES, tolerance: float = TOLERANCE) -> dict:
    """Compare ONNX Runtime with the model's own forward (native 2D-mask path) at several (batch, seq, past),
    the first row left padded; logits are compared on real (non-padding) positions, present K/V everywhere."""
    from transformers import DynamicCache

    results = []
    worst = 0.0
    for b, s, p in shapes:
        pad = min(2, p + s - 1) if b > 1 else 0
        ids, mask, pos, pasts = example_inputs(model.config, b, s, p, pad_first=pad, seed=b * 100 + s * 10 + p)
        cache = DynamicCache()
        for i in range(model.config.num_hidden_layers):
            cache.update(pasts[2 * i].clone(), pasts[2 * i + 1].clone(), i)
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        got = run_session(sess, ids, mask, pos, pasts)
        real = mask[:, -s:].bool().numpy()  # (B, seq) query positions that are real tokens
        d_logits = float(np.abs(got[0] - ref.logits.numpy())[real].max())
        d_kv = 0.0
        for i, layer in enumerate(ref.past_key_values.layers):
            d_kv = max(d_kv, float(np.abs(got[1 + 2 * i] - layer.keys.numpy()).max()),
                       float(np.abs(got[2 + 2 * i] - layer.values.numpy()).max()))
        worst = max(worst, d_logits, d_kv)
        results.append({"batch": b, "seq": s, "past": p, "left_pad": pad, "max_abs_diff_logits": d_logits,
                        "max_abs_diff_present": d_kv})
    if worst > tolerance:
        raise ExportValidationError(f"ONNX output differs from PyTorch by {worst:.3g} (tolerance {tolerance:g}); "
                                    f"per shape: {results}")
    return {"tolerance": tolerance, "max_abs_diff": worst, "shapes": results}


def greedy_generate(sess, config, input_ids: np.ndarray, max_new_tokens: int, eos_token_id: int | None = None):
    """Greedy decoding with the KV cache under onnxruntime (prompt once, then one token per step)."""
    b = input_ids.shape[0]
    pasts = empty_past(config, b)
    mask = np.ones((b, input_ids.shape[1]), dtype=np.int64)
    ids = input_ids.astype(np.int64)
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy()
    out = [input_ids]
    for _ in range(max_new_tokens):
        res = run_session(sess, ids, mask, pos, pasts)
        nxt = res[0][:, -1].argmax(-1).astype(np.int64)[:, None]  # (B, 1)
        out.append(nxt)
        pasts = res[1:]
        mask = np.concatenate([mask, np.ones((b, 1), dtype=np.int64)], 1)
        pos = pos[:, -1:] + 1
        ids = nxt
        if eos_token_id is not None and (nxt == eos_token_id).all():
            break
    return np.concatenate(out, 1)


def ort_score(sess, config, blocks, batch_size: int = 8) -> tuple[float, np.ndarray]:
    """(mean next-token NLL, argmax predictions (N,)) of an ONNX decoder over packed blocks (past length 0)."""
    total, count, preds = 0.0, 0, []
    for start in range(0, len(blocks), batch_size):
        x = blocks.get(range(start, min(start + batch_size, len(blocks))))
        b, t = x.shape
        mask = np.ones((b, t), dtype=np.int64)
        pos = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t)).copy()
        logits = run_session(sess, x, mask, pos, empty_past(config, b))[0][:, :-1].astype(np.float64)  # (B, T-1, V)
        logz = log_normaliser(logits)
        tgt = np.take_along_axis(logits, x[:, 1:, None], -1)[..., 0]
        total += float((logz - tgt).sum())
        count += tgt.size
        preds.append(logits.argmax(-1).reshape(-1))
    return total / count, np.concatenate(preds)


def quantize_int8(src: Path, dst: Path) -> None:
    """onnxruntime dynamic int8 weight quantisation (shape inference first), keeping the bdlora metadata."""
    import logging

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = dst.with_suffix(".pre.onnx")
    try:
        quant_pre_process(str(src), str(pre), skip_optimization=True, skip_symbolic_shape=True)
        # contrib ops (after --optimize) have no ONNX type inference: their outputs are fp32 activations, and the
        # quantizer's per-tensor warnings about them (on the root logger) say nothing actionable
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)
        try:
            quantize_dynamic(str(pre), str(dst), weight_type=QuantType.QInt8,
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        finally:
            root.setLevel(level)
    finally:
        if pre.exists():
            pre.unlink()
    q = onnx.load(str(dst))
    meta = {p.key: p.value for p in onnx.load(str(src), load_external_data=False).metadata_props}
    del q.metadata_props[:]
    for k, v in meta.items():
        q.metadata_props.add(key=k, value=v)
    onnx.save(q, str(dst))


def export_onnx_folder(model_dir: str | Path, out: str | Path, opset: int = DEFAULT_OPSET, quantize: str | None = None,
                       run_validation: bool = True, force: bool = False, on_stage=None,
                       optimize: bool = False) -> dict:
    """``bdlora export onnx``: model folder -> ONNX folder loadable by ``BdloraORTModelForCausalLM`` (optimum)."""
    import math

    from bdlora.export.hf import check_out_dir
    from bdlora.io import atomic_dir, write_json

    stage = on_stage or (lambda s: None)
    check_opset(opset)
    if quantize not in (None, "int8"):
        raise UsageError(f"--quantize {quantize}: unknown (allowed: int8)")
    model_dir, out = Path(model_dir), Path(out)
    check_out_dir(out, force, (model_dir,))
    stage(f"loading {model_dir}")
    model, tok, report = load_model_folder(model_dir)
    rows = module_table(model)
    summary = metadata_summary(model, rows, report)
    info: dict = {"schema_version": 1, "source": str(model_dir), "opset": opset, "summary": summary}
    with atomic_dir(out) as tmp:
        stage(f"exporting to ONNX (opset {opset})")
        t0 = time.time()
        info["matmuls_fused"] = export_decoder(model, tmp / "model.onnx", opset)
        if optimize:
            stage("fusing RMSNorm / residual / rotary subgraphs (onnxruntime transformer optimizer)")
            info["ort_fusions"] = optimize_graph(tmp / "model.onnx", model)
        add_metadata(tmp / "model.onnx", rows, summary)
        info["export_seconds"] = time.time() - t0
        info["files"] = {"model.onnx": (tmp / "model.onnx").stat().st_size}
        if run_validation:
            stage("validating against PyTorch")
            info["validation"] = validate(model, session(tmp / "model.onnx"))
        model.config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if report is not None:
            write_json(tmp / "compression.json", report)
        if quantize == "int8":
            stage("quantising to int8 (dynamic, weights)")
            quantize_int8(tmp / "model.onnx", tmp / "model_int8.onnx")
            info["files"]["model_int8.onnx"] = (tmp / "model_int8.onnx").stat().st_size
            blocks = _heldout_blocks(report, tok)
            if blocks is not None:
                stage("scoring the held-out slice with fp32 and int8 graphs")
                nll32, arg32 = ort_score(session(tmp / "model.onnx"), model.config, blocks)
                nll8, arg8 = ort_score(session(tmp / "model_int8.onnx"), model.config, blocks)
                info["int8"] = {"val_ppl_fp32": math.exp(nll32), "val_ppl_int8": math.exp(nll8),
                                "argmax_agreement": float((arg32 == arg8).mean()),
                                "ppl_change": math.exp(nll8) / math.exp(nll32) - 1.0,
                                "tokens": len(blocks) * blocks.seq_len,
                                "size_ratio": info["files"]["model_int8.onnx"] / info["files"]["model.onnx"]}
        write_json(tmp / "export.json", info)
    return info


def _heldout_blocks(report: dict | None, tok):
    """The held-out slice of the run the model came from (via the compression report's provenance), if known."""
    from bdlora.evaluate import run_val_blocks
    from bdlora.io import read_json

    run_dir = (report or {}).get("provenance", {}).get("run_dir")
    if not run_dir or not (Path(run_dir) / "config.json").exists():
        return None
    return run_val_blocks(read_json(Path(run_dir) / "config.json")["config"], tok)


def load_ort_model(onnx_dir: str | Path, file_name: str = "model.onnx", **kwargs):
    """optimum's ORTModelForCausalLM for a bdlora ONNX folder (see ``BdloraORTModelForCausalLM``)."""
    import bdlora  # noqa: F401  registers the config classes optimum's AutoConfig lookup needs

    return _ort_class().from_pretrained(str(onnx_dir), file_name=file_name, use_cache=True, use_io_binding=False,
                                        **kwargs)


def _ort_class():
    from optimum.onnxruntime import ORTModelForCausalLM

    class BdloraORTModelForCausalLM(ORTModelForCausalLM):
        """optimum's ORT decoder, told the true cache shape of bdlora model types.

        optimum sizes the empty first-step cache from ``num_attention_heads`` for model types it does not know (it
        lists mistral, llama, qwen2, ... explicitly), which breaks GQA (kv_heads < heads). This subclass only
        replaces those two numbers with the config's ``num_key_value_heads`` and head dimension."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.num_key_value_heads, self.embed_size_per_head = kv_shape(self.config)

    return BdloraORTModelForCausalLM
