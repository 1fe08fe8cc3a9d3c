"""A model folder's tokenizer as llama.cpp reads it: the ``tokenizer.ggml.*`` keys of a GGUF file.

The file must turn text into the ids the folder's own tokenizer does: every figure bdlora measured, and a student's
calibration and healing, used that tokenizer. So:

1. A byte-level BPE ``tokenizer.json`` (GPT-2, Llama 3, Qwen2, SmolLM, the builtin teacher) is written as llama.cpp's
   ``convert_hf_to_gguf.py`` writes it (``_set_vocab_gpt2``): every id's token and type, the merges and special ids
   (``gguf.SpecialVocab``), the chat template, and the pre-tokenizer named by the hash of how the tokenizer splits
   ``CHECK_TEXT`` (``pretokenizers``). A hash llama.cpp does not know is refused, as its converter refuses it, except
   a plain ``ByteLevel`` pre-tokenizer, whose regex is GPT-2's (``gpt-2``). A folder made from a ``.gguf`` file is
   written from its own ``tokenizer.json`` too: transformers' conversion of SmolLM2's GGUF tokenizer keeps GPT-2's
   regex where llama.cpp's ``smollm`` splits digits one by one, and the original keys tokenised 17 of 1,000
   held-out lines otherwise than the folder's model was scored with.
2. A SentencePiece vocabulary (a byte-fallback BPE ``tokenizer.json``: Llama 2, Mistral, Gemma) takes the tokenizer
   keys of the GGUF file the model came from when it came from one (``GGUF_TOKENIZER``, saved beside a folder bdlora
   made from a ``.gguf`` file or a preset, ``models.sources``; a student carries its teacher's tokenizer, its files'
   digests compared), else ``gguf.LlamaHfVocab``, as the converter's ``_set_vocab_llama_hf``.

The checks in llama.cpp (``llamacpp.tokenizer_check``) hold the written keys to the folder's tokenizer on held-out
lines.
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path

from transformers import AutoTokenizer

from bdlora.base.errors import ModelError
from bdlora.base.io import read_json
from bdlora.base.runs import TOKENIZER_JSON
from bdlora.export.gguf.pretokenizers import CHECK_TEXT, PRE_TOKENIZERS, SPLITS
from bdlora.models.families import GGUF_SPM_TOKENIZER
from bdlora.models.integrity import tokenizer_digests
from bdlora.models.sources import GGUF_TOKENIZER

CONTROL_LOOKS = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")


def saved_keys(folder: Path, teacher: Path | None = None) -> Path | None:
    """The GGUF tokenizer keys that hold for ``folder``'s tokenizer: saved beside it, or beside ``teacher`` when the
    folder's tokenizer files are the teacher's (a student's), else None."""
    for where in (Path(folder), teacher):
        if where is not None and (Path(where) / GGUF_TOKENIZER).is_file() and (
                Path(where) == Path(folder) or tokenizer_digests(where) == tokenizer_digests(folder)):
            return Path(where) / GGUF_TOKENIZER
    return None


def token_count(folder: Path, vocab_size: int, teacher: Path | None = None) -> int:
    """The tokens the GGUF will list: the saved keys' where ``add_vocab`` copies them (a Gemma 3 embedding pads rows
    past them), else the model's vocabulary (a converter pads missing ids with ``[PADn]``)."""
    path = Path(folder) / TOKENIZER_JSON
    model = (json.loads(path.read_text(encoding="utf-8")).get("model") or {}) if path.is_file() else {}
    keys = None if model.get("type") == "BPE" and not model.get("byte_fallback") else saved_keys(folder, teacher)
    if keys is None:
        return vocab_size
    for entry in (read_json(keys).get("keys") or []):
        if isinstance(entry, dict) and entry.get("key") == "tokenizer.ggml.tokens":
            return len(entry.get("value") or [])
    raise ModelError(f"{keys}: lists no tokens (tokenizer.ggml.tokens); the folder is damaged")


def add_vocab(writer, folder: Path, vocab_size: int, teacher: Path | None = None) -> dict:
    """Add the tokenizer of ``folder`` (or, when its tokenizer files are ``teacher``'s, the GGUF keys saved beside
    that teacher) to ``writer``; returns what was written (source, model, pre-tokenizer, tokens)."""
    folder = Path(folder)
    path = folder / TOKENIZER_JSON
    spec = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    model = spec.get("model") or {}
    if model.get("type") == "BPE" and not model.get("byte_fallback"):
        return _gpt2(writer, folder, vocab_size, spec)
    keys = saved_keys(folder, teacher)
    if keys is not None:
        return _copied(writer, keys, token_count(folder, vocab_size, teacher))
    if not path.is_file():
        raise ModelError(f"{folder}: no tokenizer.json (a byte-level BPE or SentencePiece tokenizer is what llama.cpp "
                         "reads)")
    if model.get("type") == "BPE":
        return _llama_hf(writer, folder, vocab_size)
    raise ModelError(f"{path}: a {model.get('type')} tokenizer; llama.cpp's GGUF export here takes byte-level BPE "
                     "(GPT-2, Llama 3, Qwen2) and SentencePiece-style BPE (Llama 2, Mistral) tokenizers")


def _copied(writer, path: Path, vocab_size: int) -> dict:
    doc = read_json(path)
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, list) or not keys:
        raise ModelError(f"{path}: not the tokenizer keys of a GGUF file; the folder is damaged")
    import gguf

    tokens = 0
    for entry in keys:
        name, kind, value = entry["key"], gguf.GGUFValueType[entry["type"]], entry["value"]
        sub = gguf.GGUFValueType[entry["sub_type"]] if entry.get("sub_type") else None
        if name == gguf.Keys.Tokenizer.LIST:
            tokens = len(value)
        writer.add_key_value(name, value, kind, sub_type=sub)
    if tokens != vocab_size:
        raise ModelError(f"{path}: {tokens} tokens, but {vocab_size} were expected")
    found = {e["key"]: e["value"] for e in keys}
    return {"source": f"the GGUF file's own ({path.name})", "model": found.get(gguf.Keys.Tokenizer.MODEL),
            "pre": found.get(gguf.Keys.Tokenizer.PRE), "tokens": tokens}


def pre_tokenizer(tok) -> str:
    """llama.cpp's name of ``tok``'s pre-tokenizer: by the hash of how it splits ``CHECK_TEXT`` (its converter's
    rule), else by what the loaded tokenizer runs (its backend's pre-tokenizer, not tokenizer.json's: transformers
    gives a Qwen2 folder Qwen2's own regex whatever its file says): a plain ``ByteLevel`` is GPT-2's regex
    (``gpt-2``), a ``Split`` of a regex in ``SPLITS`` then ``ByteLevel`` that one; anything else refused."""
    digest = sha256(str(tok.encode(CHECK_TEXT)).encode()).hexdigest()
    if digest in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[digest]
    pre = json.loads(tok.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False):
        return "gpt-2"
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if steps and len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel":
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex in SPLITS and steps[0].get("behavior") == "Isolated" and not steps[1].get("use_regex", True):
            return SPLITS[regex]
    raise ModelError(f"the tokenizer's pre-tokenizer (llama.cpp's hash {digest[:16]}...) is not one llama.cpp "
                     "implements; its convert_hf_to_gguf_update.py adds new ones")


def _gpt2(writer, folder: Path, vocab_size: int, spec: dict) -> dict:
    """llama.cpp's converter's ``get_vocab_base`` and ``_set_vocab_gpt2``."""
    import gguf

    tok = AutoTokenizer.from_pretrained(str(folder))
    vocab = tok.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ModelError(f"{folder}: the tokenizer has ids up to {max(vocab.values())}, beyond the model's "
                         f"vocabulary of {vocab_size}")
    pre = pre_tokenizer(tok)
    reverse = {i: t for t, i in vocab.items()}
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:  # llama.cpp takes control and user tokens as already normalised
                token = tok.decode(tok.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer, quiet=True)
    return {"source": "tokenizer.json (llama.cpp's converter's rules)", "model": "gpt2", "pre": pre,
            "tokens": len(tokens)}


def _looks_special(token: str) -> bool:
    """The converter's ``does_token_look_special``: added tokens some models forget to mark special."""
    return (token in CONTROL_LOOKS or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _llama_hf(writer, folder: Path, vocab_size: int) -> dict:
    """The converter's ``_set_vocab_llama_hf``: a SentencePiece vocabulary saved as a byte-fallback BPE."""
    import gguf

    vocab = gguf.LlamaHfVocab(folder)
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(kind)
    if len(tokens) != vocab_size:
        raise ModelError(f"{folder}: the tokenizer has {len(tokens)} tokens, the model's vocabulary {vocab_size}")
    writer.add_tokenizer_model(GGUF_SPM_TOKENIZER)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    return {"source": "tokenizer.json (llama.cpp's converter's rules)", "model": GGUF_SPM_TOKENIZER, "pre": "default",
            "tokens": len(tokens)}
