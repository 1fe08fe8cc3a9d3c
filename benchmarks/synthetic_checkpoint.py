"""Write a checkpoint of a released model's *shapes* (random bf16 weights) without downloading anything: what a user
with Llama 3.2 1B/3B, Llama 3.1 8B, Qwen2.5 1.5B/7B or Gemma 3 1B brings to bdlora, for measuring time and memory at
their sizes (never quality: the weights are random).

    python benchmarks/synthetic_checkpoint.py llama-3.2-1b --out /data/llama-3.2-1b-shape
    python benchmarks/synthetic_checkpoint.py gemma-3-1b --tokenizer gemma3-270m --out /data/gemma-3-1b-shape

The folder is a Hugging Face model folder as the hub serves it: ``config.json``, sharded ``model-0000N-of-0000M.
safetensors`` with ``model.safetensors.index.json``, and a real tokenizer (SmolLM2's or Gemma 3's from bdlora's
presets, or any tokenizer folder), the vocabulary resized to it. It is written one shard at a time (the embedding,
then each decoder layer, then the final norm and head), so the process holds one layer's weights at most (an 8B
shape is 16 GB on disk, its largest shard 1 GB), under a temp name renamed into place when whole.

Each parameter: N(0, 0.02) for matrices, ones for norm weights, zeros for biases (the families' own initialisation),
seeded by its name, so the same command writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from bdlora.base.io import atomic_dir

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# The released models' configs (their decoder shapes and what the architecture reads), vocabulary left to the
# tokenizer. Sources: each model's config.json on the Hugging Face hub.
SHAPES = {
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                         rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                         rope_scaling={**LLAMA3_ROPE, "factor": 8.0}, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, rope_theta=1000000.0,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         use_sliding_window=False),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       use_sliding_window=False),
    "gemma-3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                       rope_theta=1000000.0, rope_local_base_freq=10000.0, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, query_pre_attn_scalar=256, tie_word_embeddings=True,
                       hidden_activation="gelu_pytorch_tanh"),
}
TOKENIZERS = ("smollm2-135m", "gemma3-270m")  # bdlora's presets (their tokenizer files, from the package registry)
INIT_STD = 0.02


def value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The bf16 value of parameter ``name``: seeded by its name, so every run writes the same bytes."""
    if len(shape) < 2:
        return (torch.zeros if name.endswith(".bias") else torch.ones)(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) + 1_000_003 * seed) % (1 << 63))
    return torch.empty(shape).normal_(0.0, INIT_STD, generator=g).to(torch.bfloat16)


def tokenizer_folder(spec: str) -> Path:
    """A folder holding the tokenizer: a preset's (materialised once into bdlora's cache) or the folder given."""
    if spec in TOKENIZERS:
        from bdlora.models.sources import resolve

        return Path(resolve(spec, what="--tokenizer", on_stage=lambda m: print(f"> {m}", flush=True)))
    if not (Path(spec) / "tokenizer_config.json").is_file() and not (Path(spec) / "tokenizer.json").is_file():
        sys.exit(f"error: --tokenizer {spec}: not a preset ({', '.join(TOKENIZERS)}) or a tokenizer folder")
    return Path(spec)


def shard_groups(model) -> list[list[str]]:
    """The parameter names of each shard, in order: the embedding, each decoder layer, the rest (norm, head)."""
    names = [n for n, _ in model.named_parameters()]  # a tied head is the embedding's parameter: listed once
    layers = model.config.num_hidden_layers
    groups = [[n for n in names if n.startswith("model.embed_tokens.")]]
    groups += [[n for n in names if n.startswith(f"model.layers.{i}.")] for i in range(layers)]
    placed = {n for g in groups for n in g}
    return groups + [[n for n in names if n not in placed]]


def write(shape: str, tokenizer: str, out: Path, layers: int | None = None, seed: int = 0) -> Path:
    """Write the checkpoint of ``shape`` into ``out`` (refused when it exists); returns ``out``."""
    if out.exists():
        sys.exit(f"error: --out {out}: exists (choose a new folder)")
    tok_dir = tokenizer_folder(tokenizer)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    if tok.eos_token_id is None:
        sys.exit(f"error: --tokenizer {tokenizer}: has no EOS token (bdlora separates documents with it)")
    fields = {**SHAPES[shape], "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
              "bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id, "torch_dtype": "bfloat16"}
    if layers is not None:
        fields["num_hidden_layers"] = layers
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    if model_type == "gemma3_text":  # every sixth layer global, as released
        config.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                              for i in range(config.num_hidden_layers)]
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)  # shapes and names only: no weight memory
    model.tie_weights()  # tied inside the context, the head got a parameter of its own
    config.architectures = [type(model).__name__]  # as released (onnxruntime-genai's builder dispatches on it)
    with atomic_dir(out) as tmp:  # bdlora's writer: a temp name, ordinary permissions, renamed when whole
        groups = [g for g in shard_groups(model) if g]
        params = dict(model.named_parameters())
        weight_map, total = {}, 0
        for k, group in enumerate(groups):
            shard = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
            tensors = {n: value(n, params[n].shape, seed) for n in group}
            save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update({n: shard for n in group})
            print(f"  shard {k + 1}/{len(groups)}: {len(group)} tensors", flush=True)
            del tensors
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "synthetic.json").write_text(json.dumps({"shape": shape, "tokenizer": tokenizer, "seed": seed,
                                                        "layers": config.num_hidden_layers, "bytes": total,
                                                        "note": "random weights: for time and memory only"},
                                                       indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES), help="the released model whose shapes to write")
    p.add_argument("--out", required=True, type=Path, help="the folder to write (must not exist)")
    p.add_argument("--tokenizer", default=TOKENIZERS[0],
                   help=f"a preset ({', '.join(TOKENIZERS)}) or a tokenizer folder; the vocabulary is sized to it")
    p.add_argument("--layers", type=int, default=None, help="fewer decoder layers than released (a quick check)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.layers is not None and a.layers < 1:
        p.error(f"--layers {a.layers}: at least 1")
    out = write(a.shape, a.tokenizer, a.out, a.layers, a.seed)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
