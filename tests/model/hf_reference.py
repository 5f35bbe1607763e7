"""Run transformers' native `kimi_linear` on a checkpoint dir with `fla` hidden (subprocess).

transformers prefers fla's Triton kernels whenever `fla` imports, which fails on CPU; hiding
it makes transformers use its pure-PyTorch fallbacks. Prints JSON: greedy tokens + logits.
"""

import json
import sys

sys.modules["fla"] = None  # must happen before transformers is imported

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main() -> None:
    path, ids, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    print(json.dumps({"logits": logits.tolist(), "tokens": out[0, len(ids) :].tolist()}))


if __name__ == "__main__":
    main()
