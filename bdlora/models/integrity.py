"""Integrity of a model folder before anything reads or republishes it: safetensors files whose header matches their
size, a ``config.json`` that is a JSON object naming a model type, and (for folders bdlora wrote) the SHA-256 of
every weight file recorded in ``compression.json`` at save time, and of the tokenizer's vocabulary files (there and
in an export's ``export.json``). Standard library only.

A half-copied or edited weight file would otherwise load with random or garbage weights (transformers only warns)
or be republished by ``export hf`` as if it were whole.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from bdlora import forms
from bdlora.base.errors import ModelError, shown
from bdlora.base.io import sha256
from bdlora.base.runs import CONFIG, TOKENIZER_JSON, ModelDir
from bdlora.models.arch import SUPPORTED_FAMILIES, unsupported
from bdlora.models.families import BDLORA_PREFIX

DIGEST_KEY = "weights_sha256"  # in compression.json: {file name: hex digest}
CONFIG_KEY = "config_sha256"  # in export.json: config.json as exported (the graph's shapes are fixed by it)
TOKENIZER_KEY = "tokenizer_sha256"  # in compression.json and export.json: {file name: hex digest}
# The files that decide which ids a text becomes (the fast tokenizer's one file, or a slow one's vocabulary, merges
# or sentencepiece model). tokenizer_config.json is left out: a chat template added there changes no id.
TOKENIZER_IDENTITY = (TOKENIZER_JSON, "vocab.json", "merges.txt", "tokenizer.model", "spiece.model")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own bound on the JSON header


WEIGHT_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's map of tensor -> file (transformers')


def weight_files(folder: Path) -> list[Path]:
    """The folder's weight files: those ``model.safetensors.index.json`` names when it has one (transformers' rule: a
    stray ``zz-backup.safetensors`` beside the shards is not part of the model; read, its zeros replaced a layer's
    weights), else every ``*.safetensors`` file."""
    folder = Path(folder)
    if (folder / WEIGHT_INDEX).exists():
        return sorted({folder / name for name in weight_map(folder).values()})
    return sorted(p for p in folder.glob("*.safetensors") if p.is_file())


def weight_map(folder: Path) -> dict[str, str]:
    """``{tensor: file name}`` of the folder's ``model.safetensors.index.json``, each file a regular file in the
    folder; one line naming what is wrong otherwise."""
    path = Path(folder) / WEIGHT_INDEX
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        found = doc["weight_map"]
        if not isinstance(found, dict) or not found or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
            raise TypeError("weight_map")
    except (OSError, ValueError, KeyError, TypeError, RecursionError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not a sharded checkpoint's index (a JSON object whose weight_map names each "
                         f"tensor's file; {type(e).__name__}); the folder is damaged") from None
    for name in sorted(set(found.values())):
        shard = Path(folder) / name
        if Path(name).name != name or name in (".", ".."):
            raise ModelError(f"{path}: names {shown(name)}, a file outside the folder; an index names its shards "
                             "beside it")
        if not shard.is_file():
            raise ModelError(f"{path}: names {shown(name)}, which is not in the folder (a missing shard)")
    return found


def folder_tensors(folder: Path, dtypes: dict[str, str] | None = None) -> dict[str, tuple[int, ...]]:
    """``{tensor: shape}`` of the model in the folder's weight files (``tensor_files``: as its index maps them, a
    tensor in two files refused), read from their headers; ``dtypes`` collects the stored dtypes."""
    held: dict[Path, dict] = {}

    def shapes_of(p: Path) -> dict:
        held[p] = check_safetensors(p, dtypes)
        return held[p]

    return {t: held[p][t] for t, p in tensor_files(folder, shapes_of).items()}


def tensor_files(folder: Path, shapes_of) -> dict[str, Path]:
    """``{tensor: the file it is read from}``: as the index says (each named tensor checked to be in its file), or,
    without an index, from every weight file, a tensor in two files refused (which one is the model's?).
    ``shapes_of(path)``: the tensors of one file (``check_safetensors``)."""
    folder = Path(folder)
    held = {p: shapes_of(p) for p in weight_files(folder)}
    if (folder / WEIGHT_INDEX).exists():
        where = {t: folder / f for t, f in weight_map(folder).items()}
        for t, p in sorted(where.items()):
            if t not in held[p]:
                raise ModelError(f"{folder / WEIGHT_INDEX}: maps {shown(t)} to {p.name}, which does not hold it; "
                                 "the folder is damaged")
        return where
    where: dict[str, Path] = {}
    for p, shapes in held.items():
        for t in shapes:
            if t in where:
                raise ModelError(f"{folder}: tensor {shown(t)} is in both {where[t].name} and {p.name}; which is the "
                                 f"model's is not known (a sharded checkpoint names each tensor's file in "
                                 f"{WEIGHT_INDEX}; remove the stray file)")
            where[t] = p
    return where


def digests(folder: Path) -> dict[str, str]:
    """{file name: SHA-256} of every weight file of ``folder`` (recorded by ``save_model_folder``)."""
    return {p.name: sha256(p) for p in weight_files(folder)}


def tokenizer_digests(folder: Path) -> dict[str, str]:
    """{file name: SHA-256} of the tokenizer files of ``folder`` that decide its ids (``TOKENIZER_IDENTITY``)."""
    return {name: sha256(Path(folder) / name) for name in TOKENIZER_IDENTITY if (Path(folder) / name).is_file()}


def check_tokenizer(folder: Path, recorded: dict | None, where: str) -> None:
    """The folder's tokenizer is the one recorded in ``where`` (compression.json or export.json) when it was
    written: a foreign tokenizer of the same or a smaller vocabulary loads and runs, and turns text into other ids
    (eval reported perplexity 1261 where the model's own tokenizer gives 115.6). Folders written before the record
    existed (``recorded`` None) are not checked."""
    if not recorded:
        return
    found = tokenizer_digests(folder)
    if found != recorded:
        changed = sorted(n for n in set(found) | set(recorded) if found.get(n) != recorded.get(n))
        raise ModelError(f"{folder}: its tokenizer ({', '.join(changed)}) differs from the one recorded in {where} "
                         "when the folder was written; a tokenizer from another model maps text to other ids (copy "
                         "this model's own tokenizer back)")


FLOAT_DTYPES = ("F32", "F16", "BF16")  # what a bdlora folder stores (its architecture declares floating weights)


def check_safetensors(path: Path, dtypes: dict[str, str] | None = None) -> dict[str, tuple[int, ...]]:
    """The file is a safetensors file whose header parses and whose tensors end exactly at the end of the file;
    returns its tensors' shapes by name (read from the header: no tensor is loaded); ``dtypes`` collects their
    stored dtypes by name."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 0 < n <= min(_MAX_HEADER, size - 8):
                raise ValueError("header length out of range")
            header = json.loads(f.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        shapes = {k: tuple(int(d) for d in v["shape"]) for k, v in header.items() if k != "__metadata__"}
        if dtypes is not None:
            dtypes.update({k: str(v["dtype"]) for k, v in header.items() if k != "__metadata__"})
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError, AttributeError) as e:
        raise ModelError(f"{path}: not a valid safetensors file ({type(e).__name__}); the folder is damaged") from None
    if 8 + n + max(ends, default=0) != size:
        raise ModelError(f"{path}: {size} bytes, but its header describes {8 + n + max(ends, default=0)} (truncated "
                         "or padded); the folder is damaged")
    return shapes


def check_declared_forms(folder: Path, cfg: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every projection ``bdlora_modules`` declares names a registered form (``bdlora.forms``; else one line naming
    those there are: an unknown form loaded as dense before) and has exactly that form's tensors, consistent with
    what the declaration says (a low-rank pair's rank): an edited form would otherwise load randomly initialised."""
    problems = []
    if (head := forms.head_bits_problem(cfg)) is not None:
        raise ModelError(f"{folder / CONFIG}: {head}; the folder is damaged or its config was edited")
    modules = cfg.get("bdlora_modules") or {}
    if not isinstance(modules, dict):
        raise ModelError(f"{folder / CONFIG}: bdlora_modules is {shown(modules)}, not a table of forms; the folder is "
                         "damaged")
    for module, spec in modules.items():
        form = forms.declared(spec, f"{folder / CONFIG}: bdlora_modules[{module}]", module)
        want = form.tensors(module)
        other = set().union(*(f.tensors(module) for f in forms.ALL.values() if f is not form)) - want
        if not want <= set(shapes) or other & set(shapes):
            problems.append(f"{module} is declared {form.name}")
        elif (problem := form.problem(spec, shapes, module)) is not None:
            problems.append(problem)
    if problems:
        raise ModelError(f"{folder}: the weights do not match config.json ({'; '.join(problems[:3])}"
                         f"{' ...' if len(problems) > 3 else ''}, its tensors say otherwise); the folder is damaged "
                         "or its config was edited")


INDEX_DTYPES = ("I64", "I32")


def check_dtypes(folder: Path, cfg: dict, dtypes: dict[str, str]) -> None:
    """Every tensor in the dtype its form declares: floating weights, integer token ids (a vocab head's): an int8
    tensor loaded and scored (566.9 against 124.6) as if it were the model's weights."""
    index = set()
    for module, spec in (cfg.get("bdlora_modules") or {}).items():
        form = forms.declared(spec, f"{folder / CONFIG}: bdlora_modules[{module}]", module)
        index |= {f"{module}.{suffix}" for suffix in getattr(form, "index_suffixes", ())}
    for name in sorted(dtypes):
        want = INDEX_DTYPES if name in index else FLOAT_DTYPES
        if dtypes[name] not in want:
            raise ModelError(f"{folder}: tensor {name} is stored as {dtypes[name]}, not {' / '.join(want)} as its "
                             "form declares: the file was edited or is not bdlora's")


SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim")


OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "intermediate_size")


def declared_sizes(cfg: dict, optional: tuple[str, ...] = OPTIONAL_SIZES) -> tuple[dict[str, int], list[str]]:
    """The decoder sizes config.json declares (absent ``optional`` fields skipped, key/value heads and head size
    then resolved as transformers does), and every field that is not a positive integer."""
    sizes, bad = {}, []
    for k in SIZE_FIELDS:
        v = cfg.get(k)
        if v is None and k in optional:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            bad.append(f"{k} {v!r} (must be a positive integer)")
        else:
            sizes[k] = v
    if not bad:
        sizes.setdefault("num_key_value_heads", sizes["num_attention_heads"])
        sizes.setdefault("head_dim", sizes["hidden_size"] // sizes["num_attention_heads"])
    return sizes, bad


def _dims(shapes: dict[str, tuple[int, ...]], module: str) -> tuple[int, int] | None:
    """(in, out) features of a projection stored dense (``weight``) or low-rank (``proj_in``/``proj_out``)."""
    w = shapes.get(f"{module}.weight")
    if w is not None and len(w) == 2:
        return w[1], w[0]
    a, b = shapes.get(f"{module}.proj_in.weight"), shapes.get(f"{module}.proj_out.weight")
    if a is not None and b is not None and len(a) == 2 and len(b) == 2:
        return a[1], b[0]
    return None


def check_declared_sizes(folder: Path, cfg: dict, shapes: dict[str, tuple[int, ...]],
                         what: str = CONFIG) -> None:
    """The decoder sizes ``cfg`` declares (layers, hidden, MLP, heads, vocabulary) against the tensors the weight
    files hold (their safetensors headers), before anything is allocated: a config edited to absurd sizes would
    otherwise have transformers allocate them (a hang, then an out-of-memory kill) instead of a one-line refusal.
    Applies to the Llama/Mistral/Qwen2 layout (and bdlora's compressed forms of it); other layouts are refused by
    the architecture check."""
    sizes, bad = declared_sizes(cfg)
    where = f"{Path(folder) / CONFIG}" if what == CONFIG else what
    if bad:
        raise ModelError(f"{where}: {'; '.join(bad)}")
    embed = shapes.get("model.embed_tokens.weight")
    layers = {int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    if embed is None or len(embed) != 2 or not layers:
        return  # not the Llama layout: the architecture check names what is wrong
    held = {"vocab_size": embed[0], "hidden_size": embed[1], "num_hidden_layers": len(layers)}
    attn = _dims(shapes, "model.layers.0.self_attn.q_proj")
    kv = _dims(shapes, "model.layers.0.self_attn.k_proj")
    mlp = _dims(shapes, "model.layers.0.mlp.gate_proj")
    if attn is not None:
        held["num_attention_heads x head_dim"] = attn[1]
    if kv is not None:
        held["num_key_value_heads x head_dim"] = kv[1]
    site = (cfg.get("bdlora_modules") or {}).get("model.layers.0.mlp")
    keep = site.get("keep") if isinstance(site, dict) else None  # a pruned first MLP holds its declared channels
    if mlp is not None and "intermediate_size" in sizes and (keep is None or type(keep) is int):
        held["intermediate_size" if keep is None else "model.layers.0.mlp keep"] = mlp[1]
    attn_site = (cfg.get("bdlora_modules") or {}).get("model.layers.0.self_attn")
    groups = attn_site.get("keep") if isinstance(attn_site, dict) else None  # a pruned first attention block
    kv = groups if type(groups) is int and groups > 0 else sizes["num_key_value_heads"]
    declared = {**sizes, "model.layers.0.mlp keep": keep,
                "num_attention_heads x head_dim": kv * sizes["num_attention_heads"] // max(
                    1, sizes["num_key_value_heads"]) * sizes["head_dim"],
                "num_key_value_heads x head_dim": kv * sizes["head_dim"]}
    for site, spec in (cfg.get("bdlora_modules") or {}).items():  # every pruned attention block caches keep heads
        k_rows = _dims(shapes, f"{site}.k_proj")
        groups = isinstance(spec, dict) and spec.get("form") == forms.GROUPS.name
        if groups and type(spec.get("keep")) is int and k_rows:
            held[f"{site} keep x head_dim"], declared[f"{site} keep x head_dim"] = k_rows[1], \
                spec["keep"] * sizes["head_dim"]
    wrong = [f"{k} {declared[k]:,} but the weights hold {v:,}" for k, v in held.items() if declared[k] != v]
    if not wrong and layers != set(range(len(layers))):
        wrong.append(f"layers numbered {sorted(layers)[:3]}... are not 0..{len(layers) - 1}")
    if wrong:
        raise ModelError(f"{where}: declares {'; '.join(wrong[:3])}: the config was edited or does not belong to "
                         "these weights")


# the rotary settings that scale frequencies or positions: each a positive finite number where given (transformers
# 5.x rope_parameters, 4.x rope_scaling); a factor of -4.0 was exported without a word
ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "attention_factor", "beta_fast", "beta_slow")


def _rope_thetas(cfg: dict):
    """Every rotary number the config declares (``ROPE_NUMBERS``): top level, in rope_parameters or rope_scaling,
    or per attention type in rope_parameters (Gemma 3)."""
    if "rope_theta" in cfg:
        yield "rope_theta", cfg["rope_theta"]
    for key in ("rope_parameters", "rope_scaling"):
        rp = cfg.get(key)
        if not isinstance(rp, dict):
            continue
        for name in ROPE_NUMBERS:
            if name in rp and not isinstance(rp[name], list) and rp[name] is not None:
                yield f"{key}.{name}", rp[name]
        for kind, sub in rp.items():
            if isinstance(sub, dict):
                for name in ROPE_NUMBERS:
                    if name in sub and not isinstance(sub[name], list) and sub[name] is not None:
                        yield f"{key}.{kind}.{name}", sub[name]


def _positive_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def arch_field_problem(cfg: dict) -> str | None:
    """The config fields the architecture reads beyond its sizes, each within what it means: rotary bases and norm
    epsilons positive and finite, a sliding window and a position count positive integers (absent or null where
    the family allows). A negative rope_theta gave NaN perplexity, a sliding_window of -5 a PyTorch perplexity of
    805 beside the runtime's 124.6 on the same folder."""
    for name, v in _rope_thetas(cfg):
        if not _positive_number(v):
            return f"{name} {shown(v)} (must be a positive number)"
    for name in ("rms_norm_eps", "layer_norm_eps"):
        if name in cfg and not _positive_number(cfg[name]):
            return f"{name} {shown(cfg[name])} (must be a positive number)"
    for name in ("sliding_window", "max_position_embeddings"):
        v = cfg.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            return f"{name} {shown(v)} (must be a positive integer{' or null' if name == 'sliding_window' else ''})"
    return None


def check_config(folder: Path) -> dict:
    f = Path(folder) / CONFIG
    try:
        cfg = json.loads(f.read_text())
    except FileNotFoundError:
        raise ModelError(f"{folder}: no config.json (not a model folder)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelError(f"{f}: not valid JSON ({type(e).__name__}); the folder is damaged") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise ModelError(f"{f}: not a model config (a JSON object with a model_type); the folder is damaged")
    if (problem := arch_field_problem(cfg)) is not None:
        raise ModelError(f"{f}: {problem}; the config was edited or is damaged")
    known = SUPPORTED_FAMILIES + tuple(f"{BDLORA_PREFIX}{family}" for family in SUPPORTED_FAMILIES)
    if cfg["model_type"] not in known:  # named here: transformers would say it "does not recognize" it, or prompt
        raise ModelError(unsupported(str(folder), shown(cfg["model_type"])) + " (and their compressed forms "
                         f"{', '.join(known[len(SUPPORTED_FAMILIES):])})")
    return cfg


def implied_parameters(sizes: dict[str, int]) -> int:
    """Parameters of a Llama-layout decoder of these sizes (embedding, projections, norms; LM head counted once)."""
    h, v, n = sizes["hidden_size"], sizes["vocab_size"], sizes["num_hidden_layers"]
    q, kv = sizes["num_attention_heads"] * sizes["head_dim"], sizes["num_key_value_heads"] * sizes["head_dim"]
    inter = sizes.get("intermediate_size", 4 * h)
    return v * h + n * (2 * h * q + 2 * h * kv + 3 * h * inter + 2 * h) + h


def check_loadable(folder: Path) -> dict:
    """What a loader checks before transformers allocates anything: config.json parses and names a model type, the
    weight files are whole safetensors files (their headers match their sizes) and the declared sizes match the
    tensors. Weights in another format (a teacher's ``pytorch_model.bin``) cannot be read without unpickling, so
    there the declared parameter count is bounded by the bytes on disk (at least 2 bits a parameter). Returns the
    config."""

    folder = Path(folder)
    cfg = check_config(folder)
    family = (cfg.get("bdlora") or {}).get("base_model_type") or cfg["model_type"]
    if family not in SUPPORTED_FAMILIES:  # refused before its own sizes are even read (a GPT-2 has other names)
        raise ModelError(unsupported(str(folder), cfg["model_type"]))
    shapes = folder_tensors(folder)
    if shapes:
        check_declared_sizes(folder, cfg, shapes)
        return cfg
    sizes, bad = declared_sizes(cfg)
    if bad:
        raise ModelError(f"{folder / CONFIG}: {'; '.join(bad)}")
    on_disk = sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.suffix in (".bin", ".pt", ".pth"))
    declared = implied_parameters(sizes)
    if declared > 4 * on_disk:
        raise ModelError(f"{folder / CONFIG}: declares {declared:,} parameters, more than its weight files "
                         f"({on_disk:,} bytes) can hold: the config was edited or does not belong to these weights")
    return cfg


def check_model_folder(folder: Path, report: dict | None = None) -> None:
    """Everything above; ``report`` is the folder's compression.json (its recorded digests, when present)."""
    folder = Path(folder)
    cfg = check_config(folder)
    files = weight_files(folder)
    if not files:
        raise ModelError(f"{folder}: no .safetensors weights (bdlora reads and writes safetensors only)")
    dtypes: dict[str, str] = {}
    shapes = folder_tensors(folder, dtypes)
    check_declared_forms(folder, cfg, shapes)
    check_dtypes(folder, cfg, dtypes)
    check_declared_sizes(folder, cfg, shapes)
    check_tokenizer(folder, (report or {}).get(TOKENIZER_KEY), ModelDir.MARKER)
    recorded = (report or {}).get(DIGEST_KEY)
    if not recorded:
        return
    found = {p.name for p in files}
    if set(recorded) != found:
        raise ModelError(f"{folder}: weight files {sorted(found)} differ from those recorded at save time "
                         f"{sorted(recorded)}; the folder is damaged")
    for name, want in recorded.items():
        if sha256(folder / name) != want:
            raise ModelError(f"{folder / name}: its SHA-256 differs from the one recorded in compression.json; the "
                             "weights were changed or damaged after saving")
