"""The package's layout for setuptools: batchgen/ and its subpackages, plus the top-level conf/ shipped inside it as
batchgen.conf (the presets are edited at the top of the checkout and installed with the package). Everything else
about the project is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["batchgen", "batchgen.*"]), "batchgen.conf"],
    package_dir={"batchgen.conf": "conf"},  # its files: pyproject.toml's package-data (which replaces setup()'s)
)
