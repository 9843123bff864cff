"""Daemon settings: one source for defaults, TOML, environment and flags; unknown keys are errors."""

from __future__ import annotations

import pytest

from cbd.server.settings import load_settings


def test_precedence_defaults_toml_env_flags(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
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


def test_default_listen_address_follows_the_client_default(monkeypatch) -> None:  # type: ignore[no-untyped-def]
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
    ],
)
def test_bad_settings_are_errors(tmp_path, toml, match) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "cbd.toml"
    config.write_text(toml)
    with pytest.raises(ValueError, match=match):
        load_settings(["serve", "--config", str(config)])


def test_bad_flag_value_is_an_error() -> None:
    with pytest.raises(ValueError):
        load_settings(["serve", "--warmup", "maybe"])
