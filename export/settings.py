"""``GenaiExportConfig``: how a model becomes an onnxruntime-genai folder (precision, rounding scheme, LM head bits,
8-bit share, calibration, context, threads, the quality gate), every default in one place. ``bdlora export genai``
builds one from its flags, ``export_genai_folder`` and ``write_genai_files`` take it, and
``BenchConfig.settings_for`` derives one for every folder the bench writes (from the bench's flags, per model and
precision). Standard library only, so the torch-free CLI shows the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bdlora.base.errors import Checks
from bdlora.base.outputs import DEFAULT_STREAMING, STREAMING
from bdlora.base.schemes import (
    DEFAULT_SCHEME,
    FLOAT,
    GENAI_PRECISIONS,
    METHODS,
    MIXED,
    ROUNDED,
    SCHEMES,
    Scheme,
    mixed,
    rounded,
)
from bdlora.base.settings import Settings
from bdlora.base.threads import ThreadPool
from bdlora.forms import declared_head_bits

HEAD_BITS = 8  # the LM head's bits in an int4 graph when neither --head-bits nor the folder says
# --quality-tokens: 1 scored one block and 99,999,999,999 ran for as long as the slice lasted, neither refused
MIN_QUALITY_TOKENS, MAX_QUALITY_TOKENS = 16, 1 << 20


@dataclass(frozen=True)
class GenaiExportConfig(Settings):
    precision: str = FLOAT
    """fp32, int8 or int4 (MatMulNBits, block 32; int4 keeps the LM head at --head-bits)."""
    quant: str = DEFAULT_SCHEME
    """How int8/int4 weights are rounded (bdlora.base.schemes):"""
    head_bits: int | None = None
    """int4: the LM head's bits, 8 or 4 (4 is where small models degrade first). Default: what the model's folder
    declares (bdlora_head_bits, chosen by compress --one-shot --forms bits --speedup S), else 8."""
    int8_share: float = 0.0
    """int4 with a calibrated scheme: the share of the projection weights kept at 8 bits, those whose rounding hurts
    most."""
    calib_tokens: int = 32768
    """A calibrated scheme: training-split tokens each MatMul's input is measured on (128 blocks of 256)."""
    context_length: int | None = None
    """Longest sequence the folder generates (default: the model's positions, at most 4096)."""
    pool: ThreadPool = ThreadPool()
    """--threads: written into genai_config.json (0: none, and onnxruntime-genai then runs on one thread)."""
    spin: bool = True
    """The folder's intra-op threads spin between calls (onnxruntime's default); --no-spin writes them to sleep
    instead. Measured at Llama-3.2-1B shapes, int4, 2 threads: 8% slower on a quiet machine (44.8 against 41.4
    ms/token), 16% faster with one core busy (99.0 against 118.5; the builder's one-thread default 106.9)."""
    max_ppl_change: float = 0.10
    """int8/int4: the export is refused if held-out perplexity rises by more than this fraction over fp32."""
    quality_tokens: int | None = None
    """int8/int4: held-out tokens that check scores through the fp32 and rounded graphs (default: the slice the
    model's run was scored on, or 32,768 builtin tokens). At 1B-8B each token costs two full forwards: fewer finish
    sooner, more measure closer; export.json records how many were scored."""
    streaming: str = DEFAULT_STREAMING
    """on: read, emit, round and write one layer at a time (what a 1B-8B model needs; no fp32 model or graph is
    held; GPTQ measures its inputs one layer at a time; the parity check runs on the model cut to its first layers,
    the quality against PyTorch streamed layer by layer); off: hold the model in fp32; auto: on when the fp32
    weights pass 2 GiB (and no --int8-share, which ranks the whole graph)."""
    validate: bool = True
    """Check the folder against PyTorch before it is published."""

    @property
    def scheme(self) -> Scheme:
        return SCHEMES[self.quant]

    @property
    def calibrated(self) -> bool:
        """Whether this export rounds against measured inputs (a calibrated scheme at int8/int4)."""
        return rounded(self.precision) and self.scheme.calibrated

    def at(self, precision: str, **changes) -> GenaiExportConfig:
        """The same settings at another precision (options that do nothing there back at their defaults)."""
        if not rounded(precision):
            changes = {"quant": DEFAULT.quant, **changes}
        if not mixed(precision):
            changes = {"head_bits": DEFAULT.head_bits, "int8_share": DEFAULT.int8_share, **changes}
        return replace(self, precision=precision, **changes)

    def resolved(self, config) -> GenaiExportConfig:
        """These settings for one model (``config``: its config object or dict): ``head_bits`` None becomes the
        width its folder declares for the LM head at int4, else ``HEAD_BITS``."""
        if self.head_bits is not None:
            return self
        declared = declared_head_bits(config) if mixed(self.precision) else 0
        return replace(self, head_bits=declared or HEAD_BITS)

    @property
    def suffix(self) -> str:
        """The folder suffix ``export genai`` and the bench give this export (``-int4``, ``-int4-gptq``)."""
        if not rounded(self.precision):
            return ""
        return f"-{self.precision}" + ("" if self.quant == DEFAULT.quant else f"-{self.quant}")

    def check(self, c: Checks) -> Checks:
        """Every bad value, and every option that would do nothing at this precision (refused, never ignored)."""
        c.choice("precision", self.precision, GENAI_PRECISIONS)
        if not c.choice("quant", self.quant, METHODS):
            return c
        if self.head_bits is not None:
            c.choice("head_bits", self.head_bits, (4, 8))
        c.require(rounded(self.precision) or self.quant == DEFAULT.quant,
                  f"--quant {self.quant}: rounds quantised graphs only; --precision {self.precision} has nothing to "
                  f"round (give --precision {' or '.join(ROUNDED)})")
        c.require(self.precision not in GENAI_PRECISIONS or mixed(self.precision)
                  or self.head_bits in (None, HEAD_BITS),
                  f"--head-bits {self.head_bits}: sets the LM head's bits of an {MIXED} graph; at --precision "
                  f"{self.precision} the head keeps {'8 bits' if rounded(self.precision) else self.precision} (give "
                  f"--precision {MIXED})")
        c.integer("calib_tokens", self.calib_tokens, lo=1)
        if c.number("int8_share", self.int8_share, lo=0.0, hi=1.0):
            c.require(not self.int8_share or self.scheme.calibrated,
                      f"--int8-share {self.int8_share}: is chosen by a calibrated scheme's measured errors (give "
                      f"--quant {', '.join(s.name for s in SCHEMES.values() if s.calibrated)})")
        if c.integer("quality_tokens", self.quality_tokens, lo=MIN_QUALITY_TOKENS, hi=MAX_QUALITY_TOKENS,
                     what=" (held-out tokens: at least a block's worth to mean anything, at most what a check "
                          "finishes in hours at 8B)"):
            c.require(self.quality_tokens is None or rounded(self.precision),
                      f"--quality-tokens {self.quality_tokens}: scores a rounded graph against fp32; --precision "
                      f"{self.precision} rounds nothing")
        if c.choice("streaming", self.streaming, STREAMING):
            c.require(self.streaming != "on" or not self.int8_share,
                      f"--streaming on: --int8-share {self.int8_share} ranks every MatMul's rounding error over the "
                      "whole graph before any is written, which a streamed export never holds (give --streaming off)")
        c.integer("context_length", self.context_length)  # its bound is the model's positions: context_length_of
        self.pool.check(c, written=True)
        c.require(isinstance(self.max_ppl_change, int | float) and 0 <= self.max_ppl_change < float("inf"),
                  f"--max-ppl-change {self.max_ppl_change}: must be a finite fraction >= 0 (0.1 = 10%)")
        return c


DEFAULT = GenaiExportConfig()


GGUF_QUANTS = ("f16", "q8_0", "q4_0", "q4_k_m")  # export.gguf.layout.QUANTS: the torch-free CLI reads them here
GGUF_PPL_CHANGE = 0.10
# The GGUF type llama.cpp users pick at each precision: int4 -> Q4_K_M (llama.cpp's and Ollama's usual 4-bit file)
GGUF_OF = {"int4": "q4_k_m", "int8": "q8_0", "fp32": "f16"}


@dataclass(frozen=True)
class GgufExportConfig(Settings):
    quant: str = "q8_0"
    """f16, q8_0 or q4_0 (written by the gguf package), or q4_k_m (rounded by llama.cpp's own quantizer: the
    [llamacpp] extra)."""
    merge_lowrank: bool = False
    """Multiply low-rank pairs out into dense weights (llama.cpp has no low-rank form; their speed-up is lost).
    Without it a student holding any is refused: give it --forms channels,groups,layers."""
    quality_tokens: int = 2048
    """Held-out tokens the GGUF's perplexity (in llama.cpp) and the source's (PyTorch, fp32) are scored on."""
    max_ppl_change: float = GGUF_PPL_CHANGE
    """The export is refused if llama.cpp's held-out perplexity is above PyTorch's fp32 by more than this fraction."""
    pool: ThreadPool = ThreadPool()
    """--threads: llama.cpp's threads in the checks (default: this machine's usable cores)."""
    validate: bool = True
    """Check the folder against PyTorch before it is published."""  # export genai's words: in llama.cpp itself
    # with the [llamacpp] extra (tokenizer, logits, held-out perplexity), else its structure read back

    def check(self, c: Checks) -> Checks:
        c.choice("quant", self.quant, GGUF_QUANTS)
        c.integer("quality_tokens", self.quality_tokens, lo=MIN_QUALITY_TOKENS, hi=MAX_QUALITY_TOKENS)
        c.require(isinstance(self.max_ppl_change, int | float) and 0 <= self.max_ppl_change < float("inf"),
                  f"--max-ppl-change {self.max_ppl_change}: must be a finite fraction >= 0 (0.1 = 10%)")
        self.pool.check(c)
        return c
