"""The bundled demo model: synthetic K3-format conversations, its tokenizer, QAT training of a
tiny K3-architecture model and its DSpark draft (`k3serve train-demo`)."""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "model"


def bundled_demo() -> Path | None:
    """The trained demo checkpoint shipped in the package, if this install has it."""
    return DEMO_DIR if (DEMO_DIR / "config.json").is_file() else None


def default_model() -> Path:
    """What `k3serve serve` / `LLM()` use without a model: the demo, else the random tiny K3."""
    from k3serve.testing.builder import ensure_default_model

    return bundled_demo() or ensure_default_model()
