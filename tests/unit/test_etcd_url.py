"""`--metadata etcd://...` parsing (kera.coordinator.etcd_client.parse_url) and key prefixes."""

import pytest

from kera.coordinator.etcd_client import parse_url, prefix_end
from kera.coordinator.etcd_store import prefix_for


def test_endpoints_are_listed_in_order_with_the_default_port():
    assert parse_url("etcd://a:1,b:2,c") == [("a", 1), ("b", 2), ("c", 2379)]


@pytest.mark.parametrize("url", ["http://a:1", "etcd://", "etcd://a:x", "etcd://a:0",
                                 "etcd://a:1/path", "etcd://a:1,,b:2"])
def test_a_bad_url_is_refused_naming_the_expected_form(url):
    with pytest.raises(ValueError, match="etcd://|HOST:PORT"):
        parse_url(url)


def test_a_prefix_names_one_cluster_and_its_range_ends_after_it():
    assert prefix_for("prod") == "/kera/prod/"
    assert prefix_end("/kera/prod/") == "/kera/prod0"
    with pytest.raises(ValueError):
        prefix_for("a/b")
