"""`k3serve run-batch` (issue 47 item 9): a 50-line OpenAI batch file of chat and completion
requests runs through the engine; the malformed line and the invalid request are reported in
their own output records and the other 48 answer, in input order, as the server would."""

from __future__ import annotations

import json

from k3serve.cli import main


def test_a_mixed_batch_with_bad_lines(tiny_k3_dir, tmp_path):
    lines = []
    for i in range(50):
        if i == 17:
            lines.append('{"custom_id": "broken", "url": "/v1/completions", "body": {')  # not JSON
        elif i == 31:  # a request the server refuses (400 naming the field)
            lines.append(
                json.dumps(
                    {
                        "custom_id": "bad-temp",
                        "method": "POST",
                        "url": "/v1/completions",
                        "body": {"prompt": "x", "max_tokens": 2, "temperature": -1},
                    }
                )
            )
        elif i % 2:
            lines.append(
                json.dumps(
                    {
                        "custom_id": f"chat-{i}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {
                            "messages": [{"role": "user", "content": f"Weather {i}?"}],
                            "max_tokens": 4,
                            "temperature": 0,
                        },
                    }
                )
            )
        else:
            lines.append(
                json.dumps(
                    {
                        "custom_id": f"cmpl-{i}",
                        "method": "POST",
                        "url": "/v1/completions",
                        "body": {"prompt": f"number {i}", "max_tokens": 3, "temperature": 0},
                    }
                )
            )
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert (
        main(
            [
                "run-batch",
                "-i",
                str(src),
                "-o",
                str(dst),
                str(tiny_k3_dir),
                "--cache-memory",
                "32MiB",
                "--max-model-len",
                "512",
                "--max-num-seqs",
                "8",
            ]
        )
        == 0
    )
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(out) == 50
    broken, bad = out[17], out[31]
    assert broken["response"] is None and "line 18: not JSON" in broken["error"]["message"]
    assert bad["custom_id"] == "bad-temp" and bad["response"]["status_code"] == 400
    assert "temperature" in bad["error"]["message"]
    ok = [r for i, r in enumerate(out) if i not in (17, 31)]
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in ok)
    for i, r in enumerate(out):
        if i in (17, 31):
            continue
        body = r["response"]["body"]
        assert r["custom_id"] == (f"chat-{i}" if i % 2 else f"cmpl-{i}")  # input order kept
        assert body["object"] == ("chat.completion" if i % 2 else "text_completion")
        assert body["usage"]["completion_tokens"] >= 1
