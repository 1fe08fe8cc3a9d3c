"""``TextTokenizer`` (tokenizers + jinja2, no transformers) gives what transformers' AutoTokenizer gives."""

import json

import pytest

from bdlora.models.tokenizer import TextTokenizer

TEXTS = ["alpha beta gamma", "  leading spaces and\nnew lines\n\n", "unicode: naïve café — 日本語 🙂",
         "<|endoftext|> inside text", "", "x" * 300, "def main():\n    return 1\n"]
TEMPLATE = ("{% for m in messages %}{{ '<' + m['role'] + '>' }}{{ m['content'] | trim }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def folder(tiny_env, tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tiny_env["tokenizer"].save_pretrained(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_encode_decode_and_specials_equal_autotokenizer(folder):
    from transformers import AutoTokenizer

    ref, ours = AutoTokenizer.from_pretrained(str(folder)), TextTokenizer(folder)
    assert len(ours) == len(ref) and ours.eos_token_id == ref.eos_token_id and ours.get_vocab() == ref.get_vocab()
    for text in TEXTS:
        for special in (True, False):
            ids = ref(text, add_special_tokens=special)["input_ids"]
            assert ours(text, add_special_tokens=special)["input_ids"] == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours(TEXTS, add_special_tokens=False)["input_ids"] == ref(TEXTS, add_special_tokens=False)["input_ids"]


def test_chat_template_renders_and_tokenises_like_transformers(folder):
    from transformers import AutoTokenizer

    ref, ours = AutoTokenizer.from_pretrained(str(folder)), TextTokenizer(folder)
    msgs = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "alpha beta"}]
    for gen in (True, False):
        want = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False)
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == list(want)
        assert ours.apply_chat_template(msgs, gen, tokenize=False) == ref.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen)


def test_incremental_decoding_equals_whole_decoding(folder):
    ours = TextTokenizer(folder)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        stream, pieces = ours.decode_stream(), []
        for t in ids:
            piece = stream.step(ours.backend_tokenizer, t)
            if piece is not None:
                pieces.append(piece)
        assert "".join(pieces) == ours.decode(ids, skip_special_tokens=True), text


def test_a_folder_without_tokenizer_json_is_one_clear_error(tmp_path):
    from bdlora.base.errors import ModelError

    with pytest.raises(ModelError, match="no tokenizer.json"):
        TextTokenizer(tmp_path)
