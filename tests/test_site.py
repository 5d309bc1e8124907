"""The course as a site (``minillm.tools.site``): built from the notebooks and docs, opened in Chromium.

The build runs in strict mode (a broken link between pages fails it); the check opens the home page
and every chapter page in headless Chromium and finds nothing wrong. The same check catches each
classic defect planted in a copy of one page: an image with no pixels, equations left as TeX (the
page's MathJax removed), a broken internal link, a console error.
"""

import os
import re
import shutil

import pytest

from minillm.tools import site

pytestmark = pytest.mark.host_only  # the site's pages and a browser; no array code

if shutil.which("chromium") is None and not os.environ.get("MINILLM_REQUIRE_BROWSER"):  # .ci/run requires it
    pytest.skip("no chromium here: apt-get install chromium", allow_module_level=True)

PAGE = "notebooks/08_a_real_model/index.html"  # equations and figures
FIGURE = re.compile(r'(<img[^>]*src=")data:image/png;base64,[^"]+')  # a figure, inlined by nbconvert


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return site.build(tmp_path_factory.mktemp("site") / "site")


def test_every_chapter_page_is_whole_in_chromium(built, tmp_path):
    pages = site.chapter_pages(built)
    assert len(pages) == 1 + len(list((site.project_root() / "notebooks").glob("*.ipynb")))
    assert site.check(built, screenshots=tmp_path) == []
    assert {p.name for p in tmp_path.iterdir()} == {name for name, _ in site.SHOTS.values()}
    assert (built / "mathjax" / "MathJax.js").is_file() and (built / "docs" / "serving" / "index.html").is_file()


def planted(built, tmp_path, edit):
    broken = shutil.copytree(built, tmp_path / "broken")
    page = broken / PAGE
    html = page.read_text()
    page.write_text(edit(html))
    return site.check(broken, pages=[PAGE])


@pytest.mark.parametrize("name, edit, expected", [
    ("a figure with no pixels", lambda h: FIGURE.sub(r"\1data:image/png;base64,AAAA", h, count=1),
     "an image with no pixels"),
    ("MathJax removed", lambda h: h.replace(site.MATHJAX, "/mathjax/missing.js"), "not rendered"),
    ("a broken link", lambda h: h.replace("</article>", '<a href="/docs/no-such-page/">x</a></article>', 1),
     "a broken internal link: docs/no-such-page/"),
    ("a console error", lambda h: h.replace("</body>", "<script>console.error('boom')</script></body>", 1),
     "console error: boom"),
])
def test_the_check_catches_a_planted_defect(built, tmp_path, name, edit, expected):
    problems = planted(built, tmp_path, edit)
    assert any(expected in p for p in problems), (name, problems)


def test_build_refuses_to_overwrite_a_folder_it_did_not_build(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(site.SiteError, match="refusing to overwrite"):
        site.build(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
