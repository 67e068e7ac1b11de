"""The settings schema: parsing, refusals, unknown-name warnings, and the generated files not drifting."""

import subprocess
import sys
from pathlib import Path

import pytest

from glm53.planning import settings as S

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_parse_without_environment():
    s = S.load(environ={}, dotenv=None)
    assert s.mode == "auto" and s.port == 30000 and s.host == "127.0.0.1"
    assert s.model_id == "glm-5.3-flash" and s.context == 131072 and s.exact is False


@pytest.mark.parametrize(("name", "value"), [
    ("GLM53_PORT", "abc"), ("GLM53_PORT", "70000"), ("GLM53_MODE", "turbo"), ("GLM53_EXACT", "maybe"),
    ("GLM53_CONTEXT", "10"), ("GLM53_VRAM_BUDGET_GB", "-1"), ("GLM53_VRAM_BUDGET_GB", "nan"),
])
def test_invalid_value_names_setting_value_and_allowed(name, value):
    with pytest.raises(S.SettingsError) as err:
        S.load(environ={name: value}, dotenv=None)
    msg = str(err.value)
    assert name in msg and repr(value) in msg and "allowed" in msg


def test_unknown_name_warns_with_closest_known_name():
    s = S.load(environ={"GLM53_MODEE": "fast", "GLM53_PROT": "1"}, dotenv=None)
    assert any("GLM53_MODEE" in w and "GLM53_MODE" in w for w in s.warnings)
    assert any("GLM53_PORT" in w for w in s.warnings)


def test_entrypoint_and_test_switches_are_not_unknown_settings():
    s = S.load(environ={"GLM53_PYTHON": "/usr/bin/python3", "GLM53_TEST_ENGINE": "exl3"}, dotenv=None)
    assert s.warnings == ()
    assert not S.NOT_SETTINGS & set(S.BY_NAME)


def test_invalid_value_in_dotenv_names_it(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("GLM53_MAX_CONCURRENCY=-1\n")
    with pytest.raises(S.SettingsError, match=r"GLM53_MAX_CONCURRENCY='-1' is invalid \(allowed: 0 \(the plan picks\) \| integer >= 1\)"):
        S.load(environ={}, dotenv=env_file)


def test_settings_command_prints_every_setting():
    proc = subprocess.run([sys.executable, "-m", "glm53", "settings"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "GLM53_PORT": "31000"})
    assert proc.returncode == 0, proc.stderr
    for s in S.SCHEMA:
        assert s.name in proc.stdout
    assert "31000" in proc.stdout  # the current value next to the default


def test_environment_overrides_dotenv(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("GLM53_PORT=31000\nGLM53_MODEL_ID=from-file\n")
    s = S.load(environ={"GLM53_PORT": "32000"}, dotenv=env_file)
    assert s.port == 32000 and s.model_id == "from-file"


def test_invalid_setting_exits_2_from_the_cli():
    proc = subprocess.run([sys.executable, "-m", "glm53", "settings"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "GLM53_MODE": "turbo", "GLM53_MODEE": "x"})
    assert proc.returncode == 2
    assert "GLM53_MODE='turbo'" in proc.stderr and "did you mean GLM53_MODE" in proc.stderr


def test_generated_files_match_schema():
    assert (ROOT / ".env.example").read_text() == S.render_env_example(), "run `glm53 settings --write`"
    assert (ROOT / "docs" / "configuration.md").read_text() == S.render_markdown(), "run `glm53 settings --write`"


def test_every_setting_is_documented_once_in_env_example():
    text = (ROOT / ".env.example").read_text()
    for s in S.SCHEMA:
        assert text.count(f"# {s.name}=") == 1


def test_configuration_table_rows_have_four_cells():
    """A bare | inside a cell (GLM53_MODE's allowed values) would split the row into extra columns."""
    import re

    from glm53.planning.settings import render_markdown

    rows = [line for line in render_markdown().splitlines() if line.startswith("| `GLM53_")]
    assert len(rows) == len(S.SCHEMA)
    for row in rows:
        assert len(re.findall(r"(?<!\\)\|", row)) == 5, row


def test_the_settings_fields_are_the_schema_with_its_types():
    # Settings is what editors and type checkers follow; SCHEMA is what parses and documents. They name the same
    # settings, in the same order, and each field's type is what its parser returns.
    import dataclasses
    import typing

    hints = typing.get_type_hints(S.Settings)
    fields = [f.name for f in dataclasses.fields(S.Settings) if f.name != "warnings"]
    assert fields == [S.attr_name(s.name) for s in S.SCHEMA]
    for s in S.SCHEMA:
        assert hints[S.attr_name(s.name)] is typing.get_type_hints(s.parse)["return"], s.name
    loaded = S.load(environ={}, dotenv=None)
    for s in S.SCHEMA:
        assert isinstance(getattr(loaded, S.attr_name(s.name)), hints[S.attr_name(s.name)]), s.name


def test_settings_are_frozen_and_overrides_make_a_new_one():
    import dataclasses

    s = S.load(environ={}, dotenv=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.port = 1  # type: ignore[misc]
    t = s.with_overrides(model_dir="/model")
    assert t.model_dir == "/model" and s.model_dir == "" and t.port == s.port and t.warnings == s.warnings
    with pytest.raises(TypeError):
        s.with_overrides(no_such_setting=1)


def test_allowed_origins_are_normalized_as_browsers_write_them():
    s = S.load(environ={"GLM53_ALLOWED_ORIGINS": "http://A.example:80/, https://b.example:443 ,app://obsidian.md,"
                                                 "http://a.example, http://localhost:3000"}, dotenv=None)
    assert s.allowed_origins == ("http://a.example", "https://b.example", "app://obsidian.md",
                                 "http://localhost:3000")
    assert S.load(environ={}, dotenv=None).allowed_origins == ()
    assert S.load(environ={"GLM53_ALLOWED_ORIGINS": "*"}, dotenv=None).allowed_origins == ("*",)


@pytest.mark.parametrize("value", ["evil.example", "http://x.example/path", "http://", "http://u@x.example"])
def test_an_origin_that_is_not_one_is_refused(value):
    with pytest.raises(S.SettingsError, match="GLM53_ALLOWED_ORIGINS"):
        S.load(environ={"GLM53_ALLOWED_ORIGINS": value}, dotenv=None)


def test_the_settings_command_never_prints_the_api_key():
    key = "sk-very-secret-4711"
    proc = subprocess.run([sys.executable, "-m", "glm53", "settings"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "GLM53_API_KEY": key})
    assert proc.returncode == 0, proc.stderr
    assert key not in proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("GLM53_API_KEY"))
    assert f"<set, {len(key)} characters, hidden>" in line
