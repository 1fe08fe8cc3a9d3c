"""The timing process of ``bdlora bench --runtime genai`` and ``llamacpp``: ``python -m bdlora.bench.genai_worker
SPEC OUT``.

Loads every folder with ``og.Model`` and every GGUF file in llama.cpp (llama-cpp-python, ``n_threads`` as the genai
folders' intra-op threads, its weights repacked as llama.cpp does by default except where that crashed,
``export.gguf.llamacpp.repacks``) and times, per shape, interleaved round-robin (the order rotating every repeat,
each job after a pause that lets the previous model's threads park, see ``SETTLE_S``): prefill = ``append_tokens``
of a (batch, seq) prompt into a fresh generator (llama.cpp: ``eval`` of the prompt into an emptied context);
decode = after a prompt of ``seq`` tokens, ``decode_tokens`` greedy steps (``generate_next_token``; llama.cpp: the
argmax of the last logits, then ``eval`` of that token), reported per token. Only the timed calls are inside the
clock (generator construction and the decode prompt are not). A GGUF row is timed at batch 1 only (llama.cpp's
binding decodes one sequence). Needs onnxruntime-genai and numpy (and llama-cpp-python for GGUF files).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from bdlora.bench.specs import GenaiTiming

# Every og.Model has its own onnxruntime thread pool, whose threads spin for a while after each run. Timed right
# after another model, a job shares the 2 cores with that model's spinning threads: measured on the builtin student
# (decode ~0.15 ms/token), 4 models interleaved back to back gave 0.42 ms/token (p10-p90 0.26-0.63) for a dense model
# that decodes at 0.14 alone; a 50 ms pause before each timed job gave 0.18 (0.14-0.27). 10 ms was not enough.
SETTLE_S = 0.05


def _clocked(phase: str, steps: int, fresh, feed, step):
    """One timed job: ``fresh()`` starts an empty sequence (outside the clock), ``feed(state)`` appends the prompt,
    ``step(state)`` decodes one token. Prefill times ``feed`` alone; decode times ``steps`` steps after it, per token
    (the prompt outside the clock)."""

    def run() -> float:
        state = fresh()
        if phase == "prefill":
            t0 = time.perf_counter()
            feed(state)
            return (time.perf_counter() - t0) * 1e3
        feed(state)
        t0 = time.perf_counter()
        for _ in range(steps):
            step(state)
        return (time.perf_counter() - t0) * 1e3 / steps

    return run


def _job(og, model, phase: str, batch: int, seq: int, steps: int, ids):
    def fresh():
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=seq + (steps if phase == "decode" else 0) + 1, batch_size=batch,
                                  do_sample=False, min_length=0)
        return og.Generator(model, params)

    return _clocked(phase, steps, fresh, lambda gen: gen.append_tokens(ids), lambda gen: gen.generate_next_token())


def _gguf_job(llm, phase: str, steps: int, ids):
    tokens = [int(t) for t in ids[0]]

    def fresh():
        llm.reset()
        return llm

    return _clocked(phase, steps, fresh, lambda m: m.eval(tokens),
                    lambda m: m.eval([int(np.argmax(m.scores[m.n_tokens - 1]))]))


def gguf_models(spec: GenaiTiming) -> dict:
    """Every GGUF file of ``spec`` in llama.cpp, its context long enough for the longest shape's prompt and steps."""
    if not spec.gguf:
        return {}
    from bdlora.export.gguf.llamacpp import LlamaCpp, repacks

    context = max(s for _, _, s in spec.shapes) + spec.decode_tokens + 8
    repack = repacks()
    return {k: LlamaCpp().load(Path(v), spec.threads, context, repack=repack, logits_all=False)
            for k, v in spec.gguf.items()}


def main(argv: list[str]) -> int:
    spec = GenaiTiming.read(argv[0])
    og = None
    if spec.folders:
        import onnxruntime_genai as og
    models = {k: og.Model(v) for k, v in spec.folders.items()}
    ggufs = gguf_models(spec)
    rng = np.random.default_rng(0)
    out = []
    for phase, b, s in spec.shapes:
        ids = rng.integers(0, spec.vocab, (b, s)).astype(np.int32)
        jobs = {k: _job(og, m, phase, b, s, spec.decode_tokens, ids) for k, m in models.items()}
        if b == 1:
            jobs.update({k: _gguf_job(m, phase, spec.decode_tokens, ids) for k, m in ggufs.items()})
        names = list(jobs)
        times = {k: [] for k in names}
        for r in range(spec.warmup + spec.repeats):
            order = names[r % len(names):] + names[: r % len(names)]
            for k in order:
                time.sleep(SETTLE_S)  # let the previous model's pool stop spinning (see SETTLE_S)
                ms = jobs[k]()
                if r >= spec.warmup:
                    times[k].append(ms)
        out += [{"variant": k, "phase": phase, "batch": b, "seq": s, "ms": v} for k, v in times.items()]
        print(f"genai {phase} {b}x{s}", file=sys.stderr, flush=True)
    versions = {"og": og.__version__} if og is not None else {}
    if ggufs:
        import llama_cpp

        versions["llama_cpp_python"] = llama_cpp.__version__
    for m in ggufs.values():
        m.close()
    with open(argv[1], "w") as f:
        json.dump({"times": out, **versions}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
