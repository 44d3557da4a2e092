"""The ``kvps`` command line (``main``) and the commands that talk to a running cluster.

- ``main``: argument parsing and dispatch (the composition root of every kvps process)
- ``status``: ``kvps status``
- ``snapshot``: ``kvps snapshot ...`` and ``kvps export --snapshot``
- ``transfer``: ``kvps export`` and ``kvps import`` of the live state
- ``membership``: ``kvps node join`` and ``kvps node drain``
"""
