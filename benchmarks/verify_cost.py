"""What verifying w proposed tokens costs the target: one call of the genai graph over w new tokens after a
past, against one decode step (w = 1), for genai folders of the sizes users bring. Speculative decoding (prompt
lookup, a draft) pays only when a verifying call of w tokens costs less than the w steps it may replace; on a CPU
the int4 kernels are not bandwidth-bound at one row, so w tokens cost more than one step.

    python benchmarks/verify_cost.py --folders 1b-int4=W/llama-3.2-1b/bdlora-int4,1b-builder=W/.../builder-int4 \\
        --widths 1,2,4,8 --out docs/verify-cost.md

Each folder's every-position graph (``model_all_logits.onnx`` in bdlora's folders; the builder's ``model.onnx``) is
opened in onnxruntime with the kernels' prepacked weights (as onnxruntime-genai runs it), a ``--past``-token prompt
is run once, and each width is then timed ``--repeats`` times from that same past (medians), the widths
interleaved repeat by repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from benchtables import named_folders, publish  # the script beside this one

from bdlora.models.runtime import run_decoder, session


def graph_of(folder: Path) -> Path:
    every = folder / "model_all_logits.onnx"
    return every if every.is_file() else folder / "model.onnx"


def cache_shape(folder: Path) -> tuple[int, int, int, int]:
    """(layers, kv heads, head size, vocabulary) from genai_config.json (every genai folder has one)."""
    d = json.loads((folder / "genai_config.json").read_text())["model"]
    dec = d["decoder"]
    return dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"], d["vocab_size"]


def widths_ms(folder: Path, widths: list[int], past: int, repeats: int, threads: int) -> dict[int, float]:
    sess = session(graph_of(folder), threads=threads)
    layers, kv, hd, vocab = cache_shape(folder)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, min(vocab, 30000), (1, past))
    empty = [np.zeros((1, kv, 0, hd), np.float32) for _ in range(2 * layers)]
    cache = run_decoder(sess, prompt, np.ones((1, past), np.int64), None, empty)[1:]
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(repeats):
        for w in widths:
            ids = rng.integers(100, min(vocab, 30000), (1, w))
            began = time.perf_counter()
            run_decoder(sess, ids, np.ones((1, past + w), np.int64), None, cache)
            times[w].append((time.perf_counter() - began) * 1000)
    return {w: statistics.median(t) for w, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--folders", required=True, help="name=genai folder,...")
    p.add_argument("--widths", default="1,2,3,4,6,8", help="new tokens per call (1 is the decode step)")
    p.add_argument("--past", type=int, default=128, help="tokens already in the cache")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=2, help="intra-op threads")
    p.add_argument("--out", type=Path, required=True, help="the markdown table to write")
    a = p.parse_args(argv)
    folders = named_folders(a.folders)
    widths = sorted({int(w) for w in a.widths.split(",")} | {1})
    rows = ["| folder | one step (w = 1) ms | " + " | ".join(f"w = {w}" for w in widths if w > 1) + " |",
            "|---|---|" + "---|" * (len(widths) - 1)]
    for name, folder in folders.items():
        ms = widths_ms(folder, widths, a.past, a.repeats, a.threads)
        rows.append(f"| {name} | {ms[1]:.1f} | " + " | ".join(f"{ms[w] / ms[1]:.2f}x" for w in widths if w > 1)
                    + " |")
        print(rows[-1], flush=True)
    publish(rows, a.out)


if __name__ == "__main__":
    main()
