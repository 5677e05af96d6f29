"""The compatibility corpus (a package, so its conftest is not the tests/ one)."""
