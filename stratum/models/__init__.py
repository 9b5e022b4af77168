"""Model definitions, weight loaders, tokenizers and chat templates."""
