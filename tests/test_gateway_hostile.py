"""Hostile input to the gateway's HTTP API: every bad request is a clean 4xx
in the OpenAI error body, an unexpected failure a 500 in that body, and the
connection stays usable either way.

The gateway app runs in-process (uvicorn in a thread) over a fake dispatcher
that puts every request through the real request-plane encoding and the
worker's decoding (so a value the wire or the worker cannot take fails here
as it would in production) and answers with a few tokens. No worker
processes: these run in the fast suite.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raw_http import RawRequest, exchange
from workers import free_port

from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.routing import HealthChecker, Router, RouterConfig
from gateway.state import GatewayState
from gateway.text import Tokenizer
from protocol import to_worker
from protocol.sampling import WIRE_INT_MAX, InvalidSamplingParams, SamplingParams
from protocol.to_gateway import TokenDelta

MODEL = "tiny"
CONTEXT = 256
ADMIN_KEY = "admin-key"
MESSAGES = [{"role": "user", "content": "Hello"}]


class BoomError(RuntimeError):
    """A failure the gateway does not expect."""


class WireDispatcher:
    """Stands in for the workers: encodes each request as the worker client
    does and decodes it as a worker's engine process does, then streams
    ``min(max_tokens, 3)`` tokens. ``explode``: the next request fails with an
    exception the gateway does not expect."""

    def __init__(self) -> None:
        self.explode = False
        self.seen: list[SamplingParams] = []

    async def stream(
        self, prompt_ids: list[int], spec: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[TokenDelta]:
        if self.explode:
            self.explode = False
            raise BoomError("unexpected")
        rid = request_id or "r"
        msg = to_worker.decoder.decode(
            to_worker.encoder.encode(to_worker.Generate(rid, prompt_ids, spec))
        )
        self.seen.append(msg.sampling)
        n = min(spec.max_tokens, 3)
        for k in range(n):
            token = prompt_ids[k % len(prompt_ids)]
            tops = [[(token, -1.0)] * spec.top_logprobs] if spec.top_logprobs else None
            finish = "length" if k == n - 1 else None
            yield TokenDelta(rid, [token], [-1.0], finish, top_logprobs=tops)

    async def prune(self) -> None:
        pass

    async def connect_all(self) -> None:
        pass

    async def close(self) -> None:
        pass


@dataclass
class _LocalState(GatewayState):
    """The app state with the model facts from the model dir (no workers)."""

    model_dir: str = ""
    worker_vocab: int | None = None

    async def load_model_facts(self) -> None:
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.model_name, self.context_length = MODEL, CONTEXT
        self.worker_vocab_size = self.worker_vocab


@dataclass
class App:
    host: str
    port: int
    state: _LocalState
    dispatcher: WireDispatcher
    http: httpx.Client

    @property
    def vocab(self) -> int:
        assert self.state.tokenizer is not None
        return self.state.tokenizer.vocab_size

    def complete(self, **body: Any) -> httpx.Response:
        return self.http.post("/v1/completions", json={"model": MODEL, **body})

    def chat(self, **body: Any) -> httpx.Response:
        return self.http.post("/v1/chat/completions", json={"model": MODEL, **body})

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        return self.http.request(method, path, headers=headers, **kw)

    def raw(self, *requests: RawRequest) -> list:
        return exchange(self.host, self.port, list(requests))


@contextlib.contextmanager
def serve_in_process(state: GatewayState, dispatcher: Any) -> Iterator[App]:
    """The gateway app over ``state`` on a free port, in a thread of this process."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="critical")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "in-process gateway down"
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            yield App("127.0.0.1", port, state, dispatcher, http)
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the in-process gateway did not stop"


@pytest.fixture(scope="module")
def app(model_dir: str) -> Iterator[App]:
    router = Router(RouterConfig())
    dispatcher = WireDispatcher()
    config = GatewayConfig(admin_key=ADMIN_KEY)
    state = _LocalState(config, router, HealthChecker(router), dispatcher, model_dir=model_dir)  # type: ignore[arg-type]
    with serve_in_process(state, dispatcher) as served:
        yield served


def assert_error(resp: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    """``resp`` is ``status`` with an OpenAI error body naming ``param``."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json"), resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    return err


GOOD_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}


# -- findings, one test each ------------------------------------------------------


def test_huge_stop_token_id_is_a_400_and_the_connection_stays(app: App) -> None:
    """An id beyond what the request plane can encode (msgpack: 2**64 - 1) is
    refused before anything is encoded, and the connection is still good."""
    bad = RawRequest.post_json("/v1/completions", {**GOOD_COMPLETION, "stop_token_ids": [10**20]})
    first, second = app.raw(bad, RawRequest.post_json("/v1/completions", GOOD_COMPLETION))
    assert first.status == 400, first.body
    assert first.json()["error"]["param"] == "stop_token_ids"
    assert second.status == 200, second.body
    assert second.json()["usage"]["completion_tokens"] == 2


def test_admin_delete_with_an_empty_url_is_a_400(app: App) -> None:
    assert_error(app.admin("DELETE", "/admin/workers", params={"url": ""}), 400, "url")
    assert_error(app.admin("DELETE", "/admin/workers", params={"url": "  "}), 400, "url")
    assert_error(app.admin("DELETE", "/admin/workers"), 400, "url")


@pytest.mark.parametrize(
    "endpoint, field",
    [
        ("completions", "max_tokens"),
        ("chat", "max_tokens"),
        ("chat", "max_completion_tokens"),
    ],
)
def test_max_tokens_zero_is_a_400(app: App, endpoint: str, field: str) -> None:
    send = app.complete if endpoint == "completions" else app.chat
    body = {"prompt": "Hello"} if endpoint == "completions" else {"messages": MESSAGES}
    assert_error(send(**body, **{field: 0}), 400, field)
    assert_error(send(**body, **{field: -3}), 400, field)
    # Zero is not "unset": the other field does not stand in for it.
    if field == "max_completion_tokens":
        assert_error(send(**body, max_completion_tokens=0, max_tokens=2), 400, field)


@pytest.mark.parametrize(
    "field, value",
    [
        ("prompt", [[False]]),
        ("prompt", [True]),
        ("prompt", [1, True]),
        ("prompt", [[1], [2, False]]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", [3, False]),
    ],
)
def test_booleans_are_not_token_ids(app: App, field: str, value: Any) -> None:
    assert_error(app.complete(**{**GOOD_COMPLETION, field: value}), 400, field)


def test_booleans_are_not_stop_token_ids_in_chat(app: App) -> None:
    resp = app.chat(messages=MESSAGES, max_tokens=2, stop_token_ids=[True])
    assert_error(resp, 400, "stop_token_ids")


def _bad_integer_fields(vocab: int) -> list[tuple[str, dict[str, Any], str]]:
    """(endpoint, fields, the param the 400 names)."""
    return [
        # Token ids within the vocabulary.
        ("completions", {"prompt": [vocab]}, "prompt"),
        ("completions", {"prompt": [-1]}, "prompt"),
        ("completions", {"prompt": [[1], [10**30]]}, "prompt"),
        ("completions", {"stop_token_ids": [vocab]}, "stop_token_ids"),
        ("completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
        ("chat", {"stop_token_ids": [2**64]}, "stop_token_ids"),
        # Seeds: int64, as OpenAI takes them.
        ("completions", {"seed": 2**63}, "seed"),
        ("completions", {"seed": -(2**63) - 1}, "seed"),
        ("completions", {"seed": 2**64}, "seed"),
        ("chat", {"seed": 10**30}, "seed"),
        # Counts and limits.
        ("completions", {"n": 0}, "n"),
        ("completions", {"n": 10**30}, "n"),
        ("completions", {"top_k": 10**30}, "top_k"),
        ("completions", {"top_k": -2}, "top_k"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 10**30}, "top_logprobs"),
        ("completions", {"max_tokens": CONTEXT}, "max_tokens"),
        ("completions", {"max_tokens": 10**30}, "max_tokens"),
        ("chat", {"max_completion_tokens": 10**30}, "max_completion_tokens"),
        # Strict types: no bool, float or string where an integer goes.
        ("completions", {"max_tokens": 1.5}, "max_tokens"),
        ("completions", {"max_tokens": 2.0}, "max_tokens"),
        ("completions", {"max_tokens": True}, "max_tokens"),
        ("completions", {"max_tokens": "2"}, "max_tokens"),
        ("chat", {"max_completion_tokens": 1.5}, "max_completion_tokens"),
        ("completions", {"n": True}, "n"),
        ("completions", {"seed": 1.0}, "seed"),
        ("completions", {"seed": False}, "seed"),
        ("completions", {"top_k": True}, "top_k"),
        ("completions", {"logprobs": True}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": True}, "top_logprobs"),
        ("chat", {"logprobs": 1}, "logprobs"),
        ("completions", {"prompt": [1.0, 2.0]}, "prompt"),
        ("completions", {"stop_token_ids": [1.5]}, "stop_token_ids"),
        ("completions", {"temperature": True}, "temperature"),
        ("completions", {"stream": 1}, "stream"),
    ]


def test_integer_fields_are_range_checked_and_strictly_typed(app: App) -> None:
    for endpoint, fields, param in _bad_integer_fields(app.vocab):
        if endpoint == "completions":
            resp = app.complete(**{**GOOD_COMPLETION, **fields, "model": MODEL})
        else:
            resp = app.chat(messages=MESSAGES, max_tokens=2, **fields)
        assert_error(resp, 400, param)


def test_edges_of_the_integer_ranges_are_accepted(app: App) -> None:
    top = app.vocab - 1
    for fields in (
        {"seed": 0},
        {"seed": -1},
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"prompt": [0, top], "stop_token_ids": [0, top]},
        {"top_k": 2**64 - 1},
        {"n": 16, "logprobs": 20},
        {"max_tokens": CONTEXT - 2, "prompt": [5, 6]},
        {"temperature": 1},
    ):
        resp = app.complete(**{**GOOD_COMPLETION, **fields})
        assert resp.status_code == 200, (fields, resp.text)
    resp = app.chat(messages=MESSAGES, max_completion_tokens=1, max_tokens=5)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 1
    # Seeds keep their meaning: the n choices of seed s are seeds s, s+1, ...
    # wrapping around within int64.
    app.dispatcher.seen.clear()
    assert app.complete(**{**GOOD_COMPLETION, "seed": 2**63 - 1, "n": 2}).status_code == 200
    assert sorted(p.seed for p in app.dispatcher.seen) == [-(2**63), 2**63 - 1]


def test_worker_vocab_bounds_token_ids(app: App) -> None:
    """A worker's model may have fewer rows than its tokenizer has tokens: ids
    the model cannot embed are refused too."""
    app.state.worker_vocab_size = 100
    try:
        assert_error(app.complete(**{**GOOD_COMPLETION, "prompt": [100]}), 400, "prompt")
        resp = app.complete(**{**GOOD_COMPLETION, "prompt": [5], "stop_token_ids": [100]})
        assert_error(resp, 400, "stop_token_ids")
        assert app.complete(**{**GOOD_COMPLETION, "prompt": [99]}).status_code == 200
    finally:
        app.state.worker_vocab_size = None


def test_unexpected_exception_is_an_openai_500_and_the_connection_stays(app: App) -> None:
    app.dispatcher.explode = True
    first, second = app.raw(
        RawRequest.post_json("/v1/completions", GOOD_COMPLETION),
        RawRequest.post_json("/v1/completions", GOOD_COMPLETION),
    )
    assert first.status == 500, first.body
    err = first.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert second.status == 200, second.body


def test_unexpected_exception_mid_stream_ends_the_stream_cleanly(app: App) -> None:
    """A stream is already 200 when its requests run: a failure is an error
    event with the OpenAI body, then [DONE], and the connection stays."""
    app.dispatcher.explode = True
    first, second = app.raw(
        RawRequest.post_json("/v1/completions", {**GOOD_COMPLETION, "stream": True}),
        RawRequest.post_json("/v1/completions", GOOD_COMPLETION),
    )
    assert first.status == 200
    events = [e for e in first.body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert second.status == 200, second.body


def test_unknown_routes_and_methods_answer_in_the_openai_format(app: App) -> None:
    err = assert_error(app.http.get("/v1/no-such-endpoint"), 404, None)
    assert "/v1/no-such-endpoint" in err["message"]
    resp = app.http.get("/v1/completions")
    err = assert_error(resp, 405, None)
    assert "GET" in err["message"]
    assert resp.headers["allow"] == "POST"


def test_malformed_json_names_no_byte_offset(app: App) -> None:
    for body in (b'{"model": ', b'{"model": "tiny",}', b"not json"):
        resp = app.http.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
        err = assert_error(resp, 400, None)
        assert "JSON" in err["message"], err
    # A body that is JSON but not an object.
    assert_error(app.http.post("/v1/completions", json=[1, 2]), 400, None)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"url": ""}, "url"),
        ({"url": "   "}, "url"),
        ({"url": "::::"}, "url"),
        ({"url": "ftp://host:1"}, "url"),
        ({"url": "http://host:notaport"}, "url"),
        ({"url": "http://"}, "url"),
        ({"url": 5}, "url"),
        ({}, "url"),
        ({"url": "http://127.0.0.1:1", "role": "encode"}, "role"),
        ({"url": "http://127.0.0.1:1", "role": 5}, "role"),
        ({"url": "http://127.0.0.1:1", "role": ["decode"]}, "role"),
    ],
)
def test_admin_add_validates_its_input(app: App, body: dict[str, Any], param: str) -> None:
    assert_error(app.admin("POST", "/admin/workers", json=body), 400, param)


def test_admin_delete_validates_its_url(app: App) -> None:
    for url in ("::::", "ftp://host:1", "http://host:notaport"):
        assert_error(app.admin("DELETE", "/admin/workers", params={"url": url}), 400, "url")
    resp = app.admin("DELETE", "/admin/workers", params={"url": "http://127.0.0.1:1"})
    assert_error(resp, 404, "url")


def test_sampling_params_refuse_what_the_wire_cannot_carry() -> None:
    """The wire form itself refuses integers msgpack cannot encode, whoever
    builds it; the largest one it takes goes through."""
    for fields, param in (
        ({"max_tokens": WIRE_INT_MAX + 1}, "max_tokens"),
        ({"top_k": WIRE_INT_MAX + 1}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop_token_ids": [1, WIRE_INT_MAX + 1]}, "stop_token_ids"),
    ):
        with pytest.raises(InvalidSamplingParams) as e:
            SamplingParams(**fields)
        assert e.value.param == param
    edge = SamplingParams(
        max_tokens=WIRE_INT_MAX,
        top_k=WIRE_INT_MAX,
        seed=-(2**63),
        stop_token_ids=[WIRE_INT_MAX],
    )
    msg = to_worker.Generate("r", [1], edge)
    assert to_worker.decoder.decode(to_worker.encoder.encode(msg)) == msg


# -- fuzz ---------------------------------------------------------------------------

_INTS = st.one_of(
    st.integers(min_value=-3, max_value=40),
    st.sampled_from([0, -1, 255, 256, 511, 512, 2**31, 2**63, 2**64 - 1, 2**64, 10**30]),
    st.integers(),
)
"""Integers: mostly small (valid somewhere), then edges of the ranges, then any."""
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    _INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
"""Any JSON value (NaN and infinities too: Python's JSON reader takes them)."""

_TOKEN_IDS = st.lists(_INTS, max_size=4)
_SHARED_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL),
    "max_tokens": _INTS,
    "temperature": st.floats(allow_nan=True) | _INTS,
    "top_p": st.floats(allow_nan=True) | _INTS,
    "top_k": _INTS,
    "min_p": st.floats(allow_nan=True) | _INTS,
    "seed": _INTS,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=20),
    "stop_token_ids": _TOKEN_IDS,
    "ignore_eos": st.booleans(),
    "n": _INTS,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": _JSON}),
    "user": st.text(max_size=4),
    "return_token_ids": st.booleans(),
    "logit_bias": st.dictionaries(
        st.text(max_size=4) | _INTS.map(str), st.floats(allow_nan=True) | _INTS | _JSON, max_size=3
    ),
    "presence_penalty": st.floats(allow_nan=True) | _INTS,
    "frequency_penalty": st.floats(allow_nan=True) | _INTS,
    "repetition_penalty": st.floats(allow_nan=True) | _INTS,
    "metadata": _JSON,
    "store": _JSON,
}
_CHAT_FIELDS = {
    **_SHARED_FIELDS,
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system"]) | _JSON},
            optional={"content": _JSON, "name": _JSON, "tool_calls": _JSON},
        ),
        max_size=3,
    ),
    "max_completion_tokens": _INTS,
    "logprobs": st.booleans(),
    "top_logprobs": _INTS,
    "add_generation_prompt": st.booleans(),
}
_COMPLETION_FIELDS = {
    **_SHARED_FIELDS,
    "prompt": st.text(max_size=8)
    | st.lists(st.text(max_size=4), max_size=3)
    | _TOKEN_IDS
    | st.lists(_TOKEN_IDS, max_size=3),
    "logprobs": _INTS,
    "echo": st.booleans(),
    "best_of": _INTS,
    "suffix": st.text(max_size=4) | _JSON,
}


@st.composite
def _bodies(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]], base: dict) -> Any:
    """A valid request with one to three fields replaced, mostly by a value
    of about the right shape (so that it gets past the other checks), else by
    any JSON value, or left out; rarely a body that is not an object."""
    if draw(st.integers(0, 19)) == 0:
        return draw(_JSON)
    body = dict(base)
    names = st.sampled_from(sorted(fields))
    for name in draw(st.lists(names, min_size=1, max_size=3, unique=True)):
        how = draw(st.integers(0, 5))
        if how == 0:
            body.pop(name, None)
        elif how == 1:
            body[name] = draw(_JSON)
        else:
            body[name] = draw(fields[name])
    return body


def _assert_clean(resp: httpx.Response, body: Any) -> None:
    """Not a 5xx, every error in the OpenAI body, and no stream that ended on
    a server error."""
    assert resp.status_code < 500, (body, resp.text)
    if resp.status_code >= 400:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    elif resp.headers["content-type"].startswith("text/event-stream"):
        assert '"server_error"' not in resp.text, (body, resp.text)
        assert resp.text.endswith("data: [DONE]\n\n")


_FUZZ = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_FUZZ
@given(body=_bodies(_CHAT_FIELDS, {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}))
def test_fuzz_chat_bodies_never_5xx(app: App, body: Any) -> None:
    _assert_clean(app.http.post("/v1/chat/completions", **_json_body(body)), body)


@_FUZZ
@given(body=_bodies(_COMPLETION_FIELDS, GOOD_COMPLETION))
def test_fuzz_completion_bodies_never_5xx(app: App, body: Any) -> None:
    _assert_clean(app.http.post("/v1/completions", **_json_body(body)), body)


def _json_body(body: Any) -> dict[str, Any]:
    # allow_nan: NaN and Infinity are not JSON but Python's reader (the
    # gateway's) takes them, so they must be refused like any bad number.
    return {
        "content": json.dumps(body, allow_nan=True).encode(),
        "headers": {"content-type": "application/json"},
    }


# -- the direct generation routes answer as the FastAPI routes do -----------------

_DIRECT_CASES: list[tuple[str, str, bytes, str | None]] = [
    # (path, content type, body, None when the direct path must fall through)
    ("/v1/completions", "application/json", json.dumps(GOOD_COMPLETION).encode(), "taken"),
    (
        "/v1/chat/completions",
        "application/json",
        json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 2}).encode(),
        "taken",
    ),
    (
        "/v1/completions",
        "application/json",
        json.dumps({**GOOD_COMPLETION, "foo": 1}).encode(),
        "taken",
    ),
    (
        "/v1/completions",
        "application/json",
        json.dumps({**GOOD_COMPLETION, "max_tokens": "x"}).encode(),
        "taken",
    ),
    (
        "/v1/completions",
        "application/json",
        json.dumps({**GOOD_COMPLETION, "prompt": {}}).encode(),
        "taken",
    ),
    ("/v1/completions", "application/json", json.dumps({"prompt": "hi"}).encode(), "taken"),
    (
        "/v1/completions",
        "application/json",
        json.dumps({**GOOD_COMPLETION, "model": "nope"}).encode(),
        "taken",
    ),
    (
        "/v1/completions",
        "application/json",
        json.dumps({**GOOD_COMPLETION, "max_tokens": 10**6}).encode(),
        "taken",
    ),
    (
        "/v1/chat/completions",
        "application/json",
        json.dumps({"model": MODEL, "messages": []}).encode(),
        "taken",
    ),
    ("/v1/completions", "application/vnd.api+json", json.dumps(GOOD_COMPLETION).encode(), "taken"),
    ("/v1/completions", "application/json", b"[1, 2]", None),
    ("/v1/completions", "application/json", b'"text"', None),
    ("/v1/completions", "application/json", b"{bad", None),
    ("/v1/completions", "application/json", b"", None),
    (
        "/v1/completions",
        "application/json",
        b'{"model": "tiny", "prompt": "hi", "temperature": NaN}',
        None,
    ),
    ("/v1/completions", "text/plain", json.dumps(GOOD_COMPLETION).encode(), None),
]


_RESPONSE_ID = re.compile(rb'"id": ?"(chatcmpl|cmpl)-[0-9a-f]{24}"')
_CREATED = re.compile(rb'"created": ?[0-9]+')
_HEADERS = ("content-type", "content-length", "transfer-encoding", "retry-after", "cache-control")
"""The response headers a client acts on."""


def _comparable(resp: httpx.Response) -> tuple[int, dict[str, str | None], bytes]:
    """The status, the headers that matter and the body, byte for byte but
    for the response's id and timestamp (streamed: in every event)."""
    body = _RESPONSE_ID.sub(b'"id": "ID"', resp.content)
    body = _CREATED.sub(b'"created": 0', body)
    return resp.status_code, {h: resp.headers.get(h) for h in _HEADERS}, body


@pytest.fixture(scope="module")
def direct_and_reference(model_dir: str) -> Iterator[tuple[App, App, list[str]]]:
    """The app as built, whose direct routes note every request they serve
    themselves, and the same app with no direct routes (only FastAPI's)."""
    import gateway.app as app_module

    served = _Noted()
    real = app_module._direct_routes

    def noting(state: GatewayState) -> dict[str, Any]:
        def wrap(path: str, route: Any) -> Any:
            async def call(scope: Any, receive: Any, send: Any) -> Any:
                served.in_flight += 1
                try:
                    passed_on = await route(scope, receive, send)
                    if passed_on is None:
                        served.append(path)
                    return passed_on
                finally:
                    served.in_flight -= 1

            return call

        return {path: wrap(path, route) for path, route in real(state).items()}

    def state() -> _LocalState:
        router = Router(RouterConfig())
        config = GatewayConfig(admin_key=ADMIN_KEY)
        return _LocalState(
            config, router, HealthChecker(router), WireDispatcher(), model_dir=model_dir
        )  # type: ignore[arg-type]

    with contextlib.ExitStack() as stack:
        app_module._direct_routes = noting  # type: ignore[assignment]
        try:
            s1 = state()
            direct = stack.enter_context(serve_in_process(s1, s1.dispatcher))
            app_module._direct_routes = lambda _state: {}  # type: ignore[assignment]
            s2 = state()
            reference = stack.enter_context(serve_in_process(s2, s2.dispatcher))
        finally:
            app_module._direct_routes = real  # type: ignore[assignment]
        yield direct, reference, served


class _Noted(list):
    """The paths the direct routes served themselves, and how many of their
    calls are still running (a call may outlive its response's last byte)."""

    in_flight = 0


def _fresh(served: list[str]) -> None:
    """Forget what earlier tests' requests noted, once none of their direct
    route calls is still running (one may note its path after its client has
    read the whole response, and so after the next test began)."""
    deadline = time.monotonic() + 10
    while getattr(served, "in_flight", 0) and time.monotonic() < deadline:
        time.sleep(0.005)
    served.clear()


def _served(served: list[str], path: str | None) -> list[str]:
    """``served`` once the direct route that took ``path`` has returned (None:
    at once). The client may read the response's last bytes before the
    route's coroutine returns and notes it."""
    deadline = time.monotonic() + 10
    while path is not None and not served and time.monotonic() < deadline:
        time.sleep(0.005)
    return served


@pytest.mark.parametrize(("path", "ctype", "body", "taken"), _DIRECT_CASES)
def test_direct_routes_answer_as_fastapi_does(
    direct_and_reference: tuple[App, App, list[str]],
    path: str,
    ctype: str,
    body: bytes,
    taken: str | None,
) -> None:
    direct, reference, served = direct_and_reference
    _fresh(served)
    headers = {"content-type": ctype}
    got = direct.http.post(path, content=body, headers=headers)
    want = reference.http.post(path, content=body, headers=headers)
    assert _comparable(got) == _comparable(want)
    # The direct path serves what it can read as FastAPI would, and leaves
    # the rest to FastAPI.
    assert _served(served, path if taken else None) == ([path] if taken else [])


@pytest.mark.parametrize("stream", [False, True])
def test_direct_route_unexpected_failure_is_the_same(
    direct_and_reference: tuple[App, App, list[str]], stream: bool
) -> None:
    """The same 500; streamed, the same error event in a 200 and [DONE]."""
    direct, reference, _ = direct_and_reference
    answers = []
    for app in (direct, reference):
        app.dispatcher.explode = True
        answers.append(_comparable(app.complete(prompt="Hello", max_tokens=2, stream=stream)))
    assert answers[0] == answers[1]
    status, _, body = answers[0]
    assert status == (200 if stream else 500), body
    assert re.search(rb'"code": ?"internal_error"', body), body
    assert body.endswith(b"data: [DONE]\n\n") == stream


_STREAMED = [
    ("/v1/completions", {**GOOD_COMPLETION, "stream": True}),
    (
        "/v1/completions",
        {
            **GOOD_COMPLETION,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": 2,
            "echo": True,
            "return_token_ids": True,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 3,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 1,
        },
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True, "stop": ["o"]},
    ),
    ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES, "stream": True}),
    ("/v1/completions", {**GOOD_COMPLETION, "stream": True, "n": 0}),
]


@pytest.mark.parametrize(("path", "body"), _STREAMED, ids=lambda x: json.dumps(x)[:40])
def test_direct_routes_stream_as_fastapi_does(
    direct_and_reference: tuple[App, App, list[str]], path: str, body: dict[str, Any]
) -> None:
    """A streamed response's events, byte for byte but for its id and
    timestamp, and its refusals, are the same on both paths."""
    direct, reference, served = direct_and_reference
    _fresh(served)
    got = direct.http.post(path, json=body)
    want = reference.http.post(path, json=body)
    assert _comparable(got) == _comparable(want)
    assert _served(served, path) == [path]
    if got.status_code == 200:
        assert got.text.endswith("data: [DONE]\n\n"), got.text
