"""Slurm node lists and the launch environment of a multi-node job.

    python -m workflows.nodes hostnames 'rack[1-2]-node[01-02]' [--parser auto|builtin|scontrol]
    python -m workflows.nodes env        # inside a job: eval "$(python -m workflows.nodes env)"
    python -m workflows.nodes address    # this node's address as one JSON line (what `env` gathers)

`expand_nodelist` gives exactly what `scontrol show hostnames` prints. `scontrol` is used when it is
installed and configured; otherwise a port of Slurm's own parser (src/common/hostlist.c, 22.05)
runs, quirks included, because node names feed MASTER_ADDR and rank placement: a parser that is
"nearly" Slurm's would put ranks on the wrong hosts on exactly the clusters whose names are odd.

`env` prints MASTER_ADDR, MASTER_PORT (from the job id), NODE_IPS (one IPv4 per node, in node-list
order) and, where every node has InfiniBand, NCCL_SOCKET_IFNAME and NCCL_IB_HCA. Each node's
address is found on that node (workflows.netinfo) through one `srun` task per node.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from workflows import netinfo, slurm
from workflows.cli import OneLineParser
from workflows.slurm import SlurmError

log = logging.getLogger(__name__)

# Limits of Slurm 22.05's hostlist.c, so that what it rejects we reject too.
_SEPARATORS = "\t, "  # hostlist_create's token separators
_MAX_RANGE = 64 * 1024  # MAX_RANGE: hosts in one `lo-hi` range
_MAX_PREFIX_COUNT = 64 * 1024  # MAX_PREFIX_CNT: expansions of one earlier bracket group
_ULONG_MAX = 2**64 - 1  # strtoul saturates here on overflow

PARSERS = ("auto", "builtin", "scontrol")


class InvalidNodeList(ValueError):
    """A node list that Slurm rejects; the message names the list and the reason."""

    def __init__(self, nodelist: str, reason: str):
        super().__init__(f"invalid node list {nodelist!r}: {reason}")
        self.nodelist = nodelist
        self.reason = reason


# ------------------------------------------------------------------------------------------
# The builtin parser: a port of hostlist.c's _hostlist_create_bracketed and its helpers.


@dataclass(frozen=True)
class _Range:
    lo: int
    hi: int
    width: int  # zero-padding width: the length of the text of `lo`


class _RangeError(ValueError):
    pass


def _tokens(text: str) -> Iterator[str]:
    """Split at separators, except inside [...] (hostlist.c's _next_tok, scan for scan)."""
    end, size = 0, len(text)
    while True:
        while end < size and text[end] in _SEPARATORS:
            end += 1
        if end >= size:
            return
        start = parse = end
        while True:
            while end < size and text[end] not in _SEPARATORS:
                end += 1
            extended = False
            while True:  # step over the bracket pairs that begin before `end`
                open_at = text.find("[", parse)
                if open_at == -1 or open_at > end:
                    break
                close_at = text.find("]", parse)
                if close_at == -1 or close_at < open_at:
                    break
                if close_at < end:
                    parse = close_at + 1
                    continue
                end, extended = close_at, True  # a separator inside brackets: keep scanning
                break
            if not extended:
                break
        yield text[start:end]


def _strtoul(text: str) -> tuple[int, int]:
    """C's strtoul(text, &end, 10): (value, characters consumed); consumed == 0 when no digits."""
    i = 0
    while i < len(text) and text[i] in " \t\n\v\f\r":
        i += 1
    negative = i < len(text) and text[i] == "-"
    if i < len(text) and text[i] in "+-":
        i += 1
    digits_start = i
    while i < len(text) and "0" <= text[i] <= "9":
        i += 1
    if i == digits_start:
        return 0, 0
    value = min(int(text[digits_start:i]), _ULONG_MAX)
    if negative and value != _ULONG_MAX:  # unsigned negation, as C does it
        value = (-value) & _ULONG_MAX
    return value, i


def _parse_single_range(text: str) -> _Range:
    if "x" in text:  # Slurm reserves `x` for multi-dimensional boxes
        raise _RangeError(f"invalid range `{text}'")
    lo_text, dash, hi_text = text.partition("-")
    if dash and hi_text.startswith("-"):
        raise _RangeError(f"invalid range `{text}' (negative numbers are not allowed)")
    lo, lo_used = _strtoul(lo_text)
    if lo_used == 0:
        raise _RangeError(f"invalid range `{text}'")
    if dash and hi_text:
        hi, hi_used = _strtoul(hi_text)
        if hi_used == 0 or hi_used != len(hi_text):
            raise _RangeError(f"invalid range `{text}'")
    else:
        hi = lo
        if lo_used != len(lo_text):
            raise _RangeError(f"invalid range `{text}'")
    if lo > hi:
        raise _RangeError(f"invalid range `{text}' (descending)")
    if hi - lo + 1 > _MAX_RANGE:
        raise _RangeError(f"too many hosts in range `{text}' (Slurm's limit is {_MAX_RANGE})")
    return _Range(lo, hi, len(lo_text))


def _parse_range_list(text: str) -> list[_Range]:
    return [_parse_single_range(part) for part in text.split(",")]


def _push_range(hosts: list[str], prefix: str, numbers: _Range) -> None:
    hosts.extend(f"{prefix}{n:0{numbers.width}d}" for n in range(numbers.lo, numbers.hi + 1))


def _push_host(hosts: list[str], name: str) -> None:
    """A name without brackets; a numeric suffix is re-printed like Slurm does (saturating)."""
    digits = len(name) - len(name.rstrip("0123456789"))
    if digits == 0:
        hosts.append(name)
    else:
        value = min(int(name[-digits:]), _ULONG_MAX)
        hosts.append(f"{name[:-digits]}{value:0{digits}d}")


def _push_range_list(hosts: list[str], prefix: str, ranges: list[_Range], errors: list[str],
                     nested: bool = False) -> bool:
    """Expand the bracket groups left in `prefix` around the last group's `ranges`.

    Mirrors hostlist.c exactly, including its order (the group nearest the last one varies
    slowest) and that a failure below the first level of recursion is ignored there: the hosts
    pushed so far stay, and only a bad number is reported (Slurm logs it; the count limit it
    does not).
    """
    open_at = prefix.rfind("[")
    close_at = prefix.rfind("]", open_at + 1) if open_at != -1 else -1
    if close_at == -1:
        for numbers in ranges:
            _push_range(hosts, prefix, numbers)
        return True
    head, group, tail = prefix[:open_at], prefix[open_at + 1 : close_at], prefix[close_at + 1 :]
    try:
        prefix_ranges = _parse_range_list(group)
    except _RangeError as error:
        errors.append(str(error))
        return False
    expansions = 0
    for numbers in prefix_ranges:
        expansions += numbers.hi - numbers.lo + 1
        if expansions > _MAX_PREFIX_COUNT:
            if not nested:
                errors.append(f"bracket group [{group}] expands to more than {_MAX_PREFIX_COUNT} names")
            return False
        for n in range(numbers.lo, numbers.hi + 1):
            expanded = f"{head}{n:0{numbers.width}d}{tail}"
            if "[" in head:
                _push_range_list(hosts, expanded, ranges, errors, nested=True)  # result ignored, as in Slurm
            else:
                for inner in ranges:
                    _push_range(hosts, expanded, inner)
    return True


def _expand_token(token: str, hosts: list[str], errors: list[str]) -> bool:
    open_at = token.rfind("[")
    if open_at == -1:
        _push_host(hosts, token)
        return True
    prefix, rest = token[:open_at], token[open_at + 1 :]
    close_at = rest.find("]")
    if close_at == -1:  # an unmatched '[': Slurm takes the name literally and appends a ']'
        _push_host(hosts, f"{prefix}]" if prefix else rest)
        return True
    trailing = rest[close_at + 1 :]
    if trailing and trailing[0] != ",":
        errors.append(f"{trailing!r} follows the last ']' (Slurm allows nothing after the last bracket group)")
        return False
    try:
        ranges = _parse_range_list(rest[:close_at])
    except _RangeError as error:
        errors.append(str(error))
        return False
    return _push_range_list(hosts, prefix, ranges, errors)


def expand_builtin(nodelist: str) -> list[str]:
    """Expand `nodelist` as `scontrol show hostnames` does, without Slurm installed.

    Raises InvalidNodeList where scontrol reports an error. Duplicates and order are kept.
    """
    hosts: list[str] = []
    errors: list[str] = []
    for token in _tokens(nodelist):
        if not _expand_token(token, hosts, errors):
            break
    if errors:  # scontrol also fails when an error was only reported deep in a recursion
        raise InvalidNodeList(nodelist, errors[0])
    return hosts


# ------------------------------------------------------------------------------------------
# scontrol, and the choice between the two


def expand_scontrol(nodelist: str, scontrol: str = "scontrol") -> list[str]:
    """Ask `scontrol show hostnames`; it exits 0 even on bad input, so stderr decides."""
    proc = slurm.call([scontrol, "show", "hostnames", "--", nodelist])  # slurm.COMMAND_TIMEOUT_S
    problems = [line for line in proc.stderr.splitlines() if line.strip()]
    if proc.returncode != 0:
        detail = problems[-1] if problems else f"exit status {proc.returncode}"
        raise SlurmError(f"`{scontrol} show hostnames` failed: {detail}")
    if problems:
        reason = problems[0].removeprefix("scontrol: error: ").removeprefix("_parse_single_range: ")
        raise InvalidNodeList(nodelist, reason)
    # One name per line; an empty line is an empty name (what a lone '[' expands to), so only the
    # final newline is dropped.
    return proc.stdout.split("\n")[:-1] if proc.stdout else []


def expand_nodelist(nodelist: str, parser: str = "auto") -> list[str]:
    """Host names of a Slurm node list, in order, duplicates kept.

    parser: "scontrol" asks Slurm; "builtin" never does; "auto" asks scontrol when it is on PATH
    and works (it needs a slurm.conf), else uses the builtin port.
    """
    if parser not in PARSERS:
        raise ValueError(f"parser={parser!r}: must be one of {', '.join(PARSERS)}")
    if parser == "builtin" or (parser == "auto" and shutil.which("scontrol") is None):
        return expand_builtin(nodelist)
    if parser == "scontrol":
        return expand_scontrol(nodelist)
    try:
        return expand_scontrol(nodelist)
    except SlurmError as error:
        log.warning("%s; expanding %r with the builtin parser", error, nodelist)
        return expand_builtin(nodelist)


# ------------------------------------------------------------------------------------------
# The launch environment of a job

MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000
PROBE_TIMEOUT_S = 60.0


def master_port(job_id: int) -> int:
    """A rendezvous port per job, so that two jobs sharing a node do not collide.

    20000-29999: below Linux's ephemeral ports (32768+) and above the local test cluster's
    daemons (scripts/cluster.sh, 12000-19999). Jobs whose ids differ by 10000 share a port.
    """
    if job_id < 0:
        raise ValueError(f"job_id={job_id}: must be >= 0")
    return MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN


def launch_environment(addresses: Sequence[netinfo.NodeAddress], job_id: int) -> dict[str, str]:
    """MASTER_ADDR/MASTER_PORT/NODE_IPS (+ NCCL_* when every node has InfiniBand), node order kept."""
    if not addresses:
        raise ValueError("launch_environment: no nodes given")
    env = {
        "MASTER_ADDR": addresses[0].address,
        "MASTER_PORT": str(master_port(job_id)),
        "NODE_IPS": ",".join(a.address for a in addresses),
    }
    if all(a.netdev for a in addresses) and all(a.source in netinfo.IB_SOURCES for a in addresses):
        env["NCCL_SOCKET_IFNAME"] = ",".join(dict.fromkeys(a.netdev for a in addresses if a.netdev))
        hcas = dict.fromkeys(h for a in addresses for h in a.hcas)
        if hcas:
            env["NCCL_IB_HCA"] = ",".join(hcas)
    elif any(a.source in netinfo.IB_SOURCES for a in addresses):
        log.warning("only some nodes have InfiniBand (%s): NCCL picks its interfaces itself",
                    ", ".join(f"{a.node}={a.source}" for a in addresses))
    return env


def _probe_with_srun(hosts: Sequence[str], timeout_s: float) -> dict[str, netinfo.NodeAddress]:
    """Run `python -m workflows.nodes address` once on every node of the allocation."""
    repo = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
    n = len(hosts)
    command = [
        "srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--overlap",
        "--kill-on-bad-exit=1", f"--nodelist={','.join(dict.fromkeys(hosts))}",
        sys.executable, "-m", "workflows.nodes", "address",
    ]
    try:
        proc = slurm.call(command, env=env, timeout=timeout_s)
    except SlurmError as error:
        raise SlurmError(f"probing the addresses of {', '.join(hosts)} with srun: {error}") from error
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise SlurmError(f"probing node addresses with srun failed: {tail}")
    return read_reported(proc.stdout.splitlines())


def read_reported(lines: Iterable[str]) -> dict[str, netinfo.NodeAddress]:
    """Node -> address from the JSON lines `address` printed on the nodes (other lines are ignored)."""
    found = {}
    for line in lines:
        if line.startswith("{"):
            address = netinfo.NodeAddress.from_json(line)
            found[address.node] = address
    return found


def node_addresses(hosts: Sequence[str], probe: bool = True, probe_timeout_s: float = PROBE_TIMEOUT_S,
                   reported: dict[str, netinfo.NodeAddress] | None = None) -> list[netinfo.NodeAddress]:
    """One address per host (duplicates resolved once), InfiniBand preferred when probing.

    ``reported``: what the nodes' own `address` said, gathered by the caller (the training file
    does so inside IMAGE); then nothing is probed here.
    """
    unique = list(dict.fromkeys(hosts))
    local = os.environ.get("SLURMD_NODENAME")
    found: dict[str, netinfo.NodeAddress] = {}
    if reported is not None:
        found = reported
    elif probe and unique == [local]:
        found = {local: netinfo.local_address(local)}  # a one-node job: no srun needed
    elif probe and shutil.which("srun") and os.environ.get("SLURM_JOB_ID"):
        try:
            found = _probe_with_srun(unique, probe_timeout_s)
        except SlurmError as error:
            log.warning("%s; using Slurm's NodeAddr or DNS for every node", error)
    if found and (missing := [h for h in unique if h not in found]):
        log.warning("no address reported by %s; using Slurm's NodeAddr or DNS there", ", ".join(missing))
    result = [found.get(host) or netinfo.fallback_address(host) for host in unique]
    by_host = {a.node: a for a in result}
    return [by_host[h] for h in hosts]


def _shell_exports(env: dict[str, str]) -> str:
    return "".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items())


# ------------------------------------------------------------------------------------------
# Command line


def _build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m workflows.nodes", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    hostnames = commands.add_parser("hostnames", help="expand a node list, one host per line")
    hostnames.add_argument("nodelist", help="e.g. 'node[01-04],gpu[1-2]' (use -- before a list starting with '-')")
    hostnames.add_argument("--parser", choices=PARSERS, default="auto")
    env = commands.add_parser("env", help="print the launch environment of this job as shell exports")
    env.add_argument("--nodelist", default=os.environ.get("SLURM_JOB_NODELIST"),
                     help="default: $SLURM_JOB_NODELIST")
    env.add_argument("--job-id", type=int, default=None, help="default: $SLURM_JOB_ID")
    env.add_argument("--no-probe", action="store_true",
                     help="do not run srun on the nodes: Slurm's NodeAddr or DNS only, no InfiniBand")
    env.add_argument("--probe-timeout", type=float, default=PROBE_TIMEOUT_S, metavar="S")
    env.add_argument("--addresses", metavar="FILE", default=None,
                     help="the JSON lines `address` printed on the nodes ('-': standard input), gathered by "
                          "the caller (the training file does so inside IMAGE): no srun here")
    commands.add_parser("address", help="print this node's address as JSON (what env gathers through srun)")
    return parser


def _read_lines(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    try:
        return Path(path).read_text().splitlines()
    except OSError as error:
        raise ValueError(f"--addresses {path}: {error.strerror}") from error


def _job_id(given: int | None) -> int:
    if given is not None:
        return given
    text = os.environ.get("SLURM_JOB_ID", "")
    if not text.isdigit():
        raise ValueError(f"SLURM_JOB_ID={text!r} is not a job id: run inside a Slurm job or pass --job-id")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    # Several nodes write to one job log (`address` runs on each): every line names its node.
    node = os.environ.get("SLURMD_NODENAME") or netinfo.short_hostname()
    logging.basicConfig(level=logging.INFO, format=f"workflows.nodes[{node}]: %(levelname)s: %(message)s")
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "hostnames":
            for host in expand_nodelist(args.nodelist, args.parser):
                print(host)
        elif args.command == "env":
            if not args.nodelist:
                raise ValueError("SLURM_JOB_NODELIST is unset: run inside a Slurm job or pass --nodelist")
            job_id = _job_id(args.job_id)
            hosts = expand_nodelist(args.nodelist)
            if not hosts:
                raise ValueError(f"node list {args.nodelist!r} names no node")
            reported = None
            if args.addresses is not None:
                reported = read_reported(_read_lines(args.addresses))
            addresses = node_addresses(hosts, probe=not args.no_probe, probe_timeout_s=args.probe_timeout,
                                       reported=reported)
            sys.stdout.write(_shell_exports(launch_environment(addresses, job_id)))
        else:
            node = os.environ.get("SLURMD_NODENAME") or netinfo.short_hostname()
            print(netinfo.local_address(node).to_json())
    except (ValueError, SlurmError, netinfo.AddressNotFound) as error:
        print(f"workflows.nodes: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # A job's pre-timeout warning (USR1) reaches every process of the batch step, this probe too
    # while the training script waits for it: it is meant for the ranks, which the script tells.
    # Only when run as the probe: an ignored signal is inherited by every later child process (a
    # bash started with USR1 ignored can never trap it), so main() called in-process must not.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    sys.exit(main())
