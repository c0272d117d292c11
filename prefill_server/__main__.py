"""``python -m prefill_server``: a prefill worker (``--role both`` for a colocated one)."""

from engine.worker.cli import main

if __name__ == "__main__":
    main(prog="python -m prefill_server", default_role="prefill", default_port=30000)
