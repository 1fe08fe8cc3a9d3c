"""``BenchConfig``: what ``bdlora bench`` times and how, with one validator (standard library only; onnxruntime is
asked which providers it has when a provider is checked)."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field

from bdlora.base.errors import Checks, UsageError, flag
from bdlora.base.schemes import GENAI_PRECISIONS, SCHEMES, mixed, rounded
from bdlora.base.schemes import METHODS as QUANT_METHODS
from bdlora.base.settings import Settings
from bdlora.base.threads import ThreadPool
from bdlora.bench.front import DEPLOYED
from bdlora.export.settings import DEFAULT as GENAI
from bdlora.export.settings import GGUF_QUANTS, GenaiExportConfig

NO_DOMAIN = "none"  # --eval-data none: the front has no second domain

SCOPES = ("modules", "model", "both")
RUNTIMES = ("ort", "genai", "llamacpp")  # --runtime takes any of them, comma-separated, or an alias
ALIASES = {"both": ("ort", "genai"), "all": RUNTIMES}
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# The fields of export genai's settings that bench takes as its own options (the rest are each row's: its precision,
# or the bench's: no validation against PyTorch, the bench scores every folder itself).
ROUNDING = ("quant", "head_bits", "int8_share")


@dataclass
class BenchConfig(Settings):
    scope: str = "both"
    """modules (replaced projections only), model (whole decoder) or both."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    """Batch sizes."""
    seq_lens: list[int] = field(default_factory=lambda: [128, 512])
    """Prefill lengths (and decode cache lengths)."""
    decode_tokens: int = 64
    """Tokens decoded per decode measurement."""
    pool: ThreadPool = ThreadPool()
    """--threads: of every timing (each folder's genai_config.json asks for it too)."""
    provider: str = "cpu"
    """cpu or cuda (needs onnxruntime-gpu)."""
    repeats: int = 10
    """Timed repeats per figure (after warm-up)."""
    warmup: int = 2
    """Untimed warm-up repeats."""
    opt_level: str = "all"
    """onnxruntime graph optimisation level of every session."""
    int8: bool = False
    """Model scope: also time dynamic-int8 graphs of dense and compressed."""
    optimize: bool = False
    """Model scope: every variant's norms and rotary as onnxruntime's fused contrib ops (export onnx --optimize)."""
    runtime: str = "ort"
    """ort (our ONNX graphs, InferenceSession), genai (bdlora export genai folders driven by og.Generator, beside
    onnxruntime-genai's own builder), llamacpp (bdlora export gguf files in llama.cpp, batch 1; the [llamacpp]
    extra), several comma-separated (genai,llamacpp: timed interleaved in one process, on one front), both (ort,genai)
    or all."""
    genai_precisions: list[str] = field(default_factory=lambda: ["fp32", "int8", "int4"])
    """genai runtime: precisions of every variant (fp32, int8, int4; MatMulNBits)."""
    gguf_quants: list[str] = field(default_factory=lambda: ["q8_0", "q4_0", "q4_k_m"])
    """llamacpp runtime: the GGUF types every folder is exported at (f16, q8_0, q4_0, q4_k_m; low-rank modules
    multiplied out, as export gguf --merge-lowrank does)."""
    peers: bool = True
    """genai runtime: also time the dense model (and the teacher) converted by onnxruntime-genai's own builder (fp32,
    int4)."""
    own_forms: bool = True
    """genai runtime: also export, time and score the model's own dense and LoRA forms (its function with every
    projection dense, and dense beside an unmerged adapter), the rows its speed-up vs dense and vs LoRA is measured
    against; --no-own-forms when the teacher's rows are the comparison (ship's bench: at 1B they are two more
    teacher-sized folders exported, timed and scored on every domain)."""
    teacher: bool = True
    """genai runtime: also export and time the model's teacher at every precision, and put every folder on the
    quality/speed front with its held-out perplexity."""
    quality_tokens: int | None = None
    """genai runtime: held-out tokens each folder's perplexity is measured on (default: as many as the model's run
    reported its perplexity on, at most 32768, so the front's figures are the run's; 8192 when it has no run; 0: no
    perplexity, no front)."""
    rounding: GenaiExportConfig = GENAI
    """genai runtime: how every int8/int4 folder is rounded: export genai's own settings (``--quant``,
    ``--head-bits``, ``--int8-share``; ``ROUNDING``), for the student and, unless --teacher-quant says otherwise,
    the teacher; each row's precision is its own (``settings_for``)."""
    teacher_quant: str | None = None
    """genai runtime: how the teacher's int8/int4 weights are rounded (default: as --quant), so each side of the
    front is at its best: e.g. affine for a teacher from a Q4_1 GGUF, gptq for a trained student."""
    eval_data: str | None = None
    """genai runtime: a second corpus every front row is also scored on (its held-out split), a domain no row was
    calibrated or healed on, with the front marked on it too (default for a general-purpose model: the first of
    fortunes, prose, builtin that the model's run neither trained nor calibrated on; none: no second domain)."""
    icl: bool = False
    """genai runtime: also the ICL composite (eval's 19 probes, 10-shot, 3 seeds) of the student's and the
    teacher's row at every precision, beside its perplexity (each on a plain-layout twin rounded the same way)."""
    icl_examples: int = 50
    """With --icl: prompts per probe and seed (eval's default 50; fewer is faster and noisier)."""
    speculative: bool = False
    """genai runtime: also time the teacher's export with this folder's export at the same precision as its
    speculative-decoding draft, and with prompt lookup (batch 1, greedy, prompts of every front domain): the output is
    the teacher's, so these rows have its perplexity; acceptance and tokens per teacher call per domain."""
    fixed_widths: bool = True
    """With --speculative: also time fixed proposal widths (the draft at 1-4 tokens a call, prompt lookup at 4) beside
    the adaptive policy, to show what each width buys; --no-fixed-widths times the adaptive draft and lookup alone
    (the front's rows, and ship's: at 1B the fixed widths were 5 of the 8 timed configurations)."""

    def check(self, c: Checks, max_positions: int | None = None) -> Checks:
        """Every problem at once; with ``max_positions``, sequence lengths are bounded by the model's context."""
        c.choice("scope", self.scope, SCOPES)
        for name, values in (("batch_sizes", self.batch_sizes), ("seq_lens", self.seq_lens)):
            c.require(bool(values), f"{flag(name)}: empty list; give at least one value")
            for v in values:
                c.integer(name, v, lo=1)
        if max_positions is not None:
            need = max(self.seq_lens, default=0) + (self.decode_tokens if self.scope != "modules" else 0)
            c.require(self.scope == "modules" or need <= max_positions,
                      f"--seq-lens {max(self.seq_lens)} (+ --decode-tokens {self.decode_tokens}): above the model's "
                      f"context of {max_positions} positions")
        c.integer("repeats", self.repeats, lo=1)
        c.integer("warmup", self.warmup, lo=0)
        c.integer("decode_tokens", self.decode_tokens, lo=1)
        self.pool.check(c)
        c.choice("provider", self.provider, tuple(PROVIDERS))
        self._check_runtimes(c)
        c.require(bool(self.genai_precisions), "--genai-precisions: empty list; give at least one of "
                  + ", ".join(GENAI_PRECISIONS))
        for p in self.genai_precisions:
            c.choice("genai_precisions", p, GENAI_PRECISIONS)
        twice = sorted({p for p in self.genai_precisions if self.genai_precisions.count(p) > 1})
        c.require(not twice, f"--genai-precisions {','.join(map(str, self.genai_precisions))}: "
                             f"{', '.join(map(str, twice))} given twice (each precision is one folder)")
        c.integer("quality_tokens", self.quality_tokens, lo=0)
        if c.choice("quant", self.rounding.quant, QUANT_METHODS):
            self.settings_for("compressed", "int4").check(c)  # the student's int4 folder, as it will be written
        if self.teacher_quant is not None:
            c.choice("teacher_quant", self.teacher_quant, QUANT_METHODS)
        quant, share = self.rounding.quant, self.rounding.int8_share
        calibrated = [q for q in (quant, self.teacher_quant) if q in SCHEMES and SCHEMES[q].calibrated]
        c.require(not share or calibrated or quant not in SCHEMES,
                  f"--int8-share {share}: is chosen by a calibrated scheme's measured errors (give --quant "
                  f"or --teacher-quant {', '.join(s.name for s in SCHEMES.values() if s.calibrated)})")
        c.text("eval_data", self.eval_data)
        c.integer("icl_examples", self.icl_examples, lo=1)
        c.require(not self.icl or "genai" in self.runtimes,
                  f"--icl: the ICL of the front's rows needs --runtime genai or both (not {self.runtime})")
        c.require(not self.speculative or "genai" in self.runtimes,
                  f"--speculative: times the teacher's genai export speculating (--runtime genai or both, not "
                  f"{self.runtime})")
        c.require(self.own_forms or "ort" not in self.runtimes,
                  f"--no-own-forms: leaves the dense and LoRA rows out of the genai bench (--runtime genai, not "
                  f"{self.runtime}: the ort scopes are measured against them)")
        c.require(self.fixed_widths or self.speculative, "--no-fixed-widths: is about --speculative's timings (give "
                  "--speculative, or leave it out)")
        c.require(not self.speculative or self.quality_tokens != 0,
                  "--speculative: its prompts are the front's held-out text; --quality-tokens 0 scores none (give a "
                  "positive count)")
        c.require(not self.deployed or self.provider == "cpu",
                  f"--runtime {self.runtime}: the genai and llama.cpp benches run on cpu (--provider {self.provider})")
        return c

    def validate(self, max_positions: int | None = None) -> BenchConfig:
        """Every problem at once (``check``), then the provider looked up; with ``max_positions``, sequence lengths
        are bounded by the model's context."""
        self.check(Checks(), max_positions).done()
        provider_name(self.provider)
        return self

    def _check_runtimes(self, c: Checks) -> None:
        """--runtime's names, and llama.cpp's: the binding installed, --gguf-quants each one of export gguf's."""
        parts = [p.strip() for p in str(self.runtime).split(",")]
        for part in parts:
            c.choice("runtime", part, (*RUNTIMES, *ALIASES))
        c.require("llamacpp" not in self.runtimes or llama_cpp_here(),
                  f"--runtime {self.runtime}: llama.cpp's rows need llama-cpp-python (pip install -e \".[llamacpp]\", "
                  "built from the registry's source package)")
        c.require(bool(self.gguf_quants), "--gguf-quants: empty list; give at least one of " + ", ".join(GGUF_QUANTS))
        for q in self.gguf_quants:
            c.choice("gguf_quants", q, GGUF_QUANTS)
        twice = sorted({q for q in self.gguf_quants if self.gguf_quants.count(q) > 1})
        c.require(not twice, f"--gguf-quants {','.join(map(str, self.gguf_quants))}: {', '.join(map(str, twice))} "
                             "given twice (each type is one file)")

    @property
    def runtimes(self) -> tuple[str, ...]:
        """--runtime as the runtimes it names, in ``RUNTIMES`` order (unknown names left to ``validate``)."""
        named = set()
        for part in str(self.runtime).split(","):
            named.update(ALIASES.get(part.strip(), (part.strip(),)))
        return tuple(r for r in RUNTIMES if r in named)

    @property
    def deployed(self) -> bool:
        """Whether any runtime users deploy in is benched (genai, llamacpp): the quality/speed front is built."""
        return any(r in DEPLOYED for r in self.runtimes)

    def quant_of(self, model: str) -> str:
        """How ``model``'s int8/int4 weights are rounded (a front row's model: "teacher", "compressed", an --also, a
        ``peer-`` healed dense model, rounded as the teacher is)."""
        reference = model == "teacher" or model.startswith("peer-")
        return self.teacher_quant if reference and self.teacher_quant else self.rounding.quant

    def settings_for(self, model: str, precision: str, **changes) -> GenaiExportConfig:
        """How the bench exports ``model`` at ``precision`` (what ``export genai`` would be given; the bench times
        and scores its folders itself, so none validates against PyTorch)."""
        quant = self.quant_of(model)
        if not rounded(precision):
            return GENAI.at(precision, validate=False, **changes)
        r = self.rounding
        return dataclasses.replace(r, precision=precision, quant=quant,
                                   head_bits=r.head_bits if mixed(precision) else GENAI.head_bits,
                                   int8_share=r.int8_share if mixed(precision) and SCHEMES[quant].calibrated else 0.0,
                                   validate=False, **changes)

    @property
    def calibrated(self) -> bool:
        """Whether any folder of the run rounds against measured inputs."""
        return any(SCHEMES[q].calibrated for q in (self.rounding.quant, self.teacher_quant) if q is not None)


def llama_cpp_here() -> bool:
    """Whether llama-cpp-python is installed (found, not imported: a bad flag is refused in a second)."""
    return importlib.util.find_spec("llama_cpp") is not None


def provider_name(provider: str) -> str:
    import onnxruntime as ort

    if provider not in PROVIDERS:
        raise UsageError(f"--provider {provider!r}: unknown (allowed: {', '.join(PROVIDERS)})")
    available = ort.get_available_providers()
    if PROVIDERS[provider] not in available:
        raise UsageError(f"--provider {provider}: onnxruntime here has {', '.join(available)} (install "
                         "onnxruntime-gpu, the [gpu] extra, for cuda)")
    return PROVIDERS[provider]
