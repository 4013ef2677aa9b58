"""Package discovery, the one thing pyproject.toml cannot express: every package under fedlt/ is
found automatically, and cli/ is added as fedlt.cli (the mapping is in pyproject.toml)."""

from setuptools import find_packages, setup

# fedlt/cli may exist as a development symlink to cli/; it is the same package, listed once
setup(packages=[*find_packages(include=["fedlt", "fedlt.*"], exclude=["fedlt.cli", "fedlt.cli.*"]), "fedlt.cli"])
