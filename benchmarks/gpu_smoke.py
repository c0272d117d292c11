"""Smoke run of the whole serving stack on this machine, in one command::

    python -m benchmarks.gpu_smoke [--model DIR_OR_PRESET] [--load-format dummy]

Four deployments, one after the other (each stopped before the next starts),
and on CUDA a fifth:

  a  ``python -m gateway`` (embedded workers, built-in tiny model)
  b  ``python -m gateway --model M`` (embedded workers)
  c  ``python -m decode_server --role both --model M`` behind ``python -m gateway --decode URL``
  d  ``python -m prefill_server --model M`` and ``python -m decode_server --model M`` on one
     GPU behind ``python -m gateway --prefill URL --decode URL``
  e  c's worker with every optional kernel on (``TUNED_FLAGS``: FP8 weights and
     LM head, e4m3 KV pages, the fused layer prologue, the Triton decode
     attention, fresh prompts' whole-forward graphs), so a path that only runs
     with those flags is served end to end too

Each gets a chat completion, the same streamed, a ``json_schema`` request and
``GET /metrics``. In c and d the decode worker is then SIGKILLed (front and
engine) in the middle of a stream, which must end with an error, not hang, and
restarted on the same port, after which a request must succeed. On CUDA,
``python -m pytest -q -m gpu`` runs last (failures a line each).

M: ``--model`` (a checkpoint directory or a preset of ``engine/presets.py``,
which implies ``--load-format dummy``); by default ``llama-3.1-8b`` with random
weights on CUDA, else the built-in tiny model's directory. Prints one line per
check and a summary; exits 0 when every check passed. Every wait is bounded and
ends early when the process waited for exits; every process started is stopped
on the way out, also on errors, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import KERNEL_SETTINGS
from engine.presets import PRESETS
from harness.host import git_commit
from harness.procs import REPO, Proc, free_port, running
from harness.procs import ProcError as Failed

DEFAULT_GPU_MODEL = "llama-3.1-8b"
START_TIMEOUT_S = 300.0
"""A worker or gateway answering /health (an 8B model with graph capture: ~40 s)."""
REQUEST_TIMEOUT_S = 120.0
KILL_ERROR_S = 30.0
"""How long a client may wait for its stream to end once its decode worker died."""
READMIT_TIMEOUT_S = 30.0
"""How long the gateway may take to route to a restarted worker that answers /health."""
PYTEST_TIMEOUT_S = 600.0
LOG_LINES = 40
GPU_MEMORY_FLAG = "--gpu-memory-utilization"
PD_GPU_MEMORY = "0.45"
"""Each worker's share of the GPU in d, where two workers share one."""
CHAT = [{"role": "user", "content": "Say hello in a few words."}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def wait_ok(proc: Proc, path: str = "/health", timeout_s: float = START_TIMEOUT_S) -> float:
    """Poll ``proc``'s ``path`` until 200; fail (``Failed``) when it exits or
    ``timeout_s`` passes. Returns the seconds it took."""
    return proc.wait_http(path, timeout_s, poll_s=0.2)


# -- deployments -------------------------------------------------------------------


def _switches() -> list[str]:
    """The flags of every on/off kernel setting (``KERNEL_SETTINGS``), on."""
    from engine.config import EngineConfig
    from protocol.settings import flags

    return [
        arg
        for f in flags(EngineConfig)
        if f.name in KERNEL_SETTINGS and f.kind is bool
        for arg in f.argv(True)
    ]


TUNED_FLAGS = [
    "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3", "--decode-kernel", "triton",
    *_switches(),
]  # fmt: skip
"""Deployment e's worker flags: the engine's optional kernels, all on (the
LM head in FP8, the fused prologue, fresh prompts' whole-forward graphs:
every on/off kernel setting, so a new one is served here too)."""
CUDA_ONLY = "e"
"""Deployments whose flags need CUDA (FlashInfer attention)."""


@dataclass
class Setup:
    model: str | None
    load_format: str | None
    device: str
    cuda: bool
    pd_flags: list[str]
    """Extra flags of each worker of d (its share of the GPU)."""
    log_dir: Path


@dataclass
class Deployment:
    label: str
    procs: list[Proc]
    """The gateway first (the order they are stopped in), then its workers."""
    http: httpx.Client | None = None
    model: str = ""
    max_model_len: int = 0

    @property
    def gateway(self) -> Proc:
        return self.procs[0]

    @property
    def decode(self) -> Proc:
        return next(p for p in self.procs if p.name.endswith(("decode", "both")))

    def post(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self.http is not None
        resp = self.http.post("/v1/chat/completions", json={"model": self.model, **body})
        if resp.status_code != 200:
            raise Failed(f"HTTP {resp.status_code}: {resp.text[:200]}", self.gateway)
        return resp.json()


def py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def model_flags(s: Setup) -> list[str]:
    flags = ["--model", s.model] if s.model else []
    return flags + (["--load-format", s.load_format] if s.load_format else [])


def device_flags(s: Setup) -> list[str]:
    return [] if s.device == "auto" else ["--device", s.device]


def build(label: str, s: Setup) -> Deployment:
    """The processes of deployment ``label`` (not started yet)."""
    env = {"DISAGG_CLUSTER_TOKEN": secrets.token_hex(16)} if label in "cd" else {}

    def proc(name: str, cmd: list[str]) -> Proc:
        port = free_port()
        path = s.log_dir / f"{label}-{name}.log"
        return Proc(f"{label}-{name}", [*cmd, "--port", str(port)], path, env, port)

    gateway = py("gateway", "--host", "127.0.0.1", *device_flags(s))
    if label == "a":
        return Deployment(label, [proc("gateway", gateway)])
    if label == "b":
        return Deployment(label, [proc("gateway", [*gateway, *model_flags(s)])])
    worker_flags = [*model_flags(s), *device_flags(s)]
    gateway = py("gateway", "--host", "127.0.0.1")
    if label in "ce":
        tuned = TUNED_FLAGS if label == "e" else []
        both = proc("both", py("decode_server", "--role", "both", *worker_flags, *tuned))
        return Deployment(label, [proc("gateway", [*gateway, "--decode", both.url]), both])
    prefill = proc("prefill", py("prefill_server", *worker_flags, *s.pd_flags))
    decode = proc("decode", py("decode_server", *worker_flags, *s.pd_flags))
    gateway += ["--prefill", prefill.url, "--decode", decode.url]
    return Deployment(label, [proc("gateway", gateway), prefill, decode])


def show(cmd: list[str]) -> str:
    return shlex.join(["python", *cmd[1:]])


# -- checks: each returns a note for its line or raises Failed -----------------------


def check_start(d: Deployment) -> str:
    """Workers first (they load in parallel), then the gateway; each until /health."""
    workers, gateway = d.procs[1:], d.gateway
    for p in workers:
        p.start()
    for p in workers:
        wait_ok(p)
    gateway.start()
    wait_ok(gateway)
    d.http = httpx.Client(base_url=gateway.url, timeout=REQUEST_TIMEOUT_S)
    card = d.http.get("/v1/models").raise_for_status().json()["data"][0]
    d.model, d.max_model_len = card["id"], int(card.get("max_model_len") or 0)
    return "; ".join(x for x in [f"model {d.model}", *map(start_parts, workers)] if x)


def start_parts(worker: Proc) -> str:
    """Where a worker's start went (its /server_info), e.g. ``weights 3.1,
    decode graphs 5.0, ...`` seconds; empty where it does not say."""
    try:
        info = httpx.get(f"{worker.url}/server_info", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return ""
    parts = info.get("start_seconds") or {}
    return ", ".join(f"{name} {s:.1f}" for name, s in parts.items())


def check_chat(d: Deployment) -> str:
    body = d.post({"messages": CHAT, "max_tokens": 16})
    choice, usage = body["choices"][0], body["usage"]
    if not isinstance(choice["message"]["content"], str) or usage["completion_tokens"] < 1:
        raise Failed(f"no completion: {json.dumps(body)[:200]}")
    return f"{usage['completion_tokens']} tokens, {choice['finish_reason']}"


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | None]:
    """The JSON events of an SSE stream; None for ``[DONE]``."""
    for line in lines:
        if line.startswith("data: "):
            yield None if line == "data: [DONE]" else json.loads(line[6:])


def check_stream(d: Deployment) -> str:
    assert d.http is not None
    body = {"model": d.model, "messages": CHAT, "max_tokens": 16, "stream": True}
    chunks, done = 0, False
    with d.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise Failed(f"HTTP {resp.status_code}: {resp.read()[:200]!r}", d.gateway)
        for event in sse_events(resp.iter_lines()):
            if event is None:
                done = True
            elif "error" in event:
                raise Failed(f"error event: {event['error']}", d.gateway)
            elif done:
                raise Failed("an event after [DONE]")
            else:
                chunks += bool(event.get("choices"))
    if not chunks or not done:
        raise Failed(f"{chunks} chunks, {'' if done else 'no '}[DONE]")
    return f"{chunks} chunks"


def check_json(d: Deployment) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    messages = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
    choice = d.post({"messages": messages, "max_tokens": 64, "response_format": fmt})["choices"][0]
    content, finish = choice["message"]["content"], choice["finish_reason"]
    try:
        value = json.loads(content)
    except (TypeError, ValueError):
        raise Failed(f"not JSON (finish_reason {finish}): {content!r:.80}") from None
    if not (isinstance(value, dict) and set(value) == {"ok"} and isinstance(value["ok"], bool)):
        raise Failed(f"does not match the schema: {content!r:.80}")
    return content


def check_metrics(d: Deployment) -> str:
    assert d.http is not None
    resp = d.http.get("/metrics")
    if resp.status_code != 200:
        raise Failed(f"HTTP {resp.status_code}")
    names = {line.split()[2] for line in resp.text.splitlines() if line.startswith("# TYPE ")}
    gateway = sorted(n for n in names if n.startswith("gateway_"))
    if not gateway:
        raise Failed(f"no gateway_ metrics among {sorted(names)[:5]}")
    return f"{len(gateway)} gateway_ metrics"


def check_kill(d: Deployment) -> str:
    """SIGKILL the decode worker mid-stream: the stream must end with an error
    (an error event, a closed connection) within ``KILL_ERROR_S``."""
    assert d.http is not None
    max_tokens = max(64, min(1000, d.max_model_len // 2))
    body = {"model": d.model, "messages": CHAT, "max_tokens": max_tokens, "stream": True}
    body["ignore_eos"] = True
    timeout = httpx.Timeout(KILL_ERROR_S, connect=10)
    with d.http.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as resp:
        if resp.status_code != 200:
            raise Failed(f"HTTP {resp.status_code} before the kill", d.gateway)
        events = sse_events(resp.iter_lines())
        for chunks, event in enumerate(events, 1):
            if event is None or "error" in event:
                raise Failed(f"stream ended before the kill: {event}", d.gateway)
            if chunks == 3:
                break
        d.decode.kill()
        killed = time.monotonic()
        outcome = stream_end(events, killed + KILL_ERROR_S)
    return f"{outcome} {time.monotonic() - killed:.2f}s after the kill"


def stream_end(events: Iterator[dict[str, Any] | None], deadline: float) -> str:
    """How a stream whose worker was killed ends; Failed unless with an error."""
    try:
        for event in events:
            if event is not None and "error" in event:
                error = event["error"]
                if not error.get("message") or error.get("code") == "internal_error":
                    raise Failed(f"error event without a reason: {error}")
                return f"error event ({error.get('message')!r:.80})"
            if event is None:
                raise Failed("stream ended with [DONE] and no error")
            if time.monotonic() > deadline:
                raise Failed(f"client still getting chunks {KILL_ERROR_S:g}s after the kill")
    except httpx.TimeoutException:
        raise Failed(f"client hung {KILL_ERROR_S:g}s") from None
    except httpx.TransportError as e:
        return f"connection closed ({type(e).__name__})"
    return "stream closed without [DONE]"


def check_restart(d: Deployment) -> str:
    """Restart the killed decode worker on its port; once it and the gateway
    answer /health, a request must succeed."""
    decode = d.decode
    if decode.alive:
        raise Failed(f"{decode.name} was not killed")
    decode.start()
    up = wait_ok(decode)
    readmitted = wait_ok(d.gateway, timeout_s=READMIT_TIMEOUT_S)
    check_chat(d)
    return f"worker healthy in {up:.1f}s, gateway in {readmitted:.1f}s more"


def check_pytest(log_dir: Path) -> str:
    # One line a failure (where it failed and the assertion's message), and a
    # wide summary whose lines keep their messages: the log's last lines, which
    # a failed check prints, then say why without the log itself.
    cmd = py("pytest", "-q", "-m", "gpu", "--tb=line", "-rfE")
    p = Proc("pytest", cmd, log_dir / "pytest.log", {"COLUMNS": "240"})
    with running([p]):
        p.start()
        assert p.proc is not None
        try:
            code = p.proc.wait(PYTEST_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise Failed(f"not done after {PYTEST_TIMEOUT_S:g}s", p) from None
    summary = re.compile(r"\d+ (passed|failed|error|errors|skipped|deselected)\b")
    last = [line for line in p.log_tail(400).splitlines() if summary.search(line)]
    line = last[-1].strip("= ") if last else f"exit code {code}"
    if code != 0:
        raise Failed(line, p)
    return line


CHECKS: list[tuple[str, Callable[[Deployment], str]]] = [
    ("chat", check_chat),
    ("stream", check_stream),
    ("json", check_json),
    ("metrics", check_metrics),
]
FAULT_CHECKS = [("kill", check_kill), ("restart", check_restart)]


# -- running -----------------------------------------------------------------------


@dataclass
class Result:
    name: str
    ok: bool
    seconds: float
    detail: str = ""


@dataclass
class Runner:
    results: list[Result] = field(default_factory=list)
    shown: set[str] = field(default_factory=set)
    """Processes whose log was printed (once per deployment)."""

    def check(self, name: str, fn: Callable[..., str], arg: Any, procs: list[Proc]) -> bool:
        """Run one check, print its line (and on failure the log of the process
        that explains it, or of those that died)."""
        t0 = time.monotonic()
        explain: list[Proc] = []
        try:
            detail, ok = fn(arg), True
        except Failed as e:
            detail, ok = e.reason, False
            explain = [e.proc] if e.proc else []
        except Exception as e:  # noqa: BLE001 - one broken check must not end the run
            detail, ok = f"{type(e).__name__}: {e}", False
        result = Result(name, ok, round(time.monotonic() - t0, 2), detail)
        self.results.append(result)
        print(f"{'PASS' if ok else 'FAIL':<5} {name:<11} {result.seconds:6.2f}s  {detail}")
        if not ok:
            for p in explain or [p for p in procs if p.exited]:
                if p.name in self.shown:
                    continue
                self.shown.add(p.name)
                print(
                    f"----- last {LOG_LINES} lines of {p.log_path} -----\n{p.log_tail(LOG_LINES)}"
                )
        sys.stdout.flush()
        return ok


def run_deployment(label: str, setup: Setup, runner: Runner) -> None:
    d = build(label, setup)
    print(f"== {label}")
    for p in [*d.procs[1:], d.gateway]:
        print(f"   $ {show(p.cmd)}")
    sys.stdout.flush()
    with running(d.procs):
        try:
            if not runner.check(f"{label}/start", check_start, d, d.procs):
                return
            for name, fn in CHECKS + (FAULT_CHECKS if label in "cd" else []):
                runner.check(f"{label}/{name}", fn, d, d.procs)
        finally:
            if d.http is not None:
                d.http.close()


def probe_cuda(device: str) -> tuple[bool, str]:
    """Whether the workers get a CUDA device, and the GPU's name (in a child
    process: this one never holds a CUDA context)."""
    name = ""
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
            name = out.strip().splitlines()[0] if out.strip() else ""
    if device == "cpu":
        return False, name
    code = (
        "import torch; a = torch.cuda.is_available(); print(a, a and torch.cuda.get_device_name())"
    )
    try:
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
    except subprocess.SubprocessError:
        return False, name
    out = run.stdout.split(maxsplit=1)
    cuda = bool(out) and out[0] == "True"
    return cuda, name or (out[1].strip() if cuda and len(out) > 1 else "")


def has_flag(module: str, flag: str) -> bool:
    out = subprocess.run(
        py(module, "--help"), capture_output=True, text=True, timeout=120, cwd=REPO
    )
    return flag in out.stdout


def resolve_model(args: argparse.Namespace, cuda: bool) -> tuple[str, str | None]:
    """The model of b, c and d and its load format (None: the workers' default)."""
    model = args.model or (DEFAULT_GPU_MODEL if cuda else None)
    if model is None:
        from engine.tiny import ensure_tiny_model

        return str(ensure_tiny_model()), args.load_format
    if model in PRESETS:
        return model, args.load_format or "dummy"
    return model, args.load_format


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_smoke",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", help=f"checkpoint dir or preset ({', '.join(sorted(PRESETS))})")
    ap.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        help="the workers' --load-format (default: dummy for a preset, else theirs)",
    )
    ap.add_argument("--device", default="auto", help="the workers' --device (default: auto)")
    ap.add_argument(
        "--only",
        default=None,
        help="deployments to run, of a,b,c,d,e (default: all; e on CUDA only)",
    )
    ap.add_argument("--skip-pytest", action="store_true", help="do not run pytest -m gpu")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    if args.only is not None:
        args.only = [x for x in args.only.split(",") if x]
        if not args.only or set(args.only) - set("abcde"):
            ap.error(f"--only takes letters of a,b,c,d,e, got {args.only}")
    return args


def write_json(path: str, setup: Setup, gpu: str, runner: Runner, interrupted: bool) -> None:
    """The record of the checks run, also of a run stopped part way
    (``interrupted``: by SIGINT or SIGTERM, as a time limit sends)."""
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"hostname": socket.gethostname(), "gpu": gpu},
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "git_commit": git_commit(full=True),
        "model": setup.model,
        "load_format": setup.load_format,
        "device": setup.device,
        "cuda": setup.cuda,
        "passed": sum(r.ok for r in runner.results),
        "failed": sum(not r.ok for r in runner.results),
        "interrupted": interrupted,
        "results": [asdict(r) for r in runner.results],
    }
    Path(path).write_text(json.dumps(record, indent=2) + "\n")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.monotonic()
    cuda, gpu = probe_cuda(args.device)
    if args.only is None:
        args.only = list("abcde" if cuda else "abcd")
    elif not cuda and set(args.only) & set(CUDA_ONLY):
        print(f"deployment {CUDA_ONLY} needs CUDA: its kernels run on FlashInfer", file=sys.stderr)
        return 2
    model, load_format = resolve_model(args, cuda)
    pd_flags = []
    if cuda and has_flag("decode_server", GPU_MEMORY_FLAG):
        pd_flags = [GPU_MEMORY_FLAG, PD_GPU_MEMORY]
    log_dir = Path(tempfile.mkdtemp(prefix="gpu_smoke-"))
    setup = Setup(model, load_format, args.device, cuda, pd_flags, log_dir)
    print(
        f"model {model} ({load_format or 'default'} weights), device {args.device}, "
        f"{'CUDA: ' + (gpu or '?') if cuda else 'no CUDA'}; logs in {log_dir}"
    )
    runner = Runner()
    try:
        for label in args.only:
            run_deployment(label, setup, runner)
        if cuda and not args.skip_pytest:
            print("== pytest -m gpu")
            runner.check("pytest/gpu", check_pytest, log_dir, [])
    except KeyboardInterrupt:
        print("interrupted; every process started was stopped", file=sys.stderr)
        if args.json:
            write_json(args.json, setup, gpu, runner, interrupted=True)
        return 130
    failed = [r.name for r in runner.results if not r.ok]
    print(
        f"{len(runner.results) - len(failed)} passed, {len(failed)} failed"
        f"{' (' + ', '.join(failed) + ')' if failed else ''} in {time.monotonic() - t0:.0f}s"
    )
    if args.json:
        write_json(args.json, setup, gpu, runner, interrupted=False)
    if failed:
        print(f"logs kept in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
