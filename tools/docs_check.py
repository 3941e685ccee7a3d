"""The built docs site looked at as a user sees it: every page in headless Chromium.

``make docs-check`` runs it on ``site/`` after ``make docs``. Each page is served
on localhost and opened in Chromium (Playwright driving the system's browser);
a page fails on any of:

* an uncaught script error, or an error the page logs to the console;
* a request that fails or answers 400 or more (a missing image, stylesheet, script);
* a request to any other host (the site must work offline: no web fonts, no CDN);
* an image that did not decode (``naturalWidth`` 0);
* Markdown that did not render (a code fence, a snippet or an API directive left
  as text) or a page without its title heading.

The site's search is used once, as a reader would: a query typed into the
search box must list results.

Before the site, the same checks run on a small page broken in each of these
ways (the canary); if any break goes unreported, the check itself is broken and
fails. Needs Chromium (Debian's ``chromium``, or ``CPJAX_CHROMIUM`` naming a
binary) and the ``playwright`` package (the ``docs`` extra).

Usage: ``python tools/docs_check.py [SITE_DIR] [--screenshots DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import shutil
import sys
import tempfile
import threading
import typing
from urllib.parse import urlsplit

# Chromium on a closed network: without the background-networking flags it
# tries Google's hosts at every start and logs each refusal.
CHROMIUM_ARGS = (
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
)
# Text that means Markdown reached the reader unrendered: a code fence, a
# pymdownx snippet, a mkdocstrings directive.
UNRENDERED = ("```", "--8<--", "\n::: ")
SEARCH_QUERY = "ring attention"

# Images that did not decode; the article's text and whether it has a title.
_BROKEN_IMAGES = """Array.from(document.images)
  .filter(i => !i.complete || i.naturalWidth === 0).map(i => i.getAttribute('src'))"""
_CONTENT = """(() => {
  const a = document.querySelector('article') || document.body;
  return [a.innerText, !!a.querySelector('h1')];
})()"""


def chromium() -> str:
  """The Chromium binary: ``$CPJAX_CHROMIUM``, else ``chromium`` on the PATH."""
  path = (
    os.environ.get("CPJAX_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
  )
  if not path:
    raise SystemExit(
      "docs_check: no Chromium found: install Debian's `chromium` package "
      "(apt-get install chromium) or set CPJAX_CHROMIUM to a Chromium binary"
    )
  return path


@contextlib.contextmanager
def serve(root: str) -> typing.Iterator[str]:
  """Serve ``root`` on a free localhost port for the duration; yields its base URL."""

  class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the check reports what matters itself
      pass

  server = http.server.ThreadingHTTPServer(
    ("127.0.0.1", 0), functools.partial(Quiet, directory=root)
  )
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}/"
  finally:
    server.shutdown()
    server.server_close()


def pages(root: str) -> list[str]:
  """Every HTML page under ``root``, as paths relative to it, sorted."""
  found = []
  for folder, _, names in os.walk(root):
    found += [os.path.relpath(os.path.join(folder, n), root) for n in names if n.endswith(".html")]
  return sorted(p.replace(os.sep, "/") for p in found)


def check_pages(
  browser, base: str, paths: list[str], screenshots: str | None = None
) -> dict[str, list[str]]:
  """Open each page of ``paths`` under ``base``; returns the problems found, by page."""
  host = urlsplit(base).netloc
  problems: dict[str, list[str]] = {}
  context = browser.new_context()

  def offsite(route):
    # Record and refuse: the site must not need another host to render.
    problems.setdefault(current[0], []).append(f"request to another host: {route.request.url}")
    route.abort()

  context.route(lambda url: urlsplit(url).netloc not in (host, ""), offsite)
  page = context.new_page()
  current = [""]

  def report(message):
    problems.setdefault(current[0], []).append(message)

  page.on("pageerror", lambda error: report(f"script error: {error}"))
  page.on("console", lambda m: m.type == "error" and report(f"console error: {m.text}"))
  page.on(
    "requestfailed",
    lambda r: urlsplit(r.url).netloc == host and report(f"request failed: {r.url} ({r.failure})"),
  )
  page.on("response", lambda r: r.status >= 400 and report(f"HTTP {r.status}: {r.url}"))
  for path in paths:
    current[0] = path
    page.goto(base + path, wait_until="networkidle")
    for src in page.evaluate(_BROKEN_IMAGES):
      report(f"image did not render: {src}")
    text, has_title = page.evaluate(_CONTENT)
    for mark in UNRENDERED:
      if mark in text:
        report(f"unrendered Markdown ({mark.strip()!r}) in the page's text")
    if not has_title:
      report("no title heading (h1) in the page")
    if screenshots:
      name = path.replace("/", "__").removesuffix(".html") + ".png"
      page.screenshot(path=os.path.join(screenshots, name), full_page=True)
  context.close()
  return problems


def check_search(browser, base: str) -> list[str]:
  """Type a query into the site's search box; the problems if no result is listed."""
  page = browser.new_page()
  try:
    page.goto(base + "index.html", wait_until="networkidle")
    # Key by key, as a reader types: the theme searches on each key.
    page.click("input.md-search__input")
    page.locator("input.md-search__input").press_sequentially(SEARCH_QUERY, delay=20)
    page.wait_for_selector(".md-search-result__item", timeout=15_000)
    return []
  except Exception as error:  # a timeout is the finding: the search lists nothing
    return [f"search for {SEARCH_QUERY!r} listed no result ({type(error).__name__})"]
  finally:
    page.close()


CANARY = """<!doctype html><html><head><title>canary</title></head><body><article>
<p>No title heading, a raw fence:</p><pre>```python</pre>
<img src="missing.png"><script>throw new Error("canary");</script>
</article></body></html>"""
# What the canary page must produce, one problem each.
CANARY_FINDINGS = (
  "script error",
  "HTTP 404",
  "image did not render",
  "unrendered Markdown",
  "no title heading",
)


def check_canary(browser) -> list[str]:
  """The checks on a page broken in each way; the breaks they missed."""
  with tempfile.TemporaryDirectory() as root:
    with open(os.path.join(root, "canary.html"), "w") as f:
      f.write(CANARY)
    with serve(root) as base:
      found = check_pages(browser, base, ["canary.html"]).get("canary.html", [])
  return [kind for kind in CANARY_FINDINGS if not any(p.startswith(kind) for p in found)]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "site", nargs="?", default="site", help="the built site (make docs writes site/)"
  )
  parser.add_argument("--screenshots", help="write a full-page PNG of every page into this folder")
  args = parser.parse_args(argv)
  if not os.path.isfile(os.path.join(args.site, "index.html")):
    raise SystemExit(f"docs_check: no index.html in {args.site!r}; run `make docs` first")
  from playwright.sync_api import sync_playwright

  if args.screenshots:
    os.makedirs(args.screenshots, exist_ok=True)
  with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=chromium(), args=list(CHROMIUM_ARGS))
    missed = check_canary(browser)
    if missed:
      print(f"docs_check: the check itself is broken: the canary page's {missed} went unreported")
      return 1
    paths = pages(args.site)
    with serve(args.site) as base:
      problems = check_pages(browser, base, paths, args.screenshots)
      if search := check_search(browser, base):
        problems["index.html (search)"] = search
    browser.close()
  for path, found in sorted(problems.items()):
    print(f"{path}:")
    for problem in found:
      print(f"  {problem}")
  print(f"docs_check: {len(paths)} pages in Chromium, {len(problems)} with problems")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
