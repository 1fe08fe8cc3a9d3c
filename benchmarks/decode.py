"""Decode speed of onnxruntime-genai folders and llama.cpp GGUF files, interleaved in one run: milliseconds per
generated token after a prompt (batch 1, greedy), at each thread count set alike in every one and with each
folder's own settings, on a quiet machine or with one core kept busy.

    python benchmarks/decode.py --folders builder=W/builder-int4,bdlora=W/bdlora-int4,q4_0=W/t.gguf-q4_0 \\
        --threads 1,2,own --busy both --spinning both --out docs/decode-1b.md

A GGUF (a ``.gguf`` file, or a folder ``bdlora export gguf`` wrote) is run by llama.cpp through llama-cpp-python (the
``[llamacpp]`` extra) with ``n_threads`` set to the thread count (``own``: llama-cpp-python's default, half the
logical cores), its weights repacked as llama.cpp does by default (not on a CPU with AMX, where that crashed:
``export.gguf.llamacpp.repacks``). ``--spinning both``: each genai folder also with
``session_options`` ``"session.intra_op.allow_spinning": "0"`` (its pool's threads sleep between calls instead of
spinning, which onnxruntime-genai 0.18 passes to onnxruntime as a config entry).

A folder is run through a view of it (its files linked into a temporary folder) whose genai_config.json sets
``session_options.intra_op_num_threads`` (``own``: the folder's file as written: bdlora writes this machine's
cores, the builder writes none, which onnxruntime-genai runs on one thread). Each repeat visits every (folder,
threads) pair in turn, so a machine's drift falls on all of them alike; the table gives each pair's median and its
ratio to the first folder's at the same setting. ``--busy``: a process spinning on one core while measuring (what
a user's machine with anything else running looks like).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime_genai as og
from benchtables import named_folders, publish  # the script beside this one

from bdlora.export.genai.config import SPIN_OFF  # what export genai --no-spin writes

OWN = "own"


def busy_loop() -> None:  # a core kept busy
    while True:
        pass




def view(folder: Path, threads: str, root: Path, spin: bool = True) -> Path:
    """``folder`` seen with ``threads`` intra-op threads (``OWN``: as it is) and, ``spin`` False, its intra-op
    threads sleeping between calls."""
    if threads == OWN and spin:
        return folder
    out = root / f"{folder.name}-{threads}-{'spin' if spin else 'nospin'}"
    if not out.exists():
        out.mkdir()
        for f in folder.iterdir():
            if f.name != "genai_config.json":
                (out / f.name).symlink_to(f.resolve())
        cfg = json.loads((folder / "genai_config.json").read_text())
        options = cfg["model"]["decoder"].setdefault("session_options", {})
        if threads != OWN:
            options["intra_op_num_threads"] = int(threads)
        if not spin:
            options.update(SPIN_OFF)
        (out / "genai_config.json").write_text(json.dumps(cfg, indent=2))
    return out


def gguf_file(path: Path) -> Path | None:
    """The GGUF file ``path`` names (itself, or the model.gguf of an ``export gguf`` folder), else None."""
    if path.suffix == ".gguf" and path.is_file():
        return path
    return path / "model.gguf" if (path / "model.gguf").is_file() else None


def gguf_ms_per_token(path: Path, threads: str, prompt: int, tokens: int) -> float:
    """llama.cpp's milliseconds per token of ``tokens`` greedy steps after a ``prompt``-token prompt."""
    from bdlora.export.gguf.llamacpp import LlamaCpp, repacks

    llm = LlamaCpp().load(path, None if threads == OWN else int(threads), prompt + tokens + 8, repack=repacks(),
                          logits_all=False)
    ids = np.random.default_rng(0).integers(100, min(llm.n_vocab(), 30000), prompt).tolist()
    llm.eval(ids)
    nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    llm.eval([nxt])  # the first step after the prompt: warm
    began = time.perf_counter()
    for _ in range(tokens):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([nxt])
    took = (time.perf_counter() - began) * 1000 / tokens
    llm.close()
    return took


def ms_per_token(folder: Path, prompt: int, tokens: int) -> float:
    """Milliseconds per token of ``tokens`` greedy steps after a ``prompt``-token prompt (the prefill not
    counted)."""
    model = og.Model(str(folder))
    vocab = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
    ids = np.random.default_rng(0).integers(100, min(vocab, 30000), prompt).astype(np.int32)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt + tokens + 1, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    gen.generate_next_token()  # the first step after the prompt: warm
    began = time.perf_counter()
    for _ in range(tokens):
        gen.generate_next_token()
    return (time.perf_counter() - began) * 1000 / tokens


def runs(folders: dict[str, Path], spinning: str) -> list[tuple[str, Path, bool]]:
    """(row name, folder or GGUF file, spin) of every row: each genai folder spinning and/or not, each GGUF once."""
    out = []
    for name, folder in folders.items():
        if gguf_file(folder) is not None:
            out.append((name, gguf_file(folder), True))
            continue
        for spin in {"on": [True], "off": [False], "both": [True, False]}[spinning]:
            out.append((name if spinning != "both" else f"{name} ({'spinning' if spin else 'no spinning'})",
                        folder, spin))
    return out


def measure(folders: dict[str, Path], threads: list[str], prompt: int, tokens: int, repeats: int,
            busy: bool, spinning: str = "on") -> dict[tuple[str, str], list[float]]:
    times: dict[tuple[str, str], list[float]] = {}
    spinner = mp.Process(target=busy_loop, daemon=True) if busy else None
    if spinner:
        spinner.start()
    try:
        with tempfile.TemporaryDirectory() as root:
            for r in range(repeats):
                for t in threads:
                    for name, folder, spin in runs(folders, spinning):
                        ms = gguf_ms_per_token(folder, t, prompt, tokens) if folder.suffix == ".gguf" else \
                            ms_per_token(view(folder, t, Path(root), spin), prompt, tokens)
                        times.setdefault((name, t), []).append(ms)
                        print(f"  repeat {r + 1}: {name} threads {t} {'busy' if busy else 'quiet'}: {ms:.2f} ms/token",
                              flush=True)
    finally:
        if spinner:
            spinner.kill()
    return times


def table(times: dict, names: list[str], threads: list[str], busy: bool) -> list[str]:
    first = names[0]
    rows = []
    for t in threads:
        base = statistics.median(times[(first, t)])
        for name in names:
            ms = times[(name, t)]
            rows.append(f"| {'one core busy' if busy else 'quiet'} | {t} | {name} | {statistics.median(ms):.2f} | "
                        f"{min(ms):.2f}-{max(ms):.2f} | {statistics.median(ms) / base:.3f} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--folders", required=True, help="name=folder,... (the first is the reference)")
    p.add_argument("--threads", default="1,2,own", help="intra-op thread counts, and/or 'own'")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens before the timed steps")
    p.add_argument("--tokens", type=int, default=32, help="timed decode steps")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--busy", choices=("no", "yes", "both"), default="no", help="a core kept busy while measuring")
    p.add_argument("--spinning", choices=("on", "off", "both"), default="on",
                   help="genai folders: their intra-op threads spinning between calls (onnxruntime's default), not, "
                        "or both")
    p.add_argument("--out", type=Path, required=True, help="the markdown table to write")
    a = p.parse_args(argv)
    folders = named_folders(a.folders)
    missing = [str(f) for f in folders.values() if not (f / "genai_config.json").is_file() and gguf_file(f) is None]
    if missing:
        p.error(f"neither genai folders nor GGUF files: {', '.join(missing)}")
    threads = [t.strip() for t in a.threads.split(",")]
    rows = ["| machine | threads | folder | ms/token (median) | range | vs the first |",
            "|---|---|---|---|---|---|"]
    for busy in {"no": [False], "yes": [True], "both": [False, True]}[a.busy]:
        names = [name for name, _, _ in runs(folders, a.spinning)]
        rows += table(measure(folders, threads, a.prompt, a.tokens, a.repeats, busy, a.spinning), names, threads,
                      busy)
    publish(rows, a.out)


if __name__ == "__main__":
    main()
