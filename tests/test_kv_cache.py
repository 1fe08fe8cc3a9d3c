"""The KV cache reaches every transformers release under the name it declares, without a deprecation warning."""

from __future__ import annotations

import importlib.metadata
import warnings

import numpy as np
import pytest
import torch
from packaging.version import Version
from peft import LoraConfig
from transformers import DynamicCache, MistralForCausalLM

from bdlora.export.onnx.validate import torch_forward
from bdlora.models.kv_cache import RENAMED_IN, cache_argument, returned_cache
from bdlora.models.peft_compat import wrap_lora
from bdlora.models.perplexity import TorchLM
from conftest import tiny_config

INSTALLED = Version(importlib.metadata.version("transformers"))


@pytest.fixture
def model():
    torch.manual_seed(0)
    return MistralForCausalLM(tiny_config(64, layers=2)).eval()


def test_the_argument_is_the_installed_releases_name(model):
    expected = "cache" if INSTALLED >= RENAMED_IN else "past_key_values"
    assert cache_argument(model) == expected
    # PEFT's wrapper takes **kwargs and hands them to a model of the installed release
    wrapped = wrap_lora(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert cache_argument(wrapped) == expected


def test_cached_decoding_is_exact_and_warns_nothing(model):
    ids = np.array([[5, 9, 3, 7, 11, 2]], dtype=np.int64)
    lm = TorchLM(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers 5.24+ warns on ``past_key_values=``
        logits, past = lm.step(ids[:, :4], np.ones((1, 4), np.int64), np.arange(4)[None], None)
        assert past.get_seq_length() == 4
        nxt, past = lm.step(ids[:, 4:5], np.ones((1, 5), np.int64), np.array([[4]]), past)
        scored = lm.score(ids[:, 5:6], np.ones((1, 6), np.int64), np.array([[5]]), past)
        assert past.get_seq_length() == 5  # score rolls its token back
        kv = [torch.zeros(1, 2, 0, 8) for _ in range(4)]  # what export validation feeds the model, flat
        with torch.no_grad():
            out = torch_forward(model, torch.from_numpy(ids), torch.ones(1, 6, dtype=torch.int64),
                                torch.arange(6)[None], kv)
    with torch.no_grad():
        full = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(logits, full[:, 3], atol=1e-5)
    np.testing.assert_allclose(nxt, full[:, 4], atol=1e-5)
    np.testing.assert_allclose(scored[:, 0], full[:, 5], atol=1e-5)
    np.testing.assert_allclose(out[0], full, atol=1e-5)
    assert [tuple(t.shape) for t in out[1:]] == [(1, 2, 6, 8)] * 4


def test_returned_cache_reads_either_field(model):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{cache_argument(model): DynamicCache()})
    assert returned_cache(out).get_seq_length() == 3
