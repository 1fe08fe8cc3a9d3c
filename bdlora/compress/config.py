"""The options of ``compress --one-shot`` (a pretrained model compressed without training): a dataclass whose
field docstrings the CLI turns into help text, and a validator that collects every problem and raises once, as
``config.TrainConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

from bdlora.base.errors import Checks, shown
from bdlora.base.outputs import DEFAULT_STREAMING, STREAMING
from bdlora.base.settings import Settings
from bdlora.base.threads import ThreadPool
from bdlora.data.documents import BUILTIN
from bdlora.forms import ONE_SHOT_FORMS
from bdlora.forms.dials import Dials

CALIB_TOKENS = 8192  # training-split tokens the whitened start and the quality allocation are measured on
EVAL_TOKENS = 8192  # held-out tokens of a one-shot compression's before/after perplexity


@dataclass
class OneShotConfig(Settings):
    dials: Dials = Dials(forms=ONE_SHOT_FORMS)
    """--mac-ratio or --speedup, --precision, --quant, --forms (default lowrank,channels), --width-multiple: what the
    allocation is given (``forms.dials.Dials``, shared with train)."""
    calib_tokens: int = CALIB_TOKENS
    """Training-split tokens of --data the calibration (input Gram matrices, output Fisher diagonals) uses."""
    data: str = BUILTIN
    """Corpus to measure held-out perplexity on (and to calibrate on, unless --calib-data), as bdlora train's --data
    (default builtin)."""
    calib_data: str | None = None
    """Corpus to calibrate on, as --data (default: --data; for a general-purpose model scored on builtin,
    builtin:1,prose:1); e.g. teacher:65536 or builtin:0.5,prose:0.5."""
    heldout_fraction: float | None = None
    """Held-out fraction of --data (default: the corpus's, 0.02 for the builtin one)."""
    seq_len: int = 128
    """Tokens per calibration and evaluation block (default 128)."""
    eval_tokens: int = EVAL_TOKENS
    """Held-out tokens scored for the source's and the compressed model's perplexity."""
    correct: bool = False
    """After factoring, re-solve every low-rank pair's second factor layer by layer against the source's own
    outputs on the calibration tokens, with the layers below already compressed (sequential least squares, as GPTQ
    and SVD-LLM v2 do)."""
    streaming: str = DEFAULT_STREAMING
    """on: calibrate one decoder layer at a time (forward, then backward from the top), each layer's input Grams
    written to the temp folder ($TMPDIR) as it finishes, so the whole model's activations and every Gram are never in
    memory together (a 1B-8B model); off: the whole model forward and backward at once; auto: on past 2 GiB of
    fp32 weights. The same numbers either way."""
    pool: ThreadPool = ThreadPool()
    """--threads: with --precision, the thread count the decode times are measured at (what export genai writes)."""

    def check(self, c: Checks) -> Checks:
        d = self.dials
        if d.ratio is None:
            c.add("--mac-ratio: --one-shot needs the projection-MAC speed-up to compress to (e.g. --mac-ratio 1.5; "
                  "or with --precision, --speedup S: the whole decode speed-up)")
        if d.mac_ratio is not None and d.speedup is not None:
            c.add(f"--speedup {shown(d.speedup)}: give --mac-ratio or --speedup, not both")
        if d.speedup is not None and d.precision is None:
            c.add(f"--speedup {shown(d.speedup)}: needs --precision P (the decode step it predicts is measured "
                  "at P)")
        d.check(c)
        for name in ("calib_tokens", "eval_tokens"):
            c.integer(name, getattr(self, name), lo=1)
        c.integer("seq_len", self.seq_len, lo=2, what=" (a block needs a token and its successor)")
        c.number("heldout_fraction", self.heldout_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        self.pool.check(c)
        c.choice("streaming", self.streaming, STREAMING)
        c.text("data", self.data)
        c.text("calib_data", self.calib_data)
        c.require(isinstance(self.correct, bool), f"--correct {shown(self.correct)}: must be true or false")
        return c
