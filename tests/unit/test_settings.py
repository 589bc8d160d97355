"""The plugin's settings are declared once (crossover/settings.py): every `CROSSOVER_*` variable has one
declaration, the records, their reading and docs/settings.md's table come from it, nothing else in the product
reads the variables, and a bad value is a `SettingError` that names the variable and the value."""
from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from crossover import setting_fields
from crossover.settings import (
    PLUGIN_SETTINGS,
    AggregationSettings,
    LBBSPSettings,
    PluginSettings,
    SettingError,
    declared,
)
from scripts import gen_settings_table

ROOT = Path(__file__).resolve().parents[2]
FREE_TEXT = (setting_fields.text, setting_fields.trimmed, setting_fields.upper_text)


def test_every_variable_is_declared_once_and_every_field_is_a_declaration():
    names = [s.env for s in declared(PluginSettings)]
    assert len(names) == len(set(names)) == len(PLUGIN_SETTINGS), "a variable is declared twice"
    for record in (PluginSettings, AggregationSettings, LBBSPSettings):
        for f in fields(record):
            undeclared = "setting" not in f.metadata and "record" not in f.metadata
            assert not undeclared or (record, f.name) == (PluginSettings, "target"), f"{record.__name__}.{f.name}"
            if "setting" in f.metadata:
                assert f.default == f.metadata["setting"].default


def test_the_product_names_no_variable_it_does_not_declare_and_reads_none_but_here():
    readers = []
    for path in sorted((ROOT / "crossover").rglob("*.py")):
        text = path.read_text()
        unknown = set(re.findall(r"\b(CROSSOVER_[A-Z0-9_]*[A-Z0-9])\b", text)) - set(PLUGIN_SETTINGS)
        assert not unknown, f"{path.relative_to(ROOT)} names undeclared settings {sorted(unknown)}"
        reads = re.search(r"(environ|getenv)\b[^\n]*[\"']CROSSOVER_", text)
        if reads and path.name not in ("settings.py", "setting_fields.py"):
            readers.append(str(path.relative_to(ROOT)))
    # the one other reader: the daemon's and the CLI's default socket (a rank's is read by its settings)
    assert readers == ["crossover/protos/__init__.py"], readers


def test_the_docs_table_is_generated_from_the_declarations():
    text = gen_settings_table.TABLE_DOC.read_text()
    block = text.split("<!-- settings-table", 1)[1].split("\n", 1)[1].split("<!-- /settings-table -->", 1)[0]
    assert block.strip() == gen_settings_table.table(), "run `python -m scripts.gen_settings_table`"
    assert gen_settings_table.table().count("\n| `CROSSOVER_") == len(PLUGIN_SETTINGS)


def test_the_environment_fills_every_record():
    built = PluginSettings.from_env("train", environ={
        "CROSSOVER_ADDRESS": "node:5050", "CROSSOVER_DEVICE": "2", "CROSSOVER_PIN": "off",
        "CROSSOVER_HOST_CORES": "2-3,8", "CROSSOVER_AGGREGATION": "Adasum", "CROSSOVER_LBBSP_MAX_BATCH": "64, 64,32",
        "CROSSOVER_GRANT_TIMEOUT": "2.5", "CROSSOVER_LOG_LEVEL": "info", "CROSSOVER_GROUPS": " 0,1;2,3 "})
    assert (built.target, built.address, built.job_name, built.device, built.pin) == ("node:5050", "node:5050",
                                                                                      "train", 2, False)
    assert (built.host_cores, built.grant_timeout_s, built.log_level) == ((2, 3, 8), 2.5, "INFO")
    assert built.aggregation.rule == "adasum" and built.aggregation.groups == "0,1;2,3"
    assert built.aggregation.lbbsp.max_batch == (64, 64, 32)
    named = PluginSettings.from_env("train", environ={"CROSSOVER_JOB_NAME": "mine", "CROSSOVER_SOCKET": "/s"})
    assert (named.job_name, named.target) == ("mine", "unix:///s")
    assert PluginSettings.from_env(environ={}).job_name == "job"


_REFUSED = [
    ("CROSSOVER_LBBSP_PERIOD", "ten", "CROSSOVER_LBBSP_PERIOD='ten' is not an integer"),
    ("CROSSOVER_LBBSP_PERIOD", "0", "CROSSOVER_LBBSP_PERIOD=0 is outside 1..1000000"),
    ("CROSSOVER_GRANT_TIMEOUT", "soon", "CROSSOVER_GRANT_TIMEOUT='soon' is not a number"),
    ("CROSSOVER_REPORT_INTERVAL", "2", "CROSSOVER_REPORT_INTERVAL=2 is outside 0.0..1.0"),
    ("CROSSOVER_PIN", "Maybe", "CROSSOVER_PIN='maybe' is not a boolean (use 1 or 0)"),
    ("CROSSOVER_AGGREGATION", "mean",
     "CROSSOVER_AGGREGATION='mean' is not one of average, sum, adasum, weighted, group_async or empty"),
    ("CROSSOVER_TRANSPORT", "udp", "CROSSOVER_TRANSPORT='udp' is not one of auto, grpc"),
    ("CROSSOVER_DEVICE", "gpu", "CROSSOVER_DEVICE='gpu' is not an integer"),
    ("CROSSOVER_DEVICE", "-2", "CROSSOVER_DEVICE=-2 must be -1 or a device index"),
    ("CROSSOVER_HOST_CORES", "a-b", "CROSSOVER_HOST_CORES: 'a-b' is not a cpu list such as 0-3,8"),
    ("CROSSOVER_LBBSP_MAX_BATCH", "64,x",
     "CROSSOVER_LBBSP_MAX_BATCH='64,x' is not an int or a comma-separated list of ints"),
    ("CROSSOVER_LBBSP_MAX_BATCH", "0", "CROSSOVER_LBBSP_MAX_BATCH='0': every cap must be >= 1"),
]


@pytest.mark.parametrize(("name", "value", "message"), _REFUSED, ids=[f"{n}={v}" for n, v, _ in _REFUSED])
def test_each_kind_of_setting_refuses_a_bad_value_as_it_always_did(name, value, message):
    with pytest.raises(SettingError) as refused:
        PluginSettings.from_env(environ={name: value})
    assert str(refused.value) == message


@pytest.mark.parametrize("setting", [s for s in PLUGIN_SETTINGS.values() if s.parse not in FREE_TEXT],
                         ids=lambda s: s.env)
def test_every_setting_but_free_text_refuses_a_bad_value_naming_the_variable(setting):
    with pytest.raises(SettingError) as refused:
        PluginSettings.from_env(environ={setting.env: "bogus"})
    assert setting.env in str(refused.value) and "bogus" in str(refused.value)


def test_a_blank_variable_is_an_unset_one():
    blank = {s.env: " " for s in PLUGIN_SETTINGS.values()}
    assert PluginSettings.from_env(environ=blank) == PluginSettings.from_env(environ={})
