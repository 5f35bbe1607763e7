"""vLLM's `--config FILE.yaml` for `k3serve serve`: the file's keys as command-line flags."""

from __future__ import annotations

import argparse
import json

from k3serve.server.flags import add_serve_args


def apply_config_file(argv: list[str]) -> list[str]:
    """vLLM's `--config FILE.yaml`: the file's keys become flags placed before the command
    line's own, so a flag given on the command line wins (argparse keeps the last value)."""
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    import yaml

    i = next(j for j, a in enumerate(argv) if a == "--config" or a.startswith("--config="))
    path = argv[i].split("=", 1)[1] if "=" in argv[i] else argv[i + 1]
    rest = argv[:i] + argv[i + (1 if "=" in argv[i] else 2) :]
    try:
        values = yaml.safe_load(open(path)) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read it: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: a YAML mapping of flag names to values is expected")
    p = argparse.ArgumentParser(add_help=False)
    add_serve_args(p)  # what each key's flag takes: a value, several, or none (a switch)
    flags = []
    for key, value in values.items():
        flags += _config_flag(path, str(key), value, p._option_string_actions)
    # the subcommand ("serve") and a MODEL right after it; the file's flags follow (a list's
    # values would swallow a MODEL after them), the command line's come last
    head = rest[:2] if len(rest) > 1 and not rest[1].startswith("-") else rest[:1]
    return head + flags + rest[len(head) :]


_YES, _NO = ("true", "yes", "on", "1"), ("false", "no", "off", "0", "")


def _config_flag(path: str, key: str, value, actions: dict) -> list[str]:
    """One --config entry as command-line words. A switch's false is said (`--no-X` where the
    flag has one): dropping it left `enable_prefix_caching: false` on. 0 and "" are values."""
    flag = "--" + key.replace("_", "-")
    action = actions.get(flag)  # None: not a serve flag (run-batch's own, or a typo): argparse judges it
    if value is None:
        return []  # YAML's null: the flag's default
    if action is not None and action.nargs == 0:  # a switch: store_true, or --X / --no-X
        return _config_switch(path, key, flag, value, actions)
    if isinstance(value, bool) and action is None:
        return [flag]  # argparse names the unknown flag (a typo's false used to vanish)
    if isinstance(value, bool):
        raise ValueError(f"--config {path}: {key} takes a value, not {str(value).lower()}")
    if isinstance(value, list) and action is not None and action.nargs in ("*", "+"):
        return [flag, *(str(v) for v in value)]
    return [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]


def _config_switch(path: str, key: str, flag: str, value, actions: dict) -> list[str]:
    on = value if isinstance(value, bool) else str(value).strip().lower()
    if on not in (True, False, *_YES, *_NO):
        raise ValueError(f"--config {path}: {key} is a switch: give true or false, not {value!r}")
    if on is True or on in _YES:
        return [flag]
    no = "--no-" + flag[2:]
    return [no] if no in actions else []  # a store_true flag's false is its default
