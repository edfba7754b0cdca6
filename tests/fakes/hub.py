"""A Hugging Face Hub out of reach, for the tests of the scripts that read from it: a Hub that answers
every request 503, endpoints nothing listens on, and the environments that point the libraries there."""

import contextlib
import http.server
import os
import socket
import threading

# an endpoint nothing listens on (the discard port): a request to it is refused at once
NOWHERE = "http://127.0.0.1:9"


class UnavailableHub(http.server.BaseHTTPRequestHandler):
    """A Hub that answers every request "503 Service Unavailable", the status the libraries retry on,
    and counts the requests."""

    def do_GET(self):
        self.server.requests.append(self.requestline)
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):  # quiet
        pass


@contextlib.contextmanager
def unavailable_hub():
    """An UnavailableHub serving in a thread: gives (its endpoint, the list of requests it received)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), UnavailableHub)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", server.requests
    finally:
        server.shutdown()
        server.server_close()


def closed_port():
    """A local port that was free a moment ago: a connection to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def no_hub_env(endpoint, tmp_path, **extra):
    """os.environ with the Hub at endpoint, reached directly (a proxy must not stand in for it), and an
    empty Hub cache (HF_HOME under tmp_path); extra wins, and a None in it removes that variable."""
    env = {**os.environ, "HF_ENDPOINT": endpoint, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1",
           "HF_HOME": str(tmp_path / "hf_home"), **extra}
    return {k: v for k, v in env.items() if v is not None}
