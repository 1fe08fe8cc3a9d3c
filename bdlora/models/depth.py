"""A model with only some of its decoder layers: what a student warm-started from teacher layers starts as
(``train.student``) and what a one-shot compression that removes layers keeps (``compress.oneshot``)."""

from __future__ import annotations

import copy

import torch

from bdlora.models.lazy import empty, is_lazy


def take_layers(source_model, idx: list[int], seed: int = 0, scratch: bool = False):
    """The source with only its decoder layers ``idx`` (ascending), renumbered 0.. in that order: embeddings, final
    norm, LM head and each kept layer copied (random weights with ``scratch``); the source is not changed. Of a lazy
    source (``models.lazy``), a lazy model whose layer ``j`` is the source's ``idx[j]`` to whoever reads it."""
    config = copy.deepcopy(source_model.config)
    config.num_hidden_layers = len(idx)
    if getattr(config, "layer_types", None) is not None:  # per-layer attention kinds (e.g. Qwen2 sliding window)
        config.layer_types = [config.layer_types[i] for i in idx]
    if getattr(config, "bdlora_modules", None):  # a compressed source: each kept layer's forms, renumbered, and the
        # entries outside the layers (a draft's head) as they are
        outside = {k: v for k, v in config.bdlora_modules.items() if not k.startswith("model.layers.")}
        config.bdlora_modules = {**outside,
                                 **{f"model.layers.{j}.{k.split('.', 3)[3]}": v for j, i in enumerate(idx)
                                    for k, v in config.bdlora_modules.items() if k.startswith(f"model.layers.{i}.")}}
    torch.manual_seed(seed)
    if is_lazy(source_model) and not scratch:  # its weights stay the source's files', read under the source's
        return empty(lambda: type(source_model)(config))  # layer numbers (compress.streamed.source_name)
    student = type(source_model)(config)
    if scratch:
        return student.to(torch.float32)
    src, dst = source_model.model, student.model
    dst.embed_tokens.load_state_dict(src.embed_tokens.state_dict())
    dst.norm.load_state_dict(src.norm.state_dict())
    for j, i in enumerate(idx):
        dst.layers[j].load_state_dict(src.layers[i].state_dict())
    if not student.config.tie_word_embeddings:
        student.lm_head.load_state_dict(source_model.lm_head.state_dict())
    student.tie_weights()
    return student.to(torch.float32)
