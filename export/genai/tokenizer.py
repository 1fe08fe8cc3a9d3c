"""The tokenizer.json of an onnxruntime-genai folder: the model's, less what onnxruntime-genai's tokenizer cannot read.

onnxruntime-genai 0.18 tokenises with onnxruntime-extensions, which (a) never matches an added token whose
``normalized`` is true (it looks for the raw text, and normalised content such as ``▁▁▁`` never occurs in raw text)
and (b) decodes every added token literally (its content, ``▁`` and all, instead of through the decoder). A teacher
converted from a SentencePiece GGUF carries its user-defined pieces as such tokens (``models.sources.
own_tokenizer_rules``: Gemma 3's runs of 2-31 ``▁``, ids 138-167, matched whole as SentencePiece matches them), so in
onnxruntime-genai they would decode as ``▁▁def`` where the model says ``  def``.

Each of those tokens is already a piece of the vocabulary under the same id, so the genai folder drops the added-token
entry and keeps the piece: the model's ids and their meaning are unchanged, decoding is exact, and onnxruntime-genai
and the ``tokenizers`` library (which bdlora's server and eval use on a genai folder) tokenise alike. The one
difference from the model's own tokenizer is where a run of spaces longer than one piece is split: by the BPE merges
(35 spaces: 16 + 19) instead of longest-first (31 + 4); both are valid tokenisations the model has seen. The ONNX
folder and GGUF files keep the rules (onnxruntime via ``tokenizers``, llama.cpp from the GGUF's token types).
"""

from __future__ import annotations

import json
from pathlib import Path

from bdlora.base.io import write_json
from bdlora.base.runs import TOKENIZER_JSON


def readable_by_genai(folder: Path) -> dict | None:
    """Rewrite ``folder``'s tokenizer.json (atomically) without the non-special, normalised added tokens whose content
    is the vocabulary's piece for the same id (the module docstring says why); what was dropped, or None when nothing
    was (no tokenizer.json, or none such)."""
    path = Path(folder) / TOKENIZER_JSON
    if not path.is_file():
        return None
    spec = json.loads(path.read_text())
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    inverse = {i: p for p, i in vocab.items()} if isinstance(vocab, dict) else None

    def in_vocab(tok: dict) -> bool:
        token_id = tok.get("id")
        if not isinstance(token_id, int):
            return False
        if inverse is not None:
            return inverse.get(token_id) == tok.get("content")
        if isinstance(vocab, list) and 0 <= token_id < len(vocab):
            entry = vocab[token_id]
            return isinstance(entry, (list, tuple)) and bool(entry) and entry[0] == tok.get("content")
        return False

    added = spec.get("added_tokens") or []
    dropped = [t for t in added if t.get("normalized") and not t.get("special") and in_vocab(t)]
    if not dropped:
        return None
    spec["added_tokens"] = [t for t in added if t not in dropped]
    write_json(path, spec)
    ids = sorted(t["id"] for t in dropped)
    return {"dropped_added_tokens": len(dropped), "id_range": [ids[0], ids[-1]],
            "why": "onnxruntime-genai never matches normalized added tokens and decodes added tokens literally; "
                   "each is kept as the vocabulary piece of the same id"}
