"""``bdlora ship``'s settings: one dataclass, its options generated from the fields (``cli/options.from_dataclass``)
and recorded in ``DIR/ship.json`` as the resume contract."""

from __future__ import annotations

from dataclasses import dataclass

from bdlora.base.errors import Checks, flag, shown
from bdlora.base.schemes import GENAI_PRECISIONS, METHODS, rounded
from bdlora.base.settings import Settings
from bdlora.base.threads import ThreadPool
from bdlora.bench.config import llama_cpp_here
from bdlora.export.settings import GGUF_OF, GGUF_QUANTS
from bdlora.forms import VOCAB, check_forms, check_width_multiple
from bdlora.train.stopping import parse_duration

DRAFT_FORMS = "layers,channels,vocab"  # the draft: fewer layers, narrower MLPs, a head over frequent tokens
NO_GGUF = "none"  # --gguf none: no llama.cpp rows


def numbers(text: str, name: str, c: Checks, lo: float, integer: bool = False) -> list[float]:
    """The comma-separated numbers of option ``name`` (each at least ``lo``), problems added to ``c``."""
    out = []
    for part in str(text).split(","):
        try:
            v = int(part) if integer else float(part)
        except ValueError:
            c.add(f"{flag(name)} {shown(text)}: {part.strip()!r} is not a number (comma-separated "
                  f"numbers of at least {lo:g})")
            return []
        if not v >= lo or v != v or v == float("inf"):
            c.add(f"{flag(name)} {shown(text)}: {v:g} is below {lo:g} (or not finite)")
            return []
        out.append(v)
    if len(set(out)) < len(out):
        c.add(f"{flag(name)} {shown(text)}: a value is given twice")
    return out


@dataclass
class ShipConfig(Settings):
    """Which folder to ship: the teacher's best export at --precision against students of it, side by side."""

    data: str = "builtin"
    """Calibration (and healing) corpus of every student, as train's --data; its held-out split is the front's first
    domain (a pretrained model on builtin calibrates on builtin:1,prose:1, as compress --one-shot does)."""
    eval_data: str | None = None
    """The second domain every row is scored on, one no student was calibrated or healed on (default: bench's, the
    first of fortunes, prose, builtin the data does not name; none: no second domain)."""
    precision: str = "int4"
    """What ships: fp32, int8 or int4 (MatMulNBits, block 32)."""
    schemes: str = "rtn,gptq,affine"
    """int8/int4: the teacher's rounding schemes tried; the one with the lowest held-out perplexity is the teacher's
    row every student is compared with."""
    student_quant: str | None = None
    """int8/int4: how the students are rounded (default: the teacher's chosen scheme)."""
    forms: str = "channels,groups"
    """The structures each student's one-shot chooses among (compress --one-shot --forms)."""
    speedups: str = "1.25,1.5"
    """The predicted whole decode speed-ups of the students (compress --one-shot --speedup), comma-separated."""
    draft_speedup: float = 4.0
    """The teacher's draft for speculative decoding (--forms layers,channels,vocab at this predicted speed-up),
    timed with prompt lookup beside the teacher's export (0: no draft, no speculative rows)."""
    heal_steps: int = 0
    """Heal every student, the draft and the dense teacher (the fair peer) with this many steps on --data (train
    --student-init --method kd-lora; the draft kd-full), then compare the healed folders (0: no healing)."""
    heal_time_budget: str | None = None
    """Heal every student and the draft for at most this long each (train --time-budget, e.g. 20m: loading, teacher
    text and calibration included) instead of --heal-steps; the dense peer then gets as many steps as the most any of
    them took, so it is never healed less."""
    heal_batch_size: int = 4
    """Sequences per healing step."""
    heal_seq_len: int = 128
    """Tokens per healing sequence."""
    tolerances: str = "0,1,5,10"
    """Perplexity tolerances (percent over the teacher's export, on each domain) the recommendation answers."""
    quality_tokens: int | None = None
    """Held-out tokens each row is scored on (bench's default when unset)."""
    repeats: int = 10
    """Timed repeats per figure in the bench."""
    decode_tokens: int = 64
    """Tokens decoded per decode measurement."""
    seq_len: int = 128
    """Prompt tokens before the timed decode (bench --seq-lens)."""
    width_multiple: int | None = None
    """Every width a pruned block keeps as a projection's input (an MLP's kept channels, an attention block's kept
    heads times their size) a multiple of this (default 32, the int4 block): 256 for llama.cpp's K-quants, whose
    rows must be whole 256-blocks (export gguf --quant q4_k_m: a row that is not falls back to Q5_0 or Q8_0, larger
    and slower)."""  # ship: the students' (compress --one-shot --width-multiple); the draft keeps the default grid
    gguf: str | None = None
    """llama.cpp's rows: the GGUF type the teacher and every student are also exported at (bdlora export gguf) and
    timed at in llama.cpp, interleaved with the genai rows, and recommended per runtime (default where
    llama-cpp-python is installed: --precision's, int4 q4_k_m, int8 q8_0, fp32 f16; none: no llama.cpp rows)."""
    pool: ThreadPool = ThreadPool()
    """--threads: of every measurement."""

    def check(self, c: Checks) -> Checks:
        c.choice("precision", self.precision, GENAI_PRECISIONS)
        bad = [s.strip() for s in str(self.schemes).split(",") if s.strip() not in METHODS]
        c.require(not bad, f"--schemes {shown(self.schemes)}: unknown scheme {', '.join(map(repr, bad))} (allowed: "
                           f"{', '.join(METHODS)}, comma-separated)")
        if self.student_quant is not None and c.choice("student_quant", self.student_quant, METHODS):
            c.require(self.rounded,
                      f"--student-quant {self.student_quant}: --precision {self.precision} rounds nothing")
        names = check_forms(c, self.forms, self.precision, 1.0)
        c.require(names is None or VOCAB.name not in names,
                  f"--forms {self.forms}: vocab is the draft's head (--draft-speedup makes the draft with "
                  f"{DRAFT_FORMS}); a student keeps every token (name channels, groups, layers or bits)")
        speedups = numbers(self.speedups, "speedups", c, 1.0)
        named = [f"{s:g}" for s in speedups]  # each student's folder is student-{s:g}
        twins = sorted({n for n in named if named.count(n) > 1})
        if twins and len(set(speedups)) == len(speedups):  # equal values are refused by numbers()
            c.add(f"--speedups {shown(self.speedups)}: {', '.join(str(v) for v in speedups if f'{v:g}' in twins)} "
                  f"would all be student-{twins[0]} (give speed-ups that differ in their first six digits)")
        numbers(self.tolerances, "tolerances", c, 0.0)
        c.number("draft_speedup", self.draft_speedup, lo=0.0)
        c.require(self.draft_speedup == 0 or self.draft_speedup >= 1,
                  f"--draft-speedup {shown(self.draft_speedup)}: 0 (no draft) or at least 1")
        c.integer("heal_steps", self.heal_steps, lo=0)
        if self.heal_time_budget is not None and c.text("heal_time_budget", self.heal_time_budget):
            try:
                parse_duration(self.heal_time_budget, "heal_time_budget")
            except ValueError as e:
                c.add(str(e))
            c.require(not self.heal_steps, f"--heal-time-budget {self.heal_time_budget}: sets each heal's steps "
                                           f"itself; drop --heal-steps {self.heal_steps}")
        c.integer("heal_batch_size", self.heal_batch_size, lo=1)
        c.integer("heal_seq_len", self.heal_seq_len, lo=2)
        c.integer("quality_tokens", self.quality_tokens, lo=1)
        c.integer("repeats", self.repeats, lo=1)
        c.integer("decode_tokens", self.decode_tokens, lo=1)
        c.integer("seq_len", self.seq_len, lo=1)
        self.pool.check(c)
        check_width_multiple(c, self.width_multiple)
        if self.gguf is not None and c.choice("gguf", self.gguf, (*GGUF_QUANTS, NO_GGUF)):
            c.require(self.gguf == NO_GGUF or llama_cpp_here(),
                      f"--gguf {self.gguf}: llama.cpp's rows need llama-cpp-python (pip install -e \".[llamacpp]\"), "
                      "or leave --gguf out")
        c.text("data", self.data)
        c.text("eval_data", self.eval_data)
        return c

    @property
    def heals(self) -> bool:
        """Whether the candidates are healed (by steps or by a time budget)."""
        return bool(self.heal_steps or self.heal_time_budget)

    @property
    def rounded(self) -> bool:
        return rounded(self.precision)

    def gguf_quant(self) -> str | None:
        """The GGUF type of llama.cpp's rows, or None: none asked, or by default where llama-cpp-python is not
        installed."""
        if self.gguf == NO_GGUF or (self.gguf is None and not llama_cpp_here()):
            return None
        return self.gguf or GGUF_OF[self.precision]

    def scheme_list(self) -> list[str]:
        return [s.strip() for s in self.schemes.split(",")] if self.rounded else []

    def speedup_list(self) -> list[float]:
        return numbers(self.speedups, "speedups", Checks(), 1.0)

    def tolerance_list(self) -> list[float]:
        return numbers(self.tolerances, "tolerances", Checks(), 0.0)
