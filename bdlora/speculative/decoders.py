"""A decoder with a KV cache that can be appended to and rolled back, over either runtime bdlora deploys to: what
speculative decoding needs of the target (score several tokens in one call, forget the rejected ones) and of the
draft model (propose token by token, forget what the target rejected). numpy, onnxruntime and onnxruntime-genai
only (no torch).

- ``OrtDecoder``: a decoder graph in the plain layout (``bdlora export onnx``; explicit position ids) under
  onnxruntime, the cache kept in onnxruntime's memory between calls (IO binding) and cut on rollback.
- ``GenaiDecoder``: one batch-1 ``og.Generator`` over an onnxruntime-genai folder: ``append_tokens`` runs the
  model on several tokens at once, ``get_output("logits")`` returns every appended position (when the folder's
  graph computes them; a graph whose head reads only the last position returns one row), ``rewind_to`` rolls back.

``append`` returns the logits (n, V) of the appended positions (row i predicts the token after ``tokens[i]``), or the
last position's alone (1, V) where the graph computes only that (``all_rows`` False).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bdlora.base.errors import ModelError
from bdlora.base.runs import EXPORT_MARKER, GENAI_CONFIG, MODEL_ONNX, all_logits_graph
from bdlora.base.threads import ThreadPool
from bdlora.models.integrity import TOKENIZER_KEY, tokenizer_digests
from bdlora.models.runtime import DecoderShape, check_onnx_dir, empty_past, run_bound, session


class OrtDecoder:
    """Batch-1 decoding of a plain-layout graph with a rollback-able cache. ``state``: (cache, mask, positions) of a
    sequence already running (the serving engine's batch of one: its mask may start with left-padding columns),
    else an empty cache."""

    def __init__(self, sess, shape: DecoderShape, state=None):
        self.sess, self.shape = sess, shape
        if state is None:
            self.past, self.pad, self.length = empty_past(shape, 1), 0, 0
        else:
            self.past, mask, self.length = state
            self.pad = int(mask.shape[1]) - self.length  # leading padding columns the mask hides
        self.all_rows = True
        self.calls = 0

    @property
    def mask(self) -> np.ndarray:
        m = np.ones((1, self.pad + self.length), dtype=np.int64)
        m[:, : self.pad] = 0
        return m

    def append(self, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        ids = np.asarray([tokens], dtype=np.int64)
        pos = np.arange(self.length, self.length + n, dtype=np.int64)[None]
        mask = np.ones((1, self.pad + self.length + n), dtype=np.int64)
        mask[:, : self.pad] = 0
        logits, self.past = run_bound(self.sess, ids, mask, pos, self.past)
        self.length += n
        self.calls += 1
        return logits[0]

    def rewind(self, length: int) -> None:
        """Forget every position from ``length`` on (a no-op at the current length)."""
        if length >= self.length:
            return
        cut = self.pad + length
        self.past = [np.ascontiguousarray((a if isinstance(a, np.ndarray) else a.numpy())[:, :, :cut])
                     for a in self.past]
        self.length = length

    def state(self):
        """(cache, mask, length): what the serving engine keeps for its batch of one."""
        return self.past, self.mask, self.length


class GenaiDecoder:
    """Batch-1 decoding through one ``og.Generator`` (``generator``: one already running, e.g. the serving engine's
    cohort of one, whose ``length`` tokens it holds; else a new one of ``max_length`` positions)."""

    def __init__(self, og, model, max_length: int, generator=None, length: int = 0, all_rows: bool = True):
        self.og, self.model, self.max_length = og, model, int(max_length)
        if generator is None:
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=self.max_length, do_sample=False, batch_size=1)
            generator = og.Generator(model, params)
        self.gen, self.length, self.all_rows = generator, int(length), all_rows
        self.calls = 0

    def append(self, tokens: list[int]) -> np.ndarray:
        self.gen.append_tokens(np.asarray([tokens], dtype=np.int32))
        self.length += len(tokens)
        self.calls += 1
        if self.all_rows:
            return np.asarray(self.gen.get_output("logits"))[0]
        last = np.asarray(self.gen.get_logits())  # (1, V) or (1, 1, V): the last position's row
        return last.reshape(-1, last.shape[-1])[-1:]

    def rewind(self, length: int) -> None:
        if length < self.length:
            self.gen.rewind_to(int(length))
            self.length = int(length)


def genai_model(og, folder: Path, threads: int | None = None, filename: str | None = None):
    """An ``og.Model`` of ``folder`` on ``threads`` intra-op threads (default: the usable cores) without the CPU
    memory arena (as ``bdlora serve`` runs it), its graph ``filename`` when another than the folder's own."""
    config = og.Config(str(folder))
    decoder: dict = {"session_options": {"intra_op_num_threads": ThreadPool(threads).count,
                                         "enable_cpu_mem_arena": False}}
    if filename:
        decoder["filename"] = filename
    config.overlay(json.dumps({"model": {"decoder": decoder}}))
    return og.Model(config)


def is_genai(folder: Path) -> bool:
    return (Path(folder) / GENAI_CONFIG).is_file()


class DecoderFactory:
    """Opens a folder once (its graph or model loaded, its shape read) and makes fresh batch-1 decoders of it:
    ``bdlora export genai`` folders through onnxruntime-genai, ``bdlora export onnx`` folders through onnxruntime.
    ``all_rows``: whether the graph computes every appended position's logits (the folder's own declaration)."""

    def __init__(self, folder: str | Path, threads: int | None = None, onnx_file: str = MODEL_ONNX,
                 filename: str | None = None):
        self.folder = Path(folder)
        self.shape = DecoderShape.from_folder(self.folder)
        self.runtime = "genai" if is_genai(self.folder) else "ort"
        if self.runtime == "genai":
            import onnxruntime_genai as og

            self.og = og
            self.model = genai_model(og, self.folder, threads, filename)
            decoder = json.loads((self.folder / GENAI_CONFIG).read_text())["model"]["decoder"]
            self.all_rows = not last_row_only(self.folder / (filename or decoder.get("filename", MODEL_ONNX)))
        else:
            self.sess = session(self.folder / onnx_file, threads=ThreadPool(threads).count)
            self.all_rows = True

    @classmethod
    def verifying(cls, folder: str | Path, threads: int | None = None) -> DecoderFactory:
        """A folder opened to verify proposals: a genai folder's graph of every position's logits."""
        return cls(folder, threads, filename=all_logits_graph(folder) if is_genai(Path(folder)) else None)

    def new(self, max_length: int):
        if self.runtime == "genai":
            return GenaiDecoder(self.og, self.model, min(max_length, self.shape.max_positions),
                                all_rows=self.all_rows)
        return OrtDecoder(self.sess, self.shape)


def last_row_only(graph: Path) -> bool:
    """Whether a decoder graph's logits output has one position (its head reads only the last one): read from the
    graph's declared output shape, without its weights."""
    import onnx

    try:
        g = onnx.load(str(graph), load_external_data=False).graph
    except Exception as e:  # noqa: BLE001  protobuf's own errors: one line
        raise ModelError(f"{graph}: does not load as an ONNX graph ({type(e).__name__})") from None
    logits = next((o for o in g.output if o.name == "logits"), None)
    dims = logits.type.tensor_type.shape.dim if logits is not None else []
    return len(dims) == 3 and dims[1].HasField("dim_value") and dims[1].dim_value == 1


def check_draft(target: Path, draft: Path) -> None:
    """One-line refusal (``ModelError``) of a draft folder that cannot propose for ``target``: not a finished export
    (``bdlora export onnx`` or ``genai``), another tokenizer (the same text would be other ids: every proposal would
    be a different token, or a wrong one accepted), or another vocabulary width (the logits rows differ)."""
    draft = Path(draft)
    try:
        check_onnx_dir(draft, MODEL_ONNX, "genai" if is_genai(draft) else "ort")
    except ModelError as e:
        raise ModelError(f"--draft {e}") from None
    mine, theirs = tokenizer_digests(draft), tokenizer_digests(Path(target))
    recorded = json.loads((Path(target) / EXPORT_MARKER).read_text()).get(TOKENIZER_KEY) if (
        Path(target) / EXPORT_MARKER).is_file() else None
    if mine != (recorded or theirs):
        raise ModelError(f"--draft {draft}: its tokenizer differs from {target}'s (a draft proposes token ids, which "
                         "must mean the same text to both; make the draft from this teacher)")
    v_draft, v_target = DecoderShape.from_folder(draft).vocab_size, DecoderShape.from_folder(target).vocab_size
    if v_draft != v_target:
        raise ModelError(f"--draft {draft}: its vocabulary has {v_draft:,} rows, {target}'s {v_target:,} (a draft's "
                         "logits must cover the target's tokens)")
    p_draft, p_target = positions(draft), positions(Path(target))
    if p_draft < p_target:  # a request past the draft's context failed mid-way (HTTP 500 from the server)
        raise ModelError(f"--draft {draft}: holds {p_draft:,} positions, {target} {p_target:,}: a request longer "
                         f"than the draft's context cannot be proposed for (export the draft with --context-length "
                         f"{p_target} or more)")


def positions(folder: Path) -> int:
    """The positions a folder's decoder holds: its config's, and a genai folder's context_length (its KV buffer,
    set by export genai --context-length) when smaller."""
    held = DecoderShape.from_folder(folder).max_positions
    if is_genai(folder):
        ctx = json.loads((folder / GENAI_CONFIG).read_text())["model"].get("context_length")
        held = min(held, ctx) if isinstance(ctx, int) and ctx > 0 else held
    return held


def opened(what: str, folder: Path, make):
    """``make()`` (a ``DecoderFactory``), its runtime's failure to load the folder as one line naming it (a truncated
    weight file made onnxruntime raise a RuntimeError traceback under generate --draft)."""
    try:
        return make()
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001  onnxruntime(-genai)'s own errors: one line either way
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise ModelError(f"{what} {folder}: does not load in its runtime ({type(e).__name__}: {first}); the folder "
                         "is damaged, export it again") from None


def stop_ids_of(factory: DecoderFactory, eos: int | None) -> list[int]:
    """Tokens never fed to a decoder: end-of-text, and under onnxruntime-genai its pad id too (dropped from the end
    of what it is fed)."""
    ids = [eos]
    if factory.runtime == "genai":
        model = json.loads((factory.folder / GENAI_CONFIG).read_text())["model"]
        ids.append(model.get("pad_token_id"))
    return [i for i in ids if i is not None]
