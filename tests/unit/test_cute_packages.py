"""Finding and importing the flash extra's packages: present, absent, broken; their caches under cbd's."""

from __future__ import annotations

import json
import os
import sys

from cbd.model import cute_packages

CACHE_VARIABLES = ("QUACK_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED")


def test_an_import_gives_the_name_or_a_one_line_reason(tmp_path, monkeypatch) -> None:
    for name in CACHE_VARIABLES:  # an import sets them: restored after the test
        monkeypatch.delenv(name, raising=False)
    assert cute_packages.present("json") and not cute_packages.present("no_such_package_here.sub")
    assert cute_packages.import_from("json", "dumps", "json") is json.dumps
    reason = cute_packages.import_from("no_such_package_here", "x", "some-dist")
    assert reason == "the some-dist package is not installed (pip install 'cbd[flash]')"
    (tmp_path / "broken_kernels_pkg.py").write_text("raise OSError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reason = cute_packages.import_from("broken_kernels_pkg", "x", "broken-kernels")
    assert reason == "broken-kernels failed to import: OSError: libcuda.so.1: cannot open shared object file"
    sys.modules.pop("broken_kernels_pkg", None)


def test_kernel_caches_go_under_cbds_cache_directory(tmp_path, monkeypatch) -> None:
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CBD_CACHE_DIR", str(tmp_path))
    cute_packages.set_cache_dirs()
    assert os.environ["QUACK_CACHE_DIR"] == str(tmp_path / "quack")
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "flash-attn-4")
