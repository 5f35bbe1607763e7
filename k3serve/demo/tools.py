"""Working implementations of the demo's three tools (`TOOLS` in data.py), for clients that run
the tool loop against the demo model: the behaviour tests and `examples`-style scripts.

`run_tool(name, arguments_json, rng)` returns the tool message content in the same form the
training conversations used: a JSON object for get_weather, a bare number for the others.
"""

from __future__ import annotations

import json
import random
import re

from k3serve.demo.data import UNITS, WEATHER

_EXPR = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")


def run_tool(name: str, arguments: str, rng: random.Random) -> str:
    """Execute one call. Raises ValueError naming the problem for an unknown tool or bad arguments."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: arguments are not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{name}: arguments must be a JSON object")
    if name == "get_weather":
        return json.dumps(
            {"city": _field(args, "city", str), "condition": rng.choice(WEATHER), "temp_c": rng.randint(-5, 35)}
        )
    if name == "calculator":
        m = _EXPR.match(_field(args, "expression", str))
        if not m:
            raise ValueError("calculator: expression must be 'INT OP INT' with OP one of + - *")
        a, op, b = int(m[1]), m[2], int(m[3])
        return str(a + b if op == "+" else a - b if op == "-" else a * b)
    if name == "unit_converter":
        value, src, dst = (
            _field(args, "value", (int, float)),
            _field(args, "from_unit", str),
            _field(args, "to_unit", str),
        )
        if (src, dst) not in UNITS:
            raise ValueError(f"unit_converter: cannot convert {src} to {dst}")
        return str(round(value * UNITS[(src, dst)], 2))
    raise ValueError(f"unknown tool {name!r}")


def _field(args: dict, key: str, kind):
    if key not in args:
        raise ValueError(f"missing argument {key!r}")
    if not isinstance(args[key], kind) or isinstance(args[key], bool):
        raise ValueError(f"argument {key!r} has the wrong type")
    return args[key]
