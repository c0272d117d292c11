"""The OpenAI-compatible gateway in front of the prefill and decode workers.

- ``app``: the HTTP routes; ``state``: what they share; ``config``: ``GatewayConfig``.
- ``openai/``: the API's requests, checks, errors, choices and response shapes.
- ``text/``: tokenizer, chat templates, stream detokenizer, stop strings.
- ``routing/``: workers, policies, prefix trees, breakers, health checks, admin.
- ``dispatch``: one request over a prefill and a decode worker, streams merged.
- ``metrics``: Prometheus metrics; ``embedded``: local workers when none are given.

Importing the gateway imports no torch and no engine or worker module.
"""
