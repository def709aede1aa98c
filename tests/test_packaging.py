"""The set-up promises: environment.yml mirrors pyproject, .ci/run runs the README's test command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _pyproject_deps() -> set[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = data["project"]
    deps = set(project["dependencies"])
    for extra in ("dev", "course", "serve", "grammar", "gpu"):
        deps |= set(project["optional-dependencies"][extra])
    return deps


def _environment_deps() -> set[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    pip = [ln.strip()[2:].strip() for ln in lines if re.match(r"^\s{6}- ", ln)]
    return {d for d in pip if d != "-e ."}


def test_environment_yml_mirrors_pyproject():
    assert _environment_deps() == _pyproject_deps()


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(pip install [^\n]+)\n```", text)


def test_readme_has_two_commands_and_ci_runs_the_test_one():
    commands = _readme_commands()
    assert len(commands) >= 2, commands
    demo, test = commands[0], commands[1]
    assert "python -m minisgl generate" in demo and "assets/tiny-qwen3" in demo
    assert "pytest" in test
    ci = (ROOT / ".ci" / "run").read_text()
    assert test in ci, "the CI entry must run the README's test command verbatim"


def test_cpu_setup_pins_the_local_cpu_torch():
    # on a CPU machine a bare `torch` requirement would pull a multi-GB CUDA build
    for command in _readme_commands()[:2]:
        assert "torch==" in command


def test_cli_help_runs():
    out = subprocess.run([sys.executable, "-m", "minisgl", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "generate" in out.stdout and "bench" in out.stdout and "serve" in out.stdout


def test_model_configs_for_benchmarks_are_real_shapes():
    import json
    small = json.loads((ROOT / "assets/configs/qwen3-0.6b/config.json").read_text())
    big = json.loads((ROOT / "assets/configs/qwen3-8b/config.json").read_text())
    assert (small["hidden_size"], small["num_hidden_layers"], small["vocab_size"]) == (1024, 28, 151936)
    assert (big["hidden_size"], big["num_hidden_layers"], big["intermediate_size"]) == (4096, 36, 12288)


def test_ci_installs_the_browser_for_the_browser_test():
    # tests/test_browser.py must really run in CI: .ci/run installs Debian's chromium, the dev extra Playwright
    ci = (ROOT / ".ci" / "run").read_text()
    assert "apt-get install -y chromium" in ci and "playwright install" not in ci
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert any(d.startswith("playwright") for d in dev)


def test_ci_installs_triton_for_the_kernel_tests():
    # the Triton kernels' interpreter tests, the PTX check and the structured-output tests skip without Triton and
    # xgrammar: CI must not skip them (xgrammar without its dependencies: they would pull a CUDA torch)
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r'^pip install "triton==[0-9.]+" && pip install --no-deps "xgrammar==', ci, re.M)
