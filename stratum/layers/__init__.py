"""Building blocks of the decoder: norms, rotary embeddings, linear kernels and paged attention."""
