"""Render every page of a built site in headless Chromium and fail on any problem.

The site folder is served over HTTP on 127.0.0.1; every HTML page in it, and every
same-site page a link points at, is loaded in Chromium (driven by Playwright, using the
system's Chromium: no browser is downloaded). It fails (exit status 1, each problem listed
with its page) on:

- a console error or an uncaught exception;
- a failed request for a same-site resource (4xx / 5xx status, or a network failure);
- any request to another host: the site must work offline, so it must make none
  (links to other hosts are fine: they are not followed, only counted);
- a broken same-site link or anchor: an ``href`` to a page or file that does not exist,
  or a ``#fragment`` with no matching ``id`` on the target page (ids are read after the
  page's scripts ran).

Usage, from the repository root (``nox -s docs-check`` builds the site and runs this)::

    python tools/check_site.py build/site
    CHROMIUM=/path/to/chromium python tools/check_site.py build/site

Needs ``playwright`` (the Python package only: ``playwright install`` is not needed) and
Chromium (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urldefrag, urlsplit

DEFAULT_CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Collected from each page once its scripts ran: links, resources it references, and ids.
COLLECT_JS = """() => ({
  links: Array.from(document.querySelectorAll("a[href], area[href]"), (a) => a.href),
  resources: Array.from(
    document.querySelectorAll(
      "img[src], script[src], iframe[src], source[src], video[src], audio[src], " +
      "link[href]:not([rel~=canonical]):not([rel~=alternate])"
    ),
    (e) => e.src || e.href
  ),
  ids: Array.from(document.querySelectorAll("[id]"), (e) => e.id).concat(
    Array.from(document.querySelectorAll("a[name]"), (e) => e.name)
  ),
})"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(root: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve ``root`` on a free port of 127.0.0.1 from a daemon thread; returns the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    return server, f"http://{host}:{port}/"


@dataclass
class Report:
    base: str
    root: Path
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    external_links: set[str] = field(default_factory=set)
    links_checked: int = 0
    anchors_checked: int = 0

    def add(self, page: str, problem: str) -> None:
        if problem not in self.problems[page]:
            self.problems[page].append(problem)

    def same_site(self, url: str) -> bool:
        return url.startswith(self.base)

    def rel(self, url: str) -> str:
        return "/" + url.removeprefix(self.base) if self.same_site(url) else url


def page_key(url: str) -> str:
    """The URL without fragment or query; a folder URL means its index.html."""
    url = urldefrag(url).url.split("?", 1)[0]
    return url + "index.html" if url.endswith("/") else url


def _local_file(report: Report, url: str) -> Path | None:
    """The file a same-site URL is served from, or None when there is none."""
    path = unquote(urlsplit(page_key(url)).path).lstrip("/")
    target = (report.root / path).resolve()
    if target.is_dir():
        target = target / "index.html"
    if not target.is_relative_to(report.root) or not target.is_file():
        return None
    return target


def _is_html(url: str) -> bool:
    return page_key(url).endswith((".html", ".htm"))


def render_all(report: Report, chromium: str, timeout_s: float) -> int:
    """Render every page; record problems in ``report``; returns the number of pages."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    on_disk = sorted(report.root.rglob("*.html"))
    queue = [report.base + quote(p.relative_to(report.root).as_posix()) for p in on_disk]
    seen = set(queue)
    ids: dict[str, set[str]] = {}  # page key -> ids on it
    links: list[tuple[str, str]] = []  # (from page, absolute href)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        context = browser.new_context()
        context.set_default_timeout(timeout_s * 1000)
        try:
            while queue:
                url = queue.pop(0)
                key = report.rel(url)
                page = context.new_page()
                watch = Watch(report, key)
                watch.attach(page)
                try:
                    response = page.goto(url, wait_until="load")
                    page.wait_for_load_state("networkidle")
                    ok = response is not None and response.status < 400  # else: reported
                    found = page.evaluate(COLLECT_JS) if ok else None
                except PlaywrightError as exc:
                    report.add(key, f"could not render the page: {str(exc).splitlines()[0]}")
                    found = None
                finally:
                    page.close()
                watch.flush()
                ids[page_key(url)] = set(found["ids"]) if found else set()
                if not found:
                    continue
                for href in found["links"]:
                    links.append((key, href))
                    target = page_key(href)
                    if report.same_site(href) and _is_html(href) and target not in seen:
                        seen.add(target)
                        if _local_file(report, href) is not None:  # else: a broken link
                            queue.append(target)
                for src in found["resources"]:  # also those not loaded (lazy images, ...)
                    if src in watch.bad_urls:
                        continue  # its request is reported already
                    if src.startswith(("http:", "https:")) and not report.same_site(src):
                        report.add(key, f"references a resource on another host: {src}")
                    elif report.same_site(src) and _local_file(report, src) is None:
                        report.add(key, f"references a missing resource: {report.rel(src)}")
        finally:
            context.close()
            browser.close()

    for page_url, href in links:
        if urlsplit(href).scheme not in ("http", "https"):
            continue  # mailto:, javascript:, data:, ...
        if not report.same_site(href):
            report.external_links.add(href)
            continue
        report.links_checked += 1
        if _local_file(report, href) is None:
            report.add(page_url, f"broken link: {report.rel(href)} does not exist")
            continue
        fragment = unquote(urldefrag(href).fragment)
        if not fragment or not _is_html(href):
            continue
        report.anchors_checked += 1
        if fragment not in ids.get(page_key(href), set()):
            report.add(page_url, f"broken anchor: {report.rel(href)} (no id {fragment!r} there)")
    return len(ids)


class Watch:
    """The events of one page while it loads; every problem goes into the report."""

    def __init__(self, report: Report, key: str) -> None:
        self.report = report
        self.key = key
        self.own_url = report.base + key.lstrip("/")
        self.bad_urls: set[str] = set()  # requests reported: blocked, failed, 4xx / 5xx
        self.console: list[tuple[str, str, str]] = []  # (type, text, url of its source)

    def attach(self, page: Any) -> None:
        page.route("**/*", self.on_route)
        page.on("console", self.on_console)
        page.on("pageerror", self.on_page_error)
        page.on("requestfailed", self.on_request_failed)
        page.on("response", self.on_response)

    def on_route(self, route: Any) -> None:
        url = route.request.url
        if self.report.same_site(url) or not url.startswith(("http:", "https:", "ws:", "wss:")):
            route.continue_()
            return
        self.bad_urls.add(url)
        self.report.add(self.key, f"request to another host (blocked): {url}")
        route.abort("blockedbyclient")

    def on_console(self, msg: Any) -> None:
        if msg.type in ("error", "assert"):
            self.console.append((msg.type, msg.text, msg.location.get("url", "")))

    def on_page_error(self, exc: Any) -> None:
        self.report.add(self.key, f"uncaught exception: {exc}")

    def on_request_failed(self, request: Any) -> None:
        if request.url not in self.bad_urls:
            self.bad_urls.add(request.url)
            where = self.report.rel(request.url)
            self.report.add(self.key, f"request failed: {where} ({request.failure})")

    def on_response(self, response: Any) -> None:
        if response.status >= 400 and self.report.same_site(response.url):
            self.bad_urls.add(response.url)
            where = self.report.rel(response.url)
            self.report.add(self.key, f"HTTP {response.status}: {where}")

    def flush(self) -> None:
        """Report the console errors, but not the browser's own note on a request that
        is reported already."""
        for kind, text, where in self.console:
            if where in self.bad_urls and text.startswith("Failed to load resource"):
                continue
            suffix = f" (at {self.report.rel(where)})" if where and where != self.own_url else ""
            self.report.add(self.key, f"console {kind}: {text}{suffix}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built site folder (mkdocs --site-dir)")
    parser.add_argument(
        "--chromium",
        default=os.environ.get("CHROMIUM", DEFAULT_CHROMIUM),
        help=f"Chromium executable (default: $CHROMIUM, else {DEFAULT_CHROMIUM})",
    )
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds per page (default: 30)"
    )
    args = parser.parse_args(argv)

    root = args.site.resolve()
    if not (root / "index.html").is_file():
        parser.error(f"{args.site} has no index.html: build the site first (nox -s docs)")
    if not Path(args.chromium).is_file():
        parser.error(
            f"no Chromium at {args.chromium}: install it (apt-get install chromium) "
            "or set CHROMIUM to its path"
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        parser.error("the playwright package is missing: pip install playwright")

    server, base = serve(root)
    try:
        report = Report(base=base, root=root)
        pages = render_all(report, args.chromium, args.timeout)
    finally:
        server.shutdown()

    for page in sorted(report.problems):
        print(f"{page}:")
        for problem in report.problems[page]:
            print(f"  - {problem}")
    hosts = sorted({urlsplit(u).netloc for u in report.external_links})
    print(
        f"{pages} pages rendered, {report.links_checked} same-site links and "
        f"{report.anchors_checked} anchors checked; {len(report.external_links)} links to "
        f"other hosts skipped ({', '.join(hosts) or 'none'})"
    )
    count = sum(len(v) for v in report.problems.values())
    if count:
        print(f"FAILED: {count} problem(s) on {len(report.problems)} page(s)")
        return 1
    print("OK: no console errors, failed requests, external requests or broken links")
    return 0


if __name__ == "__main__":
    sys.exit(main())
