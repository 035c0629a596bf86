"""A loopback HTTP server for download tests: fixed routes, scripted failures, Range support."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LoopbackServer:
    """``routes`` maps a path to bytes; ``failures`` maps a path to a list of status codes returned
    (one per request) before the content is served; unknown paths are 404. ``hits`` counts requests."""

    def __init__(self, routes: dict[str, bytes] | None = None, failures: dict[str, list[int]] | None = None):
        self.routes = dict(routes or {})
        self.failures = {k: list(v) for k, v in (failures or {}).items()}
        self.hits: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                path = self.path.split("?")[0]
                server.hits[path] = server.hits.get(path, 0) + 1
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
