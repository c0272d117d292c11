"""The weight and KV formats the engine's flags may ask for (torch-free, so
the worker's command line lists them).

``--quantization fp8``: e4m3 weights with a scale per output channel
(``engine.layers.fp8``). ``--kv-cache-dtype fp8_e4m3``: the KV pool in e4m3
(``engine.kvcache.pool``)."""

QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
"""``auto``: the model's dtype."""
