"""Models: reading any folder bdlora makes or takes (``load``; the teacher's build and presets in ``teacher``,
``sources``), architecture access (``arch``, ``families``), the Budgeted LoRA model itself in the shape of PEFT's
tuners (``budgeted``: its config, gated layer and model), what each module costs (``costs``: shapes, MACs, the
compression rules, the ``CostModel`` protocol), and running a model or an export (``perplexity``, ``runtime``,
``kv_cache``, ``lazy``). Core: imports base, data, forms' registry and deployed, never compress, train or eval."""
