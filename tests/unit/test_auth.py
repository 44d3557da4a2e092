"""Token file format and roles (``kvps.service.auth``), without a cluster."""
from __future__ import annotations

import pytest

import kvps_client as kc
from kvps.errors import ConfigError, Forbidden, Unauthorized, error_from_dict
from kvps.cli.main import build_parser
from kvps.service.auth import TokenStore, admin_token, allows, new_token, parse_tokens


def test_a_bare_token_line_is_admin_and_a_role_may_follow():
    text = "old-style\n\n  reader read \nworker write\nboss admin\n"
    assert parse_tokens(text) == [("old-style", "admin"), ("reader", "read"), ("worker", "write"),
                                  ("boss", "admin")]


@pytest.mark.parametrize("line", ["tok writer", "tok read extra", "tok READ"])
def test_a_malformed_line_is_refused_by_number(line):
    with pytest.raises(ConfigError) as err:
        parse_tokens(f"good\n{line}\n")
    assert err.value.fields["line"] == 2


def test_a_generated_token_is_accepted_on_the_command_line():
    # token_urlsafe gave a token starting with "-" one run in 64, and "--token -x..." is an option to argparse
    tokens = {new_token() for _ in range(2000)}
    assert len(tokens) == 2000 and all(not t.startswith("-") and len(t) == 48 for t in tokens)
    parser = build_parser()
    for token in sorted(tokens)[:5] + sorted(tokens)[-5:]:
        assert parser.parse_args(["status", "--token", token]).token == token


def test_roles_are_ordered_read_write_admin():
    assert [(r, n) for r in ("read", "write", "admin") for n in ("read", "write", "admin")
            if allows(r, n)] == [("read", "read"), ("write", "read"), ("write", "write"),
                                 ("admin", "read"), ("admin", "write"), ("admin", "admin")]


def test_processes_send_the_first_admin_token(tmp_path):
    path = tmp_path / "token"
    path.write_text("reader read\nfirst-admin\nsecond admin\n")
    assert admin_token(path) == "first-admin"
    assert TokenStore(path).admin_token() == "first-admin"
    path.write_text("reader read\n")
    with pytest.raises(ConfigError):
        admin_token(path)


def test_check_answers_401_for_unknown_and_typed_403_for_too_small_a_role(tmp_path):
    path = tmp_path / "token"
    path.write_text("boss\nreader read\nworker write\n")
    store = TokenStore(path)
    assert store.check("Bearer reader", "read") == "read"
    assert store.check("Bearer boss", "admin") == "admin"
    for header in (None, "", "Bearer ", "Bearer nobody", "Basic boss"):
        with pytest.raises(Unauthorized):
            store.check(header, "read")
    with pytest.raises(Forbidden) as err:
        store.check("Bearer worker", "admin", "POST /v1/moves")
    exc = err.value
    assert exc.http_status == 403 and exc.role == "write" and exc.needs == "admin"
    assert "POST /v1/moves" in exc.message
    # the client sees the same class and fields, and does not retry it
    again = error_from_dict(exc.to_dict())
    assert isinstance(again, kc.Forbidden) and isinstance(again, kc.RejectedError)
    assert again.fields == exc.fields


def test_a_malformed_rewrite_keeps_the_tokens_read_last(tmp_path):
    path = tmp_path / "token"
    path.write_text("boss\n")
    store = TokenStore(path, recheck_every=0.0)
    path.write_text("boss\nhalf written-\n")  # a bad role: refused as a whole
    assert store.check("Bearer boss", "admin") == "admin"
    path.write_text("boss\nreader read\n")
    assert store.check("Bearer reader", "read") == "read"
