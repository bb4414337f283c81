"""The install story: what pyproject.toml declares, and that the README's `pip install -e ".[test]"`
resolves from plain PyPI (not only on machines whose pip config finds a local CPU build of torch).

- The test extra's triton is a range, not a pin. torch's CUDA wheels pin their own triton, so a pin
  of ours that differs from torch's makes the extra unresolvable (it did: triton==3.8.0 beside
  torch 2.13.0's triton==3.7.1). The range is the Triton versions the gpu kernels were checked
  under, and no wider.
- The resolver check runs pip's resolver against the default index with every pip config file and
  PIP_* variable ignored (`--isolated`), as a user's machine would see it.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# torch is the reference the tests compare against; it stays pinned.
TORCH = "2.13.0"
# torch 2.13.0's wheels on PyPI say: Requires-Dist: triton==3.7.1; platform_system == "Linux" and
# python_version < "3.15" (read from the resolver's report). The declared range must hold it.
TORCH_PINS_TRITON = "3.7.1"
# The Triton versions the kernels were checked under: every kernel launch compiled to sm_90 cubin
# under Triton 3.8.0 and 3.6.0 (tools/compile_sm90.py; tests/test_gpu_compile.py runs the
# full-size half under the installed one), and the gpu tests passed under both interpreters
# (docs/GPU.md). Nothing outside 3.6 to 3.8 was checked, so the range must not admit it.
TRITON_CHECKED = ("3.6.0", "3.8.0")
TRITON_UNCHECKED = ("3.5.1", "3.9.0", "4.0.0")


def _test_extra(name):
    found = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["test"]
             if Requirement(r).name == name]
    assert len(found) == 1, f"the test extra should name {name} exactly once, found {found}"
    return found[0]


def _in_range(version, specifier: SpecifierSet):
    # Local labels (torch 2.13.0+cpu) and pre-releases are judged by their release, as pip would
    # accept an installed one.
    return specifier.contains(Version(version).public, prereleases=True)


def test_torch_stays_pinned():
    torch = _test_extra("torch")
    assert str(torch.specifier) == f"=={TORCH}", torch


def test_triton_range_is_the_checked_versions():
    triton = _test_extra("triton")
    spec = triton.specifier
    assert not any(s.operator in ("==", "===") for s in spec), \
        f"{triton}: a pin; torch pins its own triton, so ours must be a range that holds it"
    for v in TRITON_CHECKED:
        assert _in_range(v, spec), f"{triton} leaves out Triton {v}, which the kernels were checked under"
    for patch in ("3.6.1", "3.7.0", "3.8.1"):
        assert _in_range(patch, spec), f"{triton} leaves out Triton {patch}, inside the checked span"
    for v in TRITON_UNCHECKED:
        assert not _in_range(v, spec), f"{triton} admits Triton {v}, which the kernels were never checked under"
    assert _in_range(TORCH_PINS_TRITON, spec), \
        f"{triton} leaves out triton {TORCH_PINS_TRITON}, which torch {TORCH}'s CUDA wheels pin: unresolvable"
    # triton ships Linux wheels only; the marker keeps macOS and Windows installs working
    assert triton.marker is not None and "platform_system" in str(triton.marker), triton


def test_installed_triton_is_in_the_declared_range():
    try:
        installed = metadata.version("triton")
    except metadata.PackageNotFoundError:
        pytest.skip("triton is not installed here")
    triton = _test_extra("triton")
    assert _in_range(installed, triton.specifier), \
        f"installed triton {installed} is outside the declared {triton}"


def test_readme_python_version_is_requires_python():
    requires = SpecifierSet(PYPROJECT["project"]["requires-python"])
    floors = [s.version for s in requires if s.operator == ">="]
    assert len(floors) == 1, requires
    said = re.findall(r"Python (\d+\.\d+) or newer", (ROOT / "README.md").read_text())
    assert said, "README.md no longer says which Python it needs ('Python X.Y or newer')"
    assert set(said) == {floors[0]}, f"README.md says Python {said}, pyproject says requires-python {requires}"
    assert sys.version_info[:2] >= tuple(map(int, floors[0].split("."))), \
        f"this interpreter ({sys.version.split()[0]}) is older than requires-python {requires}"



def test_readme_installs_the_cpu_build_of_torch_before_the_test_extra():
    """A CPU-only user copies the README's test command as it stands: its first step takes the
    pinned torch from PyTorch's CPU index, and only then the test extra (which keeps it)."""
    readme = (ROOT / "README.md").read_text()
    commands = [c for c in re.findall(r"```bash\n(.*?)```", readme, re.S) if '".[test]"' in c]
    assert len(commands) == 1, commands
    steps = [s.strip() for s in commands[0].split("&&")]
    assert steps[0] == f"pip install torch=={TORCH} --index-url https://download.pytorch.org/whl/cpu", steps
    assert steps[1] == 'pip install -e ".[test]"' and steps[2].startswith("python -m pytest"), steps
    assert str(_test_extra("torch").specifier) == f"=={TORCH}"


def test_a_missing_serve_extra_names_what_installs_it(monkeypatch):
    """serve without Starlette: one line whose two installs name the extra that exists and the
    packages it holds."""
    from handgrad.models.sampling import SampleError
    from handgrad.serve import command
    monkeypatch.setattr(command, "Starlette", None)
    with pytest.raises(SampleError) as e:
        command.build(None)
    said = str(e.value)
    assert "\n" not in said and "pip install -e '.[serve]'" in said, said
    extra = {Requirement(r).name for r in PYPROJECT["project"]["optional-dependencies"]["serve"]}
    named = set(re.search(r"pip install ([a-z ]+)$", said).group(1).split())
    assert named == extra == {"starlette", "uvicorn"}, (named, extra)

# What pip prints when it cannot reach the index (urllib3's and the resolver's words). Only these
# skip the resolver check; any other failure, a ResolutionImpossible above all, fails it.
_NETWORK = ("NewConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "Max retries exceeded",
            "Could not fetch URL", "Temporary failure in name resolution", "Name or service not known",
            "Network is unreachable", "Connection refused", "ProxyError", "connection broken by")


def _network_failure(output):
    return (any(m in output for m in _NETWORK)
            and "ResolutionImpossible" not in output and "conflicting dependencies" not in output)


def _pip_version():
    return Version(metadata.version("pip"))


# The first pip whose fast-deps resolves from metadata alone. With pip 23.2.1 (this machine's, and a
# fresh Python 3.11's) the resolve below took 93 s and downloaded 3.4 GB; with pip 26.3 28 s (the
# 2-core AMD EPYC Zen 3, 2026-11-28).
FAST_DEPS_PIP = Version("26.3")


def _resolver_pip(tmp, env):
    """(the command that runs the resolving pip, whether it takes fast-deps): this interpreter's own
    pip if it is FAST_DEPS_PIP or newer; else PyPI's newest pip wheel, fetched into tmp and run from
    the wheel itself (pip runs from its wheel: `python pip-X-py3-none-any.whl/pip`), so nothing is
    installed. Where that fetch cannot reach the index the check is skipped, as the resolve itself
    would be; where it fails otherwise, the installed pip resolves (slowly)."""
    installed = [sys.executable, "-m", "pip"]
    if _pip_version() >= FAST_DEPS_PIP:
        return installed, True
    fetch = [sys.executable, "-m", "pip", "download", "--isolated", "--no-deps", "--only-binary", ":all:",
             "--disable-pip-version-check", "--progress-bar", "off", "-d", tmp, f"pip>={FAST_DEPS_PIP}"]
    out = subprocess.run(fetch, env=env, capture_output=True, text=True, timeout=300, check=False)
    wheels = sorted(Path(tmp).glob("pip-*.whl"))
    if out.returncode == 0 and len(wheels) == 1:
        return [sys.executable, str(wheels[0] / "pip")], True
    if _network_failure(out.stdout + out.stderr):
        pytest.skip(f"the package index cannot be reached from here: {' '.join(fetch)}")
    return installed, False


@pytest.mark.network
def test_test_extra_resolves_from_plain_pypi():
    """`pip install -e ".[test]"` as a user's machine resolves it: the default index, no pip config
    (no local wheel directories, no constraints), nothing taken as already installed. Resolution
    only (--dry-run), but pip 23.2 to 25.0 still download every wheel they consider into a
    temporary directory (3.4 GB: the CUDA torch, its nvidia-* wheels and triton; measured against an
    index without PEP 658 metadata, and pypa/pip#12603 reports the same with it). pip 26.3 with
    fast-deps reads only the metadata, by HTTP range requests, so the resolve runs on it
    (_resolver_pip: the installed pip where it is that new, else PyPI's pip wheel run as it is)."""
    triton = _test_extra("triton")
    with tempfile.TemporaryDirectory(prefix="handgrad-resolve-") as tmp:
        report = Path(tmp) / "report.json"
        env = dict(os.environ, TMPDIR=tmp)  # pip's downloads land here and go with it
        pip, fast = _resolver_pip(tmp, env)
        # not --quiet: on a conflict, pip says which requirements collide only at its default verbosity
        cmd = [*pip, "install", *(["--use-feature=fast-deps"] if fast else []), "--isolated", "--dry-run",
               "--ignore-installed", "--disable-pip-version-check", "--progress-bar", "off", "--report",
               str(report), "-e", ".[test]"]
        start = time.monotonic()
        try:
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
        except subprocess.TimeoutExpired as e:
            said = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            pytest.fail(f"pip's resolver ran past 900 s: {' '.join(cmd)}\n{said[-3000:]}")
        took = time.monotonic() - start
        output = out.stdout + out.stderr
        if out.returncode != 0 and _network_failure(output):
            said = next(line for line in output.splitlines() if any(m in line for m in _NETWORK))
            pytest.skip(f"the package index cannot be reached from here: {said.strip()[:300]}")
        assert out.returncode == 0, f"{' '.join(cmd)} failed (exit {out.returncode}):\n{output[-6000:]}"
        chosen = {i["metadata"]["name"].lower(): i["metadata"] for i in json.loads(report.read_text())["install"]}
    print(f"resolved in {took:.0f} s: torch {chosen.get('torch', {}).get('version')}, "
          f"triton {chosen.get('triton', {}).get('version')}")

    assert "torch" in chosen, sorted(chosen)
    assert Version(chosen["torch"]["version"]).public == TORCH, chosen["torch"]["version"]
    if not triton.marker.evaluate():
        return  # not Linux: no triton wanted
    assert "triton" in chosen, f"the resolve on this platform has no triton: {sorted(chosen)}"
    assert _in_range(chosen["triton"]["version"], triton.specifier), \
        f"pip chose triton {chosen['triton']['version']}, outside the declared {triton}"
    # torch's own triton requirement, as the report read it from torch's metadata
    for line in chosen["torch"].get("requires_dist", []):
        req = Requirement(line)
        if req.name == "triton" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            pinned = [s.version for s in req.specifier if s.operator == "=="]
            assert all(_in_range(v, triton.specifier) for v in pinned), \
                f"torch {TORCH} requires {req}, outside handgrad's {triton}"
