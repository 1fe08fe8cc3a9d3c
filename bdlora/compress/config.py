"""The options of ``compress --one-shot`` (a pretrained model compressed without training): a dataclass whose
field docstrings the CLI turns into help text, and a validator that collects every problem and raises once, as
``config.TrainConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

from bdlora.base.errors import Checks, shown
from bdlora.base.outputs import DEFAULT_STREAMING, STREAMING
from bdlora.base.schemes import GENAI_PRECISIONS, quant_problem
from bdlora.base.settings import Settings
from bdlora.base.threads import ThreadPool
from bdlora.data.documents import BUILTIN
from bdlora.forms import ONE_SHOT_FORMS, WIDTH_MULTIPLE, check_forms, check_width_multiple, form_names

CALIB_TOKENS = 8192  # training-split tokens the whitened start and the quality allocation are measured on
EVAL_TOKENS = 8192  # held-out tokens of a one-shot compression's before/after perplexity


@dataclass
class OneShotConfig(Settings):
    mac_ratio: float | None = None
    """Projection-MAC speed-up of the compressed model vs the source's dense projections (e.g. 1.5)."""
    speedup: float | None = None
    """With --precision, instead of --mac-ratio: the predicted whole decode speed-up over the source's export at that
    precision (e.g. 1.3): each layer's attention, norms and activation work and the step's fixed cost are priced
    beside the projections, so a removed layer saves its whole time and a narrower MLP its share."""
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
    precision: str | None = None
    """Allocate by measured decode time at this precision (fp32, int8, int4: the genai exporter's nodes timed in
    onnxruntime on this machine, cached) instead of by MACs; --mac-ratio is then the projections' decode-time
    speed-up, and a low-rank pair that is no faster than its dense product at that precision is never chosen."""
    forms: str = ONE_SHOT_FORMS
    """The structures the allocation chooses among, comma-separated: lowrank (a projection as a rank-r pair),
    channels (an MLP keeping fewer intermediate channels: gate, up and down as narrower dense products, down refitted
    to the kept channels), groups (an attention block keeping fewer key/value heads with their query heads: q, k, v
    and o as narrower dense products and a smaller KV cache, o refitted), layers (a decoder layer removed whole) and
    bits (with --precision int4: a dense projection kept at 8 bits, its measured rounding error bought back at the
    int8 time) and vocab (with --speedup: the LM head keeping only the tokens the teacher emits most, for a
    speculative-decoding draft), each site taking whichever costs least quality for what it saves; e.g.
    lowrank,channels,groups,layers,bits. Default lowrank,channels (measured on SmolLM2 at 1.2x: 12% lower perplexity
    in domain and 20% lower on text never seen than lowrank alone)."""
    quant: str | None = None
    """--precision int8 or int4: the scheme export genai will round with (rtn, gptq, affine; default rtn). Its node
    layout is what is timed (affine's 4-bit MatMuls read block means and hold 3% more columns), and with --forms bits
    its grid measures each projection's rounding error."""
    streaming: str = DEFAULT_STREAMING
    """on: calibrate one decoder layer at a time (forward, then backward from the top), each layer's input Grams
    written to the temp folder ($TMPDIR) as it finishes, so the whole model's activations and every Gram are never in
    memory together (a 1B-8B model); off: the whole model forward and backward at once; auto: on past 2 GiB of
    fp32 weights. The same numbers either way."""
    pool: ThreadPool = ThreadPool()
    """--threads: with --precision, the thread count the decode times are measured at (what export genai writes)."""
    width_multiple: int | None = None
    """Every width a pruned block keeps as a projection's input (an MLP's kept channels, an attention block's kept
    heads times their size) a multiple of this (default 32, the int4 block): 256 for llama.cpp's K-quants, whose
    rows must be whole 256-blocks (export gguf --quant q4_k_m: a row that is not falls back to Q5_0 or Q8_0, larger
    and slower)."""

    @property
    def whole_step(self) -> bool:
        """Whether the budget is the whole decode step (``--speedup``, its time measured at ``--precision``) rather
        than the projections' MACs (``--mac-ratio``): the one place this is decided."""
        return self.speedup is not None

    def check(self, c: Checks) -> Checks:
        if self.mac_ratio is None and self.speedup is None:
            c.add("--mac-ratio: --one-shot needs the projection-MAC speed-up to compress to (e.g. --mac-ratio 1.5; "
                  "or with --precision, --speedup S: the whole decode speed-up)")
        if self.mac_ratio is not None and self.speedup is not None:
            c.add(f"--speedup {shown(self.speedup)}: give --mac-ratio or --speedup, not both")
        if self.speedup is not None and self.precision is None:
            c.add(f"--speedup {shown(self.speedup)}: needs --precision P (the decode step it predicts is measured "
                  "at P)")
        c.number("mac_ratio", self.mac_ratio, lo=1.0)
        c.number("speedup", self.speedup, lo=1.0)
        for name in ("calib_tokens", "eval_tokens"):
            c.integer(name, getattr(self, name), lo=1)
        c.integer("seq_len", self.seq_len, lo=2, what=" (a block needs a token and its successor)")
        c.number("heldout_fraction", self.heldout_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        if self.precision is not None:
            c.choice("precision", self.precision, GENAI_PRECISIONS)
        quant_problem(c, self.quant, self.precision)
        self.pool.check(c)
        check_width_multiple(c, self.width_multiple)
        c.choice("streaming", self.streaming, STREAMING)
        c.text("data", self.data)
        check_forms(c, self.forms, self.precision, self.speedup)
        c.text("calib_data", self.calib_data)
        c.require(isinstance(self.correct, bool), f"--correct {shown(self.correct)}: must be true or false")
        return c

    @property
    def widths(self) -> int:
        """The multiple every kept input width is on (``width_multiple``, default the int4 block)."""
        return self.width_multiple or WIDTH_MULTIPLE

    @property
    def ratio(self) -> float:
        """The dial: --mac-ratio, or --speedup."""
        return self.mac_ratio if self.mac_ratio is not None else self.speedup

    @property
    def form_names(self) -> tuple[str, ...]:
        return form_names(self.forms)
