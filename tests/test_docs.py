"""The documentation: the generated flag reference is current, the README is
short and links only to pages that exist, every page is in the nav, and the
site builds with --strict (a broken link or anchor fails it)."""

import importlib.util
import os
import re
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _generator():
    path = os.path.join(ROOT, "scripts", "gen_config_reference.py")
    spec = importlib.util.spec_from_file_location("gen_config_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_flag_reference_is_generated_from_the_parsers():
    gen = _generator()
    with open(gen.PAGE) as f:
        committed = f.read()
    assert committed == gen.render(), (
        "docs/configuration/flags.md is stale: run .venv/bin/python scripts/gen_config_reference.py"
    )


def test_the_flag_reference_names_every_flag(monkeypatch):
    # The page is the parsers': a flag of `shoal serve` and an engine argument appear with their defaults.
    text = _generator().render()
    assert "| `--max-num-seqs` | `256` |" in text
    assert "| `--routing` | `kv` |" in text
    assert "## `shoal serve`" in text and "### `shoal bench offline`" in text
    # A default read from the shell (SHOAL_API_KEY) never reaches the page.
    monkeypatch.setenv("SHOAL_API_KEY", "secret-from-the-shell")
    assert "secret-from-the-shell" not in _generator().render()


def test_the_readme_is_short_and_links_to_pages_that_exist():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert text.count("\n") <= 200
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links to the docs"
    missing = [link for link in local if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        nav = _nav_pages(yaml.safe_load(f)["nav"])
    on_disk = {
        os.path.relpath(os.path.join(d, name), DOCS)
        for d, _, files in os.walk(DOCS)
        for name in files
        if name.endswith(".md")
    }
    assert sorted(set(nav)) == sorted(on_disk)
    assert len(nav) == len(set(nav))


def test_the_site_builds_strictly(tmp_path):
    mkdocs = os.path.join(os.path.dirname(sys.executable), "mkdocs")
    cmd = [mkdocs, "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.path.exists(tmp_path / "site" / "configuration" / "flags" / "index.html")
