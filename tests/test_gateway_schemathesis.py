"""The gateway's OpenAPI schema fuzzed with schemathesis: bodies, queries
and headers generated from every operation's schema, valid and invalid,
with the served model's name put into the bodies so that generation paths
are reached, and the admin key sent so that admin handlers are. Not one
answer may be a 5xx, and every error is in the OpenAI format.

The gateway runs in-process over the hostile tests' fake workers (the real
request-plane encoding). Two sets of cases per operation: schemathesis's
coverage cases (a fixed list: each field missing, of the wrong type, at and
past its bounds) and Hypothesis examples drawn from the operation's
strategies (a fixed seed and a bounded number of examples).

Schemathesis is used through its Python API (operations, coverage cases,
strategies), not through its pytest plugin, which patches pytest's node
internals and broke with a pytest release (``Function._nodeid``, gone in
pytest 9.2)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_gateway_hostile import ADMIN_KEY, MESSAGES, MODEL, App
from test_gateway_hostile import app as app  # noqa: F401  (the fixture)

schemathesis = pytest.importorskip("schemathesis")  # a test extra; GPU-only hosts may lack it
MODES = list(schemathesis.GenerationMode)  # valid and invalid data


@pytest.fixture(scope="module")
def operations(app: App) -> list[schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_url(f"http://{app.host}:{app.port}/openapi.json")
    ops = []
    for result in schema.get_all_operations():
        error = getattr(result, "err", None)
        if error is not None:  # an operation the schema defines badly
            raise error()
        ops.append(result.ok())
    labels = {op.label for op in ops}
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= labels, labels
    return ops


def check(case: schemathesis.Case) -> None:
    """Send ``case`` (its body given the served model) and check the answer."""
    body = case.body
    if isinstance(body, dict) and "model" in body:
        body["model"] = MODEL
        # The schema allows what the first checks refuse (no messages, an
        # empty prompt); filled in, the rest of the body reaches generation.
        if body.get("messages") == []:
            body["messages"] = MESSAGES
        if body.get("prompt") in ("", []):
            body["prompt"] = "Hello"
        if body.get("tools") == []:
            del body["tools"]
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    resp = case.call(headers=headers, timeout=30)
    if case.path == "/health" and resp.status_code == 503:
        # Its answer while no worker is up, as in this app (the fake workers
        # are no listed workers): the one 5xx the schema promises.
        return
    assert resp.status_code < 500, (case.method, case.path, case.body, resp.text)
    content_type = resp.headers.get("content-type", [""])[0]
    if resp.status_code >= 400 and content_type.startswith("application/json"):
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}, resp.text


def test_openapi_coverage_cases_never_5xx(operations: list[schemathesis.APIOperation]) -> None:
    sent = 0
    for op in operations:
        schema = op.schema
        generation = schema.config.generation_for(operation=op, phase="coverage")
        for case in schema.iter_coverage_cases(
            op, generation_modes=MODES, generation_config=generation
        ):
            check(case)
            sent += 1
    # Hundreds for the two generation endpoints alone: a schema or a
    # schemathesis that yields next to none would test nothing.
    assert sent >= 100, sent


def test_openapi_fuzz_never_5xx(operations: list[schemathesis.APIOperation]) -> None:
    for op in operations:

        @settings(
            max_examples=40,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=st.one_of([op.as_strategy(generation_mode=mode) for mode in MODES]))
        def fuzz(case: schemathesis.Case) -> None:
            check(case)

        fuzz()
