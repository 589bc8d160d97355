"""The CLI's hostile or careless inputs: a NaN interval, a token file, a token sent in the clear."""
from __future__ import annotations

from click.testing import CliRunner

from crossover.client.cli import main


def test_a_nan_interval_is_a_usage_error_not_a_traceback():
    res = CliRunner().invoke(main, ["queue", "--watch", "--interval", "nan", "--socket", "/nonexistent/x.sock"])
    assert res.exit_code == 2 and "not nan" in res.output and "Traceback" not in res.output


def test_the_token_comes_from_a_file_and_a_token_over_plain_tcp_is_warned_about(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    res = CliRunner().invoke(main, ["queue", "--address", "127.0.0.1:9", "--token-file", str(token),
                                    "--timeout", "0.2"])
    assert "over plain TCP" in res.output and "s3cret" not in res.output
    both = CliRunner().invoke(main, ["queue", "--address", "127.0.0.1:9", "--token", "x", "--token-file", str(token)])
    assert both.exit_code == 2 and "not both" in both.output
    missing = CliRunner().invoke(main, ["queue", "--address", "127.0.0.1:9", "--token-file", str(tmp_path / "no")])
    assert missing.exit_code == 2 and "cannot read --token-file" in missing.output


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got {lines!r}"
    return lines[0]


def test_usage_errors_are_one_line_that_says_where_help_is():
    for args, words in ((["queue", "--bogus"], "--bogus"), (["nosuch"], "nosuch"), (["drain"], "DEVICE"),
                        (["--bogus"], "--bogus")):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2, res.output
        line = _one_line(res.stderr)
        assert line.startswith("crossover") and words in line and "--help" in line, line


def test_an_empty_socket_is_a_usage_error_not_a_traceback():
    res = CliRunner(env={"CROSSOVER_ADDRESS": None}).invoke(main, ["queue", "--socket", ""])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert "--socket" in _one_line(res.stderr)


def test_an_address_with_no_port_there_is_a_usage_error():
    for address in ("127.0.0.1:99999", "127.0.0.1", "127.0.0.1:x", ":7070"):
        res = CliRunner().invoke(main, ["queue", "--address", address, "--timeout", "0.2"])
        assert res.exit_code == 2, (address, res.output)
        line = _one_line(res.stderr)
        assert "--address" in line and address in line, line


def test_a_socket_that_is_a_file_or_a_folder_is_called_so(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("")
    for path, words in ((plain, "not a socket"), (tmp_path, "a folder")):
        res = CliRunner(env={"CROSSOVER_ADDRESS": None}).invoke(main, ["queue", "--socket", str(path),
                                                                       "--timeout", "1"])
        assert res.exit_code == 3, res.output
        line = _one_line(res.stderr)
        assert words in line and "stale" not in line, line


def test_a_steering_call_refused_for_want_of_the_admin_token_says_where_it_comes_from():
    import grpc

    from crossover.client.admin import translate

    class Refused(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.PERMISSION_DENIED

        def details(self) -> str:
            return "SetPolicy over TCP needs the admin token"

    err = translate(Refused(), "127.0.0.1:7070", 5.0, method="SetPolicy", command="crossover policy")
    assert str(err) == ("not allowed: `crossover policy` over TCP needs the admin token: pass --token-file with "
                        "the daemon's --admin-token-file")
