"""The repository's top-level folders install as subpackages of one import package, ``shardfold``
(``functions/`` -> ``shardfold.functions``, ...). pyproject.toml holds everything else; this file exists
only because that mapping needs the package list, which is found here so that a new kind's package
(``functions/<kind>/``) is picked up without editing a shared file."""

from setuptools import find_namespace_packages, find_packages, setup

FOLDERS = ("functions", "orchestrator", "client", "infra", "events")
CODE = find_packages(include=[f"{f}*" for f in FOLDERS])
DATA = find_namespace_packages(include=["events.*"])  # events/data/...: sample data (MANIFEST.in)

setup(
    package_dir={"shardfold": "shardfold", **{f"shardfold.{f}": f for f in FOLDERS}},
    packages=["shardfold", *(f"shardfold.{p}" for p in CODE + DATA)],
)
