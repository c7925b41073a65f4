"""The PD transfer settings: one options type from the flags to the transport, refused on
a unified server, and one owner of Mooncake's process-wide environment."""

from __future__ import annotations

import os

import pytest

from kvflow.contract import BOOTSTRAP_TIMEOUT_ENV
from kvflow.runtime.disagg.transport import KVTransferOptions
from kvflow.runtime.server.args import parse_args
from kvflow.runtime.utils import mooncake_env


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch):
    for key in [k for k in os.environ if k.startswith("MC_")]:
        monkeypatch.delenv(key)
    mooncake_env.reset_for_tests()
    yield monkeypatch
    mooncake_env.reset_for_tests()


def test_flags_reach_the_options() -> None:
    args = parse_args(
        [
            "--role",
            "prefill",
            "--bootstrap-port",
            "9001",
            "--disagg-timeout",
            "7.5",
            "--kv-transfer-protocol",
            "tcp",
            "--disaggregation-transfer-backend",
            "mooncake",
        ]
    )
    assert args.kv_transfer == KVTransferOptions(
        backend="mooncake",
        protocol="tcp",
        timeout_s=7.5,
        bootstrap_host="127.0.0.1",
        bootstrap_port=9001,
    )
    decode = ["--role", "decode", "--disaggregation-trusted-prefills", "127.0.0.1:1"]
    assert parse_args(decode).kv_transfer == KVTransferOptions(
        bootstrap_port=parse_args(["--role", "prefill"]).kv_transfer.bootstrap_port
    )
    assert parse_args([]).kv_transfer is None


def test_the_bootstrap_timeout_is_sglangs_environment_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    prefill = ["--role", "prefill"]
    monkeypatch.delenv(BOOTSTRAP_TIMEOUT_ENV, raising=False)
    assert parse_args(prefill).kv_transfer.bootstrap_timeout_s == 300.0  # SGLang's default
    monkeypatch.setenv(BOOTSTRAP_TIMEOUT_ENV, "45")
    assert parse_args(prefill).kv_transfer.bootstrap_timeout_s == 45.0
    for bad in ("0", "-3", "soon"):
        monkeypatch.setenv(BOOTSTRAP_TIMEOUT_ENV, bad)
        with pytest.raises(SystemExit):
            parse_args(prefill)
        assert f"${BOOTSTRAP_TIMEOUT_ENV} must be seconds > 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--disagg-timeout", "3"],
        ["--kv-transfer-protocol", "tcp"],
        ["--disaggregation-transfer-backend", "mooncake"],
    ],
)
def test_pd_flags_refused_on_a_unified_server(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert f"{argv[0]}: prefill/decode settings" in capsys.readouterr().err


def test_protocol_stays_with_a_mooncake_store() -> None:
    argv = ["--kv-transfer-protocol", "tcp", "--hicache-host-memory-gb", "1"]
    argv += ["--hicache-storage", "mooncake", "--hicache-storage-path", "127.0.0.1:50051"]
    assert parse_args(argv).kv_transfer is None


def test_the_transport_gets_the_deadline(clean_env: pytest.MonkeyPatch) -> None:
    options = KVTransferOptions(timeout_s=2.5)
    options.require_env()
    with options.transport() as transport:
        assert transport.timeout_s == 2.5
    assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "3"


def test_store_first_then_transport_both_apply(clean_env: pytest.MonkeyPatch) -> None:
    """The order of the scheduler process with a Mooncake store and PD: before one owner,
    the store's setdefault won and the transport's timeout never applied."""
    mooncake_env.require("the Mooncake store", 2.0, "127.0.0.1")
    merged = mooncake_env.require("the PD KV transport", 30.0)
    assert merged["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "30"
    assert merged["MC_HANDSHAKE_CONNECT_TIMEOUT"] == "30"
    assert merged["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"  # the store's need stays
    assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "30"
    mooncake_env.reset_for_tests()
    for key in [k for k in os.environ if k.startswith("MC_")]:
        clean_env.delenv(key)
    mooncake_env.require("the PD KV transport", 30.0)
    assert mooncake_env.require("the Mooncake store", 2.0, "127.0.0.1") == merged


def test_what_the_user_set_is_left_alone(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "99")
    merged = mooncake_env.require("the PD KV transport", 5.0)
    assert merged["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "99"
    assert merged["MC_HANDSHAKE_CONNECT_TIMEOUT"] == "5"


def test_the_internal_key_comes_from_the_environment_and_stays_out_of_reprs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvflow.contract import INTERNAL_KEY_ENV

    monkeypatch.setenv(INTERNAL_KEY_ENV, "s3cret-key")
    options = parse_args(["--role", "prefill"]).kv_transfer
    assert options is not None and options.internal_key == "s3cret-key"
    assert "s3cret-key" not in repr(options)
    monkeypatch.setenv(INTERNAL_KEY_ENV, "")
    assert parse_args(["--role", "prefill"]).kv_transfer.internal_key is None  # open routes


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--disaggregation-transfer-backend", "cuda_ipc", "--device", "cpu"],
            "cuda_ipc copies KV between GPUs of one host: it needs CUDA",
        ),
        (
            ["--disaggregation-transfer-backend", "cuda_ipc", "--kv-transfer-protocol", "tcp"],
            "the cuda_ipc backend has none",
        ),
        (
            ["--kv-transfer-protocol", "nvlink_intra", "--device", "cpu"],
            "nvlink_intra needs CUDA",
        ),
        (
            [
                *("--kv-transfer-protocol", "nvlink_intra", "--hicache-host-memory-gb", "1"),
                *("--hicache-storage", "mooncake", "--hicache-storage-path", "127.0.0.1:50051"),
            ],
            "could not reach its store",
        ),
    ],
)
def test_same_host_transports_that_cannot_work_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--role", "prefill", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
