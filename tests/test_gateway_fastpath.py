"""The request path's fast paths give what the slow ones gave: prompt ids
checked in one msgspec pass against a plain-Python reading of the rules, the
body parsed by msgspec against the stdlib parser, a streamed request's first
event fetched eagerly (and closed when nobody reads it), and the request
client's direct writes in order with its queued ones."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio
from starlette.requests import Request

from gateway.app import _parse_json_fast
from gateway.openai.choices import EagerStream
from gateway.openai.errors import APIError
from gateway.openai.validation import completion_prompts
from protocol import to_worker
from protocol.client import WorkerClient
from protocol.to_worker import Abort

VOCAB = 1000


class _WordTokenizer:
    vocab_size = VOCAB

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


def _reference(prompt: Any) -> list[list[int]] | None:
    """The rules of ``completion_prompts`` written out: None where it is a 400."""

    def ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(type(i) is int for i in x)

    if isinstance(prompt, str):
        out = [_WordTokenizer().encode(prompt)]
    elif ids(prompt):
        out = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        out = [_WordTokenizer().encode(x) for x in prompt]
    elif isinstance(prompt, list) and prompt and all(ids(x) for x in prompt):
        out = [list(x) for x in prompt]
    else:
        return None
    if not all(out) or any(not 0 <= i < VOCAB for p in out for i in p):
        return None
    return out


def _prompts() -> list[Any]:
    rng = random.Random(7)
    cases: list[Any] = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 2, 16, 4096)]
    cases += [[0, VOCAB - 1], [VOCAB], [-1], [3, VOCAB], [1, True], [True], [1, 2.0], [1, "2"]]
    cases += [[1, [2]], [[1, 2], [3]], [[1], [VOCAB]], [[True]], [], [[]], "a bb ccc", ["a", "bb"]]
    cases += [[1, None], [2**70], [1] * 10 + [-5]]
    return cases


@pytest.mark.parametrize("prompt", _prompts(), ids=lambda p: repr(p)[:30])
def test_prompt_ids_as_the_rules_say(prompt: Any) -> None:
    want = _reference(prompt)
    if want is None:
        with pytest.raises(APIError) as e:
            completion_prompts(prompt, _WordTokenizer())  # type: ignore[arg-type]
        assert e.value.status == 400 and e.value.param == "prompt"
        return
    got = completion_prompts(prompt, _WordTokenizer())  # type: ignore[arg-type]
    assert got == want and all(type(i) is int for p in got for i in p)
    assert all(p is not prompt for p in got)  # a copy: the request's list is not shared


BODIES = [
    b'{"prompt": [1, 2, 3], "temperature": 0.5, "stop": ["\\u00e9x"]}',
    b'{"a": 1e400}',
    b'{"a": NaN, "b": Infinity}',
    b'{"a": "\\ud800"}',
    b'\xef\xbb\xbf{"a": 1}',
    '{"a": "é"}'.encode("utf-16"),
    b'{"a": 123456789012345678901234567890, "b": -0.0, "c": 1.5e-320}',
    b'{"a": 1, "a": 2}',
]


def _request(body: bytes) -> Request:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "headers": [], "path": "/", "query_string": b""}
    return Request(scope, receive)


@pytest.mark.parametrize("body", BODIES, ids=lambda b: repr(b)[:24])
def test_json_fast_path_parses_as_the_stdlib(body: bytes) -> None:
    async def go() -> Any:
        request = _request(body)
        await _parse_json_fast(request)
        return await request.json()

    got = asyncio.run(go())
    want = json.loads(body)
    assert repr(got) == repr(want)


def test_json_fast_path_leaves_bad_json_to_the_route() -> None:
    async def go() -> None:
        request = _request(b'{"a": [1, 2')
        await _parse_json_fast(request)
        with pytest.raises(json.JSONDecodeError) as e:
            await request.json()
        assert e.value.pos == 11

    asyncio.run(go())


async def _events(log: list[str], items: int, fail: bool = False) -> AsyncIterator[Any]:
    log.append("started")
    try:
        for i in range(items):
            await asyncio.sleep(0.01)
            yield i
        if fail:
            raise RuntimeError("worker failed")
    finally:
        log.append("closed")


def test_eager_stream_starts_before_it_is_read() -> None:
    async def go() -> None:
        log: list[str] = []
        stream = EagerStream(_events(log, 3))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        assert log == ["started"]  # nobody has read yet
        assert [x async for x in stream] == [0, 1, 2]
        assert log == ["started", "closed"]

    asyncio.run(go())


def test_eager_stream_closed_unread_ends_its_request() -> None:
    async def go() -> None:
        log: list[str] = []
        stream = EagerStream(_events(log, 3))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        await stream.aclose()
        assert log == ["started", "closed"]
        await stream.aclose()  # twice is harmless

    asyncio.run(go())


def test_eager_stream_reader_cancelled_before_the_first_event() -> None:
    async def go() -> None:
        log: list[str] = []
        stream = EagerStream(_events(log, 3))  # type: ignore[arg-type]
        reader = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.002)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await asyncio.sleep(0)
        assert log == ["started", "closed"]

    asyncio.run(go())


def test_eager_stream_empty_and_failing() -> None:
    async def go() -> None:
        assert [x async for x in EagerStream(_events([], 0))] == []  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="worker failed"):
            async for _ in EagerStream(_events([], 0, fail=True)):  # type: ignore[arg-type]
                pass

    asyncio.run(go())


def test_client_writes_in_order_direct_and_queued() -> None:
    """Frames posted back to back (direct writes and queued ones mixed, as
    under load) reach the worker in the order they were posted."""

    async def go() -> list[str]:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        client = WorkerClient(f"tcp://127.0.0.1:{port}", context=ctx)
        await client.start()
        await asyncio.wait_for(client._connected.wait(), 5)
        for i in range(300):
            client._post(Abort(f"r{i}"))
            if i % 7 == 0:
                await asyncio.sleep(0)
        seen: list[str] = []
        while len(seen) < 300:
            _, frame = await asyncio.wait_for(router.recv_multipart(), 5)
            msg = to_worker.decoder.decode(frame)
            if isinstance(msg, Abort):
                seen.append(msg.rid)
        await client.close()
        router.close(0)
        ctx.term()
        return seen

    assert asyncio.run(go()) == [f"r{i}" for i in range(300)]
