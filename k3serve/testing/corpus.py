"""Text the tiny tokenizers are trained on: English, numbers, code and chat markup words."""

TINY_CORPUS = (
    """
The quick brown fox jumps over the lazy dog. The capital of France is Paris, and the capital
of Japan is Tokyo. What is the weather in Berlin today? It is sunny with a high of 21 degrees.
Question: what is 12 plus 30? Answer: 42. Question: what is 7 times 8? Answer: 56.
Let me think step by step. First, add the numbers. Then, check the result again.
The assistant called the calculator tool with the expression and returned the result.
The user asked for a unit conversion: 10 kilometers is 6.21 miles; 3 feet is 0.91 meters.
system user assistant tool message think response tools call argument name type string
number boolean object array index value result weather calculator convert location unit
def add(a, b):
    return a + b

class Request:
    def __init__(self, prompt, max_tokens=16):
        self.prompt = prompt
        self.max_tokens = max_tokens

for i in range(10):
    print(i, i * i)
import json, os, sys
data = json.loads('{"city": "Paris", "temp": 21.5, "ok": true, "tags": ["a", "b"]}')
if data["ok"] and len(data["tags"]) > 1:
    sys.exit(0)
Serving large language models is a systems problem: caches, batching, scheduling, kernels.
A recurrent state has a fixed size per request, while an attention cache grows with length.
Prefix caching must restore the exact state at a block boundary; speculative decoding must
roll it back when draft tokens are rejected. Tokens per second and time to first token are
the two numbers people ask about first. 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048 4096 65536
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May
June July August September October November December. Hello world! Good morning, friend.
你好世界。今天天气很好。 Bonjour le monde. Hola mundo. Guten Tag. Привет мир.
"""
    * 3
)
