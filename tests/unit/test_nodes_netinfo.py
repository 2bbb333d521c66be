"""Node address discovery (workflows.netinfo).

There is no InfiniBand hardware here, so the InfiniBand tests read a fake sysfs tree built in a
temporary folder: that tree is the ONLY stand-in in these tests. Everything else is real: the
IPoIB interface of the fake adapter is `lo`, so the real `ip -o -4 addr show dev lo` supplies its
address, and the fallbacks use the real scontrol and DNS.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from workflows import netinfo
from workflows.netinfo import AddressNotFound, IbPort, NodeAddress

IB_GID = "fe80:0000:0000:0000:0002:c903:00f3:9a31"  # a native InfiniBand GID: no IPv4 inside
ROCE_GID = "0000:0000:0000:0000:0000:ffff:0a00:0005"  # RoCE v2, IPv4-mapped 10.0.0.5
EMPTY_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _port(sysfs: Path, device: str, port: int, state: str, link_layer: str, gids: list[str],
          gid_netdevs: dict[int, str] | None = None) -> None:
    port_dir = sysfs / "class" / "infiniband" / device / "ports" / str(port)
    _write(port_dir / "state", state)
    _write(port_dir / "link_layer", link_layer)
    for index, gid in enumerate(gids):
        _write(port_dir / "gids" / str(index), gid)
    for index, netdev in (gid_netdevs or {}).items():
        _write(port_dir / "gid_attrs" / "ndevs" / str(index), netdev)


def _pci_netdev(sysfs: Path, device: str, netdev: str, dev_port: int) -> None:
    _write(sysfs / "class" / "infiniband" / device / "device" / "net" / netdev / "dev_port", str(dev_port))


@pytest.fixture
def ipoib_sysfs(tmp_path: Path) -> Path:
    """mlx5_0: an active IB port whose IPoIB interface is `lo`; mlx5_1: a port that is down."""
    _port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "InfiniBand", [IB_GID, EMPTY_GID])
    _pci_netdev(tmp_path, "mlx5_0", "lo", dev_port=0)
    _port(tmp_path, "mlx5_1", 1, "1: DOWN", "InfiniBand", [IB_GID])
    _pci_netdev(tmp_path, "mlx5_1", "ib1", dev_port=0)
    return tmp_path


def test_sysfs_ports_are_read_in_order(ipoib_sysfs):
    assert netinfo.read_ib_ports(ipoib_sysfs) == [
        IbPort("mlx5_0", 1, True, "InfiniBand", ("lo",), ()),
        IbPort("mlx5_1", 1, False, "InfiniBand", ("ib1",), ()),
    ]


def test_ipoib_address_comes_from_ip_on_the_ports_interface(ipoib_sysfs):
    assert netinfo.ib_address("gpu7", ipoib_sysfs) == NodeAddress("gpu7", "127.0.0.1", "infiniband", "lo", ("mlx5_0",))


def test_roce_address_comes_from_the_gid_table(tmp_path):
    # The interface named by the GID table does not exist here, so `ip` has nothing and the
    # IPv4-mapped GID supplies the address.
    _port(tmp_path, "mlx5_2", 1, "4: ACTIVE", "Ethernet", [IB_GID, ROCE_GID], {1: "no-such-nic0"})
    ports = netinfo.read_ib_ports(tmp_path)
    assert ports == [IbPort("mlx5_2", 1, True, "Ethernet", ("no-such-nic0",), ("10.0.0.5",))]
    assert netinfo.ib_address("n1", tmp_path) == NodeAddress("n1", "10.0.0.5", "roce", "no-such-nic0", ("mlx5_2",))


def test_second_port_of_a_dual_port_adapter_gets_its_own_interface(tmp_path):
    _port(tmp_path, "mlx5_0", 1, "1: DOWN", "InfiniBand", [IB_GID])
    _port(tmp_path, "mlx5_0", 2, "4: ACTIVE", "InfiniBand", [IB_GID])
    _pci_netdev(tmp_path, "mlx5_0", "ib0", dev_port=0)
    _pci_netdev(tmp_path, "mlx5_0", "lo", dev_port=1)
    found = netinfo.ib_address("n1", tmp_path)
    assert (found.address, found.netdev, found.hcas) == ("127.0.0.1", "lo", ("mlx5_0",))


def test_no_active_port_means_no_infiniband_address(tmp_path):
    _port(tmp_path, "mlx5_0", 1, "1: DOWN", "InfiniBand", [IB_GID])
    _pci_netdev(tmp_path, "mlx5_0", "lo", dev_port=0)
    assert netinfo.ib_address("n1", tmp_path) is None


@pytest.fixture
def outside_slurm(monkeypatch):
    """No SLURM_CONF: scontrol fails at once instead of waiting for a cluster that may be down."""
    monkeypatch.delenv("SLURM_CONF", raising=False)


@pytest.mark.usefixtures("outside_slurm")
def test_without_infiniband_the_node_falls_back_to_dns(tmp_path):
    assert netinfo.read_ib_ports(tmp_path) == []
    # Slurm has no NodeAddr for localhost, so DNS answers.
    assert netinfo.local_address("localhost", tmp_path) == NodeAddress("localhost", "127.0.0.1", "dns")


@pytest.mark.usefixtures("outside_slurm")
def test_an_unknown_node_is_an_error_naming_it(tmp_path):
    with pytest.raises(AddressNotFound, match="no address for node 'no-such-node.invalid'"):
        netinfo.local_address("no-such-node.invalid", tmp_path)


def test_netdev_ipv4_reads_ip_output():
    assert "127.0.0.1" in netinfo.netdev_ipv4("lo")
    assert netinfo.netdev_ipv4("no-such-nic0") == []


def test_node_addr_handed_in_wins_over_scontrol_and_bad_entries_are_skipped(monkeypatch, caplog):
    # Inside an image there is no scontrol: the training file hands Slurm's NodeAddr in.
    monkeypatch.setenv("MDPP_NODE_ADDRS", "node1=127.0.0.11, broken ,node2=")
    monkeypatch.setattr(netinfo.slurm, "call", lambda *a, **k: pytest.fail("scontrol must not be asked"))
    assert netinfo.slurm_node_addr("node1") == "127.0.0.11"
    assert netinfo.fallback_address("node1") == NodeAddress("node1", "127.0.0.11", "slurm")
    assert netinfo.given_node_addrs() == {"node1": "127.0.0.11"}
    assert "ignoring 'broken'" in caplog.text and "ignoring 'node2='" in caplog.text
