"""The Helm chart checks of scripts/check_chart.py, run under pytest.

Skipped when helm-python-sdk or kubernetes-validate is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip(
    "helm_python", reason="helm-python-sdk is not installed (pip install helm-python-sdk==0.2.2)"
)
pytest.importorskip(
    "kubernetes_validate",
    reason="kubernetes-validate is not installed (pip install kubernetes-validate==1.37.0)",
)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_chart.py"


def _load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_chart", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


cc = _load_checker()
CHART = cc.CHART_DIR


@pytest.fixture(scope="module")
def kube_versions() -> list[str]:
    return list(cc.kube_versions(CHART))


def test_kube_versions_cover_chart_minimum_and_latest(kube_versions: list[str]) -> None:
    assert kube_versions[0] == "1.30.0"
    assert len(kube_versions) == 2


def test_schema_is_strict_everywhere() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert cc.check_schema_strict(schema) == []


@pytest.mark.parametrize("name", ["values.yaml", "values-ha.yaml"])
def test_every_value_is_documented(name: str) -> None:
    assert cc.check_values_documented(CHART / name) == []


def test_undocumented_value_is_reported(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("# documented\na: 1\nb:\n  # documented\n  c: 2\nlist:  # inline\n  - x: 1\n")
    assert cc.check_values_documented(values) == ["values.yaml:3: key 'b' has no comment"]


@pytest.mark.parametrize("variant", cc.VARIANTS, ids=lambda v: v.name)
def test_variant(variant: Any, kube_versions: list[str]) -> None:
    results = cc.run_variant(CHART, variant, kube_versions)
    failures = {title: problems for title, problems in results.items() if problems}
    assert failures == {}


def test_rejections() -> None:
    assert cc.check_rejections(CHART) == []


def test_schema_rejects_typo_with_clear_message() -> None:
    import helm_python

    with pytest.raises(helm_python.HelmValuesError, match="dramSize"):
        cc.render(CHART, {"worker": {"dramSize": "8GiB"}})


def test_main_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert cc.main([]) == 0
    assert "all chart checks passed" in capsys.readouterr().out
