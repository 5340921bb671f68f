"""Prefect's block standards, run against every block type this package ships."""

from __future__ import annotations

import re
import socket
from importlib.metadata import entry_points
from urllib.parse import urlparse

import pytest
from prefect.blocks.core import Block
from prefect.testing.standard_test_suites import BlockStandardTestSuite
from prefect.utilities.dispatch import get_registry_for_type
from prefect.utilities.importtools import to_qualified_name


def shipped_blocks() -> list[type[Block]]:
    """The block types this package's collection entry point names, as Prefect looks them up.

    Those are what a user saves, loads and sees in the UI. Block classes the package uses
    internally (`PodGcsBucket`, which a pod gets in a saved `GcsBucket`'s place and which
    is never saved) are in Prefect's registry too once imported, but are not shipped.
    """
    (collection,) = entry_points(group="prefect.collections", name="kinetic_prefect")
    plugin = collection.load()
    registry = get_registry_for_type(Block) or {}
    blocks = [registry[slug] for slug in plugin.BLOCK_TYPES]
    assert all(to_qualified_name(b).startswith("kinetic_prefect.") for b in blocks), blocks
    return sorted(blocks, key=lambda b: b.__name__)


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


@pytest.mark.parametrize("block", shipped_blocks(), ids=lambda b: b.__name__)
class TestShippedBlocksMeetPrefectStandards(BlockStandardTestSuite):
    @pytest.fixture
    def block(self, block: type[Block]) -> type[Block]:
        return block

    def test_has_a_valid_image(self, block: type[Block]) -> None:
        # The suite downloads the logo; without a route to its host there is nothing to check.
        host = urlparse(str(block._logo_url)).hostname or ""
        if not _resolves(host):
            pytest.skip(f"the logo's host {host!r} cannot be reached from here")
        super().test_has_a_valid_image(block)

    def test_logo_is_the_google_cloud_logo_prefect_gcp_ships(self, block: type[Block]) -> None:
        from prefect_gcp.credentials import GcpCredentials

        assert block._logo_url == GcpCredentials._logo_url

    def test_documentation_url_is_this_package(self, block: type[Block]) -> None:
        assert "kinetic-prefect" in str(block._documentation_url)

    def test_every_code_example_compiles(self, block: type[Block]) -> None:
        snippets = re.findall(r"```python\n(.*?)```", block.get_code_example() or "", re.S)

        assert snippets
        for snippet in snippets:
            compile(snippet, f"<{block.__name__} example>", "exec")

    def test_slug_is_the_kebab_case_of_the_type_name(self, block: type[Block]) -> None:
        expected = re.sub(r"[^a-z0-9]+", "-", block.get_block_type_name().lower())

        assert block.get_block_type_slug() == expected


def test_both_block_types_are_found_through_the_entry_point():
    from kinetic_prefect.blocks import KineticCluster, KineticGcpCredentials

    assert {KineticCluster, KineticGcpCredentials} <= set(shipped_blocks())


def test_every_block_class_of_the_package_is_shipped_or_internal():
    """A new block type is named by the entry point, or listed here as internal."""
    import kinetic_prefect.blocks.cluster
    import kinetic_prefect.blocks.credentials  # noqa: F401
    from kinetic_prefect.common.prefect_pod_storage import PodGcsBucket

    def subclasses(cls: type) -> set[type]:
        return {s for c in cls.__subclasses__() for s in {c, *subclasses(c)}}

    ours = {c for c in subclasses(Block) if c.__module__.startswith("kinetic_prefect.")}

    assert ours == {*shipped_blocks(), PodGcsBucket}


def test_shipped_blocks_register_with_a_prefect_server(prefect_api: str):
    from prefect.client.orchestration import get_client

    for block in shipped_blocks():
        block.register_type_and_schema()

    with get_client(sync_client=True) as client:
        stored = {
            b.__name__: client.read_block_type_by_slug(b.get_block_type_slug())
            for b in shipped_blocks()
        }

    assert {name: str(t.logo_url) for name, t in stored.items()} == {
        b.__name__: str(b._logo_url) for b in shipped_blocks()
    }
    assert all(t.code_example and t.description for t in stored.values())
