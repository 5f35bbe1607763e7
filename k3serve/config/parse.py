"""Typed field access on raw config dicts; every failure names the field (`ConfigError`)."""

from __future__ import annotations

from typing import Any

_MISSING = object()


class ConfigError(ValueError):
    """A config.json field is missing, mistyped or inconsistent."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.reason = message
        super().__init__(f"config field '{field}': {message}")


class Fields:
    """Read typed values from one JSON object; `prefix` makes error names absolute."""

    def __init__(self, raw: Any, prefix: str):
        if not isinstance(raw, dict):
            raise ConfigError(prefix.rstrip(".") or "config.json", "must be a JSON object")
        self.raw = raw
        self.prefix = prefix

    def _get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key, _MISSING)
        if value is _MISSING or (value is None and default is not _MISSING):
            if default is _MISSING:
                raise ConfigError(self.prefix + key, "is required but missing")
            return default
        return value

    def int(self, key: str, default: Any = _MISSING, minimum: int | None = None) -> int:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(self.prefix + key, f"must be an integer, got {v!r}")
        if minimum is not None and v < minimum:
            raise ConfigError(self.prefix + key, f"must be >= {minimum}, got {v}")
        return v

    def opt_int(self, key: str, default: Any = None, minimum: int | None = None) -> int | None:
        if self.raw.get(key) is None:
            return default
        return self.int(key, minimum=minimum)

    def float(self, key: str, default: Any = _MISSING) -> float:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(self.prefix + key, f"must be a number, got {v!r}")
        return float(v)

    def opt_float(self, key: str, default: Any = None) -> float | None:
        if self.raw.get(key) is None:
            return default
        return self.float(key)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise ConfigError(self.prefix + key, f"must be true or false, got {v!r}")
        return v

    def choice(self, key: str, options: tuple[str, ...], default: Any = _MISSING) -> str:
        v = self._get(key, default)
        if v not in options:
            raise ConfigError(self.prefix + key, f"must be one of {list(options)}, got {v!r}")
        return v

    def obj(self, key: str) -> dict:
        v = self._get(key, _MISSING)
        if not isinstance(v, dict):
            raise ConfigError(self.prefix + key, "must be a JSON object")
        return v

    def int_list(self, key: str) -> list[int]:
        v = self._get(key, _MISSING)
        if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise ConfigError(self.prefix + key, f"must be a list of integers, got {v!r}")
        return v
