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
