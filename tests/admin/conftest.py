"""The one cluster every admin test shares (started once for the package, always stopped), with a
token of each role in its token file."""
from __future__ import annotations

import pytest

from conftest import module_cluster
from kvps.config import ServerConfig

READ_TOKEN = "read-token-for-tests"
WRITE_TOKEN = "write-token-for-tests"


def _add_role_tokens(cluster) -> None:
    with open(cluster.data_dir / "token", "a") as f:  # after the bare (admin) line LocalCluster wrote
        f.write(f"{READ_TOKEN} read\n{WRITE_TOKEN} write\n")


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    server = ServerConfig(nonfinite="skip", body_timeout=1.0)
    yield from module_cluster(tmp_path_factory, "admin", shards=2, server=server,
                              before_start=_add_role_tokens)


@pytest.fixture
def tokens(cluster) -> dict[str, str]:
    """A token of each role: ``{"read": ..., "write": ..., "admin": ...}``."""
    return {"read": READ_TOKEN, "write": WRITE_TOKEN, "admin": cluster.token}
