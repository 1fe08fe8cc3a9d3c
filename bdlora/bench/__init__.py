"""``bdlora bench``: onnxruntime timing of the compressed student against its dense and LoRA forms (SPEC 9).

- ``run``: the bench (variants exported, timed in a separate process, ratios beside the MAC limits);
- ``variants``: the dense / lora / compressed / floor models, the projections-only graph, synthetic models;
- ``report``: bench.md and bench.png;
- ``worker``: the timing process (numpy and onnxruntime only).

This file imports nothing, so ``python -m bdlora.bench.worker`` stays free of torch.
"""
