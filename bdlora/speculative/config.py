"""How tokens are proposed for a target to verify: the speculative options ``generate``, ``serve`` and ``bench`` take
(one dataclass, so each command's flags are generated from it and read the same)."""

from __future__ import annotations

from dataclasses import dataclass

from bdlora.base.errors import Checks
from bdlora.base.settings import Settings
from bdlora.speculative.proposers import DraftProposer, PromptLookup


@dataclass
class SpeculationConfig(Settings):
    """How tokens are proposed for the target to verify (shared by ``generate``, ``serve`` and ``bench``)."""

    draft: str | None = None
    """A `bdlora export genai` or `export onnx` folder of a draft model with the target's tokenizer (e.g. a student
    made from the teacher): it proposes the tokens the target verifies; the output stays the target's."""
    prompt_lookup: bool = False
    """Propose the continuation of the context's last n-gram where it occurred before (no draft model)."""
    max_k: int = 4
    """Most tokens proposed per round; the k of each round is chosen from the measured acceptance and costs."""
    fixed_k: bool = False
    """Propose exactly --max-k tokens every round (no adaptation; for measurements)."""
    ngram: int = 3
    """--prompt-lookup: longest n-gram matched (down to 1)."""

    @property
    def enabled(self) -> bool:
        return self.draft is not None or self.prompt_lookup

    @property
    def kind(self) -> str | None:
        """The proposer these options name (``proposers.PROPOSERS``), or None: no speculation."""
        return DraftProposer.name if self.draft is not None else PromptLookup.name if self.prompt_lookup else None

    def check(self, c: Checks) -> Checks:
        c.integer("max_k", self.max_k, lo=1, hi=16)
        c.integer("ngram", self.ngram, lo=1, hi=16)
        c.require(not (self.draft and self.prompt_lookup), "--draft and --prompt-lookup: give one proposer")
        return c
