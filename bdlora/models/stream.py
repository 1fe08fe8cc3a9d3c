"""Models too large to hold in fp32, read one part at a time from their weight files.

A Llama-3.2-1B in fp32 is 5 GB and an 8B one 32 GB: the exporter held the whole fp32 model, its whole fp32 graph and
validation sessions at once (16.6 GB at 1B). ``lazy_folder_model`` builds the architecture on the meta device (no
weight allocated) after the same checks ``load_model_folder`` makes, and gives it a ``SOURCE`` that reads one
tensor from its safetensors file (bf16 stays bf16 on disk and in the page cache; only the part being made exists in
fp32). The graph emitter (``export.decoder.graph``) already makes one part at a time (``lazy.materialized``):
the embedding, each decoder layer, the head. ``streamed`` does the same around a PyTorch forward (sequential
onloading, as llm-compressor and GPTQ's reference calibrate: each decoder layer materialised for its own call and
dropped after), so a reference forward of an 8B model holds one layer, not the model.

The in-memory path (``load_model_folder``) stays for the models that fit: its outputs are the same (tested to 1e-5).
"""

from __future__ import annotations

import copy
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from bdlora.base.errors import ModelError, UsageError
from bdlora.base.outputs import STREAMING
from bdlora.models.integrity import check_safetensors, tensor_files, weight_files
from bdlora.models.lazy import SOURCE, empty, materialized
from bdlora.models.load import all_finite, check_weights_match, checked_folder, checked_model
from bdlora.models.perplexity import TorchLM
from bdlora.models.scoring import score_logits

STREAM_ABOVE = 2 << 30  # fp32 bytes of weights above which ``--streaming auto`` streams (about 540M parameters)
PARITY_LAYERS = 2  # a streamed export's parity: the model's first layers (one where two pass PARITY_BYTES) ...
PARITY_VOCAB = 4096  # ... and the first rows of its embedding and head
PARITY_BYTES = 1 << 30  # fp32 bytes of layers the parity model holds (its float64 twin and graph hold as much again)


def fp32_bytes(folder: Path) -> int:
    """What the folder's floating-point weights take in fp32 (from the safetensors headers: nothing is read)."""
    total = 0
    for p in weight_files(Path(folder)):
        total += sum(int(np.prod(shape)) * 4 for shape in check_safetensors(p).values())
    return total


def streams(mode: str, model: Path | int, whole: bool = False) -> bool:
    """Whether a command works on ``model`` (a folder, or its fp32 bytes) one layer at a time: ``mode`` on, or auto
    for weights past ``STREAM_ABOVE`` in fp32 unless the command needs the ``whole`` model (an export's
    ``--int8-share`` ranks the errors of every MatMul before writing any)."""
    if mode not in STREAMING:
        raise UsageError(f"--streaming {mode}: unknown (allowed: {', '.join(STREAMING)})")
    if mode != "auto":
        return mode == "on"
    return not whole and (model if isinstance(model, int) else fp32_bytes(model)) > STREAM_ABOVE


class FolderWeights:
    """``(name, meta parameter) -> fp32 tensor`` read from the folder's safetensors files, one tensor a call, each
    checked finite as it is read (the in-memory loader checks the whole state dict; here no state dict exists)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.where = tensor_files(self.folder, check_safetensors)  # as the index maps them: a stray file is not read

    def names(self) -> set[str]:
        return set(self.where)

    def read(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ModelError(f"{self.folder}: no tensor {name} in its weight files")
        with safe_open(str(self.where[name]), framework="pt") as f:  # opened per tensor: a file kept open keeps
            t = f.get_tensor(name)  # every page read mapped, and the whole checkpoint counted as this process's
        return t

    def __call__(self, name: str, p: torch.Tensor) -> torch.Tensor:
        t = self.read(name)
        if tuple(t.shape) != tuple(p.shape):
            raise ModelError(f"{self.folder}: tensor {name} is {list(t.shape)} but config.json declares "
                             f"{list(p.shape)}")
        t = t.to(torch.float32)
        if not all_finite(t):
            raise ModelError(f"{self.folder}: weight tensor {name} holds NaN or infinity; the folder is damaged or "
                             "its training diverged")
        return t


def lazy_folder_model(model_dir: str | Path):
    """(model on the meta device reading its weights from the folder, tokenizer, compression report or None): the
    checks of ``load_model_folder`` (files whole, shapes as declared, every weight named as the architecture names
    it), no weight read."""
    folder, report = checked_folder(model_dir)
    try:
        config = AutoConfig.from_pretrained(str(folder))
        config._attn_implementation = "eager"
        model = empty(lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32))
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001  transformers raises many types for a damaged folder
        raise ModelError(f"{folder}: could not load the model ({str(e).strip()[:200]})") from None
    source = FolderWeights(folder)
    # every parameter stored under its own name: a checkpoint whose names transformers converts on load cannot be
    # read tensor by tensor
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    declared = {n for n, _ in model.named_parameters()}
    check_weights_match(folder, model, {"missing_keys": declared - source.names(),
                                        "unexpected_keys": source.names() - declared - tied},
                        cause="a checkpoint transformers renames on load is read whole: pass --streaming off")
    setattr(model, SOURCE, source)
    return checked_model(folder, model, tok), tok, report


def cut_model(model: torch.nn.Module) -> torch.nn.Module:
    """The lazy ``model`` cut to its first ``PARITY_LAYERS`` decoder layers (one at 7B-8B sizes) and the first
    ``PARITY_VOCAB`` rows of its embedding and head, reading the same weight files: a streamed export's parity check
    runs the emitter on the model's own weights at a size whose fp32 graph and PyTorch forward fit beside anything
    (the rows of a table and the layers are emitted alike whatever their number)."""
    cfg = copy.deepcopy(model.config)
    layer = sum(p.numel() for p in model.model.layers[0].parameters()) * 4  # fp32 bytes
    n = max(1, min(PARITY_LAYERS, cfg.num_hidden_layers, PARITY_BYTES // max(layer, 1)))
    v = min(PARITY_VOCAB, cfg.vocab_size)
    cfg.num_hidden_layers, cfg.vocab_size = n, v
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:n]
    if getattr(cfg, "bdlora_modules", None):
        cfg.bdlora_modules = {k: m for k, m in cfg.bdlora_modules.items()
                              if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
    cut = empty(lambda: AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))
    source = getattr(model, SOURCE)

    def value(name: str, p: torch.Tensor) -> torch.Tensor:
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            return source.read(name)[: p.shape[0]].to(torch.float32)
        return source(name, p)

    setattr(cut, SOURCE, value)
    return cut.eval()


def cut_checked(model: torch.nn.Module, folder: Path, write, check) -> dict:
    """``check(cut, path)`` of the graph ``write(cut, path)`` writes for ``cut_model(model)`` (made for the block),
    in a folder under ``folder`` removed after; with the cut's layers and vocabulary rows. A streamed export's
    parity, whatever graph it writes."""
    cut = cut_model(model)
    with tempfile.TemporaryDirectory(dir=folder) as d, materialized(cut):
        path = Path(d) / "model.onnx"
        write(cut, path)
        out = check(cut, path)
    return {**out, "layers": cut.config.num_hidden_layers, "vocab_rows": cut.config.vocab_size}


def parts(model) -> dict[str, torch.nn.Module]:
    """The parts one forward makes one at a time: the embedding, each decoder layer, the head."""
    out = {"model.embed_tokens": model.model.embed_tokens}
    out.update({f"model.layers.{i}": layer for i, layer in enumerate(model.model.layers)})
    out["lm_head"] = model.lm_head
    return out


@contextmanager
def streamed(model):
    """``model`` (lazy) whose forward materialises each part for its own call only (the norms and other small
    parameters for the whole block): at most one decoder layer, or the embedding, or the head, in fp32 at a time."""
    pieces = parts(model)
    live: dict[str, ExitStack] = {}

    def before(name):
        def hook(module, args):
            live[name] = ExitStack()
            live[name].enter_context(materialized(model, name))
        return hook

    def after(name):
        def hook(module, args, out):
            live.pop(name).close()
        return hook

    handles = []
    with materialized(model, skip=tuple(pieces)):
        for name, m in pieces.items():
            handles += [m.register_forward_pre_hook(before(name)), m.register_forward_hook(after(name))]
        try:
            yield model
        finally:
            for h in handles:
                h.remove()
            for stack in live.values():
                stack.close()


@torch.no_grad()
def score_streamed(model, blocks, batch_size: int = 4) -> tuple[float, np.ndarray]:
    """(mean next-token NLL, argmax predictions) of the lazy ``model`` over packed ``blocks``, as
    ``runtime.score_blocks`` scores a graph (``runtime.score_logits``): each block from an empty cache, at most
    ``batch_size`` blocks per forward, each forward holding one layer at a time."""
    with streamed(model):
        return score_logits(lambda x: model(torch.from_numpy(np.asarray(x))).logits.numpy(), blocks,
                            model.config.vocab_size, batch_size, "PyTorch (read one layer at a time)")


class StreamedLM(TorchLM):
    """``bdlora eval``'s PyTorch model interface (``TorchLM``: the same calls, the same numbers) over a lazy model
    (``lazy_folder_model``): every call runs ``streamed``, so scoring a 1B-8B checkpoint holds one decoder layer in
    fp32 at a time; each call reads the model's weights once (from the page cache after the first), so perplexity
    costs little more than in memory and each generated token of the ICL probes a pass over the weight files."""

    kind = "torch-streamed"

    def __init__(self, model):
        super().__init__(model, "cpu")

    def step(self, ids, mask, pos, past):
        with streamed(self.model):
            return super().step(ids, mask, pos, past)

    def score(self, ids, mask, pos, past) -> np.ndarray:
        with streamed(self.model):
            return super().score(ids, mask, pos, past)

    def logits(self, ids, mask, pos, keep: int = 0) -> np.ndarray:
        with streamed(self.model):
            return super().logits(ids, mask, pos, keep)

    def nll(self, blocks, batch_size: int = 8) -> tuple[float, int]:
        with streamed(self.model):
            return super().nll(blocks, batch_size)
