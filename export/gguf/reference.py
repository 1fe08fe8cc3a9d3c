"""What a GGUF export is checked against: the source folder in PyTorch, fp32 (loaded whole up to 2 GiB of weights,
else read one layer at a time, ``models.stream``), its tokenizer, and held-out text and blocks of the corpus its
figures come from (the builtin corpus for a model without a recorded one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from bdlora.base.outputs import DEFAULT_STREAMING
from bdlora.data.corpora import open_corpus, parse
from bdlora.data.documents import BUILTIN, is_heldout
from bdlora.export.genai.folder import data_settings, heldout_for
from bdlora.models.load import load_model_folder
from bdlora.models.perplexity import mean_nll
from bdlora.models.runtime import DecoderShape
from bdlora.models.stream import lazy_folder_model, score_streamed, streamed, streams


class Reference:
    """The model of ``model_dir`` in PyTorch with ``tokens`` held-out tokens of its corpus in blocks."""

    def __init__(self, model_dir: Path, tokens: int):
        self.model_dir = Path(model_dir)
        self.lazy = streams(DEFAULT_STREAMING, self.model_dir)
        self.model, self.tok, self.report = (lazy_folder_model if self.lazy else load_model_folder)(self.model_dir)
        self.model.eval()
        self.settings = data_settings(self.model_dir, self.report)
        self.blocks = heldout_for(self.model_dir, self.report, self.tok, DecoderShape.of(self.model.config), tokens)

    @torch.no_grad()
    def logits(self, ids) -> np.ndarray:
        x = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
        if self.lazy:
            with streamed(self.model):
                return self.model(x).logits[0].float().numpy()
        return self.model(x).logits[0].float().numpy()

    def nll(self) -> float:
        """Mean next-token NLL of every block (the positions llama.cpp's perplexity scores)."""
        if self.lazy:
            return score_streamed(self.model, self.blocks)[0]
        return mean_nll(self.model, self.blocks)[0]

    def prompts(self, n: int, length: int) -> list[np.ndarray]:
        """``n`` prompts of ``length`` tokens, the first ones of the held-out blocks."""
        rows = self.blocks.get(range(min(n, len(self.blocks))))
        return [r[:length] for r in rows]

    def lines(self, n: int) -> list[str]:
        """Up to ``n`` non-empty lines of the held-out documents of the model's corpus (its first component; the
        builtin corpus when none is recorded)."""
        spec = parse(self.settings.get("data") or BUILTIN)[0].spec
        corpus = open_corpus(spec, self.settings.get("cache_dir"))
        fraction = self.settings.get("heldout_fraction") or corpus.default_heldout_fraction
        out: list[str] = []
        for doc in corpus.documents():
            if not is_heldout(doc.id, fraction):
                continue
            out += [line for line in doc.text.splitlines() if line.strip()][: n - len(out)]
            if len(out) >= n:
                break
        return out
