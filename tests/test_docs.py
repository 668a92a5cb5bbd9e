"""The documentation site builds in strict mode, and the API page documents every public name."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_sparse

ROOT = Path(__file__).resolve().parent.parent


def test_every_public_name_is_in_the_api_reference():
    api = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: lightning_sparse\.(\w+)", api, flags=re.M))
    missing = set(lightning_sparse.__all__) - documented
    assert not missing, f"add these to docs/api.md: {sorted(missing)}"


@pytest.mark.subprocesses
@pytest.mark.timeout(300)
def test_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    run = subprocess.run([mkdocs, "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=280, check=False)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    page = (tmp_path / "site" / "guide" / "collections" / "index.html").read_text()
    assert "JaggedIds" in page  # the guide page, with its example
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "SparseEmbeddingCollection" in api and "duplicate_grads" in api
