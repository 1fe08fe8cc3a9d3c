"""Teachers from anywhere users keep them: a .gguf file (written here with the gguf package, the way llama.cpp's
converter lays out a Llama model: q/k rows permuted for its rotary layout, tied embeddings, a GPT-2 style BPE
tokenizer and a chat template), presets and hub ids; errors are one line."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from bdlora.cli import app
from conftest import train_args

CHAT_TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}")


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert script: rows of each head regrouped from (2, d/2) halves to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, tokenizer, path, **declare):
    """``declare`` overrides metadata values (block_count, embedding_length, feed_forward_length, head_count): a
    file whose metadata says other sizes than its tensors have."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(declare.get("block_count", c.num_hidden_layers))
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(declare.get("embedding_length", c.hidden_size))
    w.add_feed_forward_length(declare.get("feed_forward_length", c.intermediate_size))
    w.add_head_count(declare.get("head_count", c.num_attention_heads))
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if hasattr(c, "rope_parameters") else c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(declare.get("pre", "default"))
    w.add_token_list(tokens)
    w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", llama_cpp_permute(sd[p + "self_attn.q_proj.weight"],
                                                                 c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", llama_cpp_permute(sd[p + "self_attn.k_proj.weight"],
                                                                 c.num_key_value_heads))
        for g, h in names.items():
            w.add_tensor(f"blk.{i}.{g}.weight", sd[p + h + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tiny_env, tmp_path_factory):
    """A tied-embedding Llama (GQA 4/2) as GGUF, beside the model it came from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_env["tokenizer"]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so a wrong mapping shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    root = tmp_path_factory.mktemp("gguf")
    return model, write_gguf(model, tok, root / "tiny-llama.F32.gguf")


def test_a_gguf_teacher_loads_with_the_original_logits(tiny_env, tiny_gguf, tmp_path):
    from bdlora.models.teacher import load_teacher

    model, path = tiny_gguf
    teacher, tok, folder = load_teacher(str(path), tmp_path / "cache")
    assert folder.parent == tmp_path / "cache" / "teachers" and (folder / "model.safetensors").is_file()
    ids = torch.tensor([tiny_env["tokenizer"]("alpha beta gamma delta. one two three")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(teacher(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    assert teacher.config.tie_word_embeddings and teacher.config.num_key_value_heads == 2
    text = "alpha beta.\n  gamma"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level BPE decodes to text, not "Ġ"/"Ċ" symbols
    assert "assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                  add_generation_prompt=True)
    source = json.loads((folder / "source.json").read_text())
    assert source["gguf_file"] == path.name and source["parameters"] == sum(p.numel() for p in model.parameters())
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    load_teacher(str(path), tmp_path / "cache")  # materialised once: the cached folder is reused
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_gguf_naming_smollms_pre_tokenizer_splits_digits_as_llama_cpp_does(tiny_env, tiny_gguf, tmp_path):
    """transformers converts every byte-level GGUF tokenizer with GPT-2's split alone; a file naming llama.cpp's
    ``smollm`` pre-tokenizer (SmolLM2's: digits one by one) gets it back, and source.json says so; a ``default``
    one is left as converted."""
    from bdlora.models.teacher import load_teacher

    model, plain = tiny_gguf
    smollm = write_gguf(model, tiny_env["tokenizer"], tmp_path / "smollm.F32.gguf", pre="smollm")
    text = "year  2024, page 17"
    _, tok, folder = load_teacher(str(smollm), tmp_path / "cache")
    pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == ["2", "0", "2", "4", "1", "7"], pieces
    assert json.loads((folder / "source.json").read_text())["tokenizer_rules"] == ["pre-tokenizer smollm (llama.cpp's "
                                                                                  "name)"]
    _, tok, folder = load_teacher(str(plain), tmp_path / "cache")
    pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    assert "Ġ2024" in pieces and "tokenizer_rules" not in json.loads((folder / "source.json").read_text())


def test_a_sentencepiece_vocabularys_user_defined_pieces_match_whole_longest_first():
    """Gemma 3's runs of spaces are user-defined pieces (token type 4), which SentencePiece (and llama.cpp) match
    whole, longest first, before any merge; converted as BPE pieces, five spaces came out as four and one. Given
    back as added tokens, they match as SentencePiece matches them, with the same ids."""
    from tokenizers import Tokenizer, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from bdlora.models.families import GGUF_SPM_TOKENIZER
    from bdlora.models.sources import USER_DEFINED, own_tokenizer_rules

    pieces = ["\u2581" * n for n in range(1, 6)] + ["a"]
    bpe = models.BPE({p: i for i, p in enumerate(pieces)}, [("\u2581", "\u2581"), ("\u2581" * 2, "\u2581" * 2),
                                                            ("\u2581" * 2, "\u2581")])
    raw = Tokenizer(bpe)
    raw.normalizer = normalizers.Replace(" ", "\u2581")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    assert tok("     a")["input_ids"] == [3, 0, 5]  # BPE's merges: four spaces, then one
    keys = {"keys": [{"key": "tokenizer.ggml.model", "value": GGUF_SPM_TOKENIZER},
                     {"key": "tokenizer.ggml.token_type", "value": [1] + [USER_DEFINED] * 4 + [1]}]}
    assert own_tokenizer_rules(tok, keys) == ["4 user-defined pieces matched whole, as SentencePiece matches them"]
    assert tok("     a")["input_ids"] == [4, 5] and tok("  a")["input_ids"] == [1, 5]
    assert len(tok) == len(pieces) and own_tokenizer_rules(tok, {"keys": []}) == []


def test_teacher_command_and_training_from_a_gguf(tiny_env, tiny_gguf, tmp_path):
    model, path = tiny_gguf
    cache = tmp_path / "cache"
    res = CliRunner().invoke(app, ["teacher", "--preset", str(path), "--data", str(tiny_env["corpus"]),
                                   "--cache-dir", str(cache), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert 1 < info["val_ppl"] < 400 and info["data"] == str(tiny_env["corpus"])  # random weights: near uniform
    out = tmp_path / "run"
    args = train_args(tiny_env, out, "--max-steps", "2", "--student-layers", "1")
    args[args.index("--teacher") + 1] = str(path)
    args[args.index("--cache-dir") + 1] = str(cache)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["teacher"] == str(path) and summary["steps"] == 2


@pytest.mark.parametrize("spec,needle", [
    ("missing.gguf", "no such .gguf file"),
    ("garbage.gguf", "could not convert this GGUF file"),
    ("nobody-here/no-such-model", "pass a local model folder, a .gguf file or a preset (smollm2-135m, gemma3-270m)"),
    ("not/a/path/at/all", "no such directory"),
])
def test_teacher_sources_fail_in_one_line(tiny_env, tmp_path, monkeypatch, spec, needle):
    import huggingface_hub

    # no network in tests: a hub id must fail fast and say why. The variable is read when huggingface_hub is
    # imported, so the constant is set too (without it this case retried the network for ~45 s in-process).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "garbage.gguf").write_bytes(b"GGUF" + bytes(200))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    args = train_args(tiny_env, out)
    args[args.index("--teacher") + 1] = spec
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    err = res.stderr.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def _edited_teacher(tiny_env, folder, **sizes):
    import shutil

    shutil.copytree(tiny_env["teacher"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(sizes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _pickled_weights(folder):  # only the size of a non-safetensors weight file is read, never its content
    for f in folder.glob("*.safetensors"):
        f.unlink()
    (folder / "pytorch_model.bin").write_bytes(bytes(4096))


@pytest.mark.parametrize("declare,damage,needle", [
    ({"num_hidden_layers": 1_000_000, "hidden_size": 1_000_000_000}, None,
     "declares hidden_size 1,000,000,000 but the weights hold 32; num_hidden_layers 1,000,000 but the weights hold 4"),
    ({"intermediate_size": 10**9}, None, "intermediate_size 1,000,000,000 but the weights hold 64"),
    ({"hidden_size": 10**6}, _pickled_weights, "parameters, more than its weight files (4,096 bytes) can hold"),
    ({"block_count": 1_000_000}, "gguf", "llama.block_count 1,000,000 but the tensors hold 2"),
    ({"embedding_length": 10**9, "feed_forward_length": 10**9}, "gguf",
     "llama.embedding_length 1,000,000,000 but the tensors hold 32"),
])
def test_a_teacher_declaring_sizes_its_weights_lack_is_refused_before_loading(tiny_env, tiny_gguf, tmp_path, declare,
                                                                              damage, needle):
    """Issue 32: transformers allocates what the config (or the GGUF metadata) declares before it reads a tensor; an
    edited value must be one line, not a hang. Refused by `train --teacher` and `export onnx` alike."""
    if damage == "gguf":
        spec = write_gguf(tiny_gguf[0], tiny_env["tokenizer"], tmp_path / "edited.gguf", **declare)
    else:
        spec = _edited_teacher(tiny_env, tmp_path / "teacher", **declare)
        if damage is not None:
            damage(spec)
    readers = [(train_args(tiny_env, tmp_path / "run"), tmp_path / "run")]
    if damage is not _pickled_weights:  # export reads safetensors folders only (and says so)
        readers.append((["export", "onnx", str(spec), "--out", str(tmp_path / "o")], tmp_path / "o"))
    for args, out in readers:
        if args[0] == "train":
            args[args.index("--teacher") + 1] = str(spec)
        res = CliRunner().invoke(app, args, env={"BDLORA_CACHE": str(tmp_path / "cache")})
        assert res.exit_code == 2, (args[:2], res.output)
        err = res.stderr.strip()
        assert needle in err and len(err.splitlines()) == 1, (args[:2], err)
        assert not out.exists() and not (tmp_path / "cache" / "teachers").exists()


def test_unknown_preset_is_one_line(tmp_path):
    res = CliRunner().invoke(app, ["teacher", "--preset", "llama-9000", "--cache-dir", str(tmp_path)])
    assert res.exit_code == 2
    assert "--preset llama-9000: unknown (allowed: smollm2-135m, gemma3-270m, or a .gguf file)" in res.stderr
    assert not any(tmp_path.iterdir())


def test_export_onnx_of_a_gguf_teacher(tiny_env, tiny_gguf, tmp_path, monkeypatch):
    """The dense teacher itself exports (the baseline users compare against), validated like any model folder."""
    _, path = tiny_gguf
    monkeypatch.setenv("BDLORA_CACHE", str(tmp_path / "cache"))
    res = CliRunner().invoke(app, ["export", "onnx", str(path), "--out", str(tmp_path / "t.onnx"), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["validation"]["max_abs_diff"] <= info["validation"]["tolerance"]
    assert (tmp_path / "t.onnx" / "model.onnx").is_file() and set(info["summary"]["forms"]) == {"dense"}


def test_chunks_that_do_not_assemble_to_the_declared_checksum_are_refused(tmp_path):
    """A chunked preset (Gemma 3's four wheels) is checked against the SHA-256 its index wheel declares before
    transformers reads a byte: a chunk from another release is refused in one line naming both digests."""
    import hashlib
    import zipfile

    from bdlora.base.errors import ModelError
    from bdlora.models.sources import PRESETS, _check_assembled

    preset = PRESETS["gemma3-270m"]
    gguf = tmp_path / preset.member
    gguf.write_bytes(b"GGUF chunk of another release")
    wheel = tmp_path / "index.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(preset.checksums, f"{'0' * 64}  {preset.member}\n")
    with pytest.raises(ModelError, match=r"preset gemma3-270m: the chunks assemble to SHA-256 [0-9a-f]{16}\.\.\., "
                                         r"but index.whl declares 0{16}\.\.\. for gemma-3-270m-q4_k_m.gguf"):
        _check_assembled(preset, wheel, gguf)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(preset.checksums, f"{hashlib.sha256(gguf.read_bytes()).hexdigest()}  {preset.member}\n")
    _check_assembled(preset, wheel, gguf)  # the right digest passes
