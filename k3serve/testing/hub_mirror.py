"""A local Hugging Face Hub over real HTTP for tests (`HF_ENDPOINT=mirror.url`): the endpoints
`huggingface_hub` calls to resolve and download a model repo (repo info by revision, the file
tree, `resolve/{revision}/{path}` with HEAD and GET), served from local folders, with a log of
every request so a test can assert which files were fetched."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class HubMirror:
    def __init__(self, repos: dict[str, str | Path]):
        self.repos = {r: Path(d) for r, d in repos.items()}
        self.commit = {r: hashlib.sha1(r.encode()).hexdigest() for r in self.repos}
        self.log: list[tuple[str, str]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="hub-mirror").start()

    def fetched(self) -> set[str]:
        """Files whose bytes were sent (GET on resolve/)."""
        return {p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.log if m == "GET" and "/resolve/" in p}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str) -> list[Path]:
        return sorted(p for p in self.repos[repo].rglob("*") if p.is_file())


def _handler(mirror: HubMirror):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self._answer(head=False)

        def do_HEAD(self):
            self._answer(head=True)

        def _answer(self, head: bool):
            path = unquote(urlparse(self.path).path)
            mirror.log.append((self.command, path))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"]:
                return self._api("/".join(parts[2:4]), parts[4:], head)
            repo = "/".join(parts[:2])
            if len(parts) < 5 or parts[2] != "resolve" or repo not in mirror.repos:
                return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head)
            f = mirror.repos[repo] / "/".join(parts[4:])
            if not f.is_file():
                return self._send(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"}, head)
            data = f.read_bytes()
            headers = {"X-Repo-Commit": mirror.commit[repo], "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
            return self._send(200, data, headers, head)

        def _api(self, repo: str, rest: list[str], head: bool):
            if repo not in mirror.repos:
                return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head)
            root = mirror.repos[repo]
            files = mirror.files(repo)
            if rest and rest[0] == "tree":
                body = [
                    {
                        "type": "file",
                        "path": str(p.relative_to(root)),
                        "size": p.stat().st_size,
                        "oid": hashlib.sha1(p.read_bytes()).hexdigest(),
                    }
                    for p in files
                ]
            else:
                body = {
                    "id": repo,
                    "modelId": repo,
                    "sha": mirror.commit[repo],
                    "siblings": [{"rfilename": str(p.relative_to(root))} for p in files],
                }
            return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)

        def _send(self, code: int, body: bytes, headers: dict, head: bool):
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

    return Handler
