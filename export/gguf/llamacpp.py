"""llama.cpp itself, through llama-cpp-python (the ``[llamacpp]`` extra, built from the registry's source package):
its quantizer (``llama_model_quantize``: K-quants, which numpy cannot write) and the checks of an exported GGUF file.

The checks load the file as a user's llama.cpp would (``Llama``, memory-mapped) and hold it to PyTorch, fp32:

- the tokenizer: llama.cpp's tokens of ``TOKENIZER_LINES`` held-out lines against the Hugging Face tokenizer's,
  refused below ``TOKENIZER_AGREEMENT`` of them identical (a wrong pre-tokenizer or merge table turns most lines into
  other ids), every line that differs counted and the first shown. A preset's folder, made by transformers from its
  GGUF, agreed on 983 (SmolLM2: GPT-2's split without its digits one by one) and 993 (Gemma 3: its runs of spaces
  merged as BPE pieces, not matched whole as SentencePiece matches user-defined pieces) of 1,000 held-out lines
  until ``models.sources.own_tokenizer_rules`` gave back what the conversion lost: both now 1,000;
- the logits of ``LOGIT_PROMPTS`` held-out prompts: at f16 within ``F16_TOLERANCE`` of the largest logit (f16
  weights round each product's inputs at 2^-11, and llama.cpp accumulates in its own order), every file reporting
  its largest difference and its argmax agreement;
- the held-out perplexity of ``--quality-tokens`` tokens in llama.cpp against PyTorch's on the same blocks: a file
  above ``--max-ppl-change`` is refused, as ``export genai`` refuses a rounded graph.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import numpy as np

from bdlora.base.errors import BdloraError
from bdlora.base.reporter import SILENT, Reporter
from bdlora.export.gguf.reference import Reference

TOKENIZER_LINES = 1000
TOKENIZER_AGREEMENT = 0.95
LOGIT_PROMPTS, PROMPT_TOKENS = 3, 32
F16_TOLERANCE = 0.01  # of the largest |logit| on the prompt (SmolLM2-135M: 0.083 of 38.9, 0.2%)
CONTEXT = 512  # llama.cpp's context for the checks (a block and its prompt fit)


class GgufValidationError(BdloraError):
    exit_code = 1


def available():
    """A ``LlamaCpp`` when llama-cpp-python imports here, else None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    return LlamaCpp()


class LlamaCpp:
    """llama.cpp's quantizer and checks (``available``)."""

    def quantize(self, src: Path, dst: Path, quant: str, threads: int) -> dict:
        """``src`` (F16) rounded into ``dst`` by llama.cpp's ``llama_model_quantize`` at ``quant``."""
        import llama_cpp
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # its errors only: not a line per tensor
        ftype = {"q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
                 "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[quant]
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.nthread = int(threads)
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
        if rc != 0 or not dst.is_file():
            raise GgufValidationError(f"llama.cpp's quantizer failed on {src.name} ({rc})")
        return {"quantizer": "llama.cpp (llama_model_quantize)", "llama_cpp_python": llama_cpp.__version__}

    def load(self, path: Path, threads: int | None, context: int = CONTEXT, repack: bool = False,
             logits_all: bool = True):
        """The file in llama.cpp (``threads`` None: llama-cpp-python's default; ``logits_all``: every position's
        logits kept). ``repack`` False: without its weight repacking ("extra buffer types"): on an Intel machine
        with AMX, llama.cpp 0.3.36's AMX repack of Q8_0 and Q4_0 weights crashed (a segmentation fault in
        ``llama_decode``) whenever a batch held more than one token, on SmolLM2-135M and on files its own quantizer
        wrote; the checks compare numbers, which the plain CPU kernels give (``repacks`` says where timings may
        repack)."""
        from llama_cpp import Llama
        from llama_cpp import llama_cpp as low  # the binding Llama() reads its defaults from

        default = low.llama_model_default_params

        def plain():
            params = default()
            params.use_extra_bufts = repack
            return params

        low.llama_model_default_params = plain  # what Llama() builds its model parameters from
        kw = {} if threads is None else {"n_threads": threads, "n_threads_batch": threads}
        try:
            return Llama(model_path=str(path), n_ctx=context, n_batch=context, logits_all=logits_all,
                         verbose=False, **kw)
        finally:
            low.llama_model_default_params = default

    def validate(self, path: Path, model_dir: Path, settings, reporter: Reporter = SILENT) -> dict:
        """The three checks of the module docstring on the file at ``path`` exported from ``model_dir``."""
        import llama_cpp

        ref = Reference(model_dir, settings.quality_tokens)
        reporter.stage(f"loading {path.name} in llama.cpp (llama-cpp-python {llama_cpp.__version__})")
        llm = self.load(path, settings.pool.count, max(CONTEXT, ref.blocks.seq_len + 1))
        out: dict = {"llama_cpp_python": llama_cpp.__version__}
        reporter.stage(f"llama.cpp's tokenisation of {TOKENIZER_LINES:,} held-out lines against the tokenizer's")
        out["tokenizer"] = tokenizer_check(llm, ref.tok, ref.lines(TOKENIZER_LINES))
        reporter.stage(f"logits of {LOGIT_PROMPTS} held-out prompts of {PROMPT_TOKENS} tokens against PyTorch (fp32)")
        out["logits"] = logit_check(llm, ref, settings.quant)
        reporter.stage(f"held-out perplexity of {len(ref.blocks) * ref.blocks.seq_len:,} tokens in llama.cpp and in "
                       "PyTorch (fp32)")
        out["quality"] = quality_check(llm, ref, settings.max_ppl_change, settings.quant, reporter)
        llm.close()
        return out


def repacks() -> bool:
    """Whether llama.cpp may repack weights here as it does by default (what a user runs, timed as such): not on a
    CPU with AMX, where its AMX repack crashed batched decode (``LlamaCpp.load``)."""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return True
    return "amx_int8" not in flags.split()


def eval_logits(llm, ids) -> np.ndarray:
    """(len(ids), vocab) logits of every position of ``ids`` from a fresh context."""
    llm.reset()
    llm.eval([int(t) for t in ids])
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def tokenizer_check(llm, tok, lines: list[str]) -> dict:
    differ = []
    for line in lines:
        want = tok.encode(line, add_special_tokens=False)
        got = llm.tokenize(line.encode("utf-8"), add_bos=False, special=False)
        if list(got) != list(want):
            differ.append({"line": line[:80], "hf": list(want)[:12], "llama.cpp": list(got)[:12]})
    out = {"lines": len(lines), "identical": len(lines) - len(differ), "differ": differ[:3]}
    if len(lines) - len(differ) < TOKENIZER_AGREEMENT * len(lines):
        raise GgufValidationError(f"llama.cpp tokenises {len(differ)} of {len(lines)} held-out lines differently from "
                                  f"the model's tokenizer (first: {differ[0]['line'][:60]!r}); the GGUF's tokenizer "
                                  "keys do not match it")
    return out


def logit_check(llm, ref, quant: str) -> dict:
    worst, scale, agree, total = 0.0, 0.0, 0, 0
    for ids in ref.prompts(LOGIT_PROMPTS, PROMPT_TOKENS):
        got = eval_logits(llm, ids)
        want = ref.logits(ids)
        worst = max(worst, float(np.abs(got - want).max()))
        scale = max(scale, float(np.abs(want).max()))
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
    out = {"max_abs_diff": worst, "max_abs_logit": scale, "argmax_agreement": agree / max(total, 1),
           "tolerance": F16_TOLERANCE * scale if quant == "f16" else None, "positions": total}
    if quant == "f16" and worst > F16_TOLERANCE * scale:
        raise GgufValidationError(f"llama.cpp's logits differ from PyTorch's by {worst:.3g} at f16, above "
                                  f"{F16_TOLERANCE:g} of the largest logit ({scale:.3g}): the file is not the model")
    return out


def blocks_nll(llm, blocks, reporter: Reporter = SILENT) -> tuple[float, int]:
    """(summed next-token NLL, positions) of every block in llama.cpp, each from an emptied context: the positions
    ``models.runtime.score_blocks`` and PyTorch's ``mean_nll`` score, so the figures compare."""
    total, n = 0.0, 0
    reporter.count(0, len(blocks), "blocks")
    for i in range(len(blocks)):
        ids = blocks.get([i])[0]
        logits = eval_logits(llm, ids).astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        total -= float(logp[np.arange(len(ids) - 1), ids[1:]].sum())
        n += len(ids) - 1
        reporter.count(1, len(blocks), "blocks")
    return total, n


def perplexity(path: Path, blocks, threads: int | None, reporter: Reporter = SILENT) -> dict:
    """The held-out perplexity of the GGUF file at ``path`` in llama.cpp on ``blocks`` (bench's front rows)."""
    llm = LlamaCpp().load(path, threads, max(CONTEXT, blocks.seq_len + 1))
    try:
        nll, n = blocks_nll(llm, blocks, reporter)
    finally:
        llm.close()
    return {"ppl": math.exp(nll / max(n, 1)), "tokens": len(blocks) * blocks.seq_len}


def quality_check(llm, ref, max_change: float, quant: str, reporter: Reporter = SILENT) -> dict:
    nll_gguf, n = blocks_nll(llm, ref.blocks, reporter)
    ppl_gguf = math.exp(nll_gguf / max(n, 1))
    ppl_torch = math.exp(ref.nll())
    change = ppl_gguf / ppl_torch - 1
    out = {"ppl_torch": ppl_torch, "ppl_gguf": ppl_gguf, "ppl_change": change, "tokens": n,
           "max_ppl_change": max_change}
    if change > max_change:
        raise GgufValidationError(f"{quant} in llama.cpp raises held-out perplexity by {change:.1%} ({ppl_torch:.4g} "
                                  f"-> {ppl_gguf:.4g}), above --max-ppl-change {max_change:g}; export q8_0 or f16, or "
                                  "pass a larger --max-ppl-change to accept it")
    return out
