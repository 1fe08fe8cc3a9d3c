"""The generation engine behind ``bdlora serve``: one onnxruntime session, one worker thread, continuous batching.

The event loop never runs inference: requests are queued to a worker thread that owns the session and the batch
KV cache. Every iteration the worker (1) admits waiting requests up to ``max_batch`` active sequences, prefilling
them together (left padded) and merging their caches into the batch cache (both sides left padded to a common
length, the attention mask marking padding), then (2) runs one decode step for every active sequence. Each sequence
carries its own position ids, sampling parameters and random generator, so batching never changes a request's
output: at temperature 0 the text equals the model's own greedy generation. A finished or cancelled sequence
(client gone) leaves the batch at the next step, freeing its slot; padding columns no row needs are trimmed.

Results flow back through a per-request callback (the server posts them to the request's asyncio queue with
``loop.call_soon_threadsafe``). A failure while sampling or emitting fails only its sequence; a failed step fails
its batch and the engine goes on; if the worker itself dies, every waiting request is answered and ``on_fatal`` is
called (the server then exits non-zero so a supervisor restarts it).

numpy, onnxruntime and tokenizers only: the serving process never loads torch.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bdlora.base.runs import MODEL_ONNX
from bdlora.models.runtime import DecoderShape, check_signature, empty_past, left_padded, run_bound, session
from bdlora.models.tokenizer import TextTokenizer
from bdlora.serve.fair import FairQueue, reserved_for, reserved_slots
from bdlora.serve.interface import ServingEngine
from bdlora.serve.sequence import Request, Sequence, safe_emit, score_prompt
from bdlora.serve.speculation import EngineSpeculation
from bdlora.speculative.config import SpeculationConfig
from bdlora.speculative.decoders import OrtDecoder


class Engine(ServingEngine):
    """Owns the ONNX session and the worker thread. ``submit`` is thread-safe and never blocks on inference."""

    def __init__(self, onnx_dir: str | Path, onnx_file: str = MODEL_ONNX, max_batch: int = 16,
                 threads: int | None = None, on_fatal: Callable[[str], None] | None = None,
                 speculation: SpeculationConfig | None = None):
        self.dir = Path(onnx_dir)
        self.shape = DecoderShape.from_folder(self.dir)
        self.tokenizer = TextTokenizer(self.dir)
        self.tokenizer.max_token_bytes()  # measured once here, not in the first request
        self._open_model(onnx_file, threads, speculation is not None and speculation.enabled)
        self.max_batch = max_batch
        self.max_positions = self.shape.max_positions
        self.eos = self.tokenizer.eos_token_id
        self._waiting = FairQueue()  # round robin between requests: a 64-prompt request cannot hold the others back
        self._stop = threading.Event()
        self._open = threading.Event()  # cleared by ``held()``: admission waits
        self._open.set()
        self._thread = threading.Thread(target=self._loop, name="bdlora-engine", daemon=True)
        self.active = 0  # sequences in the batch (read by /metrics)
        self.steps = 0  # decode steps run
        self.decode_rows = 0  # sum of batch sizes over decode steps (mean batch = decode_rows / steps)
        self.runs = 0  # executions of the model (prefills and decode steps): one per step here, one per cohort
        # and step under onnxruntime-genai (``GenaiEngine``), one per sequence if nothing were batched
        self.error: str | None = None  # set when the worker died: the engine cannot serve any more
        self.on_fatal = on_fatal  # called (from the worker thread) with that error, e.g. to stop the server
        self.failed = 0  # sequences that failed alone (their request got an error; the engine went on)
        self._live: list[Sequence] = []  # the running batch
        self._admitted: list[Request] = []  # taken from the queue, not yet in the batch
        self.speculation = None  # --draft / --prompt-lookup: a sequence running alone is continued speculatively
        if speculation is not None and speculation.enabled:
            self.speculation = EngineSpeculation(speculation, threads, self._stop_ids(), self.eos)
        self._thread.start()

    # --------------------------------------------------------------------------------------------------------------

    def _accept(self, req: Request) -> None:  # the onnxruntime graph continues any prompt (no ``refuse``)
        self._waiting.put(req)

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._open.set()
        self._waiting.put(None)
        self._thread.join(timeout)

    @contextlib.contextmanager
    def held(self):
        """Hold admission: requests submitted inside the block queue up and, on leaving it, are admitted (and
        prefilled and decoded) together, up to ``max_batch``. Makes batching observable without depending on how
        fast requests happen to arrive (the tests use it); sequences already running keep decoding."""
        self._open.clear()
        try:
            yield self
        finally:
            self._open.set()

    @property
    def waiting(self) -> int:
        return self._waiting.qsize()

    @property
    def tracked(self) -> int:
        """Requests the engine still holds anything for (running, admitted, queued): 0 once idle, else a leak."""
        return len(self._live) + len(self._admitted) + self._waiting.qsize()

    # --------------------------------------------------------------------------------------------------------------

    # The model hooks (onnxruntime here; ``GenaiEngine`` runs onnxruntime-genai): open the model, prefill new
    # requests, merge them into the batch, run one decode step.

    def _open_model(self, onnx_file: str, threads: int | None, verifies: bool = False) -> None:
        """Open the served graph; ``verifies``: it will score proposed tokens (every position's logits)."""
        self.sess = session(self.dir / onnx_file, threads=threads)
        check_signature(self.dir, self.shape, self.sess)

    def _stop_ids(self) -> list[int]:
        """Tokens never fed to the model in a speculative round (end-of-text)."""
        return [self.eos] if self.eos is not None else []

    def _speculates(self, batch) -> bool:
        """Whether this step is a speculative round: a proposer, and one sequence running alone."""
        return self.speculation is not None and len(batch.seqs) == 1

    def _target_view(self, batch, s: Sequence):
        """(a decoder over ``s``'s cache in the batch of one, the positions it may reach)."""
        view = OrtDecoder(self.sess, self.shape, state=(batch.cache, batch.mask, s.pos))
        return view, min(self.max_positions, len(s.req.prompt_ids) + s.req.params.max_tokens + 1)

    def _store_view(self, batch, view) -> None:
        batch.cache, batch.mask = view.past, view.mask

    def _new_batch(self) -> _Batch:
        return _Batch()

    def _run(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray, past: list):
        """One call of the graph with IO binding (``runtime.run_bound``): the KV cache stays in onnxruntime's memory
        between steps and is copied out only when the batch changes shape. (B, S, V) logits, presents."""
        return run_bound(self.sess, ids, mask, pos, past)

    def _prefill(self, reqs: list[Request]):
        """Left-padded prefill of new requests: (batch state (presents, mask), per-request logits of its own
        positions (T_i, V))."""
        ids, mask, pos = left_padded([r.prompt_ids for r in reqs])
        logits, presents = self._run(ids, mask, pos, empty_past(self.shape, len(reqs)))
        self.runs += 1
        width = logits.shape[1]
        return (presents, mask), [logits[i, width - len(r.prompt_ids):] for i, r in enumerate(reqs)]

    def _step(self, batch: _Batch) -> np.ndarray:
        """One decode step of every sequence: (B, V) logits of their next token."""
        seqs = batch.seqs
        ids = np.array([[s.next_token] for s in seqs], dtype=np.int64)
        pos = np.array([[s.pos] for s in seqs], dtype=np.int64)
        mask = np.concatenate([batch.mask, np.ones((len(seqs), 1), dtype=np.int64)], 1)
        logits, batch.cache = self._run(ids, mask, pos, batch.cache)
        self.runs += 1
        batch.mask = mask
        return logits[:, -1]

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001  never leave clients waiting on a dead worker
            self.error = f"{type(e).__name__}: {e}"
            for r in [seq.req for seq in self._live] + self._admitted:
                safe_emit(r, "error", self.error)
            while True:
                try:
                    r = self._waiting.get_nowait()
                except queue.Empty:
                    break
                if r is not None:
                    safe_emit(r, "error", self.error)
            if self.on_fatal is not None:
                self.on_fatal(self.error)

    def _advance(self, seqs: list[Sequence], logits: np.ndarray) -> None:
        """Sample and record one token per sequence. A failure (bad logits, a sampler or callback error) fails that
        sequence alone: its request gets an error event and the others go on."""
        for s, row in zip(seqs, logits):
            if s.req.cancelled.is_set() or s.finish is not None:
                continue
            try:
                s.accept(s.sample(row), row)
            except Exception as e:  # noqa: BLE001
                s.finish = "error"
                self.failed += 1
                safe_emit(s.req, "error", f"{type(e).__name__}: {e}")

    def _serve(self) -> None:
        batch = self._new_batch()
        while not self._stop.is_set():
            new = self._admit(len(batch.seqs))  # blocks only when nothing is running
            if new is None:
                return
            if new:
                self._start(new, batch)
            batch.drop_finished()
            self.active = len(batch.seqs)
            self._live = batch.seqs
            if batch.seqs:
                if self._speculates(batch):
                    self._speculate(batch)
                else:
                    self._decode(batch)
        self.active = 0

    def _admit(self, running: int) -> list[Request] | None:
        """Waiting requests up to ``max_batch`` sequences in all; None when the engine is shut down. While
        ``held()``, nothing is admitted beside a running batch, and an idle engine waits with the first request."""
        new: list[Request] = []
        self._admitted = new
        reserve = reserved_slots(self.max_batch)
        while running + len(new) < self.max_batch:
            if running and not self._open.is_set():
                break
            free = self.max_batch - running - len(new)
            try:
                r = self._waiting.get(block=not running and not new, timeout=None,
                                      eligible=None if free > reserve else
                                      reserved_for([s.req for s in self._live] + new))
            except queue.Empty:
                break
            self._open.wait()  # held(): this request waits, and those submitted meanwhile join it
            if r is None:
                return None
            if not r.cancelled.is_set():
                new.append(r)
        return new

    def _start(self, new: list[Request], batch: _Batch) -> None:
        """Prefill new requests together and merge them into the running batch (a failed prefill fails them)."""
        try:
            state, rows = self._prefill(new)
        except Exception as e:  # noqa: BLE001  a request the graph cannot run fails alone
            for r in new:
                safe_emit(r, "error", f"{type(e).__name__}: {e}")
            return
        fresh = [Sequence(r, self.tokenizer, self.eos) for r in new]
        for i, s in enumerate(fresh):
            p = s.req.params
            try:
                if p.echo and p.logprobs is not None:  # rows[i]: the logits of the prompt's own positions
                    s.prompt_scores = score_prompt(rows[i], s.req.prompt_ids, p.logprobs)
                if p.max_tokens == 0:  # scoring only
                    s.close("length")
            except Exception as e:  # noqa: BLE001  fails this request alone
                s.finish = "error"
                self.failed += 1
                safe_emit(s.req, "error", f"{type(e).__name__}: {e}")
        self._advance(fresh, np.stack([r[-1] for r in rows]))
        batch.merge(fresh, state)

    def _decode(self, batch: _Batch) -> None:
        """One decode step for every sequence of the batch."""
        seqs = batch.seqs
        try:
            logits = self._step(batch)
        except Exception as e:  # noqa: BLE001  the batch's step failed: fail its sequences, keep serving
            for s in seqs:
                safe_emit(s.req, "error", f"{type(e).__name__}: {e}")
            self.failed += len(seqs)
            batch.clear()
            return
        self.steps += 1
        self.decode_rows += len(seqs)
        for s in seqs:
            s.pos += 1
        self._advance(seqs, logits)


    def _speculate(self, batch) -> None:
        """One speculative round of the batch's only sequence (``serve.speculation``); its committed tokens are
        taken one by one as decoded tokens are. A failed round fails the sequence, as a failed step does."""
        s = batch.seqs[0]
        try:
            view, limit = self._target_view(batch, s)
            pairs = self.speculation.round(s, view, limit)
        except Exception as e:  # noqa: BLE001  the round failed: fail its sequence, keep serving
            safe_emit(s.req, "error", f"{type(e).__name__}: {e}")
            self.failed += 1
            batch.clear()
            return
        self._store_view(batch, view)
        self.steps += 1
        self.decode_rows += 1
        self.runs += 1
        s.pos = view.length
        for token, row in pairs:
            if s.req.cancelled.is_set() or s.finish is not None:
                break
            try:
                s.accept(token, row)
            except Exception as e:  # noqa: BLE001
                s.finish = "error"
                self.failed += 1
                safe_emit(s.req, "error", f"{type(e).__name__}: {e}")


class _Batch:
    """The running sequences and their KV cache (left padded to one length; the mask marks the padding)."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.seqs: list[Sequence] = []
        self.cache: list = []  # numpy arrays, or onnxruntime values while the batch keeps its shape
        self.mask = np.zeros((0, 0), dtype=np.int64)

    @staticmethod
    def _left_pad(arrs: list[np.ndarray], mask: np.ndarray, length: int):
        extra = length - mask.shape[1]
        if extra <= 0:
            return arrs, mask
        return [np.pad(a, ((0, 0), (0, 0), (extra, 0), (0, 0))) for a in arrs], np.pad(mask, ((0, 0), (extra, 0)))

    @staticmethod
    def _numpy(cache: list) -> list[np.ndarray]:
        return [a if isinstance(a, np.ndarray) else a.numpy() for a in cache]

    def merge(self, fresh: list[Sequence], state) -> None:
        cache, mask = state
        if self.seqs:
            self.cache, cache = self._numpy(self.cache), self._numpy(cache)
            t = max(self.mask.shape[1], mask.shape[1])
            self.cache, self.mask = self._left_pad(self.cache, self.mask, t)
            cache, mask = self._left_pad(cache, mask, t)
            self.cache = [np.concatenate([a, b], 0) for a, b in zip(self.cache, cache)]
            self.mask = np.concatenate([self.mask, mask], 0)
        else:
            self.cache, self.mask = cache, mask
        self.seqs += fresh

    def drop_finished(self) -> None:
        """Finished and cancelled rows leave; padding columns no remaining row needs are trimmed."""
        keep = [i for i, s in enumerate(self.seqs) if s.finish is None and not s.req.cancelled.is_set()]
        if len(keep) == len(self.seqs):
            return
        if not keep:
            self.clear()
            return
        self.seqs = [self.seqs[i] for i in keep]
        self.cache = [a[keep] for a in self._numpy(self.cache)]
        self.mask = self.mask[keep]
        used = np.flatnonzero(self.mask.any(0))
        start = int(used[0]) if used.size else self.mask.shape[1]
        if start:
            self.cache = [a[:, :, start:] for a in self.cache]
            self.mask = self.mask[:, start:]


__all__ = ["Engine", "Request"]
