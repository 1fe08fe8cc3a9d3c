"""The speculative-decoding timing process of ``bdlora bench --speculative``: ``python -m bdlora.bench.spec_worker
SPEC OUT``.

Generates greedily from every prompt of every domain with the target alone (its folder's own graph: the head on the
last position, what plain generation runs) and with each proposer (the draft folder at fixed k and adaptive k,
prompt lookup), the configurations interleaved prompt by prompt and repeated, and reports per (domain,
configuration): new tokens, wall time with and without the prompt's prefill, acceptance, tokens per target call, the
k chosen, and whether every token equals the target's own greedy output. Needs numpy and the runtimes only.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from bdlora.bench.specs import SpeculativeTiming
from bdlora.speculative.decoders import DecoderFactory, stop_ids_of
from bdlora.speculative.loop import SpecStats, Speculator
from bdlora.speculative.policy import Costs, KPolicy
from bdlora.speculative.proposers import DraftProposer, PromptLookup, new_proposer, speculation_length

SETTLE_S = 0.05  # as the genai timing process: let the previous model's threads park before a timed run


def run_one(factory, proposer, policy, prompt: list[int], n: int, stops) -> tuple[list[int], float, float, SpecStats]:
    """(tokens, seconds with the prefill, seconds after it, stats) of ``n`` greedy tokens after ``prompt``."""
    sp = Speculator(factory.new(speculation_length(len(prompt), n, policy.max_k)), proposer, policy, stops)
    t0 = time.perf_counter()
    row = sp.prefill(prompt)
    t1 = time.perf_counter()
    seq = list(prompt) + [int(np.argmax(row))]
    sp.stats.committed += 1
    while len(seq) - len(prompt) < n:
        for token, _ in sp.round(seq, 0.0, 1.0, None, n - (len(seq) - len(prompt)), 1 << 30):
            seq.append(token)
    t2 = time.perf_counter()
    return seq[len(prompt): len(prompt) + n], t2 - t0, t2 - t1, sp.stats


def configurations(spec: SpeculativeTiming) -> list[tuple[str, str | None, int | None]]:
    """(name, proposer (``proposers.PROPOSERS``; None: the plain target), fixed k or None for adaptive) of every
    configuration timed, the plain target first; the names are the bench's result rows ("lookup" for prompt
    lookup's, as bench.json files have always called them)."""
    draft, lookup = DraftProposer.name, PromptLookup.name
    out = [("plain", None, 1)]
    if spec.draft:
        out += [(f"draft-k{k}", draft, k) for k in spec.ks] + [("draft", draft, None)]
    if spec.lookup:
        out += [(f"lookup-k{spec.max_k}", lookup, spec.max_k)] * bool(spec.ks) + [("lookup", lookup, None)]
    return out


def main(argv: list[str]) -> int:
    spec = SpeculativeTiming.read(argv[0])
    threads = spec.threads
    plain = DecoderFactory(spec.target, threads)  # model.onnx: the head on the last position
    target = DecoderFactory.verifying(spec.target, threads)
    draft = DecoderFactory(spec.draft, threads) if spec.draft else None
    stops, draft_stops = stop_ids_of(target, spec.eos), stop_ids_of(draft, spec.eos) if draft else []
    costs = {None: Costs(), DraftProposer.name: Costs(), PromptLookup.name: Costs()}  # per proposer, as a server
    out = []
    for domain, prompts in spec.prompts.items():
        cells = {name: {"tokens": 0, "seconds": 0.0, "decode_seconds": 0.0, "stats": SpecStats(), "identical": True}
                 for name, _, _ in configurations(spec)}
        for r in range(spec.warmup + spec.repeats):
            for prompt in prompts:
                reference = None
                for name, kind, k in configurations(spec):
                    proposer = new_proposer(kind, spec.ngram, draft,
                                            speculation_length(len(prompt), spec.new_tokens, spec.max_k),
                                            draft_stops)
                    policy = KPolicy(spec.max_k, costs[kind], fixed=k)
                    time.sleep(SETTLE_S)
                    toks, secs, dec, stats = run_one(plain if kind is None else target, proposer, policy, prompt,
                                                     spec.new_tokens, stops)
                    reference = toks if reference is None else reference
                    if r < spec.warmup:
                        continue
                    c = cells[name]
                    c["tokens"] += len(toks)
                    c["seconds"] += secs
                    c["decode_seconds"] += dec
                    c["stats"].add(stats)
                    c["identical"] = c["identical"] and toks == reference
        for name, c in cells.items():
            decoded = c["tokens"] - len(prompts) * spec.repeats  # each generation's first token is its prefill's
            out.append({"domain": domain, "config": name, "tokens": c["tokens"], "seconds": c["seconds"],
                        "decode_seconds": c["decode_seconds"], "identical": c["identical"],
                        "tokens_per_s": c["tokens"] / c["seconds"],
                        "decode_tokens_per_s": decoded / c["decode_seconds"],
                        **c["stats"].as_dict()})
        print(f"speculative {domain}", file=sys.stderr, flush=True)
    with open(argv[1], "w") as f:
        mine = costs[DraftProposer.name if spec.draft else PromptLookup.name]  # the draft's, else lookup's
        json.dump({"rows": out, "costs": {"target_us": {str(w): s * 1e6 for w, s in mine.target.items()},
                                          "draft_us": None if mine.draft is None else mine.draft * 1e6}}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
