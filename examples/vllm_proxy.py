"""A minimal router in front of a prefill and a decode vLLM server joined by TensorwireConnector: the two-request
flow, so that clients send ordinary completion requests.

    python examples/vllm_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

``POST /v1/completions``: the request goes to the prefill server with ``max_tokens: 1`` and ``kv_transfer_params:
{"do_remote_decode": true}``, then, with the ``kv_transfer_params`` of that answer, to the decode server, whose
answer the client gets. Whatever ``kv_transfer_params`` the client sent are replaced: a router is where a
deployment keeps clients from choosing them. Standard library only; one thread per request; no streaming.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["serve"]


def _post(url: str, body: dict, timeout_s: float) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def serve(prefill: str, decode: str, host: str, port: int, timeout_s: float = 300.0) -> ThreadingHTTPServer:
    """The proxy's server, bound (``port`` 0: a free one, ``server.server_address[1]``); call ``serve_forever``."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
            if self.path != "/v1/completions":
                return self._answer(404, b'{"error": "only /v1/completions"}')
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except ValueError:
                return self._answer(400, b'{"error": "the body is not JSON"}')
            if not isinstance(body, dict):
                return self._answer(400, b'{"error": "the body is not a JSON object"}')
            first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
            status, text = _post(prefill + "/v1/completions", first, timeout_s)
            if status != 200:
                return self._answer(status, text)
            params = json.loads(text).get("kv_transfer_params")
            self._answer(*_post(decode + "/v1/completions", {**body, "kv_transfer_params": params}, timeout_s))

        def _answer(self, status: int, text: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args) -> None:  # one line per request on stderr is noise here
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="the prefill server's URL, e.g. http://127.0.0.1:8100")
    parser.add_argument("--decode", required=True, help="the decode server's URL, e.g. http://127.0.0.1:8200")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    serve(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.host, args.port).serve_forever()


if __name__ == "__main__":
    main()
