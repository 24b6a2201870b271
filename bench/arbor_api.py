"""A small client for Arbor's API, shared by the benchmark's Python scripts:
one keep-alive connection, the admin key from $ARBOR_BENCH_KEY (set by
bench/common.sh's `await_arbor`), JSON in, the body's bytes out, and an
exit with the status and the start of the body when a call fails."""

import http.client
import json
import os
from urllib.parse import urlparse


def client(base_url="http://127.0.0.1:8080"):
    """Returns call(method, path, body=None) -> bytes."""
    url = urlparse(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    key = os.environ["ARBOR_BENCH_KEY"]

    def call(method, path, body=None):
        headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        connection.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        response = connection.getresponse()
        data = response.read()
        if response.status >= 300:
            raise SystemExit(f"{method} {path} answered {response.status}: {data[:300]!r}")
        return data

    return call
