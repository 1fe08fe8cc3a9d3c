"""bdlora's commands at the sizes users bring, beside onnxruntime-genai's own model builder: wall time and the peak
resident memory of each command's whole process tree, on checkpoints of released shapes
(``synthetic_checkpoint.py``: random bf16 weights, so time and memory only), in one markdown table.

    python benchmarks/sizes.py --shapes llama-3.2-1b --work /data/sizes --out docs/sizes-1b.md

Each command runs as its own process tree, sampled every 0.2 s (the sum of every process's resident set: a step's
children count); one that passes ``--memory-limit`` (GiB) is stopped and its row says so, instead of letting the
kernel's out-of-memory killer choose. Rows of one shape run one after the other, so their ratios compare within one
run (a machine's speed varies up to 2x from day to day). Commands (``--commands``):

    builder-int4   python -m onnxruntime_genai.models.builder -p int4 -e cpu (the runtime's own int4 export)
    export-int4    bdlora export genai --precision int4 --quant rtn (validated: parity, tokenizer, held-out check)
    export-int4-unchecked   the same with --no-validate (what the builder does: no check)
    generate       bdlora generate on export-int4's folder: --prompt-lookup --compare, 64 new tokens
    serve-loadtest bdlora serve export-int4's folder (--runtime genai), then loadtest --concurrency 1,4 against it
                   (8 requests of 32 tokens each; the server and the load generator are one process tree)
    export-onnx    bdlora export onnx (fp32, validated against PyTorch)
    gguf-q4_0, gguf-q4_k_m, gguf-q8_0   bdlora export gguf at that quant, unchecked (--no-validate: the file's
                   writing alone; q4_k_m writes f16 and rounds it with llama.cpp's quantizer, the [llamacpp] extra)
    gguf-q4_0-checked   the same, checked in llama.cpp against PyTorch (--quality-tokens as given)
    plan           bdlora plan --model CKPT --forms channels,groups --speedup 1.25 --precision int4
    one-shot       bdlora compress CKPT --one-shot --forms channels,groups --speedup 1.25 --precision int4
    ship           bdlora ship CKPT --schemes rtn --speedups 1.25 (a student, the draft, their exports and the
                   teacher's, one bench on two domains, the recommendation; rerun on the same --work resumes it)
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchtables import publish  # noqa: E402
from synthetic_checkpoint import SHAPES, write  # noqa: E402  the scripts beside this one

GIB = 2**30
PORT = 8765
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" * 3
# the server in the background until it answers /health, the load against it, the server stopped (its exit
# status is the load's)
SERVE = ("{bd} serve {folder} --runtime genai --port {port} & s=$!; "
         "for i in $(seq 1200); do curl -sf http://127.0.0.1:{port}/health >/dev/null && break; sleep 0.5; done; "
         "{bd} loadtest http://127.0.0.1:{port} --concurrency 1,4 --requests 8 --max-tokens 32; r=$?; "
         "kill $s; wait $s; exit $r")


def commands(ckpt: Path, work: Path, quality_tokens: int) -> dict[str, list[str]]:
    """Each command's argv on the checkpoint ``ckpt``, writing under ``work``."""
    bd = [sys.executable, "-m", "bdlora.cli"]
    one_shot = ["--forms", "channels,groups", "--speedup", "1.25", "--precision", "int4", "--data", "builtin"]
    return {
        "builder-int4": [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o",
                         str(work / "builder-int4"), "-p", "int4", "-e", "cpu", "-c", str(work / "builder-cache")],
        "export-int4": [*bd, "export", "genai", str(ckpt), "--precision", "int4", "--quant", "rtn",
                        *(["--quality-tokens", str(quality_tokens)] if quality_tokens else []),
                        "--out", str(work / "bdlora-int4")],
        "export-int4-gptq": [*bd, "export", "genai", str(ckpt), "--precision", "int4", "--quant", "gptq",
                             "--calib-tokens", "8192", *(["--quality-tokens", str(quality_tokens)] if quality_tokens
                                                         else []), "--out", str(work / "bdlora-int4-gptq")],
        "export-int4-unchecked": [*bd, "export", "genai", str(ckpt), "--precision", "int4", "--quant", "rtn",
                                  "--no-validate", "--out", str(work / "bdlora-int4-unchecked")],
        "generate": [*bd, "generate", str(work / "bdlora-int4"), "--prompt", PROMPT, "--prompt-lookup", "--compare",
                     "--max-tokens", "64"],
        "serve-loadtest": ["bash", "-c", SERVE.format(bd=shlex.join(bd), folder=shlex.quote(str(work / "bdlora-int4")),
                                                       port=PORT)],
        "export-onnx": [*bd, "export", "onnx", str(ckpt), "--out", str(work / "bdlora-onnx")],
        **{f"gguf-{q}": [*bd, "export", "gguf", str(ckpt), "--quant", q, "--no-validate", "--out",
                         str(work / f"gguf-{q}")] for q in ("q4_0", "q4_k_m", "q8_0")},
        "gguf-q4_0-checked": [*bd, "export", "gguf", str(ckpt), "--quant", "q4_0", *(
            ["--quality-tokens", str(quality_tokens)] if quality_tokens else []), "--out",
            str(work / "gguf-q4_0-checked")],
        "eval-ppl": [*bd, "eval", str(ckpt), "--ppl", "--data", "builtin", "--seq-len", "512", "--tokens", "4096",
                     "--domains", "", "--report", str(work / "eval.json"), "--force"],
        "plan": [*bd, "plan", "--model", str(ckpt), "--allocation", "quality", *one_shot, "--json"],
        "one-shot": [*bd, "compress", str(ckpt), "--one-shot", *one_shot, "--no-eval", "--out",
                     str(work / "one-shot")],
        "ship": [*bd, "ship", str(ckpt), "--schemes", "rtn", "--speedups", "1.25", "--data", "builtin", "--out",
                 str(work / "ship")],
    }


@dataclass
class Measured:
    seconds: float
    peak_bytes: int
    code: int
    said: str  # the last error line, or what stopped it

    def row(self, shape: str, name: str) -> str:
        status = "ok" if self.code == 0 else self.said.replace("|", "/")[:140]
        return f"| {shape} | {name} | {self.seconds:,.0f} | {self.peak_bytes / GIB:,.2f} | {status} |"


def tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of ``proc`` and every descendant (processes that end while read count as nothing)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def measure(argv: list[str], log: Path, limit_bytes: int, timeout: float) -> Measured:
    """Run ``argv`` (output to ``log``), sampling its process tree's memory; stopped past ``limit_bytes`` or
    ``timeout`` seconds."""
    peak, stop = [0], [""]
    with open(log, "w") as f:
        f.write("$ " + shlex.join(argv) + "\n")
        f.flush()
        began = time.monotonic()
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        watched = psutil.Process(proc.pid)

        def sample() -> None:
            while proc.poll() is None:
                try:
                    peak[0] = max(peak[0], tree_rss(watched))
                except psutil.Error:
                    return
                over = peak[0] > limit_bytes
                late = time.monotonic() - began > timeout
                if over or late:
                    stop[0] = (f"stopped past the memory limit ({limit_bytes / GIB:.3g} GiB)" if over
                               else f"stopped after {timeout:.0f} s")
                    for p in [*watched.children(recursive=True), watched]:
                        try:
                            p.kill()
                        except psutil.Error:
                            pass
                    return
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = proc.wait()
        sampler.join()
        seconds = time.monotonic() - began
    lines = log.read_text(errors="replace").splitlines()
    said = stop[0] or next((x for x in reversed(lines) if x.startswith("error:")), lines[-1] if lines else "")
    return Measured(seconds, peak[0], code, said)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="llama-3.2-1b", help=f"comma-separated, of {', '.join(sorted(SHAPES))}")
    p.add_argument("--commands", default="builder-int4,export-int4", help="comma-separated (see above)")
    p.add_argument("--work", type=Path, required=True, help="checkpoints and outputs go here (kept between runs)")
    p.add_argument("--out", type=Path, required=True, help="the markdown table to write")
    p.add_argument("--tokenizer", default="smollm2-135m", help="the checkpoints' tokenizer (synthetic_checkpoint)")
    p.add_argument("--memory-limit", type=float, default=20.0, help="GiB a command's process tree may hold")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a command may run")
    p.add_argument("--quality-tokens", type=int, default=None,
                   help="export-int4's held-out check (default: the command's own)")
    a = p.parse_args(argv)
    shapes = [s.strip() for s in a.shapes.split(",")]
    names = [c.strip() for c in a.commands.split(",")]
    bad = [s for s in shapes if s not in SHAPES] + [c for c in names if c not in commands(Path(), Path(), 1)]
    if bad:
        p.error(f"unknown {', '.join(map(repr, bad))}")
    rows = ["| shape | command | wall s | peak GiB (process tree) | status |", "|---|---|---|---|---|"]
    for shape in shapes:
        work = a.work / shape
        ckpt = work / "checkpoint"
        if not ckpt.is_dir():
            print(f"> writing the {shape} checkpoint", flush=True)
            write(shape, a.tokenizer, ckpt)
        for name in names:
            argv_ = commands(ckpt, work, a.quality_tokens)[name]
            for out in (Path(argv_[i + 1]) for i, x in enumerate(argv_[:-1]) if x in ("--out", "-o")):
                if out.is_dir():
                    subprocess.run(["rm", "-rf", str(out)], check=True)  # this script's own output, from before
            print(f"> {shape}: {name}", flush=True)
            m = measure(argv_, work / f"{name}.log", int(a.memory_limit * GIB), a.timeout)
            rows.append(m.row(shape, name))
            print(rows[-1], flush=True)
    publish(rows, a.out)


if __name__ == "__main__":
    main()
