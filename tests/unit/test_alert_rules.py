"""The shipped Prometheus alert rules (deploy/prometheus/kvstore-alerts.yaml, the same
file the Helm chart's PrometheusRule embeds): valid for Prometheus (`promtool check
rules`), firing when they should (`promtool test rules` with kvstore-alerts.test.yaml),
and written against series the daemons export. promtool comes with Debian's
`prometheus` package (scripts/install_promtool.sh; CI installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "kvstore-alerts.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kvstore-alerts.test.yaml"
CHART_FILES = ROOT / "deploy" / "helm" / "kvstore" / "files"


def _alerts() -> list[dict[str, object]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_the_chart_embeds_the_same_file() -> None:
    for f in (RULES, RULE_TESTS):
        assert f.resolve() == (CHART_FILES / f.name).resolve(), f"{f} is not the chart's file"


def test_every_alert_is_documented_and_uses_exported_series() -> None:
    alerts = _alerts()
    assert len(alerts) >= 8
    source = (ROOT / "kvstore" / "metrics.py").read_text()
    ops = (ROOT / "docs" / "OPERATIONS.md").read_text()
    for a in alerts:
        name = str(a["alert"])
        assert re.fullmatch(r"Kvstore[A-Za-z]+", name), name
        assert a["labels"]["severity"] in ("critical", "warning", "info"), name  # type: ignore[index]
        assert a["annotations"]["summary"] and a["annotations"]["description"], name  # type: ignore[index]
        assert f"`{name}`" in ops, f"{name} is not described in docs/OPERATIONS.md"
        for series in re.findall(r"kvstore_[a-z0-9_]+", str(a["expr"])):
            base = re.sub(r"_(total|bucket|sum|count)$", "", series)
            assert f'"{base}' in source, f"{name} uses {series}, which no daemon exports"


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is not installed: bash scripts/install_promtool.sh")
    return tool


def test_promtool_accepts_the_rules() -> None:
    out = subprocess.run([_promtool(), "check", "rules", str(RULES)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in out.stdout


def test_the_alerts_fire_when_they_should() -> None:
    out = subprocess.run([_promtool(), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
