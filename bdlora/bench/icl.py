"""ICL beside every row of the quality/speed front (``bench --runtime genai --icl``): what the student and the
teacher can still *do* at each precision they ship in, not only their perplexity.

The probes run batched and left padded (``evaluate.run_icl``), which onnxruntime's GroupQueryAttention (the genai
graph's attention) does not take: it derives positions from the mask's row sums and, on the CPU, takes several new
tokens after a past only at batch 1. So each row's model is emitted again by the one decoder emitter in the plain
layout (explicit position ids; ``export onnx``'s graph) and rounded exactly as its genai folder was (same
quantiser, method, calibration and LM-head bits; both written by ``export.genai.folder.deployment``): the same
weights and kernels, only the attention op differs, in fp32. The builder's rows (onnxruntime-genai's own graphs)
have no plain twin and carry no ICL figure.
"""

from __future__ import annotations

import shutil

import torch.nn as nn

from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import row_name
from bdlora.bench.config import BenchConfig
from bdlora.eval.evaluate import run_icl
from bdlora.eval.targets import OrtLM
from bdlora.export.decoder import DecoderLayout, decoder_graph
from bdlora.export.defaults import MAX_OPSET
from bdlora.export.genai.folder import deployment
from bdlora.models.runtime import session

ICL_SHOTS, ICL_SEEDS = 10, 3  # eval's protocol (SPEC 7): 10-shot, 3 demonstration seeds


def icl_of_rows(models: dict[str, nn.Module], tok, precisions: list[str], words: list[str], examples: int,
                work, settings=BenchConfig().settings_for, calibration=None,
                reporter: Reporter = SILENT) -> dict[str, dict]:
    """{row: {"icl", "icl_std", "icl_examples"}} for every model at every precision (rows named as the genai bench
    names its folders: ``compressed``, ``compressed-int4``, ``teacher-int8``...): the ICL composite (macro mean over
    the 19 probes, %) and its std over demonstration seeds, ``examples`` prompts per task and seed; ``settings``:
    (model name, precision) -> how its genai folder is rounded."""
    out = {}
    for name, m in models.items():
        grams: dict = {}
        base, _ = decoder_graph(m, DecoderLayout.plain(m.config, MAX_OPSET))  # emitted once, rounded per precision
        for p in precisions:
            key = row_name(name, p)
            reporter.stage(f"ICL of {key}: {ICL_SEEDS} seeds x {examples} prompts per probe (plain-layout twin)")
            try:
                path = deployment(m, None, work / f"icl-{key}", settings(name, p), "plain", calibration, grams, base)
                res = run_icl(OrtLM(session(path), m.config), tok, words, shots=ICL_SHOTS, seeds=ICL_SEEDS,
                              examples=examples)
            finally:
                shutil.rmtree(work / f"icl-{key}", ignore_errors=True)
            out[key] = {"icl": res["macro"]["mean"], "icl_std": res["macro"]["std"], "icl_examples": examples}
    return out
