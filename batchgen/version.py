"""The package version: its own module, so that modules needing it never import the package back."""

__version__ = "0.1.0"
