"""Disaggregated serving end to end: real prefill and decode worker processes
(``python -m prefill_server --role prefill`` / ``python -m decode_server --role
decode``) on the tiny model, with the test playing the gateway.

The requester's protocol: pick a room id, send ``Generate(..., room,
prefill_bootstrap=P)`` to the decode worker and ``Prefill(..., room,
decode_bootstrap=D)`` to the prefill worker at the same time. The prefill worker
answers with one delta (the first token, "prefill_done" or a real finish
reason); the decode worker streams the rest and ends the request.

Worker sets are started once per module (per transfer backend) and shared;
their transfer timeout is long, so every failure they are shown must be
reported at once, not by a timeout. Tests that kill a worker get a pair of
their own (function scope) with a short transfer timeout: what only a timeout
can detect must end within it. After every test each live worker must be idle
with its whole KV pool available again. Workers are polled (/health, stats)
with deadlines; nothing waits a fixed time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from workers import Worker, dump_log, free_port, launch_worker, launch_workers, worker_cmd

from engine.llm import LLM
from kvtransfer.endpoint import PEER_HEARTBEAT_TIMEOUT_S
from kvtransfer.nixl import nixl_available
from protocol.auth import keys_for
from protocol.client import WorkerClient, WorkerDisconnected, WorkerError
from protocol.finish import FinishReason
from protocol.sampling import SamplingParams
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate, Prefill
from worker.cli import CLUSTER_TOKEN_ENV

pytestmark = pytest.mark.e2e

VOCAB = 512
ENGINE: dict[str, Any] = dict(
    page_size=4,
    num_pages=300,
    max_num_batched_tokens=64,
    chunk_size=16,
    max_running_requests=32,
    context_length=128,
)
SHORT_TIMEOUT_S = 3.0
"""``--transfer-timeout-s`` of the workers of the kill tests: a failure that only a
timeout can detect (a silent peer) must end within a few of these."""
LONG_TIMEOUT_S = 30.0
"""``--transfer-timeout-s`` of the shared worker sets: a loaded machine never
times out a healthy transfer, and every failure they see must be reported at
once, not by a timeout (the tests check how fast)."""
SMALL_POOL_PAGES = 25
"""``--num-pages`` of the pool-full decode worker: 24 usable pages (96 tokens)."""
TOKEN = "pd-e2e-cluster-secret"
CLIENT_TIMEOUT_S = 30.0
SLACK_S = 3.0
"""Allowance over a timeout for the failure to reach the requester (polling,
process scheduling on a loaded machine)."""
AT_ONCE_S = 5.0
"""A failure reported at once (not by a timeout) reaches the requester within
this, even on a loaded machine; well under ``LONG_TIMEOUT_S``."""
IDLE_TIMEOUT_S = 3 * SHORT_TIMEOUT_S + 6
"""How long a worker may take to drain after a test (a room failed by a timeout
can take two more to be confirmed and released)."""

_NIXL_OK, _NIXL_WHY = nixl_available()
BACKENDS = [
    "tcp",
    "nccl",
    pytest.param(
        "nixl", marks=pytest.mark.skipif(not _NIXL_OK, reason=f"nixl not importable: {_NIXL_WHY}")
    ),
]
TCP = pytest.mark.parametrize("pd", ["tcp"], indirect=True)
"""Protocol and failure tests run on the tcp worker set only."""

WORKER_ENV = {
    CLUSTER_TOKEN_ENV: TOKEN,
    # Up to six workers share a few cores here: with torch's default of one
    # intra-op thread per core, a prefill worker's OpenMP threads fight the other
    # processes (a decode worker polls without pause while a room waits for KV)
    # and a 16-request wave takes seconds instead of a fraction of one, which
    # trips the short transfer timeout.
    "OMP_NUM_THREADS": "1",
}

LIVE: list[Worker] = []
"""Running workers of this module: checked for leaks (and their logs dumped on
failure) after every test."""


# -- workers ---------------------------------------------------------------------


def idle(stats: dict[str, Any], start: dict[str, Any]) -> bool:
    """No request anywhere in the worker and every KV page available again."""
    return (
        stats["running"] == 0
        and stats["waiting"] == 0
        and stats["in_flight"] == 0
        and stats.get("rooms", 0) == 0
        and stats.get("prealloc", 0) == 0
        and stats.get("transferring", 0) == 0
        and stats["available_pages"] == stats["total_pages"] == start["available_pages"]
    )


def wait_idle(workers: list[Worker], timeout: float = IDLE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    pending = [w for w in workers if w.alive]
    while pending:
        pending = [w for w in pending if w.alive and not idle(w.stats(), w.start_info["stats"])]
        if not pending:
            return
        if time.monotonic() > deadline:
            last = {w.name: w.stats() for w in pending}
            raise AssertionError(f"workers not idle after {timeout:g}s (leak?): {last}")
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def _leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test: every live worker drains back to its starting pool; the
    logs of the live workers are printed when the test (or this check) failed."""
    failed_before = request.session.testsfailed
    yield
    failed = request.session.testsfailed > failed_before
    try:
        wait_idle(LIVE)
    except AssertionError:
        if not failed:
            for w in LIVE:
                dump_log(request.config, w.log_path, 120)
            raise
    if failed:
        for w in LIVE:
            dump_log(request.config, w.log_path, 120)


Spec = tuple[list[str], int, Path, dict[str, str] | None]


def spec(
    log_dir: Path,
    name: str,
    role: str,
    model: str,
    backend: str = "tcp",
    flags: tuple[str, ...] = (),
    **overrides: Any,
) -> Spec:
    """The launch spec of one worker; the cluster token comes from the env var
    (the bad-token worker overrides it with the flag)."""
    port = free_port()
    module = "prefill_server" if role == "prefill" else "decode_server"
    engine = {
        **ENGINE,
        "transfer_backend": backend,
        "transfer_timeout_s": LONG_TIMEOUT_S,
        **overrides,
    }
    cmd = worker_cmd(module, model, port, role=role, flags=flags, **engine)
    return cmd, port, log_dir / f"{name}.log", WORKER_ENV


@dataclass
class PD:
    backend: str
    prefill: Worker
    decode: Worker
    """Decode worker with its prefix cache."""
    decode_nc: Worker
    """Decode worker with ``--no-enable-prefix-cache``."""


@pytest.fixture(scope="module", params=BACKENDS)
def pd(
    request: pytest.FixtureRequest, model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PD]:
    """One prefill worker and two decode workers (prefix cache on/off) per backend."""
    backend = request.param
    log_dir = tmp_path_factory.mktemp(f"pd-{backend}")
    specs = [
        spec(log_dir, f"prefill-{backend}", "prefill", model_dir, backend),
        spec(log_dir, f"decode-{backend}", "decode", model_dir, backend),
        spec(
            log_dir,
            f"decode-nocache-{backend}",
            "decode",
            model_dir,
            backend,
            enable_prefix_cache=False,
        ),
    ]
    with launch_workers(specs) as workers:
        LIVE.extend(workers)
        try:
            yield PD(backend, *workers)
        finally:
            for w in workers:
                LIVE.remove(w)


@dataclass
class Odd:
    small: Worker
    """Decode worker with a pool of ``SMALL_POOL_PAGES``."""
    other_model: Worker
    """Decode worker on a copy of the tiny model with another config.json."""
    bad_token: Worker
    """Decode worker with the wrong cluster token (given by flag)."""


@pytest.fixture(scope="module")
def odd(pd: PD, model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Odd]:
    """Decode workers for the edge cases, used with ``pd.prefill`` (tcp)."""
    assert pd.backend == "tcp"
    log_dir = tmp_path_factory.mktemp("odd")
    # Same directory name, different config.json: only the content hash differs.
    other = tmp_path_factory.mktemp("other-model") / Path(model_dir).name
    shutil.copytree(model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 2e-5
    (other / "config.json").write_text(json.dumps(cfg, indent=2))
    specs = [
        spec(log_dir, "decode-small", "decode", model_dir, num_pages=SMALL_POOL_PAGES),
        spec(log_dir, "decode-other-model", "decode", str(other)),
        spec(log_dir, "decode-bad-token", "decode", model_dir, flags=("--cluster-token", "wrong")),
    ]
    with launch_workers(specs) as workers:
        LIVE.extend(workers)
        try:
            yield Odd(*workers)
        finally:
            for w in workers:
                LIVE.remove(w)


@dataclass
class Pair:
    prefill: Worker
    decode: Worker
    prefill_spec: Spec
    """How the prefill worker was started (fixed bootstrap port: restartable)."""


@pytest.fixture(params=["tcp", "nccl"])
def fresh_pair(request: pytest.FixtureRequest, tmp_path: Path, model_dir: str) -> Iterator[Pair]:
    """A prefill and a decode worker (tcp, or nccl's gloo twin; short transfer
    timeout, each in its own process group) of one test, which kills one of
    them; the other must end up idle with its whole pool."""
    failed_before = request.session.testsfailed
    short = {"transfer_timeout_s": SHORT_TIMEOUT_S}
    backend = request.param
    specs = [
        spec(
            tmp_path,
            "fresh-prefill",
            "prefill",
            model_dir,
            backend,
            bootstrap_port=free_port(),
            **short,
        ),
        spec(tmp_path, "fresh-decode", "decode", model_dir, backend, **short),
    ]
    with launch_workers(specs, new_session=True) as workers:
        ok = False
        try:
            yield Pair(*workers, specs[0])
            if request.session.testsfailed == failed_before:
                wait_idle(workers)  # the survivor is back to its whole pool
                ok = True
        finally:
            for w in workers:
                if w.alive:  # it may still be SIGSTOPped: let it take SIGTERM
                    os.killpg(w.proc.pid, signal.SIGCONT)
            if not ok:
                for w in workers:
                    dump_log(request.config, w.log_path, 120)


@pytest.fixture(scope="module")
def offline(model_dir: str) -> LLM:
    """The colocated offline engine with the workers' engine settings."""
    return LLM(model_dir, device="cpu", **ENGINE)


# -- the gateway's side ------------------------------------------------------------


def greedy(max_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)


def params_of(spec: SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=spec.max_tokens, temperature=spec.temperature, ignore_eos=spec.ignore_eos
    )


def random_prompt(n: int, seed: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(3, VOCAB) for _ in range(n)]


def prompts_with_shared_prefixes(n: int, seed: int) -> list[list[int]]:
    g = random.Random(seed)
    prefixes = [[g.randrange(3, VOCAB) for _ in range(g.randrange(6, 30))] for _ in range(3)]
    return [prefixes[i % 3] + [g.randrange(3, VOCAB) for _ in range(1 + 3 * i)] for i in range(n)]


def new_room() -> str:
    return secrets.token_hex(8)


def tokens_of(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


Result = list[TokenDelta] | WorkerError


async def stream(client: WorkerClient, msg: Generate | Prefill) -> Result:
    """Every delta of ``msg`` or the client error that ended it."""
    try:
        return [d async for d in client.generate(msg)]
    except WorkerError as e:
        return e


def final(result: Result) -> TokenDelta:
    assert isinstance(result, list) and result, result
    assert all(d.finish_reason is None for d in result[:-1]), result
    assert result[-1].finish_reason is not None, result
    return result[-1]


@dataclass
class PDResult:
    prefill: Result
    decode: Result

    @property
    def tokens(self) -> list[int]:
        """The full output: the prefill worker's token, then the decode worker's."""
        assert isinstance(self.prefill, list) and isinstance(self.decode, list), self
        return tokens_of(self.prefill) + tokens_of(self.decode)


async def pd_request(
    pc: WorkerClient,
    dc: WorkerClient,
    p: Worker,
    d: Worker,
    rid: str,
    prompt: list[int],
    sampling: SamplingParams,
    room: str | None = None,
) -> PDResult:
    """One disaggregated request: Generate to decode and Prefill to prefill at once."""
    room = room or new_room()
    gen = Generate(rid, prompt, sampling, room=room, prefill_bootstrap=p.bootstrap)
    pre = Prefill(rid, prompt, sampling, room=room, decode_bootstrap=d.bootstrap)
    dres, pres = await asyncio.gather(stream(dc, gen), stream(pc, pre))
    return PDResult(pres, dres)


def clients(p: Worker, d: Worker) -> tuple[WorkerClient, WorkerClient]:
    return (
        WorkerClient(p.endpoint, timeout_s=CLIENT_TIMEOUT_S, auth=keys_for(token_of(p))),
        WorkerClient(d.endpoint, timeout_s=CLIENT_TIMEOUT_S, auth=keys_for(token_of(d))),
    )


def token_of(w: Worker) -> str:
    """The cluster token ``w`` was started with (its request plane takes only it)."""
    return "wrong" if w.name == "decode-bad-token" else TOKEN


async def wait_stats(
    w: Worker, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = 10.0
) -> dict[str, Any]:
    """``Worker.wait_stats`` off the event loop, so streams keep being read."""
    return await asyncio.to_thread(w.wait_stats, pred, what, timeout)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def check_matches(result: PDResult, expected: Any, what: str) -> None:
    """Output and finish reasons equal the offline engine's."""
    assert result.tokens == expected.token_ids, what
    p_last, d_last = final(result.prefill), final(result.decode)
    assert len(result.prefill) == 1, f"{what}: prefill sent {len(result.prefill)} deltas"
    assert len(p_last.token_ids) == 1, what
    if len(expected.token_ids) == 1:  # the first token ended it
        assert p_last.finish_reason == expected.finish_reason, what
    else:
        assert p_last.finish_reason == FinishReason.PREFILL_DONE, what
    assert d_last.finish_reason == expected.finish_reason, what


# -- the workload ------------------------------------------------------------------

N_REQUESTS = 16
PROMPTS = prompts_with_shared_prefixes(N_REQUESTS, seed=11)
SPECS = [greedy(1 if i == 5 else 4 + (i % 5) * 5, ignore_eos=i % 2 == 0) for i in range(N_REQUESTS)]


@pytest.fixture(scope="module")
def expected(offline: LLM) -> list[Any]:
    return offline.generate(PROMPTS, [params_of(s) for s in SPECS])


# -- dead workers (short transfer timeout) ---------------------------------------------


def test_prefill_killed_mid_request(fresh_pair: Pair, expected: list[Any]) -> None:
    """SIGKILL the prefill worker while a request's room on the decode worker
    waits for its KV: the decode worker, watching its KV peer, fails the room
    once the connection drops (well before the transfer timeout: no gateway
    tells it here), the prefill requester sees the disconnect, and the decode
    pool drains (checked by the fixture)."""
    p, d = fresh_pair.prefill, fresh_pair.decode
    prompt = random_prompt(30, seed=12)

    async def go() -> tuple[PDResult, Result, Result, float]:
        pc, dc = clients(p, d)
        async with pc, dc:
            # A request that works first: connections and the KV handshake are up.
            warm = await pd_request(pc, dc, p, d, "pk-warm", PROMPTS[0], SPECS[0])
            # Freeze the prefill worker so the request is caught mid-way, then kill it.
            os.killpg(p.proc.pid, signal.SIGSTOP)
            room = new_room()
            dtask = asyncio.create_task(
                stream(dc, Generate("pk-1", prompt, greedy(16), room, p.bootstrap))
            )
            ptask = asyncio.create_task(
                stream(pc, Prefill("pk-1", prompt, greedy(16), room, d.bootstrap))
            )
            await wait_stats(d, lambda s: s["transferring"] == 1, "room reserved")
            killed = time.monotonic()
            p.kill()
            dres = await dtask
            waited = time.monotonic() - killed
            return warm, dres, await ptask, waited

    warm, dres, pres, waited = run(go())
    check_matches(warm, expected[0], "request before the kill")
    last = final(dres)
    assert last.finish_reason == "error", dres
    assert "KV-plane connection" in (last.error or ""), last.error
    assert waited < PEER_HEARTBEAT_TIMEOUT_S + 1.0, waited
    assert isinstance(pres, WorkerDisconnected), pres


def test_decode_killed_mid_request(fresh_pair: Pair, expected: list[Any]) -> None:
    """SIGKILL the decode worker with one room reserved (the prefill worker then
    prefills into a dead peer) and one not yet reserved (computed while its
    reservation is awaited, which never comes): the prefill worker fails both
    rooms within the transfer timeout and its pool drains."""
    p, d = fresh_pair.prefill, fresh_pair.decode
    prompt_a, prompt_b = random_prompt(30, seed=13), random_prompt(20, seed=14)
    before = p.stats()

    async def go() -> tuple[PDResult, Result, Result, Result, float, float]:
        pc, dc = clients(p, d)
        async with pc, dc:
            warm = await pd_request(pc, dc, p, d, "dk-warm", PROMPTS[1], SPECS[1])
            room_a, room_b = new_room(), new_room()
            dtask = asyncio.create_task(
                stream(dc, Generate("dk-a", prompt_a, greedy(16), room_a, p.bootstrap))
            )
            await wait_stats(d, lambda s: s["transferring"] == 1, "room a reserved")
            d.kill()
            dres = await dtask
            t0 = time.monotonic()
            pa, pb = await asyncio.gather(
                stream(pc, Prefill("dk-a", prompt_a, greedy(16), room_a, d.bootstrap)),
                stream(pc, Prefill("dk-b", prompt_b, greedy(16), room_b, d.bootstrap)),
            )
            b_after = time.monotonic() - t0
            await wait_stats(
                p,
                lambda s: (
                    # a: its write to the dead peer failed; b: never reserved
                    s["transfers_failed"] == before["transfers_failed"] + 2
                    and idle(s, p.start_info["stats"])
                ),
                "the dead peer's room failed and released",
                timeout=4 * SHORT_TIMEOUT_S,
            )
            drained_after = time.monotonic() - t0
            return warm, dres, pa, pb, b_after, drained_after

    warm, dres, pa, pb, b_after, drained_after = run(go())
    check_matches(warm, expected[1], "request before the kill")
    assert isinstance(dres, WorkerDisconnected), dres
    # Room a had its reservation: the first token goes out, the transfer fails.
    assert final(pa).finish_reason == FinishReason.PREFILL_DONE, pa
    # Room b never got one: computed all the same (its first token goes out
    # at once; the decode side, here dead, would stream the rest), then failed
    # at the reservation timeout.
    assert final(pb).finish_reason == FinishReason.PREFILL_DONE, pb
    assert b_after < SHORT_TIMEOUT_S + SLACK_S, b_after
    # The pages under a write to the dead peer come back within the transfer
    # timeout (the backend's write timeout is the worker's transfer timeout).
    assert drained_after < SHORT_TIMEOUT_S + SLACK_S, drained_after


def test_decode_serves_a_prefill_restarted_at_the_same_address(
    fresh_pair: Pair, expected: list[Any], tmp_path: Path
) -> None:
    """After its prefill worker died mid-request and the decode worker gave up on
    it (error, then its pages back), a prefill worker restarted at the same
    bootstrap address serves the decode worker again."""
    p, d = fresh_pair.prefill, fresh_pair.decode

    async def lose_prefill() -> tuple[PDResult, Result]:
        pc, dc = clients(p, d)
        async with pc, dc:
            warm = await pd_request(pc, dc, p, d, "rs-warm", PROMPTS[0], SPECS[0])
            room = new_room()
            dtask = asyncio.create_task(
                stream(dc, Generate("rs-1", PROMPTS[1], SPECS[1], room, p.bootstrap))
            )
            await wait_stats(d, lambda s: s["transferring"] == 1, "room reserved")
            p.kill()
            return warm, await dtask

    warm, lost = run(lose_prefill())
    check_matches(warm, expected[0], "request before the kill")
    assert final(lost).finish_reason == "error"
    # The decode worker drains: its room is released after one more timeout.
    d.wait_stats(lambda s: idle(s, d.start_info["stats"]), "idle", 2 * SHORT_TIMEOUT_S + SLACK_S)

    cmd, _, _, env = fresh_pair.prefill_spec
    port = free_port()
    cmd[cmd.index("--port") + 1] = str(port)
    with launch_worker(cmd, port, tmp_path / "restarted-prefill.log", env) as p2:
        assert p2.bootstrap == p.bootstrap

        async def again() -> PDResult:
            pc, dc = clients(p2, d)
            async with pc, dc:
                return await pd_request(pc, dc, p2, d, "rs-2", PROMPTS[2], SPECS[2])

        res = run(again())
        # Fails today: the decode half ends at once with "prefill worker stopped
        # answering" (the stale failure of the dead worker), the prefill half
        # waits for a reservation that never comes.
        assert final(res.decode).error is None, res.decode
        check_matches(res, expected[2], "request to the restarted prefill worker")


# -- correctness -------------------------------------------------------------------


@pytest.mark.parametrize("decode_cache", [True, False], ids=["decode-cache", "no-decode-cache"])
def test_greedy_matches_offline(pd: PD, decode_cache: bool, expected: list[Any]) -> None:
    """16 concurrent requests with shared prefixes and different lengths, twice:
    the second wave finds the prefixes in the decode worker's cache (when on),
    so only the missing pages move; the tokens must not change."""
    p = pd.prefill
    d = pd.decode if decode_cache else pd.decode_nc
    hits_before = d.stats()["prefix_cache_hit_tokens"]
    ok_before = p.stats()["transfers_ok"]

    async def wave(tag: str) -> list[PDResult]:
        pc, dc = clients(p, d)
        async with pc, dc:
            return await asyncio.gather(
                *(
                    pd_request(pc, dc, p, d, f"{tag}-{i}", prompt, s)
                    for i, (prompt, s) in enumerate(zip(PROMPTS, SPECS))
                )
            )

    sent = []
    for tag in ("first", "again"):
        before = p.stats()["bytes_sent"]
        results = run(wave(f"{pd.backend}-{decode_cache}-{tag}"))
        for i, (res, exp) in enumerate(zip(results, expected)):
            check_matches(res, exp, f"{tag} request {i}")
        sent.append(p.stats()["bytes_sent"] - before)
    assert p.stats()["transfers_ok"] == ok_before + 2 * N_REQUESTS
    # Each transfer's tail (prefill done -> KV landed) is counted, and short.
    tail = p.stats()["transfer_tail_seconds"]
    assert 0 < tail / p.stats()["transfers_ok"] < LONG_TIMEOUT_S
    hits = d.stats()["prefix_cache_hit_tokens"] - hits_before
    if decode_cache:
        assert hits > 0, "the second wave should hit the decode worker's prefix cache"
        assert sent[1] < sent[0] / 2, f"cached prefixes were sent again: {sent}"
    else:
        assert hits == 0


# -- aborts ------------------------------------------------------------------------


@TCP
def test_decode_stream_closed_or_aborted_while_decoding(pd: PD) -> None:
    """The requester closes the decode stream (-> Abort), or sends Abort to the
    decode worker, while tokens stream: the request stops early."""
    p, d = pd.prefill, pd.decode

    async def go() -> tuple[list[TokenDelta], list[TokenDelta]]:
        pc, dc = clients(p, d)
        async with pc, dc:
            out = []
            for rid, how in (("close-1", "close"), ("abort-1", "abort")):
                room = new_room()
                prompt = random_prompt(10, seed=len(rid))
                gen = Generate(rid, prompt, greedy(110), room=room, prefill_bootstrap=p.bootstrap)
                pre = Prefill(rid, prompt, greedy(110), room=room, decode_bootstrap=d.bootstrap)
                ptask = asyncio.create_task(stream(pc, pre))
                got: list[TokenDelta] = []
                it = dc.generate(gen)
                async for delta in it:
                    got.append(delta)
                    if len(got) == 2:
                        if how == "close":
                            break
                        await dc.abort(rid)
                await it.aclose()
                assert dc.in_flight == 0
                pres = await ptask
                assert final(pres).finish_reason == FinishReason.PREFILL_DONE
                out.append(got)
            return out[0], out[1]

    closed, aborted = run(go())
    assert len(closed) == 2 and closed[-1].finish_reason is None
    assert final(aborted).finish_reason == "abort"
    assert len(tokens_of(aborted)) < 109


@TCP
def test_decode_abort_while_waiting_for_kv(pd: PD) -> None:
    """Abort on the decode worker while its room waits for KV: the requester gets
    "abort", the room is given up on the prefill side too, and a Prefill for
    that room arriving afterwards is refused (it must not write into pages the
    decode worker has already freed)."""
    p, d = pd.prefill, pd.decode
    ok_before = p.stats()["transfers_ok"]
    prompt = random_prompt(30, seed=3)

    async def go() -> tuple[Result, Result]:
        pc, dc = clients(p, d)
        async with pc, dc:
            room = new_room()
            gen = Generate("dab-1", prompt, greedy(8), room=room, prefill_bootstrap=p.bootstrap)
            dtask = asyncio.create_task(stream(dc, gen))
            await wait_stats(d, lambda s: s["transferring"] == 1, "room reserved")
            await dc.abort("dab-1")
            dres = await dtask
            # The pages come back once the prefill worker confirms the abort.
            await wait_stats(
                d, lambda s: idle(s, d.start_info["stats"]), "room released", AT_ONCE_S
            )
            pre = Prefill("dab-1", prompt, greedy(8), room=room, decode_bootstrap=d.bootstrap)
            return dres, await stream(pc, pre)

    dres, pres = run(go())
    d_last = final(dres)
    assert d_last.finish_reason == "abort" and d_last.token_ids == []
    p_last = final(pres)
    assert p_last.finish_reason in ("error", "abort"), pres
    assert p_last.token_ids == []
    assert p.stats()["transfers_ok"] == ok_before


@TCP
def test_prefill_abort(pd: PD) -> None:
    """Abort on the prefill worker while it prefills: both requesters get "abort"
    (the decode worker learns of it on the KV plane)."""
    p, d = pd.prefill, pd.decode
    prompt = random_prompt(110, seed=4)  # 7 chunks: the abort lands before the end

    async def go() -> tuple[Result, Result]:
        pc, dc = clients(p, d)
        async with pc, dc:
            room = new_room()
            gen = Generate("pab-1", prompt, greedy(8), room=room, prefill_bootstrap=p.bootstrap)
            dtask = asyncio.create_task(stream(dc, gen))
            await wait_stats(d, lambda s: s["transferring"] == 1, "room reserved")
            pre = Prefill("pab-1", prompt, greedy(8), room=room, decode_bootstrap=d.bootstrap)
            ptask = asyncio.create_task(stream(pc, pre))
            await asyncio.sleep(0)  # the Prefill is queued first, then the Abort
            await pc.abort("pab-1")
            return await ptask, await dtask

    t0 = time.monotonic()
    pres, dres = run(go())
    assert [d.finish_reason for d in pres] == ["abort"], pres
    assert final(dres).finish_reason == "abort", dres
    assert tokens_of(dres) == []
    assert time.monotonic() - t0 < AT_ONCE_S


# -- protocol errors ---------------------------------------------------------------


@TCP
def test_room_used_twice(pd: PD, offline: LLM) -> None:
    """A second request under a room id in use is refused by both workers; the
    first one is unaffected."""
    p, d = pd.prefill, pd.decode
    first, second = random_prompt(40, seed=5), random_prompt(20, seed=6)
    exp = offline.generate([first], params_of(greedy(12)))[0]

    async def go() -> tuple[PDResult, PDResult]:
        pc, dc = clients(p, d)
        async with pc, dc:
            room = new_room()
            # Tasks run in creation order: "twice-a" reaches both workers first.
            a = asyncio.create_task(pd_request(pc, dc, p, d, "twice-a", first, greedy(12), room))
            b = asyncio.create_task(pd_request(pc, dc, p, d, "twice-b", second, greedy(4), room))
            return await a, await b

    a, b = run(go())
    check_matches(a, exp, "first request of the room")
    for side in (b.prefill, b.decode):
        last = final(side)
        assert last.finish_reason == "error" and "already in use" in (last.error or ""), side


@TCP
def test_incompatible_model_is_refused(pd: PD, odd: Odd) -> None:
    """A decode worker serving a different model (config.json differs) is refused
    at the KV handshake; both requesters get an error naming the field."""
    p, d = pd.prefill, odd.other_model

    async def go() -> PDResult:
        pc, dc = clients(p, d)
        async with pc, dc:
            return await pd_request(pc, dc, p, d, "compat-1", random_prompt(9, 7), greedy(4))

    t0 = time.monotonic()
    res = run(go())
    for side in (res.decode, res.prefill):
        last = final(side)
        assert last.finish_reason == "error", side
        assert "incompatible" in (last.error or ""), last.error
        assert "model (prefill " in (last.error or ""), last.error
    assert time.monotonic() - t0 < AT_ONCE_S


@TCP
def test_wrong_cluster_token_is_refused(pd: PD, odd: Odd) -> None:
    p, d = pd.prefill, odd.bad_token

    async def go() -> PDResult:
        pc, dc = clients(p, d)
        async with pc, dc:
            return await pd_request(pc, dc, p, d, "token-1", random_prompt(9, 8), greedy(4))

    t0 = time.monotonic()
    res = run(go())
    for side in (res.decode, res.prefill):
        last = final(side)
        assert last.finish_reason == "error", side
        assert "cluster token" in (last.error or ""), last.error
    assert time.monotonic() - t0 < AT_ONCE_S


@TCP
def test_decode_pool_full(pd: PD, odd: Odd, offline: LLM) -> None:
    """With the decode pool busy a request waits for pages and completes once they
    are free; a request that can never fit is refused with a clear error."""
    p, d = pd.prefill, odd.small
    capacity = SMALL_POOL_PAGES - 1
    a_prompt, a_spec = random_prompt(60, seed=9), greedy(20)  # 15 pages, 20 at the end
    b_prompt, b_spec = random_prompt(40, seed=10), greedy(8)  # 10 pages: waits for "a"
    c_prompt, c_spec = random_prompt(100, seed=11), greedy(8)  # > 24 pages of 4: never fits
    exp_a, exp_b = offline.generate([a_prompt, b_prompt], [params_of(a_spec), params_of(b_spec)])

    async def never_fits(pc: WorkerClient, dc: WorkerClient) -> PDResult:
        room = new_room()
        ptask = asyncio.create_task(
            stream(pc, Prefill("full-c", c_prompt, c_spec, room, d.bootstrap))
        )
        dres = await stream(dc, Generate("full-c", c_prompt, c_spec, room, p.bootstrap))
        # As a gateway does: the decode half was refused, so drop the prefill half.
        await pc.abort("full-c")
        return PDResult(await ptask, dres)

    async def go() -> tuple[PDResult, PDResult, PDResult, dict[str, Any]]:
        pc, dc = clients(p, d)
        async with pc, dc:
            c = await never_fits(pc, dc)
            room_a = new_room()
            da = asyncio.create_task(
                stream(dc, Generate("full-a", a_prompt, a_spec, room_a, p.bootstrap))
            )
            # "a" holds 15 of 24 pages while its KV is (not yet) on its way ...
            await wait_stats(d, lambda s: s["transferring"] == 1, "a reserved")
            b = asyncio.create_task(pd_request(pc, dc, p, d, "full-b", b_prompt, b_spec))
            # ... so "b" (10 pages) must wait.
            waiting = await wait_stats(d, lambda s: s["prealloc"] == 1, "b waits for pages")
            pa = asyncio.create_task(
                stream(pc, Prefill("full-a", a_prompt, a_spec, room_a, d.bootstrap))
            )
            a = PDResult(await pa, await da)
            return a, await b, c, waiting

    a, b, c, waiting = run(go())
    assert waiting["transferring"] == 1 and waiting["prealloc"] == 1
    check_matches(a, exp_a, "request holding the pool")
    check_matches(b, exp_b, "request that waited for pages")
    d_err = final(c.decode)
    assert d_err.finish_reason == "error"
    assert f"KV pool holds at most {capacity * 4} tokens" in (d_err.error or ""), d_err
    assert [x.finish_reason for x in c.prefill] == ["abort"], c.prefill
