"""The install files agree with each other and with the model registry."""

import re
from pathlib import Path

from specviz.models.builtin import BUILTIN_MODELS

ROOT = Path(__file__).resolve().parents[1]


def _requirements() -> list[str]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def test_every_requirement_is_pinned():
    loose = [r for r in _requirements() if "==" not in r]
    assert loose == [], f"unpinned requirements: {loose}"


def test_torch_is_the_cpu_pin():
    assert "torch==2.13.0" in _requirements()


def test_environment_yml_matches_requirements():
    text = (ROOT / "environment.yml").read_text()
    assert re.search(r"^\s*-\s*python=3\.11\s*$", text, re.M)
    pip_items = re.findall(r"^\s{6}-\s*(\S+)\s*$", text, re.M)
    assert pip_items == _requirements()


def test_builtin_model_packages_are_required_at_their_versions():
    reqs = set(_requirements())
    for spec in BUILTIN_MODELS.values():
        for dist in spec.distributions():
            assert f"{dist}=={spec.version}" in reqs, f"{dist}=={spec.version} missing from requirements.txt"


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_cmd = next(b for b in blocks if "pytest" in b)
    assert test_cmd in (ROOT / ".ci" / "run").read_text()
