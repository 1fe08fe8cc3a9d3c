"""What the bench hands each of its timing processes: one typed spec per worker, written as JSON by the launcher
(``bench.launch``) and read back by the worker, which refuses a spec with a missing or unknown field in one line
(a worker and a bench of different versions, or a hand-edited spec, fail at once instead of deep in a timing loop).
Standard library only: the workers load no torch."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class Spec:
    MODULE: ClassVar[str]  # the worker run as ``python -m MODULE SPEC OUT``

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def read(cls, path) -> Spec:
        """The spec at ``path``; a ``ValueError`` naming a missing or unknown field."""
        with open(path) as f:
            data = json.load(f)
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        if not isinstance(data, dict) or set(data) - names or required - set(data):
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{path}: not a {cls.__name__} (fields {sorted(names)}; it has {got})")
        return cls(**data)


@dataclass(frozen=True)
class OrtTiming(Spec):
    """``bench.worker``: onnxruntime graphs timed interleaved on one global thread pool."""

    MODULE: ClassVar[str] = "bdlora.bench.worker"
    kind: str  # "modules" (each projection stack) or "model" (the whole decoder)
    graphs: dict[str, str]  # variant -> model.onnx
    shapes: list  # [phase, batch, seq] each
    repeats: int
    warmup: int
    threads: int
    provider: str
    decode_tokens: int
    dims: dict  # layers, kv_heads, head_dim, vocab, ... of the model (``bench.run._dims``)
    opt_level: str = "all"


@dataclass(frozen=True)
class GenaiTiming(Spec):
    """``bench.genai_worker``: onnxruntime-genai folders and llama.cpp GGUF files timed interleaved."""

    MODULE: ClassVar[str] = "bdlora.bench.genai_worker"
    folders: dict[str, str]  # variant -> genai folder
    shapes: list
    repeats: int
    warmup: int
    decode_tokens: int
    vocab: int
    threads: int | None = None  # llama.cpp's threads (a genai folder carries its own)
    gguf: dict[str, str] = field(default_factory=dict)  # variant -> .gguf file


@dataclass(frozen=True)
class SpeculativeTiming(Spec):
    """``bench.spec_worker``: a genai target generating alone and with each proposer."""

    MODULE: ClassVar[str] = "bdlora.bench.spec_worker"
    target: str
    prompts: dict[str, list[list[int]]]  # domain -> prompts' token ids
    new_tokens: int
    max_k: int
    threads: int
    repeats: int
    warmup: int
    draft: str | None = None
    lookup: bool = False
    ks: list[int] = field(default_factory=list)  # fixed proposal widths timed beside the adaptive one
    ngram: int = 3
    eos: int | None = None


@dataclass(frozen=True)
class VerifyTiming(Spec):
    """``bench.verify``: a genai graph's verifying calls of 1 to ``widths`` tokens (plan --speculative's curve)."""

    MODULE: ClassVar[str] = "bdlora.bench.verify"
    folder: str
    widths: int
    threads: int
    vocab: int
