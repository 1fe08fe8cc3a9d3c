import pytest
import torch

from bdlora.base.errors import ModelError, UsageError
from bdlora.train.student import build_student, check_same_vocabulary, select_layers


@pytest.mark.parametrize("mode,L,n,expected", [
    ("mixed", 12, 6, [0, 2, 4, 7, 9, 11]),
    ("mixed", 4, 2, [0, 3]),
    ("mixed", 5, 3, [0, 2, 4]),
    ("mixed", 4, 1, [0]),
    ("mixed", 6, 6, [0, 1, 2, 3, 4, 5]),
    ("first", 12, 6, [0, 1, 2, 3, 4, 5]),
    ("last", 12, 6, [6, 7, 8, 9, 10, 11]),
    ("middle", 12, 6, [3, 4, 5, 6, 7, 8]),
    ("middle", 5, 2, [1, 2]),
    ("scratch", 12, 3, [0, 1, 2]),
])
def test_select_layers(mode, L, n, expected):
    assert select_layers(mode, L, n) == expected


@pytest.mark.parametrize("n", [0, 13])
def test_select_layers_rejects_bad_count(n):
    with pytest.raises(UsageError, match="--student-layers"):
        select_layers("mixed", 12, n)


def test_select_layers_rejects_unknown_mode():
    with pytest.raises(UsageError, match="allowed: first, middle, last, mixed, scratch"):
        select_layers("random", 12, 6)


def test_copied_layers_equal_teacher(tiny_model):
    student, idx = build_student(tiny_model, 2, "mixed")
    assert idx == [0, 3]
    assert student.config.num_hidden_layers == 2
    t, s = tiny_model.state_dict(), student.state_dict()
    for j, i in enumerate(idx):
        for k, v in tiny_model.model.layers[i].state_dict().items():
            torch.testing.assert_close(s[f"model.layers.{j}.{k}"], v, rtol=0, atol=0)
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        torch.testing.assert_close(s[k], t[k], rtol=0, atol=0)


def test_scratch_is_not_a_copy(tiny_model):
    student, _ = build_student(tiny_model, 2, "scratch")
    assert not torch.equal(student.model.layers[0].self_attn.q_proj.weight,
                           tiny_model.model.layers[0].self_attn.q_proj.weight)


def test_vocabulary_mismatch_is_refused(tiny_env):
    from conftest import train_tokenizer

    other = train_tokenizer(tiny_env["corpus"], vocab_size=300)
    with pytest.raises(ModelError, match="vocabulary differs"):
        check_same_vocabulary(tiny_env["tokenizer"], other, "--student-init x")
