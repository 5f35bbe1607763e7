"""Structured outputs over HTTP: `response_format` (json_schema, json_object), vLLM's
`structured_outputs` and `guided_*` fields on chat and completions, through the official
`openai` client; the K3 response channel carries exactly the constrained JSON; bad specs and
conflicting fields are 400s naming the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "tags": {"type": "array", "items": {"enum": ["sun", "rain"]}, "maxItems": 2},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
MSGS = [{"role": "user", "content": "Plan a trip as JSON."}]
NO_THINK = {"chat_template_kwargs": {"thinking": False}}


def test_response_format_json_schema_through_the_openai_client(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    for seed in range(5):
        r = client.chat.completions.create(
            model="tiny-k3",
            messages=MSGS,
            response_format=fmt,
            max_tokens=300,
            temperature=1.0,
            seed=seed,
            extra_body=NO_THINK,
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)  # the channel holds exactly the JSON


def test_json_object_and_vllm_fields(client, live_server):
    base, _ = live_server
    r = client.chat.completions.create(
        model="tiny-k3",
        messages=MSGS,
        response_format={"type": "json_object"},
        max_tokens=300,
        temperature=1.0,
        seed=1,
        extra_body=NO_THINK,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    cases = [
        ({"structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}"}}, r"[0-9]{4}-[0-9]{2}"),
        ({"structured_outputs": {"choice": ["left", "right"]}}, "left|right"),
        ({"guided_choice": ["yes", "no"]}, "yes|no"),
        ({"guided_regex": "[a-c]{3}"}, "[a-c]{3}"),
        ({"guided_grammar": 'root ::= "x" [0-9]{1,3}'}, "x[0-9]{1,3}"),
    ]
    for extra, pattern in cases:
        comp = httpx.post(
            base + "/v1/completions", timeout=60, json={"prompt": "go", "max_tokens": 30, "temperature": 1.0, **extra}
        )
        assert comp.status_code == 200, comp.text
        assert re.fullmatch(pattern, comp.json()["choices"][0]["text"]), (extra, comp.json()["choices"][0]["text"])
        chat = httpx.post(
            base + "/v1/chat/completions",
            timeout=60,
            json={"messages": MSGS, "max_tokens": 30, "temperature": 1.0, **NO_THINK, **extra},
        )
        assert re.fullmatch(pattern, chat.json()["choices"][0]["message"]["content"]), extra
    # seeded, with room: the schema allows any whitespace, and a random model sampling at
    # temperature 1 unseeded could spend 200 tokens on it (seen once: a length-cut document)
    g = httpx.post(
        base + "/v1/completions",
        timeout=60,
        json={"prompt": "go", "max_tokens": 600, "guided_json": SCHEMA, "temperature": 1.0, "seed": 1},
    )
    assert g.json()["choices"][0]["finish_reason"] == "stop", g.json()
    jsonschema.validate(json.loads(g.json()["choices"][0]["text"]), SCHEMA)


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"guided_json": {"type": "nope"}}, "structured_outputs", "does not compile"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(live_server, body, param, says):
    base, _ = live_server
    r = httpx.post(base + "/v1/completions", timeout=60, json={"prompt": "go", "max_tokens": 5, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and says in err["message"], err
    assert "/project/" not in err["message"]  # xgrammar's source paths are stripped
