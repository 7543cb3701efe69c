"""The thread policy of a kvslim process: how many threads torch's OpenMP runtime runs and how its idle
threads wait, chosen by the CLI before torch loads.

Why it matters. torch's CPU wheel parallelizes with GNU OpenMP (``libgomp``, bundled in ``torch/lib``), and
kvslim's C kernel is built with ``-fopenmp`` against the same runtime. Between parallel regions an idle
libgomp thread spins for a while before it sleeps (``OMP_WAIT_POLICY`` unset), or forever
(``ACTIVE``), or not at all (``PASSIVE``). On a machine whose cores are all busy with other work, a
spinning thread burns the core that the thread it waits for needs: issue 30 measured a 16-stream int4
step at 1,887 ms with the runtime's default and 518 ms with ``OMP_WAIT_POLICY=PASSIVE`` at the same load.
A server shares its machine, so kvslim's commands default to ``PASSIVE``; ``scripts/thread_policy.sh``
measures each policy quiet and under load (docs/performance.md, "Thread policy").

The runtime reads ``OMP_WAIT_POLICY`` (and ``OMP_NUM_THREADS``) once, when it loads -- when torch is first
imported. So the policy is environment variables set by the CLI entry (:func:`prepare`, called by
:func:`kvslim.cli.main` before a subcommand's module, and with it torch, is imported); importing kvslim
changes nothing. A library user sets the variable before importing torch::

    OMP_WAIT_POLICY=PASSIVE python my_server.py

kvslim's own C kernels (the linear layers, the paged attention) do not run OpenMP regions: their threads are
the library's own workers (``csrc/kvslim_linear.c``), which spin a bounded while for the next call and then
sleep -- 50 us by default, ``$KVSLIM_POOL_SPIN_US`` (microseconds, 0 sleeps at once) when the library loads, or
:func:`kvslim.kernels.clib.pool_spin_us` at any time. Long enough to span a decode step's Python between two
calls, short enough that an idle process leaves its cores at once (docs/performance.md, "How long the workers
spin").

Rules: the user's environment always wins (``OMP_WAIT_POLICY`` set: kept, whatever kvslim's default); an
explicit ``--omp-wait`` that disagrees with the environment is an error rather than a silent choice;
``--threads N`` sets ``OMP_NUM_THREADS`` when the environment has none (the subcommand also calls
``torch.set_num_threads(N)``). ``KMP_BLOCKTIME`` is Intel OpenMP's spin time: recorded when set, since a
torch built against ``libiomp5`` would read it instead.

No torch at import: :func:`describe` imports it only when asked for the numbers of a running process.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import MutableMapping, Sequence
from dataclasses import asdict, dataclass

from .poolspin import spin_from_env

#: --omp-wait choices: auto (the environment's OMP_WAIT_POLICY, else PASSIVE), passive, active, runtime (the
#: OpenMP runtime's own default: the variable left unset, spin a while then sleep)
WAIT_CHOICES = ("auto", "passive", "active", "runtime")
#: the subcommands that take --threads and --omp-wait (and get the default policy)
COMMANDS = ("bench", "serve")
ENV_WAIT = "OMP_WAIT_POLICY"
ENV_THREADS = "OMP_NUM_THREADS"
#: what a choice sets OMP_WAIT_POLICY to ("" : left unset)
_VALUE = {"passive": "PASSIVE", "active": "ACTIVE", "runtime": ""}


@dataclass(frozen=True)
class ThreadPolicy:
    """What :func:`prepare` chose. wait: ``OMP_WAIT_POLICY`` in force (``PASSIVE``, ``ACTIVE``, or ``""``:
    unset, the runtime's default); wait_source: who chose it (``environment``, ``--omp-wait``, ``kvslim
    default``); threads: ``--threads`` (None: torch's default); before_torch: whether torch was not yet loaded
    when the policy was set (False: a process that imported torch first, e.g. a test calling the CLI in
    process, where the runtime already read its environment and the policy is not in effect)."""

    wait: str
    wait_source: str
    threads: int | None
    before_torch: bool

    def to_dict(self) -> dict:
        return asdict(self)


def choose_wait(flag: str | None, env: MutableMapping[str, str]) -> tuple[str, str]:
    """``(OMP_WAIT_POLICY value, source)`` for ``--omp-wait flag`` (None or ``auto``: the default) and the
    environment ``env``. ValueError for an unknown choice, or an explicit choice the environment contradicts."""
    choice = "auto" if flag is None else str(flag).strip().lower()
    if choice not in WAIT_CHOICES:
        raise ValueError(f"--omp-wait must be one of {', '.join(WAIT_CHOICES)}, got {flag!r}")
    current = env.get(ENV_WAIT)
    have = current.strip().upper() if current is not None else None
    if choice == "auto":
        return (have, "environment") if have is not None else ("PASSIVE", "kvslim default")
    want = _VALUE[choice]
    if have is not None and have != want:
        raise ValueError(
            f"--omp-wait {choice} contradicts {ENV_WAIT}={current} in the environment: the environment would "
            f"win, so unset {ENV_WAIT} or drop the flag (--omp-wait auto keeps the environment's)"
        )
    return want, "--omp-wait"


def _scan(argv: Sequence[str]) -> argparse.Namespace:
    """--threads and --omp-wait out of a subcommand's arguments (the subcommand's own parser checks the rest
    later, --threads' value included)."""
    scan = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    scan.add_argument("--threads", default=None)
    scan.add_argument("--omp-wait", default=None)
    try:
        known, _ = scan.parse_known_args(list(argv))
    except SystemExit:  # a flag without its value: the real parser says so
        return argparse.Namespace(threads=None, omp_wait=None)
    return known


def prepare(command: str, argv: Sequence[str], env: MutableMapping[str, str] | None = None) -> ThreadPolicy | None:
    """Set the thread policy's environment for ``kvslim command argv`` (the arguments after the command),
    before torch loads. None for a command outside :data:`COMMANDS` (nothing set). ValueError for a bad
    ``--omp-wait`` (one line)."""
    if command not in COMMANDS:
        return None
    env = os.environ if env is None else env
    args = _scan(argv)
    wait, source = choose_wait(args.omp_wait, env)
    spin_from_env(env)  # a bad value is refused here, not warned about when the kernels load
    if wait and source != "environment":  # the user's own value is left exactly as it is
        env[ENV_WAIT] = wait
    threads = None
    try:
        threads = int(args.threads) if args.threads is not None else None
    except ValueError:
        threads = None  # the subcommand's parser reports it
    if threads is not None and threads >= 1 and not env.get(ENV_THREADS):
        env[ENV_THREADS] = str(threads)
    return ThreadPolicy(wait=wait, wait_source=source, threads=threads, before_torch="torch" not in sys.modules)


def add_thread_flags(parser: argparse.ArgumentParser) -> None:
    """--threads and --omp-wait for a subcommand in :data:`COMMANDS` (parsed early by :func:`prepare`)."""
    parser.add_argument(
        "--threads", type=int, default=None, metavar="T",
        help="torch threads (default: torch's; sets OMP_NUM_THREADS too when the environment has none)",
    )
    parser.add_argument(
        "--omp-wait",
        default="auto",
        choices=WAIT_CHOICES,
        help="how idle OpenMP threads wait: passive (sleep at once), active (spin), runtime (the OpenMP "
        "runtime's default: spin a while, then sleep), auto (default: the environment's OMP_WAIT_POLICY, else "
        "passive: spinning threads collapse a step on a machine shared with other work; docs/performance.md)",
    )


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages, or None where the system has none."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except (OSError, AttributeError):
        return None


def describe(policy: ThreadPolicy | None = None) -> dict:
    """The thread settings of this process now, for a banner and a JSON report: the policy chosen, the
    variables in force, torch's thread counts (imports torch), the CPU count and the load average."""
    import torch

    env = os.environ
    out = {
        "omp_wait_policy": env.get(ENV_WAIT) or "",
        "wait_source": policy.wait_source if policy else ("environment" if env.get(ENV_WAIT) else "unset"),
        "omp_num_threads": env.get(ENV_THREADS) or "",
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpus": os.cpu_count(),
        "load_average": load_average(),
        "in_effect": policy.before_torch if policy else None,
    }
    if env.get("KMP_BLOCKTIME"):
        out["kmp_blocktime"] = env["KMP_BLOCKTIME"]
    if env.get("GOMP_SPINCOUNT"):
        out["gomp_spincount"] = env["GOMP_SPINCOUNT"]
    from .kernels.clib import pool_spin_us

    out["pool_spin_us"] = pool_spin_us()
    return out


def banner(info: dict) -> str:
    """One line for a command's banner, from :func:`describe`."""
    wait = info["omp_wait_policy"] or "unset (runtime default: spin, then sleep)"
    load = info["load_average"]
    extra = "".join(f", {k.upper()}={info[k]}" for k in ("kmp_blocktime", "gomp_spincount") if k in info)
    if info.get("pool_spin_us") is not None:
        extra += f"; kvslim's workers spin {info['pool_spin_us']} us"
    late = "" if info["in_effect"] is not False else " (set after torch loaded: not in effect)"
    return (
        f"threads: {info['torch_threads']} torch threads of {info['cpus']} CPUs; OMP_WAIT_POLICY {wait} "
        f"({info['wait_source']}){late}{extra}; load average {'n/a' if load is None else ' '.join(map(str, load))}"
    )
