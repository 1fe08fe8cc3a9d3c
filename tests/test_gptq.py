"""Calibrated low-bit weights (export/genai/gptq.py): the MatMulNBits layout exact under onnxruntime, GPTQ's output
error below round-to-nearest's on the same grid, and a whole genai graph quantised by it."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from bdlora.export.genai.gptq import dequantize, gptq, grid, nbits_node, output_error, pack, rtn


def run_node(codes, scales, zeros, bits, x, level=0):
    n, k = codes.shape
    node, inits = nbits_node("q", "x", "y", *pack(codes, scales, zeros, bits), k=k, n=n, bits=bits,
                             accuracy_level=level)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(40, 70), (64, 96), (3, 33)])
def test_packed_weights_compute_exactly_what_they_dequantise_to(bits, n, k):
    """B, scales and zero points in MatMulNBits' layout (4-bit: low nibble first; K padded to whole blocks; an odd
    number of blocks' zero points): onnxruntime's fp32 kernel (accuracy level 0) equals x @ dequant(codes)^T."""
    torch.manual_seed(n * k + bits)
    w = torch.randn(n, k, dtype=torch.float64)
    codes, scales, zeros = rtn(w, bits)
    x = np.random.default_rng(0).standard_normal((5, k)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(codes, scales, zeros).numpy().T
    np.testing.assert_allclose(run_node(codes, scales, zeros, bits, x), want, rtol=1e-5, atol=1e-5)
    # the int8-activation kernel (level 4, what the export uses) computes the same up to its activation rounding
    fast = run_node(codes, scales, zeros, bits, x, level=4)
    assert np.abs(fast - want).max() <= 0.02 * np.abs(want).max()


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_output_error_is_below_round_to_nearest_on_a_seeded_layer(bits):
    """On correlated inputs (what real activations are), GPTQ's error on the layer's output is well below
    round-to-nearest's on the same grid (measured: about half)."""
    torch.manual_seed(0)
    w = torch.randn(96, 128, dtype=torch.float64)
    x = torch.randn(600, 128, dtype=torch.float64) @ torch.randn(128, 128, dtype=torch.float64)
    h = x.T @ x
    energy = output_error(w, torch.zeros_like(w), h)
    e_rtn = output_error(w, dequantize(*rtn(w, bits)), h) / energy
    e_gptq = output_error(w, dequantize(*gptq(w, h, bits)), h) / energy
    assert e_gptq < 0.7 * e_rtn, (e_gptq, e_rtn)


def test_gptq_with_white_inputs_is_round_to_nearest():
    """With H = I (no correlation to exploit) every column's error stays its own: GPTQ rounds as round-to-nearest
    does (its column loop runs in float32, so a value within float32's precision of a rounding boundary may go the
    other way)."""
    torch.manual_seed(1)
    w = torch.randn(16, 64, dtype=torch.float64)
    c1, s1, z1 = gptq(w, torch.eye(64, dtype=torch.float64), 4)
    c2, s2, z2 = rtn(w, 4)
    torch.testing.assert_close(s1, s2, rtol=1e-6, atol=0)
    assert torch.equal(z1, z2) and (c1 != c2).sum() <= 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=40), st.sampled_from([4, 8]))
def test_grid_holds_the_block_and_zero(values, bits):
    """The asymmetric grid of any block: codes in [0, 2^bits - 1], 0 exactly representable, every value within
    half a step of its rounding."""
    w = torch.tensor([values], dtype=torch.float64)
    s, z = grid(w, bits)
    assert 0 <= z.item() <= (1 << bits) - 1 and z.item() == round(z.item())
    codes, scales, zeros = rtn(w, bits, block=len(values))
    assert int(codes.max()) <= (1 << bits) - 1
    err = (dequantize(codes, scales, zeros, block=len(values)) - w).abs().max().item()
    assert err <= s.item() / 2 + 1e-9


def test_a_genai_graph_quantised_by_gptq_runs_and_errs_less_than_round_to_nearest(tmp_path):
    """A whole (synthetic, mixed dense/low-rank) genai graph: every weight MatMul becomes MatMulNBits (the head at
    8 bits), the graph runs in onnxruntime, GPTQ's logits are closer to fp32's than round-to-nearest's on the same
    grid, and --int8-share moves the most hurt MatMuls to 8 bits, whose rounding error falls with it."""
    import onnx

    from bdlora.bench.variants import synthetic_model
    from bdlora.export.decoder import DecoderLayout, build_decoder
    from bdlora.export.genai.gptq import input_grams, weight_matmuls
    from bdlora.export.genai.quantize import quantize_graph
    from bdlora.models.runtime import DecoderShape, empty_past, run_decoder, session

    config = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False, "rope_theta": 10000.0}
    model, _ = synthetic_model(config, 0.5, None, rank=8)
    shape = DecoderShape.of(model.config)
    proto = build_decoder(model, DecoderLayout.genai(64))

    class Blocks:  # stands in for PackedBlocks: token rows the graph runs on
        seq_len = 24

        def __init__(self, seed, n):
            self.x = np.random.default_rng(seed).integers(0, 96, (n, 24))

        def __len__(self):
            return len(self.x)

        def get(self, idx):
            return self.x[list(idx)]

    grams = input_grams(proto, shape, Blocks(0, 16))
    head = "/lm_head/MatMul"
    bits = lambda name: 8 if name == head else 4  # noqa: E731

    def logits(p):
        onnx.save_model(p, str(tmp_path / "m.onnx"))
        x = Blocks(1, 4).x
        return run_decoder(session(tmp_path / "m.onnx"), x, np.ones_like(x), None, empty_past(shape, 4))[0]

    ref = logits(proto)
    err = {}
    for name, method, share in (("rtn", "rtn", 0.0), ("gptq", "gptq", 0.0), ("mixed", "gptq", 0.5)):
        q, info = quantize_graph(proto, grams, bits, method, int8_share=share)
        ops = [n.op_type for n in q.graph.node]
        assert "MatMul" not in ops and ops.count("MatMulNBits") == len(weight_matmuls(proto))
        assert info["bits"][head] == 8
        err[name] = float(np.abs(logits(q) - ref).mean())
        err[name + " rounding"] = sum(info["relative_output_error"].values())
        if name == "mixed":
            eight = [n for n, b in info["bits"].items() if b == 8 and n != head]
            assert eight and len(eight) < len(info["bits"]) - 1
    # the logits (int8 activations inside the kernel add a floor) and the rounding errors themselves
    assert err["gptq"] < err["rtn"] and err["gptq rounding"] < err["rtn rounding"], err
    assert err["mixed rounding"] < 0.6 * err["gptq rounding"], err


def test_gptq_rounds_a_matmul_the_same_in_slices_of_output_rows(monkeypatch):
    """GPTQ's rows are independent (one H): the head of a large vocabulary is rounded 4,096 rows at a time, and
    slices of 7 rows give the codes, scales and zero points of one call over all 40."""
    from onnx import numpy_helper

    import bdlora.export.genai.quantize as q

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 64))
    h = torch.from_numpy(x.T @ x)
    b = rng.normal(size=(64, 40)).astype(np.float32)  # (K, N) as the graph stores it
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="m")
    init = numpy_helper.from_array(b, "w")
    whole = q._round_matmul(node, init, {"x": h}, 4, "gptq")
    monkeypatch.setattr(q, "GPTQ_ROWS", 7)
    sliced = q._round_matmul(node, init, {"x": h}, 4, "gptq")
    (_, made_whole), err_whole = whole
    (_, made_sliced), err_sliced = sliced
    for a, c in zip(made_whole, made_sliced, strict=True):
        assert a.name == c.name and np.array_equal(numpy_helper.to_array(a), numpy_helper.to_array(c))
    assert err_sliced == pytest.approx(err_whole, rel=1e-9)
    codes, scales, zeros = gptq(torch.from_numpy(b.T.astype(np.float64)), h, 4)
    assert err_whole == pytest.approx(output_error(torch.from_numpy(b.T).double(), dequantize(codes, scales, zeros), h)
                                      / float(torch.einsum("nk,kl,nl->", torch.from_numpy(b.T).double(), h,
                                                           torch.from_numpy(b.T).double())), rel=1e-9)
