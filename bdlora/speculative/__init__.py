"""Speculative decoding: the teacher's exact output, faster, with a draft proposing the tokens it verifies.

``rules`` (what a round commits: greedy agreement or the rejection rule), ``decoders`` (a rollback-able KV cache
over onnxruntime and onnxruntime-genai), ``proposers`` (a draft model, prompt lookup), ``policy`` (k per round from
the measured acceptance and costs), ``loop`` (one request's rounds). numpy and the runtimes only: serving loads it
without torch.
"""
