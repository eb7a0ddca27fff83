"""A local stand-in for the hub HTTP API, enough for huggingface_hub's create_repo/create_commit.

Runs http.server in a thread on 127.0.0.1 and records every request (method, path, headers,
files committed), so tests assert what was uploaded without mocking our own code.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubRecorder:
    def __init__(self):
        self.requests: list[dict] = []
        self.committed: dict[str, bytes] = {}
        self.created: list[dict] = []
        self.branches: list[str] = []
        self.commit_revisions: list[str] = []


def _handler(rec: HubRecorder):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test output clean
            pass

        def _body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                return self.rfile.read(n)
            if self.headers.get("Transfer-Encoding") == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return b""

        def _send(self, code: int, data) -> None:
            raw = json.dumps(data).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            rec.requests.append({"method": "GET", "path": self.path, "headers": dict(self.headers)})
            self._send(404, {"error": "not found"})

        def do_POST(self):
            body = self._body()
            rec.requests.append({"method": "POST", "path": self.path, "headers": dict(self.headers), "body": body})
            parts = self.path.split("?")[0].strip("/").split("/")
            host = f"http://{self.headers['Host']}"
            if parts[:2] == ["api", "validate-yaml"]:
                return self._send(200, {"errors": [], "warnings": []})
            if parts[:3] == ["api", "repos", "create"]:
                data = json.loads(body)
                rec.created.append(data)
                repo = f"{data.get('organization') or 'user'}/{data['name']}"
                return self._send(200, {"url": f"{host}/{repo}", "name": repo, "id": repo})
            if parts[:2] == ["api", "models"] and len(parts) >= 6:
                repo, action, rev = "/".join(parts[2:4]), parts[4], "/".join(parts[5:])
                if action == "branch":
                    rec.branches.append(rev)
                    return self._send(200, {})
                if action == "preupload":
                    files = json.loads(body)["files"]
                    return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                       "shouldIgnore": False, "oid": None} for f in files]})
                if action == "commit":
                    rec.commit_revisions.append(rev)
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item.get("key") == "file":
                            value = item["value"]
                            rec.committed[value["path"]] = base64.b64decode(value["content"])
                    return self._send(200, {"commitUrl": f"{host}/{repo}/commit/{'0' * 40}",
                                            "commitOid": "0" * 40, "pullRequestUrl": None})
            self._send(404, {"error": f"unknown route {self.path}"})

    return Handler


class LocalHub:
    """Context manager: `with LocalHub() as hub: hub.url, hub.rec`."""

    def __enter__(self):
        self.rec = HubRecorder()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.rec))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
