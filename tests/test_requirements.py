"""requirements.lock, which the README's commands and CI install, against requirements.txt: every direct
requirement is locked, at a version its range admits, and every locked package is pinned exactly."""

import os
import re

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from running import REPO


def requirement_lines(path):
    """The requirement of each line of a requirements file, comments and pip-compile's notes dropped."""
    with open(path) as f:
        lines = [line.split("#", 1)[0].strip() for line in f]
    return [Requirement(line) for line in lines if line]


def locked_versions():
    """{canonical name: Version} of requirements.lock, each line `name==version`."""
    locked = {}
    for req in requirement_lines(os.path.join(REPO, "requirements.lock")):
        (spec,) = req.specifier  # exactly one: ==
        assert spec.operator == "==", f"requirements.lock: {req} is not pinned with =="
        assert canonicalize_name(req.name) not in locked, f"requirements.lock lists {req.name} twice"
        locked[canonicalize_name(req.name)] = Version(spec.version)
    return locked


def test_every_direct_requirement_is_locked_at_a_version_its_range_admits():
    locked = locked_versions()
    for req in requirement_lines(os.path.join(REPO, "requirements.txt")):
        name = canonicalize_name(req.name)
        assert name in locked, f"{req.name} is in requirements.txt but not in requirements.lock: regenerate it"
        assert req.specifier.contains(locked[name], prereleases=True), \
            f"requirements.lock has {req.name}=={locked[name]}, outside requirements.txt's {req}: regenerate it"


def test_the_lock_pins_a_public_torch_release_that_any_platform_can_install():
    """A local build label (2.13.0+cpu, from the wheel a CPU machine resolves) would exist on no index."""
    assert locked_versions()["torch"].local is None


def test_ci_and_the_readme_install_the_lock():
    with open(os.path.join(REPO, ".ci", "run")) as f:
        assert re.search(r"pip install .*-r requirements\.lock", f.read())
    with open(os.path.join(REPO, "README.md")) as f:
        commands = re.search(r"## The two commands\n\n```bash\n(.*?)```", f.read(), re.S).group(1)
    installs = re.findall(r"pip install -r (\S+) &&", commands)
    assert installs == ["requirements.lock", "requirements.lock"]
