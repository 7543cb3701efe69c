"""What ``kvslim serve`` does when told nothing: conversations kept in bounded, compressed caches.

- **Cache: int8.** The near-lossless formats of docs/quality.md's table (SmolLM2-135M, GPL-3, 384 decode
  steps) are int8 (mean KL 1.2e-5, top-1 100%, perplexity +0.1%, greedy match without a residual 0.917) and
  q8_0 (mean KL 3.2e-5, top-1 99.2%, perplexity -0.1%, greedy 0.875). int8 is the closer of the two for 3%
  more bytes per token (12.6 KB vs 12.3 KB per token at 128K tokens, about 1.8x smaller than fp16). No
  window: a window loses what leaves it, which is not near-lossless; the memory budget is the bound.
- **Memory budget: half of the memory available** when the server starts (the model already loaded): the
  kernel's ``MemAvailable`` (or a cgroup's limit, whichever is lower) for a CPU device, the free memory of
  the GPU for a CUDA device. The other half is the room for activations, the tokenizer and the rest.
- **Sessions:** at most 1000 kept, each for 24 hours after its last turn.
- **Queue:** 256 requests waiting at most (then 429 with Retry-After); prompts up to the model's context.
- **Prefill: 128 prompt tokens a step**, not the engine's 256: a step that carries a long prompt's chunk
  costs about its tokens, and every other prompt may wait through one or two of them. Measured with a
  50,995-token prompt among 15 conversations (docs/serving.md, "A long prompt among 15 conversations"): the
  others' time to first token p99 1.43x its value without the long prompt at 128, 2.23x at 256; the long
  prompt's own prefill 274 s instead of 238 s.
- **Bodies:** 8 MiB at most. **Shutdown:** 5 s of grace for requests in flight.

Light on purpose: importing this imports neither torch nor starlette (the CLI's ``--help`` reads it).
"""

from __future__ import annotations

import os

DEFAULT_CACHE = "int8"
#: prompt tokens a step reads (the module docstring: measured against 256)
DEFAULT_PREFILL_CHUNK = 128
#: the share of the available memory the default budget takes
BUDGET_FRACTION = 0.5
DEFAULT_MAX_SESSIONS = 1000
DEFAULT_SESSION_TTL = 24 * 3600.0
DEFAULT_MAX_QUEUE = 256
DEFAULT_SHUTDOWN_GRACE = 5.0
#: the largest request body read (bytes): a prompt of this many bytes is far past any context
MAX_BODY = 8 << 20
#: the budget when the machine does not say what it has available
FALLBACK_BUDGET = 2 << 30


def default_memory_budget(device: str = "cpu", fraction: float = BUDGET_FRACTION) -> tuple[int, str]:
    """``(bytes, how it was found)``: ``fraction`` of the memory available to caches on ``device`` now."""
    if str(device).startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return max(1, int(free * fraction)), f"{fraction:.0%} of {_gib(free)} free on {device}"
    available, source = available_memory()
    if available is None:
        return FALLBACK_BUDGET, f"{_gib(FALLBACK_BUDGET)}: the available memory is unknown on this machine"
    return max(1, int(available * fraction)), f"{fraction:.0%} of {_gib(available)} available ({source})"


def available_memory() -> tuple[int | None, str]:
    """Bytes this process could still take: the lower of the kernel's ``MemAvailable`` and the room left
    under a cgroup memory limit (a container's), with where it came from; ``(None, ...)`` when unknown."""
    found: list[tuple[int, str]] = []
    meminfo = _meminfo_available()
    if meminfo is not None:
        found.append((meminfo, "MemAvailable"))
    cgroup = _cgroup_room()
    if cgroup is not None:
        found.append((cgroup, "cgroup limit"))
    if not found:
        try:  # free pages only (no page cache): a lower bound, on systems without /proc
            found.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages"))
        except (ValueError, OSError, AttributeError):
            return None, "unknown"
    return min(found)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """The room left under this process's cgroup memory limit (v2, then v1); None without a limit."""
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:  # "max", or v1's "no limit" (a huge number)
            return None
        return max(0, int(limit) - usage)
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
