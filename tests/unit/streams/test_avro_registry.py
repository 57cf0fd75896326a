"""The schema registry client against a small HTTP server speaking its REST API: a schema is
fetched once and cached, an id the registry does not have is remembered for a while (its
messages are dead-lettered without a request each), and a registry that does not answer
is ``LookupUnavailable`` (the ingest edge waits for it), never a cached verdict."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from edgestream.streams.errors import LookupUnavailable, RecordDecodeError
from edgestream.streams.formats import avro_records, format_named
from edgestream.streams.formats.avro_records import SchemaRegistry

READING = {"type": "record", "name": "Reading", "fields": [{"name": "x", "type": "float"}]}


class Registry:
    """Serves ``/schemas/ids/<id>``: ids in ``schemas`` answer, ``failing`` ones answer 503,
    the rest 404; counts the requests per id."""

    def __init__(self) -> None:
        self.schemas = {1: json.dumps(READING), 4: json.dumps({"not": "avro"})}
        self.failing: set[int] = set()
        self.requests: dict[int, int] = {}
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                schema_id = int(self.path.rsplit("/", 1)[1])
                owner.requests[schema_id] = owner.requests.get(schema_id, 0) + 1
                code = 503 if schema_id in owner.failing else 200 if schema_id in owner.schemas else 404
                body = json.dumps({"schema": owner.schemas[schema_id]} if code == 200 else {"error_code": code})
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/apis/ccompat/v7"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def registry():
    served = Registry()
    yield served
    served.close()


def test_a_schema_is_fetched_once_and_served_from_the_cache(registry):
    client = SchemaRegistry(registry.url, timeout_s=2.0)
    assert not client.cached(1)
    client.fetch(1)
    assert client.cached(1)
    assert client.schema(1)["name"] == "Reading" and client.schema(1) is client.schema(1)
    assert registry.requests == {1: 1}


def test_a_missing_id_is_remembered_then_asked_again(registry, monkeypatch):
    client = SchemaRegistry(registry.url, timeout_s=2.0)
    for schema_id, words in ((2, r"has no schema 2 \(HTTP 404\)"), (4, r"schema 4 of \S+ is not")):
        client.fetch(schema_id)
        assert client.cached(schema_id)
        for _ in range(2):
            with pytest.raises(RecordDecodeError, match=words) as raised:
                client.schema(schema_id)
            assert raised.value.reason == "unknown_schema"
    assert registry.requests == {2: 1, 4: 1}
    monkeypatch.setattr(avro_records, "MISSING_TTL_S", 0.0)
    registry.schemas[2] = json.dumps(READING)  # registered since
    assert not client.cached(2)
    assert client.schema(2)["name"] == "Reading" and registry.requests[2] == 2


def test_a_registry_that_does_not_answer_is_unavailable_and_nothing_is_cached(registry):
    client = SchemaRegistry(registry.url, timeout_s=2.0)
    registry.failing.add(1)
    with pytest.raises(LookupUnavailable, match="answered HTTP 503 for schema 1"):
        client.fetch(1)
    assert not client.cached(1)
    # A caller that cannot wait gets the message's verdict instead (dead-lettered, replayable).
    with pytest.raises(RecordDecodeError, match="HTTP 503") as raised:
        client.schema(1)
    assert raised.value.reason == "unknown_schema" and not client.cached(1)
    registry.failing.clear()
    client.fetch(1)
    assert client.cached(1)
    url = registry.url
    registry.close()
    gone = SchemaRegistry(url, timeout_s=2.0)
    with pytest.raises(LookupUnavailable, match="did not answer for schema 1"):
        gone.fetch(1)
    assert not gone.cached(1)


def test_the_format_looks_up_each_uncached_id_of_a_fetch_once(registry, monkeypatch):
    fmt = format_named("avro")
    params = fmt.parse_params({"features": ["x"], "schema_registry": registry.url})
    monkeypatch.setattr(avro_records, "_REGISTRIES", {})
    framed = [b"\x00" + i.to_bytes(4, "big") + b"\x00\x00\x80\x3f" for i in (1, 1, 2)]
    lookups = fmt.lookups(params, [*framed, b"{}", None, b"\x00\x00"])  # no id in the last three
    assert len(lookups) == 2
    for lookup in lookups:
        lookup()
    assert registry.requests == {1: 1, 2: 1}
    assert fmt.lookups(params, framed) == []  # both answered (one schema, one missing id)
