"""Which prefill a decode may contact: the router's signed pair tokens and the static list."""

from __future__ import annotations

import pytest

from kvflow.runtime.wire import Bootstrap
from kvflow.runtime.wire.pair_token import TOKEN_TTL_S, PairTrust, sign_pair

PAIR = Bootstrap("10.0.0.7", 8998, 12345)
NOW = 1_800_000_000.0


def test_a_signed_pair_passes_until_it_expires() -> None:
    token = sign_pair("key", PAIR, now=NOW)
    trust = PairTrust(key="key")
    assert trust.problem(PAIR, token, now=NOW + TOKEN_TTL_S - 1) is None
    assert trust.problem(PAIR, token, now=NOW + TOKEN_TTL_S + 1) == "bootstrap_token has expired"


@pytest.mark.parametrize(
    "other",
    [
        Bootstrap("10.0.0.8", 8998, 12345),  # another prefill: the forgery target
        Bootstrap("10.0.0.7", 8999, 12345),
        Bootstrap("10.0.0.7", 8998, 12346),  # another room
    ],
)
def test_a_token_names_its_room_and_prefill(other: Bootstrap) -> None:
    token = sign_pair("key", PAIR, now=NOW)
    assert "does not match" in PairTrust(key="key").problem(other, token, now=NOW)


@pytest.mark.parametrize("token", [None, "", "v1.x.y", "v2.1.ab", 7, "v1.1.2.3", ["v1"]])
def test_missing_or_malformed_tokens_are_refused(token: object) -> None:
    assert PairTrust(key="key").problem(PAIR, token, now=NOW) is not None


def test_the_static_list_needs_no_token() -> None:
    trust = PairTrust(trusted=frozenset({"10.0.0.7:8998"}))
    assert trust.problem(PAIR, None) is None
    assert "not a trusted prefill" in trust.problem(Bootstrap("10.0.0.8", 8998, 1), None)
    assert not PairTrust().configured and trust.configured
