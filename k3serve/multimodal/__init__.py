"""Media input: decoding and preprocessing images for the vision tower (k3-model-spec.md §9)."""
