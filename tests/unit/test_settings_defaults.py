"""The defaults a `CROSSOVER_*` variable falls back to are the fields' own defaults, in one place."""
import os

from crossover.client.settings import AggregationSettings, PluginSettings


def test_from_env_without_variables_is_the_fields_defaults(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CROSSOVER_"):
            monkeypatch.delenv(name)
    built = PluginSettings.from_env()
    assert built == PluginSettings(target=built.target)
    assert AggregationSettings.from_env() == AggregationSettings()
