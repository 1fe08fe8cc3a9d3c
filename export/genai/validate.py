"""Validation of a genai folder: graph parity with PyTorch (prefill, decode after a past, a run of decode steps fed
back), the runtime's own greedy generation (``og.Generator``) against PyTorch's, the runtime's tokenizer against
the Hugging Face one, and, for int8/int4, the held-out perplexity change and argmax agreement against fp32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime_genai as og
import torch
import torch.nn as nn

from bdlora.base.io import write_json
from bdlora.base.runs import ALL_LOGITS_ONNX, GENAI_CONFIG, MODEL_ONNX
from bdlora.export.decoder import DecoderLayout, build_decoder
from bdlora.export.genai.config import base_type_of, genai_config
from bdlora.export.genai.logits import last_position_head, split_head
from bdlora.export.genai.pieces import Pieces, first_call_feeds
from bdlora.export.genai.stream import ExternalData, StreamingBuilder, save_streamed
from bdlora.export.onnx.validate import (
    NOISE_FACTOR,
    TOLERANCE,
    ExportValidationError,
    in_float64,
    max_abs_diff,
    validate,
)
from bdlora.models.runtime import DecoderShape, empty_past, run_decoder, session, signature_problems
from bdlora.models.runtime import DecoderSignature as Sig
from bdlora.models.stream import cut_checked

# GroupQueryAttention takes right-aligned batches (positions come from the mask's row sums) and, on CPU, several
# new tokens after a past only for batch 1: the shapes a genai runtime feeds it.
GENAI_SHAPES = ((1, 1, 0), (2, 6, 0), (2, 1, 5), (1, 4, 3), (1, 1, 33))
PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, there was a",
           "import numpy as np\n\n")
TEXTS = ("The capital of France is Paris.\nIt has 2 million people.", "  def f(x):\n\treturn x ** 2  # héllo ✓",
         "<|im_start|>user\nHi!<|im_end|>")


def graph_parity(model: nn.Module, sess, steps: int = 6) -> dict:
    """Logits and present K/V against PyTorch at ``GENAI_SHAPES``, then a prompt of 8 followed by ``steps`` decode
    steps, each fed the previous step's presents, against the full-sequence forward."""

    out = validate(model, sess, shapes=GENAI_SHAPES, left_pad=False)
    shape = DecoderShape.of(model.config)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, shape.vocab_size, (1, 8 + steps), generator=g)
    with torch.no_grad():
        ref = model(ids).logits.numpy()
        with in_float64(model):
            noise = max_abs_diff(model(ids).logits.numpy(), ref)
    bound = max(out["tolerance"], TOLERANCE, NOISE_FACTOR * noise)  # as in ``validate``: torch's own fp32 error
    past = empty_past(shape, 1)
    worst, t = 0.0, 0
    for n in [8] + [1] * steps:
        x = ids[:, t : t + n].numpy()
        res = run_decoder(sess, x, np.ones((1, t + n), np.int64), None, past)
        worst = max(worst, max_abs_diff(res[0], ref[:, t : t + n]))
        past, t = res[1:], t + n
    if worst > bound:
        raise ExportValidationError(f"genai graph differs from PyTorch by {worst:.3g} over {steps} decode steps "
                                    f"(tolerance {bound:.3g})")
    return {**out, "decode_steps": steps, "decode_max_abs_diff": worst, "decode_tolerance": bound}


def cut_parity(model: nn.Module, context_length: int, folder: Path) -> dict:
    """``graph_parity`` of the genai graph of ``models.stream.cut_model(model)`` (written under ``folder``, removed
    after), then the cut's last-position graph against its every-position twin on right-padded batches
    (``last_position_parity``) and as onnxruntime-genai runs it with the genai_config.json the export writes
    (``runtime_last_position``): the head's slicing and the runtime's inputs and cache checked where their sessions
    cost little. The whole graph is tied to these by ``structure``."""

    def check(cut, path: Path) -> dict:
        sess = session(path)
        out = graph_parity(cut, sess)
        split_head(path.parent)  # the session read the every-position graph: it serves as its twin below
        shape = DecoderShape.of(cut.config)
        rows = last_rows(sess, shape)
        out["last_position"] = last_position_parity(path.parent, shape, full=sess)
        del sess
        write_json(path.parent / GENAI_CONFIG, genai_config(cut.config, base_type_of(cut.config), context_length))
        return {**out, "runtime": runtime_last_position(path.parent, rows)}

    def write(cut, path: Path) -> None:  # each part's weights appended to the data file as the export writes them
        # (no protobuf copy of 500 MB at 1B: 2.5 s -> 1 s), so split_head reads and writes the structure only
        layout = DecoderLayout.genai(context_length)
        data = ExternalData(path.parent / f"{path.name}.data")
        try:
            proto = build_decoder(cut, layout, StreamingBuilder(layout.opset, data=data))
        finally:
            data.close()
        save_streamed(proto, path)

    return cut_checked(model, folder, write, check)


@torch.no_grad()
def torch_greedy(model: nn.Module, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation of ``ids`` by PyTorch and, per step, the margin between its top two logits."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    margins = []
    for logits in out.logits:
        top2 = torch.topk(logits[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return out.sequences[0, len(ids):].tolist(), margins


def generator_greedy(folder: Path, model: nn.Module, tokenizer, n: int = 32, tolerance: float = 1e-3) -> dict:
    """``og.Generator`` greedy tokens against PyTorch's for several prompts (``n`` new tokens each, EOS ignored).
    A divergence is accepted only at a step where PyTorch's top two logits are within ``tolerance`` (a tie any two
    fp32 implementations may break differently); the generated text itself is then compared up to that step."""

    og_model = og.Model(str(folder))
    rows, ties = [], 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        params = og.GeneratorParams(og_model)
        params.set_search_options(max_length=len(ids) + n, min_length=len(ids) + n, do_sample=False)
        gen = og.Generator(og_model, params)
        gen.append_tokens(np.array(ids, dtype=np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        got = [int(t) for t in gen.get_sequence(0)][len(ids):]
        want, margins = torch_greedy(model, ids, n)
        rows.append(_greedy_row("og.Generator's", prompt, got, want, margins, tolerance))
        ties += rows[-1]["first_tie"] is not None
    return {"prompts": rows, "new_tokens": n, "all_identical": ties == 0, "tie_breaks": ties}


def _greedy_row(what: str, prompt: str, got: list[int], want: list[int], margins: list[float],
                tolerance: float) -> dict:
    """A prompt's greedy tokens against PyTorch's: the first step they part must be a near tie of PyTorch's."""
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is not None and margins[first] > tolerance:
        raise ExportValidationError(
            f"{what} greedy tokens differ from PyTorch's at step {first} of {prompt!r} (PyTorch's top-2 margin "
            f"{margins[first]:.3g} > {tolerance}): {got[: first + 1]} vs {want[: first + 1]}")
    return {"prompt": prompt, "tokens": len(got), "identical": first is None, "first_tie": first}


def greedy_in_pieces(folder: Path, model: nn.Module, tokenizer, n: int = 8, tolerance: float = 1e-3) -> dict:
    """``generator_greedy`` for a graph too large to open whole (an fp32 8B graph: 32 GB): PyTorch's greedy
    continuation of each prompt (``n`` tokens; ``model`` read one layer at a time), then the every-position graph
    run in pieces (``pieces.Pieces``) over the prompt and those tokens, whose argmax at each step must be PyTorch's
    token but where its top two logits are within ``tolerance``. onnxruntime-genai's own run is checked on the cut
    (``cut_parity``)."""
    shape = DecoderShape.of(model.config)
    runs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        runs.append((prompt, ids, *torch_greedy(model, ids, n)))
    calls = [first_call_feeds(shape, np.array([ids + want[:-1]])) for _, ids, want, _ in runs]
    rows = [_greedy_row("the graph's", prompt, out[Sig.LOGITS][0, len(ids) - 1 :].argmax(-1).tolist(), want, margins,
                        tolerance)
            for (prompt, ids, want, margins), out in zip(runs, list(Pieces(folder).run(calls)))]
    ties = sum(r["first_tie"] is not None for r in rows)
    return {"prompts": rows, "new_tokens": n, "all_identical": ties == 0, "tie_breaks": ties,
            "runtime": "onnxruntime, in pieces"}


def tokenizer_roundtrip(folder: Path, tokenizer) -> dict:
    """onnxruntime-genai's tokenizer must encode and decode like the Hugging Face one (a byte-level BPE read
    wrongly decodes to raw symbols such as 'Ġ')."""

    tok = og.Tokenizer(og.Config(str(folder)))  # the folder's config and tokenizer files; no session opened
    for text in TEXTS:
        want = tokenizer(text, add_special_tokens=False)["input_ids"]
        got = [int(t) for t in tok.encode(text)]
        if got[-len(want):] != want:
            raise ExportValidationError(f"onnxruntime-genai's tokenizer encodes {text!r} as {got[:12]}..., the "
                                        f"model's tokenizer as {want[:12]}...")
        # onnxruntime-genai's decode drops special tokens (as a chat client wants)
        back, ref = tok.decode(np.array(want, dtype=np.int32)), tokenizer.decode(want, skip_special_tokens=True)
        if back != ref:
            raise ExportValidationError(f"onnxruntime-genai's tokenizer decodes {want[:12]}... as {back!r}, the "
                                        f"model's tokenizer as {ref!r}")
    return {"texts": len(TEXTS), "identical": True}


def last_position_parity(folder: Path, shape: DecoderShape, tolerance: float = 1e-5, full=None) -> dict:
    """model.onnx (each row's last position) against model_all_logits.onnx (every position; ``full``: a session of
    it already open) on the shapes the runtime feeds: right-padded prompts of different lengths, then a decode step
    after them. The two graphs share every weight, so the rows must agree to rounding."""
    rng = np.random.default_rng(11)
    lengths = np.array([7, 3, 5])
    ids = rng.integers(0, shape.vocab_size, (len(lengths), int(lengths.max())))
    mask = (np.arange(ids.shape[1])[None] < lengths[:, None]).astype(np.int64)
    past = empty_past(shape, len(lengths))
    step, later = ids[:1, :1], np.ones((1, ids.shape[1] + 1), np.int64)
    # one session at a time, each as deployed (prepacked): unprepacked, MatMulNBits dequantises its weights on every
    # call, and these four calls took 37 s at 3B against 6.7 s
    full = session(folder / ALL_LOGITS_ONNX) if full is None else full
    a = run_decoder(full, ids, mask, None, past)
    one = [x[:1] for x in a[1:]]
    c = run_decoder(full, step, later, None, one)[0]
    del full
    last = session(folder / MODEL_ONNX)
    b, d = run_decoder(last, ids, mask, None, past), run_decoder(last, step, later, None, one)[0]
    worst = max(float(np.abs(a[0][r, n - 1] - b[0][r, 0]).max()) for r, n in enumerate(lengths))
    worst = max(worst, float(np.abs(c[0, -1] - d[0, 0]).max()))
    if b[0].shape[1] != 1 or worst > tolerance:
        raise ExportValidationError(f"{MODEL_ONNX}'s last-position logits differ from {ALL_LOGITS_ONNX}'s by "
                                    f"{worst:.3g} (tolerance {tolerance:g})")
    return {"max_abs_diff": worst, "tolerance": tolerance}


def structure(folder: Path, shape: DecoderShape) -> dict:
    """model.onnx is model_all_logits.onnx with the last-position head (``logits.last_position_head``) and nothing
    else: the same nodes and the same weights at the same offsets of the one data file, so what the every-position
    graph is measured to do (the held-out check, run in pieces) model.onnx does, with the head's slicing checked on
    the cut (``cut_parity``). And the graph's inputs and outputs are what config.json and genai_config.json declare
    (layers, key/value heads, head size, vocabulary). Reads the two graphs' structure only (no weights, no session)."""
    every = onnx.load(str(folder / ALL_LOGITS_ONNX), load_external_data=False)
    last_position_head(every)
    last = onnx.load(str(folder / MODEL_ONNX), load_external_data=False)
    if every.SerializeToString(deterministic=True) != last.SerializeToString(deterministic=True):
        raise ExportValidationError(f"{MODEL_ONNX} is not {ALL_LOGITS_ONNX} with its last-position head: the two "
                                    "graphs were written apart or edited")
    dims = {v.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]
            for v in [*last.graph.input, *last.graph.output]}
    problems = signature_problems(shape, dims, dims)
    decoder = json.loads((folder / GENAI_CONFIG).read_text())["model"]["decoder"]
    declared = {"num_hidden_layers": shape.layers, "head_size": shape.head_dim,
                "num_key_value_heads": shape.kv_heads, "num_attention_heads": shape.heads}
    problems += [f"{GENAI_CONFIG} {k} {decoder.get(k)} but the model has {v}" for k, v in declared.items()
                 if decoder.get(k) != v]
    names = [*decoder["inputs"].values(), *decoder["outputs"].values()]
    problems += [f"{GENAI_CONFIG} names {n!r}, which the graph lacks" for n in names
                 if (n % 0 if "%d" in n else n) not in dims]
    if problems:
        raise ExportValidationError(f"the graph does not match its configs: {'; '.join(problems[:3])}")
    return {"identical_but_head": True, "nodes": len(last.graph.node), "layers": shape.layers}


def last_rows(sess, shape: DecoderShape, lengths: tuple[int, ...] = (7, 3, 5)) -> list[tuple]:
    """What model.onnx must give for prompts of random tokens of ``lengths`` and one token after each:
    (ids (n + 1,), logits at the prompt's last position, logits of the token after), from ``sess``, a session of
    model_all_logits.onnx (every position's logits; the same weights)."""
    rng = np.random.default_rng(13)
    rows = []
    for n in lengths:
        ids = rng.integers(0, shape.vocab_size, (1, n + 1))
        a = run_decoder(sess, ids[:, :n], np.ones((1, n), np.int64), None, empty_past(shape, 1))
        after = run_decoder(sess, ids[:, n:], np.ones((1, n + 1), np.int64), None, a[1:])[0]
        rows.append((ids[0], a[0][0, -1], after[0, -1]))
    return rows


def runtime_last_position(folder: Path, rows: list[tuple], tolerance: float = 1e-5) -> dict:
    """model.onnx as onnxruntime-genai runs it (``og.Model``: its genai_config, its own inputs and cache) against
    ``rows`` (``last_rows``): each prompt's logits and the next token's, to ``tolerance``. A streamed export runs it
    on its cut (``cut_parity``), whose session costs little, where the whole graph's would hold 6.4 GB at 8B."""
    model, worst = og.Model(str(folder)), 0.0
    for ids, prompt, after in rows:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + 1)
        gen = og.Generator(model, params)
        for part, want in ((ids[:-1], prompt), (ids[-1:], after)):
            gen.append_tokens(part.astype(np.int32))
            got = gen.get_logits().reshape(-1)
            worst = max(worst, float(np.abs(got - want).max()) if got.shape == want.shape else float("inf"))
    if worst > tolerance:
        raise ExportValidationError(f"onnxruntime-genai's logits from {MODEL_ONNX} differ from {ALL_LOGITS_ONNX}'s "
                                    f"by {worst:.3g} (tolerance {tolerance:g})")
    return {"max_abs_diff": worst, "tolerance": tolerance, "prompts": len(rows), "runtime": "onnxruntime-genai"}
