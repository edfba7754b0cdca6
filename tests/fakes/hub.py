"""Fake Hugging Face Hubs for the tests of the scripts that use it: one out of reach (a Hub that answers
every request 503, endpoints nothing listens on, and the environments that point the libraries there), and
one that takes an upload (scripts/export_hf.py --push_to_hub)."""

import base64
import contextlib
import http.server
import json
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


class AcceptingHub(http.server.BaseHTTPRequestHandler):
    """A Hub that takes an upload as the real one does for small files (create the repo, ask how to
    upload each file: inline, "regular"; commit them as NDJSON) and keeps what it was sent:
    server.files = {repo_id: {path: bytes}}."""

    def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.server.requests.append(self.requestline)
        if self.path.startswith("/api/whoami-v2"):
            return self.reply(200, {"type": "user", "name": "tester", "auth": {"accessToken": {"role": "write"}}})
        self.reply(404, {"error": f"not in this fake: {self.path}"})

    def do_POST(self):
        self.server.requests.append(self.requestline)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        endpoint = f"http://127.0.0.1:{self.server.server_port}"
        if self.path == "/api/repos/create":
            repo = json.loads(body)
            repo_id = f"{repo.get('organization') or 'tester'}/{repo['name']}"
            return self.reply(200, {"url": f"{endpoint}/{repo_id}", "name": repo_id, "id": repo_id})
        parts = self.path.split("/")  # /api/models/<owner>/<name>/<preupload|commit>/<revision>
        repo_id, action = "/".join(parts[3:5]), parts[5]
        if action == "preupload":
            files = json.loads(body)["files"]
            return self.reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                              for f in files]})
        if action == "commit":
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    content = base64.b64decode(item["value"]["content"])
                    self.server.files.setdefault(repo_id, {})[item["value"]["path"]] = content
            return self.reply(200, {"commitUrl": f"{endpoint}/{repo_id}/commit/0123abcd", "commitOid": "0123abcd"})
        self.reply(404, {"error": f"not in this fake: {self.path}"})

    def log_message(self, *args):  # quiet
        pass


@contextlib.contextmanager
def accepting_hub():
    """An AcceptingHub serving in a thread: gives (its endpoint, the files it was sent)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), AcceptingHub)
    server.requests, server.files = [], {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", server
    finally:
        server.shutdown()
        server.server_close()
