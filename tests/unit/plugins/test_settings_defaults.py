"""The defaults a `CROSSOVER_*` variable falls back to are the fields' own defaults, in one place."""
import os

from crossover.settings import AggregationSettings, PluginSettings


def test_from_env_without_variables_is_the_fields_defaults(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CROSSOVER_"):
            monkeypatch.delenv(name)
    built = PluginSettings.from_env()
    assert built == PluginSettings(target=built.target)
    assert AggregationSettings.from_env() == AggregationSettings()


def test_a_user_without_a_daemon_of_their_own_finds_the_nodes_system_daemon(tmp_path, monkeypatch):
    from crossover import protos

    system = tmp_path / "run" / "crossoverd.sock"
    monkeypatch.delenv("CROSSOVER_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(protos.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(protos, "SYSTEM_SOCKET", str(system))
    own = str(tmp_path / "user" / "crossover" / "crossoverd.sock")
    assert protos.default_socket_path(client=True) == own, "no system daemon: the user's own path"
    system.parent.mkdir()
    system.touch()
    assert protos.default_socket_path(client=True) == str(system)
    assert protos.default_socket_path() == own, "a user's daemon never takes the system daemon's path"
    (tmp_path / "user" / "crossover").mkdir(parents=True)
    (tmp_path / "user" / "crossover" / "crossoverd.sock").touch()
    assert protos.default_socket_path(client=True) == own, "the user's own daemon comes first"
