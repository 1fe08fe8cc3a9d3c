"""``bdlora bench --speculative``: the teacher's export with the benched folder's export as its speculative-decoding
draft (and with prompt lookup), timed beside the teacher alone at batch 1 on prompts of every front domain.

Each domain gives ``SPEC_PROMPTS`` prompts of ``SPEC_PROMPT_TOKENS`` tokens (the first tokens of its held-out
blocks); every configuration generates ``SPEC_NEW_TOKENS`` greedy tokens from each, in its own timing process
(``bench.spec_worker``). The output is the teacher's own (the rows say whether every token was identical), so a
speculative row's quality is the teacher's; its speed on the front is the teacher's timed decode step divided by the
speed-up measured against the teacher alone in the same process and prompts.
"""

from __future__ import annotations

from pathlib import Path

from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import row_name
from bdlora.bench.launch import run_timing_process
from bdlora.bench.specs import SpeculativeTiming

SPEC_PROMPTS = 4  # prompts per domain
SPEC_PROMPT_TOKENS = 128  # tokens per prompt (the front's decode context)
SPEC_NEW_TOKENS = 64  # greedy tokens generated per prompt and configuration
SPEC_KS = (1, 2, 3, 4)  # fixed proposal widths timed beside the adaptive one
SPEC_REPEATS, SPEC_WARMUP = 2, 1


def prompts_of(blocks, context: int | None = None) -> list[list[int]]:
    """The first ``SPEC_PROMPT_TOKENS`` tokens of ``SPEC_PROMPTS`` held-out blocks spread over the slice (fewer when it
    is short), shorter where the target's ``context`` could not hold them, the new tokens and a last proposal (a
    128-position model failed "exceeds max length")."""
    room = SPEC_PROMPT_TOKENS if context is None else context - SPEC_NEW_TOKENS - max(SPEC_KS) - 1
    count, n, length = len(blocks), SPEC_PROMPTS, max(1, min(SPEC_PROMPT_TOKENS, room))
    picks = sorted({int(i * count / n) for i in range(n)})[:count]
    return [[int(t) for t in blocks.get([i])[0][:length]] for i in picks]


def speculative_rows(target: Path, draft: Path | None, lookup: bool, prompts: dict[str, list[list[int]]],
                     threads: int, work: Path, eos: int | None, reporter: Reporter = SILENT,
                     fixed: bool = True) -> dict:
    """The worker's rows and measured costs for ``target`` (a genai folder) with ``draft`` (a genai folder) and/or
    prompt lookup; ``fixed``: also at each fixed proposal width (``SPEC_KS``), beside the adaptive policy."""
    spec = SpeculativeTiming(target=str(target), prompts=prompts, new_tokens=SPEC_NEW_TOKENS, max_k=max(SPEC_KS),
                             threads=threads, repeats=SPEC_REPEATS, warmup=SPEC_WARMUP,
                             draft=str(draft) if draft else None, lookup=lookup,
                             ks=list(SPEC_KS) if fixed else [], ngram=3, eos=eos)
    return run_timing_process(spec, f"speculative-{target.name}", work,
                              lambda line: line.startswith("speculative "), reporter, what="speculative timing")


def summary(rows: list[dict]) -> dict[str, dict]:
    """Per configuration, over every domain: the speed-up against the target alone (total tokens over total time
    each, the prompt's prefill included) and the decode speed-up (the tokens after the first over the time after the
    prefill: a verifying graph computes every prompt position's logits, so its prefill costs more than plain
    generation's), the acceptance, tokens per target call, and whether every token was the target's."""
    out = {}
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        plain = [r for r in rows if r["config"] == "plain"]
        rate = sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine)
        base = sum(r["tokens"] for r in plain) / sum(r["seconds"] for r in plain)
        decode = _decode_rate(mine) / _decode_rate(plain)
        acc = sum(r["accepted"] for r in mine), sum(r["evaluated"] for r in mine)
        calls = sum(r["committed"] for r in mine), sum(r["target_calls"] for r in mine)
        out[name] = {"speedup": rate / base, "decode_speedup": decode, "tokens_per_s": rate,
                     "identical": all(r["identical"] for r in mine),
                     "acceptance": acc[0] / acc[1] if acc[1] else 0.0,
                     "tokens_per_target_call": calls[0] / calls[1] if calls[1] else 0.0}
    return out


def _decode_rate(rows: list[dict]) -> float:
    return sum(r["decode_tokens_per_s"] * r["decode_seconds"] for r in rows) / sum(r["decode_seconds"] for r in rows)


def front_rows(results: list[dict], spec: dict[str, dict], precision: str) -> list[dict]:
    """Decode rows of the speculative configurations at ``precision`` for the front: the teacher's timed decode rows
    (batch 1) divided by each configuration's measured decode speed-up (the front's rows are decode after the
    prompt); named ``spec-<config>-<precision>``."""
    teacher = row_name("teacher", precision)
    out = []
    for r in results:
        if r["scope"] == "genai" and r["variant"] == teacher and r["phase"] == "decode" and r["batch"] == 1:
            for name in ("draft", "lookup"):
                if name in spec:
                    s = spec[name]["decode_speedup"]
                    out.append({**r, "variant": f"spec-{name}-{precision}", "median_ms": r["median_ms"] / s,
                                "p10_ms": r["p10_ms"] / s, "p90_ms": r["p90_ms"] / s, "speculative": True})
    return out
