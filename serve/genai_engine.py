"""``bdlora serve --runtime genai``: the same engine (queue, worker thread, continuous admission, per-sequence
sampling, stop strings, log-probabilities) with the model run by onnxruntime-genai over a ``bdlora export genai``
folder, decoding the running sequences together.

**Cohorts.** Requests admitted in the same iteration form a cohort: one batched ``og.Generator`` whose prompts are
right padded with the folder's pad id (onnxruntime-genai masks a batch's *trailing* pad tokens, and
GroupQueryAttention keeps each row's own past length, so a right-padded row computes exactly what it computes alone:
measured equal to the last bit). Every engine step runs one decode step per cohort, so the weights are read once per
cohort instead of once per sequence; cohorts admitted at different times run side by side (continuous admission).
The engine samples itself: each step it reads the batch's next-token logits (``get_logits``: each row's last real
position), samples every row under its own request's parameters (temperature, top-p, seed, stop strings,
log-probabilities: exactly as on the onnxruntime path), and makes the generator take those tokens by handing it
logits that put all the mass on them (``set_logits`` + a greedy ``generate_next_token``).

What onnxruntime-genai cannot do on CPU, measured with 0.18: its own continuous-batching engine (``og.Engine``)
needs ``engine.dynamic_batching``, i.e. PagedAttention, which its builder emits only for CUDA/WebGPU fp16; the
static ``og.Engine`` that runs our folders batches at most 4 requests, starts a batch only when the previous one has
drained, refuses per-request seeds and stop strings, and reports tokens but no logits (no logprobs or echo). A
batched generator cannot drop a row either: a row that finishes early stays in its cohort (fed the pad token, its
output ignored) until the cohort's last row finishes, and its slot counts as free for admission at once.

onnxruntime-genai drops a prompt's *trailing* pad tokens, alone as in a batch (measured: a prompt ending with the pad
id, which is the end-of-text id of most models, continues exactly as the prompt without it), and it ends a row whose
fed token is end-of-text, so such a token cannot be fed as a decode step either. Such a prompt is refused with a
clear error (``refuse``) rather than answered for a different prompt; ``--runtime ort`` serves it.
"""

from __future__ import annotations

import json
import queue
import time

import numpy as np

from bdlora.base.memory import release_freed_memory
from bdlora.base.runs import all_logits_graph
from bdlora.base.threads import ThreadPool
from bdlora.serve.engine import Engine
from bdlora.serve.fair import reserved_slots
from bdlora.serve.sequence import Request, Sequence
from bdlora.speculative.decoders import GenaiDecoder

_FORCE_OFF = np.float32(-1e30)  # the logit of every token but the one a row must take
GATHER_QUIET = 0.002  # seconds: an idle engine's first request waits this long for each next one (``_gather``)
GATHER_MAX = 0.010  # seconds: and this long at most


def trailing_pad(pad: int | None, prompt_ids: list[int]) -> str | None:
    """Why onnxruntime-genai cannot continue this prompt exactly (None: it can)."""
    if pad is not None and prompt_ids and prompt_ids[-1] == pad:
        return (f"ends with token id {pad}, the model's pad id, which onnxruntime-genai strips from a prompt's end "
                f"(it would continue a different prompt); serve with --runtime ort to send it")
    return None




class _Cohort:
    """One batched generator and its rows (fixed order; a finished row keeps its place)."""

    def __init__(self, gen, rows: list[int], width: int, vocab: int, max_length: int = 0):
        self.gen = gen
        self.max_length = max_length  # positions the generator holds
        self.rows = rows  # indices into the admitted requests, until ``bind`` replaces them by sequences
        self.seqs: list[Sequence] = []
        self.width = width
        self.forced = np.full((len(rows), vocab), _FORCE_OFF, dtype=np.float32)
        self.alive: list[bool] = []  # which rows are in the engine's batch, as of the last ``_Cohorts._refresh``

    def any_live(self) -> bool:
        return any(s.finish is None and not s.req.cancelled.is_set() for s in self.seqs)


class _Cohorts:
    """The running cohorts; ``seqs`` are the live sequences in cohort order (what the engine samples)."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.cohorts: list[_Cohort] = []
        self.seqs: list[Sequence] = []

    def merge(self, fresh: list[Sequence], cohorts: list[_Cohort]) -> None:
        for c in cohorts:
            c.seqs = [fresh[i] for i in c.rows]
        self.cohorts += cohorts
        self._refresh()

    def drop_finished(self) -> None:
        had = bool(self.cohorts)
        self.cohorts = [c for c in self.cohorts if c.any_live()]
        self._refresh()
        if had and not self.cohorts:
            release_freed_memory()

    def _refresh(self) -> None:
        """Snapshot which rows are live: a client may cancel at any moment, but the rows a step samples must be
        exactly ``seqs`` as the engine saw them."""
        for c in self.cohorts:
            c.alive = [s.finish is None and not s.req.cancelled.is_set() for s in c.seqs]
        self.seqs = [s for c in self.cohorts for s, alive in zip(c.seqs, c.alive) if alive]


class GenaiEngine(Engine):
    """``Engine`` over an onnxruntime-genai folder (genai_config.json, model.onnx, tokenizer, config.json).

    Admission while cohorts run is deferred, as text-generation-inference defers it (its ``waiting_served_ratio``
    and ``max_waiting_tokens``): a request that arrives alone would start a cohort of one, which costs a whole model
    run per step for one row, so waiting requests join only once they number at least ``waiting_served_ratio``
    times the running sequences, or the oldest has waited ``max_waiting_steps`` decode steps; and while more are
    waiting than slots are free, only once a quarter of ``max_batch`` is free (measured on SmolLM2 with 64
    closed-loop clients: 192 -> 250 tok/s, model runs per step 1.63 -> 1.02). Requests that finish together are
    replaced together, in one cohort. An idle engine admits at once, with the requests sent with it (``_gather``)."""

    def __init__(self, *args, waiting_served_ratio: float = 1.2, max_waiting_steps: int = 20, **kw):
        self.waiting_served_ratio = waiting_served_ratio
        self.max_waiting_steps = max_waiting_steps
        self._waiting_since: int | None = None  # the decode step at which requests were first seen waiting
        super().__init__(*args, **kw)

    def _admit(self, running: int) -> list[Request] | None:
        if running and self._open.is_set():
            waiting = self.waiting
            if not waiting:
                self._waiting_since = None
                return []
            if self._waiting_since is None:
                self._waiting_since = self.steps
            if (waiting < self.waiting_served_ratio * running
                    and self.steps - self._waiting_since < self.max_waiting_steps):
                return []  # keep decoding; admit them together a little later
            if self.max_batch - running < min(waiting, max(1, self.max_batch // 4)):
                return []  # the batch is full but for a slot or two: wait until a quarter of it is free
        self._waiting_since = None
        new = super()._admit(running)
        if new and not running:
            self._gather(new)
        return new

    def _gather(self, new: list[Request]) -> None:
        """An idle engine took a request: requests sent together reach it a few milliseconds apart (each through
        the server), so take those that follow within ``GATHER_QUIET`` of each other (at most ``GATHER_MAX``) into
        the same cohort instead of starting a cohort of one and another of the rest."""
        deadline = time.perf_counter() + GATHER_MAX
        while len(new) < self.max_batch - reserved_slots(self.max_batch) and time.perf_counter() < deadline:
            try:
                r = self._waiting.get(timeout=GATHER_QUIET)
            except queue.Empty:
                return
            if r is None:  # shut down: leave the sentinel for the next ``_admit``
                self._waiting.put(None)
                return
            if not r.cancelled.is_set():
                new.append(r)

    def _open_model(self, onnx_file: str, threads: int | None, verifies: bool = False) -> None:
        import onnxruntime_genai as og

        self.og = og
        # this server's thread count (default: the usable cores) over the folder's session options, so a folder
        # exported on another machine, or without a count (onnxruntime-genai then runs it on ONE thread, measured
        # 1.4-1.6x slower on 2 cores), uses this machine's cores
        self.intra_op_threads = ThreadPool(threads).count
        # the folder's model.onnx computes each row's last position only (what generation reads); proposals are
        # verified on every position's logits (its twin), and a prompt echoed with logprobs is scored on them too
        scoring = all_logits_graph(self.dir)
        self.model = self._load(scoring if verifies else None)
        self._scoring = self.model if verifies or scoring == onnx_file else None  # else loaded on first need
        self.context = int(self.shape.max_positions)
        model_cfg = json.loads((self.dir / "genai_config.json").read_text())["model"]
        self.pad = int(model_cfg.get("pad_token_id", model_cfg.get("eos_token_id", 0)))
        self.vocab = int(self.shape.vocab_size)

    def _load(self, filename: str | None):
        """An og.Model of the folder on this server's threads, its graph ``filename`` if not the folder's own. No CPU
        memory arena: a cohort's KV buffer is sized by its rows and longest generation, so the arena kept every size
        it had seen (measured: RSS +32 MB over six rounds of 50 clients hanging up, vs under 16 MB without it) while
        a decode step costs the same (0.163 vs 0.160 ms builtin, 24.0 vs 23.0 ms SmolLM2)."""
        config = self.og.Config(str(self.dir))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": self.intra_op_threads, "enable_cpu_mem_arena": False},
            **({"filename": filename} if filename else {})}}}))
        return self.og.Model(config)

    @property
    def scoring_model(self):
        """The model over every position's logits (a prompt echoed with logprobs), loaded on first use."""
        if self._scoring is None:
            self._scoring = self._load(all_logits_graph(self.dir))
        return self._scoring

    def _new_batch(self) -> _Cohorts:
        return _Cohorts()

    def _stop_ids(self) -> list[int]:
        """End-of-text and the pad id: onnxruntime-genai drops a trailing pad token from what it is fed."""
        return [t for t in (self.eos, self.pad) if t is not None]

    def _speculates(self, batch: _Cohorts) -> bool:
        """Only a cohort of one running alone: a batched generator cannot take a different number of tokens per
        row."""
        return (self.speculation is not None and len(batch.seqs) == 1 and len(batch.cohorts) == 1
                and len(batch.cohorts[0].seqs) == 1)

    def _target_view(self, batch: _Cohorts, s: Sequence):
        c = batch.cohorts[0]
        return GenaiDecoder(self.og, self.model, c.max_length, generator=c.gen, length=s.pos), c.max_length

    def _store_view(self, batch: _Cohorts, view) -> None:
        time.sleep(0)  # hand the GIL to the event loop (see ``_step``)

    def refuse(self, prompt_ids: list[int]) -> str | None:
        return trailing_pad(self.pad, prompt_ids)

    def _groups(self, reqs: list[Request]) -> list[list[int]]:
        """Admitted requests split into cohorts: each cohort's padded prompt plus its longest generation fits the
        context (the generator's one KV buffer)."""
        groups: list[list[int]] = []
        current: list[int] = []
        width = longest = 0
        for i, r in enumerate(reqs):
            n, new = len(r.prompt_ids), max(1, r.params.max_tokens)
            if current and max(width, n) + max(longest, new) + 1 > self.context:
                groups.append(current)
                current, width, longest = [], 0, 0
            current.append(i)
            width, longest = max(width, n), max(longest, new)
        if current:
            groups.append(current)
        return groups

    def _prefill(self, reqs: list[Request]):
        """Prefill each cohort in one generator call: (cohorts, per-request logits rows: the prompt's own positions
        when the request echoes with logprobs, else its next-token logits as a (1, V) row)."""
        cohorts, rows = [], [None] * len(reqs)
        for group in self._groups(reqs):
            prompts = [reqs[i].prompt_ids for i in group]
            width = max(len(p) for p in prompts)
            ids = np.full((len(group), width), self.pad, dtype=np.int32)
            for j, p in enumerate(prompts):
                ids[j, : len(p)] = p
            longest = max(max(1, reqs[i].params.max_tokens) for i in group)
            echoes = any(reqs[i].params.echo and reqs[i].params.logprobs is not None for i in group)
            model = self.scoring_model if echoes else self.model  # a prompt scored: every position's logits
            params = self.og.GeneratorParams(model)
            max_length = min(self.context, width + longest + 1)
            params.set_search_options(max_length=max_length, do_sample=False, batch_size=len(group))
            gen = self.og.Generator(model, params)
            gen.append_tokens(ids)
            self.runs += 1
            last = np.asarray(gen.get_logits())[:, -1]  # each row's last real position
            full = None
            for j, i in enumerate(group):
                p = reqs[i].params
                if p.echo and p.logprobs is not None:
                    if full is None:
                        full = np.asarray(gen.get_output("logits"))
                    rows[i] = full[j, : len(prompts[j])]
                else:
                    rows[i] = last[j : j + 1]
            cohorts.append(_Cohort(gen, group, width, self.vocab, max_length))
            time.sleep(0)  # hand the GIL to the event loop between generator calls (see ``_step``)
        return cohorts, rows

    def _step(self, batch: _Cohorts) -> np.ndarray:
        """One decode step of every cohort: each row takes its sampled token (finished rows the pad id), the model
        runs once per cohort; (live sequences, V) next-token logits in ``batch.seqs`` order."""
        out = []
        for c in batch.cohorts:
            live = c.alive
            tokens = [s.next_token if alive else self.pad for s, alive in zip(c.seqs, live)]
            rows = np.arange(len(tokens))
            c.forced[rows, tokens] = 0.0
            c.gen.set_logits(c.forced)
            c.forced[rows, tokens] = _FORCE_OFF
            c.gen.generate_next_token()
            logits = np.asarray(c.gen.get_logits())[:, -1]
            self.runs += 1
            out.append(logits[np.flatnonzero(live)])
            # onnxruntime-genai's Python calls keep the GIL while the model runs (onnxruntime's release it): hand
            # it over after every call, or the server's event loop (health, streaming, new requests) starves
            # until the whole generation ends
            time.sleep(0)
        return np.concatenate(out) if out else np.zeros((0, self.vocab), dtype=np.float32)
