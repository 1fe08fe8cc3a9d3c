"""``genai_config.json``: what onnxruntime-genai needs to drive the decoder graph (the fields its model builder
writes), plus the search defaults it generates with (greedy, the model's EOS)."""

from __future__ import annotations

from bdlora.base.runs import MODEL_ONNX
from bdlora.base.threads import ThreadPool
from bdlora.models.families import family, genai_families
from bdlora.models.runtime import DecoderSignature as Sig


def _ids(value) -> int | list[int]:
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def base_type_of(config) -> str:
    """The base family a transformers config's graph is emitted as (a student's: its teacher's)."""
    return (getattr(config, "bdlora", None) or {}).get("base_model_type", config.model_type)


SPIN_OFF = {"session.intra_op.allow_spinning": "0"}  # a string: onnxruntime-genai passes an unknown string option to
# onnxruntime as a session config entry (a number or an object is refused)


def genai_config(config, base_type: str, context_length: int, filename: str = MODEL_ONNX,
                 pool: ThreadPool = ThreadPool(0), spin: bool = True) -> dict:
    """The config onnxruntime-genai reads for ``config`` (a transformers config of the base family ``base_type``).
    ``past_present_share_buffer``: past and present are one (batch, kv_heads, max_length, head_dim) buffer that
    GroupQueryAttention writes in place, so no cache is copied between steps. ``pool``: the intra-op threads the
    folder asks for (0 or None: none written, the runtime's own choice). ``spin`` False: the intra-op threads sleep
    between calls (``SPIN_OFF``) instead of spinning."""
    genai_type = family(base_type).genai_type
    if genai_type is None:
        raise ValueError(f"model type {base_type!r}: onnxruntime-genai export supports {', '.join(genai_families())}")
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    eos = config.eos_token_id if config.eos_token_id is not None else 0
    session_options: dict = {"log_id": "onnxruntime-genai", "provider_options": []}
    if pool.threads:
        session_options["intra_op_num_threads"] = int(pool.threads)
    if not spin:
        session_options.update(SPIN_OFF)
    pad = config.pad_token_id if config.pad_token_id is not None else _ids(eos)
    if isinstance(pad, list):
        pad = pad[0]
    return {
        "model": {
            "bos_token_id": config.bos_token_id if config.bos_token_id is not None else _ids(eos),
            "context_length": int(context_length),
            "decoder": {
                "session_options": session_options,
                "filename": filename,
                "head_size": head_dim,
                "hidden_size": int(config.hidden_size),
                "inputs": {"input_ids": Sig.INPUT_IDS, "attention_mask": Sig.ATTENTION_MASK,
                           "past_key_names": Sig.past("%d", "key"), "past_value_names": Sig.past("%d", "value")},
                "outputs": {"logits": Sig.LOGITS, "present_key_names": Sig.present("%d", "key"),
                            "present_value_names": Sig.present("%d", "value")},
                "num_attention_heads": heads,
                "num_hidden_layers": int(config.num_hidden_layers),
                "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
            },
            "eos_token_id": _ids(eos),
            "pad_token_id": pad,
            "type": genai_type,
            "vocab_size": int(config.vocab_size),
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
            "max_length": int(context_length), "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1, "past_present_share_buffer": True, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }
