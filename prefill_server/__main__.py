"""``python -m prefill_server``: a prefill worker (``--role both`` for a colocated one)."""

from prefill_server import PREFILL_ROLE
from worker.cli import main
from worker.roles import COLOCATED

if __name__ == "__main__":
    main(prog="python -m prefill_server", roles=(PREFILL_ROLE, COLOCATED), default_port=30000)
