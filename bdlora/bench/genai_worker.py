"""The genai timing process of ``bdlora bench --runtime genai``: ``python -m bdlora.bench.genai_worker SPEC OUT``.

Loads every folder with ``og.Model`` and times, per shape, interleaved round-robin (the order rotating every
repeat, each job after a pause that lets the previous model's threads park, see ``SETTLE_S``): prefill =
``append_tokens`` of a (batch, seq) prompt into a fresh generator; decode = after a prompt of ``seq`` tokens,
``decode_tokens`` calls of ``generate_next_token``, reported per token. Only the timed calls are
inside the clock (generator construction and the decode prompt are not). Needs onnxruntime-genai and numpy only.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

# Every og.Model has its own onnxruntime thread pool, whose threads spin for a while after each run. Timed right
# after another model, a job shares the 2 cores with that model's spinning threads: measured on the builtin student
# (decode ~0.15 ms/token), 4 models interleaved back to back gave 0.42 ms/token (p10-p90 0.26-0.63) for a dense model
# that decodes at 0.14 alone; a 50 ms pause before each timed job gave 0.18 (0.14-0.27). 10 ms was not enough.
SETTLE_S = 0.05


def _job(og, model, phase: str, batch: int, seq: int, steps: int, ids):
    def run() -> float:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=seq + (steps if phase == "decode" else 0) + 1, batch_size=batch,
                                  do_sample=False, min_length=0)
        gen = og.Generator(model, params)
        if phase == "prefill":
            t0 = time.perf_counter()
            gen.append_tokens(ids)
            return (time.perf_counter() - t0) * 1e3
        gen.append_tokens(ids)
        t0 = time.perf_counter()
        for _ in range(steps):
            gen.generate_next_token()
        return (time.perf_counter() - t0) * 1e3 / steps

    return run


def main(argv: list[str]) -> int:
    import onnxruntime_genai as og

    spec = json.loads(open(argv[0]).read())
    models = {k: og.Model(v) for k, v in spec["folders"].items()}
    rng = np.random.default_rng(0)
    out = []
    for phase, b, s in spec["shapes"]:
        ids = rng.integers(0, spec["vocab"], (b, s)).astype(np.int32)
        jobs = {k: _job(og, m, phase, b, s, spec["decode_tokens"], ids) for k, m in models.items()}
        names = list(jobs)
        times = {k: [] for k in names}
        for r in range(spec["warmup"] + spec["repeats"]):
            order = names[r % len(names):] + names[: r % len(names)]
            for k in order:
                time.sleep(SETTLE_S)  # let the previous model's pool stop spinning (see SETTLE_S)
                ms = jobs[k]()
                if r >= spec["warmup"]:
                    times[k].append(ms)
        out += [{"variant": k, "phase": phase, "batch": b, "seq": s, "ms": v} for k, v in times.items()]
        print(f"genai {phase} {b}x{s}", file=sys.stderr, flush=True)
    with open(argv[1], "w") as f:
        json.dump({"times": out, "og": og.__version__}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
