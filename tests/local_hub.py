"""A Hub on localhost for the calls `kernels.get_kernel` makes online, answered from built repo
trees: the publisher's organization (with its kernel-trust flag), a repo's version branches,
its file tree and its files. kernels and huggingface_hub run unchanged against it
(`HF_ENDPOINT`), so their trust check runs for real, which offline mode skips."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import urllib.parse
from pathlib import Path


class LocalHub:
    """repos: {repo_id: (tree, version, commit)}; trusted: organizations the Hub marks as
    trusted kernel publishers. Use as a context manager; `url` is the endpoint."""

    def __init__(self, repos: dict[str, tuple[Path, int, str]], trusted: set[str] = frozenset()):
        self.repos, self.trusted = repos, set(trusted)
        self.requests: list[str] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                hub._answer(self, body=True)

            def do_HEAD(self):  # noqa: N802
                hub._answer(self, body=False)

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def _repo(self, path: str):
        """(repo_id, rest of the path) for a path that starts with a served repo's id."""
        for repo_id in self.repos:
            if path == repo_id or path.startswith(repo_id + "/"):
                return repo_id, path[len(repo_id) + 1:]
        return None, None

    def _answer(self, handler, body: bool):
        path = urllib.parse.urlparse(handler.path).path
        self.requests.append(f"{handler.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "organizations"] and parts[3:] == ["overview"]:
            org = parts[2]
            return self._json(handler, {"name": org, "fullname": org, "avatarUrl": "",
                                        "trustedKernelPublisher": org in self.trusted}, body)
        if parts[:2] == ["api", "kernels"]:
            repo_id, rest = self._repo("/".join(parts[2:]))
            if repo_id is None:
                return self._missing(handler)
            tree, version, commit = self.repos[repo_id]
            if rest == "refs":
                branch = {"name": f"v{version}", "ref": f"refs/heads/v{version}", "targetCommit": commit}
                return self._json(handler, {"branches": [branch], "tags": [], "converts": []}, body)
            kind, _, rest = rest.partition("/")
            revision, _, inside = rest.partition("/")
            if kind == "tree" and revision == commit:
                recursive = "recursive=true" in (urllib.parse.urlparse(handler.path).query or "").lower()
                return self._json(handler, self._listing(tree, inside, recursive), body)
        if parts[0] == "kernels":
            repo_id, rest = self._repo("/".join(parts[1:]))
            if repo_id is not None:
                tree, _, commit = self.repos[repo_id]
                kind, revision, *inside = rest.split("/")
                file = tree.joinpath(*inside)
                if kind == "resolve" and revision == commit and file.is_file():
                    data = file.read_bytes()
                    handler.send_response(200)
                    handler.send_header("Content-Length", str(len(data)))
                    handler.send_header("ETag", f'"{_blob_id(data)}"')
                    handler.send_header("X-Repo-Commit", commit)
                    handler.end_headers()
                    if body:
                        handler.wfile.write(data)
                    return None
        return self._missing(handler)

    @staticmethod
    def _listing(tree: Path, inside: str, recursive: bool) -> list[dict]:
        base = tree.joinpath(*inside.split("/")) if inside else tree
        entries = sorted(base.rglob("*") if recursive else base.iterdir())
        out = []
        for entry in entries:
            rel = entry.relative_to(tree).as_posix()
            if entry.is_dir():
                out.append({"type": "directory", "oid": hashlib.sha1(rel.encode()).hexdigest(), "path": rel})
            else:
                data = entry.read_bytes()
                out.append({"type": "file", "oid": _blob_id(data), "size": len(data), "path": rel})
        return out

    @staticmethod
    def _json(handler, payload, body: bool):
        data = json.dumps(payload).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)

    @staticmethod
    def _missing(handler):
        handler.send_response(404)
        handler.send_header("Content-Length", "0")
        handler.end_headers()


def _blob_id(data: bytes) -> str:
    """git's blob id, as the Hub reports a file's oid."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
