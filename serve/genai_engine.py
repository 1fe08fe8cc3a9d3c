"""``bdlora serve --runtime genai``: the same engine (queue, worker thread, continuous admission, per-sequence
sampling, stop strings, log-probabilities) with the model run by onnxruntime-genai over a ``bdlora export genai``
folder.

Each sequence owns an ``og.Generator`` (batch 1): its KV cache is one buffer of ``prompt + max_tokens`` positions
that GroupQueryAttention updates in place (``past_present_share_buffer``), so nothing is copied between steps and a
sequence joins or leaves the running set without touching the others' caches. The engine samples itself from the
generator's logits (``get_logits``, or the prompt's own positions from ``get_output('logits')`` for echo scoring)
and feeds the chosen token back with ``append_tokens``: temperature, top-p, seeds and log-probabilities behave
exactly as on the onnxruntime path. What this trades away is batching the decode GEMMs across requests: every
sequence runs its own step (on CPU at batch 1, where decode is bound by reading the weights, that is the runtime's
fast path per request; total throughput under many concurrent requests is lower than the onnxruntime engine's).
"""

from __future__ import annotations

import json
import time

import numpy as np

from bdlora.errors import usable_cores
from bdlora.serve.engine import Engine
from bdlora.serve.sequence import Request, Sequence


class _Generators:
    """The running sequences and their generators (same order)."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.seqs: list[Sequence] = []
        self.gens: list = []

    def merge(self, fresh: list[Sequence], gens: list) -> None:
        self.seqs += fresh
        self.gens += gens

    def drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self.seqs) if s.finish is None and not s.req.cancelled.is_set()]
        self.seqs = [self.seqs[i] for i in keep]
        self.gens = [self.gens[i] for i in keep]


class GenaiEngine(Engine):
    """``Engine`` over an onnxruntime-genai folder (genai_config.json, model.onnx, tokenizer, config.json)."""

    def _open_model(self, onnx_file: str, threads: int | None) -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(self.dir))
        # this server's thread count (default: the usable cores) over the folder's session options, so a folder
        # exported on another machine, or without a count (onnxruntime-genai then runs it on ONE thread, measured
        # 1.4-1.6x slower on 2 cores), uses this machine's cores
        self.intra_op_threads = threads or usable_cores()
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": self.intra_op_threads}}}}))
        self.model = og.Model(config)
        self.context = int(self.shape.max_positions)

    def _new_batch(self) -> _Generators:
        return _Generators()

    def _prefill(self, reqs: list[Request]):
        gens, rows = [], []
        for r in reqs:
            params = self.og.GeneratorParams(self.model)
            length = min(self.context, len(r.prompt_ids) + max(1, r.params.max_tokens) + 1)
            params.set_search_options(max_length=length, do_sample=False)
            gen = self.og.Generator(self.model, params)
            gen.append_tokens(np.asarray([r.prompt_ids], dtype=np.int32))
            full = r.params.echo and r.params.logprobs is not None
            rows.append(np.asarray(gen.get_output("logits"))[0] if full else np.asarray(gen.get_logits())[0])
            gens.append(gen)
        return gens, rows

    def _step(self, batch: _Generators) -> np.ndarray:
        out = []
        for s, gen in zip(batch.seqs, batch.gens):
            gen.append_tokens(np.asarray([[s.next_token]], dtype=np.int32))
            out.append(np.asarray(gen.get_logits())[0, -1])
            # onnxruntime-genai's Python calls keep the GIL while the model runs (onnxruntime's release it): hand
            # it over after every step, or the server's event loop (health, streaming, new requests) starves
            # until the whole generation ends
            time.sleep(0)
        return np.stack(out)
