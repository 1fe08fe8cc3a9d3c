"""Timing worker of ``bdlora bench``, run as its own process (``python -m bdlora.bench.worker SPEC OUT``).

Why a process: onnxruntime's global thread pool (one pool shared by every session, spinning allowed) is the only
way to time several sessions in one process without their per-session pools stealing cores from each other, but
it is process-wide: once set, every later session of that process must opt out of per-session threads. Running the
timing here keeps that setting away from the caller. Only numpy and onnxruntime are imported (``bdlora`` and
``bdlora.bench``, which Python runs first, import nothing heavy: a test checks that torch never loads).

SPEC: a ``bench.specs.OrtTiming`` as JSON (the graphs by variant, "modules" or "model", the shapes, repeats, threads,
provider, optimisation level, decode tokens and the model's dimensions).
OUT (JSON): {"pool": description, "times": [{"variant", "phase", "batch", "seq", "ms": [...]}, ...]}
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from bdlora.bench.specs import OrtTiming
from bdlora.models.runtime import DecoderSignature, run_bound, session_options


def time_interleaved(jobs: dict, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Run each job once per round, rotating the order every round; returns ms per job after warm-up."""
    names = list(jobs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t = time.perf_counter()
            jobs[n]()
            dt = (time.perf_counter() - t) * 1000
            if r >= warmup:
                times[n].append(dt)
    return times


def _sessions(spec: OrtTiming) -> tuple[dict, str]:
    import onnxruntime as ort

    threads = int(spec.threads)
    ort.set_global_thread_pool_sizes(threads, 1)
    levels = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    sessions = {}
    for name, path in spec.graphs.items():
        so = session_options(ort)
        so.use_per_session_threads = False  # all sessions share the one global pool
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = levels[spec.opt_level]
        sessions[name] = ort.InferenceSession(path, so, providers=[spec.provider])
    return sessions, f"one global onnxruntime thread pool of {threads} intra-op threads (separate timing process)"


def time_modules(spec: OrtTiming, sessions: dict) -> list[dict]:
    d = spec.dims
    rng = np.random.default_rng(0)
    out = []
    widths = {"x_a": d["hidden"], "x_m": d["hidden"], "x_o": d["q_dim"], "x_d": d["intermediate"]}
    for phase, b, s in spec.shapes:
        n = b * s
        x = {k: rng.standard_normal((n, w), dtype=np.float32) for k, w in widths.items()}
        jobs = {name: _bound_run(sess, stack_feeds(sess, x)) for name, sess in sessions.items()}
        times = time_interleaved(jobs, spec.repeats, spec.warmup)
        out += [{"variant": k, "phase": phase, "batch": b, "seq": s, "ms": v} for k, v in times.items()]
        _progress(f"modules {phase} {b}x{s}")
    return out


def stack_feeds(sess, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each input ``x_d.3`` of a projection stack ``sess`` fed from ``x["x_d"]`` at the width its graph declares: a
    student whose MLP keeps fewer channels (or attention fewer groups) reads a narrower hidden state in those
    layers than the dense stack it is timed beside (the leading columns of the same draw)."""
    feeds = {}
    for i in sess.get_inputs():
        base = x[i.name.split(".", 1)[0]]
        feeds[i.name] = np.ascontiguousarray(base[:, :declared_width(i.shape, base.shape[1])])
    return feeds


def declared_width(shape: list, default: int) -> int:
    """Dimension 1 of a graph input's declared ``shape`` (a width or a head count), or ``default`` where the graph
    leaves it symbolic."""
    return shape[1] if isinstance(shape[1], int) else default


def _bound_run(sess, feeds: dict):
    """A zero-argument run with inputs and preallocated outputs bound once (IO binding), as a server would run
    a fixed shape: the timing then holds the graph's work, not per-call output allocation for its many outputs."""
    binding = sess.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    outs = []
    for meta, ref in zip(sess.get_outputs(), sess.run(None, feeds)):
        buf = np.empty_like(ref)
        binding.bind_output(meta.name, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
        outs.append(buf)

    def run(sess=sess, binding=binding, outs=outs):  # ``outs`` keeps the bound buffers alive
        sess.run_with_iobinding(binding)

    return run


def cache_heads(sess, names: list[str], default: int) -> list[int]:
    """The key/value heads of each cache input of ``sess`` as its graph declares them (a student whose attention
    keeps fewer groups caches fewer heads in those layers than the dense model it is timed beside)."""
    dims = {i.name: i.shape for i in sess.get_inputs()}
    return [declared_width(dims[n], default) if n in dims else default for n in names]


def time_model(spec: OrtTiming, sessions: dict) -> list[dict]:
    d = spec.dims
    layers, kv, hd, vocab = d["layers"], d["kv_heads"], d["head_dim"], d["vocab"]
    names = DecoderSignature(layers).cache_inputs
    heads = {n: cache_heads(sess, names, kv) for n, sess in sessions.items()}
    steps = int(spec.decode_tokens)
    rng = np.random.default_rng(0)
    out = []
    for phase, b, s in spec.shapes:
        if phase == "prefill":
            sig = DecoderSignature(layers)
            feeds = {sig.INPUT_IDS: rng.integers(0, vocab, (b, s), dtype=np.int64),
                     sig.ATTENTION_MASK: np.ones((b, s), np.int64),
                     sig.POSITION_IDS: np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy()}
            jobs = {n: _bound_run(sess, {**feeds, **{c: np.zeros((b, h, 0, hd), np.float32)
                                                     for c, h in zip(sig.cache_inputs, heads[n])}})
                    for n, sess in sessions.items()}
            times = time_interleaved(jobs, spec.repeats, spec.warmup)
        else:  # decode ``steps`` tokens after a cache of ``s`` tokens, feeding each step's cache back
            full = [rng.standard_normal((b, kv, s, hd), dtype=np.float32) for _ in range(2 * layers)]
            pasts = {n: [p if p.shape[1] == h else p[:, :h].copy() for p, h in zip(full, heads[n])] for n in sessions}

            def decode(sess, name, b=b, s=s, pasts=pasts):
                # as serve and greedy generation run it: presents stay onnxruntime values bound as the next past
                cache, tok = pasts[name], np.zeros((b, 1), np.int64)
                for t in range(steps):
                    logits, cache = run_bound(sess, tok, np.ones((b, s + t + 1), np.int64),
                                              np.full((b, 1), s + t, np.int64), cache)
                    tok = logits[:, -1].argmax(-1)[:, None].astype(np.int64)

            jobs = {n: (lambda sess=sess, n=n: decode(sess, n)) for n, sess in sessions.items()}
            times = time_interleaved(jobs, max(1, spec.repeats // 2), min(spec.warmup, 1))
            times = {k: [t / steps for t in v] for k, v in times.items()}  # ms per generated token
        out += [{"variant": k, "phase": phase, "batch": b, "seq": s, "ms": v} for k, v in times.items()]
        _progress(f"model {phase} {b}x{s}")
    return out


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    spec = OrtTiming.read(argv[0])
    sessions, pool = _sessions(spec)
    times = time_modules(spec, sessions) if spec.kind == "modules" else time_model(spec, sessions)
    with open(argv[1], "w") as f:
        json.dump({"pool": pool, "times": times}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
