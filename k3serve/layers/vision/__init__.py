"""The MoonViT3d vision tower and its projector (k3-model-spec.md §9)."""
