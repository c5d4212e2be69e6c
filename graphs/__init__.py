"""Forward context, per-KV-group metadata and the drop-in Attention layer (issue 4; not built yet)."""
