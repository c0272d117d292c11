"""``python -m decode_server``: a decode worker (``--role both`` for a colocated one)."""

from decode_server import DECODE_ROLE
from worker.cli import main
from worker.roles import COLOCATED

if __name__ == "__main__":
    main(prog="python -m decode_server", roles=(DECODE_ROLE, COLOCATED), default_port=30001)
