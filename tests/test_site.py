"""The course as a site (``minillm.tools.site``): built from the notebooks and docs, opened in Chromium.

The build runs in strict mode (a broken link between pages fails it) and replaces only a folder that a
build wrote; the sidebar lists the chapters in order, one title style, then the docs in their stated
order; the check opens the home page and every chapter page in headless Chromium and finds nothing
wrong. The same check catches each classic defect planted in a copy of one page: an image with no
pixels, equations left as TeX (the page's MathJax removed), a broken internal link, a console error,
a code block cut off, a text table whose lines wrap, a table header squashed to one word per line.
"""

import json
import os
import re
import shutil

import pytest

from minillm.tools import site

pytestmark = [pytest.mark.host_only, pytest.mark.slow]  # the site's pages and a browser; no array code

if shutil.which("chromium") is None and not os.environ.get("MINILLM_REQUIRE_BROWSER"):  # .ci/run requires it
    pytest.skip("no chromium here: apt-get install chromium", allow_module_level=True)

PAGE = "notebooks/12_launch_floor/index.html"  # equations, figures, a text table, code
FIGURE = re.compile(r'(<img[^>]*src=")data:image/png;base64,[^"]+')  # a figure, inlined by nbconvert


def style(css):
    return lambda h: h.replace("</body>", f"<style>{css}</style></body>", 1)


TABLE = "<table><thead><tr><th>launches per decoded token</th></tr></thead><tbody><tr><td>9</td></tr></tbody></table>"


PLANTED = {  # name -> (edit of the page's HTML, what the check must say about that page)
    "figure": (lambda h: FIGURE.sub(r"\1data:image/png;base64,AAAA", h, count=1), "an image with no pixels"),
    "mathjax": (lambda h: h.replace(site.MATHJAX, "/mathjax/missing.js"), "not rendered"),
    "link": (lambda h: h.replace("</article>", '<a href="/docs/no-such-page/">x</a></article>', 1),
             "a broken internal link: docs/no-such-page/"),
    "console": (lambda h: h.replace("</body>", "<script>console.error('boom')</script></body>", 1),
                "console error: boom"),
    "clipped code": (style(".highlight-ipynb, .highlight-ipynb pre { overflow: hidden !important; }"),
                     "a code block cut off"),
    "wrapped text table": (style(".jp-OutputArea-output pre { white-space: pre-wrap !important; }"),
                           "a text block whose lines wrap"),
    "squashed header": (lambda h: style(".md-typeset table th { white-space: normal !important; width: 1px; }")(
                            h.replace("</article>", TABLE + "</article>", 1)), "a table header squashed"),
}


def linked_copy(src, dst):
    """A copy of a built site whose files are hard links (fast); edit a file only by replacing it."""
    return shutil.copytree(src, dst, copy_function=os.link)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The site, built over a folder that holds an earlier build's output (its marker lists what it wrote)."""
    out = tmp_path_factory.mktemp("site") / "site"
    out.mkdir()
    (out / "old.html").write_text("an earlier build's page")
    (out / site.MARKER).write_text(json.dumps({"files": ["old.html"]}))
    return site.build(out)


@pytest.fixture(scope="module")
def planted(built, tmp_path_factory):
    """Each defect of PLANTED in its own copy of PAGE (at the same depth, so its links resolve alike; its
    notebook copied beside the others, so the check knows it holds equations), all checked in one run ->
    ({name: the problems found on that copy}, the problems of no one page: broken links)."""
    tmp = tmp_path_factory.mktemp("planted")
    broken, root = linked_copy(built, tmp / "site"), tmp / "root"
    (root / "notebooks").mkdir(parents=True)
    source, html, pages = site.project_root() / "notebooks" / "12_launch_floor.ipynb", (built / PAGE).read_text(), {}
    for i, (name, (edit, _)) in enumerate(PLANTED.items()):
        pages[name] = f"notebooks/planted_{i}/index.html"
        (broken / pages[name]).parent.mkdir()
        (broken / pages[name]).write_text(edit(html))
        shutil.copy(source, root / "notebooks" / f"planted_{i}.ipynb")
    problems = site.check(broken, pages=list(pages.values()), root=root)
    on_pages = {name: [p for p in problems if p.startswith(page + ": ")] for name, page in pages.items()}
    return on_pages, [p for p in problems if not p.startswith("notebooks/planted_")]


def test_every_chapter_page_is_whole_in_chromium(built, tmp_path):
    pages = site.chapter_pages(built)
    assert len(pages) == 1 + len(list((site.project_root() / "notebooks").glob("*.ipynb")))
    assert site.check(built, screenshots=tmp_path) == []
    assert {p.name for p in tmp_path.iterdir()} == {name for name, _ in site.SHOTS.values()}
    assert (built / "mathjax" / "MathJax.js").is_file() and (built / "docs" / "serving" / "index.html").is_file()
    assert not (built / "old.html").exists()  # the earlier build's output is replaced


def test_the_sidebar_lists_the_chapters_in_order_then_the_docs_in_their_order(built):
    """The sidebar mixed "Chapter 1 —" and "02 ·" and listed the docs by file name: each chapter is "N · title"
    in order, then every doc, in DOCS_ORDER's order."""
    home = (built / "index.html").read_text()
    links = re.findall(r'<a href="((?:notebooks|docs)/[^/"]+)/" class="md-nav__link">\s*<span class="md-ellipsis">'
                       r'\s*([^<]+?)\s*<', home)
    seen = list(dict.fromkeys(links))  # the sidebar's links, in order, each once
    chapters = [title for path, title in seen if path.startswith("notebooks/")]
    numbers = [p.stem.split("_")[0].lstrip("0") for p in sorted((site.project_root() / "notebooks").glob("*.ipynb"))]
    assert [t.split(" · ")[0] for t in chapters] == numbers and numbers[:3] == ["1", "2", "3"]
    assert not any(t.split(" · ", 1)[1].startswith(("Chapter", "Appendix")) for t in chapters), chapters
    docs = [path.split("/")[1] for path, _ in seen if path.startswith("docs/")]
    on_disk = {p.stem for p in (site.project_root() / "docs").glob("*.md")}
    assert docs == [name for name in site.DOCS_ORDER if name in on_disk] and set(docs) == on_disk


@pytest.mark.parametrize("name", list(PLANTED))
def test_the_check_catches_a_planted_defect(planted, name):
    """The defect is reported (a broken link: once, for the whole site), and never on a copy without it."""
    on_pages, site_wide = planted
    expected = PLANTED[name][1]
    assert any(expected in p for p in on_pages[name] + site_wide), (name, on_pages[name], site_wide)
    others = [p for other, found in on_pages.items() if other != name for p in found if expected in p]
    assert others == [], f"{expected!r} reported on a page without that defect: {others}"


def test_build_refuses_to_overwrite_a_folder_it_did_not_build(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(site.SiteError, match="not a site this command built"):
        site.build(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_build_never_empties_a_folder_that_merely_looks_like_a_site(tmp_path):
    """`site build --out DIR` emptied any folder holding a sitemap.xml (precious.txt and sub/ deleted): a folder
    without the build's marker is refused, whatever it holds, and keeps every file."""
    (tmp_path / "sitemap.xml").write_text("<urlset/>")
    (tmp_path / "precious.txt").write_text("mine")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.md").write_text("mine too")
    with pytest.raises(site.SiteError, match="not a site this command built"):
        site.build(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "precious.txt", "sitemap.xml", "sub", "sub/notes.md"]


def test_build_refuses_a_site_it_built_once_something_else_is_in_it(built, tmp_path):
    """A site this command built, with a file of the user's added to it: replacing it would delete the file."""
    mine = linked_copy(built, tmp_path / "site")
    (mine / "docs" / "precious.txt").write_text("mine")
    with pytest.raises(site.SiteError, match=r"holds 1 files the site build did not write \(docs/precious.txt\)"):
        site.build(mine)
    assert (mine / "docs" / "precious.txt").read_text() == "mine"
