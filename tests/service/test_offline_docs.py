"""``/docs`` and ``/redoc`` work without the internet: their pages name no other host, and the
scripts and styles they load are served by the service itself (from the fastapi-offline
package)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.api import create_app
from service.settings import Settings

#: a reference to another host: a scheme, or a protocol-relative "//host"
EXTERNAL = re.compile(r"(?:[a-z][a-z0-9+.-]*:)?//[^\s'\"<>]+", re.IGNORECASE)
LOADED = re.compile(r"""(?:src|href|spec-url)=["']([^"']+)["']|url: *'([^']+)'""")


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path_factory.mktemp("docs"), database_url=None)
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_name_no_other_host_and_their_assets_load(client, page):
    r = client.get(page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = re.sub(r"<!--.*?-->", "", r.text, flags=re.DOTALL)
    assert EXTERNAL.findall(html) == []
    loaded = [a or b for a, b in LOADED.findall(html)]
    assert "/openapi.json" in loaded and any(u.endswith(".js") for u in loaded)
    for url in loaded:
        assert url.startswith("/"), url
        asset = client.get(url)
        assert asset.status_code == 200 and len(asset.content) > 0, url
    scripts = [u for u in loaded if u.endswith(".js")]
    assert all(len(client.get(u).content) > 100_000 for u in scripts)  # the bundles themselves
