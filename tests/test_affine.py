"""int4 on an affine grid (export/genai/affine.py): Q4_1-grid weights given back exactly, the float offsets carried by
one MatMulNBits node at integer zero points (the fast kernel) with the block means of its input, and a genai graph
whose weights sit on a Q4_1 grid quantised far closer than round-to-nearest."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from bdlora.export.genai.affine import (
    affine_node,
    affine_rtn,
    affine_weights,
    augment_nodes,
    split_offset,
    symmetric_rtn,
)
from bdlora.export.genai.gptq import dequantize, rtn


def q4_1(n: int, k: int, seed: int) -> torch.Tensor:
    """Weights on llama.cpp's Q4_1 grid: per block of 32 a float scale and offset (the min), codes 0..15 with 0 and
    15 present, blocks around 0 as trained weights are."""
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, 1, generator=g, dtype=torch.float64) * 0.01 + 1e-3
    m = -d * (torch.rand(n, k // 32, 1, generator=g, dtype=torch.float64) * 15)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).double()
    q[..., 0], q[..., 1] = 0, 15
    return (d * q + m).view(n, k)


def run(nodes, inits, k: int, n: int, x: np.ndarray) -> np.ndarray:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", n])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 10_000))
def test_q4_1_weights_are_given_back_exactly(n, blocks, seed):
    """On weights that sit on a Q4_1 grid the affine grid is that grid: codes, scales and offsets dequantise to the
    weights to float64 rounding, where the integer grid of round-to-nearest cannot."""
    w = q4_1(n, 32 * blocks, seed)
    codes, scales, zeros = affine_rtn(w, 4)
    assert int(codes.max()) <= 15
    assert torch.allclose(dequantize(codes, scales, zeros), w, rtol=0, atol=1e-12)
    z, offset = split_offset(scales, zeros, 4)
    assert torch.equal(z, z.round()) and bool((offset.abs() <= scales / 2 + 1e-12).all())  # at most half a step


def test_q8_0_weights_are_given_back_exactly():
    """The 8-bit grid is Q8_0's (scale max|w|/127, zero point 128): exact on such weights."""
    g = torch.Generator().manual_seed(0)
    d = torch.rand(5, 3, 1, generator=g, dtype=torch.float64) * 0.01 + 1e-3
    q = torch.randint(-127, 128, (5, 3, 32), generator=g).double()
    q[..., 0] = 127
    w = (d * q).view(5, 96)
    codes, scales, zeros = symmetric_rtn(w, 8)
    assert torch.equal(zeros, torch.full_like(zeros, 128.0))
    assert torch.allclose(dequantize(codes, scales, zeros), w, rtol=0, atol=1e-12)


def test_block_means_and_the_one_node_compute_the_affine_weights():
    """AveragePool + Concat give ``[x, block means of x]``; the MatMulNBits node reading it computes ``x @ W_hat^T``
    where W_hat holds the integer-grid weights plus the 4-bit-rounded offsets (``affine_weights``) to the kernel's
    float error (accuracy level 0: fp32 activations); the offsets' rounding costs under 1/20 of round-to-nearest's
    error."""
    n, k = 48, 96
    w = q4_1(n, k, 1)
    x = np.random.default_rng(0).standard_normal((2, 3, k)).astype(np.float32)
    aug, aug_nodes = augment_nodes("x", k)
    assert [nd.op_type for nd in aug_nodes] == ["AveragePool", "Concat"]
    both = run(aug_nodes + [helper.make_node("Identity", [aug], ["y"])], [], k, k + k // 32, x)
    np.testing.assert_array_equal(both[..., :k], x)
    np.testing.assert_allclose(both[..., k:], x.reshape(2, 3, k // 32, 32).mean(-1), rtol=1e-5, atol=1e-6)
    codes, scales, zeros = affine_rtn(w, 4)
    nodes, inits = affine_node("q", "x", "y", codes, scales, zeros, k=k, n=n, bits=4, accuracy_level=0)
    assert [nd.op_type for nd in nodes] == ["MatMulNBits"] and nodes[0].input[0] == aug
    y = run(aug_nodes + nodes, inits, k, n, x)
    w_hat = affine_weights(codes, scales, zeros, 4)
    np.testing.assert_allclose(y, x @ w_hat.numpy().T, rtol=1e-4, atol=1e-5)
    err_affine = float(((w_hat - w) ** 2).sum())
    err_rtn = float(((dequantize(*rtn(w, 4)) - w) ** 2).sum())
    assert err_affine < err_rtn / 20, (err_affine, err_rtn)


def test_offsets_on_the_integer_grid_need_no_correction_and_bad_k_is_refused():
    """Blocks whose offsets are whole steps (symmetric grids) keep the plain node on x itself; block means need
    whole blocks."""
    w = torch.tensor([[-1.0, 0.0, 1.0] * 10 + [0.5, -0.5]], dtype=torch.float64)
    codes, scales, zeros = affine_rtn(w, 4)
    z, offset = split_offset(scales, torch.round(zeros), 4)
    nodes, _ = affine_node("q", "x", "y", codes, scales, torch.round(zeros), k=32, n=1, bits=4)
    assert [nd.op_type for nd in nodes] == ["MatMulNBits"] and nodes[0].input[0] == "x" and not bool(offset.any())
    with pytest.raises(ValueError, match="K 40: block means need whole blocks of 32"):
        augment_nodes("x", 40)


def test_a_genai_graph_on_a_q4_1_grid_quantises_far_closer_than_round_to_nearest(tmp_path):
    """A whole synthetic genai graph whose projection weights are snapped to a Q4_1 grid (as SmolLM2's GGUF is):
    with --quant affine every weight MatMul is one MatMulNBits at integer zero points and accuracy level 4 (the
    round-to-nearest kernel), the graph runs, and its logits are far closer to fp32's than round-to-nearest's."""
    import onnx
    from onnx import numpy_helper

    from bdlora.bench.variants import synthetic_model
    from bdlora.export.decoder import DecoderLayout, build_decoder
    from bdlora.export.genai.quantize import quantize_nbits
    from bdlora.models.runtime import DecoderShape, empty_past, run_decoder, session

    config = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False, "rope_theta": 10000.0}
    model, _ = synthetic_model(config, 1.0, None, rank=8)  # every projection dense
    proto = build_decoder(model, DecoderLayout.genai(64))
    weights = {nd.input[1] for nd in proto.graph.node if nd.op_type == "MatMul"}
    for t in proto.graph.initializer:  # snap each weight MatMul's (K, N) matrix to Q4_1 along K
        if t.name in weights:
            a = numpy_helper.to_array(t)
            c, s, z = affine_rtn(torch.from_numpy(a.T.astype(np.float64)), 4)
            t.CopyFrom(numpy_helper.from_array(dequantize(c, s, z).T.numpy().astype(np.float32), t.name))
    shape = DecoderShape.of(model.config)
    x = np.random.default_rng(1).integers(0, 96, (4, 24))

    def logits(p):
        onnx.save_model(p, str(tmp_path / "m.onnx"))
        return run_decoder(session(tmp_path / "m.onnx"), x, np.ones_like(x), None, empty_past(shape, 4))[0]

    ref = logits(proto)
    err = {}
    for method in ("rtn", "affine"):
        q, info = quantize_nbits(proto, "int4", method)
        assert info["matmuls_fp32"] == 0 and info["lm_head_bits"] == 8
        nbits = [nd for nd in q.graph.node if nd.op_type == "MatMulNBits"]
        assert all({a.name: a.i for a in nd.attribute}["accuracy_level"] == 4 for nd in nbits)
        err[method] = float(np.abs(logits(q) - ref).mean())
    assert info["method"] == "affine" and info["offset_corrections"] == 4 * 2  # qkv, o, gate/up, down per layer
    zero_points = {i.name: i for i in q.graph.initializer}
    assert all(zero_points[nd.input[3]].data_type == TensorProto.UINT8 for nd in nbits)
    assert err["affine"] < err["rtn"] / 4, err
