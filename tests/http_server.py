"""A loopback HTTP server for download tests: fixed routes, scripted failures, Range support."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LoopbackServer:
    """``routes`` maps a path to bytes; ``failures`` maps a path to a list of status codes returned
    (one per request) before the content is served; unknown paths are 404. ``hits`` counts requests;
    ``redirects`` maps a path to a URL answered with 302; ``token`` makes every route but redirects
    answer 401 unless the request carries ``Authorization: Bearer <token>``. ``authorization`` keeps
    each request's Authorization header (None when absent) by path."""

    def __init__(self, routes: dict[str, bytes] | None = None, failures: dict[str, list[int]] | None = None,
                 redirects: dict[str, str] | None = None, token: str | None = None):
        self.routes = dict(routes or {})
        self.failures = {k: list(v) for k, v in (failures or {}).items()}
        self.redirects = dict(redirects or {})
        self.token = token
        self.hits: dict[str, int] = {}
        self.authorization: dict[str, list] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                path = self.path.split("?")[0]
                server.hits[path] = server.hits.get(path, 0) + 1
                server.authorization.setdefault(path, []).append(self.headers.get("Authorization"))
                if path in server.redirects:
                    self.send_response(302)
                    self.send_header("Location", server.redirects[path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if server.token is not None and self.headers.get("Authorization") != f"Bearer {server.token}":
                    self.send_error(401)
                    return
                pending = server.failures.get(path)
                if pending:
                    self.send_error(pending.pop(0))
                    return
                if path not in server.routes:
                    self.send_error(404)
                    return
                body = server.routes[path]
                start = 0
                range_header = self.headers.get("Range")
                if range_header and range_header.startswith("bytes="):
                    start = int(range_header[6:].split("-")[0])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                self.wfile.write(body[start:])

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
