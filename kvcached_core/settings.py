"""The settings an engine passes to kvcached_core, and how they are read from the environment.

This module is the only reader of `KVCACHED_*` variables. Every module takes its settings from
`current_settings()`: the process's settings, parsed once and parsed again only when a
`KVCACHED_*` variable changed (so a test or a launcher that sets one is seen, and an engine
step does not re-parse anything). A bad value raises `KVCachedConfigError` naming the variable,
so a typo in a deployment fails at startup instead of running with a silent default.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from kvcached_core.errors import KVCachedConfigError

# A budget's name is part of its shared record's file name (kvcached_core/budget.py).
_BUDGET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def validate_budget_name(name: str) -> str:
    if not _BUDGET_NAME.match(name):
        raise KVCachedConfigError(
            f"invalid budget name {name!r}: use letters, digits, '_', '-', '.' (at most 128)"
        )
    return name

MIB = 1 << 20

# Binary units only: "2G" and "2GiB" and "2GB" all mean 2 * 2**30.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
# KVCACHED_LAYOUT -> `KVCachedSettings.contiguous_layout` (None: the integration decides).
_LAYOUTS: dict[str, bool | None] = {"auto": None, "per-layer": False, "contiguous": True}
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9_]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse a byte size such as `512M`, `2G`, `1.5GiB`, `1_000_000` (binary units).

    Raises ValueError with the reason when the text is not a whole, non-negative byte count.
    """
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"invalid size {text!r} (examples: 512M, 2G, 1.5GiB, 1_000_000)")
    number, unit = match.groups()
    multiplier = _UNITS.get(unit.lower())
    if multiplier is None:
        raise ValueError(f"invalid size {text!r}: unknown unit {unit!r} (use B, K, M, G, T)")
    try:
        value = Decimal(number.replace("_", "").replace(",", "")) * multiplier
    except InvalidOperation as exc:
        raise ValueError(f"invalid size {text!r}") from exc
    if value != value.to_integral_value():
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return int(value)


def format_size(num_bytes: int) -> str:
    """Human-readable binary size: 1.5GiB, 512MiB, 4096B."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"


@dataclass(frozen=True)
class KVCachedSettings:
    """Runtime settings of one engine's KV pool.

    `contiguous_layout`: `KVCACHED_LAYOUT`: True (`contiguous`, one compound page per logical
    page for all layers), False (`per-layer`, one page per layer), None (`auto`, the default:
    the engine integration takes contiguous wherever its KV layout allows it; vLLM decides per
    attention layout in `integration/vllm/kv_buffers.py`, other callers take per-layer).
    `max_cached_tokens`: prefix-cache cap in tokens (< 0 unlimited, 0 disables caching).
    `budget`: name of the host-wide memory budget the pool charges its pages to (None: none).
    `zero_page_writable`: `KVCACHED_ZERO_PAGE=writable|read-only`; None leaves the choice to
    the engine integration (vLLM picks writable: its dummy runs write KV for padding tokens
    into blocks no request owns).
    `min_reserved_pages` / `max_reserved_pages`: bounds of the page allocator's *reserve*, the
    warm pages it keeps mapped ahead of demand (no block is in them). "Reserve" means only that
    in this project; blocks the ledger keeps out of circulation are "set aside".
    `virtual_size_bytes`: `KVCACHED_VIRTUAL_SIZE`, address space for the KV cache of all layers
    (None: the engine's own sizing). `pool_name`: `KVCACHED_POOL_NAME` (None: the engine picks
    one from its pid). `ipc_timeout_s`: `KVCACHED_IPC_TIMEOUT`, seconds one exchange with worker
    processes may take. `shm_dir`: `KVCACHED_SHM_DIR`, where limit records, budgets and the
    devices' start-up windows live. `start_window_timeout_s`: `KVCACHED_START_WINDOW_TIMEOUT`,
    seconds an elastic engine waits for another engine's start-up window on its device before
    it takes its memory snapshot anyway (`startup_memory.acquire_startup_window`).
    `scheduler_only`: `KVCACHED_SCHEDULER_ONLY=1` declares a process that runs an engine's
    scheduler with no KV buffers (planning, the engine's own scheduler tests): its block pools
    get a host-memory ledger each, and never attach to a pool registered in the process (KV
    buffers a test allocates on their own). Without it an elastic scheduler whose KV buffers are not
    VMM-backed refuses to start.
    """

    # Only patched engines read these settings, and a patched engine is elastic unless told
    # otherwise (`KVCACHED_ENABLE=0` makes it behave exactly as the stock engine).
    enabled: bool = True
    page_size: int = 2 * MIB
    contiguous_layout: bool | None = None
    min_reserved_pages: int = 5
    max_reserved_pages: int = 10
    prealloc: bool = True
    physical_limit_bytes: int | None = None
    max_cached_tokens: int = 16000
    defer_physical_release: bool = False
    budget: str | None = None
    zero_page_writable: bool | None = None
    virtual_size_bytes: int | None = None
    pool_name: str | None = None
    ipc_timeout_s: float = 60.0
    shm_dir: str = "/dev/shm"
    scheduler_only: bool = False
    start_window_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size % 4096:
            raise KVCachedConfigError(
                f"page_size must be a positive multiple of 4096 bytes, got {self.page_size}"
            )
        if self.min_reserved_pages < 0 or self.max_reserved_pages < 0:
            raise KVCachedConfigError("min_reserved_pages and max_reserved_pages must be >= 0")
        if self.min_reserved_pages > self.max_reserved_pages:
            raise KVCachedConfigError(
                f"min_reserved_pages ({self.min_reserved_pages}) exceeds "
                f"max_reserved_pages ({self.max_reserved_pages})"
            )
        if self.physical_limit_bytes is not None and self.physical_limit_bytes < 0:
            raise KVCachedConfigError("physical_limit_bytes must be >= 0")
        if self.budget is not None:
            validate_budget_name(self.budget)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KVCachedSettings:
        """Read `KVCACHED_*` variables (unset ones keep their defaults)."""
        env = os.environ if environ is None else environ
        defaults = cls()
        reserved_min = _int(env, "KVCACHED_MIN_RESERVED_PAGES", defaults.min_reserved_pages)
        reserved_max = _int(env, "KVCACHED_MAX_RESERVED_PAGES", defaults.max_reserved_pages)
        if reserved_min < 0:
            raise KVCachedConfigError(
                f"KVCACHED_MIN_RESERVED_PAGES must be >= 0, got {reserved_min}"
            )
        if reserved_max < reserved_min:
            raise KVCachedConfigError(
                f"KVCACHED_MAX_RESERVED_PAGES={reserved_max} is below "
                f"KVCACHED_MIN_RESERVED_PAGES={reserved_min}"
            )
        page_size = _size(env, "KVCACHED_PAGE_SIZE", defaults.page_size)
        if page_size is None or page_size <= 0 or page_size % 4096:
            raise KVCachedConfigError(
                f"KVCACHED_PAGE_SIZE must be a positive multiple of 4096 bytes, got {page_size}"
            )
        layout = env.get("KVCACHED_LAYOUT", "auto").strip().lower()
        if layout not in _LAYOUTS:
            raise KVCachedConfigError(
                f"KVCACHED_LAYOUT must be 'auto', 'per-layer' or 'contiguous', got {layout!r}"
            )
        return cls(
            enabled=_flag(env, "KVCACHED_ENABLE", defaults.enabled),
            page_size=page_size,
            contiguous_layout=_LAYOUTS[layout],
            min_reserved_pages=reserved_min,
            max_reserved_pages=reserved_max,
            prealloc=_flag(env, "KVCACHED_PREALLOC", defaults.prealloc),
            physical_limit_bytes=_size(env, "KVCACHED_PHYSICAL_LIMIT", None),
            max_cached_tokens=_int(env, "KVCACHED_MAX_CACHED_TOKENS", defaults.max_cached_tokens),
            defer_physical_release=_flag(
                env, "KVCACHED_DEFER_PHYSICAL_RELEASE", defaults.defer_physical_release
            ),
            budget=_budget_name(env),
            zero_page_writable=_zero_page(env),
            virtual_size_bytes=_size(env, "KVCACHED_VIRTUAL_SIZE", None),
            pool_name=env.get("KVCACHED_POOL_NAME", "").strip() or None,
            ipc_timeout_s=_seconds(env, "KVCACHED_IPC_TIMEOUT", defaults.ipc_timeout_s),
            shm_dir=env.get("KVCACHED_SHM_DIR", "").strip() or defaults.shm_dir,
            scheduler_only=_flag(env, "KVCACHED_SCHEDULER_ONLY", defaults.scheduler_only),
            start_window_timeout_s=_seconds(env, "KVCACHED_START_WINDOW_TIMEOUT",
                                            defaults.start_window_timeout_s),
        )


_ENV_PREFIX = "KVCACHED_"
_current_lock = threading.Lock()
_current: tuple[tuple[tuple[str, str], ...], KVCachedSettings] | None = None


def current_settings(environ: Mapping[str, str] | None = None) -> KVCachedSettings:
    """The process's settings (`environ`: parse that mapping instead, uncached).

    Parsed from `os.environ` on first use and again only when a `KVCACHED_*` variable was set,
    changed or removed since; otherwise the parsed object is returned as it is.
    """
    global _current
    if environ is not None:
        return KVCachedSettings.from_env(environ)
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIX)))
    with _current_lock:
        cached = _current
    if cached is not None and cached[0] == key:
        return cached[1]
    parsed = KVCachedSettings.from_env(dict(key))
    with _current_lock:
        _current = (key, parsed)
    return parsed


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise KVCachedConfigError(f"{name} must be a boolean (1/0, true/false, yes/no), got {raw!r}")


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw.strip().replace("_", ""))
    except ValueError:
        raise KVCachedConfigError(f"{name} must be an integer, got {raw!r}") from None


def _size(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return parse_size(raw)
    except ValueError as exc:
        raise KVCachedConfigError(f"{name}: {exc}") from None


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise KVCachedConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise KVCachedConfigError(f"{name}={raw!r} must be a positive number of seconds")
    return value


def _budget_name(env: Mapping[str, str]) -> str | None:
    raw = env.get("KVCACHED_BUDGET", "").strip()
    if not raw:
        return None
    try:
        return validate_budget_name(raw)
    except KVCachedConfigError as exc:
        raise KVCachedConfigError(f"KVCACHED_BUDGET: {exc}") from None


def _zero_page(env: Mapping[str, str]) -> bool | None:
    raw = env.get("KVCACHED_ZERO_PAGE", "").strip().lower()
    if not raw:
        return None
    if raw not in ("read-only", "writable"):
        raise KVCachedConfigError(
            f"KVCACHED_ZERO_PAGE must be 'read-only' or 'writable', got {raw!r}"
        )
    return raw == "writable"
