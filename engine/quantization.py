"""The weight formats ``--quantization`` may ask for (torch-free, so the
worker's command line lists them): ``fp8``, e4m3 weights with a scale per
output channel (``engine.layers.fp8``)."""

QUANTIZATIONS = ("fp8",)
