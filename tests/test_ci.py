"""The reference-fixture tests may skip on a developer's machine without ../shared, never under CI=true."""

import pytest
from conftest import require_reference_fixtures


def test_missing_fixtures_skip_outside_ci(tmp_path, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="reference fixtures not found"):
        require_reference_fixtures(tmp_path / "missing")


@pytest.mark.parametrize("value", ["true", "True", "1"])
def test_missing_fixtures_fail_under_ci(tmp_path, monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="CI=true requires them"):
        require_reference_fixtures(tmp_path / "missing")


def test_present_fixtures_are_returned(tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert require_reference_fixtures(tmp_path) == tmp_path
