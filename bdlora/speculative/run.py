"""``bdlora generate``: one prompt continued by an exported model, with a draft or prompt lookup proposing the tokens
it verifies (speculative decoding), timed; ``--compare`` also generates without them and says whether the tokens
are identical and how much faster speculation was. numpy and the runtimes only (no torch)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from bdlora.base.errors import Checks, UsageError
from bdlora.base.settings import Settings
from bdlora.base.threads import ThreadPool
from bdlora.models.tokenizer import TextTokenizer
from bdlora.speculative.config import SpeculationConfig
from bdlora.speculative.decoders import DecoderFactory, check_draft, opened, stop_ids_of
from bdlora.speculative.loop import Speculator, generate
from bdlora.speculative.policy import Costs, KPolicy
from bdlora.speculative.proposers import new_proposer, speculation_length


@dataclass
class GenerateConfig(Settings):
    """One generation: the prompt and how it is continued."""

    max_tokens: int = 128
    """New tokens at most (fewer when the model ends the text)."""
    temperature: float = 0.0
    """0: greedy (the target's own tokens); above 0, sampled from the target's distribution."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches this."""
    seed: int | None = None
    """Random seed of the sampler."""
    chat: bool = False
    """Wrap the prompt in the model's chat template (one user message)."""
    pool: ThreadPool = ThreadPool()
    """--threads: of each model."""

    def check(self, c: Checks) -> Checks:
        c.integer("max_tokens", self.max_tokens, lo=1)
        c.number("temperature", self.temperature, 0.0, 2.0)
        c.number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        c.integer("seed", self.seed, lo=0)
        self.pool.check(c)
        return c


def open_speculation(folder: Path, spec: SpeculationConfig, threads: int | None):
    """(target factory, proposer factory or None): the folder opened for verification and the proposer ``spec``
    names (a draft checked against the target first)."""
    target = opened("MODEL_DIR", folder, lambda: DecoderFactory.verifying(folder, threads))
    if spec.draft is not None:
        check_draft(folder, Path(spec.draft))
        draft = opened("--draft", Path(spec.draft), lambda: DecoderFactory(spec.draft, threads))
        return target, draft
    return target, None


def prompt_ids(tok: TextTokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        if not tok.chat_template:
            raise UsageError(f"--chat: {tok.folder} has no chat template")
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False)
    ids = tok.encode(prompt)
    if not ids:
        raise UsageError("--prompt: empty (it encodes to no tokens)")
    return ids


def _one(target, proposer, spec: SpeculationConfig, cfg: GenerateConfig, ids: list[int], eos, stop_ids,
         costs: Costs) -> dict:
    max_length = speculation_length(len(ids), cfg.max_tokens, spec.max_k, target.shape.max_positions)
    if len(ids) + 1 > target.shape.max_positions:
        raise UsageError(f"--prompt: {len(ids):,} tokens, the model takes {target.shape.max_positions:,} positions")
    policy = KPolicy(spec.max_k, costs, fixed=spec.max_k if spec.fixed_k else None)
    sp = Speculator(target.new(max_length), proposer, policy, stop_ids)
    t0 = time.perf_counter()
    tokens = [t for t, _ in generate(sp, ids, cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.seed, eos, max_length)]
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": len(tokens) / seconds if seconds else 0.0,
            "stats": sp.stats.as_dict()}


def generate_text(folder: str | Path, prompt: str, cfg: GenerateConfig, spec: SpeculationConfig,
                  compare: bool = False) -> dict:
    """Continue ``prompt`` with the model of ``folder`` (an export), speculatively when ``spec`` names a proposer;
    with ``compare``, also plainly (same runtime, same loop), each after a short warm-up."""
    folder = Path(folder)
    cfg.check(spec.check(Checks())).done()
    tok = TextTokenizer(folder)
    target, draft = open_speculation(folder, spec, cfg.pool.threads)
    ids = prompt_ids(tok, prompt, cfg.chat)
    eos = tok.eos_token_id
    stops = stop_ids_of(target, eos)
    max_length = speculation_length(len(ids), cfg.max_tokens, spec.max_k, target.shape.max_positions)
    draft_stops = stop_ids_of(draft, eos) if draft else stops
    costs = Costs()
    runs = {}
    for name in (["plain"] if compare or not spec.enabled else []) + (["speculative"] if spec.enabled else []):
        kind = spec.kind if name == "speculative" else None

        def proposer(kind=kind):
            return new_proposer(kind, spec.ngram, draft, max_length, draft_stops)

        warm = GenerateConfig(**{**cfg.__dict__, "max_tokens": min(8, cfg.max_tokens)})
        _one(target, proposer(), spec, warm, ids, eos, stops, costs)  # sessions and thread pools warm
        runs[name] = _one(target, proposer(), spec, cfg, ids, eos, stops, costs)
    main = runs.get("speculative") or runs["plain"]
    out = {"folder": str(folder), "runtime": target.runtime, "prompt_tokens": len(ids), "temperature": cfg.temperature,
           "text": tok.decode(main["tokens"], skip_special_tokens=True), **main, "proposer": spec.kind,
           "draft": spec.draft}
    if compare and spec.enabled:
        plain = runs["plain"]
        out["plain"] = plain
        same = min(len(plain["tokens"]), len(main["tokens"]))
        out["identical"] = plain["tokens"] == main["tokens"]
        out["identical_prefix"] = next((i for i in range(same) if plain["tokens"][i] != main["tokens"][i]), same)
        out["speedup"] = main["tokens_per_second"] / plain["tokens_per_second"] if plain["tokens_per_second"] else 0.0
    return out
