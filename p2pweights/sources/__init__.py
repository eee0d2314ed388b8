"""Where a checkpoint's bytes come from and what they are: formats, the manifest, the chunker, file and object-store readers, synthetic and packed checkpoints."""
