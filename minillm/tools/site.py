"""``python -m minillm site build|check|serve``: the course as a static site, checked in a real browser.

``build`` stages README.md (as the home page), docs/ and the notebooks (with their committed
outputs; nothing is executed) and builds them with MkDocs and mkdocs-jupyter into ``--out``
(default ``site/``), in strict mode: a broken link between pages fails the build. Equations render
with MathJax served from the site itself (the copy the ``jupyter-server-mathjax`` package ships),
so the site needs no network. The sidebar lists the chapters in order, each titled "N · title",
then the docs in the order of ``DOCS_ORDER``. Code and text outputs keep their lines (a long line
scrolls) and tables keep their columns (a wide table scrolls): ``SITE_CSS``. A build writes
``MARKER`` into the site, listing every file it wrote, and replaces an existing ``--out`` only if
it is empty or holds exactly such a site: anything else in it is refused, never deleted.

``check`` serves the built site on 127.0.0.1 and opens the home page and every chapter page in
headless Chromium (Debian's ``chromium``, driven by Playwright; nothing is downloaded). It fails on
a console error or a failed request, an image with no pixels, an equation left as TeX (or a MathJax
error), a code block or output cut off (wider than its box, with nothing to scroll it), a block of
text whose lines wrap (a text table's columns broken), a table header squashed (narrower than its
longest word, or one word per line), and an internal link that does not answer 200. ``serve``
serves a built site at http://127.0.0.1:8001 for reading.

Why MkDocs + mkdocs-jupyter: MkDocs is the standard static-site builder for Python projects'
Markdown docs, and mkdocs-jupyter renders .ipynb pages with nbconvert, outputs and figures
included, in the same navigation. Jupyter Book 2 builds with mystmd, which needs Node.js.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

from .project import project_root

SITE_REQUIREMENTS = "requirements-site.txt"
MATHJAX = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,local/minillm"
# That package ships MathJax 2.7 as one combined configuration with the STIX-Web web fonts only: use
# them. Its HTML-CSS output also declares a placeholder font at url('about:blank'), which Chromium
# refuses with a console error; a local() source that names no installed font is the same blank.
LOCAL_CONFIG = """MathJax.Hub.Config({
  "HTML-CSS": {availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null,
               styles: {"@font-face": {"font-family": "MathJax_Blank", src: "local('MathJax Blank None')"}}},
  TeX: {extensions: ["AMSmath.js", "AMSsymbols.js", "noErrors.js", "noUndefined.js"]}, showMathMenu: false
});
MathJax.Ajax.loadComplete("[MathJax]/config/local/minillm.js");
"""
SITE_CSS = """/* Code and text outputs keep their lines: a long line scrolls (mkdocs-jupyter wraps outputs). */
body .jupyter-wrapper .jp-OutputArea-output pre, body .md-typeset pre > code,
body .jupyter-wrapper .highlight-ipynb pre {
  white-space: pre; word-break: normal; overflow-wrap: normal; overflow-x: auto;
}
/* Tables keep their columns: a header stays on one line, and a table wider than the page scrolls. */
body .md-typeset table:not([class]) { max-width: 100%; overflow-x: auto; }
body .md-typeset table:not([class]) th { white-space: nowrap; }
/* Scrollbars that show (the theme's stay transparent until hovered). */
body .md-typeset pre > code, body .jupyter-wrapper .highlight-ipynb, body .jupyter-wrapper .jp-OutputArea-output pre,
body .md-typeset table:not([class]) {
  scrollbar-width: thin; scrollbar-color: var(--md-default-fg-color--light) transparent;
}
"""
MARKER = ".minillm-site.json"  # written by build into the site: the files it wrote
MAX_MARKER_BYTES = 16_000_000  # a larger marker is not one build wrote: refused before it is read
DOCS_ORDER = ("architecture", "attention", "kv_cache", "flash_attention", "speculative_decoding", "paged_attention",
              "batch_speculative", "real_model", "speculation_zoo", "medusa", "lookahead", "verify_cost", "serving",
              "eagle", "launch_floor", "quantization", "gpu", "training", "threads", "production", "instructors")
# the docs in the sidebar: the architecture, the measured pages in chapter order, running it, teaching it;
# a page not named here follows them, by file name
CHAPTER_PREFIX = re.compile(r"^(?:(?:Chapter|Appendix)\s+)?[A-Z]?\d+\s*[—·:.-]\s*")  # "Chapter 1 — ", "02 · "
CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
SHOTS = {"index.html": ("site_home.png", None),  # page -> (file, the heading to scroll to)
         "notebooks/08_a_real_model/index.html": ("site_chapter_08.png", "4. RMSNorm")}
SCROLL_JS = """heading => { const h = [...document.querySelectorAll('h2')].find(h => h.textContent.startsWith(heading));
                           if (h) { h.scrollIntoView(); } return !!h; }"""
MATH_SOURCE = re.compile(r"\$\$.+?\$\$|\$[^$\n]*\\[a-zA-Z]+[^$\n]*\$", re.DOTALL)

CHECK_PAGE_JS = r"""async () => {
  if (window.MathJax && MathJax.Hub) { await new Promise(done => MathJax.Hub.Queue(done)); }
  const blank = [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src);
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const raw = [];
  const tex = /\$\$|\\\(|\\\[|\$[^$\s][^$]*\\[a-zA-Z]+[^$]*\$/;
  while (walker.nextNode()) {
    const node = walker.currentNode;
    const skip = 'script, style, code, pre, textarea, .MathJax, .MathJax_Display, .MathJax_Preview';
    if (node.parentElement.closest(skip)) continue;
    if (tex.test(node.textContent)) raw.push(node.textContent.trim().slice(0, 80));
  }
  const snippet = e => e.textContent.trim().slice(0, 60);
  const rows = (el, range) => {  // the lines a box's text takes on screen
    const style = getComputedStyle(el), lh = parseFloat(style.lineHeight) || 1.2 * parseFloat(style.fontSize);
    const rects = [...range.getClientRects()].filter(r => r.width > 0);
    if (!rects.length) return 0;
    return Math.round((range.getBoundingClientRect().height - rects[0].height) / lh) + 1;
  };
  const clipped = [], wrapped = [], squashed = [];
  for (const el of document.querySelectorAll('pre, pre > code, .highlight-ipynb, .jp-OutputArea-output, table')) {
    if (el.scrollWidth <= el.clientWidth + 1) continue;  // it fits
    let box = el, overflow = getComputedStyle(el).overflowX;  // the box that decides what shows
    while (overflow === 'visible' && box.parentElement) {
      box = box.parentElement;
      overflow = getComputedStyle(box).overflowX;
    }
    if (overflow === 'hidden' || overflow === 'clip') clipped.push(snippet(el));
  }
  for (const el of document.querySelectorAll('pre')) {
    const range = document.createRange();
    range.selectNodeContents(el);
    if (rows(el, range) > el.textContent.replace(/\n$/, '').split('\n').length) wrapped.push(snippet(el));
  }
  for (const th of document.querySelectorAll('th')) {
    const words = th.textContent.trim().split(/\s+/).filter(Boolean), range = document.createRange();
    range.selectNodeContents(th);
    if (th.scrollWidth > th.clientWidth + 1 || (words.length > 1 && rows(th, range) >= words.length)) {
      squashed.push(snippet(th));
    }
  }
  return {blank, raw, clipped: [...new Set(clipped)], wrapped: [...new Set(wrapped)], squashed: [...new Set(squashed)],
          rendered: document.querySelectorAll('.MathJax, .MathJax_Display').length,
          mathErrors: document.querySelectorAll('.MathJax_Error, merror').length,
          links: [...document.querySelectorAll('a[href]')].map(a => a.href.split('#')[0])
                   .filter(h => h.startsWith(location.origin))};
}"""


class SiteError(RuntimeError):
    """The site could not be built or failed its check: one line that says what."""


def need(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise SiteError(f"the site needs {module}: pip install -r {SITE_REQUIREMENTS}") from None


# ---- build --------------------------------------------------------------------------------------------


def title_of(path: Path) -> str:
    """A page's title: its first '# ' heading (a notebook's first markdown cell's), else its name."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        text = next(("".join(c["source"]) for c in cells if c["cell_type"] == "markdown"), "")
    else:
        text = path.read_text()
    heading = next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), path.stem)
    return heading.replace("`", "")


def nav_title(path: Path) -> str:
    """The sidebar's title of a page: a notebook's is "N · title" whatever its heading's own prefix ("Chapter 1 —",
    "02 ·"); a doc's is its title without such a prefix. 01_gpt_from_arrays.ipynb -> "1 · A GPT from arrays"."""
    title = CHAPTER_PREFIX.sub("", title_of(path))
    return f"{path.stem.split('_')[0].lstrip('0')} · {title}" if path.suffix == ".ipynb" else title


def docs_in_order(docs: list[Path]) -> list[Path]:
    """The docs in the sidebar's order: those DOCS_ORDER names, in its order, then the others by file name."""
    rank = {name: i for i, name in enumerate(DOCS_ORDER)}
    return sorted(docs, key=lambda p: (rank.get(p.stem, len(rank)), p.name))


def stage(root: Path, staging: Path) -> dict:
    """Copy what the site shows into ``staging`` -> the MkDocs configuration for it."""
    mathjax = Path(need("jupyter_server_mathjax").__file__).parent / "static"
    shutil.copytree(root / "docs", staging / "docs")
    shutil.copytree(root / "notebooks", staging / "notebooks", ignore=shutil.ignore_patterns(".*", "__pycache__"))
    shutil.copytree(mathjax, staging / "mathjax")
    (staging / "mathjax" / "config" / "local").mkdir(exist_ok=True)
    (staging / "mathjax" / "config" / "local" / "minillm.js").write_text(LOCAL_CONFIG)
    (staging / "minillm.css").write_text(SITE_CSS)
    (staging / "index.md").write_text((root / "README.md").read_text())
    notebooks = sorted((staging / "notebooks").glob("*.ipynb"))  # 01..12, then the appendix A1
    docs = docs_in_order(list((staging / "docs").glob("*.md")))
    return {
        "site_name": "minillm",
        "site_description": "A small GPT in pure array code, one chapter per inference optimization",
        "docs_dir": str(staging),
        "use_directory_urls": True,
        "strict": True,
        "validation": {"links": {"not_found": "warn", "absolute_links": "warn", "unrecognized_links": "info"},
                       "omitted_files": "info"},
        "theme": {"name": "material", "font": False, "features": ["navigation.sections"]},
        "extra_javascript": [],
        "extra_css": ["minillm.css"],
        "markdown_extensions": ["tables", "toc", "admonition", "fenced_code"],
        "plugins": [{"search": {}}, {"mkdocs-jupyter": {"execute": False, "include_source": False, "cache": False,
                                                      "ignore_h1_titles": True,  # the nav's titles, not the h1s
                                                      "custom_mathjax_url": "/" + MATHJAX}}],
        "nav": [{"Home": "index.md"},
                {"Chapters": [{nav_title(p): f"notebooks/{p.name}"} for p in notebooks]},
                {"Docs": [{nav_title(p): f"docs/{p.name}"} for p in docs]}],
        "exclude_docs": "mathjax/\n",
    }


def tree(folder: Path) -> list[str]:
    """Every file, folder and link under ``folder`` (links not followed), as sorted relative paths."""
    found = []
    for top, dirs, files in os.walk(folder):
        found += [Path(top, name).relative_to(folder).as_posix() for name in dirs + files]
    return sorted(found)


def check_replaceable(out: Path) -> None:
    """Refuse (SiteError) unless ``out`` is missing, an empty folder, or a site that build wrote and nothing
    else: its MARKER lists every file in it. Only the listing is read from the marker; nothing is deleted by it."""
    if not out.exists():
        return
    if out.is_symlink() or not out.is_dir():
        raise SiteError(f"{out} is not a folder: refusing to replace it")
    present = tree(out)
    if not present:
        return
    marker = out / MARKER
    try:
        if marker.stat().st_size > MAX_MARKER_BYTES:
            raise ValueError("too large")
        written = set(json.loads(marker.read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise SiteError(f"{out} exists and is not a site this command built (no {MARKER} in it): refusing to "
                        "replace it") from None
    extra = [p for p in present if p not in written and p != MARKER]
    if extra:
        raise SiteError(f"{out} holds {len(extra)} files the site build did not write ({', '.join(extra[:3])}): "
                        "refusing to replace it")


def build(out: Path, root: Path | None = None) -> Path:
    """Build the site into ``out`` -> ``out``. Pass 1 refuses an ``out`` that is not empty and not a site this
    command built (``check_replaceable``); pass 2 builds beside it, writes MARKER, then swaps the new site in
    with two renames (the old site, if any, is removed only after that)."""
    need("mkdocs_jupyter")
    from mkdocs.commands.build import build as mkdocs_build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort, ConfigurationError

    root = Path(root or project_root())
    out = Path(out).resolve()
    check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    beside = tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.")  # same disk: a rename swaps
    with tempfile.TemporaryDirectory() as tmp, beside as new:
        staging, site_dir = Path(tmp) / "src", Path(new) / "site"
        config = stage(root, staging)
        config_file = Path(tmp) / "mkdocs.yml"
        config_file.write_text(json.dumps(config | {"site_dir": str(site_dir)}))  # YAML reads JSON
        try:
            cfg = load_config(config_file=str(config_file))
            mkdocs_build(cfg)
        except (Abort, ConfigurationError) as exc:
            raise SiteError(f"the site did not build: {exc}") from None
        shutil.copytree(staging / "mathjax", site_dir / "mathjax", dirs_exist_ok=True)  # excluded from pages
        (site_dir / MARKER).write_text(json.dumps({"written_by": "python -m minillm site build",
                                                   "files": tree(site_dir)}, indent=0))
        if out.exists():
            out.rename(Path(new) / "old")  # an empty folder or a site build wrote (checked above)
        site_dir.rename(out)
    return out


# ---- serve and check ------------------------------------------------------------------------------------


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a reader that hung up mid-file is not an error here
        pass


@contextlib.contextmanager
def serving(site: Path, port: int = 0):
    """The built site over HTTP on 127.0.0.1 -> its base URL."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = QuietServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def chromium_path() -> str:
    for name in CHROMIUM:
        if found := shutil.which(name):
            return found
    raise SiteError("no Chromium found: install Debian's chromium (apt-get install chromium)")


def chapter_pages(site: Path) -> list[str]:
    """The home page and one page per notebook, as paths relative to the site."""
    return ["index.html", *sorted(f"notebooks/{p.name}/index.html" for p in (site / "notebooks").iterdir()
                                  if (p / "index.html").is_file())]


def expected_math(root: Path, page: str) -> bool:
    """Does the page's source hold TeX (so MathJax must have rendered something)?"""
    if not page.startswith("notebooks/"):
        return False
    nb = json.loads((root / "notebooks" / f"{page.split('/')[1]}.ipynb").read_text())
    return any(MATH_SOURCE.search("".join(c["source"])) for c in nb["cells"] if c["cell_type"] == "markdown")


def open_page(browser, url: str):
    """A new tab with ``url`` loaded -> (the tab, the console errors, page errors and failed requests it saw)."""
    page, seen = browser.new_page(viewport={"width": 1440, "height": 1000}), []
    page.on("console", lambda m: seen.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: seen.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: seen.append(f"request failed: {r.url}"))
    page.goto(url, wait_until="load")
    return page, seen


def page_problems(page, page_path: str, seen: list, root: Path) -> tuple[list[str], set]:
    """Look at a loaded tab -> (its problems, the internal links it holds)."""
    found = page.evaluate(CHECK_PAGE_JS)
    problems = [*seen,
                *[f"an image with no pixels: {src}" for src in found["blank"]],
                *[f"an equation left as TeX: {text!r}" for text in found["raw"]],
                *[f"a code block cut off (wider than its box, and nothing scrolls it): {text!r}"
                  for text in found["clipped"]],
                *[f"a text block whose lines wrap (a text table's columns break): {text!r}"
                  for text in found["wrapped"]],
                *[f"a table header squashed (narrower than its longest word, or one word per line): {text!r}"
                  for text in found["squashed"]]]
    if found["mathErrors"]:
        problems.append(f"{found['mathErrors']} MathJax errors")
    if expected_math(root, page_path) and not found["rendered"]:
        problems.append("its equations were not rendered (MathJax did not run)")
    return [f"{page_path}: {p}" for p in problems], set(found["links"])


def check(site: Path, screenshots: Path | None = None, root: Path | None = None, pages=None) -> list[str]:
    """Open every chapter page (or ``pages``) in headless Chromium -> the problems found (none: all fine)."""
    need("playwright")
    from playwright.sync_api import sync_playwright

    root, site = Path(root or project_root()), Path(site)
    if not (site / "index.html").is_file():
        raise SiteError(f"{site} holds no built site: run python -m minillm site build first")
    problems, links = [], set()
    with serving(site) as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        for page_path in pages or chapter_pages(site):
            page, seen = open_page(browser, base + page_path)
            found, page_links = page_problems(page, page_path, seen, root)
            problems += found
            links |= page_links
            if screenshots is not None and page_path in SHOTS:
                screenshots.mkdir(parents=True, exist_ok=True)
                name, heading = SHOTS[page_path]
                if heading is not None and not page.evaluate(SCROLL_JS, heading):
                    problems.append(f"{page_path}: no heading {heading!r} to show in the screenshot")
                page.screenshot(path=str(screenshots / name))
            page.close()
        browser.close()
        for link in sorted(links):
            try:
                with urllib.request.urlopen(link, timeout=10) as r:
                    ok = r.status == 200
            except urllib.error.URLError:
                ok = False
            if not ok:
                problems.append(f"a broken internal link: {link.removeprefix(base)}")
    return problems


# ---- the command -------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["build", "check", "serve"], help="build the site, check it in Chromium, or "
                   "serve it for reading")
    p.add_argument("--out", default="site", help="the site's folder (default site/)")
    p.add_argument("--screenshots", metavar="DIR", help="check: also save two pages' screenshots in DIR")


def main(args) -> int:
    out = Path(args.out)
    try:
        if args.action == "build":
            print(f"site built: {build(out)} (open it with python -m minillm site serve)")
            return 0
        if args.action == "serve":
            if not (out / "index.html").is_file():
                raise SiteError(f"{out} holds no built site: run python -m minillm site build first")
            with serving(out, 8001) as url:
                print(f"the course at {url} (Ctrl-C stops)", flush=True)
                threading.Event().wait()
        problems = check(out, Path(args.screenshots) if args.screenshots else None)
    except SiteError as exc:
        raise ValueError(str(exc)) from None
    for line in problems:
        print(line)
    pages = len(chapter_pages(out))
    print(f"{pages} pages checked in Chromium: " + ("no problems" if not problems else f"{len(problems)} problems"))
    return 0 if not problems else 1
