"""Flags and the internal key of every server in the PD tests."""

# A small chunk so long prompts prefill in several chunks on the prefill side.
COMMON = ("--max-total-tokens", "6000", "--context-length", "2048", "--chunked-prefill-size", "64")


def trusting(bootstrap_port: int) -> tuple[str, ...]:
    """A decode's flags naming the one prefill it may contact (on loopback): the tests send
    to it directly and through both routers, none of which signs without the internal key."""
    return ("--disaggregation-trusted-prefills", f"127.0.0.1:{bootstrap_port}")


# Every server and router of tests/pd shares it (tests/pd/conftest.py sets it for the
# session): kvflow router signs its pairs with it, the decode checks them, the prefill's
# bootstrap routes require it.
PD_INTERNAL_KEY = "tests-pd-internal-key"

# The prefills' $SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (seconds) in tests/pd.
PD_BOOTSTRAP_TIMEOUT = "20"
