"""What a target call scoring ``w`` tokens at once costs beside one decode step, measured on the target's own shapes
at the deployed precision (``plan --speculative``'s verification cost): on a CPU the int4 kernels cost more per call
as the tokens grow (SmolLM2 int4 on 2 cores: 2 tokens 1.15-1.3x a step, 3 tokens 1.5-1.6x, 5 tokens 2.1-2.3x),
which bounds what a draft can buy.

A random dense model of the target's config (full depth, built without weights, ``bench.whole._dense_model``) is
exported by this toolkit at the precision (scheme layout and head bits as ``bench.whole``), and timed in its own
process (``python -m bdlora.bench.verify SPEC OUT``): after a ``CONTEXT``-token prompt, each width's call of random
tokens then a rollback, widths interleaved, the median of its repeats per width. Cached beside the latency table
with the machine's other load while it was timed: a curve timed busy, or whose repeats disagree, is marked unclean and
measured again by a quiet run (``latency.reusable``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bdlora.base import load  # through the module: the tests set its readers
from bdlora.base.errors import UsageError
from bdlora.base.io import read_json, write_json
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.schemes import scheme
from bdlora.base.threads import ThreadPool
from bdlora.bench.genai import _stand_in_tokenizer
from bdlora.bench.launch import run_timing_process
from bdlora.bench.specs import VerifyTiming
from bdlora.bench.whole import CONTEXT, _dense_model, shape_key
from bdlora.eval.reference import teacher_folder
from bdlora.export.genai.folder import deployment, heldout_for
from bdlora.export.genai.latency import TABLE_VERSION, cpu_name
from bdlora.export.settings import GenaiExportConfig
from bdlora.models.load import load_model_folder
from bdlora.models.perplexity import agreement
from bdlora.models.runtime import DecoderShape
from bdlora.speculative.decoders import DecoderFactory
from bdlora.speculative.predict import speculative_speedup

VERIFY_VERSION = 3  # 3: the median of each width's repeats, checked, the load recorded
REPEATS, WARMUP = 15, 3


def verify_path(cache: Path, config: dict, precision: str, threads: int, layout: str, widths: int) -> Path:
    tag = hashlib.sha256(json.dumps([VERIFY_VERSION, TABLE_VERSION, ort.__version__, cpu_name(), shape_key(config),
                                     int(config["num_hidden_layers"]), precision, layout, widths, CONTEXT],
                                    sort_keys=True).encode()).hexdigest()[:12]
    return Path(cache) / "latency" / f"verify-{precision}-t{threads}-{tag}.json"


def verify_curve(config: dict, precision: str, threads: int, cache: Path, quant: str, widths: int = 5,
                 reporter: Reporter = SILENT) -> dict[int, float]:
    """{w: a call of w tokens as a share of a call of one} for w in 1..``widths`` at ``precision``, cached."""
    timed = scheme(quant).timed_as(precision)
    path = verify_path(cache, config, precision, threads, timed.layout(precision), widths)
    if path.is_file():
        doc = read_json(path)
        shares = {int(w): float(v) for w, v in (doc.get("shares") or {}).items()}
        if sorted(shares) == list(range(1, widths + 1)) and all(np.isfinite(v) and v > 0 for v in shares.values()):
            if load.reusable(doc.get("unclean"), path, reporter):
                return shares
        else:
            reporter.stage(f"{path}: damaged, measuring again")
    settings = GenaiExportConfig(quant=timed.name, context_length=CONTEXT + widths + 8, pool=ThreadPool(threads),
                                 validate=False).at(precision)
    work = Path(tempfile.mkdtemp(prefix="bdlora-verify-"))
    try:
        reporter.stage(f"exporting a synthetic {config['num_hidden_layers']}-layer graph at {precision} to time "
                       f"calls of 1 to {widths} tokens (verifying a draft's proposals)")
        folder = deployment(_dense_model(config, int(config["num_hidden_layers"]), int(config["intermediate_size"])),
                            _stand_in_tokenizer(), work / "target", settings)
        with load.LoadWatch() as watch:
            spec = VerifyTiming(folder=str(folder), widths=widths, threads=threads, vocab=int(config["vocab_size"]))
            res = run_timing_process(spec, "verify", work, lambda line: line.startswith("verify "), reporter,
                                     what="verification timing")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    times = {int(w): v for w, v in res["ms"].items()}
    ms = {w: float(np.median(times[w])) for w in sorted(times)}
    shares = {w: ms[w] / ms[1] for w in sorted(ms)}
    spread = [str(w) for w in sorted(times) if not load.agree(times[w])]
    unclean = (f"timed with {watch.load.said()}" if not watch.load.quiet else
               f"the repeats of {', '.join(spread)} token(s) are not within {load.AGREE:g}x of their fastest" if spread
               else None)
    if unclean:
        load.not_cached(reporter, "the verification curve", watch.load, unclean if watch.load.quiet else "")
    write_json(path, {"precision": precision, "threads": threads, "ms": ms, "shares": shares,
                      "load": watch.load.record(), "unclean": unclean})
    return shares


def main(argv: list[str]) -> int:
    spec = VerifyTiming.read(argv[0])
    factory = DecoderFactory.verifying(spec.folder, spec.threads)
    rng = np.random.default_rng(0)
    widths = range(1, spec.widths + 1)
    times: dict[int, list[float]] = {w: [] for w in widths}
    dec = factory.new(CONTEXT + spec.widths + 4)
    dec.append(rng.integers(1, spec.vocab, CONTEXT).tolist())
    for r in range(WARMUP + REPEATS):
        for w in widths:
            tokens = rng.integers(1, spec.vocab, w).tolist()
            time.sleep(0.02)
            t0 = time.perf_counter()
            dec.append(tokens)
            spent = time.perf_counter() - t0
            dec.rewind(CONTEXT)
            if r >= WARMUP:
                times[w].append(spent * 1e3)
    print("verify widths", file=sys.stderr, flush=True)
    with open(argv[1], "w") as f:
        json.dump({"ms": {str(w): t for w, t in times.items()}}, f)  # every repeat: the caller checks they agree
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def predict_speculative(folder: Path, report: dict, draft_us: float, teacher_step, precision: str, threads: int,
                        cache: Path, quant: str, max_k: int = 4, tokens: int = 4096,
                        reporter: Reporter = SILENT) -> dict:
    """``plan FOLDER --precision P --speculative``: the speed-up of the teacher's export at ``precision`` with
    ``folder`` (a draft made from it) as its draft, from the draft's greedy agreement with the teacher on ``tokens``
    held-out tokens, the draft's predicted whole decode step (``draft_us``) as a share of the teacher's
    (``teacher_step(config)``: its dense step predicted the same way) and the teacher's measured verification cost
    (``verify_curve``)."""
    prov = report.get("provenance") or {}
    where, why = teacher_folder(prov.get("teacher"), cache)
    if where is None:
        raise UsageError(f"plan {folder} --speculative: its teacher is needed to measure the agreement ({why})")
    reporter.stage(f"loading the draft {folder} and its teacher {where}")
    draft, tok, _ = load_model_folder(folder)
    teacher, _, _ = load_model_folder(where)
    blocks = heldout_for(Path(folder), report, tok, DecoderShape.of(draft.config), tokens)
    reporter.stage(f"the draft's greedy agreement with its teacher on {len(blocks) * blocks.seq_len:,} held-out "
                   "tokens")
    alpha = agreement(teacher, draft, blocks)
    verify = verify_curve(teacher.config.to_dict(), precision, threads, cache, quant, max_k + 1, reporter)
    teacher_us = teacher_step(teacher.config.to_dict())
    return {**speculative_speedup(alpha, draft_us / teacher_us, verify, max_k), "teacher": str(where),
            "agreement_tokens": len(blocks) * blocks.seq_len, "draft_us": draft_us, "teacher_us": teacher_us}
