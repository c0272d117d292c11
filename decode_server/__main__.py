"""``python -m decode_server``: a decode worker (``--role both`` for a colocated one)."""

from engine.worker.cli import main

if __name__ == "__main__":
    main(prog="python -m decode_server", default_role="decode", default_port=30001)
