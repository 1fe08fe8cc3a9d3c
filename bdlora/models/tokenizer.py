"""A Hugging Face tokenizer folder read without transformers (so without torch): the ``tokenizers`` backend from
``tokenizer.json``, the special tokens and options of ``tokenizer_config.json``, and the chat template rendered the
way transformers renders it (a sandboxed jinja2 environment with ``trim_blocks``/``lstrip_blocks``, its ``tojson``,
``raise_exception`` and ``strftime_now``). Serving and ONNX-side evaluation use it; a test checks it against
``AutoTokenizer`` token for token.

Only fast tokenizers (a ``tokenizer.json``) are supported; that is what every export bdlora writes holds.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

from bdlora.base.errors import ModelError
from bdlora.base.runs import TOKENIZER_CONFIG, TOKENIZER_JSON

_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def check_vocabulary(folder, tokenizer_size: int, model_rows: int) -> None:
    """A tokenizer must produce only ids the model embeds: a folder holding another model's tokenizer (a 49,152-token
    one beside a 1,024-row embedding) served garbage with status 200, exported fine and failed in eval with an
    IndexError. (A model may have more rows than tokens: vocabularies are padded.)"""
    if tokenizer_size > model_rows:
        raise ModelError(f"{folder}: its tokenizer has {tokenizer_size:,} tokens but the model embeds {model_rows:,}; "
                         "the tokenizer files are not this model's")


class TextTokenizer:
    """The subset of ``PreTrainedTokenizerFast`` bdlora's runtime needs, with the same results."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        tj = self.folder / TOKENIZER_JSON
        if not tj.is_file():
            raise ModelError(f"{self.folder}: no tokenizer.json (bdlora needs a fast tokenizer)")
        try:
            self.backend_tokenizer = Tokenizer.from_file(str(tj))
            cfg_path = self.folder / TOKENIZER_CONFIG
            self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        except Exception as e:  # noqa: BLE001  a damaged file is the folder's problem
            raise ModelError(f"{self.folder}: cannot read the tokenizer ({type(e).__name__}: {e})") from None
        self.special = {n: _content(self.config.get(n)) for n in SPECIAL_NAMES}
        self.clean_up_spaces = bool(self.config.get("clean_up_tokenization_spaces", False))
        template = self.folder / "chat_template.jinja"
        self.chat_template = template.read_text() if template.exists() else self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: the default one
            self.chat_template = {t["name"]: t["template"] for t in self.chat_template}.get("default")

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def token_id(self, name: str) -> int | None:
        tok = self.special.get(name)
        return None if tok is None else self.backend_tokenizer.token_to_id(tok)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id("bos_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode keeps it): a server tokenising a long prompt in a
        # thread must not stop its event loop
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (at least 4): a text of more than ``n * max_token_bytes()``
        bytes has more than ``n`` tokens, which a server checks before tokenising anything."""
        if not hasattr(self, "_max_token_bytes"):
            ids = list(range(len(self)))
            texts = self.backend_tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
            specials = self.backend_tokenizer.get_added_tokens_decoder()  # their decode may skip the text
            longest = max((len(t.encode("utf-8", "replace")) for t in texts), default=1)
            longest = max([longest] + [len(a.content.encode("utf-8")) for a in specials.values()])
            self._max_token_bytes = max(4, longest)
        return self._max_token_bytes

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **_ignored) -> dict:
        """``{"input_ids": ...}`` for a string or a list of strings (the call form transformers' tokenizers have)."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        encs = self.backend_tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encs]}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for a, b in _CLEANUPS:
                text = text.replace(a, b)
        return text

    @cached_property
    def _template(self):
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):  # {% generation %}...{% endgeneration %}: rendered as its body
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
                return jinja2.nodes.Scope(body).set_lineno(lineno)

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True) -> str | list[int]:
        """Render ``messages`` with the chat template (as transformers does) and, by default, tokenise the result
        without adding special tokens (the template writes them)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{k: v for k, v in self.special.items() if v is not None})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def decode_stream(self, skip_special_tokens: bool = True):
        """An incremental detokeniser (``tokenizers.decoders.DecodeStream``): ``step(id)`` returns the new text, or
        None while a multi-byte character is incomplete."""
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=skip_special_tokens)


def _content(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None
