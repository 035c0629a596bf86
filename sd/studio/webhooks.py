"""Webhooks: a JSON POST to a URL of the job's (or the studio's ``--webhook``) when a job starts, writes a
validation grid, finishes, fails, is stopped, cancelled or lost.

Events wait in a bounded queue and are sent by one thread of their own, so a slow or dead receiver never holds
a job or a page: each is tried ``tries`` times with backoff (1, 2, 4, 8 s ...), then dropped with a line on the
console; when more than ``capacity`` wait, the oldest are dropped and counted. With ``SD_STUDIO_WEBHOOK_SECRET``
set, each body is signed: ``X-SD-Signature: sha256=<HMAC-SHA256 of the body>``, as GitHub's webhooks are.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

SECRET_ENV = "SD_STUDIO_WEBHOOK_SECRET"


def check_url(url: str) -> str:
    """``url`` when it is an http(s) address with a host, else a ValueError saying what is wanted."""
    parts = urllib.parse.urlsplit(str(url))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"webhook {url!r}: an http:// or https:// address, e.g. http://127.0.0.1:9000/hook")
    return str(url)


class Webhooks:
    def __init__(self, default_url: str | None = None, tries: int = 5, first_delay: float = 1.0,
                 timeout: float = 10.0, capacity: int = 1000):
        self.default_url = check_url(default_url) if default_url else None
        self.tries, self.first_delay, self.timeout = tries, first_delay, timeout
        self.events: collections.deque = collections.deque(maxlen=capacity)
        self.dropped = 0
        self.ready = threading.Condition()
        self.sent = 0
        self.closing = False
        self.thread = threading.Thread(target=self.send_all, name="studio-webhooks", daemon=True)
        self.thread.start()

    def __call__(self, event: str, job, **details) -> None:
        """Queue ``event`` of ``job`` (a ``JobRecord``) for its URLs; returns at once."""
        urls = {url for url in (job.webhook, self.default_url) if url}
        if not urls:
            return
        body = json.dumps({"event": event, "time": time.time(), "job": job.public(), **details}).encode()
        with self.ready:
            for url in sorted(urls):
                if len(self.events) == self.events.maxlen:
                    self.dropped += 1
                self.events.append((url, body))
            self.ready.notify()

    def send_all(self) -> None:
        while True:
            with self.ready:
                while not self.events and not self.closing:
                    self.ready.wait()
                if not self.events:
                    return
                url, body = self.events.popleft()
            self.send(url, body)

    def send(self, url: str, body: bytes) -> bool:
        headers = {"Content-Type": "application/json", "User-Agent": "sd-studio"}
        secret = os.environ.get(SECRET_ENV)
        if secret:
            digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
            headers["X-SD-Signature"] = f"sha256={digest}"
        error = None
        for attempt in range(self.tries):
            try:
                request = urllib.request.Request(url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    response.read()
                self.sent += 1
                return True
            except (OSError, urllib.error.URLError) as caught:  # HTTPError too: a 5xx is tried again
                error = caught
            if attempt + 1 < self.tries and not self.closing:
                time.sleep(self.first_delay * 2 ** attempt)
        print(f"studio webhook {url}: not delivered after {self.tries} tries ({error})", file=sys.stderr, flush=True)
        return False

    def close(self, wait: float = 5.0) -> None:
        """Send what waits (for at most ``wait`` seconds), then stop the thread."""
        with self.ready:
            self.closing = True
            self.ready.notify()
        self.thread.join(timeout=wait)
