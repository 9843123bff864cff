"""Daemon settings: one source for defaults, TOML, environment and flags; unknown keys are errors."""

from __future__ import annotations

import pytest
import torch

from cbd.server.settings import load_settings


def test_precedence_defaults_toml_env_flags(tmp_path, monkeypatch) -> None:
    config = tmp_path / "cbd.toml"
    config.write_text('[engine]\nblock_size = 32\nmax_num_seqs = 8\n[server]\nlisten = "unix:/tmp/a.sock"\n')
    monkeypatch.setenv("CBD_MAX_NUM_SEQS", "16")
    monkeypatch.setenv("CBD_ENABLE_PREFIX_CACHING", "false")
    engine, server = load_settings(["serve", "--config", str(config), "--max-num-seqs", "4", "--num-kv-blocks", "64"])
    assert engine.block_size == 32  # TOML over the default
    assert engine.max_num_seqs == 4  # flag over env over TOML
    assert engine.enable_prefix_caching is False  # env
    assert engine.num_kv_blocks == 64
    assert engine.kv_cache_gib == 0.5  # untouched default
    assert server.addresses() == ["unix:/tmp/a.sock"]


def test_default_listen_address_follows_the_client_default(monkeypatch) -> None:
    monkeypatch.delenv("CBD_LISTEN", raising=False)
    monkeypatch.setenv("CBD_ADDRESS", "unix:/tmp/x.sock")
    assert load_settings(["serve"])[1].addresses() == ["unix:/tmp/x.sock"]


@pytest.mark.parametrize(
    "toml, match",
    [
        ("[engine]\nblock_sise = 8\n", "unknown engine config keys: \\['block_sise'\\]"),
        ("[servr]\n", "unknown tables"),
        ("[engine]\nblock_size = 12\n", "power of two"),
        ("[server]\nlog_level = 'LOUD'\n", "log_level"),
        ("[server]\nmetrics_max_connections = 0\n", "metrics_max_connections must be >= 1"),
        ("[server]\nmetrics_auth_token_file = '/x'\n", "metrics_auth_token_file needs metrics_port"),
        ("[engine]\nblas_library = 'mkl'\n", "blas_library must be 'auto', 'cublas' or 'cublaslt'"),
        ("[server]\nlisten = '127.0.0.1:99999'\n", "listen: '127.0.0.1:99999' is not unix:/path or host:port"),
        ("[server]\nlisten = 'unix:/tmp/a.sock,localhost'\n", "listen: 'localhost' is not"),
        ("[server]\nlisten = 'unix:'\n", "listen: a unix address needs a path"),
    ],
)
def test_bad_settings_are_errors(tmp_path, toml, match) -> None:
    config = tmp_path / "cbd.toml"
    config.write_text(toml)
    with pytest.raises(ValueError, match=match):
        load_settings(["serve", "--config", str(config)])


def test_bad_flag_value_is_an_error() -> None:
    with pytest.raises(ValueError):
        load_settings(["serve", "--warmup", "maybe"])


def test_blas_library_flag(monkeypatch) -> None:
    """--blas-library picks torch's BLAS front end on CUDA; "auto" is cuBLASLt; on the CPU nothing is set."""
    from cbd.model import blas

    monkeypatch.delenv("CBD_BLAS_LIBRARY", raising=False)
    assert load_settings(["serve"])[0].blas_library == "auto"
    assert load_settings(["serve", "--blas-library", "cublas"])[0].blas_library == "cublas"
    assert blas.resolve("auto") == "cublaslt" and blas.resolve("cublas") == "cublas"
    with pytest.raises(ValueError, match="blas_library"):
        blas.resolve("rocblas")
    chosen: list[str] = []
    monkeypatch.setattr("torch.backends.cuda.preferred_blas_library", chosen.append)
    blas.select("auto", torch.device("cpu"))
    assert chosen == []
    blas.select("auto", torch.device("cuda", 0))
    blas.select("cublas", torch.device("cuda", 0))
    assert chosen == ["cublaslt", "cublas"]


def test_setting_sources_name_the_file_variable_or_flag_of_each_setting(tmp_path, monkeypatch) -> None:
    import os

    from cbd.server.settings import setting_sources

    for name in [n for n in os.environ if n.startswith("CBD_")]:  # e.g. CI's CBD_CACHE_DIR: only ours here
        monkeypatch.delenv(name)
    config = tmp_path / "cbd.toml"
    config.write_text("[engine]\nmax_num_seqs = 9\nblock_size = 32\n[server]\nshutdown_grace = 3.0\n")
    monkeypatch.setenv("CBD_CONFIG", str(config))
    monkeypatch.setenv("CBD_BLOCK_SIZE", "8")  # the environment wins over the file
    lines = setting_sources(["serve", "--shutdown-grace", "5"])  # and a flag over both
    assert lines[0] == f"config file: {config}"
    assert f"engine.max_num_seqs = 9  (file {config})" in lines
    assert "engine.block_size = 8  (env CBD_BLOCK_SIZE)" in lines
    assert "server.shutdown_grace = 5.0  (flag --shutdown-grace)" in lines
    assert len(lines) == 4
