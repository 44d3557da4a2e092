"""A package so that ``conftest.py``'s package-scoped cluster is started once for every module here."""
