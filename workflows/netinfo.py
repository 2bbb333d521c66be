"""Which IPv4 address a node is reached at, found on that node.

Preference: its InfiniBand address (IPoIB, or RoCE's Ethernet address), so that the rendezvous and
NCCL's bootstrap run over the fast fabric; else the address Slurm knows it by (NodeAddr, from
`scontrol show node`); else DNS. Sources of InfiniBand facts, in order: sysfs
(/sys/class/infiniband/<hca>/ports/<n>/{state,link_layer,gids,gid_attrs/ndevs}, and
<hca>/device/net/<netdev> for IPoIB interfaces) plus `ip -o -4 addr show dev <netdev>`; pyverbs,
when importable, where sysfs shows no InfiniBand class (some containers hide it).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import socket
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer.problems import raise_if_any
from workflows import slurm

log = logging.getLogger(__name__)

IB_SOURCES = ("infiniband", "roce")
SOURCES = (*IB_SOURCES, "slurm", "dns")
COMMAND_TIMEOUT_S = 20.0
_INET = re.compile(r"\binet (\d{1,3}(?:\.\d{1,3}){3})/")
_NODE_ADDR = re.compile(r"\bNodeAddr=(\S+)")


class AddressNotFound(RuntimeError):
    """No way to reach a node was found; the message names the node and what was tried."""


@dataclass(frozen=True)
class IbPort:
    """One port of one InfiniBand/RoCE adapter, as sysfs (or pyverbs) describes it."""

    device: str
    """Adapter (HCA) name, e.g. mlx5_0: what NCCL_IB_HCA lists."""
    port: int
    """Port number, from 1."""
    active: bool
    """The port's state is ACTIVE (a cable, a subnet manager, a link)."""
    link_layer: str
    """"InfiniBand" (native IB, IPoIB interfaces) or "Ethernet" (RoCE)."""
    netdevs: tuple[str, ...]
    """Network interfaces of this port: ib0 for IPoIB, the Ethernet NIC for RoCE."""
    gid_ipv4: tuple[str, ...]
    """IPv4 addresses embedded in the port's GID table (RoCE v2 GIDs are ::ffff:a.b.c.d)."""


@dataclass(frozen=True)
class NodeAddress:
    """How to reach one node."""

    node: str
    """Slurm node name."""
    address: str
    """Dotted IPv4 address."""
    source: str
    """Where it came from: infiniband, roce, slurm (NodeAddr) or dns."""
    netdev: str | None = None
    """The interface carrying `address` when known (an InfiniBand source): NCCL_SOCKET_IFNAME."""
    hcas: tuple[str, ...] = ()
    """Active InfiniBand adapters of the node: NCCL_IB_HCA."""

    def __post_init__(self):
        errors = []
        if not self.node:
            errors.append("node='' must name a node")
        try:
            ipaddress.IPv4Address(self.address)
        except ValueError:
            errors.append(f"address={self.address!r} is not an IPv4 address")
        if self.source not in SOURCES:
            errors.append(f"source={self.source!r} is not one of {', '.join(SOURCES)}")
        raise_if_any(errors, "NodeAddress")
        object.__setattr__(self, "hcas", tuple(self.hcas))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> NodeAddress:
        return cls(**json.loads(text))


def _read(path: Path) -> str | None:
    """A sysfs attribute, stripped; None where it is absent or unreadable (IB ports EINVAL on ndevs)."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _numbered(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def _gid_ipv4(gid_text: str | None) -> str | None:
    """The IPv4 address in an IPv4-mapped GID (RoCE v2), else None (IB GIDs, empty entries)."""
    if not gid_text:
        return None
    try:
        mapped = ipaddress.IPv6Address(gid_text).ipv4_mapped
    except ValueError:
        return None
    return str(mapped) if mapped is not None and not mapped.is_unspecified else None


def _pci_netdevs_by_port(device_dir: Path) -> dict[int, list[str]]:
    """Interfaces that share the adapter's PCI function, keyed by port (dev_port counts from 0)."""
    by_port: dict[int, list[str]] = {}
    net = device_dir / "device" / "net"
    if not net.is_dir():
        return by_port
    for netdev in sorted(net.iterdir()):
        dev_port = _read(netdev / "dev_port")
        port = int(dev_port) + 1 if dev_port and dev_port.isdigit() else 1
        by_port.setdefault(port, []).append(netdev.name)
    return by_port


def read_ib_ports(sysfs: Path = Path("/sys")) -> list[IbPort]:
    """Every InfiniBand/RoCE port that sysfs shows, in adapter then port order."""
    root = sysfs / "class" / "infiniband"
    if not root.is_dir():
        return []
    ports = []
    for device_dir in sorted(root.iterdir()):
        pci_netdevs = _pci_netdevs_by_port(device_dir)
        for port_dir in _numbered(device_dir / "ports"):
            port = int(port_dir.name)
            state = _read(port_dir / "state") or ""  # e.g. "4: ACTIVE"
            gid_netdevs = (_read(p) for p in _numbered(port_dir / "gid_attrs" / "ndevs"))
            netdevs = dict.fromkeys([*pci_netdevs.get(port, []), *(n for n in gid_netdevs if n)])
            gids = (_gid_ipv4(_read(p)) for p in _numbered(port_dir / "gids"))
            ports.append(IbPort(
                device=device_dir.name, port=port, active=state.split(":")[-1].strip() == "ACTIVE",
                link_layer=_read(port_dir / "link_layer") or "InfiniBand",
                netdevs=tuple(netdevs), gid_ipv4=tuple(dict.fromkeys(g for g in gids if g)),
            ))
    return ports


def read_ib_ports_pyverbs() -> list[IbPort]:
    """The same facts through pyverbs (rdma-core's Python binding); [] when it is not installed.

    Only consulted where sysfs has no InfiniBand class. Netdevs are not known to verbs, so RoCE
    addresses come from the GID table and IPoIB ones are not found this way.
    """
    try:
        from pyverbs.device import Context, get_device_list  # type: ignore[import-not-found]
    except ImportError:
        return []
    ports = []
    try:
        for device in get_device_list():
            name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
            with Context(name=name) as context:
                for port in range(1, context.query_device().phys_port_cnt + 1):
                    attr = context.query_port(port)
                    gids = []
                    for index in range(attr.gid_tbl_len):
                        try:
                            gids.append(_gid_ipv4(str(context.query_gid(port, index))))
                        except Exception:  # noqa: BLE001 - unpopulated GID slots raise on some kernels
                            continue
                    ports.append(IbPort(
                        device=name, port=port, active=attr.state == 4,  # IBV_PORT_ACTIVE
                        link_layer="Ethernet" if attr.link_layer == 2 else "InfiniBand",  # IBV_LINK_LAYER_ETHERNET
                        netdevs=(), gid_ipv4=tuple(dict.fromkeys(g for g in gids if g)),
                    ))
    except Exception as error:  # noqa: BLE001 - a broken verbs stack must not stop the launch
        log.warning("pyverbs could not list InfiniBand ports (%s); ignoring it", error)
        return []
    return ports


def netdev_ipv4(netdev: str) -> list[str]:
    """IPv4 addresses of one interface, from `ip -o -4 addr show dev <netdev>`."""
    try:
        proc = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", netdev],
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired) as error:
        log.warning("could not ask `ip` for the addresses of %s: %s", netdev, error)
        return []
    return _INET.findall(proc.stdout) if proc.returncode == 0 else []


def ib_address(node: str, sysfs: Path = Path("/sys")) -> NodeAddress | None:
    """This node's InfiniBand (or RoCE) IPv4 address, or None when it has no usable active port."""
    ports = read_ib_ports(sysfs) if (sysfs / "class" / "infiniband").is_dir() else read_ib_ports_pyverbs()
    active = [p for p in ports if p.active]
    hcas = tuple(dict.fromkeys(p.device for p in active))
    for port in active:
        source = "infiniband" if port.link_layer == "InfiniBand" else "roce"
        for netdev in port.netdevs:
            for address in netdev_ipv4(netdev):
                return NodeAddress(node, address, source, netdev, hcas)
        if port.gid_ipv4:
            return NodeAddress(node, port.gid_ipv4[0], "roce", port.netdevs[0] if port.netdevs else None, hcas)
    if ports and not active:
        log.info("%s: InfiniBand adapters present but no port is ACTIVE", node)
    return None


# "node1=10.0.0.1,node2=10.0.0.2": Slurm's NodeAddr of each node, handed into a container (which has
# no scontrol) by the training sbatch file, which reads them on the host.
NODE_ADDRS_ENV = "MDPP_NODE_ADDRS"


def given_node_addrs(text: str | None = None) -> dict[str, str]:
    """Node -> NodeAddr from $MDPP_NODE_ADDRS (or ``text``); malformed entries are named and skipped."""
    text = os.environ.get(NODE_ADDRS_ENV, "") if text is None else text
    found = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        node, sep, addr = entry.partition("=")
        if not sep or not node or not addr:
            log.warning("%s: ignoring %r (expected node=address)", NODE_ADDRS_ENV, entry)
            continue
        found[node] = addr
    return found


def slurm_node_addr(node: str) -> str | None:
    """The NodeAddr Slurm has for `node` ($MDPP_NODE_ADDRS, else `scontrol show node`), or None."""
    given = given_node_addrs().get(node)
    if given:
        return given
    try:
        proc = slurm.call(["scontrol", "show", "node", "-o", node], timeout=COMMAND_TIMEOUT_S)
    except slurm.SlurmError as error:
        log.debug("scontrol show node %s: %s", node, error)
        return None
    match = _NODE_ADDR.search(proc.stdout) if proc.returncode == 0 else None
    return match.group(1) if match else None


def dns_ipv4(name: str) -> str | None:
    try:
        infos = socket.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return infos[0][4][0] if infos else None


def fallback_address(node: str) -> NodeAddress:
    """Slurm's NodeAddr (resolved when it is a name), else DNS of the node name."""
    node_addr = slurm_node_addr(node)
    if node_addr:
        address = node_addr if _is_ipv4(node_addr) else dns_ipv4(node_addr)
        if address:
            return NodeAddress(node, address, "slurm")
    address = dns_ipv4(node)
    if address:
        return NodeAddress(node, address, "dns")
    raise AddressNotFound(
        f"no address for node {node!r}: Slurm's NodeAddr is {node_addr or 'unknown'} "
        f"and DNS does not resolve {node!r}"
    )


def local_address(node: str, sysfs: Path = Path("/sys")) -> NodeAddress:
    """How other nodes reach this one: InfiniBand first, then Slurm's NodeAddr, then DNS."""
    found = ib_address(node, sysfs) or fallback_address(node)
    log.debug("%s: %s (%s)", node, found.address, found.source)
    return found


def short_hostname() -> str:
    return socket.gethostname().split(".")[0]


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True
