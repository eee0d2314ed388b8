"""Where verified bytes live on a host: the store and its bitfield, the copy on disk, the ring, the model and Hugging Face caches, the manifest catalog, the device buffer."""
